"""JSON Lines files (one record a line): the conversations of ``finetune --data chat.jsonl`` and
the preference pairs of ``finetune --dpo``, read alike, every error naming the file and line."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["json_lines"]


def json_lines(path, *, missing: str, holds: str):
    """``(n, where, record)`` for each non-blank line of the UTF-8 file ``path`` (``n``: its line number, from 1; ``where``:
    ``"NAME line N"``, for the caller's own errors about the record).

    Args:
        missing: the message of the :class:`FileNotFoundError` for a path that is not a file.
        holds: what one line holds (``{"messages": [...]}``), said after a line that is not JSON.

    Raises:
        FileNotFoundError: ``missing``. ValueError: not UTF-8 text; a line that is not JSON
            (``chat.jsonl line 3 is not JSON (Expecting value, column 1); each line holds ...``).
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(missing)
    try:
        lines = p.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{p} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{p.name} line {n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not JSON ({exc.msg}, column {exc.colno}); each line holds {holds}") from None
        yield n, where, record

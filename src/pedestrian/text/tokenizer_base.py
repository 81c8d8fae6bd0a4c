"""What both tokenizers share: the text they accept, the ids they decode, their file format.

Text must be Unicode: a lone surrogate (a code point U+D800 ... U+DFFF on its own, which is what
bytes that are not UTF-8 become when decoded with ``errors="surrogateescape"`` -- as Python does
for command-line arguments and file names) cannot be encoded as UTF-8. Both tokenizers refuse
it, in training and in ``encode``, with a :class:`LoneSurrogateError` that names its position
and the fix (:func:`check_text`).

Saved files are JSON objects ``{"kind": "char" | "bpe", "version": 1, ...}`` (:data:`FORMAT_VERSION`),
written atomically (:func:`pedestrian.atomic.write_file`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Union

import numpy as np

from ..atomic import write_file

PathLike = Union[str, "os.PathLike[str]"]
#: the version of the tokenizer file format
FORMAT_VERSION = 1


class LoneSurrogateError(ValueError):
    """Text holds a lone surrogate (U+D800 ... U+DFFF), which is not a Unicode character.

    Attributes:
        position: character index of the first one in the text that was checked.
        char: that character.
    """

    def __init__(self, message: str, position: int, char: str) -> None:
        super().__init__(message)
        self.position = position
        self.char = char


_SURROGATE = re.compile("[\ud800-\udfff]")


def find_lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate (U+D800 ... U+DFFF) in ``text``, or ``None``.

    A Python ``str`` never holds a valid surrogate pair (those are combined into one code
    point), so every surrogate in it stands alone.
    """
    m = _SURROGATE.search(text)
    return None if m is None else m.start()


def check_text(text: str, what: str = "the text", offset: int = 0) -> None:
    """Raise :class:`LoneSurrogateError` if ``text`` holds a lone surrogate.

    Args:
        text: the text. what: how to name it in the message (``"the prompt"``).
        offset: added to the reported character index (``text`` is a piece of a longer text).

    Raises:
        LoneSurrogateError (a ``ValueError``): the message names the code point, its character
            index and the fix.
    """
    i = find_lone_surrogate(text)
    if i is not None:
        c = text[i]
        raise LoneSurrogateError(
            f"{what} has a lone surrogate U+{ord(c):04X} at character {offset + i}: it is not a "
            "Unicode character (it is what bytes that are not UTF-8 become when decoded with "
            "errors='surrogateescape', e.g. a command-line argument or file in another encoding). "
            "Fix the source's encoding (save or pass it as UTF-8), or drop such characters, e.g. "
            "text.encode('utf-8', 'replace').decode('utf-8')", offset + i, c)


def check_ids(ids: Iterable[int] | np.ndarray, vocab_size: int) -> list[int]:
    """Validate token ids (1-D, integers, in range) and return them as a list of int."""
    arr = np.asarray(ids if not isinstance(ids, (str, bytes)) else [ids])
    if arr.size == 0:
        return []
    if arr.ndim != 1:
        raise ValueError(
            f"decode takes a 1-D sequence of token ids, got shape {arr.shape}; decode each row "
            "separately."
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"token id {int(arr[i])} at position {i} is outside the vocabulary "
            f"[0, {vocab_size}); were these ids made with a different tokenizer?"
        )
    return arr.astype(np.int64).tolist()


def read_json(path: PathLike, what: str) -> Any:
    """The parsed UTF-8 JSON file ``path`` (``what`` names it in messages).

    Raises:
        FileNotFoundError: no such file. ValueError: not UTF-8 JSON.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"{what} not found: {p} does not exist or is not a file.")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} {p} is not a valid UTF-8 JSON file: {e}") from None


def check_kind(d: Any, kind: str) -> None:
    """Raise ``ValueError`` unless ``d`` is a tokenizer dict of ``kind`` in :data:`FORMAT_VERSION`."""
    if not isinstance(d, dict):
        raise ValueError(f"tokenizer dict must be a dict, got {type(d).__name__}")
    if d.get("kind") != kind:
        raise ValueError(f'expected a tokenizer dict with "kind": "{kind}", got kind={d.get("kind")!r}')
    if d.get("version", FORMAT_VERSION) != FORMAT_VERSION:
        raise ValueError(
            f"tokenizer dict has version {d.get('version')!r}; this pedestrian reads version "
            f"{FORMAT_VERSION}. Upgrade pedestrian or re-save the tokenizer."
        )


def save_json(d: dict[str, Any], path: PathLike) -> None:
    """Write a tokenizer dict as UTF-8 JSON, atomically (``WriteError`` if the OS refuses)."""
    write_file(path, json.dumps(d, ensure_ascii=False, indent=1) + "\n", what="the tokenizer file")


class SavesJSON:
    """``save``, shared by the tokenizers: :meth:`to_dict` written as a file."""

    def save(self, path: PathLike) -> None:
        """Write :meth:`to_dict` as UTF-8 JSON to ``path``, atomically (parent folders are
        created); ``load`` reads it back.

        Raises:
            WriteError (an ``OSError``): the OS refused; an existing ``path`` is left as it was.
        """
        save_json(self.to_dict(), path)


def read_tokenizer_file(path: PathLike) -> tuple[dict, str]:
    """The JSON object of a tokenizer file -- or of a folder's ``tokenizer.json`` -- and the
    file's name for messages.

    Raises:
        FileNotFoundError: the path does not exist (or the folder has no ``tokenizer.json``).
        ValueError: not UTF-8 JSON, or not a JSON object.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            raise FileNotFoundError(f"folder {p} has no tokenizer.json; pass the tokenizer file itself.")
        p = p / "tokenizer.json"
    d = read_json(p, "tokenizer file")
    if not isinstance(d, dict):
        raise ValueError(f"{p} does not hold a JSON object, so it is not a tokenizer.")
    return d, str(p)

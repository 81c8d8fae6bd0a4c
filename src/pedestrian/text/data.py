"""The corpus: reading it (a file, a folder, the bundled one) and the train/validation split.

The pipeline is::

    text   = load_corpus(path)                      # str (a file, or a folder of *.txt)
    train, val = split_train_val(text, 0.1)         # last 10 % of the characters -> val
    tokens = encode_to_token_file(path, tokenizer)  # pedestrian.text.tokens: 1-D np.memmap, cached
    x, y   = TokenDataset(tokens).get_batch(rng, B, T)   # pedestrian.text.tokens: int64 (B, T) each

Corpus rules (shared by :func:`load_corpus`, :func:`iter_corpus_pieces`,
:func:`iter_train_pieces` and :func:`pedestrian.text.tokens.encode_to_token_file`):

- a *file* is read as strict UTF-8, byte for byte (no newline translation), except that a
  UTF-8 byte-order mark (``EF BB BF``) at the very start of a file is dropped, as Python's
  ``utf-8-sig`` codec does (per file: a folder of files saved by Windows Notepad gives no
  U+FEFF characters); a U+FEFF anywhere else is kept as text;
- a *folder* means all ``*.txt`` files directly inside it, sorted by file name, joined with
  a single ``"\\n"`` between consecutive files (sub-folders are not searched);
- a corpus with no text (no characters, or only whitespace) is an error.

The bundled corpus (:data:`BUNDLED_CORPUS`) is 42 Shakespeare plays and poems from Project
Gutenberg; it ships inside the package (``pedestrian/text/corpus/shakespeare``, with its
``PROVENANCE.md``), so a wheel install trains on it too.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Union

__all__ = [
    "BUNDLED_CORPUS",
    "CorpusError",
    "CorpusNotFoundError",
    "bundled_corpus",
    "corpus_files",
    "load_corpus",
    "iter_corpus_pieces",
    "iter_text_pieces",
    "iter_train_pieces",
    "corpus_digest",
    "split_train_val",
]

PathLike = Union[str, "os.PathLike[str]"]

#: The bundled Shakespeare corpus: package data, ``pedestrian/text/corpus/shakespeare`` beside this
#: file, in a source checkout and in an installed wheel alike.
BUNDLED_CORPUS: Path = Path(__file__).resolve().parent / "corpus" / "shakespeare"

_BOM = b"\xef\xbb\xbf"  # UTF-8 byte-order mark
_READ_BLOCK = 1 << 22  # bytes read from a file at a time (4 MiB)
_PIECE_CHARS = 1 << 18  # target characters per piece handed to the tokenizer (256 Ki)
# A piece may end only at a *single* "\n" between two non-whitespace characters. Byte-level BPE
# pre-tokenisation (GPT-2's pattern, and the Llama-3 style ones) always starts a new pre-token
# after such a newline, and the newline's own pre-token is the same whether or not the text ends
# there (which is not true after a run of whitespace: GPT-2's `\s+(?!\S)` would then merge it), so
# encoding piece by piece gives the same ids as encoding the whole.
_SAFE_CUT = re.compile(r"(?<=\S)\n(?=\S)")


class CorpusError(ValueError):
    """The corpus exists but cannot be used (empty, not UTF-8, folder without ``*.txt``)."""


class CorpusNotFoundError(FileNotFoundError):
    """The corpus path does not exist."""


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


def bundled_corpus() -> Path:
    """Return :data:`BUNDLED_CORPUS` after checking that it is there.

    Returns:
        Path to the folder ``pedestrian/text/corpus/shakespeare`` of the installed package.

    Raises:
        CorpusNotFoundError (a ``FileNotFoundError``): the folder is missing (a damaged install,
            or a build that left out the package data).
    """
    if not BUNDLED_CORPUS.is_dir():
        raise CorpusNotFoundError(_bundled_missing_message())
    return BUNDLED_CORPUS


def _bundled_missing_message() -> str:
    return (
        f"the bundled Shakespeare corpus is not at {BUNDLED_CORPUS}: the package was installed "
        "without its data (reinstall it: from a checkout `pip install .` or `pip install -e .`), "
        "or pass your own corpus (a UTF-8 .txt file or "
        "a folder of them) with --data PATH."
    )


def corpus_files(path: PathLike | None) -> tuple[Path, list[Path]]:
    """Resolve ``path`` (None = bundled) to (root, the files it stands for, in order).

    Raises:
        CorpusNotFoundError / CorpusError: as :func:`load_corpus` (a missing path, a folder
            without ``*.txt``).
    """
    if path is None:
        path = bundled_corpus()
    p = Path(path).expanduser()
    if not p.exists():
        if p.resolve() == BUNDLED_CORPUS:
            raise CorpusNotFoundError(_bundled_missing_message())
        raise CorpusNotFoundError(
            f"corpus not found: {p} does not exist. Pass a UTF-8 text file or a folder of "
            "*.txt files."
        )
    if p.is_dir():
        files = sorted((f for f in p.glob("*.txt") if f.is_file()), key=lambda f: f.name)
        if not files:
            raise CorpusError(
                f"corpus folder {p} contains no *.txt files (sub-folders are not searched). "
                "Put the training text in UTF-8 .txt files directly inside it, or pass a "
                "single file."
            )
        return p, files
    if not p.is_file():
        raise CorpusError(f"corpus path {p} is neither a regular file nor a folder.")
    return p, [p]


def _iter_file_text(file: Path) -> Iterator[str]:
    """Decode ``file`` as strict UTF-8 in blocks cut after a newline byte, without a leading
    byte-order mark.

    Cutting after ``b"\\n"`` never splits a multi-byte character, so each block decodes on its
    own and a decoding error can be reported with its absolute byte offset.
    """
    offset = 0  # absolute byte offset of ``pending[0]``
    pending = b""
    with open(file, "rb") as fh:
        head = fh.read(len(_BOM))
        if head == _BOM:
            offset = len(_BOM)
        else:
            pending = head
        while True:
            block = fh.read(_READ_BLOCK)
            data = pending + block
            if not block:
                cut = len(data)
            else:
                cut = data.rfind(b"\n") + 1
                if cut == 0:  # no newline yet: keep reading
                    pending = data
                    continue
            chunk, pending = data[:cut], data[cut:]
            try:
                text = chunk.decode("utf-8")
            except UnicodeDecodeError as e:
                bad = chunk[e.start : e.start + 4]
                raise CorpusError(
                    f"corpus file {file} is not valid UTF-8: byte offset {offset + e.start} "
                    f"(bytes {bad!r}): {e.reason}. Re-save the file as UTF-8 (e.g. "
                    f"`iconv -f LATIN1 -t UTF-8`) or remove it from the corpus."
                ) from None
            offset += cut
            if text:
                yield text
            if not block:
                return


def _iter_corpus_text(files: list[Path]) -> Iterator[str]:
    for i, f in enumerate(files):
        if i:
            yield "\n"
        yield from _iter_file_text(f)


def _cut_pieces(blocks: Iterator[str], piece_chars: int) -> Iterator[str]:
    """Re-chunk a stream of strings into pieces of at least ``piece_chars`` characters (but the
    last), each ending right after the first cut point (see ``_SAFE_CUT``) at or past that
    length. ``"".join(pieces) == "".join(blocks)``."""
    buf, start, scan = "", 0, 0  # buf[start:] is pending; no cut point in buf[start:scan]
    for block in blocks:
        buf = buf[start:] + block
        scan, start = max(scan - start, 0), 0
        while len(buf) - start >= piece_chars:
            m = _SAFE_CUT.search(buf, max(scan, start + piece_chars - 1))
            if m is None:  # no cut point yet: wait for the next block
                scan = max(len(buf) - 1, 0)
                break
            cut = m.start() + 1
            yield buf[start:cut]
            start = scan = cut
    if start < len(buf):
        yield buf[start:]


def iter_corpus_pieces(
    path: PathLike | None = None, piece_chars: int = _PIECE_CHARS
) -> Iterator[str]:
    """Stream a corpus as consecutive text pieces without holding all of it in memory.

    ``"".join(iter_corpus_pieces(path)) == load_corpus(path)``. Each piece but the last ends
    right after a single ``"\\n"`` standing between two non-whitespace characters, a point where
    byte-level BPE pre-tokenisation always cuts the text the same way whether or not the text
    ends there, so tokenising piece by piece gives the same ids as tokenising the whole. (A text
    without such newlines -- e.g. one with ``"\\r\\n"`` line ends -- comes as a single piece.)

    Args:
        path: a UTF-8 text file or a folder of ``*.txt`` files; ``None`` = :data:`BUNDLED_CORPUS`.
        piece_chars: minimum piece length in characters (except for the last piece); a piece
            ends at the first cut point at or after it.

    Yields:
        ``str`` pieces, in corpus order.

    Raises:
        CorpusNotFoundError: the path does not exist.
        CorpusError: folder without ``*.txt`` files, a file that is not UTF-8 (the message
            names the file and byte offset; raised when the iterator reaches it), or a corpus
            with no text.
    """
    if piece_chars < 1:
        raise ValueError(f"piece_chars must be >= 1, got {piece_chars}")
    root, files = corpus_files(path)
    has_text = False
    for piece in _cut_pieces(_iter_corpus_text(files), piece_chars):
        if not has_text and piece.strip():
            has_text = True
        yield piece
    if not has_text:
        what = f"file {root}" if root.is_file() else f"folder {root} ({len(files)} *.txt files)"
        raise CorpusError(
            f"corpus {what} contains no text (it is empty or only whitespace). Point --data "
            "at a non-empty UTF-8 text file or folder."
        )


def iter_text_pieces(text: str) -> Iterator[str]:
    """A text held in memory, cut into pieces where :func:`iter_corpus_pieces` cuts a corpus
    (``"".join(pieces) == text``)."""
    return _cut_pieces(iter([text]), _PIECE_CHARS)


def load_corpus(path: PathLike | None = None) -> str:
    """Read a corpus into one string.

    Args:
        path: a UTF-8 text file, or a folder whose ``*.txt`` files (directly inside it, sorted
            by name) are joined with ``"\\n"``. ``None`` loads :data:`BUNDLED_CORPUS`.

    Returns:
        The text, decoded as strict UTF-8 byte for byte (``"\\r\\n"`` is kept as is).

    Raises:
        CorpusNotFoundError (``FileNotFoundError``): the path does not exist (for the bundled
            corpus, the message explains how to get it).
        CorpusError (``ValueError``): a folder without ``*.txt`` files; a file that is not valid
            UTF-8 (names the file and the byte offset); a corpus with no text (empty or only
            whitespace).
    """
    return "".join(iter_corpus_pieces(path))


def iter_train_pieces(
    path: PathLike | None, val_fraction: float, piece_chars: int = _PIECE_CHARS
) -> Iterator[str]:
    """Stream the training part of a corpus: ``"".join(iter_train_pieces(path, f)) ==
    split_train_val(load_corpus(path), f)[0]``, without holding the corpus in memory.

    Two passes over the files: one counts the characters (to place the split), the other
    yields the pieces of :func:`iter_corpus_pieces` up to the split (the last one cut there).

    Raises:
        as :func:`iter_corpus_pieces` and :func:`split_train_val`.
    """
    n = sum(len(piece) for piece in iter_corpus_pieces(path, piece_chars))
    n_train = _split_point(n, val_fraction)
    seen = 0
    for piece in iter_corpus_pieces(path, piece_chars):
        if seen + len(piece) >= n_train:
            if n_train > seen:
                yield piece[: n_train - seen]
            return
        seen += len(piece)
        yield piece


def split_train_val(text: str, val_fraction: float = 0.1) -> tuple[str, str]:
    """Split a text deterministically into (train, validation) by characters.

    The *last* ``n_val = round(len(text) * val_fraction)`` characters are the validation text,
    everything before them the training text: ``train + val == text``. No shuffling, no
    randomness; for a folder corpus this means the last files (by name) are held out.

    Args:
        text: the whole corpus.
        val_fraction: fraction of characters held out, ``0 <= val_fraction < 1``. With 0 the
            validation text is ``""``.

    Returns:
        ``(train, val)``, two ``str``.

    Raises:
        ValueError: ``val_fraction`` outside ``[0, 1)``, or a text too short for both parts to
            be non-empty (when ``val_fraction > 0``).
    """
    cut = _split_point(len(text), val_fraction)
    return text[:cut], text[cut:]


def _split_point(n: int, val_fraction: float) -> int:
    """Characters in the training part of a text of ``n`` characters (see split_train_val)."""
    val_fraction = float(val_fraction)
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(
            f"val_fraction must be in [0, 1) (the fraction of characters held out for "
            f"validation), got {val_fraction}"
        )
    if val_fraction == 0.0:
        return n
    n_val = round(n * val_fraction)
    if n_val == 0 or n_val >= n:
        raise ValueError(
            f"text of {n} characters is too short to hold out val_fraction="
            f"{val_fraction}: one of train/validation would be empty. Use a longer corpus or "
            "val_fraction=0."
        )
    return n - n_val


def corpus_digest(path: PathLike | None = None) -> str:
    """A hex SHA-256 of a corpus's content: of each file's bytes, in corpus order (see
    :func:`load_corpus`), streamed in blocks. Two corpora with the same digest read as the same
    text; names, sizes and modification times play no part. This is the corpus part of the
    token-cache key of :func:`pedestrian.text.tokens.encode_to_token_file`.

    Raises:
        CorpusNotFoundError / CorpusError: as :func:`load_corpus` (a missing path, a folder
            without ``*.txt``).
    """
    _, files = corpus_files(path)
    h = hashlib.sha256()
    h.update(f"{len(files)} files\0".encode())
    for f in files:
        one = hashlib.sha256()
        size = 0
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(_READ_BLOCK), b""):
                one.update(block)
                size += len(block)
        h.update(f"{size}\0".encode())
        h.update(one.digest())
    return h.hexdigest()

"""Corpus loading, the train/validation split, token files and random training batches.

The pipeline is::

    text   = load_corpus(path)                      # str (a file, or a folder of *.txt)
    train, val = split_train_val(text, 0.1)         # last 10 % of the characters -> val
    tokens = encode_to_token_file(path, tokenizer)  # 1-D uint16/uint32 np.memmap, cached
    x, y   = TokenDataset(tokens).get_batch(rng, B, T)   # int64 (B, T) each, y = x shifted

Corpus rules (shared by :func:`load_corpus`, :func:`iter_corpus_pieces`,
:func:`iter_train_pieces` and :func:`encode_to_token_file`):

- a *file* is read as strict UTF-8, byte for byte (no newline translation), except that a
  UTF-8 byte-order mark (``EF BB BF``) at the very start of a file is dropped, as Python's
  ``utf-8-sig`` codec does (per file: a folder of files saved by Windows Notepad gives no
  U+FEFF characters); a U+FEFF anywhere else is kept as text;
- a *folder* means all ``*.txt`` files directly inside it, sorted by file name, joined with
  a single ``"\\n"`` between consecutive files (sub-folders are not searched);
- a corpus with no text (no characters, or only whitespace) is an error.

The bundled corpus (:data:`BUNDLED_CORPUS`) is 42 Shakespeare plays and poems from Project
Gutenberg; it ships inside the package (``pedestrian/corpus/shakespeare``, with its
``PROVENANCE.md``), so a wheel install trains on it too.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Union

import numpy as np

from .atomic import reporting, write_all, write_file

if TYPE_CHECKING:  # pragma: no cover
    from .tokenizer import Tokenizer

__all__ = [
    "BUNDLED_CORPUS",
    "CorpusError",
    "CorpusNotFoundError",
    "bundled_corpus",
    "load_corpus",
    "iter_corpus_pieces",
    "iter_train_pieces",
    "corpus_digest",
    "split_train_val",
    "default_cache_dir",
    "encode_to_token_file",
    "TokenDataset",
]

PathLike = Union[str, "os.PathLike[str]"]

#: The bundled Shakespeare corpus: package data, ``pedestrian/corpus/shakespeare`` beside this
#: file, in a source checkout and in an installed wheel alike.
BUNDLED_CORPUS: Path = Path(__file__).resolve().parent / "corpus" / "shakespeare"

_CACHE_FORMAT = 2  # bump when the token-file layout, the cache key or the corpus rules change
_BOM = b"\xef\xbb\xbf"  # UTF-8 byte-order mark
_READ_BLOCK = 1 << 22  # bytes read from a file at a time (4 MiB)
_PIECE_CHARS = 1 << 18  # target characters per piece handed to the tokenizer (256 Ki)
_PIECES_PER_BATCH = 8  # pieces encoded together (tokenizers runs a batch on all cores)
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
        Path to the folder ``pedestrian/corpus/shakespeare`` of the installed package.

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


def _corpus_files(path: PathLike | None) -> tuple[Path, list[Path]]:
    """Resolve ``path`` (None = bundled) to (root, the files it stands for, in order)."""
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
    root, files = _corpus_files(path)
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


# --------------------------------------------------------------------------------------------
# Token files
# --------------------------------------------------------------------------------------------


def corpus_digest(path: PathLike | None = None) -> str:
    """A hex SHA-256 of a corpus's content: of each file's bytes, in corpus order (see
    :func:`load_corpus`), streamed in blocks. Two corpora with the same digest read as the same
    text; names, sizes and modification times play no part. This is the corpus part of the
    token-cache key of :func:`encode_to_token_file`.

    Raises:
        CorpusNotFoundError / CorpusError: as :func:`load_corpus` (a missing path, a folder
            without ``*.txt``).
    """
    _, files = _corpus_files(path)
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


def default_cache_dir() -> Path:
    """The per-user cache folder for token files.

    ``$PEDESTRIAN_CACHE`` if set, else ``$XDG_CACHE_HOME/pedestrian``, else
    ``~/.cache/pedestrian``. Used when no ``cache_dir`` is given and the folder beside the
    corpus is not writable, or when the corpus is given as a string.
    """
    env = os.environ.get("PEDESTRIAN_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pedestrian"


def _writable_dir(d: Path) -> bool:
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".probe-"):
            pass
        return True
    except OSError:
        return False


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    blob = json.dumps(tokenizer.to_dict(), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def encode_to_token_file(
    text_or_path: str | os.PathLike[str],
    tokenizer: Tokenizer,
    cache_dir: PathLike | None = None,
) -> np.memmap:
    """Encode a corpus once into a flat ``.npy`` token file and memory-map it.

    The corpus is streamed piece by piece (see :func:`iter_corpus_pieces`) and the ids are
    written to disk as they come, then loaded with ``np.load(mmap_mode="r")``, so neither the
    text nor the ids have to fit in memory.

    Cache: the file name carries a hash of (the corpus content, the tokenizer's full JSON form,
    the format version). For a path the corpus part is :func:`corpus_digest`: the SHA-256 of
    every file's bytes, in corpus order -- the content, not the names, sizes or modification
    times, so an edit that keeps a file's size and time still re-encodes, and a corpus folder
    moved elsewhere (with its ``.pedestrian_cache``) keeps its cache (hashing reads the corpus once per call: about 5 ms for the bundled
    5.1 MB, files in the page cache). For a string it is the SHA-256 of its UTF-8 bytes. A second call with the same
    corpus and tokenizer opens the existing file without encoding; a changed tokenizer or an
    edited/added/removed corpus file gives a new key and re-encodes (stale files are left in
    place). The file is written atomically (:func:`pedestrian.atomic.write_file`), so an
    interrupted run never leaves a truncated cache file, and an OS error (no space, ...) is one
    :class:`~pedestrian.atomic.WriteError`.

    Where: ``cache_dir`` if given (created if needed); else ``.pedestrian_cache/`` beside the
    corpus (inside a corpus folder, or next to a corpus file); if that is not writable, or the
    corpus is a string, :func:`default_cache_dir`.

    Args:
        text_or_path: an ``os.PathLike`` (e.g. ``pathlib.Path``) to a corpus file or folder
            (rules as in :func:`load_corpus`), or a ``str`` holding the text itself. A plain
            ``str`` is always treated as text, never as a path -- wrap paths in ``Path``.
        tokenizer: a :class:`~pedestrian.tokenizer.CharTokenizer` or
            :class:`~pedestrian.tokenizer.BPETokenizer` (anything with ``encode``,
            ``vocab_size`` and ``to_dict``).
        cache_dir: explicit folder for the token file.

    Returns:
        Read-only ``np.memmap`` of shape ``(n_tokens,)``, dtype ``uint16`` if
        ``tokenizer.vocab_size <= 65536`` else ``uint32``. Its ``.filename`` is the cache file.

    Raises:
        CorpusNotFoundError / CorpusError: as :func:`load_corpus` (for a path); CorpusError for
            an empty or whitespace-only string.
        ValueError: from ``tokenizer.encode`` (e.g. a character the CharTokenizer does not know);
            ``LoneSurrogateError`` for a string holding a lone surrogate (names its index).
        WriteError (an ``OSError``): the cache file or folder cannot be written (no space, no
            permission, read-only, ...); nothing half-written is left.
    """
    vocab_size = int(tokenizer.vocab_size)
    dtype = _token_dtype(vocab_size)
    h = hashlib.sha256()
    h.update(f"pedestrian-tokens-v{_CACHE_FORMAT}\0{dtype.str}\0".encode())
    h.update(_tokenizer_fingerprint(tokenizer).encode())

    if isinstance(text_or_path, str):
        text = text_or_path
        if not text.strip():
            raise CorpusError(
                "the corpus text is empty or only whitespace; nothing to encode."
            )
        from .tokenizer import check_text

        check_text(text, "the corpus text")
        h.update(b"\0text\0")
        h.update(hashlib.sha256(text.encode("utf-8")).digest())
        stem = "text"
        beside = None
        pieces: Iterator[str] = _cut_pieces(iter([text]), _PIECE_CHARS)
    elif isinstance(text_or_path, os.PathLike):
        root, files = _corpus_files(text_or_path)
        h.update(b"\0files\0")
        h.update(corpus_digest(root).encode())
        stem = root.stem if root.is_file() else root.name
        beside = (root if root.is_dir() else root.parent) / ".pedestrian_cache"
        pieces = iter_corpus_pieces(root)
    else:
        raise TypeError(
            "text_or_path must be a str (the text itself) or an os.PathLike (a corpus file or "
            f"folder), got {type(text_or_path).__name__}"
        )

    kind = tokenizer.to_dict().get("kind", "tok")
    name = f"{stem or 'corpus'}-{kind}{vocab_size}-{h.hexdigest()[:20]}.tokens.npy"

    if cache_dir is not None:
        out_dir = Path(cache_dir).expanduser()
    elif beside is not None and _writable_dir(beside):
        out_dir = beside
    else:
        out_dir = default_cache_dir()
    with reporting(out_dir, "the token cache folder"):
        out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / name
    if target.is_file():
        return np.load(target, mmap_mode="r")

    _write_token_file(pieces, tokenizer, vocab_size, dtype, target)
    return np.load(target, mmap_mode="r")


def _batched(it: Iterator[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _encode_many(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """``[tokenizer.encode(t) for t in texts]``, in parallel when the tokenizer can."""
    many = getattr(tokenizer, "encode_batch", None)
    return many(texts) if many is not None else [tokenizer.encode(t) for t in texts]


def _write_token_file(
    pieces: Iterator[str], tokenizer: Tokenizer, vocab_size: int, dtype: np.dtype, target: Path
) -> None:
    """Encode ``pieces`` into ``target`` (.npy, 1-D ``dtype``), atomically.

    The ids go to a scratch file beside ``target`` as they come (their number, which the
    ``.npy`` header holds, is known only at the end); then header and ids are written to
    ``target`` by :func:`pedestrian.atomic.write_file`. Plain ``os.write`` calls throughout (not a
    memory map, whose writes to a full disk end the process with SIGBUS): a full disk is an
    ``OSError``, reported as a :class:`~pedestrian.atomic.WriteError`.
    """
    with reporting(target, "the token cache"):
        fd, raw_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.tmp-", suffix=".raw")
        try:
            n = 0
            try:
                for batch in _batched(pieces, _PIECES_PER_BATCH):
                    for ids_list in _encode_many(tokenizer, batch):
                        ids = np.asarray(ids_list, dtype=np.int64)
                        if ids.size == 0:
                            continue
                        lo, hi = int(ids.min()), int(ids.max())
                        if lo < 0 or hi >= vocab_size:
                            raise ValueError(
                                f"tokenizer produced id {hi if hi >= vocab_size else lo} outside "
                                f"[0, vocab_size={vocab_size}); the tokenizer is inconsistent."
                            )
                        write_all(fd, ids.astype(dtype).tobytes())
                        n += ids.size
            finally:
                os.close(fd)
            if n == 0:
                raise CorpusError("the corpus encoded to zero tokens; nothing to train on.")
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(
                header, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (n,)})

            def chunks() -> Iterator[bytes]:
                yield header.getvalue()
                with open(raw_name, "rb") as raw:
                    yield from iter(lambda: raw.read(_READ_BLOCK), b"")

            write_file(target, chunks(), what="the token cache")
        finally:
            try:
                os.unlink(raw_name)
            except OSError:
                pass


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


class TokenDataset:
    """Random next-token-prediction windows from a flat token stream.

    Args:
        tokens: 1-D array-like of non-negative integer ids (a ``np.memmap`` from
            :func:`encode_to_token_file` works without being read into memory: only the
            sampled windows are read).

    Raises:
        ValueError: ``tokens`` is not 1-D or not of an integer dtype.
    """

    def __init__(self, tokens: np.ndarray) -> None:
        arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(
                f"TokenDataset needs a 1-D token stream, got an array of shape {arr.shape}; "
                "flatten it first (e.g. tokens.reshape(-1))."
            )
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(
                f"TokenDataset needs integer token ids, got dtype {arr.dtype}."
            )
        self.tokens = arr

    def __len__(self) -> int:
        """Number of tokens in the stream."""
        return int(self.tokens.shape[0])

    def _check(self, batch_size: int, context_length: int) -> None:
        for name, v in (("batch_size", batch_size), ("context_length", context_length)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        n, need = len(self), int(context_length) + 1
        if n < need:
            raise ValueError(
                f"token stream too short: it has {n} tokens but one training window needs "
                f"context_length + 1 = {need}. Use a smaller context length or a longer "
                "corpus (or a smaller val_fraction, if this is the validation split)."
            )

    def get_batch(
        self, rng: np.random.Generator, batch_size: int, context_length: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Sample ``batch_size`` windows of ``context_length + 1`` consecutive tokens.

        Each window starts at an offset drawn uniformly (with replacement) from
        ``0 .. len(self) - context_length - 1`` with ``rng.integers``; ``x`` is its first
        ``context_length`` tokens and ``y`` its last ``context_length`` (the next-token
        targets: ``y[b, t] == tokens[start_b + t + 1] == x[b, t + 1]``).

        Args:
            rng: a ``np.random.Generator`` (same seed and state -> same batch).
            batch_size: B >= 1.
            context_length: T >= 1.

        Returns:
            ``(x, y)``: two C-contiguous ``int64`` arrays of shape ``(B, T)``.

        Raises:
            TypeError: ``rng`` is not a ``np.random.Generator``.
            ValueError: non-positive B or T, or fewer than T + 1 tokens (the message gives both
                numbers).
        """
        if not isinstance(rng, np.random.Generator):
            raise TypeError(
                "rng must be a numpy.random.Generator (e.g. np.random.default_rng(seed)), got "
                f"{type(rng).__name__}"
            )
        self._check(batch_size, context_length)
        T = int(context_length)
        starts = rng.integers(0, len(self) - T, size=int(batch_size))
        idx = starts[:, None] + np.arange(T + 1)
        windows = np.asarray(self.tokens[idx], dtype=np.int64)
        return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])

    def fixed_batches(
        self, seed: int, n_batches: int, batch_size: int, context_length: int
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """A deterministic list of batches, e.g. for a validation loss that is comparable
        across evaluations: ``n_batches`` calls of :meth:`get_batch` with
        ``np.random.default_rng(seed)``. Same arguments -> identical arrays.

        Returns:
            list of ``n_batches`` ``(x, y)`` pairs, each ``int64`` ``(B, T)``.

        Raises:
            ValueError: ``n_batches < 1``, or as :meth:`get_batch`.
        """
        if isinstance(n_batches, bool) or not isinstance(n_batches, (int, np.integer)) or n_batches < 1:
            raise ValueError(f"n_batches must be a positive integer, got {n_batches!r}")
        self._check(batch_size, context_length)
        rng = np.random.default_rng(seed)
        return [self.get_batch(rng, batch_size, context_length) for _ in range(int(n_batches))]

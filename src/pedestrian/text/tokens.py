"""A corpus as tokens: encoded once into a cached token file (a read-only ``np.memmap``), and
random training windows from it.

    tokens = encode_to_token_file(path, tokenizer)        # 1-D uint16/uint32 np.memmap, cached
    x, y   = TokenDataset(tokens).get_batch(rng, B, T)    # int64 (B, T) each, y = x shifted

The corpus is read by :mod:`pedestrian.text.data` (its rules: strict UTF-8, a folder's ``*.txt``
files joined with ``"\\n"``); this module only encodes what it yields.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..atomic import reporting, write_all, write_file
from .data import CorpusError, PathLike, corpus_digest, corpus_files, iter_corpus_pieces, iter_text_pieces
from .tokenizer_base import check_text

if TYPE_CHECKING:  # pragma: no cover
    from .tokenizer import Tokenizer

__all__ = ["default_cache_dir", "encode_to_token_file", "TokenDataset"]

_CACHE_FORMAT = 2  # bump when the token-file layout, the cache key or the corpus rules change
_COPY_BLOCK = 1 << 22  # bytes copied from the scratch file at a time (4 MiB)
_PIECES_PER_BATCH = 8  # pieces encoded together (tokenizers runs a batch on all cores)


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
        tokenizer: a :class:`~pedestrian.text.tokenizer.CharTokenizer` or
            :class:`~pedestrian.text.tokenizer.BPETokenizer` (anything with ``encode``,
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
        check_text(text, "the corpus text")
        h.update(b"\0text\0")
        h.update(hashlib.sha256(text.encode("utf-8")).digest())
        stem = "text"
        beside = None
        pieces: Iterator[str] = iter_text_pieces(text)
    elif isinstance(text_or_path, os.PathLike):
        root, files = corpus_files(text_or_path)
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
    # the default folder (no cache_dir given): say which variable moves it
    then = None if cache_dir is not None else \
        "run the command again (PEDESTRIAN_CACHE=FOLDER puts the token cache in another folder)"
    with reporting(out_dir, "the token cache folder", then=then):
        out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / name
    if target.is_file():
        return np.load(target, mmap_mode="r")

    _write_token_file(pieces, tokenizer, vocab_size, dtype, target, then)
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
    pieces: Iterator[str], tokenizer: Tokenizer, vocab_size: int, dtype: np.dtype, target: Path,
    then: str | None = None,
) -> None:
    """Encode ``pieces`` into ``target`` (.npy, 1-D ``dtype``), atomically.

    The ids go to a scratch file beside ``target`` as they come (their number, which the
    ``.npy`` header holds, is known only at the end); then header and ids are written to
    ``target`` by :func:`pedestrian.atomic.write_file`. Plain ``os.write`` calls throughout (not a
    memory map, whose writes to a full disk end the process with SIGBUS): a full disk is an
    ``OSError``, reported as a :class:`~pedestrian.atomic.WriteError`.
    """
    with reporting(target, "the token cache", then=then):
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
                    yield from iter(lambda: raw.read(_COPY_BLOCK), b"")

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

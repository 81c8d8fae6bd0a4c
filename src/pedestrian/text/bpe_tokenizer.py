"""Byte-level BPE (GPT-2 style): a thin wrapper around Hugging Face ``tokenizers``, which does
all the BPE work: a ``ByteLevel`` pre-tokenizer and decoder as in GPT-2, trained with
:meth:`BPETokenizer.train` or read from a ``tokenizer.json`` or a GPT-2 ``vocab.json`` +
``merges.txt`` pair.

This module reads no files of a corpus: :meth:`BPETokenizer.train` takes an iterable of texts
(stream a corpus into it with :func:`pedestrian.text.data.iter_corpus_pieces`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as _HFTokenizer

from .tokenizer_base import (FORMAT_VERSION, PathLike, SavesJSON, check_ids, check_kind, check_text,
                             read_tokenizer_file)



@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table used by byte-level BPE.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to ``chr(256 + k)`` in
    order (so the space ``0x20`` is ``"Ġ"`` and the newline ``0x0A`` is ``"Ċ"``). This is the
    table behind ``tokenizers.pre_tokenizers.ByteLevel``; a byte-level token's string is its
    bytes spelled with these characters.

    Returns:
        dict of 256 entries ``{byte value: one-character str}``.
    """
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


#: end-of-text tokens by family, in the order looked for: GPT-2 / SmolLM2 / Qwen2, Llama 2 and
#: Mistral, Llama 3, chat ends (``<|im_end|>``)
EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>")

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_scheme(tok: _HFTokenizer, source: str) -> str:
    """``"byte_level"`` (GPT-2, SmolLM2, Qwen2, Llama 3: a ``ByteLevel`` decoder) or
    ``"metaspace"`` (Llama 2, TinyLlama, Mistral: sentencepiece's ``▁`` for a space and
    ``<0xHH>`` byte-fallback tokens, a decoder with ``ByteFallback``); BPE models only.

    Raises:
        ValueError: another model or decoder (the message names it).
    """
    cfg = json.loads(tok.to_str())
    dec = cfg.get("decoder") or {}
    types = {dec.get("type")} | {d.get("type") for d in dec.get("decoders", []) or []}
    model = (cfg.get("model") or {}).get("type")
    if model != "BPE":
        raise ValueError(
            f"{source} uses a {model!r} model; BPETokenizer supports only BPE (model type 'BPE': "
            "byte-level as GPT-2, or sentencepiece-style with byte fallback as Llama 2)."
        )
    if "ByteLevel" in types:
        return "byte_level"
    if "ByteFallback" in types and ({"Metaspace", "Replace"} & types):
        return "metaspace"
    raise ValueError(
        f"{source} is neither a byte-level BPE tokenizer (its decoder is {dec.get('type')!r}, expected "
        "'ByteLevel' as in GPT-2) nor a sentencepiece-style one (a decoder with 'ByteFallback' and "
        "'Replace' or 'Metaspace', as in Llama 2). BPETokenizer supports only those two; train one "
        "with BPETokenizer.train."
    )


def _require_byte_level(tok: _HFTokenizer, source: str) -> None:
    _byte_scheme(tok, source)


class BPETokenizer(SavesJSON):
    """Byte-level BPE tokenizer (as GPT-2), a thin wrapper around a Hugging Face
    ``tokenizers.Tokenizer`` with a ``ByteLevel`` pre-tokenizer and decoder; or a
    sentencepiece-style BPE ``tokenizer.json`` with byte fallback (Llama 2, TinyLlama, Mistral),
    read as it is (:attr:`scheme` says which: ``"byte_level"`` or ``"metaspace"``).

    :meth:`save` writes pedestrian's tokenizer file; ``self.hf.save(path)`` writes a plain Hugging
    Face ``tokenizer.json`` instead (:meth:`load` reads both).

    Any text, in any script, encodes without unknown tokens (every byte has a token), and
    ``decode(encode(s)) == s``. Special tokens (e.g. ``"<|endoftext|>"``) written literally in
    the text are encoded as their single special id, as Hugging Face does.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` whose model is BPE and whose decoder is
            ``ByteLevel``.

    Raises:
        ValueError: ``tokenizer`` is not byte-level BPE.
    """

    kind = "bpe"

    def __init__(self, tokenizer: _HFTokenizer) -> None:
        if not isinstance(tokenizer, _HFTokenizer):
            raise TypeError(
                f"BPETokenizer wraps a tokenizers.Tokenizer, got {type(tokenizer).__name__}; use "
                "BPETokenizer.train / from_file / from_vocab_merges / load to build one."
            )
        self.scheme = _byte_scheme(tokenizer, "the tokenizer")
        ids = set(tokenizer.get_vocab(with_added_tokens=True).values())
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        if ids != set(range(n)):
            # ids must be 0 .. vocab_size - 1: a gap decodes to "" and pushes a real id out of range
            missing = sorted(set(range(max(ids, default=-1) + 1)) - ids)
            raise ValueError(
                f"the tokenizer's ids are not 0 .. {max(ids, default=-1)} without gaps: missing "
                f"{missing[:10]}{' ...' if len(missing) > 10 else ''}; pedestrian needs consecutive ids "
                "(renumber the vocabulary of the tokenizer file)")
        self.hf: _HFTokenizer = tokenizer
        self._bytes_cache: dict[int, bytes] = {}
        self._special = {
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        }

    # ---- construction ----------------------------------------------------------------------

    @staticmethod
    def _empty() -> _HFTokenizer:
        tok = _HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return tok

    @classmethod
    def train(
        cls,
        texts: str | Iterable[str],
        vocab_size: int,
        special_tokens: Sequence[str] = ("<|endoftext|>",),
        min_frequency: int = 2,
    ) -> BPETokenizer:
        """Train a byte-level BPE tokenizer with ``tokenizers.trainers.BpeTrainer``.

        The vocabulary is: the special tokens (ids ``0 .. len(special_tokens) - 1``), the 256
        single-byte tokens, then learned merges until ``vocab_size`` is reached (or no pair
        occurs ``min_frequency`` times -- a small text can give fewer ids; read
        :attr:`vocab_size` afterwards).

        Args:
            texts: one training text (a ``str``), or an iterable of texts consumed once, piece by
                piece, so a corpus never has to be in memory: e.g.
                ``pedestrian.text.data.iter_corpus_pieces(path)`` (whose pieces end where byte-level
                pre-tokenisation cuts anyway, so the result equals training on their join).
            vocab_size: target vocabulary size, ``>= 256 + len(special_tokens)``.
            special_tokens: tokens never split or merged, e.g. an end-of-text marker.
            min_frequency: a pair must occur this often to be merged.

        Returns:
            a trained :class:`BPETokenizer`.

        Raises:
            ValueError: ``vocab_size`` too small for the byte alphabet plus special tokens, or
                nothing to train on. LoneSurrogateError (a ``ValueError``): a text holds a lone
                surrogate (the message gives its character index in the joined texts).
            TypeError: a path (``os.PathLike``) or another non-``str`` item instead of text.
            Whatever the iterable raises (e.g. ``CorpusError`` from a corpus reader).
        """
        special_tokens = list(special_tokens)
        minimum = 256 + len(special_tokens)
        if int(vocab_size) < minimum:
            raise ValueError(
                f"vocab_size={vocab_size} is too small for byte-level BPE: the 256 byte tokens "
                f"plus {len(special_tokens)} special token(s) already need {minimum}."
            )
        if isinstance(texts, str):
            texts = [texts]
        elif isinstance(texts, os.PathLike):
            raise TypeError(
                f"BPETokenizer.train takes texts, not a path ({os.fspath(texts)!r}); stream a corpus "
                "file or folder with BPETokenizer.train(pedestrian.text.data.iter_corpus_pieces(path), ...)"
            )
        seen = [0]  # characters handed to the trainer so far

        def checked() -> Iterable[str]:
            for t in texts:
                if not isinstance(t, str):
                    raise TypeError(
                        f"BPETokenizer.train takes str texts, got {type(t).__name__}"
                        + ("; stream a path with pedestrian.text.data.iter_corpus_pieces(path)"
                           if isinstance(t, os.PathLike) else "")
                    )
                check_text(t, "the training text", offset=seen[0])
                seen[0] += len(t)
                yield t

        tok = cls._empty()
        trainer = trainers.BpeTrainer(
            vocab_size=int(vocab_size),
            min_frequency=int(min_frequency),
            special_tokens=special_tokens,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(checked(), trainer=trainer)
        if seen[0] == 0:
            raise ValueError("BPETokenizer.train got no training text.")
        return cls(tok)

    @classmethod
    def from_file(cls, path: PathLike) -> BPETokenizer:
        """Load a Hugging Face ``tokenizer.json`` (byte-level BPE, e.g. GPT-2's).

        Raises:
            FileNotFoundError: no such file. ValueError: unreadable, or not byte-level BPE.
        """
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer.json not found: {p} does not exist or is not a file.")
        try:
            tok = _HFTokenizer.from_file(str(p))
        except Exception as e:  # tokenizers raises a bare Exception on parse errors
            raise ValueError(f"{p} is not a valid Hugging Face tokenizer.json: {e}") from None
        _require_byte_level(tok, str(p))
        return cls(tok)

    @classmethod
    def from_vocab_merges(
        cls,
        vocab_json: PathLike,
        merges_txt: PathLike,
        special_tokens: Sequence[str] | None = None,
    ) -> BPETokenizer:
        """Build from GPT-2 style ``vocab.json`` (token -> id) and ``merges.txt`` files.

        Args:
            vocab_json: path to ``vocab.json``.
            merges_txt: path to ``merges.txt`` (one merge ``"a b"`` per line; a leading
                ``#version`` line is allowed).
            special_tokens: vocabulary entries to treat as special (never split, matched
                literally in text). Each must be in ``vocab.json``. ``None`` means
                ``"<|endoftext|>"`` if the vocabulary has it (GPT-2), else none.

        Raises:
            FileNotFoundError: a file is missing. ValueError: files that ``tokenizers`` cannot
                parse, or a special token absent from the vocabulary.
        """
        paths = [Path(vocab_json).expanduser(), Path(merges_txt).expanduser()]
        for p in paths:
            if not p.is_file():
                raise FileNotFoundError(f"BPE file not found: {p} does not exist or is not a file.")
        try:
            model = models.BPE.from_file(str(paths[0]), str(paths[1]))
        except Exception as e:
            raise ValueError(
                f"could not read a GPT-2 style BPE vocabulary from {paths[0]} and {paths[1]}: {e}"
            ) from None
        tok = _HFTokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        vocab = tok.get_vocab(with_added_tokens=False)
        if special_tokens is None:
            special_tokens = [t for t in ("<|endoftext|>",) if t in vocab]
        missing = [t for t in special_tokens if t not in vocab]
        if missing:
            raise ValueError(
                f"special token(s) {missing!r} are not in {paths[0]}; pass only tokens the "
                "vocabulary has."
            )
        if special_tokens:
            tok.add_special_tokens([AddedToken(t, special=True) for t in special_tokens])
        return cls(tok)

    # ---- use -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Encode text to ids (``list[int]``, each in ``[0, vocab_size)``). Never fails on
        unseen characters: byte-level BPE falls back to byte tokens (a sentencepiece-style
        file to its ``<0xHH>`` tokens, or its unknown token if it has none).

        ``add_special_tokens``: run the file's post-processor as ``tokenizers`` does (a Llama
        ``tokenizer.json`` puts ``<s>`` / ``<|begin_of_text|>`` in front, GPT-2's adds
        nothing); prompts are encoded so, corpus text without (``False``, the default).

        Raises:
            TypeError: ``text`` is not a ``str``.
            LoneSurrogateError (a ``ValueError``): ``text`` holds a lone surrogate, which has
                no UTF-8 bytes (the message names its position).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        try:
            return self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:                    # tokenizers' only word for a lone surrogate
            check_text(text)
            raise

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[self.encode(t) for t in texts]``, computed in parallel by ``tokenizers``.

        Raises:
            TypeError / LoneSurrogateError: as :meth:`encode` (the message says which text).
        """
        texts = list(texts)
        for t in texts:
            if not isinstance(t, str):
                raise TypeError(f"encode_batch takes str items, got {type(t).__name__}")
        fast = getattr(self.hf, "encode_batch_fast", None)  # tokenizers >= 0.20: no offsets
        try:
            enc = (fast or self.hf.encode_batch)(texts, add_special_tokens=False)
        except TypeError:
            for j, t in enumerate(texts):
                check_text(t, f"text {j} of the batch")
            raise
        return [e.ids for e in enc]

    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        """Decode ids to text. A byte sequence that is not valid UTF-8 (e.g. a cut-off
        character at the end) decodes to U+FFFD replacement characters, as Hugging Face does.

        Args:
            ids: 1-D sequence or array of integer ids.
            skip_special_tokens: leave special tokens out of the text.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``, non-integer ids, or a non-1-D array.
        """
        return self.hf.decode(
            check_ids(ids, self.vocab_size), skip_special_tokens=skip_special_tokens
        )

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (may be part of a UTF-8 character).

        Mirrors the ``ByteLevel`` decoder: each character of the token string is mapped back
        through :func:`bytes_to_unicode`; characters outside that table (e.g. in a special
        token) contribute their UTF-8 encoding. A sentencepiece-style file: ``▁`` is a space and
        ``<0xHH>`` the byte ``HH``, the rest its UTF-8 (the decoder's ``Strip`` of the text's one
        leading space is not applied: a stream of tokens keeps it).

        Raises:
            ValueError: ``token_id`` outside ``[0, vocab_size)``.
        """
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        i = check_ids([token_id], self.vocab_size)[0]
        s = self.hf.id_to_token(i)
        if s is None:
            raise ValueError(f"token id {i} has no token in this vocabulary (a gap in the ids).")
        if self.scheme == "metaspace":          # "▁" is a space, <0xHH> one byte (sentencepiece)
            m = _BYTE_TOKEN.match(s)
            self._bytes_cache[i] = bytes([int(m.group(1), 16)]) if m else s.replace("\u2581", " ").encode("utf-8")
            return self._bytes_cache[i]
        table = _unicode_to_bytes()
        out = bytearray()
        for c in s:
            b = table.get(c)
            if b is None:
                out += c.encode("utf-8")
            else:
                out.append(b)
        self._bytes_cache[i] = bytes(out)
        return self._bytes_cache[i]

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special token (e.g. ``<|endoftext|>``)."""
        return int(token_id) in self._special

    @property
    def special_tokens(self) -> dict[str, int]:
        """``{special token string: id}``."""
        return {self.hf.id_to_token(i): i for i in sorted(self._special)}

    # ---- persistence -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form: ``{"kind": "bpe", "version": 1, "tokenizer_json": str}``,
        the last being the Hugging Face ``tokenizer.json`` text."""
        return {"kind": "bpe", "version": FORMAT_VERSION, "tokenizer_json": self.hf.to_str()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BPETokenizer:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: wrong ``kind``/``version``, or ``tokenizer_json`` that does not parse.
        """
        check_kind(d, "bpe")
        s = d.get("tokenizer_json")
        if not isinstance(s, str):
            raise ValueError('bpe tokenizer dict needs a "tokenizer_json" string.')
        try:
            tok = _HFTokenizer.from_str(s)
        except Exception as e:
            raise ValueError(f"bpe tokenizer dict holds an invalid tokenizer_json: {e}") from None
        return cls(tok)

    @classmethod
    def load(cls, path: PathLike) -> BPETokenizer:
        """Read a file written by :meth:`save` (or a plain ``tokenizer.json``).

        Raises:
            FileNotFoundError: no such file. ValueError: not a BPE tokenizer file.
        """
        d, source = read_tokenizer_file(path)
        if d.get("kind") == "char":
            raise ValueError(f"{path} holds a CharTokenizer, not a BPETokenizer.")
        return cls.from_json(d, source)

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str = "the tokenizer dict") -> BPETokenizer:
        """From a dict of :meth:`to_dict` or a parsed plain Hugging Face ``tokenizer.json`` (a
        dict with a ``"model"`` key); ``source`` names it in messages.

        Raises:
            ValueError: neither of those (another ``kind``), not byte-level BPE, or malformed.
        """
        kind = d.get("kind")
        if kind == "bpe":
            return cls.from_dict(d)
        if kind is None and "model" in d:  # plain Hugging Face tokenizer.json
            try:
                tok = _HFTokenizer.from_str(json.dumps(d))
            except Exception as e:
                raise ValueError(f"{source} is not a valid Hugging Face tokenizer.json: {e}") from None
            _require_byte_level(tok, source)
            return cls(tok)
        raise ValueError(
            f'{source} is not a pedestrian tokenizer: expected "kind" to be "char" or "bpe" (or a '
            f'Hugging Face tokenizer.json with a "model"), got kind={kind!r}.'
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BPETokenizer) and self.hf.to_str() == other.hf.to_str()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"

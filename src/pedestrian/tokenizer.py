"""Tokenizers: a character-level one and byte-level BPE (GPT-2 style, via Hugging Face
``tokenizers``), a streaming decoder for generation, and saving/loading beside a checkpoint.

- :class:`~pedestrian.char_tokenizer.CharTokenizer` -- one id per Unicode code point seen in the
  training text.
- :class:`~pedestrian.bpe_tokenizer.BPETokenizer` -- byte-level BPE: ``ByteLevel`` pre-tokenizer
  and decoder as in GPT-2, trained with ``BPETokenizer.train`` or read from a ``tokenizer.json``
  or a GPT-2 ``vocab.json`` + ``merges.txt`` pair. All the BPE work is done by ``tokenizers``.
- :class:`StreamDecoder` -- turns generated ids into text one id at a time without ever
  emitting half a UTF-8 character.
- :func:`load_tokenizer` -- rebuilds either class from ``to_dict()`` output, a saved JSON file,
  or a plain Hugging Face ``tokenizer.json``.

Both classes share the interface ``encode(text) -> list[int]``, ``decode(ids) -> str``,
``vocab_size``, ``token_bytes(id) -> bytes``, ``to_dict()`` / ``from_dict()``, ``save(path)`` /
``load(path)``; what they share in code (the text they accept, the ids they decode, the file
format) is :mod:`pedestrian.tokenizer_base`. This module is where a reader imports them from.
"""

from __future__ import annotations

import codecs
import os
from typing import Any, Union

from .bpe_tokenizer import BPETokenizer, bytes_to_unicode
from .char_tokenizer import CharTokenizer, UnknownCharacterError
from .tokenizer_base import LoneSurrogateError, PathLike, check_text, find_lone_surrogate, read_tokenizer_file


__all__ = [
    "CharTokenizer",
    "BPETokenizer",
    "StreamDecoder",
    "Tokenizer",
    "UnknownCharacterError",
    "LoneSurrogateError",
    "find_lone_surrogate",
    "check_text",
    "load_tokenizer",
    "bytes_to_unicode",
]

Tokenizer = Union[CharTokenizer, BPETokenizer]


# --------------------------------------------------------------------------------------------
# Streaming decode
# --------------------------------------------------------------------------------------------


class StreamDecoder:
    """Incremental decoder for generation: feed ids one at a time, get text as soon as it is
    complete.

    A byte-level BPE token can end in the middle of a multi-byte UTF-8 character (an emoji or a
    CJK character is often split over two or more tokens). Such trailing bytes are held back
    until the character is complete, so :meth:`push` never returns a partial character or a
    U+FFFD replacement for one. Concatenating every :meth:`push` result and the final
    :meth:`flush` equals ``tokenizer.decode(all_ids)``. Byte sequences that can never become
    valid UTF-8 turn into U+FFFD, as in ``decode``.

    Args:
        tokenizer: a :class:`CharTokenizer` or :class:`BPETokenizer` (anything with
            ``token_bytes(id) -> bytes`` and ``is_special(id) -> bool``).
        skip_special_tokens: emit nothing for special tokens.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token id; return the text completed by it (possibly ``""``).

        Raises:
            ValueError: ``token_id`` outside the vocabulary.
        """
        token_id = int(token_id)
        data = self.tokenizer.token_bytes(token_id)
        if self.skip_special_tokens and self.tokenizer.is_special(token_id):
            return ""
        return self._decoder.decode(data, final=False)

    def flush(self) -> str:
        """End the stream: return any held-back bytes (an incomplete character becomes
        U+FFFD) and reset, so the decoder can be reused for a new stream."""
        out = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return out


def load_tokenizer(obj_or_path: Tokenizer | dict[str, Any] | PathLike) -> Tokenizer:
    """Rebuild a tokenizer from whatever was saved beside a checkpoint.

    Args:
        obj_or_path: one of
            - a :class:`CharTokenizer` / :class:`BPETokenizer` (returned as is);
            - a dict from ``to_dict()`` (``{"kind": "char" | "bpe", ...}``) or a parsed plain
              Hugging Face ``tokenizer.json`` (a dict with a ``"model"`` key);
            - a path to a JSON file holding either of those, or to a folder containing
              ``tokenizer.json``.

    Returns:
        a :class:`CharTokenizer` or :class:`BPETokenizer`.

    Raises:
        FileNotFoundError: the path does not exist (or the folder has no ``tokenizer.json``).
        ValueError: the JSON is not a tokenizer pedestrian knows (unknown ``kind``, not
            byte-level BPE, malformed).
        TypeError: ``obj_or_path`` is none of the above.
    """
    if isinstance(obj_or_path, (CharTokenizer, BPETokenizer)):
        return obj_or_path
    if isinstance(obj_or_path, (str, os.PathLike)):
        d, source = read_tokenizer_file(obj_or_path)
    elif isinstance(obj_or_path, dict):
        d, source = obj_or_path, "the tokenizer dict"
    else:
        raise TypeError(
            "load_tokenizer takes a tokenizer, a dict or a path, got "
            f"{type(obj_or_path).__name__}"
        )
    if d.get("kind") == "char":
        return CharTokenizer.from_dict(d)
    return BPETokenizer.from_json(d, source)

"""Tokenizers: a character-level one and byte-level BPE (GPT-2 style, via Hugging Face
``tokenizers``), a streaming decoder for generation, and saving/loading beside a checkpoint.

- :class:`~pedestrian.text.char_tokenizer.CharTokenizer` -- one id per Unicode code point seen in the
  training text.
- :class:`~pedestrian.text.bpe_tokenizer.BPETokenizer` -- byte-level BPE: ``ByteLevel`` pre-tokenizer
  and decoder as in GPT-2, trained with ``BPETokenizer.train`` or read from a ``tokenizer.json``
  or a GPT-2 ``vocab.json`` + ``merges.txt`` pair. All the BPE work is done by ``tokenizers``.
- :class:`StreamDecoder` -- turns generated ids into text one id at a time without ever
  emitting half a UTF-8 character; :class:`StopText` cuts that text before a stop string.
- :func:`load_tokenizer` -- rebuilds either class from ``to_dict()`` output, a saved JSON file,
  or a plain Hugging Face ``tokenizer.json``.

Both classes share the interface ``encode(text) -> list[int]``, ``decode(ids) -> str``,
``vocab_size``, ``token_bytes(id) -> bytes``, ``to_dict()`` / ``from_dict()``, ``save(path)`` /
``load(path)``; what they share in code (the text they accept, the ids they decode, the file
format) is :mod:`pedestrian.text.tokenizer_base`. This module is where a reader imports them from.
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
    "StopText",
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


class StopText:
    """The text of one generated row, cut right before the first stop string.

    Stop strings are matched on the decoded text, whatever its split into tokens: the text ends
    right before the stop string that is completed first, reading character by character (of
    two completed at the same character, the longer). Text is released as soon as it is
    decided: only the longest tail that is still the beginning of a stop string is held back,
    so a match always starts in the held tail or in the new text.

    Args:
        tokenizer: a Char/BPE tokenizer (decoded with :class:`StreamDecoder`,
            special tokens skipped).
        stops: non-empty stop strings (may be empty: then text passes straight through).
    """

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.decoder = StreamDecoder(tokenizer, skip_special_tokens=True)
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text now known to come before any stop string."""
        return self._feed(self.decoder.push(token_id), final=False)

    def finish(self) -> str:
        """End of generation: the rest of the text (up to a stop string found in it)."""
        return self._feed(self.decoder.flush(), final=True)

    def _feed(self, text: str, final: bool) -> str:
        if self.stopped:
            return ""
        pending = self.pending + text
        # the match that ends first (ties: the longest), as if the text came one character at a
        # time -- so the cut does not depend on how the text is split into tokens
        found = [(i + len(s), -len(s)) for s, i in ((s, pending.find(s)) for s in self.stops) if i >= 0]
        if found:
            end, minus_len = min(found)
            self.stopped, self.pending = True, ""
            return pending[:end + minus_len]
        held = 0 if final else self._held(pending)
        self.pending = pending[len(pending) - held:]
        return pending[:len(pending) - held]

    def _held(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best


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

"""The character-level tokenizer: one id per Unicode code point seen in the training text."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .tokenizer_base import FORMAT_VERSION, PathLike, SavesJSON, check_ids, check_kind, check_text, read_json


class UnknownCharacterError(ValueError):
    """Text holds characters that are not in a :class:`CharTokenizer`'s vocabulary.

    Attributes:
        unknown: ``{character: first position in the text}`` for every unknown character.
    """

    def __init__(self, message: str, unknown: dict[str, int]) -> None:
        super().__init__(message)
        self.unknown = unknown


class CharTokenizer(SavesJSON):
    """Character-level tokenizer: id ``i`` is the ``i``-th character of :attr:`chars`.

    The vocabulary is fixed when the tokenizer is built (:meth:`from_text` takes the sorted set
    of characters -- Unicode code points -- of the *training text*). Text with a character
    outside it cannot be encoded: :meth:`encode` raises :class:`UnknownCharacterError` naming
    each such character and its first position, unless ``unknown="skip"``.

    Args:
        chars: the vocabulary, in id order; each item a single character, no duplicates.

    Raises:
        ValueError: an item that is not exactly one character, a duplicate, or an empty list.
    """

    kind = "char"

    def __init__(self, chars: Sequence[str]) -> None:
        chars = list(chars)
        if not chars:
            raise ValueError("CharTokenizer needs at least one character in its vocabulary.")
        for i, c in enumerate(chars):
            if not isinstance(c, str) or len(c) != 1:
                raise ValueError(
                    f"CharTokenizer vocabulary item {i} must be a single character, got {c!r}"
                )
        if len(set(chars)) != len(chars):
            dup = sorted({c for c in chars if chars.count(c) > 1})
            raise ValueError(f"CharTokenizer vocabulary has duplicate characters: {dup!r}")
        check_text("".join(chars), "the CharTokenizer vocabulary")
        self.chars: list[str] = chars
        self._stoi: dict[str, int] = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Build the vocabulary from a training text: its distinct characters, sorted by code
        point.

        Raises:
            ValueError: ``text`` is empty.
            LoneSurrogateError (a ``ValueError``): ``text`` holds a lone surrogate.
        """
        if not text:
            raise ValueError("cannot build a CharTokenizer from an empty text.")
        check_text(text, "the training text")
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        """Number of ids (the number of distinct characters)."""
        return len(self.chars)

    def encode(self, text: str, unknown: str = "error") -> list[int]:
        """Map each character of ``text`` to its id.

        Args:
            text: the string to encode.
            unknown: ``"error"`` (default) raises on characters outside the vocabulary;
                ``"skip"`` drops them.

        Returns:
            ``list[int]``, one id per (known) character, each in ``[0, vocab_size)``.

        Raises:
            UnknownCharacterError (a ``ValueError``): with ``unknown="error"``, text contains
                characters the training text did not; the message lists them (``repr`` and
                ``U+XXXX``) with their first positions.
            LoneSurrogateError (a ``ValueError``): ``text`` holds a lone surrogate (whatever
                ``unknown`` says: it is not a character at all).
            ValueError: ``unknown`` is neither ``"error"`` nor ``"skip"``.
        """
        if unknown not in ("error", "skip"):
            raise ValueError(f'unknown must be "error" or "skip", got {unknown!r}')
        stoi = self._stoi
        try:
            return [stoi[c] for c in text]
        except KeyError:
            pass
        check_text(text)                         # the vocabulary never holds a surrogate
        if unknown == "skip":
            return [stoi[c] for c in text if c in stoi]
        missing: dict[str, int] = {}
        for i, c in enumerate(text):
            if c not in stoi and c not in missing:
                missing[c] = i
        shown = ", ".join(f"{c!r} (U+{ord(c):04X}) at position {i}" for c, i in list(missing.items())[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise UnknownCharacterError(
            f"{len(missing)} character(s) not in the CharTokenizer vocabulary: {shown}{more}. "
            f"The vocabulary ({self.vocab_size} characters) was built from the training text, so "
            "it can only encode characters that occur there. Rebuild the tokenizer from a text "
            'that contains them, or pass unknown="skip" to drop them.',
            missing,
        )

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Map ids back to text: ``decode(encode(s)) == s`` for any encodable ``s``.

        Args:
            ids: 1-D sequence or array of integer ids.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``, non-integer ids, or a non-1-D array.
        """
        chars = self.chars
        return "".join(chars[i] for i in check_ids(ids, self.vocab_size))

    def token_bytes(self, token_id: int) -> bytes:
        """UTF-8 bytes of one token (used by :class:`StreamDecoder`)."""
        return self.chars[check_ids([token_id], self.vocab_size)[0]].encode("utf-8")

    def is_special(self, token_id: int) -> bool:
        """Always ``False``: a CharTokenizer has no special tokens."""
        return False

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form: ``{"kind": "char", "version": 1, "chars": [...]}``."""
        return {"kind": "char", "version": FORMAT_VERSION, "chars": list(self.chars)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CharTokenizer:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: ``d`` is not a char-tokenizer dict (wrong ``kind``, missing ``chars``,
                or an unsupported ``version``).
        """
        check_kind(d, "char")
        if not isinstance(d.get("chars"), list):
            raise ValueError('char tokenizer dict needs a "chars" list of single characters.')
        return cls(d["chars"])

    @classmethod
    def load(cls, path: PathLike) -> CharTokenizer:
        """Read a file written by :meth:`save`.

        Raises:
            FileNotFoundError: no such file. ValueError: not JSON, or not a char tokenizer.
        """
        return cls.from_dict(read_json(path, "tokenizer file"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and self.chars == other.chars

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"

"""The KV cache (paper section 3, side note; EQUATIONS.md "KV cache").

The keys and values of a token never change once computed -- each is a per-token fully connected
map of that token's input to the block. During generation a :class:`KVCache` keeps, per block
and key/value head, the ``k`` and ``v`` rows of every token seen so far in arrays preallocated to
the context length::

    cache.keys[i]   (B, n_kv_heads, context_length, d_qk)      block i
    cache.values[i] (B, n_kv_heads, context_length, d_head)

With grouped-query attention (``n_kv_heads < n_heads``, EQUATIONS.md "Grouped-query attention")
the cache holds only the ``n_kv_heads`` heads the queries share: ``n_heads / n_kv_heads`` times
less memory than multi-head attention of the same width.

``model.forward(new_tokens, kv_cache=cache)`` runs the same layer forwards as training; each
block's attention writes the new tokens' keys and values at ``cache.length …`` and takes one
softmax row per new token against every cached key: O(current length) work per token instead of
the O(length²) of a full forward pass. Its logits equal those of a full forward pass over the
same prefix (tested to 1e-10 relative in float64).

Rows of different lengths (a batch of prompts) are left-padded: ``key_start[b]`` is the first
real token of row ``b``; no query attends to the padding, and row ``b``'s positions count from
its first real token, so each row computes what it would compute alone.

Position encodings (``config.position_encoding``): the cache stores keys as the attention saw
them, so with RoPE they are stored *rotated* by their own position (the rotation runs between
the qkv projection and the attention, before the attention writes the cache). When the cache is
full, a ``"rope"`` or ``"none"`` model may :meth:`KVCache.drop_oldest` entries and go on: the
kept keys stay valid because RoPE scores depend only on the offset between query and key
(``"none"``: on nothing positional at all), and the positions of new tokens keep counting up
(``offset``). A ``"learned"`` model cannot: its positions are absolute indices into a table of
``context_length`` rows, so past the context the cache is rebuilt from scratch
(:mod:`pedestrian.generation.generate`).

Sliding-window blocks (``config.window(i) = w < context_length``; Mistral, Gemma 2's local
layers) keep only what their queries can still see: a ring of ``w`` slots, the token of cache
index ``p`` in slot ``(dropped + p) mod w``, overwritten as new tokens come (each step gathers the
last ``w − 1`` cached keys in order beside the new ones, :func:`pedestrian.layers.attention`'s
``_ring_step``). Such a block holds ``w / context_length`` of a full block's memory, whatever the
length generated (:attr:`KVCache.nbytes`; docs/guide.md, "Sliding window").
"""

from __future__ import annotations

import numbers

import numpy as np

from ..backend import asarray_like
from ..layers.attention import KVBlock

__all__ = ["KVCache", "KVBlock"]


class KVCache:
    """Keys and values of every token seen so far, per block and key/value head, for ``B`` sequences.

    Args:
        model: a causal :class:`~pedestrian.model.GPT` (the cache takes its dtype and backend).
        batch_size: ``B``, the number of sequences generated together.
        key_start: optional ``(B,)`` ints: the number of left-padding tokens of each row (its
            first real token); ``None`` when no row is padded.

    Attributes:
        keys: list over blocks of ``(B, n_kv_heads, context_length, d_qk)`` arrays (a
            sliding-window block: ``(B, n_kv_heads, w, d_qk)``, a ring, module docstring).
        values: list over blocks of ``(B, n_kv_heads, context_length, d_head)`` arrays (ring: ``w``).
        windows: per block, ``w`` when its arrays are a ring of ``w`` slots, else ``None``.
        dropped: tokens forgotten by :meth:`drop_oldest` since the last :meth:`reset`.
        n_kv_heads: the config's ``n_kv_heads`` (``n_heads`` when it has none or ``None``).
        length: number of tokens (padding included) cached so far.
        context_length: capacity (the model's ``context_length``).
        offset: position of the token in cache slot 0 (before left padding is subtracted):
            the number of tokens dropped by :meth:`drop_oldest`, plus the ``first_position``
            given to :meth:`reset`. ``0`` for a new cache.

    Memory (:attr:`nbytes`): ``B · n_blocks · n_kv_heads · context_length · (d_qk + d_head)``
    numbers, i.e. ``2 · n_blocks · context_length · d_model · n_kv_heads / n_heads`` per sequence
    when ``d_qk = d_head = d/n_heads`` (EQUATIONS.md). Allocated once, here.

    Raises:
        ValueError: a non-causal model (a token's keys would depend on later tokens, so nothing
            can be cached -- use ``generate(..., use_cache=False)``), ``batch_size < 1``, or a
            ``key_start`` of the wrong shape.
    """

    def __init__(self, model, batch_size: int = 1, key_start=None) -> None:
        c = model.config
        if not c.causal:
            raise ValueError("a KV cache needs a causal model (config.causal=True): in a "
                             "bidirectional model earlier tokens' keys change when a token is "
                             "added; generate with use_cache=False instead")
        if not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        xp = model.xp
        self.model = model
        self.batch_size = int(batch_size)
        self.context_length = c.context_length
        dev = model.device                                 # None: the backend's default (the CPU)
        self.n_kv_heads = n_kv = getattr(c, "n_kv_heads", None) or c.n_heads
        #: per block: its sliding window when its arrays are a ring of that many slots, else ``None``
        window = getattr(c, "window", lambda i: None)      # (a config without the field: no window)
        self.windows = [w if w is not None and w < c.context_length else None
                        for w in (window(i) for i in range(c.n_blocks))]
        slots = [c.context_length if w is None else w for w in self.windows]
        self.keys = [xp.zeros((batch_size, n_kv, n, c.d_qk), dtype=model.dtype, device=dev) for n in slots]
        self.values = [xp.zeros((batch_size, n_kv, n, c.d_head), dtype=model.dtype, device=dev) for n in slots]
        self.reset(key_start)

    def reset(self, key_start=None, *, first_position: int = 0) -> None:
        """Forget every cached token (the arrays are kept and overwritten; no allocation).

        Args:
            key_start: as in the constructor.
            first_position: position index of the next token fed (``offset``). RoPE and
                ``none`` models may start anywhere (a RoPE model's logits do not change: its
                scores depend on offsets only; a test); a learned table needs
                ``first_position + length <= context_length`` (checked by the model's forward).

        Raises:
            ValueError: ``key_start`` of the wrong shape or negative; ``first_position < 0``.
        """
        if not isinstance(first_position, numbers.Integral) or first_position < 0:
            raise ValueError(f"first_position must be an integer >= 0, got {first_position!r}")
        self.length = self.dropped = 0
        self.offset = self._first = int(first_position)
        self.key_start = self._pad = self._pad_host = None
        if key_start is not None:
            start = np.asarray(key_start, dtype=np.int64)
            if start.shape != (self.batch_size,) or start.min() < 0:
                raise ValueError(f"key_start must hold {self.batch_size} counts >= 0, got {key_start!r}")
            if start.any():
                self._pad_host = start                     # (known here: no device read to update it)
                self.key_start = self._pad = asarray_like(start, self.keys[0])

    def drop_oldest(self, n: int) -> None:
        """Forget the ``n`` oldest cached tokens and keep the others (RoPE and ``none`` models).

        The kept keys and values move to the front of the arrays (``O(length · d)`` copying,
        no recomputation); the next tokens' positions keep counting from where they were
        (``offset`` grows by ``n``). A kept token's key and value are those it got when it was
        computed, with every earlier token (dropped ones included) in its context -- a sliding
        window over the keys, as in Mistral's rolling-buffer cache, not a recompute of the
        window from scratch (module docstring; :mod:`pedestrian.generation.generate`).

        Raises:
            ValueError: a learned-position model (its positions are absolute indices into a
                table of ``context_length`` rows: rebuild the cache instead), or ``n`` not in
                ``[0, length]``.
        """
        if self.model.config.learned_positions:
            raise ValueError("a model with learned positions cannot drop cached tokens (its positions "
                             "are absolute); reset the cache and feed the last tokens again")
        if not isinstance(n, numbers.Integral) or not 0 <= n <= self.length:
            raise ValueError(f"can drop 0 to length={self.length} cached tokens, got {n!r}")
        n, L = int(n), self.length
        if n == 0:
            return
        xp = self.model.xp
        for arrays in (self.keys, self.values):
            for a, window in zip(arrays, self.windows):
                if window is None:                 # (a ring stays: its slots count from `dropped`)
                    a[:, :, :L - n, :] = xp.asarray(a[:, :, n:L, :], copy=True)   # overlapping ranges
        self.length = L - n
        self.offset += n
        self.dropped += n
        if self._pad_host is not None:             # padding slots that are left, per row
            start = np.clip(self._pad_host - (self.offset - self._first), 0, None)
            self.key_start = asarray_like(start, self.keys[0]) if start.any() else None

    @property
    def nbytes(self) -> int:
        """Bytes held by the keys and values of every block (the whole capacity, used or not; a
        sliding-window block's ring of ``w`` slots)."""
        return sum(int(a.nbytes) for a in (*self.keys, *self.values))      # (NumPy arrays and torch tensors)

    def block(self, i: int) -> KVBlock:
        """Block ``i``'s arrays and the current length, as the attention layers take them."""
        return KVBlock(self.keys[i], self.values[i], self.length, self.key_start, self.windows[i], self.dropped)

    def positions(self, T: int):
        """Position index of ``T`` new tokens: ``offset + length + t``, counted from each row's
        first real token (``(T,)``, or ``(B, T)`` with left padding; padding gets position 0)."""
        xp, first = self.model.xp, self.offset + self.length
        pos = (np.arange(first, first + T) if self.model.backend == "numpy"     # 0.3 vs 1.2 µs
               else xp.arange(first, first + T, device=self.model.device))
        if self._pad is None:
            return pos
        return xp.clip(pos[None, :] - self._pad[:, None], 0, None)

    def __repr__(self) -> str:
        return (f"KVCache(batch_size={self.batch_size}, length={self.length}, offset={self.offset}, "
                f"context_length={self.context_length}, n_blocks={len(self.keys)})")

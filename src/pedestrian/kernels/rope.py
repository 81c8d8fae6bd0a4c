"""Fast RoPE (reference: :mod:`pedestrian.layers.rope`): the angles looked up in a table.

The angles ``cos(t·θ_j)``, ``sin(t·θ_j)`` of positions ``0 … n−1`` are computed once per
``(r, base, scaling, dtype)`` by the reference's own :func:`~pedestrian.layers.rope.rope_angles`
and kept, read-only, in a table that doubles when a later position needs it; a call looks its
positions up (the same numbers: ``cos`` and ``sin`` of the same float64 angles). The reference
recomputes them in every block for every token: a third of RoPE's time in a decoding step
(docs/performance.md, "Llama family at SmolLM2-135M's shape"). The turn itself, and the
backward (the cache is the reference's), are the reference's: written in place into one array,
the turn measured no faster (docs/kernels.md).

Threads: the tables are shared and never written; a larger one replaces a smaller one whole.
"""

from __future__ import annotations

import numpy as np

from ..layers.rope import _rotate, rope_angles, rope_backward

__all__ = ["rope_forward", "rope_backward"]

#: ``(r, base, scaling, dtype) -> (cos, sin)``, each ``(n, 1, r/2)`` for positions ``0 … n−1``
_TABLES: dict = {}
#: the first table's length (positions); it doubles as far as a position asks
_FIRST_LENGTH = 1024


def _angles(positions, r: int, base: float, scaling, dtype):
    """``(cos, sin)`` of :func:`~pedestrian.layers.rope.rope_angles` for ``positions`` ``(T,)``
    or ``(B, T)``, from the table (made or grown here)."""
    key = (r, float(base), scaling, dtype)
    table = _TABLES.get(key)
    lo, hi = (int(positions.min()), int(positions.max())) if positions.size else (0, 0)
    if lo < 0:                                               # (no table row: computed as the reference does)
        return rope_angles(positions, r, base, np.empty(0, dtype), scaling)
    if table is None or hi >= table[0].shape[0]:
        n = max(_FIRST_LENGTH, 1 << hi.bit_length())
        table = rope_angles(np.arange(n), r, base, np.empty(0, dtype), scaling)   # (n, 1, r/2) each
        for a in table:
            a.flags.writeable = False
        _TABLES[key] = table
    return table[0][positions], table[1][positions]


def rope_forward(qkv, n_heads: int, d_qk: int, positions=None, *, base: float = 10_000.0,
                 rotated: int | None = None, n_kv_heads: int | None = None, scaling=None):
    """Rotate every head's queries and keys by their token's position (RoPE, GPT-NeoX pairing;
    EQUATIONS.md "RoPE").

    Fast :func:`pedestrian.layers.rope.rope_forward` (same arguments, results and cache; the
    angles from a table, see the module docstring)."""
    r = d_qk - d_qk % 2 if rotated is None else rotated
    if r % 2 or not 2 <= r <= d_qk:
        raise ValueError(f"RoPE rotates an even number 2 <= r <= d_qk={d_qk} of dimensions, got r={r}")
    pos = np.arange(qkv.shape[1]) if positions is None else np.asarray(positions)
    cos, sin = _angles(pos, r, base, scaling, qkv.dtype)                         # (…, T, 1, r/2)
    n_qk = n_heads + (n_heads if n_kv_heads is None else n_kv_heads)             # q heads, then k heads
    return _rotate(qkv, n_qk, d_qk, r, cos, sin), (cos, sin, n_qk, d_qk, r)

"""Fast RoPE (reference: :mod:`pedestrian.layers.rope`): the angles looked up in a table.

The angles ``cos(t·θ_j)``, ``sin(t·θ_j)`` of positions ``0 … n−1`` are computed once per
``(r, base, scaling, dtype)`` by the reference's own :func:`~pedestrian.layers.rope.rope_angles`
and kept, read-only, in a table that doubles when a later position needs it; a call looks its
positions up (the same numbers: ``cos`` and ``sin`` of the same float64 angles). The reference
recomputes them in every block for every token: a third of RoPE's time in a decoding step
(docs/performance.md, "Llama family at SmolLM2-135M's shape"). The turn is one numba loop
over the rows (:func:`_turn`) with the reference's products and sums in its order and no
fast-math flag (``exact``): the reference's bits, in one call where the reference makes about
fifteen small NumPy ones (at one token per step their cost is what RoPE costs).

Threads: the tables are shared and never written; a larger one replaces a smaller one whole.
"""

from __future__ import annotations

import numpy as np

from ..layers.rope import rope_angles
from .jit import kernel, prange
from .workspace import empty_array

__all__ = ["rope_forward", "rope_backward", "angle_rows", "turn_rows"]

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


@kernel(parallel=True, exact=True)
def _turn(x, cos, sin, n_qk, d_qk, r, y):
    """Per row ``i`` of ``x`` ``(N, width)``: ``y = x``, then in each of the ``n_qk`` q and k heads
    ``y_j = x_j cos_j − x_{j+r/2} sin_j``, ``y_{j+r/2} = x_{j+r/2} cos_j + x_j sin_j``, ``j < r/2``,
    with the angles of row ``i mod M`` of ``cos``, ``sin`` ``(M, r/2)`` (``M = T``: one row of
    angles per position, shared by the batch; ``M = N``: one per row)."""
    N, width = x.shape
    half, M = r // 2, cos.shape[0]
    for i in prange(N):
        m = i % M
        for j in range(width):
            y[i, j] = x[i, j]
        for h in range(n_qk):
            o = h * d_qk
            for j in range(half):
                a, b = x[i, o + j], x[i, o + half + j]
                y[i, o + j] = a * cos[m, j] - b * sin[m, j]
                y[i, o + half + j] = b * cos[m, j] + a * sin[m, j]


#: :func:`_turn` on one thread, for a kernel that calls it (:mod:`pedestrian.kernels.decode`)
turn_rows = _turn.serial


def angle_rows(positions, r: int, base: float, scaling, dtype):
    """``(cos, sin)`` of ``positions`` ``(T,)`` or ``(B, T)`` from the table, as C-contiguous
    ``(T or B·T, r/2)`` arrays: the rows :func:`turn_rows` reads."""
    cos, sin = _angles(np.asarray(positions), r, base, scaling, dtype)
    return np.ascontiguousarray(cos).reshape(-1, r // 2), np.ascontiguousarray(sin).reshape(-1, r // 2)


def _rotate(qkv, n_qk: int, d_qk: int, r: int, cos, sin):
    """:func:`pedestrian.layers.rope._rotate` by :func:`_turn`: one new array."""
    B, T, width = qkv.shape
    cos = np.ascontiguousarray(cos).reshape(-1, r // 2)                         # (T or B·T, r/2)
    sin = np.ascontiguousarray(sin).reshape(-1, r // 2)
    out = empty_array(qkv.shape, qkv)
    _turn(np.ascontiguousarray(qkv).reshape(B * T, width), cos, sin, n_qk, d_qk, r, out.reshape(B * T, width))
    return out


def rope_forward(qkv, n_heads: int, d_qk: int, positions=None, *, base: float = 10_000.0,
                 rotated: int | None = None, n_kv_heads: int | None = None, scaling=None):
    """Rotate every head's queries and keys by their token's position (RoPE, GPT-NeoX pairing;
    EQUATIONS.md "RoPE").

    Fast :func:`pedestrian.layers.rope.rope_forward` (same arguments, results and cache; the
    angles from a table, the turn one loop: see the module docstring).

    Raises:
        ValueError: ``rotated`` odd, below 2 or above ``d_qk``; ``positions`` of another shape
            than ``(T,)`` or ``(B, T)``."""
    r = d_qk - d_qk % 2 if rotated is None else rotated
    if r % 2 or not 2 <= r <= d_qk:
        raise ValueError(f"RoPE rotates an even number 2 <= r <= d_qk={d_qk} of dimensions, got r={r}")
    B, T = qkv.shape[:2]
    pos = np.arange(T) if positions is None else np.asarray(positions)
    if pos.size not in (T, B * T) or pos.shape[-1] != T:
        raise ValueError(f"positions must be (T,) or (B, T) = ({B}, {T}) for qkv {tuple(qkv.shape)}, got "
                         f"shape {tuple(pos.shape)}")
    cos, sin = _angles(pos, r, base, scaling, qkv.dtype)                         # (…, T, 1, r/2)
    n_qk = n_heads + (n_heads if n_kv_heads is None else n_kv_heads)             # q heads, then k heads
    return _rotate(qkv, n_qk, d_qk, r, cos, sin), (cos, sin, n_qk, d_qk, r)


def rope_backward(delta, cache):
    """``Δ_in = R(−tθ) Δ`` on the q and k columns, the value columns' signal passed through
    (EQUATIONS.md "RoPE").

    Fast :func:`pedestrian.layers.rope.rope_backward` (same arguments and result)."""
    cos, sin, n_qk, d_qk, r = cache
    return _rotate(delta, n_qk, d_qk, r, cos, -sin)

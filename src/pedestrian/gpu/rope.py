"""RoPE on the GPU, q and k turned in place (reference: :mod:`pedestrian.layers.rope`;
EQUATIONS.md "RoPE forward", "RoPE backward").

One program per token turns the first ``r`` dimensions of each of its ``n_heads + n_kv_heads``
q and k heads (any number of key heads: grouped-query and multi-query alike), a block of
heads × pairs at once; the value columns are not touched, so the turn is written over the
array it was given (the projection's fresh output in the forward, the attention's fresh signal
in the backward) and that array is returned: no copy of ``qkv``. The backward is the same
kernel with the sine's sign flipped (``R(φ)ᵀ = R(−φ)``). The angles ``cos(tθ_j)``, ``sin(tθ_j)``
come from the reference's :func:`~pedestrian.layers.rope.rope_angles` (float64 angles, rounded
once), kept per ``(r, base, scaling, dtype, device)`` for positions ``0 … n−1`` when the
positions are the default ``0 … T−1``; explicit positions (a KV-cache step) are computed on the
device as the reference does (no read of the positions on the host).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layers.rope import rope_angles

#: ``(r, base, scaling, dtype, device) -> (cos, sin)``, each ``(n, 1, r/2)`` for positions ``0 … n−1``
_TABLES: dict = {}


@triton.jit
def _turn_kernel(X, COS, SIN, width, d_qk, n_qk, half, M, SIGN: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_J: tl.constexpr):
    """Row ``pid`` of ``X`` ``(N, width)``, angles of row ``pid mod M``: in every head ``h < n_qk``
    ``y_j = x_j cos_j − x_{j+r/2} (±sin_j)``, ``y_{j+r/2} = x_{j+r/2} cos_j + x_j (±sin_j)``, in place."""
    row = tl.program_id(0)
    m = row % M
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_J)[None, :]
    mask = (h < n_qk) & (j < half)
    c = tl.load(COS + m * half + j, mask=j < half, other=0.0)
    s = tl.load(SIN + m * half + j, mask=j < half, other=0.0) * SIGN
    first = X + row * width + h * d_qk + j
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    tl.store(first, x1 * c - x2 * s, mask=mask)
    tl.store(first + half, x2 * c + x1 * s, mask=mask)


def _angles(positions, T: int, r: int, base: float, scaling, like):
    """``(cos, sin)``, ``(T, 1, r/2)`` or ``(B, T, 1, r/2)``, as :func:`~pedestrian.layers.rope.rope_angles`."""
    if positions is not None:
        return rope_angles(positions, r, base, like, scaling)
    key = (r, float(base), scaling, like.dtype, str(like.device))
    table = _TABLES.get(key)
    if table is None or table[0].shape[0] < T:
        n = max(1024, triton.next_power_of_2(T))
        table = _TABLES[key] = rope_angles(torch.arange(n, device=like.device), r, base, like, scaling)
    return table[0][:T], table[1][:T]


def _turn(x, cache, sign: int):
    """``x`` ``(B, T, width)`` turned in place (a contiguous copy first where it is not contiguous)."""
    cos, sin, n_qk, d_qk, r = cache
    x = x if x.is_contiguous() else x.contiguous()
    B, T, width = x.shape
    half = r // 2
    cos2, sin2 = cos.reshape(-1, half), sin.reshape(-1, half)
    if B * T:
        _turn_kernel[(B * T,)](x, cos2 if cos2.is_contiguous() else cos2.contiguous(),
                               sin2 if sin2.is_contiguous() else sin2.contiguous(), width, d_qk, n_qk, half,
                               cos2.shape[0], SIGN=sign, BLOCK_H=max(2, triton.next_power_of_2(n_qk)),
                               BLOCK_J=max(2, triton.next_power_of_2(half)))
    return x


def rope_forward(qkv, n_heads: int, d_qk: int, positions=None, *, base: float = 10_000.0,
                 rotated: int | None = None, n_kv_heads: int | None = None, scaling=None):
    """``y_j = x_j cos(tθ_j) − x_{j+r/2} sin(tθ_j)``, ``y_{j+r/2} = x_{j+r/2} cos(tθ_j) + x_j sin(tθ_j)``,
    ``θ_j = base^(−2j/r)``, on every q and k head; the value columns pass through.

    GPU :func:`pedestrian.layers.rope.rope_forward` (same arguments, results and cache), but ``qkv``
    is turned in place and returned (the reference returns a new array).

    Raises:
        ValueError: ``rotated`` odd, below 2 or above ``d_qk``.
    """
    r = d_qk - d_qk % 2 if rotated is None else rotated
    if r % 2 or not 2 <= r <= d_qk:
        raise ValueError(f"RoPE rotates an even number 2 <= r <= d_qk={d_qk} of dimensions, got r={r}")
    cos, sin = _angles(positions, qkv.shape[1], r, base, scaling, qkv)
    cache = (cos, sin, n_heads + (n_heads if n_kv_heads is None else n_kv_heads), d_qk, r)
    return _turn(qkv, cache, 1), cache


def rope_backward(delta, cache):
    """``Δ_in = R(−tθ) Δ`` on the q and k columns; the value columns' signal passes through.

    GPU :func:`pedestrian.layers.rope.rope_backward` (same arguments and result), ``delta`` turned
    back in place and returned."""
    return _turn(delta, cache, -1)

"""numba loops of the attention kernels (NumPy arrays): the softmax rows, the tiles' ``exp``, a KV-cache step.

The products stay on BLAS (:mod:`pedestrian.kernels.attention`, :mod:`.attention_tiled`); these
loops do what lies between them in one pass per row, with the causal mask as a loop bound
(masked entries are written 0 and never computed). ``exp`` is :mod:`.vecmath`'s polynomial the
compiler vectorises: numba's ``math.exp`` is a scalar call (the PyPI llvmlite has no SVML) and
measured 2x slower than NumPy's ``np.exp`` here, the polynomial 2x faster (docs/kernels.md).

Sums with cancellation (the softmax backward's row sums) accumulate float32 in float64; sums of
positive terms (the softmax's) and the decode step's products in the arrays' dtype, vectorised. :data:`USE` is False where numba is
missing; the callers then run their NumPy (or torch) code.
"""

from __future__ import annotations


import numpy as np

from .jit import AVAILABLE, kernel, prange
from .vecmath import exp

__all__ = ["USE", "exp", "softmax_rows", "softmax_backward_rows", "exp_tile", "decode_attention"]

#: the attention kernels run these loops on NumPy arrays (numba can be imported)
USE = AVAILABLE


@kernel(parallel=True)
def softmax_rows(s, T, causal):
    """``P = softmax(S)`` in place, row by row: ``s`` ``(N, L)``, row ``r`` is query ``r mod T``
    of ``T`` at position ``L − T + r mod T``; with ``causal`` the keys after it are 0."""
    N, L = s.shape
    zero = np.zeros(1, dtype=s.dtype)[0]
    for r in prange(N):
        n = L - T + r % T + 1 if causal else L                      # allowed keys 0 … n-1
        row = s[r]
        m = row[0]
        for j in range(1, n):
            m = max(m, row[j])
        total = zero                  # in the rows' dtype: a sum of positive terms, vectorised
        for j in range(n):
            e = exp(row[j] - m)
            row[j] = e
            total += e
        inv = 1 / total
        for j in range(n):
            row[j] *= inv
        row[n:] = 0.0


@kernel(parallel=True)
def softmax_backward_rows(dp, p, T, causal):
    """``Δcausal = P ∘ (dP − rowsum(dP ∘ P))`` into ``dp`` ``(N, L)`` (rows as in :func:`softmax_rows`;
    masked entries 0)."""
    N, L = dp.shape
    for r in prange(N):
        n = L - T + r % T + 1 if causal else L
        d_row, p_row = dp[r], p[r]
        total = 0.0
        for j in range(n):
            total += d_row[j] * p_row[j]
        for j in range(n):
            d_row[j] = p_row[j] * (d_row[j] - total)
        d_row[n:] = 0.0


@kernel
def exp_tile(s, offset, causal):
    """``s = exp(s)`` in place on a tile ``(g, r, c)`` of scores; with ``causal``, key ``j`` after
    query ``i`` (``j > i + offset``: the tile's first query sits ``offset`` after its first key)
    gets 0 (the mask, fused)."""
    g, R, C = s.shape
    for h in range(g):
        for i in range(R):
            n = min(C, max(0, i + offset + 1)) if causal else C
            row = s[h, i]
            for j in range(n):
                row[j] = exp(row[j])
            row[n:] = 0.0


@kernel
def decode_attention(qkv, keys, values, length, key_start, causal, scale, zero, q_out, p_out, out):
    """A KV-cache step: the ``T`` new tokens' keys and values written into the cache at
    ``length …``, then ``out = softmax(q kᵀ · scale, masked) v`` against all ``L = length + T``.

    ``qkv`` ``(B, T, H·(2·d_qk + d_head))``; ``keys`` ``(B, H, capacity, d_qk)``, ``values``
    ``(B, H, capacity, d_head)``; ``key_start`` ``(B,)`` (each row's first real key: 0 when no
    row is padded); ``q_out`` ``(B, H, T, d_qk)`` = ``q · scale``, ``p_out`` ``(B, H, T, L)``,
    ``out`` ``(B, T, H·d_head)``. Masks as :func:`pedestrian.layers.attention.attention_mask`."""
    B, H, _, d_qk = keys.shape
    d_head = values.shape[3]
    T = qkv.shape[1]
    L = length + T
    for bh in range(B * H):                  # serial: a token's work is smaller than a parallel region's cost
        b, h = bh // H, bh % H
        for t in range(T):                                           # this head's new keys, values
            for c in range(d_qk):
                keys[b, h, length + t, c] = qkv[b, t, H * d_qk + h * d_qk + c]
            for c in range(d_head):
                values[b, h, length + t, c] = qkv[b, t, 2 * H * d_qk + h * d_head + c]
        acc = np.empty_like(values[0, 0, 0])                        # (the dtype: vectorised)
        for t in range(T):
            pos = length + t                                         # the query's position
            q = q_out[b, h, t]
            for c in range(d_qk):
                q[c] = qkv[b, t, h * d_qk + c] * scale
            p = p_out[b, h, t]
            for j in range(L):
                if (causal and j > pos) or (j < key_start[b] and j != pos):
                    p[j] = -np.inf
                    continue
                kj = keys[b, h, j]
                dot = zero                                           # (the dtype's: vectorised)
                for c in range(d_qk):
                    dot += q[c] * kj[c]
                p[j] = dot
            m = p[pos]                                               # (its own key: always allowed)
            for j in range(L):
                m = max(m, p[j])
            total = zero
            for j in range(L):
                e = exp(p[j] - m)
                p[j] = e
                total += e
            acc[:] = 0.0
            for j in range(L):
                p[j] /= total
                vj = values[b, h, j]
                for c in range(d_head):
                    acc[c] += p[j] * vj[c]
            for c in range(d_head):
                out[b, t, h * d_head + c] = acc[c]

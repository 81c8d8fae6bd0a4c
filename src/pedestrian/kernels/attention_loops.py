"""numba loops of the attention kernels (NumPy arrays): each head's forward and backward, a KV-cache step.

:func:`heads_forward` and :func:`heads_backward` are a whole head's attention per iteration, the
heads over numba's threads, each head's products one single-threaded BLAS call (``np.dot``); the
loops do what lies between the products in one pass per row, with the causal mask as a loop
bound (masked entries are written 0 and never computed). ``exp`` is :mod:`.vecmath`'s polynomial the
compiler vectorises (numba's ``math.exp`` is a scalar call: docs/kernels.md).

Sums with cancellation (the softmax backward's row sums) accumulate float32 in float64; sums of
positive terms (the softmax's) and the decode step's products in the arrays' dtype, vectorised.
"""

from __future__ import annotations


import numpy as np

from .jit import kernel, prange
from .vecmath import exp

__all__ = ["exp", "heads_forward", "heads_backward", "decode_attention"]


@kernel
def row_max(row, n, m):
    """``max(m, row[0], …, row[n−1])``."""
    for j in range(n):
        m = max(m, row[j])
    return m


@kernel
def exp_shifted(row, n, m):
    """``row[j] = exp(row[j] − m)`` for ``j < n``, ``row[n:] = 0`` (the causal mask as a loop
    bound); returns their sum, in the row's dtype (a sum of positive terms: vectorised)."""
    total = row.dtype.type(0.0)              # 0 in the row's dtype (a float32 sum stays float32)
    for j in range(n):
        e = exp(row[j] - m)
        row[j] = e
        total += e
    row[n:] = 0.0
    return total


@kernel
def _softmax_row(row, n):
    """``row[:n] = softmax(row[:n])`` in place, ``row[n:] = 0``."""
    inv = 1 / exp_shifted(row, n, row_max(row, n, row[0]))
    for j in range(n):
        row[j] *= inv


@kernel
def _softmax_backward_row(d_row, p_row, n):
    """``Δcausal = P ∘ (dP − Σ dP ∘ P)`` in place of ``dP`` (the sum in float64), masked entries 0."""
    total = 0.0
    for j in range(n):
        total += d_row[j] * p_row[j]
    for j in range(n):
        d_row[j] = p_row[j] * (d_row[j] - total)
    d_row[n:] = 0.0


@kernel(parallel=True, size=lambda qkv, causal, scale, q, k, v, p, *rest: p.size)
def heads_forward(qkv, causal, scale, q, k, v, p, out):
    """``out_h = P_h v_h``, ``P_h = softmax(scale · q_h k_hᵀ, causal mask)`` for every head
    (EQUATIONS.md, "One attention head").

    Every head ``(b, h)`` of ``qkv`` ``(B, T, H·(2·d_qk + d_head))``: its ``q · scale``, ``k``,
    ``v`` copied out ``(B, H, T, d)``, ``P = softmax(q kᵀ)`` (masked) into ``p`` ``(B, H, T, T)``,
    ``P v`` into its columns of ``out`` ``(B, T, H·d_head)``; heads over the threads, products on BLAS."""
    for u in prange(q.shape[0] * q.shape[1]):
        _head_forward(u, qkv, causal, scale, q, k, v, p, out)


@kernel
def _head_forward(u, qkv, causal, scale, q, k, v, p, out):
    """:func:`heads_forward` of head ``u = b·H + h``."""
    B, H, T, d_qk = q.shape
    d_head = v.shape[3]
    b, h = u // H, u % H
    qh, kh, vh, ph = q[b, h], k[b, h], v[b, h], p[b, h]
    for t in range(T):
        for c in range(d_qk):
            qh[t, c] = qkv[b, t, h * d_qk + c] * scale
            kh[t, c] = qkv[b, t, (H + h) * d_qk + c]
        for c in range(d_head):
            vh[t, c] = qkv[b, t, 2 * H * d_qk + h * d_head + c]
    np.dot(qh, kh.T, ph)                                         # S = q kᵀ / √d_qk
    for t in range(T):
        _softmax_row(ph[t], t + 1 if causal else T)
    o = np.empty((T, d_head), dtype=out.dtype)
    np.dot(ph, vh, o)                                            # P v
    for t in range(T):
        for c in range(d_head):
            out[b, t, h * d_head + c] = o[t, c]


@kernel(parallel=True, size=lambda delta, q, k, v, p, *rest: p.size)
def heads_backward(delta, q, k, v, p, causal, inv_sqrt_d, keep, kept, delta_qkv):
    """``dv = Pᵀ Δ``, ``dP = Δ vᵀ``, ``Δcausal = P ∘ (dP − rowsum(dP ∘ P))``, ``dq = Δcausal k/√d``,
    ``dk = Δcausalᵀ q/√d`` for every head (EQUATIONS.md, "One attention head").

    Every head's backward: ``dv = Pᵀ Δ``, ``dP = Δ vᵀ``, ``Δcausal`` (into ``kept[b, h]`` when
    ``keep``), ``dq = Δcausal k / √d_qk``, ``dk = Δcausalᵀ q`` (``q`` carries ``1/√d_qk``), written
    into their column blocks of ``delta_qkv`` ``(B, T, H·(2·d_qk + d_head))``."""
    for u in prange(q.shape[0] * q.shape[1]):
        _head_backward(u, delta, q, k, v, p, causal, inv_sqrt_d, keep, kept, delta_qkv)


@kernel
def _head_backward(u, delta, q, k, v, p, causal, inv_sqrt_d, keep, kept, delta_qkv):
    """:func:`heads_backward` of head ``u = b·H + h``."""
    B, H, T, d_qk = q.shape
    d_head = v.shape[3]
    b, h = u // H, u % H
    qh, kh, vh, ph = q[b, h], k[b, h], v[b, h], p[b, h]
    d = np.empty((T, d_head), dtype=delta.dtype)
    for t in range(T):
        for c in range(d_head):
            d[t, c] = delta[b, t, h * d_head + c]
    dv = np.empty((T, d_head), dtype=delta.dtype)
    np.dot(ph.T, d, dv)                                          # dv = Pᵀ Δ
    dp = kept[b, h] if keep else np.empty((T, T), dtype=delta.dtype)
    np.dot(d, vh.T, dp)                                          # dP = Δ vᵀ
    for t in range(T):
        _softmax_backward_row(dp[t], ph[t], t + 1 if causal else T)
    dq = np.empty((T, d_qk), dtype=delta.dtype)
    np.dot(dp, kh, dq)                                           # dq = Δcausal k
    dk = np.empty((T, d_qk), dtype=delta.dtype)
    np.dot(dp.T, qh, dk)                                         # dk = Δcausalᵀ q
    for t in range(T):
        for c in range(d_qk):
            delta_qkv[b, t, h * d_qk + c] = dq[t, c] * inv_sqrt_d
            delta_qkv[b, t, (H + h) * d_qk + c] = dk[t, c]
        for c in range(d_head):
            delta_qkv[b, t, 2 * H * d_qk + h * d_head + c] = dv[t, c]


@kernel
def decode_attention(qkv, keys, values, length, key_start, causal, scale, q_out, p_out, out):
    """``out = softmax(q [K; k]ᵀ/√d_qk, mask) [V; v]`` for ``T`` new tokens after the cache's
    ``K``, ``V`` (EQUATIONS.md, "KV cache").

    A KV-cache step: the ``T`` new tokens' keys and values written into the cache at
    ``length …``, then ``out = softmax(q kᵀ · scale, masked) v`` against all ``L = length + T``.

    ``qkv`` ``(B, T, H·(2·d_qk + d_head))``; ``keys`` ``(B, H, capacity, d_qk)``, ``values``
    ``(B, H, capacity, d_head)``; ``key_start`` ``(B,)`` (each row's first real key: 0 when no
    row is padded); ``q_out`` ``(B, H, T, d_qk)`` = ``q · scale``, ``p_out`` ``(B, H, T, L)``,
    ``out`` ``(B, T, H·d_head)``. Masks as :func:`pedestrian.layers.attention.attention_mask`."""
    B, H, _, d_qk = keys.shape
    d_head = values.shape[3]
    T = qkv.shape[1]
    L = length + T
    zero = q_out.dtype.type(0.0)                     # 0 in the dtype (a float32 loop stays float32)
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
                dot = zero
                for c in range(d_qk):
                    dot += q[c] * kj[c]
                p[j] = dot
            total = exp_shifted(p, L, row_max(p, L, p[pos]))         # (its own key: always allowed)
            acc[:] = 0.0
            for j in range(L):
                masked = (causal and j > pos) or (j < key_start[b] and j != pos)
                p[j] = zero if masked else p[j] / total              # (0 also when the max is NaN)
                vj = values[b, h, j]
                for c in range(d_head):
                    acc[c] += p[j] * vj[c]
            for c in range(d_head):
                out[b, t, h * d_head + c] = acc[c]

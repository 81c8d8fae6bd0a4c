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
def softcap_range(row, a, n, cap):
    """``row[j] = cap · tanh(row[j] / cap)`` for ``a <= j < n`` (the score soft-cap; ``cap = 0``: none)."""
    if cap > 0:
        for j in range(a, n):
            row[j] = cap * np.tanh(row[j] / cap)


@kernel
def _softmax_row(row, a, n, cap):
    """``row[a:n] = softmax(cap(row[a:n]))`` in place, 0 elsewhere. The keys before ``a`` are set to
    ``−∞`` and the loops start at 0 (a loop from a variable start does not vectorise: 6x slower)."""
    if cap > 0:
        softcap_range(row, a, n, cap)
    if a > 0:
        row[:a] = -np.inf
    inv = 1 / exp_shifted(row, n, row_max(row, n, row[a]))
    for j in range(n):
        row[j] *= inv


@kernel
def _softmax_backward_row(d_row, p_row, a, n):
    """``Δcausal = P ∘ (dP − Σ dP ∘ P)`` in place of ``dP`` (the sum in float64), masked entries 0."""
    if a > 0:
        d_row[:a] = 0.0                              # (P is 0 there: the loops may start at 0)
    total = 0.0
    for j in range(n):
        total += d_row[j] * p_row[j]
    for j in range(n):
        d_row[j] = p_row[j] * (d_row[j] - total)
    if a > 0:
        d_row[:a] = 0.0
    d_row[n:] = 0.0


@kernel(parallel=True, size=lambda qkv, bounds, cap, scale, q, k, v, p, *rest: p.size)
def heads_forward(qkv, bounds, cap, scale, q, k, v, p, out):
    """``out_h = P_h v_{g(h)}``, ``P_h = softmax(mask(cap(scale · q_h k_{g(h)}ᵀ)))`` for every head,
    ``g(h) = h // (H / H_kv)`` (EQUATIONS.md, "One attention head", "Grouped-query attention").

    Every head ``(b, h)`` of ``qkv`` ``(B, T, H·d_qk + H_kv·(d_qk + d_head))``: its ``q · scale``
    ``(B, H, T, d_qk)``, the key/value heads' ``k``, ``v`` ``(B, H_kv, T, ·)`` copied out,
    ``P = softmax(q kᵀ)`` (masked, query head ``h`` against key/value head ``h // (H / H_kv)``) into
    ``p`` ``(B, H, T, T)``, ``P v`` into its columns of ``out`` ``(B, T, H·d_head)``; heads over the
    threads, products on BLAS. Grouped (``H_kv < H``), the key/value heads are copied out first;
    else each head copies its own. The mask: query ``t`` of batch row ``b`` sees keys
    ``lo[b', t] <= j < hi[b', t]``, ``lo, hi = bounds[0], bounds[1]`` (``b' = b``, or 0 when they have
    one row: :func:`pedestrian.kernels.masks.key_bounds`);
    ``cap > 0``: scores ``cap · tanh(s / cap)`` first."""
    if k.shape[1] < q.shape[1]:
        for u in prange(k.shape[0] * k.shape[1]):
            _copy_kv(u, qkv, q.shape[1] * q.shape[3], k, v)
    for u in prange(q.shape[0] * q.shape[1]):
        _head_forward(u, qkv, bounds, cap, scale, q, k, v, p, out)


@kernel
def _copy_kv(u, qkv, hq, k, v):
    """Key/value head ``u = b·H_kv + j``'s ``k``, ``v`` out of ``qkv`` (the k part starts at column ``hq``)."""
    B, H_kv, T, d_qk = k.shape
    d_head = v.shape[3]
    b, j = u // H_kv, u % H_kv
    for t in range(T):
        for c in range(d_qk):
            k[b, j, t, c] = qkv[b, t, hq + j * d_qk + c]
        for c in range(d_head):
            v[b, j, t, c] = qkv[b, t, hq + H_kv * d_qk + j * d_head + c]


@kernel
def _head_forward(u, qkv, bounds, cap, scale, q, k, v, p, out):
    """:func:`heads_forward` of head ``u = b·H + h``."""
    B, H, T, d_qk = q.shape
    d_head = v.shape[3]
    b, h = u // H, u % H
    qh, kh, vh, ph = q[b, h], k[b, h // (H // k.shape[1])], v[b, h // (H // k.shape[1])], p[b, h]
    if k.shape[1] == H:                                          # multi-head: its own k, v
        _copy_kv(u, qkv, H * d_qk, k, v)
    for t in range(T):
        for c in range(d_qk):
            qh[t, c] = qkv[b, t, h * d_qk + c] * scale
    np.dot(qh, kh.T, ph)                                         # S = q kᵀ / √d_qk
    lo, hi = bounds[0, b if bounds.shape[1] > 1 else 0], bounds[1, b if bounds.shape[1] > 1 else 0]
    for t in range(T):
        _softmax_row(ph[t], lo[t], hi[t], cap)
    o = np.empty((T, d_head), dtype=out.dtype)
    np.dot(ph, vh, o)                                            # P v
    for t in range(T):
        for c in range(d_head):
            out[b, t, h * d_head + c] = o[t, c]


@kernel(parallel=True, size=lambda delta, q, k, v, p, *rest: p.size)
def heads_backward(delta, q, k, v, p, bounds, cap, scale, keep, kept, dk_heads, dv_heads, delta_qkv):
    """``dv = Pᵀ Δ``, ``dP = Δ vᵀ``, ``Δcausal = P ∘ (dP − rowsum(dP ∘ P))``, ``dq = Δraw k``,
    ``dk = Δrawᵀ q``, ``Δraw = Δcausal · scale`` (soft-capped: ``∘ (1 − tanh²(s/c))``) for every head,
    summed over each key/value head's group (EQUATIONS.md, "One attention head", "Grouped-query
    attention", "Score scale and soft-cap").

    Every head's backward: ``dv = Pᵀ Δ``, ``dP = Δ vᵀ``, ``Δcausal`` (into ``kept[b, h]`` when
    ``keep``), ``dq``, ``dk`` (``q`` carries ``scale``), written into their column blocks of
    ``delta_qkv`` ``(B, T, H·d_qk + H_kv·(d_qk + d_head))``. Grouped (``H_kv < H``): each query
    head's ``dk``, ``dv`` go to ``dk_heads``, ``dv_heads`` ``(B, H, T, ·)``, then each key/value head
    sums its group's, in head order (the same bits on any number of threads). The mask ``bounds``
    as :func:`heads_forward`'s; ``bounds[2]`` the segment ids.
    Without a soft-cap, as the reference: ``dq`` from ``k − k̄`` (``k̄`` its segment's mean) and ``dk``
    less the mean of its segment's nonzero rows (the rows of ``Δcausal`` sum to 0), so the rounding
    of those sums is not scaled by a short sequence's key mean (float32), and a key no query with
    an error signal sees keeps ``dk = 0`` exactly."""
    for u in prange(q.shape[0] * q.shape[1]):
        _head_backward(u, delta, q, k, v, p, bounds, cap, scale, keep, kept, dk_heads, dv_heads, delta_qkv)
    if k.shape[1] < q.shape[1]:
        for u in prange(k.shape[0] * k.shape[1]):
            _group_sum(u, q.shape[1], dk_heads, dv_heads, delta_qkv)


@kernel
def _segment_centre(a, seg, out, active_only):
    """``out`` = ``a`` less, per run of equal ``seg``, the mean of the run's rows (``active_only``:
    the mean of its rows that are not all 0, subtracted from those rows only -- the others are
    left as they are; float64 sums)."""
    T, w = a.shape
    use = np.ones(T, np.bool_)
    if active_only:
        for t in range(T):
            use[t] = False
            for c in range(w):
                if a[t, c] != 0:
                    use[t] = True
                    break
    mean = np.empty(w)
    s0 = 0
    while s0 < T:
        s1 = s0 + 1
        while s1 < T and seg[s1] == seg[s0]:
            s1 += 1
        mean[:] = 0.0
        count = 0
        for t in range(s0, s1):
            if use[t]:
                count += 1
                for c in range(w):
                    mean[c] += a[t, c]
        for c in range(w):
            mean[c] /= max(count, 1)
        for t in range(s0, s1):
            if use[t]:
                for c in range(w):
                    out[t, c] = a[t, c] - mean[c]
        s0 = s1


@kernel
def _head_backward(u, delta, q, k, v, p, bounds, cap, scale, keep, kept, dk_heads, dv_heads, delta_qkv):
    """:func:`heads_backward` of head ``u = b·H + h``."""
    B, H, T, d_qk = q.shape
    d_head = v.shape[3]
    grouped = k.shape[1] < H
    b, h = u // H, u % H
    bb = b if bounds.shape[1] > 1 else 0
    lo, hi, seg = bounds[0, bb], bounds[1, bb], bounds[2, bb]
    qh, kh, vh, ph = q[b, h], k[b, h // (H // k.shape[1])], v[b, h // (H // k.shape[1])], p[b, h]
    d = np.empty((T, d_head), dtype=delta.dtype)
    for t in range(T):
        for c in range(d_head):
            d[t, c] = delta[b, t, h * d_head + c]
    dv = dv_heads[b, h] if grouped else np.empty((T, d_head), dtype=delta.dtype)
    np.dot(ph.T, d, dv)                                          # dv = Pᵀ Δ
    dp = kept[b, h] if keep else np.empty((T, T), dtype=delta.dtype)
    np.dot(d, vh.T, dp)                                          # dP = Δ vᵀ
    for t in range(T):
        _softmax_backward_row(dp[t], ph[t], lo[t], hi[t])
    dq = np.empty((T, d_qk), dtype=delta.dtype)
    dk = dk_heads[b, h] if grouped else np.empty((T, d_qk), dtype=delta.dtype)
    if cap > 0:                                                  # Δcausal ∘ (1 − tanh²(s/c)), s again
        ds = np.empty((T, T), dtype=delta.dtype)
        np.dot(qh, kh.T, ds)
        for t in range(T):
            for j in range(T):
                th = np.tanh(ds[t, j] / cap)
                ds[t, j] = dp[t, j] * (1 - th * th)
        np.dot(ds, kh, dq)                                       # dq = Δraw k
        np.dot(ds.T, qh, dk)                                     # dk = Δrawᵀ q
    else:
        kc = np.empty((T, d_qk), dtype=delta.dtype)
        _segment_centre(kh, seg, kc, False)                  # k − k̄: rows of Δcausal sum to 0
        np.dot(dp, kc, dq)                                       # dq = Δcausal (k − k̄) = Δcausal k
        np.dot(dp.T, qh, dk)                                     # dk = Δcausalᵀ q
        _segment_centre(dk, seg, dk, True)                   # Σ_segment dk = 0: its rounding removed
    for t in range(T):
        for c in range(d_qk):
            delta_qkv[b, t, h * d_qk + c] = dq[t, c] * scale
    if grouped:
        return
    for t in range(T):
        for c in range(d_qk):
            delta_qkv[b, t, (H + h) * d_qk + c] = dk[t, c]
        for c in range(d_head):
            delta_qkv[b, t, 2 * H * d_qk + h * d_head + c] = dv[t, c]


@kernel
def _group_sum(u, H, dk_heads, dv_heads, delta_qkv):
    """Key/value head ``u = b·H_kv + j``: ``dk``, ``dv`` = the sums over its group's query heads
    ``j·g … j·g + g − 1`` (EQUATIONS.md "Grouped-query attention"), into ``delta_qkv``."""
    T, d_qk, d_head = dk_heads.shape[2], dk_heads.shape[3], dv_heads.shape[3]
    H_kv = (delta_qkv.shape[2] - H * d_qk) // (d_qk + d_head)
    g = H // H_kv
    b, j = u // H_kv, u % H_kv
    for t in range(T):
        for c in range(d_qk):
            s = dk_heads[b, j * g, t, c]
            for m in range(1, g):
                s += dk_heads[b, j * g + m, t, c]
            delta_qkv[b, t, H * d_qk + j * d_qk + c] = s
        for c in range(d_head):
            s = dv_heads[b, j * g, t, c]
            for m in range(1, g):
                s += dv_heads[b, j * g + m, t, c]
            delta_qkv[b, t, H * d_qk + H_kv * d_qk + j * d_head + c] = s


@kernel
def decode_attention(qkv, keys, values, length, start, key_start, causal, window, cap, scale, q_out, p_out, out):
    """``out = softmax(q [K; k]ᵀ/√d_qk, mask) [V; v]`` for ``T`` new tokens after the cache's
    ``K``, ``V`` (EQUATIONS.md, "KV cache").

    A KV-cache step: the ``T`` new tokens' keys and values written into the cache at
    ``length …``, then ``out = softmax(q kᵀ · scale, masked) v`` against all ``L = length + T``.

    ``qkv`` ``(B, T, H·d_qk + H_kv·(d_qk + d_head))``; ``keys`` ``(B, H_kv, capacity, d_qk)``,
    ``values`` ``(B, H_kv, capacity, d_head)`` (query head ``h`` reads key/value head
    ``h // (H / H_kv)``); ``key_start`` ``(B,)`` (each row's first real key: 0 when no row is
    padded); ``q_out`` ``(B, H, T, d_qk)`` = ``q · scale``, ``p_out`` ``(B, H, T, L)``,
    ``out`` ``(B, T, H·d_head)``; ``window > 0``: only keys ``pos − window < i`` (a full-length
    cache); ``cap > 0``: scores ``cap · tanh(s / cap)``. Masks as
    :func:`pedestrian.layers.attention.attention_mask`. Cache index ``i`` lives in slot ``(start +
    i) mod capacity``: ``start = 0`` for a cache in order; a sliding window's ring read in place, in
    its tokens' order (:func:`pedestrian.kernels.attention.ring_frame`)."""
    B, H_kv, n_slots, d_qk = keys.shape
    H = q_out.shape[1]
    d_head = values.shape[3]
    T = qkv.shape[1]
    L = length + T
    zero = q_out.dtype.type(0.0)                     # 0 in the dtype (a float32 loop stays float32)
    for bj in range(B * H_kv):                       # the key/value heads' new keys, values
        b, j = bj // H_kv, bj % H_kv
        for t in range(T):
            slot = (start + length + t) % n_slots
            for c in range(d_qk):
                keys[b, j, slot, c] = qkv[b, t, H * d_qk + j * d_qk + c]
            for c in range(d_head):
                values[b, j, slot, c] = qkv[b, t, H * d_qk + H_kv * d_qk + j * d_head + c]
    for bh in range(B * H):                  # serial: a token's work is smaller than a parallel region's cost
        b, h = bh // H, bh % H
        j = h // (H // H_kv)                                         # its key/value head
        acc = np.empty_like(values[0, 0, 0])                        # (the dtype: vectorised)
        for t in range(T):
            pos = length + t                                         # the query's position
            q = q_out[b, h, t]
            for c in range(d_qk):
                q[c] = qkv[b, t, h * d_qk + c] * scale
            p = p_out[b, h, t]
            slot = start - 1                                         # cache index i's slot, wrapping
            for i in range(L):
                slot = slot + 1 if slot + 1 < n_slots else 0
                if (causal and i > pos) or (i < key_start[b] and i != pos) or (window > 0 and i <= pos - window):
                    p[i] = -np.inf
                    continue
                ki = keys[b, j, slot]
                dot = zero
                for c in range(d_qk):
                    dot += q[c] * ki[c]
                p[i] = cap * np.tanh(dot / cap) if cap > 0 else dot
            total = exp_shifted(p, L, row_max(p, L, p[pos]))         # (its own key: always allowed)
            acc[:] = 0.0
            slot = start - 1
            for i in range(L):
                slot = slot + 1 if slot + 1 < n_slots else 0
                masked = (causal and i > pos) or (i < key_start[b] and i != pos) or (window > 0 and i <= pos - window)
                p[i] = zero if masked else p[i] / total              # (0 also when the max is NaN)
                vi = values[b, j, slot]
                for c in range(d_head):
                    acc[c] += p[i] * vi[c]
            for c in range(d_head):
                out[b, t, h * d_head + c] = acc[c]

"""Tiled (flash-style) multi-head attention: the section-3 head in blocks, O(T) memory.

The same function as :func:`pedestrian.layers.attention.multi_head_attention_forward` and its
backward, computed in a different order (docs/EQUATIONS.md, "Tiled attention"):

- **Forward.** Queries are taken ``block_q`` rows at a time and keys ``block_k`` at a time. For a
  block of queries the softmax is built up over the key blocks with a running row maximum ``m``
  (the online softmax: each new block rescales the row sums ``l`` and outputs ``u`` by
  ``exp(m_old − m_new)``). Per query row only the output and the log-sum-exp ``ℓ = m + log l``
  are kept; the ``T × T`` matrix ``P`` is never stored. With the causal mask, key blocks wholly
  above the diagonal are skipped and the diagonal block's mask is a loop bound.
- **Backward.** Each block's ``P = exp(S − ℓ)`` is recomputed from ``q``, ``k`` and the stored
  ``ℓ``; ``dv``, ``dP``, ``Δcausal``, ``dq`` and ``dk`` are accumulated block by block. The row
  sums of the softmax backward come from ``D = rowsum(dP ∘ P) = rowsum(Δ ∘ out)`` (EQUATIONS.md),
  ``T × d_head`` numbers (float32 summed in float64).
- **NumPy arrays (numba).** One kernel per direction: ``prange`` over units of work that write
  disjoint outputs -- forward: (head, query block), largest first, dealt round-robin to the
  threads; backward: one head each -- every tile product a single-threaded BLAS call
  (``np.dot`` into per-unit scratch, :func:`pedestrian.kernels.jit.blas_one_thread`), the mask,
  ``exp`` (:mod:`.vecmath`) and the softmax's sums one loop per row between them. No unit reads
  another's results, so the bits are the same for any number of threads.
- **torch tensors** (a GPU's: :mod:`pedestrian.kernels` gives CPU tensors to the numba loops):
  the same blocks, all heads of a block in one batched call, one after another.

``Δcausal`` (``backward(keep_delta_causal=True)``) and ``P`` (:func:`tiled_attention_weights`)
are computed on request only, as full ``(B, n_heads, T, T)`` arrays.

:func:`pedestrian.kernels.attention.multi_head_attention_forward` picks this kernel from
:data:`TILED_MIN_T` on (docs/performance.md, "Long context").
"""

from __future__ import annotations

import math

import numpy as np

from ..backend import is_torch_array, to_numpy
from ..layers.attention import check_kv_heads, check_mask_args
from . import schedule
from .attention_loops import exp_shifted, row_max, softcap_range
from .jit import blas_one_thread, kernel, prange, threads_used
from .masks import block_bounds, key_bounds, key_range, row_range, tile_allowed, torch_bounds
from .vecmath import exp
from .workspace import empty_array

__all__ = ["BLOCKS", "TILED_MIN_T", "use_tiled", "tiled_attention_forward", "tiled_attention_backward",
           "tiled_attention_weights"]

#: ``(block_q, block_k)`` per backend: query rows and key columns of one tile; NumPy: the numba
#: loops, torch: the batched loop (:data:`.schedule.TILED_BLOCKS`)
BLOCKS = schedule.TILED_BLOCKS
#: the shortest sequence for which the fast path uses this kernel, per backend
#: (:data:`.schedule.TILED_MIN_T`)
TILED_MIN_T = schedule.TILED_MIN_T


def _backend(x) -> str:
    return "torch" if is_torch_array(x) else "numpy"


def use_tiled(T: int, like) -> bool:
    """Whether the fast path runs tiled attention for a sequence of ``T`` tokens (no KV cache)
    on ``like``'s backend: ``T >= TILED_MIN_T[backend]``."""
    return T >= TILED_MIN_T[_backend(like)]


_MASKS: dict = {}


def _tile_mask(rows: int, cols: int, offset: int, like):
    """Additive ``(rows, cols)`` causal mask of a tile whose first query sits ``offset`` positions
    after its first key: ``−∞`` where key ``c`` comes after query ``r`` (``c > r + offset``)."""
    key = (rows, cols, offset, str(like.dtype), str(like.device))
    mask = _MASKS.get(key)
    if mask is None:
        mask = np.where(np.arange(cols)[None, :] > np.arange(rows)[:, None] + offset, -math.inf, 0.0)
        if is_torch_array(like):
            import torch

            mask = torch.from_numpy(mask).to(dtype=like.dtype, device=like.device)
        else:
            mask = mask.astype(like.dtype)
        if len(_MASKS) > 256:                              # many sequence lengths: start again
            _MASKS.clear()
        _MASKS[key] = mask
    return mask


def _empty(shape, like):
    return like.new_empty(shape) if is_torch_array(like) else empty_array(shape, like)


def _copy(dst, src) -> None:
    dst.copy_(src) if is_torch_array(dst) else np.copyto(dst, src)


def _split_heads(src, B: int, n_heads: int):
    """``src`` ``(B, T, n_heads·w)`` (a column block of ``qkv``) as a new ``(B·n_heads, T, w)``."""
    T, w = src.shape[1], src.shape[2] // n_heads
    dst = _empty((B * n_heads, T, w), src)
    _copy(dst.reshape(B, n_heads, T, w), src.reshape(B, T, n_heads, w).swapaxes(1, 2))
    return dst


def _merge_heads_into(dst, src, B: int, n_heads: int) -> None:
    """``src`` ``(B·n_heads, T, w)`` into ``dst`` ``(B, T, n_heads·w)`` (head ``h``: columns ``h·w …``)."""
    T, w = src.shape[1], src.shape[2]
    _copy(dst.reshape(B, T, n_heads, w).swapaxes(1, 2), src.reshape(B, n_heads, T, w))


@kernel
def _add_into(a, b):
    """``a += b`` (2-D), written as a loop: numba compiles an array expression on slices for
    seconds (11 of the backward's 17 s), a loop nest in milliseconds."""
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            a[i, j] += b[i, j]


@kernel(parallel=True, size=lambda q, *rest: q.shape[0] * q.shape[1] * q.shape[1] // 2)   # scores made
def _forward_units(q, k, v, units, lanes, bq, bk, lo, hi, cap, o, lse):
    """Online softmax per (head, query block) ``units[u] = g·n_blocks + block``:
    ``o = softmax(cap(q kᵀ)) v``, ``lse = m + log Σ exp(cap(q kᵀ) − m)`` over the keys
    ``lo <= j < hi`` of each row. ``q`` ``(G, T, d_qk)`` already ``· scale``, ``k`` ``(G_kv, T, d_qk)``,
    ``v`` ``(G_kv, T, d_head)`` (query head ``g`` reads key/value head ``g // (G / G_kv)``), ``lo``,
    ``hi`` ``(B | 1, T)``, ``o`` ``(G, T, d_head)``, ``lse`` ``(G, T)``.
    (Each lane's work is :func:`_forward_lane`.)"""
    for lane in prange(lanes):                       # units lane, lane + lanes, … (largest first)
        _forward_lane(q, k, v, units, lane, lanes, bq, bk, lo, hi, cap, o, lse)


@kernel
def _forward_lane(q, k, v, units, lane, lanes, bq, bk, lo, hi, cap, o, lse):
    G, T, d_head = o.shape
    group = G // k.shape[0]                                  # query heads per key/value head
    n_blocks = -(-T // bq)
    s_flat = np.empty(bq * bk, dtype=q.dtype)
    acc, t = np.empty((bq, d_head), dtype=q.dtype), np.empty((bq, d_head), dtype=q.dtype)
    m, l = np.empty(bq, dtype=q.dtype), np.empty(bq, dtype=q.dtype)
    for u in range(lane, len(units), lanes):
        g, i0 = units[u] // n_blocks, units[u] % n_blocks * bq
        gk = g // group
        bb = g // (G // lo.shape[0]) if lo.shape[0] > 1 else 0
        lo_b, hi_b = lo[bb], hi[bb]
        i1 = min(i0 + bq, T)
        r = i1 - i0
        start, end = lo_b[i0], hi_b[i0]                      # keys seen by the block: start … end-1
        for i in range(i0, i1):
            start, end = min(start, lo_b[i]), max(end, hi_b[i])
        m[:] = -np.inf
        l[:] = 0.0
        acc[:] = 0.0
        for j0 in range(start // bk * bk, end, bk):
            c = min(bk, end - j0)
            s = s_flat[:r * c].reshape((r, c))
            np.dot(q[g, i0:i1], k[gk, j0:j0 + c].T, s)       # S (r, c)
            for i in range(r):                               # e = exp(S − m_new), sums rescaled
                a, n = row_range(i, i0, j0, c, lo_b, hi_b)
                row = s[i]
                if a >= n:                                   # no key of this tile: nothing changes
                    row[:] = 0.0
                    continue
                softcap_range(row, a, n, cap)
                row[:a] = -np.inf                            # (loops from 0: they vectorise)
                m_new = row_max(row, n, m[i])
                total = exp_shifted(row, n, m_new)
                alpha = exp(m[i] - m_new)                    # exp(m_old − m_new) <= 1
                l[i] = l[i] * alpha + total
                m[i] = m_new
                for j in range(d_head):
                    acc[i, j] *= alpha
            np.dot(s, v[gk, j0:j0 + c], t[:r])               # e v (r, d_head)
            _add_into(acc[:r], t[:r])
        for i in range(r):
            for j in range(d_head):
                o[g, i0 + i, j] = acc[i, j] / l[i]
            lse[g, i0 + i] = m[i] + np.log(l[i])


@kernel(parallel=True, size=lambda q, *rest: q.shape[0] * q.shape[1] * q.shape[1])
def _backward_heads(q, k, v, d, o, lse, bq, bk, lo, hi, cap, keep, kept, dq, dk, dv):
    """Per head ``g`` (``prange``): ``P = exp(cap(q kᵀ) − lse)``, ``dv = Pᵀ Δ``,
    ``Δcausal = P ∘ (Δ vᵀ − rowsum(Δ ∘ o))``, ``Δraw = Δcausal`` (soft-capped: ``∘ (1 − tanh²)``),
    ``dq = Δraw k``, ``dk = Δrawᵀ q`` (shapes of :func:`_forward_units`; ``d`` = Δ ``(G, T, d_head)``;
    ``kept`` ``(G, T, T)`` when ``keep``; outputs ``dq``, ``dk`` ``(G, T, d_qk)``, ``dv``, per query
    head (grouped: the caller sums each group's ``dk``, ``dv``); ``dq`` still to be ``· scale``)."""
    for g in prange(q.shape[0]):
        _backward_head(g, q, k, v, d, o, lse, bq, bk, lo, hi, cap, keep, kept, dq, dk, dv)


@kernel
def _backward_head(g, q, k, v, d, o, lse, bq, bk, lo, hi, cap, keep, kept, dq, dk, dv):
    G, T, d_qk = q.shape
    d_head = v.shape[2]
    gk = g // (G // k.shape[0])                              # its key/value head
    bb = g // (G // lo.shape[0]) if lo.shape[0] > 1 else 0
    lo_b, hi_b = lo[bb], hi[bb]
    n_blocks = -(-T // bq)
    b_lo, b_hi = np.empty(n_blocks, np.int64), np.empty(n_blocks, np.int64)
    block_bounds(lo_b, hi_b, bq, b_lo, b_hi)
    minus_d = np.empty(T, dtype=q.dtype)                     # −D = −rowsum(Δ ∘ o), in float64
    for i in range(T):
        total = 0.0
        for c in range(d_head):
            total += np.float64(d[g, i, c]) * np.float64(o[g, i, c])
        minus_d[i] = -total
    dq[g] = 0.0
    p_flat, dp_flat = np.empty(bq * bk, dtype=q.dtype), np.empty(bq * bk, dtype=q.dtype)
    f_flat = np.empty(bq * bk if cap > 0 else 1, dtype=q.dtype)
    t_q, t_k = np.empty((bq, d_qk), dtype=q.dtype), np.empty((bk, d_qk), dtype=q.dtype)
    t_v = np.empty((bk, d_head), dtype=q.dtype)
    for j0 in range(0, T, bk):                               # one key block: its dk, dv
        c = min(bk, T - j0)
        dk[g, j0:j0 + c] = 0.0
        dv[g, j0:j0 + c] = 0.0
        for nb in range(n_blocks):                           # the query blocks that see it
            if b_hi[nb] <= j0 or b_lo[nb] >= j0 + c:
                continue
            i0 = nb * bq
            r = min(bq, T - i0)
            p, dp = p_flat[:r * c].reshape((r, c)), dp_flat[:r * c].reshape((r, c))
            np.dot(q[g, i0:i0 + r], k[gk, j0:j0 + c].T, p)  # S
            np.dot(d[g, i0:i0 + r], v[gk, j0:j0 + c].T, dp)  # dP
            for i in range(r):                               # P, then Δcausal into dp
                a, n = row_range(i, i0, j0, c, lo_b, hi_b)
                row, drow = p[i], dp[i]
                ell, md = lse[g, i0 + i], minus_d[i0 + i]
                if cap > 0:
                    frow = f_flat[i * c:(i + 1) * c]
                    for j in range(a, n):
                        th = np.tanh(row[j] / cap)
                        frow[j] = 1 - th * th                # ∂ cap(s) / ∂s
                        row[j] = cap * th
                row[:a] = -np.inf                            # (loops from 0: they vectorise)
                for j in range(n):
                    row[j] = exp(row[j] - ell)
                    drow[j] = row[j] * (drow[j] + md)
                drow[:a] = 0.0
                row[n:] = 0.0
                drow[n:] = 0.0
            if keep:
                _add_into(kept[g, i0:i0 + r, j0:j0 + c], dp)          # (kept starts as zeros)
            if cap > 0:                                      # Δraw = Δcausal ∘ (1 − tanh²)
                for i in range(r):
                    a, n = row_range(i, i0, j0, c, lo_b, hi_b)
                    for j in range(a, n):
                        dp[i, j] *= f_flat[i * c + j]
            np.dot(p.T, d[g, i0:i0 + r], t_v[:c])            # dv += Pᵀ Δ
            _add_into(dv[g, j0:j0 + c], t_v[:c])
            np.dot(dp.T, q[g, i0:i0 + r], t_k[:c])           # dk += Δrawᵀ q
            _add_into(dk[g, j0:j0 + c], t_k[:c])
            np.dot(dp, k[gk, j0:j0 + c], t_q[:r])            # dq += Δraw k
            _add_into(dq[g, i0:i0 + r], t_q[:r])


def tiled_attention_forward(qkv, n_heads: int, d_qk: int, d_head: int, *, causal: bool = True,
                            block_q: int | None = None, block_k: int | None = None,
                            n_kv_heads: int | None = None, window: int | None = None, segments=None,
                            softcap: float | None = None, scale: float | None = None):
    """``o = softmax(cap(q kᵀ · scale)) v`` and ``ℓ = m + log Σ_β exp(S_β − m)`` per query row over
    its visible keys, block by block of keys with the running maximum ``m`` (EQUATIONS.md, "Tiled
    attention"); query head ``h`` reads key/value head ``h // (n_heads / n_kv_heads)``.

    Multi-head attention of the fused ``qkv`` by tiles (module docstring; EQUATIONS.md).

    Args:
        qkv: ``(B, T, n_heads·d_qk + n_kv_heads·(d_qk + d_head))`` float array (NumPy or torch),
            as :func:`pedestrian.layers.attention.multi_head_attention_forward` takes it.
        n_heads, d_qk, d_head: the head layout.
        causal: mask future keys (their blocks are skipped).
        block_q, block_k: tile size (default :data:`BLOCKS` of the backend).
        n_kv_heads: key/value heads, dividing ``n_heads`` (``None``: ``n_heads``).
        window, segments, softcap, scale: as the reference's (key blocks no query of a block
            sees are skipped).

    Returns:
        ``(a3, cache)``: ``a3`` ``(B, T, n_heads·d_head)``, the heads' ``P v`` side by side. The
        cache holds ``q · scale`` ``(B·n_heads, T, d_qk)``, ``k`` ``(B·n_kv_heads, T, d_qk)``,
        ``v`` ``(B·n_kv_heads, T, d_head)``, ``ℓ`` ``(B·n_heads, T)`` and ``a3`` itself (the
        backward's ``rowsum(Δ ∘ out)``): ``O(T)``.

    Raises:
        ValueError: a block size below 1; ``n_kv_heads`` not a divisor of ``n_heads``; bad
            ``window``, ``segments`` or ``softcap``.
    """
    B, T, _ = qkv.shape
    n_kv = check_kv_heads(n_heads, n_kv_heads)
    check_mask_args(qkv, None, window, segments, softcap)
    G, hq, hk = B * n_heads, n_heads * d_qk, n_kv * d_qk
    bq, bk = BLOCKS[_backend(qkv)]
    bq, bk = bq if block_q is None else block_q, bk if block_k is None else block_k
    if bq < 1 or bk < 1:
        raise ValueError(f"block sizes must be >= 1, got block_q={bq}, block_k={bk}")
    seg_host = None if segments is None else (to_numpy(segments) if is_torch_array(segments) else segments)
    bounds = key_bounds(B, T, causal, window, seg_host)                      # (lo, hi, seg) on the host
    cap = 0.0 if softcap is None else float(softcap)
    scale = 1.0 / math.sqrt(d_qk) if scale is None else float(scale)
    plain = window is None and segments is None and cap == 0.0               # the causal mask as a loop bound
    q = _split_heads(qkv[..., :hq], B, n_heads)                              # (B·H, T, d_qk)
    k, v = _split_heads(qkv[..., hq:hq + hk], B, n_kv), _split_heads(qkv[..., hq + hk:], B, n_kv)  # (B·H_kv, T, ·)
    q *= scale
    if is_torch_array(qkv):
        mask = None if plain else torch_bounds(bounds, cap, qkv)
        if n_kv < n_heads:                                                   # (G_kv, g, T, ·), k, v broadcast
            o, lse = _torch_forward(q.reshape(B * n_kv, -1, T, d_qk), k[:, None], v[:, None], bq, bk, causal, mask)
            o, lse = o.reshape(G, T, d_head), lse.reshape(G, T)
        else:
            o, lse = _torch_forward(q, k, v, bq, bk, causal, mask)
    else:
        blas_one_thread()
        o, lse = empty_array((G, T, d_head), qkv), empty_array((G, T), qkv)
        n_blocks = -(-T // bq)
        work = np.arange(G * n_blocks)                                       # unit g·n_blocks + block
        units = work[np.argsort(-(work % n_blocks), kind="stable")] if causal else work
        _forward_units(q, k, v, units, max(1, min(threads_used(), len(units))), bq, bk, bounds[0], bounds[1], cap,
                       o, lse)
    out = _empty((B, T, n_heads * d_head), qkv)
    _merge_heads_into(out, o, B, n_heads)
    return out, dict(tiled=True, q=q, k=k, v=v, out=out, lse=lse, d_qk=d_qk, n_heads=n_heads, n_kv_heads=n_kv,
                     causal=causal, blocks=(bq, bk), bounds=bounds, cap=cap, scale=scale,
                     plain=plain)   # (the heads' outputs as a3 holds them, not a second copy)


def _torch_forward(q, k, v, bq, bk, causal, mask=None):
    """The online softmax of :func:`_forward_lane` on torch tensors, all heads of a tile at once.
    Grouped, ``q`` is ``(G_kv, g, T, d_qk)`` and ``k``, ``v`` ``(G_kv, 1, T, ·)`` (broadcast over the group).
    ``mask``: :func:`pedestrian.kernels.masks.torch_bounds` (``None``: the causal mask or none)."""
    import torch

    T, d_head = v.shape[-2:]
    o, lse = q.new_empty((*q.shape[:-1], d_head)), q.new_empty(q.shape[:-1])
    B = 1 if mask is None else mask["lo"].shape[0]
    for i0 in range(0, T, bq):
        i1 = min(i0 + bq, T)
        m = l = acc = None
        start, end = key_range(mask, causal, i0, i1, T)
        for j0 in range(start // bk * bk, end, bk):
            j1 = min(j0 + bk, end)
            s = q[..., i0:i1, :] @ k[..., j0:j1, :].mT                       # S (G, r, c)
            if mask is not None:                                             # cap, then the mask
                if mask["cap"] > 0:
                    s = mask["cap"] * torch.tanh(s / mask["cap"])
                ok = tile_allowed(mask, i0, i1, j0, j1, s.reshape(B, -1, *s.shape[-2:]))
                s = torch.where(ok, s.reshape(B, -1, *s.shape[-2:]), -math.inf).reshape(s.shape)
            elif causal and j1 - 1 > i0:                                     # the tile crosses the diagonal
                s += _tile_mask(i1 - i0, j1 - j0, i0 - j0, s)
            m_new = s.amax(-1, keepdim=True) if m is None else torch.maximum(m, s.amax(-1, keepdim=True))
            if mask is not None:                                             # a row with no key yet: 0, not NaN
                m_new = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            e = torch.exp(s - m_new)                                         # exp(S − m_new)
            if m is None:
                l, acc = e.sum(-1, keepdim=True), e @ v[..., j0:j1, :]
            else:
                alpha = torch.exp(m - m_new)                                 # rescale the sums so far
                l, acc = l * alpha + e.sum(-1, keepdim=True), acc * alpha + e @ v[..., j0:j1, :]
            m = m_new
        o[..., i0:i1, :] = acc / l
        lse[..., i0:i1] = (m + torch.log(l))[..., 0]                         # ℓ = m + log l
    return o, lse


def tiled_attention_backward(delta, cache, *, keep_delta_causal: bool = False):
    """``P = exp(S − ℓ)``, ``Δcausal = P ∘ (Δ vᵀ − rowsum(Δ ∘ o))``, ``dv = Pᵀ Δ``,
    ``dq = Δcausal k/√d_qk``, ``dk = Δcausalᵀ q/√d_qk``, tile by tile (EQUATIONS.md, "Tiled attention").

    Backward of :func:`tiled_attention_forward` down to the fused ``qkv`` (EQUATIONS.md).

    Per tile: ``P = exp(S − ℓ)`` (recomputed), ``dv += Pᵀ Δ``, ``dP = Δ vᵀ``,
    ``Δcausal = P ∘ (dP − D)`` with ``D = rowsum(Δ ∘ out)`` (= ``rowsum(dP ∘ P)``),
    ``dq += Δcausal k / √d_qk``, ``dk += Δcausalᵀ q / √d_qk``.

    Args:
        delta: ``Δ3`` ``(B, T, n_heads·d_head)``.
        cache: from :func:`tiled_attention_forward`.
        keep_delta_causal: also return ``Δcausal`` ``(B, n_heads, T, T)`` (zeros on the skipped
            blocks above the diagonal; ``O(T²)`` memory, on request only).

    Returns:
        ``(delta_qkv, delta_causal)``: ``(B, T, n_heads·(2·d_qk + d_head))`` and ``Δcausal`` or ``None``.
    """
    q, k, v, lse = cache["q"], cache["k"], cache["v"], cache["lse"]
    d_qk, n_heads, causal = cache["d_qk"], cache["n_heads"], cache["causal"]
    n_kv = cache.get("n_kv_heads", n_heads)
    bq, bk = cache["blocks"]
    B = delta.shape[0]
    d, o = _split_heads(delta, B, n_heads), _split_heads(cache["out"], B, n_heads)   # Δ, out per head, contiguous
    G, T, d_head = o.shape
    hq, hk, group = n_heads * d_qk, n_kv * d_qk, n_heads // n_kv
    bounds = cache.get("bounds")
    bounds = key_bounds(B, T, causal) if bounds is None else bounds
    cap, scale = cache.get("cap", 0.0), cache.get("scale", 1.0 / math.sqrt(d_qk))
    if is_torch_array(o):
        mask = None if cache.get("plain", True) else torch_bounds(bounds, cap, o)
        kept = o.new_zeros((G, T, T)) if keep_delta_causal else None
        if group == 1:
            dq, dk, dv = _torch_backward(q, k, v, d, o, lse, bq, bk, causal, kept, mask)
        else:                                                                # (G_kv, g, ·, ·), k, v broadcast
            grouped = lambda a: a.reshape(G // group, group, *a.shape[1:])  # noqa: E731
            dq, dk, dv = _torch_backward(grouped(q), k[:, None], v[:, None], grouped(d), grouped(o), grouped(lse),
                                         bq, bk, causal, None if kept is None else grouped(kept), mask)
            dq, dk, dv = dq.reshape(q.shape), dk[:, 0], dv[:, 0]
    else:
        blas_one_thread()
        kept = np.zeros((G, T, T), o.dtype) if keep_delta_causal else None
        dq, dk, dv = empty_array(q.shape, o), empty_array(q.shape, o), empty_array(o.shape, o)   # per query head
        _backward_heads(q, k, v, d, o, lse, bq, bk, bounds[0], bounds[1], cap, kept is not None,
                        np.zeros((1, 1, 1), o.dtype) if kept is None else kept, dq, dk, dv)
        if group > 1:                                                        # Σ over each group's heads
            dk, dv = _group_sum(dk, group), _group_sum(dv, group)
    dq *= scale
    delta_qkv = _empty((B, T, hq + hk + n_kv * d_head), o)
    for part, lo, heads in ((dq, 0, n_heads), (dk, hq, n_kv), (dv, hq + hk, n_kv)):
        _merge_heads_into(delta_qkv[..., lo:lo + heads * part.shape[2]], part, B, heads)
    return delta_qkv, None if kept is None else kept.reshape(B, n_heads, T, T)


def _group_sum(a, group: int):
    """``a`` ``(G, T, w)`` per query head -> ``(G / group, T, w)``: each key/value head's sum over
    the ``group`` query heads that read it, added in head order (the same bits on any threads)."""
    a = a.reshape(a.shape[0] // group, group, *a.shape[1:])
    out = a[:, 0].copy()
    for m in range(1, group):
        out += a[:, m]
    return out


def _torch_backward(q, k, v, d, o, lse, bq, bk, causal, kept, mask=None):
    """:func:`_backward_head` on torch tensors, all heads of a tile at once (``mask``:
    :func:`pedestrian.kernels.masks.torch_bounds`)."""
    import torch

    T = o.shape[-2]
    minus_d = -(d * o).sum(-1, keepdim=True)                                 # −D = −rowsum(Δ ∘ out)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    total = (lambda a: a.sum(1, keepdim=True)) if q.dim() == 4 else (lambda a: a)  # Σ over a group
    B = 1 if mask is None else mask["lo"].shape[0]
    for i0 in range(0, T, bq):
        i1 = min(i0 + bq, T)
        start, end = key_range(mask, causal, i0, i1, T)
        for j0 in range(start // bk * bk, end, bk):
            j1 = min(j0 + bk, end)
            s = q[..., i0:i1, :] @ k[..., j0:j1, :].mT                       # S
            factor = None
            if mask is not None:
                if mask["cap"] > 0:                                          # cap(S), ∂cap/∂S = 1 − tanh²
                    th = torch.tanh(s / mask["cap"])
                    s, factor = mask["cap"] * th, 1 - th * th
                ok = tile_allowed(mask, i0, i1, j0, j1, s.reshape(B, -1, *s.shape[-2:]))
                s = torch.where(ok, s.reshape(B, -1, *s.shape[-2:]), -math.inf).reshape(s.shape)
            elif causal and j1 - 1 > i0:
                s += _tile_mask(i1 - i0, j1 - j0, i0 - j0, s)
            p = torch.exp(s - lse[..., i0:i1, None])                         # P = exp(S − ℓ)
            dv[..., j0:j1, :] += total(p.mT @ d[..., i0:i1, :])              # dv += Pᵀ Δ
            ds = p * (d[..., i0:i1, :] @ v[..., j0:j1, :].mT + minus_d[..., i0:i1, :])  # Δcausal = P ∘ (dP − D)
            if kept is not None:
                kept[..., i0:i1, j0:j1] = ds
            if factor is not None:
                ds = ds * factor                                             # Δraw (before the scale)
            dq[..., i0:i1, :] += ds @ k[..., j0:j1, :]                       # dq += Δraw k
            dk[..., j0:j1, :] += total(ds.mT @ q[..., i0:i1, :])             # dk += Δrawᵀ q
    return dq, dk, dv


def tiled_attention_weights(cache):
    """``P = exp(cap(q kᵀ · scale) − ℓ)`` (EQUATIONS.md, "Tiled attention").

    ``P`` ``(B, n_heads, T, T)`` of a :func:`tiled_attention_forward` cache, recomputed from
    ``q``, ``k`` and the log-sum-exp ``ℓ``, ``0`` where masked (``O(T²)`` memory, on request only)."""
    q, k, lse = cache["q"], cache["k"], cache["lse"]
    G, T, _ = q.shape
    group = G // k.shape[0]                                                  # query heads per key/value head
    q, k, lse = q.reshape(G // group, group, T, -1), k[:, None], lse.reshape(G // group, group, T)
    s = q @ k.swapaxes(-1, -2)                                               # S (G_kv, g, T, T)
    cap = cache.get("cap", 0.0)
    if cap > 0:
        s = cap * (s / cap).tanh() if is_torch_array(s) else cap * np.tanh(s / cap)
    s = s - lse[..., None]                                                   # S − ℓ
    p = s.exp() if is_torch_array(s) else np.exp(s)                          # P
    B = G // cache["n_heads"]
    p = p.reshape(B, cache["n_heads"], T, T)
    bounds = cache.get("bounds")
    lo, hi, _ = key_bounds(B, T, cache["causal"]) if bounds is None else bounds
    j = np.arange(T)
    allowed = (j >= lo[:, :, None]) & (j < hi[:, :, None])                   # (B | 1, T, T)
    if is_torch_array(p):
        import torch

        allowed = torch.from_numpy(allowed).to(p.device)
        return torch.where(allowed[:, None], p, torch.zeros_like(p))         # 0 where masked (also a NaN ℓ)
    return np.where(allowed[:, None], p, 0.0).astype(p.dtype, copy=False)

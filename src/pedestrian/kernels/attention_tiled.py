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
- **torch tensors** (and NumPy without numba, or with the powers of 2 forced): the same blocks,
  all heads of a block in one batched call, one after another (PyTorch threads each operation).
  On PyTorch's CPU the tiles take ``2^x`` instead of ``e^x`` (:func:`pedestrian.kernels.blas.uses_exp2`):
  ``q`` carries ``log₂e`` besides ``1/√d_qk``, so ``S`` and ``ℓ`` are in units of ``ln 2`` and
  ``P = 2^(S·log₂e − ℓ·log₂e)`` is the same number; ``dk``, a product with that ``q``, is
  divided by ``log₂e`` at the end.

``Δcausal`` (``backward(keep_delta_causal=True)``) and ``P`` (:func:`tiled_attention_weights`)
are computed on request only, as full ``(B, n_heads, T, T)`` arrays.

:func:`pedestrian.kernels.attention.multi_head_attention_forward` picks this kernel from
:data:`TILED_MIN_T` on (docs/performance.md, "Long context").
"""

from __future__ import annotations

import math

import numpy as np

from ..backend import is_numpy_array, is_torch_array
from . import attention_loops, blas
from .blas import copy_into, elementwise_lib, rowdot
from .attention_loops import exp_shifted, row_max
from .jit import blas_one_thread, kernel, prange, threads_used
from .vecmath import exp
from .workspace import empty_array

__all__ = ["BLOCKS", "TILED_MIN_T", "use_tiled", "tiled_attention_forward", "tiled_attention_backward",
           "tiled_attention_weights"]

#: ``(block_q, block_k)`` per backend: query rows and key columns of one tile. NumPy (numba, one
#: head per tile): measured docs/kernels.md, "Tiled attention"; torch tensors pay more per call
#: (~5-10 µs) and thread each one: 256 × 512 was as fast as 128 × 256 on one thread and faster on two.
BLOCKS = {"numpy": (128, 256), "torch": (256, 512)}
#: the shortest sequence for which the fast path uses this kernel (below it, the full-matrix
#: kernel of :mod:`pedestrian.kernels.attention` is faster). Measured, docs/performance.md.
TILED_MIN_T = {"numpy": 256, "torch": 512}


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
    key = (rows, cols, offset, like.dtype, like.device)                  # dtypes differ by backend
    mask = _MASKS.get(key)
    if mask is None:
        if is_torch_array(like):
            import torch

            pos_r = torch.arange(rows, device=like.device)[:, None]
            pos_c = torch.arange(cols, device=like.device)[None, :]
            mask = torch.zeros((rows, cols), dtype=like.dtype, device=like.device)
            mask.masked_fill_(pos_c > pos_r + offset, -math.inf)
        else:
            mask = np.zeros((rows, cols), dtype=like.dtype)
            mask[np.arange(cols)[None, :] > np.arange(rows)[:, None] + offset] = -math.inf
        if len(_MASKS) > 256:                              # many sequence lengths: start again
            _MASKS.clear()
        _MASKS[key] = mask
    return mask


def _zeros(shape, like):
    if is_numpy_array(like):
        return np.zeros(shape, dtype=like.dtype)
    import torch

    return torch.zeros(shape, dtype=like.dtype, device=like.device)


def _split_heads_into(dst, src, B: int, n_heads: int) -> None:
    """``src`` ``(B, T, n_heads·w)`` (a column block of ``qkv``) into ``dst`` ``(B·n_heads, T, w)``."""
    T, w = src.shape[1], src.shape[2] // n_heads
    copy_into(dst.reshape(B, n_heads, T, w), src.reshape(B, T, n_heads, w).swapaxes(1, 2))


def _merge_heads_into(dst, src, B: int, n_heads: int) -> None:
    """``src`` ``(B·n_heads, T, w)`` into ``dst`` ``(B, T, n_heads·w)`` (head ``h``: columns ``h·w …``)."""
    T, w = src.shape[1], src.shape[2]
    copy_into(dst.reshape(B, T, n_heads, w).swapaxes(1, 2), src.reshape(B, n_heads, T, w))


@kernel
def _add_into(a, b):
    """``a += b`` (2-D), written as a loop: numba compiles an array expression on slices for
    seconds (11 of the backward's 17 s), a loop nest in milliseconds."""
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            a[i, j] += b[i, j]


@kernel
def _allowed(i, i0, j0, c, causal):
    """Keys of a tile (first key ``j0``, ``c`` of them) that query ``i0 + i`` may see."""
    return min(c, max(0, i0 + i - j0 + 1)) if causal else c


@kernel(parallel=True)
def _forward_units(q, k, v, units, lanes, bq, bk, causal, o, lse):
    """Online softmax per (head, query block) ``units[u] = g·n_blocks + block``:
    ``o = softmax(q kᵀ) v``, ``lse = m + log Σ exp(q kᵀ − m)``. ``q`` ``(G, T, d_qk)`` already
    ``÷ √d_qk``, ``k`` ``(G, T, d_qk)``, ``v``, ``o`` ``(G, T, d_head)``, ``lse`` ``(G, T)``.
    (Each lane's work is :func:`_forward_lane`.)"""
    for lane in prange(lanes):                       # units lane, lane + lanes, … (largest first)
        _forward_lane(q, k, v, units, lane, lanes, bq, bk, causal, o, lse)


@kernel
def _forward_lane(q, k, v, units, lane, lanes, bq, bk, causal, o, lse):
    G, T, d_head = v.shape
    n_blocks = -(-T // bq)
    s_flat = np.empty(bq * bk, dtype=q.dtype)
    acc, t = np.empty((bq, d_head), dtype=q.dtype), np.empty((bq, d_head), dtype=q.dtype)
    m, l = np.empty(bq, dtype=q.dtype), np.empty(bq, dtype=q.dtype)
    for u in range(lane, len(units), lanes):
        g, i0 = units[u] // n_blocks, units[u] % n_blocks * bq
        i1 = min(i0 + bq, T)
        r, end = i1 - i0, i1 if causal else T                # keys seen: 0 … end-1
        m[:] = -np.inf
        l[:] = 0.0
        acc[:] = 0.0
        for j0 in range(0, end, bk):
            c = min(bk, end - j0)
            s = s_flat[:r * c].reshape((r, c))
            np.dot(q[g, i0:i1], k[g, j0:j0 + c].T, s)        # S (r, c)
            for i in range(r):                               # e = exp(S − m_new), sums rescaled
                n, row = _allowed(i, i0, j0, c, causal), s[i]
                m_new = row_max(row, n, m[i])
                total = exp_shifted(row, n, m_new)
                alpha = exp(m[i] - m_new)                    # exp(m_old − m_new) <= 1
                l[i] = l[i] * alpha + total
                m[i] = m_new
                for j in range(d_head):
                    acc[i, j] *= alpha
            np.dot(s, v[g, j0:j0 + c], t[:r])                # e v (r, d_head)
            _add_into(acc[:r], t[:r])
        for i in range(r):
            for j in range(d_head):
                o[g, i0 + i, j] = acc[i, j] / l[i]
            lse[g, i0 + i] = m[i] + np.log(l[i])


@kernel(parallel=True)
def _backward_heads(q, k, v, d, o, lse, bq, bk, causal, keep, kept, dq, dk, dv):
    """Per head ``g`` (``prange``): ``P = exp(q kᵀ − lse)``, ``dv = Pᵀ Δ``,
    ``Δcausal = P ∘ (Δ vᵀ − rowsum(Δ ∘ o))``, ``dq = Δcausal k``, ``dk = Δcausalᵀ q`` (shapes of
    :func:`_forward_units`; ``d`` = Δ ``(G, T, d_head)``; ``kept`` ``(G, T, T)`` when ``keep``;
    outputs ``dq``, ``dk`` ``(G, T, d_qk)``, ``dv``; ``dq`` still to be ``÷ √d_qk``)."""
    for g in prange(q.shape[0]):
        _backward_head(g, q, k, v, d, o, lse, bq, bk, causal, keep, kept, dq, dk, dv)


@kernel
def _backward_head(g, q, k, v, d, o, lse, bq, bk, causal, keep, kept, dq, dk, dv):
    G, T, d_qk = q.shape
    d_head = v.shape[2]
    minus_d = np.empty(T, dtype=q.dtype)                     # −D = −rowsum(Δ ∘ o), in float64
    for i in range(T):
        total = 0.0
        for c in range(d_head):
            total += np.float64(d[g, i, c]) * np.float64(o[g, i, c])
        minus_d[i] = -total
    dq[g] = 0.0
    p_flat, dp_flat = np.empty(bq * bk, dtype=q.dtype), np.empty(bq * bk, dtype=q.dtype)
    t_q, t_k = np.empty((bq, d_qk), dtype=q.dtype), np.empty((bk, d_qk), dtype=q.dtype)
    t_v = np.empty((bk, d_head), dtype=q.dtype)
    for j0 in range(0, T, bk):                               # one key block: its dk, dv
        c = min(bk, T - j0)
        dk[g, j0:j0 + c] = 0.0
        dv[g, j0:j0 + c] = 0.0
        for i0 in range(j0 // bq * bq if causal else 0, T, bq):   # the query blocks that see it
            r = min(bq, T - i0)
            p, dp = p_flat[:r * c].reshape((r, c)), dp_flat[:r * c].reshape((r, c))
            np.dot(q[g, i0:i0 + r], k[g, j0:j0 + c].T, p)   # S
            np.dot(d[g, i0:i0 + r], v[g, j0:j0 + c].T, dp)  # dP
            for i in range(r):                               # P, then Δcausal into dp
                n, row, drow = _allowed(i, i0, j0, c, causal), p[i], dp[i]
                ell, md = lse[g, i0 + i], minus_d[i0 + i]
                for j in range(n):
                    row[j] = exp(row[j] - ell)
                    drow[j] = row[j] * (drow[j] + md)
                row[n:] = 0.0
                drow[n:] = 0.0
            if keep:
                _add_into(kept[g, i0:i0 + r, j0:j0 + c], dp)          # (kept starts as zeros)
            np.dot(p.T, d[g, i0:i0 + r], t_v[:c])            # dv += Pᵀ Δ
            _add_into(dv[g, j0:j0 + c], t_v[:c])
            np.dot(dp.T, q[g, i0:i0 + r], t_k[:c])           # dk += Δcausalᵀ q
            _add_into(dk[g, j0:j0 + c], t_k[:c])
            np.dot(dp, k[g, j0:j0 + c], t_q[:r])             # dq += Δcausal k
            _add_into(dq[g, i0:i0 + r], t_q[:r])


def tiled_attention_forward(qkv, n_heads: int, d_qk: int, d_head: int, *, causal: bool = True,
                            block_q: int | None = None, block_k: int | None = None):
    """Multi-head attention of the fused ``qkv`` by tiles (module docstring; EQUATIONS.md).

    Args:
        qkv: ``(B, T, n_heads·(2·d_qk + d_head))`` float array (NumPy or torch), as
            :func:`pedestrian.layers.attention.multi_head_attention_forward` takes it.
        n_heads, d_qk, d_head: the head layout.
        causal: mask future keys (their blocks are skipped).
        block_q, block_k: tile size (default :data:`BLOCKS` of the backend).

    Returns:
        ``(a3, cache)``: ``a3`` ``(B, T, n_heads·d_head)``, the heads' ``P v`` side by side. The
        cache holds, per head (``B·n_heads`` of them), ``q·unit/√d_qk``, ``k`` ``(B·n_heads, T, d_qk)``,
        ``v`` and the outputs ``o`` ``(B·n_heads, T, d_head)``, and ``ℓ·unit`` ``(B·n_heads, T)``
        (``unit = log₂e`` where the tiles take powers of 2, the module docstring; else 1): ``O(T)``.

    Raises:
        ValueError: a block size below 1.
    """
    B, T, _ = qkv.shape
    G, hq = B * n_heads, n_heads * d_qk
    bq, bk = BLOCKS[_backend(qkv)]
    bq, bk = bq if block_q is None else block_q, bk if block_k is None else block_k
    if bq < 1 or bk < 1:
        raise ValueError(f"block sizes must be >= 1, got block_q={bq}, block_k={bk}")
    unit, exp_, log = blas.softmax_exp(qkv)                                  # scores in units of ln 2, or 1
    q, k = empty_array((G, T, d_qk), qkv), empty_array((G, T, d_qk), qkv)
    v, o, lse = empty_array((G, T, d_head), qkv), empty_array((G, T, d_head), qkv), empty_array((G, T), qkv)
    _split_heads_into(q, qkv[..., :hq], B, n_heads)
    _split_heads_into(k, qkv[..., hq:2 * hq], B, n_heads)
    _split_heads_into(v, qkv[..., 2 * hq:], B, n_heads)
    lib = elementwise_lib(qkv)
    lib.multiply(q, unit / math.sqrt(d_qk), out=q)
    if attention_loops.USE and is_numpy_array(qkv) and unit == 1.0:
        blas_one_thread()
        n_blocks = -(-T // bq)
        work = np.arange(G * n_blocks)                                       # unit g·n_blocks + block
        units = work[np.argsort(-(work % n_blocks), kind="stable")] if causal else work
        _forward_units.sized(G * T * (T if causal else 2 * T) // 2)(
            q, k, v, units, max(1, min(threads_used(), len(units))), bq, bk, causal, o, lse)
    else:                                                                    # torch: all heads per call
        for i0 in range(0, T, bq):
            i1 = min(i0 + bq, T)
            m = l = acc = None
            for j0 in range(0, i1 if causal else T, bk):
                j1 = min(j0 + bk, i1 if causal else T)
                s = q[:, i0:i1] @ k[:, j0:j1].mT                             # S (G, r, c)
                if causal and j1 - 1 > i0:                                   # the tile crosses the diagonal
                    s += _tile_mask(i1 - i0, j1 - j0, i0 - j0, s)
                m_new = lib.amax(s, axis=-1, keepdims=True)
                m_new = m_new if m is None else lib.maximum(m, m_new)
                e = exp_(s - m_new)                                          # exp(S − m_new)
                if m is None:
                    l, acc = lib.sum(e, axis=-1, keepdims=True), e @ v[:, j0:j1]
                else:
                    alpha = exp_(m - m_new)                                  # rescale the sums so far
                    l, acc = l * alpha + lib.sum(e, axis=-1, keepdims=True), acc * alpha + e @ v[:, j0:j1]
                m = m_new
            copy_into(o[:, i0:i1], acc / l)
            copy_into(lse[:, i0:i1], (m + log(l))[..., 0])                   # ℓ = m + log l
    out = empty_array((B, T, n_heads * d_head), qkv)
    _merge_heads_into(out, o, B, n_heads)
    return out, dict(tiled=True, q=q, k=k, v=v, o=o, lse=lse, d_qk=d_qk, n_heads=n_heads, causal=causal,
                     blocks=(bq, bk), unit=unit)


def tiled_attention_backward(delta, cache, *, keep_delta_causal: bool = False):
    """Backward of :func:`tiled_attention_forward` down to the fused ``qkv`` (EQUATIONS.md).

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
    q, k, v, o, lse = cache["q"], cache["k"], cache["v"], cache["o"], cache["lse"]
    G, T, d_head = o.shape
    d_qk, n_heads, causal, unit = cache["d_qk"], cache["n_heads"], cache["causal"], cache["unit"]
    bq, bk = cache["blocks"]
    B, hq = G // n_heads, n_heads * d_qk
    d = empty_array((G, T, d_head), o)                                       # Δ per head, contiguous
    _split_heads_into(d, delta, B, n_heads)
    dq, dk, dv = empty_array((G, T, d_qk), o), empty_array((G, T, d_qk), o), empty_array((G, T, d_head), o)
    kept = _zeros((B, n_heads, T, T), o) if keep_delta_causal else None
    lib = elementwise_lib(o)
    if attention_loops.USE and is_numpy_array(o) and unit == 1.0:
        blas_one_thread()
        kept3 = np.zeros((1, 1, 1), o.dtype) if kept is None else kept.reshape(G, T, T)
        _backward_heads.sized(G * T * T)(q, k, v, d, o, lse, bq, bk, causal, kept is not None, kept3, dq, dk, dv)
    else:                                                                    # torch: all heads per call
        _, exp_, _ = blas.softmax_exp(o, unit)
        minus_d = rowdot(d, o)                                               # D = rowsum(Δ ∘ out)
        lib.multiply(minus_d, -1.0, out=minus_d)
        dk[...], dv[...] = 0, 0
        for i0 in range(0, T, bq):
            i1 = min(i0 + bq, T)
            for j0 in range(0, i1 if causal else T, bk):
                j1 = min(j0 + bk, i1 if causal else T)
                s = q[:, i0:i1] @ k[:, j0:j1].mT - lse[:, i0:i1, None]     # S − ℓ
                if causal and j1 - 1 > i0:
                    s += _tile_mask(i1 - i0, j1 - j0, i0 - j0, s)
                p = exp_(s)
                dv[:, j0:j1] += p.mT @ d[:, i0:i1]                           # dv += Pᵀ Δ
                ds = p * (d[:, i0:i1] @ v[:, j0:j1].mT + minus_d[:, i0:i1])  # Δcausal = P ∘ (dP − D)
                if kept is not None:
                    kept.reshape(G, T, T)[:, i0:i1, j0:j1] = ds
                if j0 == 0:
                    copy_into(dq[:, i0:i1], ds @ k[:, j0:j1])                # dq += Δcausal k
                else:
                    dq[:, i0:i1] += ds @ k[:, j0:j1]
                dk[:, j0:j1] += ds.mT @ q[:, i0:i1]                          # dk += Δcausalᵀ q (× unit)
    lib.multiply(dq, 1.0 / math.sqrt(d_qk), out=dq)
    if unit != 1.0:                                                          # q carried log₂e: take it out
        lib.multiply(dk, 1.0 / unit, out=dk)
    delta_qkv = empty_array((B, T, 2 * hq + n_heads * d_head), o)
    for part, lo, width in ((dq, 0, d_qk), (dk, hq, d_qk), (dv, 2 * hq, d_head)):
        _merge_heads_into(delta_qkv[..., lo:lo + n_heads * width], part, B, n_heads)
    return delta_qkv, kept


def tiled_attention_weights(cache):
    """``P`` ``(B, n_heads, T, T)`` of a :func:`tiled_attention_forward` cache, recomputed from
    ``q``, ``k`` and the log-sum-exp ``ℓ``: ``P = exp(q kᵀ/√d_qk − ℓ)``, ``0`` above the diagonal
    when causal (``O(T²)`` memory, on request only)."""
    q, k, lse = cache["q"], cache["k"], cache["lse"]
    G, T, _ = q.shape
    lib = elementwise_lib(q)
    p = q @ k.mT                                                             # S (G, T, T)
    lib.subtract(p, lse[..., None], out=p)                                   # S − ℓ
    if cache["causal"]:
        lib.add(p, _tile_mask(T, T, 0, p), out=p)
    _, exp_, _ = blas.softmax_exp(p, cache["unit"])
    exp_(p, out=p)                                                           # P
    return p.reshape(G // cache["n_heads"], cache["n_heads"], T, T)

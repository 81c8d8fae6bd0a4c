"""Multi-head attention on a GPU: the section-3 head as tiled (flash) Triton kernels, forward and backward.

``out = softmax(q kᵀ · scale, causal mask) v`` per head (``scale``: ``1/√d_qk`` unless given), and its backward
``dv = Pᵀ Δ``, ``Δcausal = P ∘ (Δ vᵀ − D)`` with ``D = rowsum(Δ ∘ out)``, ``dq = Δcausal k/√d_qk``,
``dk = Δcausalᵀ q/√d_qk`` (docs/EQUATIONS.md, "One attention head" and "Tiled attention"), with
grouped-query heads (EQUATIONS.md, "Grouped-query attention": query head ``h`` reads key/value head
``h // g``, ``g = n_heads / n_kv_heads``; a key/value head's ``dk``, ``dv`` are its group's sums).

The same contract as :func:`pedestrian.layers.multi_head_attention_forward` /
:func:`~pedestrian.layers.multi_head_attention_backward` and :func:`~pedestrian.layers.attention_weights`
(same names, arguments and results), computed in the order of EQUATIONS.md "Tiled attention":

- **Forward** (:func:`_forward_kernel`, one program per (query block, batch row · query head)):
  the online softmax over key blocks, a running row maximum ``m``, sum ``l`` and output ``u``
  rescaled by ``exp(m_old − m_new)``; it writes ``out = u / l`` straight into ``a3``'s columns of
  its head and keeps ``ℓ = m + log l`` per query row. ``P`` (``T × T``) is never stored.
- **Backward**: ``D = rowsum(Δ ∘ out)`` first (:func:`_row_term_kernel`, the paper's Δcausal
  correction: ``rowsum(dP ∘ P) = rowsum(Δ ∘ out)``); then ``P = exp(S − ℓ)`` is recomputed per
  tile by two kernels that each own their outputs, so no two programs write the same number
  (no atomics: the bits are the same at every run):
  :func:`_dkdv_kernel` -- one program per (key block, batch row · key/value head) sums ``dk``,
  ``dv`` over the query blocks that see it *and over the group's query heads, in head order*;
  :func:`_dq_kernel` -- one program per (query block, batch row · query head) sums ``dq`` over the
  key blocks it sees.
- **Causal.** Tiles wholly above the diagonal are never visited (the forward and ``dq`` stop at
  the diagonal block, ``dk``/``dv`` start at it); inside a tile the mask is applied to ``S``
  (``−∞``) and to ``P`` and ``Δcausal`` (``0``) before any sum, so a loss at position ``t``
  sends exactly ``0`` to ``q``, ``k``, ``v`` after ``t``. The reference's float32 correction of
  ``dq`` (``k − k̄``, the mean over all keys) is taken here with key 0 instead, which every query
  sees; ``dk``'s mean row is not removed (that would take every position: not causal; issue 49).
- **Window, packed segments.** With ``window`` or ``segments`` (``MASKED``) each query row ``α`` sees
  the keys ``lo_α <= β < hi_α`` (:func:`pedestrian.kernels.masks.key_bounds`, made on the host, one
  ``(3, B | 1, T)`` array on the device): the forward and ``dq`` visit only the key tiles between
  the block's smallest ``lo`` and largest ``hi``, ``dk``/``dv`` mask per entry; a row with no key
  in a tile so far keeps ``m = −∞`` and is shifted by 0 (EQUATIONS.md "Masks as key ranges").
- **Widths.** Any ``d_qk``, ``d_head``: a tile's columns are padded to a power of two (at least
  16) and the padding masked on load (zeros) and store. ``T`` need not be a multiple of a block.
- **Dtypes.** float32 (products in IEEE float32, no TF32, float32 sums) and float64 (float64
  throughout); the scale ``1/√d_qk`` is a compile-time constant of the input's precision.

Explicit fallbacks (:mod:`pedestrian.kernels.attention`'s GPU path, the reference layers and the
tiled torch loop): a KV-cache step (``kv_cache``), data of another dtype (float16, bfloat16),
arrays that are not torch tensors, CPU tensors unless ``TRITON_INTERPRET=1`` (Triton's interpreter,
the tests' way), a sliding window, packed segments or a score soft-cap (the tiled torch loop, which
masks by per-row key bounds), head widths above :data:`MAX_WIDTH`, no tokens, more than 65,535
(batch row, head) pairs (:func:`supported`); ``keep_delta_causal=True`` and
:func:`attention_weights` (``O(T²)`` arrays for pictures) recompute from this cache with the tiled
torch loop. The model has no dropout on attention weights, so none is needed here.
"""

from __future__ import annotations

import math
import os

import triton
import triton.language as tl

from ..layers.attention import KVBlock, check_kv_heads

__all__ = ["MAX_WIDTH", "attention_weights", "multi_head_attention_backward", "multi_head_attention_forward",
           "supported"]

#: the widest head (``d_qk``, ``d_head``) the kernels take; wider heads run the fallback
MAX_WIDTH = 256


@triton.jit
def _row_bounds(BOUNDS, bounds_b, hi_off, b, offs_m, row_ok, T):
    """Rows ``offs_m`` of sequence ``b``: the first visible key and one past the last
    (:func:`pedestrian.kernels.masks.key_bounds`' ``lo`` and ``hi`` planes; rows past ``T`` see none)."""
    row_lo = tl.load(BOUNDS + b.to(tl.int64) * bounds_b + offs_m, mask=row_ok, other=T)
    row_hi = tl.load(BOUNDS + hi_off + b.to(tl.int64) * bounds_b + offs_m, mask=row_ok, other=0)
    return row_lo, row_hi


@triton.jit
def _forward_kernel(QKV, O, LSE, BOUNDS, T, stride_b, stride_t, o_stride_b, o_stride_t, bounds_b, hi_off,
                    H: tl.constexpr, GROUP: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr,
                    P_QK: tl.constexpr, P_V: tl.constexpr, SCALE: tl.constexpr, CAUSAL: tl.constexpr,
                    MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``m⁽ʲ⁾ = max(m⁽ʲ⁻¹⁾, max_β S_αβ)``, ``l⁽ʲ⁾ = e^{m⁽ʲ⁻¹⁾−m⁽ʲ⁾} l⁽ʲ⁻¹⁾ + Σ_β e^{S_αβ−m⁽ʲ⁾}``,
    ``u⁽ʲ⁾ = e^{m⁽ʲ⁻¹⁾−m⁽ʲ⁾} u⁽ʲ⁻¹⁾ + Σ_β e^{S_αβ−m⁽ʲ⁾} v_β``; ``out = u/l``, ``ℓ = m + log l``
    (EQUATIONS.md, "Tiled attention"). One query block of one head; ``O`` ``(B, T, H·D_V)``,
    ``LSE`` ``(B·H, T)``. ``MASKED``: query ``α`` sees keys ``lo_α <= β < hi_α`` (a sliding window,
    packed segments; ``BOUNDS`` of :func:`pedestrian.kernels.masks.key_bounds`, row ``b`` at
    ``b · bounds_b``, ``hi`` ``hi_off`` after ``lo``)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // GROUP
    base = QKV + b.to(tl.int64) * stride_b
    q_col, k_col, v_col = h * D_QK, H * D_QK + kvh * D_QK, H * D_QK + (H // GROUP) * D_QK + kvh * D_V
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    cq, cv = tl.arange(0, P_QK), tl.arange(0, P_V)
    row_ok = offs_m < T
    q = tl.load(base + offs_m[:, None] * stride_t + q_col + cq[None, :],
                mask=row_ok[:, None] & (cq[None, :] < D_QK), other=0.0)              # q_I (BLOCK_M, P_QK)
    m_i = tl.full([BLOCK_M], float("-inf"), q.dtype)
    l_i = tl.zeros([BLOCK_M], q.dtype)
    acc = tl.zeros([BLOCK_M, P_V], q.dtype)
    if MASKED:                                                                        # the keys the rows see
        row_lo, row_hi = _row_bounds(BOUNDS, bounds_b, hi_off, b, offs_m, row_ok, T)
        lo = (tl.min(row_lo, 0) // BLOCK_N) * BLOCK_N
        hi = tl.max(row_hi, 0)
    else:
        lo = 0
        hi = tl.minimum(start_m + BLOCK_M, T) if CAUSAL else T                        # no tile above the diagonal
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        col_ok = offs_n < T
        kt = tl.load(base + offs_n[None, :] * stride_t + k_col + cq[:, None],
                     mask=col_ok[None, :] & (cq[:, None] < D_QK), other=0.0)          # k_Jᵀ (P_QK, BLOCK_N)
        v = tl.load(base + offs_n[:, None] * stride_t + v_col + cv[None, :],
                    mask=col_ok[:, None] & (cv[None, :] < D_V), other=0.0)            # v_J (BLOCK_N, P_V)
        allowed = col_ok[None, :]
        if MASKED:
            allowed = allowed & (offs_n[None, :] >= row_lo[:, None]) & (offs_n[None, :] < row_hi[:, None])
        elif CAUSAL:
            allowed = allowed & (offs_n[None, :] <= offs_m[:, None])
        s = tl.dot(q, kt, input_precision="ieee", out_dtype=q.dtype) * SCALE          # S_IJ
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))                                         # finite: key 0 is in tile 0
        m_use = m_new
        if MASKED:                                                                    # a row with no key yet: 0,
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)                      # not e^{−∞ + ∞}
        alpha = tl.exp(m_i - m_use)                                                   # e^{m_old − m_new} <= 1
        p = tl.where(allowed, tl.exp(s - m_use[:, None]), 0.0)                        # e^{S − m_new}
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee", out_dtype=q.dtype)
        m_i = m_new
    if MASKED:                                                                        # rows past T see no key:
        l_i = tl.where(row_ok, l_i, 1.0)                                              # 1, not 0/0 (not stored)
    out = acc / l_i[:, None]
    tl.store(O + b.to(tl.int64) * o_stride_b + offs_m[:, None] * o_stride_t + h * D_V + cv[None, :], out,
             mask=row_ok[:, None] & (cv[None, :] < D_V))
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, m_i + tl.log(l_i), mask=row_ok)


@triton.jit
def _row_term_kernel(DO, O, DR, T, stride_b, stride_t, H: tl.constexpr, D_V: tl.constexpr, P_V: tl.constexpr,
                     BLOCK_M: tl.constexpr):
    """``D_α = rowsum(Δ ∘ out)_α = rowsum(dP ∘ P)_α`` (EQUATIONS.md, "Tiled attention"): one query
    block of one head; ``DO``, ``O`` ``(B, T, H·D_V)`` with the same strides, ``DR`` ``(B·H, T)``."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    offs_m = start_m + tl.arange(0, BLOCK_M)
    cv = tl.arange(0, P_V)
    ok = (offs_m[:, None] < T) & (cv[None, :] < D_V)
    at = b.to(tl.int64) * stride_b + offs_m[:, None] * stride_t + h * D_V + cv[None, :]
    do = tl.load(DO + at, mask=ok, other=0.0)
    o = tl.load(O + at, mask=ok, other=0.0)
    tl.store(DR + bh.to(tl.int64) * T + offs_m, tl.sum(do * o, 1), mask=offs_m < T)


@triton.jit
def _dkdv_kernel(QKV, DO, LSE, DR, DQKV, BOUNDS, T, stride_b, stride_t, do_stride_b, do_stride_t, bounds_b, hi_off,
                 H: tl.constexpr, GROUP: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr,
                 P_QK: tl.constexpr, P_V: tl.constexpr, SCALE: tl.constexpr, CAUSAL: tl.constexpr,
                 MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``dv_J = Σ_h Σ_I P_IJᵀ Δ_I``, ``dk_J = Σ_h Σ_I Δcausal_IJᵀ q_I /√d_qk`` with
    ``P_IJ = exp(S_IJ − ℓ_I)``, ``Δcausal_IJ = P_IJ ∘ (Δ_I v_Jᵀ − D_I)`` (EQUATIONS.md, "Tiled
    attention", "Grouped-query attention"): one key block of one key/value head, summed over its
    group's query heads ``h`` in order and over the query blocks ``I`` that see it. Computed
    transposed (keys as rows). ``DQKV`` shaped and strided like ``QKV``."""
    start_n = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1)
    H_KV: tl.constexpr = H // GROUP
    b, kvh = bkv // H_KV, bkv % H_KV
    base, dbase = QKV + b.to(tl.int64) * stride_b, DQKV + b.to(tl.int64) * stride_b
    k_col, v_col = H * D_QK + kvh * D_QK, H * D_QK + H_KV * D_QK + kvh * D_V
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    cq, cv = tl.arange(0, P_QK), tl.arange(0, P_V)
    col_ok = offs_n < T
    k = tl.load(base + offs_n[:, None] * stride_t + k_col + cq[None, :],
                mask=col_ok[:, None] & (cq[None, :] < D_QK), other=0.0)               # k_J (BLOCK_N, P_QK)
    v = tl.load(base + offs_n[:, None] * stride_t + v_col + cv[None, :],
                mask=col_ok[:, None] & (cv[None, :] < D_V), other=0.0)                # v_J (BLOCK_N, P_V)
    dk = tl.zeros([BLOCK_N, P_QK], k.dtype)
    dv = tl.zeros([BLOCK_N, P_V], k.dtype)
    lo = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0                               # no tile above the diagonal
    for member in range(GROUP):                                              # the group's query heads, in order
        h = kvh * GROUP + member
        bh = b * H + h
        for start_m in range(lo, T, BLOCK_M):
            offs_m = start_m + offs_m0
            row_ok = offs_m < T
            qt = tl.load(base + offs_m[None, :] * stride_t + h * D_QK + cq[:, None],
                         mask=row_ok[None, :] & (cq[:, None] < D_QK), other=0.0)      # q_Iᵀ (P_QK, BLOCK_M)
            dot_ = tl.load(DO + b.to(tl.int64) * do_stride_b + offs_m[None, :] * do_stride_t + h * D_V + cv[:, None],
                           mask=row_ok[None, :] & (cv[:, None] < D_V), other=0.0)     # Δ_Iᵀ (P_V, BLOCK_M)
            ell = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=row_ok, other=0.0)
            d_row = tl.load(DR + bh.to(tl.int64) * T + offs_m, mask=row_ok, other=0.0)
            allowed = col_ok[:, None] & row_ok[None, :]
            if MASKED:
                row_lo, row_hi = _row_bounds(BOUNDS, bounds_b, hi_off, b, offs_m, row_ok, T)
                allowed = allowed & (offs_n[:, None] >= row_lo[None, :]) & (offs_n[:, None] < row_hi[None, :])
            elif CAUSAL:
                allowed = allowed & (offs_n[:, None] <= offs_m[None, :])
            st = tl.dot(k, qt, input_precision="ieee", out_dtype=k.dtype) * SCALE      # S_IJᵀ
            pt = tl.where(allowed, tl.exp(st - ell[None, :]), 0.0)                    # P_IJᵀ, 0 where masked
            dv += tl.dot(pt, tl.trans(dot_), input_precision="ieee", out_dtype=k.dtype)   # += P_IJᵀ Δ_I
            dpt = tl.dot(v, dot_, input_precision="ieee", out_dtype=k.dtype)          # dP_IJᵀ = v_J Δ_Iᵀ
            dst = tl.where(allowed, pt * (dpt - d_row[None, :]), 0.0)                 # Δcausal_IJᵀ
            dk += tl.dot(dst, tl.trans(qt), input_precision="ieee", out_dtype=k.dtype)    # += Δcausal_IJᵀ q_I
    tl.store(dbase + offs_n[:, None] * stride_t + k_col + cq[None, :], dk * SCALE,
             mask=col_ok[:, None] & (cq[None, :] < D_QK))
    tl.store(dbase + offs_n[:, None] * stride_t + v_col + cv[None, :], dv,
             mask=col_ok[:, None] & (cv[None, :] < D_V))


@triton.jit
def _dq_kernel(QKV, DO, LSE, DR, DQKV, BOUNDS, T, stride_b, stride_t, do_stride_b, do_stride_t, bounds_b, hi_off,
               H: tl.constexpr, GROUP: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr,
               P_QK: tl.constexpr, P_V: tl.constexpr, SCALE: tl.constexpr, CAUSAL: tl.constexpr,
               MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``dq_I = Σ_J Δcausal_IJ k_J /√d_qk`` with ``P_IJ = exp(S_IJ − ℓ_I)``,
    ``Δcausal_IJ = P_IJ ∘ (Δ_I v_Jᵀ − D_I)`` (EQUATIONS.md, "Tiled attention"): one query block
    of one query head, over the key blocks it sees.

    Taken as ``Σ_J Δcausal_IJ (k_J − k_0)``: equal, since each row of ``Δcausal`` sums to 0, and
    the rounding left in that row sum is then scaled by the keys' spread, not by a large common
    part of them (the reference's float32 correction, with key 0 -- which every query sees -- in
    place of the mean over all keys, so nothing after a query's position enters its ``dq``)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // GROUP
    base = QKV + b.to(tl.int64) * stride_b
    k_col, v_col = H * D_QK + kvh * D_QK, H * D_QK + (H // GROUP) * D_QK + kvh * D_V
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    cq, cv = tl.arange(0, P_QK), tl.arange(0, P_V)
    row_ok = offs_m < T
    q = tl.load(base + offs_m[:, None] * stride_t + h * D_QK + cq[None, :],
                mask=row_ok[:, None] & (cq[None, :] < D_QK), other=0.0)               # q_I (BLOCK_M, P_QK)
    do = tl.load(DO + b.to(tl.int64) * do_stride_b + offs_m[:, None] * do_stride_t + h * D_V + cv[None, :],
                 mask=row_ok[:, None] & (cv[None, :] < D_V), other=0.0)               # Δ_I (BLOCK_M, P_V)
    ell = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=row_ok, other=0.0)
    d_row = tl.load(DR + bh.to(tl.int64) * T + offs_m, mask=row_ok, other=0.0)
    k0 = tl.load(base + k_col + cq, mask=cq < D_QK, other=0.0)                       # key 0: every query sees it
    dq = tl.zeros([BLOCK_M, P_QK], q.dtype)
    if MASKED:                                                                        # the keys the rows see
        row_lo, row_hi = _row_bounds(BOUNDS, bounds_b, hi_off, b, offs_m, row_ok, T)
        lo = (tl.min(row_lo, 0) // BLOCK_N) * BLOCK_N
        hi = tl.max(row_hi, 0)
    else:
        lo = 0
        hi = tl.minimum(start_m + BLOCK_M, T) if CAUSAL else T                        # no tile above the diagonal
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        col_ok = offs_n < T
        k = tl.load(base + offs_n[:, None] * stride_t + k_col + cq[None, :],
                    mask=col_ok[:, None] & (cq[None, :] < D_QK), other=0.0)           # k_J (BLOCK_N, P_QK)
        vt = tl.load(base + offs_n[None, :] * stride_t + v_col + cv[:, None],
                     mask=col_ok[None, :] & (cv[:, None] < D_V), other=0.0)           # v_Jᵀ (P_V, BLOCK_N)
        allowed = row_ok[:, None] & col_ok[None, :]
        if MASKED:
            allowed = allowed & (offs_n[None, :] >= row_lo[:, None]) & (offs_n[None, :] < row_hi[:, None])
        elif CAUSAL:
            allowed = allowed & (offs_n[None, :] <= offs_m[:, None])
        s = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=q.dtype) * SCALE     # S_IJ
        p = tl.where(allowed, tl.exp(s - ell[:, None]), 0.0)                          # P_IJ, 0 where masked
        dp = tl.dot(do, vt, input_precision="ieee", out_dtype=q.dtype)                # dP_IJ = Δ_I v_Jᵀ
        ds = tl.where(allowed, p * (dp - d_row[:, None]), 0.0)                        # Δcausal_IJ
        dq += tl.dot(ds, k - k0[None, :], input_precision="ieee", out_dtype=q.dtype)  # += Δcausal_IJ (k_J − k_0)
    tl.store(DQKV + b.to(tl.int64) * stride_b + offs_m[:, None] * stride_t + h * D_QK + cq[None, :], dq * SCALE,
             mask=row_ok[:, None] & (cq[None, :] < D_QK))


def _width(d: int) -> int:
    """A tile's columns for a head width ``d``: the next power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(d))


#: ``(block_m, block_n)``, query rows and key columns of every call's tiles (powers of two, at
#: least 16 on a GPU), or ``None``: :func:`default_tiles` per call. A setting for tests and tuning
#: (the tests set small tiles so that a few tokens span several), not part of the contract's signature.
TILES: tuple | None = None


def default_tiles(d_qk: int, d_head: int, dtype) -> tuple:
    """``(block_m, block_n)`` for a GPU: 64 × 64 float32 tiles up to width 64, narrower key blocks
    for wider heads and float64 (registers). Not tuned on a GPU yet (docs/kernels.md)."""
    wide = max(d_qk, d_head) > 64
    if str(dtype).endswith("float64"):
        return (32, 16) if wide else (32, 32)
    return (64, 32) if wide else (64, 64)


def _interpreted() -> bool:
    """``TRITON_INTERPRET`` asks for Triton's interpreter (as :func:`pedestrian.gpu.interpreting`)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def supported(qkv, d_qk: int, d_head: int, kv_cache=None, n_heads: int = 1, window=None, segments=None,
              softcap=None) -> bool:
    """Whether these kernels run this call (else the fallback, module docstring): a torch tensor of
    float32 / float64 on a CUDA device (or any device under ``TRITON_INTERPRET=1``), no KV cache,
    no score soft-cap (the tiled torch loop runs it; a sliding window and packed segments run
    here), head widths
    up to :data:`MAX_WIDTH`, at least one token and ``B·n_heads`` within a CUDA grid's second axis
    (65,535)."""
    import torch

    return (kv_cache is None and softcap is None
            and isinstance(qkv, torch.Tensor) and qkv.dtype in (torch.float32, torch.float64)
            and (qkv.device.type == "cuda" or _interpreted()) and max(d_qk, d_head) <= MAX_WIDTH
            and qkv.ndim == 3 and qkv.shape[1] > 0 and 0 < qkv.shape[0] * n_heads <= 65_535)


def _check_blocks(block_m: int, block_n: int, on_gpu: bool) -> None:
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 1 or value & (value - 1) or (on_gpu and value < 16):
            raise ValueError(f"attention TILES: {name}={value} must be a power of two (at least 16 on a "
                             "GPU); set e.g. pedestrian.gpu.attention.TILES = (32, 32), or None")


def multi_head_attention_forward(qkv, n_heads: int, d_qk: int, d_head: int, *, causal: bool = True,
                                 kv_cache: KVBlock | None = None, n_kv_heads: int | None = None,
                                 window: int | None = None, segments=None, softcap: float | None = None,
                                 scale: float | None = None):
    """``out = softmax(q kᵀ/√d_qk, causal mask) v`` per head, ``ℓ = log Σ_β exp(S_αβ)`` per query
    row (EQUATIONS.md, "One attention head", "Tiled attention", "Grouped-query attention").

    Args, returns and errors of :func:`pedestrian.layers.multi_head_attention_forward`:
        qkv: ``(B, T, n_heads·d_qk + n_kv_heads·(d_qk + d_head))`` torch tensor on a CUDA device
            (float32 or float64); other calls run the fallback (module docstring).
        n_heads, d_qk, d_head, causal, kv_cache, n_kv_heads, scale: as the reference's.
        window, segments: as the reference's (the rows' key bounds, host-made: ``segments`` are
            read to the host once); softcap: as the reference's, run by the fallback (:func:`supported`).
        (The tiles: :data:`TILES`.)

    Returns:
        ``(a3, cache)``: ``a3`` ``(B, T, n_heads·d_head)``; the cache holds ``qkv`` (not copied),
        ``a3``, ``ℓ`` ``(B·n_heads, T)`` and the layout: ``O(T)`` beside ``qkv``.

    Raises:
        ValueError: ``n_kv_heads`` not a divisor of ``n_heads``; a :data:`TILES` size that is not a
            power of two; ``qkv``'s last axis not ``n_heads·d_qk + n_kv_heads·(d_qk + d_head)`` wide.
    """
    if not supported(qkv, d_qk, d_head, kv_cache, n_heads, window, segments, softcap):
        from ..kernels.attention import on_device_forward

        return on_device_forward(qkv, n_heads, d_qk, d_head, causal=causal, kv_cache=kv_cache, n_kv_heads=n_kv_heads,
                                 window=window, segments=segments, softcap=softcap, scale=scale)
    scale = 1.0 / math.sqrt(d_qk) if scale is None else float(scale)
    n_kv = check_kv_heads(n_heads, n_kv_heads)
    B, T, width = qkv.shape
    if width != n_heads * d_qk + n_kv * (d_qk + d_head):
        raise ValueError(f"qkv has {width} columns but n_heads={n_heads}, n_kv_heads={n_kv}, d_qk={d_qk}, "
                         f"d_head={d_head} need {n_heads * d_qk + n_kv * (d_qk + d_head)}; pass the fused projection")
    bm, bn = default_tiles(d_qk, d_head, qkv.dtype) if TILES is None else TILES
    _check_blocks(bm, bn, qkv.device.type == "cuda")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    out = qkv.new_empty((B, T, n_heads * d_head))
    lse = qkv.new_empty((B * n_heads, T))
    masked = window is not None or segments is not None
    host, bounds = _bounds(B, T, causal, window, segments, qkv) if masked else (None, lse)   # (lse: unread)
    b_stride, hi_off = (T if bounds.shape[1] > 1 else 0, bounds.shape[1] * T) if masked else (0, 0)
    _forward_kernel[(triton.cdiv(T, bm), B * n_heads)](
        qkv, out, lse, bounds, T, qkv.stride(0), qkv.stride(1), out.stride(0), out.stride(1), b_stride, hi_off,
        H=n_heads, GROUP=n_heads // n_kv, D_QK=d_qk, D_V=d_head, P_QK=_width(d_qk), P_V=_width(d_head),
        SCALE=scale, CAUSAL=bool(causal), MASKED=masked, BLOCK_M=bm, BLOCK_N=bn)
    return out, dict(gpu_flash=True, qkv=qkv, out=out, lse=lse, n_heads=n_heads, n_kv_heads=n_kv, d_qk=d_qk,
                     d_head=d_head, causal=bool(causal), blocks=(bm, bn), scale=scale,
                     mask=(masked, bounds, b_stride, hi_off), host_bounds=host)


def _bounds(B: int, T: int, causal: bool, window, segments, like):
    """:func:`pedestrian.kernels.masks.key_bounds` ``(3, B | 1, T)``: ``(on the host, on like's device)``."""
    import torch

    from ..kernels.masks import key_bounds

    host = None if segments is None else (segments.cpu().numpy() if isinstance(segments, torch.Tensor)
                                          else segments)
    bounds = key_bounds(B, T, causal, window, host)
    return bounds, torch.from_numpy(bounds).to(like.device)


def multi_head_attention_backward(delta, cache, *, keep_delta_causal: bool = False):
    """``D = rowsum(Δ ∘ out)``, ``P = exp(S − ℓ)``, ``Δcausal = P ∘ (Δ vᵀ − D)``, ``dv = Pᵀ Δ``,
    ``dq = Δcausal k/√d_qk``, ``dk = Δcausalᵀ q/√d_qk`` tile by tile, a group's ``dk``, ``dv``
    summed (EQUATIONS.md, "Tiled attention", "Grouped-query attention").

    Args, returns and errors of :func:`pedestrian.layers.multi_head_attention_backward`:
        delta: ``Δ3`` ``(B, T, n_heads·d_head)``.
        cache: from :func:`multi_head_attention_forward` (a fallback's cache runs the fallback's backward).
        keep_delta_causal: also return ``Δcausal`` ``(B, n_heads, T, T)``: computed by the tiled
            torch loop from this cache (``O(T²)`` memory, on request only).

    Returns:
        ``(delta_qkv, delta_causal)``: shaped like ``qkv``; ``Δcausal`` or ``None``.
    """
    if not cache.get("gpu_flash"):
        from ..kernels.attention import on_device_backward

        return on_device_backward(delta, cache, keep_delta_causal=keep_delta_causal)
    if keep_delta_causal:
        from ..kernels.attention_tiled import tiled_attention_backward

        return tiled_attention_backward(delta, _tiled_cache(cache), keep_delta_causal=True)
    qkv, out, lse = cache["qkv"], cache["out"], cache["lse"]
    n_heads, n_kv, d_qk, d_head = cache["n_heads"], cache["n_kv_heads"], cache["d_qk"], cache["d_head"]
    bm, bn = cache["blocks"]
    B, T, _ = qkv.shape
    if delta.shape != out.shape:
        raise ValueError(f"delta has shape {tuple(delta.shape)} but the forward's output has {tuple(out.shape)}; "
                         "pass Δ3 of this attention's output")
    if delta.stride(-1) != 1 or delta.stride() != out.stride():
        delta = delta.contiguous()                                            # (the row term reads both alike)
    masked, bounds, b_stride, hi_off = cache["mask"]
    layout = dict(H=n_heads, GROUP=n_heads // n_kv, D_QK=d_qk, D_V=d_head, P_QK=_width(d_qk), P_V=_width(d_head),
                  SCALE=cache["scale"], CAUSAL=cache["causal"], MASKED=masked, BLOCK_M=bm, BLOCK_N=bn)
    d_row = lse.new_empty((B * n_heads, T))
    _row_term_kernel[(triton.cdiv(T, bm), B * n_heads)](
        delta, out, d_row, T, out.stride(0), out.stride(1), H=n_heads, D_V=d_head, P_V=_width(d_head), BLOCK_M=bm)
    delta_qkv = qkv.new_empty(qkv.shape)
    strides = (bounds, T, qkv.stride(0), qkv.stride(1), delta.stride(0), delta.stride(1), b_stride, hi_off)
    _dkdv_kernel[(triton.cdiv(T, bn), B * n_kv)](qkv, delta, lse, d_row, delta_qkv, *strides, **layout)
    _dq_kernel[(triton.cdiv(T, bm), B * n_heads)](qkv, delta, lse, d_row, delta_qkv, *strides, **layout)
    return delta_qkv, None


def _tiled_cache(cache) -> dict:
    """This forward's cache in :func:`pedestrian.kernels.attention_tiled.tiled_attention_forward`'s
    layout (``q/√d_qk`` and ``k``, ``v`` split by head), for its ``O(T²)`` functions."""
    qkv, n_heads, n_kv, d_qk = cache["qkv"], cache["n_heads"], cache["n_kv_heads"], cache["d_qk"]
    B, T, _ = qkv.shape
    hq, hk = n_heads * d_qk, n_kv * d_qk

    def split(a, heads):                                                      # (B, T, heads·w) -> (B·heads, T, w)
        return a.reshape(B, T, heads, -1).transpose(1, 2).reshape(B * heads, T, -1)

    return dict(tiled=True, q=split(qkv[..., :hq], n_heads) * cache["scale"], scale=cache["scale"],
                bounds=cache.get("host_bounds"), plain=cache.get("host_bounds") is None,
                k=split(qkv[..., hq:hq + hk], n_kv), v=split(qkv[..., hq + hk:], n_kv), out=cache["out"],
                lse=cache["lse"], d_qk=d_qk, n_heads=n_heads, n_kv_heads=n_kv, causal=cache["causal"],
                blocks=cache["blocks"])


def attention_weights(cache):
    """``P = exp(q kᵀ/√d_qk − ℓ)`` (EQUATIONS.md, "Tiled attention"): ``(B, n_heads, T, T)`` of a
    :func:`multi_head_attention_forward` cache, recomputed by the tiled torch loop's
    :func:`~pedestrian.kernels.attention_tiled.tiled_attention_weights` (``O(T²)``, for pictures;
    a fallback's cache: the fallback's weights)."""
    if not cache.get("gpu_flash"):
        from ..kernels.attention import on_device_weights

        return on_device_weights(cache)
    from ..kernels.attention_tiled import tiled_attention_weights

    return tiled_attention_weights(_tiled_cache(cache))

"""Fast kernels for multi-head attention (reference: :mod:`pedestrian.layers.attention`, sections 3-4).

The same formulas as the reference, arranged for speed: the scale ``1/√d_qk`` is folded into
``q`` once (on PyTorch's CPU with ``log₂e``: the softmax then takes ``2^x``, the same numbers
for a third to a half of the cost, :func:`pedestrian.kernels.blas.uses_exp2`; ``dk``, a product
with that ``q``, is divided by ``log₂e``), the scores are overwritten in place by the softmax (one
``(B, H, T, T)`` array per block instead of three), ``dP`` becomes ``Δcausal`` in place, heads
are written straight into their column blocks of ``a3`` and of the signal at ``qkv`` (no
concatenation copies). On NumPy arrays each head's forward and backward is one iteration of a
numba loop over the heads (:mod:`pedestrian.kernels.attention_loops`: heads over the threads,
products on a single-threaded BLAS, the softmax one pass per row, the causal mask a loop bound),
and so is a KV-cache step of a few tokens.

From :data:`pedestrian.kernels.attention_tiled.TILED_MIN_T` tokens on, the forward runs the tiled
kernel of :mod:`pedestrian.kernels.attention_tiled` instead (``O(T)`` memory, causal blocks
skipped, heads over threads); the backward and :func:`attention_weights` follow the cache.
"""

from __future__ import annotations

import math

from array_api_compat import device

from ..backend import array_namespace, is_numpy_array, is_torch_array
from ..layers.attention import KVBlock, attention_mask
from .attention_tiled import tiled_attention_backward, tiled_attention_forward, tiled_attention_weights, use_tiled
from . import attention_loops, blas
from .blas import copy_into, elementwise_lib, matmul_into, rowdot
from .jit import blas_one_thread
from .workspace import empty_array, scratch

_MASKS: dict = {}
#: a KV-cache step of at most this many new tokens runs as one numba loop nest
#: (:func:`pedestrian.kernels.attention_loops.decode_attention`; its products are loops, not BLAS)
DECODE_MAX_T = 8


def causal_mask(T: int, like):
    """Additive ``(T, T)`` mask: ``0`` on and below the diagonal, ``−∞`` above; built once per
    ``(T, dtype, backend, device)`` and reused (no per-step allocation)."""
    xp = array_namespace(like)
    dev = device(like)
    key = (T, str(like.dtype), type(like).__module__, str(dev))
    mask = _MASKS.get(key)
    if mask is None:
        pos = xp.arange(T, device=dev)
        zeros = xp.zeros((T, T), dtype=like.dtype, device=dev)
        mask = xp.where(pos[None, :] > pos[:, None], xp.full_like(zeros, -math.inf), zeros)
        _MASKS[key] = mask
    return mask


def softmax_backward_into(delta_p, p, out) -> None:
    """``out = P ∘ (dP − rowsum(dP ∘ P))`` (``out`` may be ``delta_p`` itself)."""
    lib = elementwise_lib(p)
    rowsum = rowdot(delta_p, p)                            # Σ_β dP_αβ P_αβ, no temporary
    lib.subtract(delta_p, rowsum, out=out)
    lib.multiply(out, p, out=out)


def multi_head_attention_forward(qkv, n_heads: int, d_qk: int, d_head: int, *, causal: bool = True,
                                 kv_cache: KVBlock | None = None):
    """Fast :func:`pedestrian.layers.attention.multi_head_attention_forward` (same arguments and
    results; the cache's ``q`` carries the ``1/√d_qk`` scale, times ``log₂e`` where the softmax
    takes ``2^x``: the cache's ``unit``). Long sequences
    (:func:`pedestrian.kernels.attention_tiled.use_tiled`) run the tiled kernel, whose cache holds
    no ``P``."""
    if kv_cache is not None:
        return _cached_attention(qkv, n_heads, d_qk, d_head, causal, kv_cache)
    B, T, _ = qkv.shape
    if use_tiled(T, qkv):
        return tiled_attention_forward(qkv, n_heads, d_qk, d_head, causal=causal)
    hq, hv = n_heads * d_qk, n_heads * d_head

    def heads(lo, width):                                    # (B, T, H·w) -> (B, H, T, w) view
        return qkv[..., lo:lo + n_heads * width].reshape(B, T, n_heads, width).swapaxes(1, 2)

    unit, exp, _ = blas.softmax_exp(qkv)                     # scores in units of ln 2, or 1
    if attention_loops.USE and is_numpy_array(qkv) and unit == 1.0:      # numba: heads over the threads
        blas_one_thread()
        q, k = (empty_array((B, n_heads, T, d_qk), qkv) for _ in range(2))
        v, p = empty_array((B, n_heads, T, d_head), qkv), empty_array((B, n_heads, T, T), qkv)
        out = empty_array((B, T, hv), qkv)
        attention_loops.heads_forward.sized(p.size)(qkv, causal, 1.0 / math.sqrt(d_qk), q, k, v, p, out)
        return out, dict(q=q, k=k, v=v, p=p, d_qk=d_qk, unit=unit, causal=causal)
    q_raw, k, v = heads(0, d_qk), heads(hq, d_qk), heads(2 * hq, d_head)
    if is_torch_array(qkv):
        # torch's batched matmul copies a head-interleaved operand on every use (it needs one
        # stride over (B, H)); one copy each here also serves the backward's three uses
        k, v = k.contiguous(), v.contiguous()
    q = empty_array((B, n_heads, T, d_qk), qkv)              # q · unit / √d_qk (the scale folded in)
    p = empty_array((B, n_heads, T, T), qkv)
    out = empty_array((B, T, hv), qkv)                       # heads' P v side by side (a3)
    out_heads = out.reshape(B, T, n_heads, d_head).swapaxes(1, 2)
    mask = causal_mask(T, qkv) if causal else None
    lib = elementwise_lib(qkv)
    copy_into(q, q_raw)                                      # (a head of width 1 is a column:
    lib.multiply(q, unit / math.sqrt(d_qk), out=q)           # scaled once contiguous)
    matmul_into(p, q, k.mT)                                  # scores S (B, H, T, T), × unit
    if mask is not None:
        lib.add(p, mask, out=p)
    lib.subtract(p, lib.amax(p, axis=-1, keepdims=True), out=p)
    exp(p, out=p)
    lib.divide(p, lib.sum(p, axis=-1, keepdims=True), out=p)
    matmul_into(out_heads, p, v)                             # P v
    return out, dict(q=q, k=k, v=v, p=p, d_qk=d_qk, unit=unit, causal=causal)


def _cached_attention(qkv, n_heads, d_qk, d_head, causal, kv_cache: KVBlock):
    """Attention of ``T`` new tokens against every cached one; writes their keys and values."""
    B, T, _ = qkv.shape
    hq, hv = n_heads * d_qk, n_heads * d_head
    L0, L = kv_cache.length, kv_cache.length + T
    keys, values = kv_cache.keys, kv_cache.values
    unit, exp, _ = blas.softmax_exp(qkv)                     # as in the forward above
    if (attention_loops.USE and T <= DECODE_MAX_T and unit == 1.0 and type(qkv) is type(keys)
            and is_numpy_array(qkv) and keys.flags.c_contiguous and values.flags.c_contiguous):
        return _decode(qkv, n_heads, d_qk, d_head, causal, kv_cache)
    if d_qk == d_head:                                       # q, k, v heads at once: (B, 3H, T, d)
        heads = qkv.reshape(B, T, 3 * n_heads, d_qk).swapaxes(1, 2)
        keys[:, :, L0:L, :] = heads[:, n_heads:2 * n_heads]
        values[:, :, L0:L, :] = heads[:, 2 * n_heads:]
        q = heads[:, :n_heads] * (unit / math.sqrt(d_qk))
    else:
        keys[:, :, L0:L, :] = qkv[..., hq:2 * hq].reshape(B, T, n_heads, d_qk).swapaxes(1, 2)
        values[:, :, L0:L, :] = qkv[..., 2 * hq:].reshape(B, T, n_heads, d_head).swapaxes(1, 2)
        q = qkv[..., :hq].reshape(B, T, n_heads, d_qk).swapaxes(1, 2) * (unit / math.sqrt(d_qk))
    k, v = keys[:, :, :L, :], values[:, :, :L, :]
    s = q @ k.mT                                             # (B, H, T, L), × unit
    if (causal and T > 1) or kv_cache.key_start is not None:
        allowed = attention_mask(T, L, causal=causal, key_start=kv_cache.key_start, like=qkv)
        xp = array_namespace(s)
        s = xp.where(allowed, s, xp.full_like(s, -math.inf))
    lib = elementwise_lib(s)                                 # NumPy: amax, sum are the ufuncs' reduces
    lib.subtract(s, lib.amax(s, axis=-1, keepdims=True), out=s)
    exp(s, out=s)
    lib.divide(s, lib.sum(s, axis=-1, keepdims=True), out=s)
    out = (s @ v).swapaxes(1, 2).reshape(B, T, hv)           # (B, T, H·d_head)
    return out, dict(q=q, k=k, v=v, p=s, d_qk=d_qk, unit=unit, kv_cache=True)


def _decode(qkv, n_heads, d_qk, d_head, causal, kv_cache: KVBlock):
    """:func:`_cached_attention` as one numba call (:func:`pedestrian.kernels.attention_loops.decode_attention`)."""
    import numpy as np

    B, T, _ = qkv.shape
    L0, L = kv_cache.length, kv_cache.length + T
    key_start = (np.zeros(B, dtype=np.int64) if kv_cache.key_start is None
                 else np.asarray(kv_cache.key_start, dtype=np.int64).reshape(B))
    q = np.empty((B, n_heads, T, d_qk), dtype=qkv.dtype)
    p = np.empty((B, n_heads, T, L), dtype=qkv.dtype)
    out = np.empty((B, T, n_heads * d_head), dtype=qkv.dtype)
    attention_loops.decode_attention(np.ascontiguousarray(qkv), kv_cache.keys, kv_cache.values, L0, key_start,
                                     causal, 1.0 / math.sqrt(d_qk), q, p, out)
    k, v = kv_cache.keys[:, :, :L, :], kv_cache.values[:, :, :L, :]
    return out, dict(q=q, k=k, v=v, p=p, d_qk=d_qk, unit=1.0, kv_cache=True)


def multi_head_attention_backward(delta, cache, *, keep_delta_causal: bool = False):
    """Fast :func:`pedestrian.layers.attention.multi_head_attention_backward` (``Δcausal``, when
    kept, is computed block by block for a tiled cache)."""
    if cache.get("kv_cache"):
        raise ValueError("no backward through a KV-cache forward; run model.forward without a cache")
    if cache.get("tiled"):
        return tiled_attention_backward(delta, cache, keep_delta_causal=keep_delta_causal)
    q, k, v, p = cache["q"], cache["k"], cache["v"], cache["p"]
    B, H, T, d_head = v.shape
    d_qk, unit = cache["d_qk"], cache["unit"]
    hq, hv = H * d_qk, H * d_head
    delta_qkv = empty_array((B, T, 2 * hq + hv), p)
    kept = empty_array(p.shape, p) if keep_delta_causal else None
    lib = elementwise_lib(p)
    if attention_loops.USE and is_numpy_array(p) and unit == 1.0:        # numba: heads over the threads
        blas_one_thread()
        attention_loops.heads_backward.sized(p.size)(
            delta, q, k, v, p, cache.get("causal", True), 1.0 / math.sqrt(d_qk), keep_delta_causal,
            kept if keep_delta_causal else p[:1, :1, :1, :1], delta_qkv)
        return delta_qkv, kept

    def heads(lo, width):                                     # column block as (B, H, T, w) view
        return delta_qkv[..., lo:lo + H * width].reshape(B, T, H, width).swapaxes(1, 2)

    d_out = delta.reshape(B, T, H, d_head).swapaxes(1, 2)     # head h's columns of Δ
    if is_torch_array(p):
        d_out = d_out.contiguous()                            # used twice (see the forward)
    dq_all, dk_all, dv_all = heads(0, d_qk), heads(hq, d_qk), heads(2 * hq, d_head)

    matmul_into(dv_all, p.mT, d_out)                          # dv = Pᵀ Δ
    delta_causal = kept if kept is not None else scratch(p.shape, p, "attention.dP")
    matmul_into(delta_causal, d_out, v.mT)                    # dP = Δ vᵀ
    softmax_backward_into(delta_causal, p, delta_causal)      # Δcausal
    dq = scratch(q.shape, p, "attention.dq")                  # contiguous, then into its columns
    matmul_into(dq, delta_causal, k)                          # dq = Δraw k
    lib.multiply(dq, 1.0 / math.sqrt(d_qk), out=dq)
    copy_into(dq_all, dq)
    dk = scratch(dk_all.shape, p, "attention.dk")             # dk = Δrawᵀ q (q carries 1/√d_qk
    matmul_into(dk, delta_causal.mT, q)                       # and unit: take it out)
    if unit != 1.0:
        lib.multiply(dk, 1.0 / unit, out=dk)
    copy_into(dk_all, dk)
    return delta_qkv, kept


def attention_weights(cache):
    """``P`` ``(B, n_heads, T, L)`` of a :func:`multi_head_attention_forward` cache (recomputed
    from ``q``, ``k`` and the log-sum-exp for a tiled cache)."""
    if cache.get("tiled"):
        return tiled_attention_weights(cache)
    return cache["p"]

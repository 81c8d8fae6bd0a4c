"""Fast kernels for multi-head attention (reference: :mod:`pedestrian.layers.attention`, sections 3-4).

The same formulas as the reference, arranged for speed: the scale ``1/√d_qk`` is folded into
``q`` once, the scores are overwritten in place by the softmax (one ``(B, H, T, T)`` array per
block instead of three), ``dP`` becomes ``Δcausal`` in place, heads are written straight into
their column blocks of ``a3`` and of the signal at ``qkv`` (no concatenation copies). Each head's
forward and backward is one iteration of a numba loop over the heads
(:mod:`pedestrian.kernels.attention_loops`: heads over the threads, products on a single-threaded
BLAS, the softmax one pass per row, the causal mask a loop bound), and so is a KV-cache step of a
few tokens. Grouped-query attention: query head ``h`` reads key/value head ``h // g``; each query
head's ``dk``, ``dv`` go to scratch and a second loop sums each group's, in head order.

From :data:`pedestrian.kernels.attention_tiled.TILED_MIN_T` tokens on, the forward runs the tiled
kernel of :mod:`pedestrian.kernels.attention_tiled` instead (``O(T)`` memory, causal blocks
skipped, heads over threads); the backward and :func:`attention_weights` follow the cache.
The ``on_device_*`` functions are what torch tensors on a GPU run (:mod:`pedestrian.kernels`).
"""

from __future__ import annotations

import math

import numpy as np

from .. import layers
from ..layers.attention import KVBlock, check_cache_heads, check_kv_heads, check_mask_args, ring_slots
from ..layers.checks import check_float
from . import attention_loops, schedule
from .attention_tiled import tiled_attention_backward, tiled_attention_forward, tiled_attention_weights, use_tiled
from .jit import blas_one_thread
from .masks import key_bounds
from .workspace import empty_array

def multi_head_attention_forward(qkv, n_heads: int, d_qk: int, d_head: int, *, causal: bool = True,
                                 kv_cache: KVBlock | None = None, n_kv_heads: int | None = None,
                                 window: int | None = None, segments=None, softcap: float | None = None,
                                 scale: float | None = None):
    """``out_h = softmax(mask(cap(q_h k_{g(h)}ᵀ · scale))) v_{g(h)}`` per head, the heads side by
    side, ``g(h) = h // (n_heads / n_kv_heads)``; ``q, k, v`` the columns of ``qkv`` (EQUATIONS.md,
    "One attention head", "Multi-head attention", "Grouped-query attention", "Sliding window",
    "Packed segments", "Score scale and soft-cap").

    Fast :func:`pedestrian.layers.attention.multi_head_attention_forward` (same arguments and
    results; the cache's ``q`` carries the scale). Long sequences
    (:func:`pedestrian.kernels.attention_tiled.use_tiled`) run the tiled kernel, whose cache holds
    no ``P``."""
    check_float(qkv, "qkv")
    n_kv = check_kv_heads(n_heads, n_kv_heads)
    check_mask_args(qkv, kv_cache, window, segments, softcap)
    scale = 1.0 / math.sqrt(d_qk) if scale is None else float(scale)
    if kv_cache is not None:
        return _cached_attention(qkv, n_heads, d_qk, d_head, causal, kv_cache, n_kv, window, softcap, scale)
    B, T, _ = qkv.shape
    if use_tiled(T, qkv):
        return tiled_attention_forward(qkv, n_heads, d_qk, d_head, causal=causal, n_kv_heads=n_kv, window=window,
                                       segments=segments, softcap=softcap, scale=scale)
    bounds = key_bounds(B, T, causal, window, segments)
    cap = 0.0 if softcap is None else float(softcap)
    blas_one_thread()                                        # heads over numba's threads
    q, k = empty_array((B, n_heads, T, d_qk), qkv), empty_array((B, n_kv, T, d_qk), qkv)
    v, p = empty_array((B, n_kv, T, d_head), qkv), empty_array((B, n_heads, T, T), qkv)
    out = empty_array((B, T, n_heads * d_head), qkv)
    attention_loops.heads_forward(qkv, bounds, cap, scale, q, k, v, p, out)
    return out, dict(q=q, k=k, v=v, p=p, d_qk=d_qk, causal=causal, bounds=bounds, cap=cap, scale=scale)


def _cached_attention(qkv, n_heads, d_qk, d_head, causal, kv_cache: KVBlock, n_kv, window, softcap, scale):
    """Attention of ``T`` new tokens against every cached one; writes their keys and values. A
    few tokens: one numba loop nest (a sliding-window ring in its frame, :func:`ring_frame`); more
    (a prompt): the reference."""
    keys, values = kv_cache.keys, kv_cache.values
    check_cache_heads(kv_cache, n_kv)
    if qkv.shape[1] <= schedule.DECODE_MAX_T and keys.flags.c_contiguous and values.flags.c_contiguous:
        if kv_cache.window is None:
            return _decode(qkv, n_heads, d_qk, d_head, causal, kv_cache, window, softcap, scale)
        frame, start = ring_frame(kv_cache, qkv.shape[1])
        out = _decode(qkv, n_heads, d_qk, d_head, causal, frame, kv_cache.window, softcap, scale, start)
        ring_keep(kv_cache, frame, qkv.shape[1])
        return out
    out, cache = layers.multi_head_attention_forward(qkv, n_heads, d_qk, d_head, causal=causal, kv_cache=kv_cache,
                                                     n_kv_heads=n_kv, window=window, softcap=softcap, scale=scale)
    return out, dict(cache, kv_cache=True)


def ring_frame(kv_cache: KVBlock, T: int) -> tuple[KVBlock, int]:
    """``(frame, start)``: a sliding-window ring's step of ``T`` tokens as
    :func:`~pedestrian.kernels.attention_loops.decode_attention` reads it (the reference's
    ``_ring_step``): ``length = held``, the cached tokens a new query can still see
    (:func:`~pedestrian.layers.attention.ring_slots`), then the ``T`` new ones, the left padding
    counted in that frame. When they fit in the ring (``held + T <= w``: one token after a full
    window, or a short prompt) the frame is the ring itself, its index 0 at slot ``start``, and the
    step writes the new keys and values into their slots; else a copy in order (``start = 0``)
    whose new keys and values :func:`ring_keep` puts into the ring."""
    old, _ = ring_slots(kv_cache, T)
    w, shift = kv_cache.keys.shape[2], kv_cache.length - len(old)                     # shift: index of frame 0
    key_start = None if kv_cache.key_start is None else kv_cache.key_start - shift
    if len(old) + T <= w:
        return KVBlock(kv_cache.keys, kv_cache.values, len(old), key_start), (kv_cache.first + shift) % w
    B, H_kv, _, d_qk = kv_cache.keys.shape
    keys = np.empty((B, H_kv, len(old) + T, d_qk), kv_cache.keys.dtype)                  # (B, H_kv, held + T, d_qk)
    values = np.empty((B, H_kv, len(old) + T, kv_cache.values.shape[3]), kv_cache.values.dtype)
    keys[:, :, :len(old)], values[:, :, :len(old)] = kv_cache.keys[:, :, old], kv_cache.values[:, :, old]
    return KVBlock(keys, values, len(old), key_start), 0


def ring_keep(kv_cache: KVBlock, frame: KVBlock, T: int) -> None:
    """The last ``min(T, w)`` new keys and values of a copied :func:`ring_frame` into their ring
    slots (a frame that is the ring itself has them there already)."""
    if frame.keys is kv_cache.keys:
        return
    _, new = ring_slots(kv_cache, T)
    kv_cache.keys[:, :, new] = frame.keys[:, :, frame.length + T - len(new):frame.length + T]
    kv_cache.values[:, :, new] = frame.values[:, :, frame.length + T - len(new):frame.length + T]


def _decode(qkv, n_heads, d_qk, d_head, causal, kv_cache: KVBlock, window=None, softcap=None, scale=None, start=0):
    """:func:`_cached_attention` as one numba call (:func:`pedestrian.kernels.attention_loops.decode_attention`;
    ``start``: the slot of cache index 0, :func:`ring_frame`)."""
    B, T, _ = qkv.shape
    L0, L = kv_cache.length, kv_cache.length + T
    if L0 < 0 or L > kv_cache.keys.shape[2]:                # (numba writes past the cache)
        raise ValueError(f"a KV-cache step of {T} tokens at length {L0} does not fit the cache's "
                         f"capacity {kv_cache.keys.shape[2]}")
    key_start = (np.zeros(B, dtype=np.int64) if kv_cache.key_start is None
                 else np.asarray(kv_cache.key_start, dtype=np.int64).reshape(B))
    q = np.empty((B, n_heads, T, d_qk), dtype=qkv.dtype)
    p = np.empty((B, n_heads, T, L), dtype=qkv.dtype)
    out = np.empty((B, T, n_heads * d_head), dtype=qkv.dtype)
    attention_loops.decode_attention(np.ascontiguousarray(qkv), kv_cache.keys, kv_cache.values, L0, start, key_start,
                                     causal, 0 if window is None else int(window),
                                     0.0 if softcap is None else float(softcap),
                                     1.0 / math.sqrt(d_qk) if scale is None else scale, q, p, out)
    k, v = kv_cache.keys[:, :, :L, :], kv_cache.values[:, :, :L, :]     # (a ring read in place: its slots' order)
    return out, dict(q=q, k=k, v=v, p=p, d_qk=d_qk, kv_cache=True)


def multi_head_attention_backward(delta, cache, *, keep_delta_causal: bool = False):
    """Per head ``dv = Pᵀ Δ``, ``dP = Δ vᵀ``, ``Δcausal = P ∘ (dP − rowsum(dP ∘ P))``,
    ``dq = Δraw k``, ``dk = Δrawᵀ q`` with ``Δraw = Δcausal · scale`` (soft-capped:
    ``∘ (1 − tanh²(s/c))``), into the columns of ``Δqkv`` (EQUATIONS.md, "One attention head",
    "Score scale and soft-cap").

    Fast :func:`pedestrian.layers.attention.multi_head_attention_backward` (``Δcausal``, when
    kept, is computed block by block for a tiled cache)."""
    if cache.get("kv_cache"):
        raise ValueError("no backward through a KV-cache forward; run model.forward without a cache")
    if cache.get("tiled"):
        return tiled_attention_backward(delta, cache, keep_delta_causal=keep_delta_causal)
    q, k, v, p = cache["q"], cache["k"], cache["v"], cache["p"]
    (B, H, T, d_qk), n_kv, d_head = q.shape, k.shape[1], v.shape[3]
    delta_qkv = empty_array((B, T, H * d_qk + n_kv * (d_qk + d_head)), p)
    kept = empty_array(p.shape, p) if keep_delta_causal else None
    grouped = n_kv < H                                        # per-query-head dk, dv, then group sums
    dk_heads = empty_array((B, H, T, d_qk), p) if grouped else p[:1, :1, :1, :1]
    dv_heads = empty_array((B, H, T, d_head), p) if grouped else p[:1, :1, :1, :1]
    blas_one_thread()                                         # heads over numba's threads
    attention_loops.heads_backward(
        delta, q, k, v, p, cache["bounds"], cache["cap"], cache["scale"], keep_delta_causal,
        kept if keep_delta_causal else p[:1, :1, :1, :1], dk_heads, dv_heads, delta_qkv)
    return delta_qkv, kept


def attention_weights(cache):
    """``P = softmax(q kᵀ/√d_qk, causal mask)`` (EQUATIONS.md, "One attention head").

    ``P`` ``(B, n_heads, T, L)`` of a :func:`multi_head_attention_forward` cache (recomputed
    from ``q``, ``k`` and the log-sum-exp for a tiled cache)."""
    if cache.get("tiled"):
        return tiled_attention_weights(cache)
    return layers.attention_weights(cache)              # (a prompt's KV-cache step ran the reference: grouped P)


def on_device_forward(qkv, n_heads: int, d_qk: int, d_head: int, *, causal: bool = True,
                      kv_cache: KVBlock | None = None, n_kv_heads: int | None = None, window: int | None = None,
                      segments=None, softcap: float | None = None, scale: float | None = None):
    """``out_h = softmax(mask(cap(q_h k_{g(h)}ᵀ · scale))) v_{g(h)}`` per head (EQUATIONS.md,
    "Multi-head attention", "Grouped-query attention"; by tiles: "Tiled attention").

    The forward for torch tensors on a GPU: the tiled kernel's torch loop from
    :data:`pedestrian.kernels.attention_tiled.TILED_MIN_T` tokens on (``O(T)`` memory), else the
    reference (same arguments and results as :func:`multi_head_attention_forward`)."""
    mask = dict(window=window, segments=segments, softcap=softcap, scale=scale)
    if kv_cache is None and use_tiled(qkv.shape[1], qkv):
        return tiled_attention_forward(qkv, n_heads, d_qk, d_head, causal=causal, n_kv_heads=n_kv_heads, **mask)
    return layers.multi_head_attention_forward(qkv, n_heads, d_qk, d_head, causal=causal, kv_cache=kv_cache,
                                               n_kv_heads=n_kv_heads, **mask)


def on_device_backward(delta, cache, *, keep_delta_causal: bool = False):
    """``dv = Pᵀ Δ``, ``Δcausal = P ∘ (Δ vᵀ − rowsum(Δ ∘ out))``, ``dq = Δcausal k/√d_qk``,
    ``dk = Δcausalᵀ q/√d_qk`` per head (EQUATIONS.md, "One attention head", "Tiled attention").

    The backward of :func:`on_device_forward` (its cache says which one ran)."""
    backward = tiled_attention_backward if cache.get("tiled") else layers.multi_head_attention_backward
    return backward(delta, cache, keep_delta_causal=keep_delta_causal)


def on_device_weights(cache):
    """``P = softmax(q kᵀ/√d_qk, causal mask)`` (EQUATIONS.md, "One attention head").

    ``P`` of an :func:`on_device_forward` cache."""
    return tiled_attention_weights(cache) if cache.get("tiled") else layers.attention_weights(cache)

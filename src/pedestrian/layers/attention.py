"""Scaled dot-product attention: one head (paper section 3) and multi-head (section 4).

Shapes follow EQUATIONS.md: a head maps ``x (B, T, d)`` to ``q, k (B, T, d_qk)`` (the paper's
``d_ρ``) and ``v (B, T, d_head)``; scores ``S = q kᵀ / √d_qk`` are ``(B, T, T)``. The causal
mask sets future scores (key position β > query position α) to ``−∞`` before the softmax, so
they get probability exactly 0 -- the paper writes a Hadamard product with a 0/1 matrix, which
taken literally is wrong (``exp(0) = 1``); its own check code uses ``−∞``.

Multi-head attention is the section-3 head batched over heads by a reshape: the fused
projection ``qkv = x [Wq | Wk | Wv] + [bq | bk | bv]`` is cut into ``n_heads`` column blocks of
each part, the heads run side by side on a ``(B, n_heads, T, ·)`` axis, and their outputs are
concatenated. In the backward the heads' signals at ``q``, ``k``, ``v`` are concatenated the same
way, so that the caller's ``Δ_{i-1} = d_qkv [Wq | Wk | Wv]ᵀ`` *is* the section-4 sum over heads
``Σ_h (dq_h Wq_hᵀ + dk_h Wk_hᵀ + dv_h Wv_hᵀ)``.

Grouped-query attention (Llama, Qwen2, Mistral; EQUATIONS.md "Grouped-query attention"):
``n_kv_heads`` key/value heads, each shared by a group of ``n_heads / n_kv_heads`` query heads.
The forward broadcasts each key/value head over its group (an axis of length 1 against the
group's queries, no copy); the backward sums the group's ``dk``, ``dv`` over that axis.

Reference implementation: the paper's math only, written against the array API standard.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..backend import array_namespace
from .checks import check_float
from .linear import linear_backward, linear_forward


class KVBlock(NamedTuple):
    """One block's slice of a KV cache, as the attention layers see it (paper section 3 side note).

    Attributes:
        keys: ``(B, n_heads, capacity, d_qk)``; values: ``(B, n_heads, capacity, d_head)``.
        length: tokens cached before this call; the new ones are written at ``length …``.
        key_start: ``(B,)`` integer array, the first real key of each row (left padding before
            it is never attended to), or ``None`` when no row is padded.
        window: ``None``, or a sliding window ``w`` whose arrays are a ring of ``capacity = w``
            slots: the token of cache index ``p`` lives in slot ``(first + p) mod w`` and only the
            last ``w`` are held (a sliding-window block's cache, :mod:`pedestrian.model.kv_cache`).
        first: the ring's count of tokens dropped before cache index 0 (``drop_oldest``).
    """

    keys: object
    values: object
    length: int
    key_start: object = None
    window: int | None = None
    first: int = 0


def attention_mask(T: int, L: int, *, causal: bool, key_start=None, like=None, window: int | None = None,
                   segments=None):
    """Boolean ``(T, L)`` (or ``(B, 1, T, L)`` with ``key_start`` or ``segments``) of the scores a query may use.

    Query ``α`` sits at position ``i = L − T + α`` (the last ``T`` of ``L`` tokens, so a KV-cache step
    continues the cached ones); with ``causal`` it may use keys ``j <= i``; with a sliding
    ``window`` ``w`` only ``i − w < j`` of them (Mistral, Gemma 2; transformers'
    ``sliding_window_causal_mask_function``); with ``segments`` ``(B, L)`` (ids of packed
    conversations, ``L == T``) only keys of its own segment, ``segments[b, j] == segments[b, i]``.
    Keys before ``key_start[b]`` are row ``b``'s left padding: no query uses them, except a padding
    query its own key (so every row of scores keeps one finite entry).
    """
    xp = array_namespace(like)
    query_pos = xp.arange(L - T, L, device=like.device)[:, None]             # (T, 1)
    key_pos = xp.arange(L, device=like.device)[None, :]                      # (1, L)
    allowed = key_pos <= query_pos if causal else xp.ones((T, L), dtype=xp.bool, device=like.device)
    if window is not None:
        allowed = allowed & (key_pos > query_pos - window)                   # i − w < j
    if segments is not None:
        same = segments[:, -T:, None] == segments[:, None, :]                # (B, T, L)
        allowed = allowed & same[:, None]                                    # (B, 1, T, L)
    if key_start is None:
        return allowed                                                       # (T, L) or (B, 1, T, L)
    start = xp.reshape(key_start, (-1, 1, 1, 1))                             # (B, 1, 1, 1)
    return allowed & ((key_pos >= start) | (key_pos == query_pos))           # (B, 1, T, L)


def segment_mean(a, segments=None, active=None):
    """Per key row ``j`` of ``a`` ``(B, heads…, L, w)``: the mean of the rows of ``j``'s segment
    (``segments`` ``(B, L)``; ``None``: one segment) that are ``active`` (``(B, heads…, L, 1)``
    booleans; ``None``: all), and 0 on the rows that are not active.

    The float32 correction of the attention backward (:func:`scaled_dot_product_attention_backward`)
    takes its means with it: over a segment's keys only, and over the keys that get a gradient,
    so that a key no query with an error signal sees keeps a gradient of exactly 0.
    """
    xp = array_namespace(a)
    w = xp.ones_like(a[..., :1]) if active is None else xp.astype(active, a.dtype)   # (…, L, 1)
    if segments is None:
        count = xp.sum(w, axis=-2, keepdims=True)                           # (…, 1, 1)
        return xp.sum(a * w, axis=-2, keepdims=True) / xp.maximum(count, xp.ones_like(count)) * w
    same = xp.astype(segments[:, :, None] == segments[:, None, :], a.dtype)   # (B, L, L)
    same = xp.reshape(same, (same.shape[0],) + (1,) * (a.ndim - 3) + same.shape[1:])
    count = same @ w                                                         # (…, L, 1)
    return (same @ (a * w)) / xp.maximum(count, xp.ones_like(count)) * w     # (…, L, w)


def softmax_forward(scores):
    """Row-wise softmax over the last axis; ``−∞`` entries get exactly 0.

    The row max is subtracted first, so scores of magnitude ``1e4`` stay finite. Every row
    must hold at least one finite entry (true with a causal mask: the diagonal).
    """
    xp = array_namespace(scores)
    e = xp.exp(scores - xp.max(scores, axis=-1, keepdims=True))
    return e / xp.sum(e, axis=-1, keepdims=True)


def softmax_backward(delta_p, p):
    """``Δcausal = P ∘ (dP − rowsum(dP ∘ P))`` (EQUATIONS.md; the paper's Δcausal).

    Each row sums to zero because each row of ``P`` sums to one; masked entries are exactly 0
    because ``P`` is 0 there.
    """
    xp = array_namespace(p)
    return p * (delta_p - xp.sum(delta_p * p, axis=-1, keepdims=True))


def scaled_dot_product_attention_forward(q, k, v, allowed=None, *, scale: float | None = None,
                                          softcap: float | None = None, segments=None):
    """``out = softmax(mask(cap(q kᵀ · scale))) v`` over any leading axes (section 3; EQUATIONS.md
    "Score scale and soft-cap").

    Args:
        q: ``(..., T, d_qk)``; k: ``(..., L, d_qk)``; v: ``(..., L, d_head)``.
        allowed: boolean mask broadcastable to ``(..., T, L)`` (``False`` -> score ``−∞``), or ``None``.
        scale: the score scale (``None``: ``1/√d_qk``).
        softcap: ``c`` of the soft-cap ``s ↦ c·tanh(s/c)`` after the scale, before the mask (Gemma 2),
            or ``None``.
        segments: ``(B, L)`` segment ids the mask was made with (kept for the backward's means).

    Returns:
        ``(out, cache)``: ``out`` ``(..., T, d_head)``; ``cache`` holds ``q, k, v``, ``p`` (= ``P``) and,
        soft-capped, ``tanh(s/c)``.
    """
    xp = array_namespace(q)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ xp.matrix_transpose(k) * scale                              # S (..., T, L)
    tanh = None
    if softcap is not None:                                                  # S ↦ c·tanh(S/c)
        tanh = xp.tanh(scores / softcap)
        scores = softcap * tanh
    if allowed is not None:
        scores = xp.where(allowed, scores, xp.full_like(scores, -math.inf))
    p = softmax_forward(scores)                                              # P (..., T, L)
    if allowed is not None:                                                  # exactly 0 even when a
        p = xp.where(allowed, p, xp.zeros_like(p))                           # NaN row max made e NaN
    return p @ v, dict(q=q, k=k, v=v, p=p, allowed=allowed, scale=scale, tanh=tanh,  # (..., T, d_head)
                       segments=segments)


def scaled_dot_product_attention_backward(delta, cache):
    """Section 3's backward of :func:`scaled_dot_product_attention_forward` (EQUATIONS.md).

    ``dv = Pᵀ Δ``, ``dP = Δ vᵀ``, ``Δcausal = P ∘ (dP − rowsum(dP ∘ P))``, ``Δraw = Δcausal · scale``
    (soft-capped: ``Δraw = Δcausal ∘ (1 − tanh²(s/c)) · scale``), ``dq = Δraw k``, ``dk = Δrawᵀ q``.

    Returns:
        ``(dq, dk, dv, delta_causal)``, shaped like ``q, k, v`` and ``P``.
    """
    xp = array_namespace(delta)
    q, k, v, p = cache["q"], cache["k"], cache["v"], cache["p"]
    scale, tanh, segments = cache.get("scale", 1 / math.sqrt(q.shape[-1])), cache.get("tanh"), cache.get("segments")
    dv = xp.matrix_transpose(p) @ delta                                      # (..., L, d_head)
    dp = delta @ xp.matrix_transpose(v)                                      # (..., T, L)
    allowed = cache.get("allowed")
    if allowed is not None:                                                  # masked dP: 0 (a NaN in a
        dp = xp.where(allowed, dp, xp.zeros_like(dp))                        # value no query sees stays out)
    delta_causal = softmax_backward(dp, p)                                   # (..., T, L)
    if allowed is not None:                                                  # masked: exactly 0, also
        delta_causal = xp.where(allowed, delta_causal, xp.zeros_like(p))     # in a NaN row
    if tanh is not None:                                                     # through c·tanh(s/c)
        delta_raw = delta_causal * (1 - tanh * tanh) * scale
        return delta_raw @ k, xp.matrix_transpose(delta_raw) @ q, dv, delta_causal
    delta_raw = delta_causal * scale
    # rows of Δraw sum to 0 over their segment's keys, so dq = Δraw (k − k̄) and Σ_segment dk = 0:
    # the key mean k̄ and the rounding left in Σ dk, removed, would otherwise reach dq, dWk scaled
    # by |k̄|, |x̄| (float32). Means per segment, dk's over the keys with a gradient only: a key no
    # query with an error signal sees keeps dk = 0 exactly (EQUATIONS.md, "Exact zeros").
    dq = delta_raw @ (k - segment_mean(k, segments))                         # (..., T, d_qk)
    dk = xp.matrix_transpose(delta_raw) @ q                                  # (..., L, d_qk)
    dk = dk - segment_mean(dk, segments, xp.any(dk != 0, axis=-1, keepdims=True))   # (..., L, d_qk)
    return dq, dk, dv, delta_causal


def attention_head_forward(x, wq, bq, wk, bk, wv, bv, *, causal: bool = True):
    """One attention head with its projections, exactly as the paper's section 3.

    Args:
        x: ``(B, T, d)`` input ``a_{i-1}``.
        wq, wk: ``(d, d_qk)``; wv: ``(d, d_head)``; biases ``(d_qk,)``/``(d_head,)`` or ``None``.
        causal: apply the causal mask.

    Returns:
        ``(out, cache)``: ``out = P v`` ``(B, T, d_head)``; the cache holds ``x``, the weights and
        the attention cache (``q, k, v, P``; ``P`` is ``(B, T, T)``).
    """
    q, _ = linear_forward(x, wq, bq)                                         # (B, T, d_qk)
    k, _ = linear_forward(x, wk, bk)                                         # (B, T, d_qk)
    v, _ = linear_forward(x, wv, bv)                                         # (B, T, d_head)
    T = x.shape[1]
    allowed = attention_mask(T, T, causal=True, like=x) if causal else None
    out, attn = scaled_dot_product_attention_forward(q, k, v, allowed)      # (B, T, d_head)
    return out, dict(x=x, weights=(wq, wk, wv), attn=attn, p=attn["p"])


def attention_head_backward(delta, cache):
    """Backward of :func:`attention_head_forward` (EQUATIONS.md, "One attention head").

    Args:
        delta: ``(B, T, d_head)`` error signal ``Δ_i^h``.
        cache: from the forward.

    Returns:
        ``(delta_in, grads, delta_causal)``: ``delta_in`` ``(B, T, d)`` (the head's share of
        ``Δ_{i-1}``: ``dq Wqᵀ + dk Wkᵀ + dv Wvᵀ``); ``grads`` maps ``wq, bq, wk, bk, wv, bv`` to their
        gradients (``bk``'s is identically zero); ``delta_causal`` ``(B, T, T)``, rows summing to 0.
    """
    xp = array_namespace(delta)
    x = cache["x"]
    dq, dk, dv, delta_causal = scaled_dot_product_attention_backward(delta, cache["attn"])
    grads, delta_in = {}, None
    for name, d_out, w in (("q", dq, cache["weights"][0]), ("k", dk, cache["weights"][1]),
                           ("v", dv, cache["weights"][2])):
        grads["w" + name] = xp.zeros_like(w)
        grads["b" + name] = xp.zeros_like(w[0])
        d_in = linear_backward(d_out, x, w, dweight=grads["w" + name], dbias=grads["b" + name])
        delta_in = d_in if delta_in is None else delta_in + d_in
    return delta_in, grads, delta_causal


def _split_heads(a, n_heads: int):
    """``(B, T, n_heads·w)`` -> ``(B, n_heads, T, w)``: head ``h`` owns columns ``h·w … (h+1)·w``."""
    xp = array_namespace(a)
    B, T, width = a.shape
    return xp.permute_dims(xp.reshape(a, (B, T, n_heads, width // n_heads)), (0, 2, 1, 3))


def _merge_heads(a):
    """``(B, n_heads, T, w)`` -> ``(B, T, n_heads·w)``: the heads side by side (section 4's concat)."""
    xp = array_namespace(a)
    B, H, T, w = a.shape
    return xp.reshape(xp.permute_dims(a, (0, 2, 1, 3)), (B, T, H * w))


def _group(a, n_groups: int):
    """``(B, H, T, w)`` -> ``(B, n_kv_heads, g, T, w)`` with ``g = H / n_kv_heads`` query heads per group:
    query head ``h`` is member ``h mod g`` of group ``h // g`` (Hugging Face's ``repeat_kv`` order)."""
    xp = array_namespace(a)
    B, H, T, w = a.shape
    return xp.reshape(a, (B, n_groups, H // n_groups, T, w))


def qkv_width(n_heads: int, d_qk: int, d_head: int, n_kv_heads: int | None = None) -> int:
    """Columns of the fused ``qkv``: ``n_heads·d_qk`` (q) ``+ n_kv_heads·d_qk`` (k) ``+ n_kv_heads·d_head`` (v)."""
    n_kv = n_heads if n_kv_heads is None else n_kv_heads
    return n_heads * d_qk + n_kv * (d_qk + d_head)


def check_kv_heads(n_heads: int, n_kv_heads: int | None) -> int:
    """``n_kv_heads`` (``None``: ``n_heads``), checked to divide ``n_heads``.

    Raises:
        ValueError: ``n_kv_heads`` not a positive divisor of ``n_heads``.
    """
    if n_kv_heads is None:
        return n_heads
    if not 1 <= n_kv_heads <= n_heads or n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads} "
                         "(1: multi-query, n_heads: multi-head); choose a divisor of n_heads")
    return n_kv_heads


def check_cache_heads(kv_cache: KVBlock, n_kv_heads: int) -> None:
    """Raises ValueError when the cache's arrays do not hold ``n_kv_heads`` heads."""
    if kv_cache.keys.shape[1] != n_kv_heads or kv_cache.values.shape[1] != n_kv_heads:
        raise ValueError(f"the KV cache holds {kv_cache.keys.shape[1]} heads but the attention has "
                         f"n_kv_heads={n_kv_heads}; make the cache with n_kv_heads heads")


def multi_head_attention_forward(qkv, n_heads: int, d_qk: int, d_head: int, *, causal: bool = True,
                                 kv_cache: KVBlock | None = None, n_kv_heads: int | None = None,
                                 window: int | None = None, segments=None, softcap: float | None = None,
                                 scale: float | None = None):
    """All heads at once: the section-3 head batched over ``(B, n_heads)`` (section 4), with
    grouped-query attention (EQUATIONS.md "Grouped-query attention") when ``n_kv_heads < n_heads``.

    Args:
        qkv: ``(B, T, n_heads·d_qk + n_kv_heads·(d_qk + d_head))``, the fused projection
            ``x [Wq | Wk | Wv] + [bq | bk | bv]`` (query head ``h`` owns columns ``h·d_qk …`` of the
            q part, key/value head ``j`` columns ``j·d_qk …`` of k and ``j·d_head …`` of v).
        n_heads, d_qk, d_head: the query heads and the head widths (Hugging Face's ``head_dim``
            is ``d_qk = d_head``; it need not be ``d_model / n_heads``).
        causal: mask future keys.
        kv_cache: a :class:`KVBlock` with ``n_kv_heads`` heads: the new keys and values are
            written into it at ``length …`` and the queries attend to every cached token
            (generation); ``None`` for a plain forward.
        n_kv_heads: key/value heads, dividing ``n_heads`` (``None``: ``n_heads``, multi-head;
            1: multi-query). Query head ``h`` reads key/value head ``h // (n_heads / n_kv_heads)``
            (Hugging Face's ``repeat_kv``).
        window: sliding window ``w``: query ``i`` sees keys ``i − w < j <= i`` (``None``: all).
        segments: ``(B, T)`` integer segment ids, nondecreasing along ``T`` (packed sequences):
            query ``i`` sees key ``j`` only if ``segments[b, j] == segments[b, i]``; not with a cache.
        softcap: ``c``: scores ``s ↦ c·tanh(s/c)`` after the scale, before the mask (``None``: none).
        scale: the score scale (``None``: ``1/√d_qk``).

    Returns:
        ``(a3, cache)``: ``a3`` ``(B, T, n_heads·d_head)``, the heads' ``P v`` concatenated; the
        cache holds ``q`` ``(B, n_heads, T, d_qk)`` (grouped: ``(B, n_kv_heads, g, T, d_qk)``),
        ``k, v`` ``(B, n_kv_heads, L, ·)`` and ``p`` (``P``).

    Raises:
        TypeError: ``qkv`` not real floating point.
        ValueError: ``n_kv_heads`` not a divisor of ``n_heads``; a KV-cache step that does not fit
            the cache's capacity; ``segments`` with a cache or of the wrong shape.
    """
    check_float(qkv, "qkv")
    xp = array_namespace(qkv)
    n_kv = check_kv_heads(n_heads, n_kv_heads)
    check_mask_args(qkv, kv_cache, window, segments, softcap)
    hq, hk = n_heads * d_qk, n_kv * d_qk
    q = _split_heads(qkv[..., :hq], n_heads)                                 # (B, H, T, d_qk)
    k = _split_heads(qkv[..., hq:hq + hk], n_kv)                             # (B, H_kv, T, d_qk)
    v = _split_heads(qkv[..., hq + hk:], n_kv)                               # (B, H_kv, T, d_head)
    T = qkv.shape[1]
    key_start = None
    if kv_cache is not None and kv_cache.window is not None:                 # a ring of the last w
        k, v, key_start = _ring_step(kv_cache, k, v)
        window = kv_cache.window
    elif kv_cache is not None:                                               # append, attend to all
        check_cache_heads(kv_cache, n_kv)
        L0, L = kv_cache.length, kv_cache.length + T
        if L0 < 0 or L > kv_cache.keys.shape[2]:
            raise ValueError(f"a KV-cache step of {T} tokens at length {L0} does not fit the cache's "
                             f"capacity {kv_cache.keys.shape[2]}")
        kv_cache.keys[:, :, L0:L, :] = k
        kv_cache.values[:, :, L0:L, :] = v
        k, v, key_start = kv_cache.keys[:, :, :L, :], kv_cache.values[:, :, :L, :], kv_cache.key_start
    L = k.shape[2]
    masked = causal or key_start is not None or window is not None or segments is not None
    allowed = attention_mask(T, L, causal=causal, key_start=key_start, like=qkv, window=window,
                             segments=segments) if masked else None
    if n_kv < n_heads:                                                       # a group's heads share k, v
        q, k, v = _group(q, n_kv), xp.expand_dims(k, axis=2), xp.expand_dims(v, axis=2)  # (B, H_kv, g|1, ·, ·)
        allowed = None if allowed is None else (allowed if allowed.ndim == 2 else allowed[:, None])
    out, cache = scaled_dot_product_attention_forward(q, k, v, allowed, scale=scale, softcap=softcap,
                                                      segments=segments)    # (B, H, T, d_head) or grouped
    out = xp.reshape(out, (out.shape[0], n_heads, T, d_head))                # (B, H, T, d_head)
    return _merge_heads(out), dict(cache, n_kv_heads=n_kv)                   # (B, T, H·d_head)


def check_mask_args(qkv, kv_cache, window, segments, softcap) -> None:
    """Raises ValueError for a ``window`` below 1, a ``softcap`` not > 0, ``segments`` with a KV
    cache or not ``(B, T)`` (the shared checks of every attention kernel)."""
    if window is not None and (isinstance(window, bool) or int(window) != window or window < 1):
        raise ValueError(f"window must be a positive integer (keys i − w < j <= i), got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 (scores become c·tanh(s/c)), got {softcap!r}")
    if segments is None:
        return
    if kv_cache is not None:
        raise ValueError("segments (packed sequences) cannot be used with a KV cache; generate one "
                         "sequence per row instead")
    if tuple(segments.shape) != tuple(qkv.shape[:2]):
        raise ValueError(f"segments has shape {tuple(segments.shape)} but the tokens are "
                         f"{tuple(qkv.shape[:2])}; pass one segment id per token")


def ring_slots(kv_cache: KVBlock, T: int) -> tuple[list, list]:
    """``(old, new)``: the ring slots of a sliding-window block's step of ``T`` tokens -- ``old``, in
    order, those of the last ``min(length, w − 1)`` cached tokens a new query can still see; ``new``
    those the last ``min(T, w)`` new tokens go to, ``(first + p) mod w``. (This layer's step and the
    fused decode step, :mod:`pedestrian.model.decode`.)"""
    w, L0 = kv_cache.keys.shape[2], kv_cache.length
    held, n = min(L0, w - 1), min(T, w)
    return ([(kv_cache.first + p) % w for p in range(L0 - held, L0)],
            [(kv_cache.first + p) % w for p in range(L0 + T - n, L0 + T)])


def _ring_step(kv_cache: KVBlock, k, v):
    """A KV-cache step of a sliding-window block whose arrays are a ring of ``w`` slots: the keys
    and values the new queries may see -- the cached ones of :func:`ring_slots` (gathered in
    order) and the ``T`` new ones -- and the left padding in that frame; the new tokens' keys and
    values (the last ``w`` of them) are written into their slots."""
    xp = array_namespace(k)
    w, L0, T = kv_cache.keys.shape[2], kv_cache.length, k.shape[2]
    if kv_cache.window != w:
        raise ValueError(f"a sliding-window cache block holds {w} slots but its window is {kv_cache.window}")
    if kv_cache.keys.shape[1] != k.shape[1]:
        check_cache_heads(kv_cache, k.shape[1])
    old, new = ring_slots(kv_cache, T)
    keys = xp.concat([kv_cache.keys[:, :, old, :], k], axis=2)              # (B, H_kv, held + T, d_qk)
    values = xp.concat([kv_cache.values[:, :, old, :], v], axis=2)          # (B, H_kv, held + T, d_head)
    kv_cache.keys[:, :, new, :] = k[:, :, T - len(new):, :]
    kv_cache.values[:, :, new, :] = v[:, :, T - len(new):, :]
    key_start = None if kv_cache.key_start is None else kv_cache.key_start - (L0 - len(old))
    return keys, values, key_start


def multi_head_attention_backward(delta, cache, *, keep_delta_causal: bool = False):
    """Backward of :func:`multi_head_attention_forward` down to the fused ``qkv``.

    ``Δ3`` ``(B, T, n_heads·d_head)`` is cut into one column block per head, every head runs
    the section-3 backward (batched), and the heads' ``dq, dk, dv`` are concatenated into the
    signal at ``qkv`` (the caller's fused linear backward then sums over heads, module docstring).
    With grouped-query attention, a key/value head's ``dk``, ``dv`` are the sums over the query
    heads of its group (EQUATIONS.md "Grouped-query attention").

    Returns:
        ``(delta_qkv, delta_causal)``: shaped like ``qkv`` and, if asked, ``Δcausal``
        ``(B, n_heads, T, T)`` (else ``None``).

    Raises:
        ValueError: the forward ran against a KV cache (generation has no backward).
    """
    xp = array_namespace(delta)
    if cache["k"].shape[-2] != delta.shape[1]:
        raise ValueError("no backward through a KV-cache forward; run model.forward without a cache")
    B, T, _ = delta.shape
    n_heads = delta.shape[2] // cache["v"].shape[-1]
    n_kv = cache.get("n_kv_heads", n_heads)
    d = _split_heads(delta, n_heads)                                         # (B, H, T, d_head)
    if n_kv < n_heads:
        d = _group(d, n_kv)                                                  # (B, H_kv, g, T, d_head)
    dq, dk, dv, delta_causal = scaled_dot_product_attention_backward(d, cache)
    if n_kv < n_heads:                                                       # Σ over the group's heads
        dk, dv = xp.sum(dk, axis=2), xp.sum(dv, axis=2)                      # (B, H_kv, T, ·)
        dq = xp.reshape(dq, (B, n_heads, T, dq.shape[-1]))                   # (B, H, T, d_qk)
        delta_causal = xp.reshape(delta_causal, (B, n_heads, T, T))          # (B, H, T, T)
    delta_qkv = xp.concat([_merge_heads(dq), _merge_heads(dk), _merge_heads(dv)], axis=-1)
    return delta_qkv, (delta_causal if keep_delta_causal else None)


def attention_weights(cache):
    """``P`` ``(B, n_heads, T, L)`` of a :func:`multi_head_attention_forward` cache."""
    xp, p = array_namespace(cache["p"]), cache["p"]
    return xp.reshape(p, (p.shape[0], -1, *p.shape[-2:])) if p.ndim == 5 else p   # grouped: (B, H_kv, g, T, L)

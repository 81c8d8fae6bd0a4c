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
    """

    keys: object
    values: object
    length: int
    key_start: object = None


def attention_mask(T: int, L: int, *, causal: bool, key_start=None, like=None):
    """Boolean ``(T, L)`` (or ``(B, 1, T, L)`` with ``key_start``) of the scores a query may use.

    Query ``α`` sits at position ``L − T + α`` (the last ``T`` of ``L`` tokens, so a KV-cache step
    continues the cached ones); with ``causal`` it may use keys ``β <= L − T + α``. Keys before
    ``key_start[b]`` are row ``b``'s left padding: no query uses them, except a padding query
    its own key (so every row of scores keeps one finite entry).
    """
    xp = array_namespace(like)
    query_pos = xp.arange(L - T, L, device=like.device)[:, None]             # (T, 1)
    key_pos = xp.arange(L, device=like.device)[None, :]                      # (1, L)
    allowed = key_pos <= query_pos if causal else xp.ones((T, L), dtype=xp.bool, device=like.device)
    if key_start is None:
        return allowed                                                       # (T, L)
    start = xp.reshape(key_start, (-1, 1, 1, 1))                             # (B, 1, 1, 1)
    return allowed & ((key_pos >= start) | (key_pos == query_pos))           # (B, 1, T, L)


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


def scaled_dot_product_attention_forward(q, k, v, allowed=None):
    """``out = softmax(q kᵀ / √d_qk, masked) v`` over any leading axes (section 3).

    Args:
        q: ``(..., T, d_qk)``; k: ``(..., L, d_qk)``; v: ``(..., L, d_head)``.
        allowed: boolean mask broadcastable to ``(..., T, L)`` (``False`` -> score ``−∞``), or ``None``.

    Returns:
        ``(out, cache)``: ``out`` ``(..., T, d_head)``; ``cache`` holds ``q, k, v`` and ``p`` (= ``P``).
    """
    xp = array_namespace(q)
    scores = q @ xp.matrix_transpose(k) / math.sqrt(q.shape[-1])            # S (..., T, L)
    if allowed is not None:
        scores = xp.where(allowed, scores, xp.full_like(scores, -math.inf))
    p = softmax_forward(scores)                                              # P (..., T, L)
    if allowed is not None:                                                  # exactly 0 even when a
        p = xp.where(allowed, p, xp.zeros_like(p))                           # NaN row max made e NaN
    return p @ v, dict(q=q, k=k, v=v, p=p, allowed=allowed)                  # (..., T, d_head)


def scaled_dot_product_attention_backward(delta, cache):
    """Section 3's backward of :func:`scaled_dot_product_attention_forward` (EQUATIONS.md).

    ``dv = Pᵀ Δ``, ``dP = Δ vᵀ``, ``Δcausal = P ∘ (dP − rowsum(dP ∘ P))``, ``Δraw = Δcausal/√d_qk``,
    ``dq = Δraw k``, ``dk = Δrawᵀ q``.

    Returns:
        ``(dq, dk, dv, delta_causal)``, shaped like ``q, k, v`` and ``P``.
    """
    xp = array_namespace(delta)
    q, k, v, p = cache["q"], cache["k"], cache["v"], cache["p"]
    dv = xp.matrix_transpose(p) @ delta                                      # (..., L, d_head)
    dp = delta @ xp.matrix_transpose(v)                                      # (..., T, L)
    allowed = cache.get("allowed")
    if allowed is not None:                                                  # masked dP: 0 (a NaN in a
        dp = xp.where(allowed, dp, xp.zeros_like(dp))                        # value no query sees stays out)
    delta_causal = softmax_backward(dp, p)                                   # (..., T, L)
    if allowed is not None:                                                  # masked: exactly 0, also
        delta_causal = xp.where(allowed, delta_causal, xp.zeros_like(p))     # in a NaN row
    delta_raw = delta_causal / math.sqrt(q.shape[-1])
    # rows of Δraw sum to 0, so dq = Δraw (k − k̄) and Σ_keys dk = 0: the key mean k̄ and the
    # rounding left in Σ dk, removed, would otherwise reach dq, dWk scaled by |k̄|, |x̄| (float32)
    dq = delta_raw @ (k - xp.mean(k, axis=-2, keepdims=True))                # (..., T, d_qk)
    dk = xp.matrix_transpose(delta_raw) @ q                                  # (..., L, d_qk)
    dk = dk - xp.mean(dk, axis=-2, keepdims=True)                            # (..., L, d_qk)
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
                                 kv_cache: KVBlock | None = None, n_kv_heads: int | None = None):
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

    Returns:
        ``(a3, cache)``: ``a3`` ``(B, T, n_heads·d_head)``, the heads' ``P v`` concatenated; the
        cache holds ``q`` ``(B, n_heads, T, d_qk)`` (grouped: ``(B, n_kv_heads, g, T, d_qk)``),
        ``k, v`` ``(B, n_kv_heads, L, ·)`` and ``p`` (``P``).

    Raises:
        TypeError: ``qkv`` not real floating point.
        ValueError: ``n_kv_heads`` not a divisor of ``n_heads``; a KV-cache step that does not fit
            the cache's capacity.
    """
    check_float(qkv, "qkv")
    xp = array_namespace(qkv)
    n_kv = check_kv_heads(n_heads, n_kv_heads)
    hq, hk = n_heads * d_qk, n_kv * d_qk
    q = _split_heads(qkv[..., :hq], n_heads)                                 # (B, H, T, d_qk)
    k = _split_heads(qkv[..., hq:hq + hk], n_kv)                             # (B, H_kv, T, d_qk)
    v = _split_heads(qkv[..., hq + hk:], n_kv)                               # (B, H_kv, T, d_head)
    T = qkv.shape[1]
    key_start = None
    if kv_cache is not None:                                                 # append, attend to all
        check_cache_heads(kv_cache, n_kv)
        L0, L = kv_cache.length, kv_cache.length + T
        if L0 < 0 or L > kv_cache.keys.shape[2]:
            raise ValueError(f"a KV-cache step of {T} tokens at length {L0} does not fit the cache's "
                             f"capacity {kv_cache.keys.shape[2]}")
        kv_cache.keys[:, :, L0:L, :] = k
        kv_cache.values[:, :, L0:L, :] = v
        k, v, key_start = kv_cache.keys[:, :, :L, :], kv_cache.values[:, :, :L, :], kv_cache.key_start
    L = k.shape[2]
    allowed = attention_mask(T, L, causal=causal, key_start=key_start, like=qkv) \
        if causal or key_start is not None else None
    if n_kv < n_heads:                                                       # a group's heads share k, v
        q, k, v = _group(q, n_kv), xp.expand_dims(k, axis=2), xp.expand_dims(v, axis=2)  # (B, H_kv, g|1, ·, ·)
        allowed = None if allowed is None else (allowed if allowed.ndim == 2 else allowed[:, None])
    out, cache = scaled_dot_product_attention_forward(q, k, v, allowed)     # (B, H, T, d_head) or grouped
    out = xp.reshape(out, (out.shape[0], n_heads, T, d_head))                # (B, H, T, d_head)
    return _merge_heads(out), dict(cache, n_kv_heads=n_kv)                   # (B, T, H·d_head)


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

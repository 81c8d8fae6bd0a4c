"""Scaled dot-product attention: one head (paper section 3) and multi-head (section 4).

Shapes follow EQUATIONS.md: a head maps ``x (B, T, d)`` to ``q, k (B, T, d_qk)`` (the paper's
``d_ρ``) and ``v (B, T, d_head)``; scores ``S = q kᵀ / √d_qk`` are ``(B, T, T)``. The causal
mask sets future scores (key position β > query position α) to ``−∞`` before the softmax, so
they get probability exactly 0 -- the paper writes a Hadamard product with a 0/1 matrix, which
taken literally is wrong (``exp(0) = 1``); its own check code uses ``−∞``.
"""

from __future__ import annotations

import math

from array_api_compat import device

from ..backend import array_namespace
from .linear import linear_backward, linear_forward

_MASKS: dict = {}


def causal_mask(T: int, like):
    """Additive ``(T, T)`` mask: ``0`` on and below the diagonal, ``−∞`` above.

    Built once per ``(T, dtype, backend, device)`` and reused (no per-step allocation).
    """
    xp = array_namespace(like)
    dev = device(like)
    key = (T, str(like.dtype), type(like).__module__, str(dev))
    mask = _MASKS.get(key)
    if mask is None:
        pos = xp.arange(T, device=dev)
        future = pos[None, :] > pos[:, None]
        zeros = xp.zeros((T, T), dtype=like.dtype, device=dev)
        mask = xp.where(future, xp.full_like(zeros, -math.inf), zeros)
        _MASKS[key] = mask
    return mask


def softmax_rows(scores):
    """Row-wise softmax over the last axis; ``−∞`` entries get exactly 0.

    The row max is subtracted first, so scores of magnitude ``1e4`` stay finite. Every row
    must hold at least one finite entry (true with a causal mask: the diagonal).
    """
    xp = array_namespace(scores)
    e = xp.exp(scores - xp.max(scores, axis=-1, keepdims=True))
    e /= xp.sum(e, axis=-1, keepdims=True)
    return e


def softmax_backward(delta_p, p):
    """``Δ_S = P ∘ (dP − rowsum(dP ∘ P))`` (EQUATIONS.md; the paper's Δcausal).

    Each row of the result sums to zero because each row of ``P`` sums to one. Masked
    entries come out exactly 0 because ``P`` is 0 there.
    """
    xp = array_namespace(p)
    return p * (delta_p - xp.sum(delta_p * p, axis=-1, keepdims=True))


def attention_head_forward(x, wq, bq, wk, bk, wv, bv, *, causal: bool = True):
    """One attention head, written exactly as the paper's section 3 (for reading and testing).

    Args:
        x: ``(B, T, d)`` input ``a_{i-1}``.
        wq, wk: ``(d, d_qk)``; wv: ``(d, d_head)``; biases ``(d_qk,)``/``(d_head,)`` or ``None``.
        causal: apply the causal mask.

    Returns:
        ``(out, cache)``: ``out = P v`` of shape ``(B, T, d_head)``; the cache holds
        ``x, q, k, v, P`` (``P`` is ``(B, T, T)``).
    """
    xp = array_namespace(x)
    q, _ = linear_forward(x, wq, bq)
    k, _ = linear_forward(x, wk, bk)
    v, _ = linear_forward(x, wv, bv)
    d_qk = wq.shape[1]
    scores = (q @ xp.matrix_transpose(k)) / math.sqrt(d_qk)
    if causal:
        scores = scores + causal_mask(x.shape[1], x)
    p = softmax_rows(scores)
    return p @ v, dict(x=x, q=q, k=k, v=v, p=p, d_qk=d_qk, weights=(wq, wk, wv))


def attention_head_backward(delta, cache):
    """Backward of :func:`attention_head_forward` (EQUATIONS.md, "One attention head").

    Args:
        delta: ``(B, T, d_head)`` error signal ``Δ_i^h``.
        cache: from the forward.

    Returns:
        ``(delta_in, grads, delta_causal)``: ``delta_in`` ``(B, T, d)`` (the head's share of
        ``Δ_{i-1}``); ``grads`` maps ``wq, bq, wk, bk, wv, bv`` to their gradients
        (``bk``'s is identically zero); ``delta_causal`` is ``(B, T, T)`` with rows summing to 0.
    """
    xp = array_namespace(delta)
    x, q, k, v, p = cache["x"], cache["q"], cache["k"], cache["v"], cache["p"]
    wq, wk, wv = cache["weights"]
    dv = xp.matrix_transpose(p) @ delta                     # Pᵀ Δ
    dp = delta @ xp.matrix_transpose(v)                     # Δ vᵀ
    delta_causal = softmax_backward(dp, p)
    delta_raw = delta_causal / math.sqrt(cache["d_qk"])
    dq = delta_raw @ k
    dk = xp.matrix_transpose(delta_raw) @ q
    grads = {}
    delta_in = None
    for name, d_out, w in (("q", dq, wq), ("k", dk, wk), ("v", dv, wv)):
        d_in, grads["w" + name], grads["b" + name] = linear_backward(d_out, x, w)
        delta_in = d_in if delta_in is None else delta_in + d_in
    return delta_in, grads, delta_causal


def multi_head_attention_forward(qkv, n_heads: int, d_qk: int, d_head: int, *, causal: bool = True):
    """All heads at once, as batched matmuls over ``(B, n_heads)``.

    The q/k/v projections of every head are one fused fully connected layer computed by the
    caller: ``qkv = x [Wq | Wk | Wv] + [bq | bk | bv]``, with head ``h`` owning columns
    ``h·d_qk … (h+1)·d_qk`` of the q and k parts and ``h·d_head …`` of the v part.

    Args:
        qkv: ``(B, T, n_heads·(2·d_qk + d_head))``.

    Returns:
        ``(out, cache)``: ``out`` ``(B, T, n_heads·d_head)`` is the concatenation of the heads'
        ``P v`` (the paper's ``a3``); the cache holds ``q`` (pre-scaled by ``1/√d_qk``), ``k``,
        ``v`` as ``(B, n_heads, T, ·)`` and ``P`` as ``(B, n_heads, T, T)``.
    """
    xp = array_namespace(qkv)
    B, T, _ = qkv.shape
    hq, hv = n_heads * d_qk, n_heads * d_head

    def heads(part, width):                                  # (B, T, H·w) -> (B, H, T, w)
        return xp.permute_dims(xp.reshape(part, (B, T, n_heads, width)), (0, 2, 1, 3))

    q = heads(qkv[..., :hq], d_qk) * (1.0 / math.sqrt(d_qk))  # fold the scale into q
    k = heads(qkv[..., hq:2 * hq], d_qk)
    v = heads(qkv[..., 2 * hq:2 * hq + hv], d_head)
    scores = q @ xp.matrix_transpose(k)                      # (B, H, T, T)
    if causal:
        scores += causal_mask(T, scores)
    p = softmax_rows(scores)
    out = p @ v                                              # (B, H, T, d_head)
    out = xp.reshape(xp.permute_dims(out, (0, 2, 1, 3)), (B, T, hv))
    return out, dict(q=q, k=k, v=v, p=p, d_qk=d_qk)


def multi_head_attention_backward(delta, cache, *, keep_delta_causal: bool = False):
    """Backward of :func:`multi_head_attention_forward` down to the fused ``qkv``.

    The incoming ``Δ`` ``(B, T, n_heads·d_head)`` is sliced column-wise into one block per
    head; every head runs the section-3 backward (batched); the result is the signal at the
    fused ``qkv`` output. The caller's fused linear backward then forms ``Δ_{i-1} = dq Wqᵀ +
    dk Wkᵀ + dv Wvᵀ``, which *is* the sum over heads of each head's ``Δ_{i-1}^h``.

    Returns:
        ``(delta_qkv, delta_causal)``: ``(B, T, n_heads·(2·d_qk + d_head))`` and, if asked,
        ``Δcausal`` ``(B, n_heads, T, T)`` (else ``None``).
    """
    q, k, v, p = cache["q"], cache["k"], cache["v"], cache["p"]
    xp = array_namespace(p)
    B, H, T, d_head = v.shape
    d_qk = cache["d_qk"]
    hq, hv = H * d_qk, H * d_head
    d_out = xp.permute_dims(xp.reshape(delta, (B, T, H, d_head)), (0, 2, 1, 3))
    dv = xp.matrix_transpose(p) @ d_out                      # Pᵀ Δ
    dp = d_out @ xp.matrix_transpose(v)                      # Δ vᵀ
    delta_causal = softmax_backward(dp, p)                   # masked entries are 0 already
    dq = (delta_causal @ k) * (1.0 / math.sqrt(d_qk))        # Δraw k
    dk = xp.matrix_transpose(delta_causal) @ q               # Δrawᵀ q (q carries 1/√d_qk)
    delta_qkv = xp.empty((B, T, 2 * hq + hv), dtype=p.dtype, device=device(p))

    def merge(part):                                          # (B, H, T, w) -> (B, T, H·w)
        return xp.reshape(xp.permute_dims(part, (0, 2, 1, 3)), (B, T, -1))

    delta_qkv[..., :hq] = merge(dq)
    delta_qkv[..., hq:2 * hq] = merge(dk)
    delta_qkv[..., 2 * hq:] = merge(dv)
    return delta_qkv, (delta_causal if keep_delta_causal else None)

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

from ..backend import (array_namespace, elementwise_lib, empty_array, for_row_blocks, is_torch_array,
                       matmul_into, rowdot, scratch)
from .linear import linear_backward, linear_forward

_MASKS: dict = {}
#: elements of (B, H, T, T) per block: batched matmuls of small matrices want few, large calls
_BLOCK = 1 << 20


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


def softmax_backward(delta_p, p, *, out=None):
    """``Δ_S = P ∘ (dP − rowsum(dP ∘ P))`` (EQUATIONS.md; the paper's Δcausal).

    Each row of the result sums to zero because each row of ``P`` sums to one. Masked
    entries come out exactly 0 because ``P`` is 0 there.

    Args:
        delta_p: ``dP``, any shape ``(..., T)``; p: the softmax output, same shape.
        out: array to write the result into (may be ``delta_p`` itself); default a new one.
    """
    lib = elementwise_lib(p)
    if out is None:
        out = empty_array(p.shape, p)
    rowsum = rowdot(delta_p, p)                            # Σ_β dP_αβ P_αβ, no temporary
    lib.subtract(delta_p, rowsum, out=out)
    lib.multiply(out, p, out=out)
    return out


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
    B, T, _ = qkv.shape
    hq, hv = n_heads * d_qk, n_heads * d_head

    def heads(lo, width):                                    # (B, T, H·w) -> (B, H, T, w) view
        return qkv[..., lo:lo + n_heads * width].reshape(B, T, n_heads, width).swapaxes(1, 2)

    q_raw, k, v = heads(0, d_qk), heads(hq, d_qk), heads(2 * hq, d_head)
    if is_torch_array(qkv):
        # torch's batched matmul copies a head-interleaved operand on every use (it needs one
        # stride over (B, H)); one copy each here also serves the backward's three uses
        k, v = k.contiguous(), v.contiguous()
    q = empty_array((B, n_heads, T, d_qk), qkv)              # q / √d_qk (the scale folded in)
    p = empty_array((B, n_heads, T, T), qkv)
    out = empty_array((B, T, hv), qkv)                       # heads' P v side by side (a3)
    out_heads = out.reshape(B, T, n_heads, d_head).swapaxes(1, 2)
    mask = causal_mask(T, qkv) if causal else None
    lib = elementwise_lib(qkv)

    def kernel(lo: int, hi: int) -> None:                    # batch rows lo:hi
        qb, sb = q[lo:hi], p[lo:hi]
        lib.multiply(q_raw[lo:hi], 1.0 / math.sqrt(d_qk), out=qb)
        matmul_into(sb, qb, k[lo:hi].mT)                     # scores S (B, H, T, T)
        if mask is not None:
            lib.add(sb, mask, out=sb)
        lib.subtract(sb, lib.amax(sb, axis=-1, keepdims=True), out=sb)    # softmax_rows, in place
        lib.exp(sb, out=sb)
        lib.divide(sb, lib.sum(sb, axis=-1, keepdims=True), out=sb)
        matmul_into(out_heads[lo:hi], sb, v[lo:hi])          # P v

    for_row_blocks(qkv, kernel, B, n_heads * T * T, block=_BLOCK)
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
    B, H, T, d_head = v.shape
    d_qk = cache["d_qk"]
    hq, hv = H * d_qk, H * d_head
    delta_qkv = empty_array((B, T, 2 * hq + hv), p)
    kept = empty_array(p.shape, p) if keep_delta_causal else None
    lib = elementwise_lib(p)

    def heads(lo, width):                                     # column block as (B, H, T, w) view
        return delta_qkv[..., lo:lo + H * width].reshape(B, T, H, width).swapaxes(1, 2)

    d_out = delta.reshape(B, T, H, d_head).swapaxes(1, 2)     # head h's columns of Δ
    if is_torch_array(p):
        d_out = d_out.contiguous()                            # used twice (see the forward)
    dq_all, dk_all, dv_all = heads(0, d_qk), heads(hq, d_qk), heads(2 * hq, d_head)

    def kernel(lo: int, hi: int) -> None:                     # batch rows lo:hi
        pb, db = p[lo:hi], d_out[lo:hi]
        matmul_into(dv_all[lo:hi], pb.mT, db)                 # dv = Pᵀ Δ
        delta_causal = kept[lo:hi] if kept is not None else scratch(pb.shape, pb, "attention.dP")
        matmul_into(delta_causal, db, v[lo:hi].mT)            # dP = Δ vᵀ
        softmax_backward(delta_causal, pb, out=delta_causal)  # Δcausal; masked entries stay 0
        dq = dq_all[lo:hi]
        matmul_into(dq, delta_causal, k[lo:hi])               # dq = Δraw k
        lib.multiply(dq, 1.0 / math.sqrt(d_qk), out=dq)
        matmul_into(dk_all[lo:hi], delta_causal.mT, q[lo:hi])  # dk = Δrawᵀ q (q carries 1/√d_qk)

    for_row_blocks(p, kernel, B, H * T * T, block=_BLOCK)
    return delta_qkv, kept

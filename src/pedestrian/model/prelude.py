"""The attention's prelude: what the queries and keys go through between their products and the
scores, as one forward/backward pair that the training chain (:meth:`GPT._block
<pedestrian.model.gpt.GPT._block>` and its backward) and the decode path
(:mod:`pedestrian.model.decode`) both call, so a step of either sees every feature of it.

On the fused ``qkv = a2 W_qkv`` ``(B, T, H·d_qk + H_kv·d_qk + H_kv·d_head)`` of block ``i``
(docs/EQUATIONS.md, "The attention's prelude")::

    q, k ← RMSNorm(q; w_q), RMSNorm(k; w_k)      config.qk_norm: "head" -- each head's d_qk
                                                   features, one weight (d_qk,) for every head
                                                   (Qwen3, Gemma 3); "proj" -- the whole
                                                   projection, (H·d_qk,) and (H_kv·d_qk,) (OLMo 2)
    q, k ← R(t θ) q, R(t θ) k                    RoPE, when config.uses_rope(i) (SmolLM3's
                                                   no_rope_layers: some blocks turn nothing)

Both are the kernel table's own layers (``rmsnorm_forward`` on a reshaped view: the reference
layer or the fast kernel, whichever the model runs; ``rope_forward``), so the prelude needs no
kernel of its own. Backward in the reverse order: RoPE turned back, then the norms' backward
(which writes ``dw_q``, ``dw_k``: the sum over tokens, and heads for ``"head"``).
"""

from __future__ import annotations

from types import SimpleNamespace

from ..backend import array_namespace

__all__ = ["forward", "backward"]


def _parts(config, qkv):
    """The q and k column ranges of ``qkv`` and the shapes their norms see."""
    c = config
    hq, hk = c.n_heads * c.d_qk, c.n_kv_heads * c.d_qk
    lead = tuple(qkv.shape[:-1])
    if c.qk_norm == "head":
        return (0, hq, (*lead, c.n_heads, c.d_qk)), (hq, hq + hk, (*lead, c.n_kv_heads, c.d_qk))
    return (0, hq, (*lead, hq)), (hq, hq + hk, (*lead, hk))


def forward(K, config, i: int, qkv, w, positions, *, turn: bool = True):
    """The prelude of block ``i`` on ``qkv`` (module docstring): ``(qkv, cache)``, the q and k
    columns normed (written into ``qkv``) and turned (``turn=False``: not turned, the decode path
    turns them in its fused kernel, :func:`config.uses_rope <pedestrian.config.GPTConfig.uses_rope>`
    says whether).

    Args:
        K: the model's kernel table; config: its :class:`~pedestrian.config.GPTConfig`.
        qkv: ``(B, T, width)`` the block's fused q, k, v products (owned by the chain: written).
        w: the block's layer table (``w.q_norm``, ``w.k_norm``: their weights).
        positions: the tokens' positions (RoPE), as :func:`rope_forward` takes them.
    """
    c = config
    cache = SimpleNamespace(norms=None, rope=None)
    if c.qk_norm is not None:
        xp, eps, norms = array_namespace(qkv), float(c.ln_eps), []
        for (lo, hi, shape), weight in zip(_parts(c, qkv), (w.q_norm.weight, w.k_norm.weight)):
            y, norm_cache = K.rmsnorm_forward(xp.reshape(qkv[..., lo:hi], shape), weight, eps)   # (..., width)
            qkv[..., lo:hi] = xp.reshape(y, (*shape[:len(qkv.shape) - 1], hi - lo))             # q or k normed
            norms.append(norm_cache)
        cache.norms = norms
    if turn and c.uses_rope(i):                                                  # q, k turned by position
        qkv, cache.rope = K.rope_forward(qkv, c.n_heads, c.d_qk, positions, base=c.rope_base, rotated=c.rope_dims,
                                         n_kv_heads=c.n_kv_heads, scaling=c.rope_scaling)
    return qkv, cache


def backward(K, config, d_qkv, cache, g):
    """Backward of :func:`forward`: ``Δ`` at ``qkv``'s products from ``Δ`` at its output
    ``d_qkv`` (written into, and returned); writes ``g.q_norm``, ``g.k_norm``'s weight gradients
    (``None``: frozen)."""
    if cache.rope is not None:                                                   # turned back: R(−tθ)
        d_qkv = K.rope_backward(d_qkv, cache.rope)
    if cache.norms is not None:
        xp = array_namespace(d_qkv)
        for (lo, hi, shape), norm_cache, grad in zip(_parts(config, d_qkv), cache.norms, (g.q_norm, g.k_norm)):
            d_in = K.rmsnorm_backward(xp.reshape(d_qkv[..., lo:hi], shape), norm_cache,
                                      dweight=None if grad is None else grad.weight)
            d_qkv[..., lo:hi] = xp.reshape(d_in, (*shape[:len(d_qkv.shape) - 1], hi - lo))
    return d_qkv

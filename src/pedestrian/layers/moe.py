"""The mixture-of-experts MLP of Mixtral, Qwen3-MoE and OLMoE (EQUATIONS.md, "Mixture of experts").

Per token row ``x`` (``N = B·T`` rows of width ``d``), ``E`` SwiGLU experts of width ``m``::

    r = x W_r                      (N, E)   router logits (HF ``mlp.gate``)
    π = softmax(r)                 (N, E)
    K = top-k of π                 (N, k)   by descending π; ties: the lower expert index first
    g_e = π_e  (or π_e / Σ_K π)    (N, k)   ``norm_topk_prob`` renormalises
    y = Σ_{e∈K} g_e SwiGLU_e(x)    (N, d)

Backward: each chosen expert's SwiGLU gets ``g_e Δ`` (an expert a token did not choose gets
nothing from it), ``∂L/∂g_e = ⟨Δ, SwiGLU_e(x)⟩``, through the renormalisation
(``∂L/∂π_j = (∂L/∂g_j − Σ_K g ∂L/∂g) / Σ_K π`` for ``j ∈ K``) and the softmax to ``r`` and
``W_r``; the choice of ``K`` has no gradient.

The layer is split where the experts' products go, so a model can run each expert's layers with
their LoRA adapters (:class:`pedestrian.model.moe.MoEMLP`): :func:`moe_router_forward` routes and
groups the ``N·k`` (token, expert) rows by expert, :func:`moe_gather` lays the tokens out in
that order (expert ``e``'s rows are ``offsets[e]:offsets[e+1]``: one product per expert),
:func:`moe_combine_forward` weighs and adds each token's ``k`` outputs; :func:`moe_forward` is
the whole layer. Reference implementation, written against the array API standard.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..backend import array_namespace
from .swiglu import swiglu_mlp_backward, swiglu_mlp_forward


class RouteCache(NamedTuple):
    """What :func:`moe_router_backward` and the gather/combine functions need."""

    x: Any          #: ``(N, d)`` the rows routed
    pi: Any         #: ``(N, E)`` router probabilities ``softmax(x W_r)``
    top: Any        #: ``(N, k)`` int64, the chosen experts by descending ``π`` (ties: lower index first)
    g: Any          #: ``(N, k)`` their weights (renormalised when ``renorm``)
    order: Any      #: ``(N·k,)`` int64, slot ``n·k + s`` of each expert row, grouped by expert, tokens ascending
    slot_rows: Any  #: ``(N·k,)`` int64, where slot ``n·k + s``'s row sits in ``order`` (its inverse)
    offsets: tuple  #: ``E + 1`` ints: expert ``e``'s rows are ``order[offsets[e]:offsets[e+1]]``
    renorm: bool    #: ``norm_topk_prob``


def moe_router_forward(x, w_router, k: int, norm_topk_prob: bool):
    """Route each row of ``x`` ``(..., d)`` to its ``k`` experts with ``W_r`` ``(d, E)``.

    Returns:
        ``((g, offsets), cache)``: the weights ``g`` ``(N, k)``, the groups' bounds ``offsets``
        (``E + 1`` ints) and a :class:`RouteCache`.
    """
    xp = array_namespace(x, w_router)
    d, E = w_router.shape
    rows = xp.reshape(x, (-1, d))                                             # (N, d)
    r = rows @ w_router                                                       # (N, E) router logits
    e = xp.exp(r - xp.max(r, axis=-1, keepdims=True))                         # (N, E)
    pi = e / xp.sum(e, axis=-1, keepdims=True)                                # (N, E) softmax
    top = xp.argsort(-pi, axis=-1, stable=True)[:, :k]                        # (N, k) ties: lower index first
    p_top = xp.take_along_axis(pi, top, axis=-1)                              # (N, k)
    g = p_top / xp.sum(p_top, axis=-1, keepdims=True) if norm_topk_prob else p_top   # (N, k)
    flat = xp.reshape(top, (-1,))                                             # (N·k,) expert of slot n·k+s
    order = xp.argsort(flat, stable=True)                                     # (N·k,) slots by expert
    slot_rows = xp.argsort(order, stable=True)                                # (N·k,) inverse permutation
    counts = xp.sum(xp.astype(flat[:, None] == xp.arange(E, device=flat.device)[None, :], xp.int64), axis=0)
    offsets = (0, *[int(c) for c in xp.cumulative_sum(counts)])               # E + 1 ints (host)
    return (g, offsets), RouteCache(rows, pi, top, g, order, slot_rows, offsets, norm_topk_prob)


def moe_router_backward(d_g, cache: RouteCache, w_router, *, d_pi=None, dweight=None):
    """``Δ_x`` ``(N, d)`` of the routing for ``∂L/∂g`` ``(N, k)``; writes ``dW_r = xᵀ Δ_r``.

    ``d_pi``: an ``(E,)`` signal added to every row's ``∂L/∂π`` (the load-balancing loss's,
    :func:`moe_load_balancing_loss`); ``None``: none."""
    xp = array_namespace(d_g, cache.pi)
    N, E = cache.pi.shape
    if cache.renorm:                                                          # g = π_K / Σ_K π
        s = xp.sum(xp.take_along_axis(cache.pi, cache.top, axis=-1), axis=-1, keepdims=True)   # (N, 1)
        d_top = (d_g - xp.sum(d_g * cache.g, axis=-1, keepdims=True)) / s      # (N, k)
    else:
        d_top = d_g                                                           # (N, k)
    chosen = xp.astype(cache.top[:, :, None] == xp.arange(E, device=d_g.device), d_g.dtype)   # (N, k, E)
    d_pi_rows = xp.sum(d_top[:, :, None] * chosen, axis=1)                    # (N, E) zero off K
    if d_pi is not None:
        d_pi_rows = d_pi_rows + d_pi                                          # (N, E)
    d_r = cache.pi * (d_pi_rows - xp.sum(cache.pi * d_pi_rows, axis=-1, keepdims=True))   # (N, E) softmax
    if dweight is not None:
        dweight[...] = xp.matrix_transpose(cache.x) @ d_r                     # (d, E)
    return d_r @ xp.matrix_transpose(w_router)                                # (N, d)


def moe_gather(cache: RouteCache):
    """The rows of the ``N·k`` (token, expert) pairs grouped by expert: ``(N·k, d)``."""
    xp = array_namespace(cache.x)
    return xp.take(cache.x, cache.order // cache.top.shape[1], axis=0)       # (N·k, d)


def moe_scatter(d_rows, cache: RouteCache):
    """Backward of :func:`moe_gather`: each token's ``k`` rows of ``d_rows`` ``(N·k, d)`` added, ``(N, d)``."""
    xp = array_namespace(d_rows)
    N, k = cache.top.shape
    by_slot = xp.reshape(xp.take(d_rows, cache.slot_rows, axis=0), (N, k, -1))   # (N, k, d)
    return xp.sum(by_slot, axis=1)                                            # (N, d)


def moe_combine_forward(outs, cache: RouteCache):
    """``y_n = Σ_s g_{n,s} out_{n,s}`` of the experts' outputs ``outs`` ``(N·k, d)`` (grouped by
    expert). Returns ``(y (N, d), by_slot (N, k, d))``."""
    xp = array_namespace(outs)
    N, k = cache.top.shape
    by_slot = xp.reshape(xp.take(outs, cache.slot_rows, axis=0), (N, k, -1))  # (N, k, d)
    return xp.sum(cache.g[:, :, None] * by_slot, axis=1), by_slot             # (N, d)


def moe_combine_backward(delta, combine_cache, cache: RouteCache):
    """``(Δ_outs (N·k, d) grouped by expert, ∂L/∂g (N, k))`` for ``Δ`` ``(N, d)``; ``combine_cache``:
    :func:`moe_combine_forward`'s ``by_slot``."""
    by_slot = combine_cache
    xp = array_namespace(delta)
    N, k = cache.top.shape
    d_g = xp.sum(delta[:, None, :] * by_slot, axis=-1)                        # (N, k) ⟨Δ, SwiGLU_e(x)⟩
    d_slot = xp.reshape(cache.g[:, :, None] * delta[:, None, :], (N * k, -1))  # (N·k, d) g_e Δ
    return xp.take(d_slot, cache.order, axis=0), d_g                          # grouped by expert


def moe_load_balancing_loss(routes: list, E: int, k: int):
    """transformers' ``load_balancing_loss_func`` (no attention mask) over the routes of every MoE
    layer: ``N`` rows in all, ``f_e = (rows choosing e) / N``, ``P_e = Σ_rows π_e / N``,
    ``aux = E Σ_e f_e P_e`` (about ``k`` at perfect balance). Returns ``(aux, d_pi)`` with
    ``d_pi = ∂aux/∂π_{row,e} = E f_e / N`` ``(E,)``, the same for every row (the counts ``f``
    have no gradient)."""
    xp = array_namespace(routes[0].pi)
    n = sum(c.pi.shape[0] for c in routes)                                    # rows of every layer
    arange = xp.arange(E, device=routes[0].pi.device)
    counts = sum(xp.sum(xp.astype(xp.reshape(c.top, (-1,))[:, None] == arange, c.pi.dtype), axis=0)
                 for c in routes)                                             # (E,)
    p_sum = sum(xp.sum(c.pi, axis=0) for c in routes)                         # (E,)
    f = counts / n                                                            # (E,) Σ f = k
    return E * xp.sum(f * (p_sum / n)), E * f / n                             # aux, (E,)


def moe_forward(x, w_router, w_gate, w_up, w_down, k: int, norm_topk_prob: bool):
    """The whole layer: ``y = Σ_{e∈K} g_e SwiGLU_e(x)``, ``x`` ``(..., d)``; ``W_r`` ``(d, E)``,
    ``W_gate``, ``W_up`` ``(E, d, m)``, ``W_down`` ``(E, m, d)``. Returns ``(y (..., d), cache)``."""
    xp = array_namespace(x)
    (g, offsets), route = moe_router_forward(x, w_router, k, norm_topk_prob)
    rows = moe_gather(route)                                                  # (N·k, d) by expert
    parts = [swiglu_mlp_forward(rows[lo:hi, ...], w_gate[e], w_up[e], w_down[e])   # one product per expert
             for e, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:]))]
    y, by_slot = moe_combine_forward(xp.concat([p[0] for p in parts], axis=0), route)
    return xp.reshape(y, x.shape), (route, [p[1] for p in parts], by_slot)


def moe_backward(delta, cache, w_router, w_gate, w_up, w_down, *, d_pi=None, dw_router=None, dw_gate=None,
                 dw_up=None, dw_down=None):
    """``Δ_x`` ``(..., d)`` of :func:`moe_forward`; writes the gradients given (``dw_gate`` etc.
    ``(E, d, m)``; ``d_pi``: see :func:`moe_router_backward`)."""
    xp = array_namespace(delta)
    route, caches, by_slot = cache
    d_outs, d_g = moe_combine_backward(xp.reshape(delta, (-1, delta.shape[-1])), by_slot, route)
    o = route.offsets
    d_rows = xp.concat([swiglu_mlp_backward(d_outs[o[e]:o[e + 1], ...], c, w_gate[e], w_up[e], w_down[e],
                                            dw_gate=None if dw_gate is None else dw_gate[e],
                                            dw_up=None if dw_up is None else dw_up[e],
                                            dw_down=None if dw_down is None else dw_down[e])
                        for e, c in enumerate(caches)], axis=0)               # (N·k, d)
    dx = moe_scatter(d_rows, route) + moe_router_backward(d_g, route, w_router, d_pi=d_pi, dweight=dw_router)
    return xp.reshape(dx, delta.shape)

"""Fast kernels of the mixture-of-experts MLP (reference: :mod:`pedestrian.layers.moe`).

NumPy arrays: the router's product and every expert's products on BLAS (:mod:`.linear`, one
product per expert over the rows grouped for it), the rest in numba loops: the softmax, the
top-k and the renormalisation one pass per row; the grouping by expert a counting sort (stable:
tokens ascending within an expert, as the reference's stable ``argsort``); the weighted sum of a
token's ``k`` outputs and its backward one pass per token, reading the experts' rows in place
(no ``(N, k, d)`` copy). Same cache names as the reference (:class:`~pedestrian.layers.moe.RouteCache`);
the combine's cache is the experts' outputs ``(N·k, d)`` themselves.
"""

from __future__ import annotations

import math

import numpy as np

from ..layers.moe import RouteCache, moe_load_balancing_loss
from .jit import kernel, prange
from .linear import linear_backward, linear_forward
from .swiglu import swiglu_mlp_backward, swiglu_mlp_forward
from .workspace import empty_array

__all__ = ["moe_router_forward", "moe_router_backward", "moe_gather", "moe_scatter", "moe_combine_forward",
           "moe_combine_backward", "moe_load_balancing_loss", "moe_forward", "moe_backward"]


@kernel(parallel=True)
def _route(r, k, renorm, pi, top, g):
    """Per row: ``π = softmax(r)``, the ``k`` largest ``π`` (first the lower index among equals),
    ``g = π_K`` or ``π_K / Σ_K π``."""
    N, E = r.shape
    for n in prange(N):
        mx = r[n, 0]
        for e in range(1, E):
            mx = max(mx, r[n, e])
        s = r.dtype.type(0.0)
        for e in range(E):
            v = math.exp(r[n, e] - mx)
            pi[n, e] = v
            s += v
        for e in range(E):
            pi[n, e] = pi[n, e] / s
        total = r.dtype.type(0.0)
        for j in range(k):
            best = -1
            for e in range(E):
                taken = False
                for i in range(j):
                    taken = taken or top[n, i] == e
                if not taken and (best < 0 or pi[n, e] > pi[n, best]):
                    best = e
            top[n, j] = best
            g[n, j] = pi[n, best]
            total += pi[n, best]
        if renorm:
            for j in range(k):
                g[n, j] = g[n, j] / total


@kernel
def _group(top, E, order, slot_rows, offsets):
    """Counting sort of the ``N·k`` slots by expert (tokens ascending within one)."""
    N, k = top.shape
    offsets[:] = 0
    for n in range(N):
        for s in range(k):
            offsets[top[n, s] + 1] += 1
    for e in range(E):
        offsets[e + 1] += offsets[e]
    cursor = offsets[:E].copy()
    for n in range(N):
        for s in range(k):
            e = top[n, s]
            order[cursor[e]] = n * k + s
            slot_rows[n * k + s] = cursor[e]
            cursor[e] += 1


@kernel(parallel=True)
def _router_delta(d_g, pi, top, g, renorm, d_pi, d_r):
    """``Δ_r`` of the softmax for ``∂L/∂g`` through the renormalisation (and ``d_pi`` on every row)."""
    N, E = pi.shape
    k = top.shape[1]
    for n in prange(N):
        for e in range(E):
            d_r[n, e] = d_pi[e]
        if renorm:
            s = pi.dtype.type(0.0)
            dot = pi.dtype.type(0.0)
            for j in range(k):
                s += pi[n, top[n, j]]
                dot += d_g[n, j] * g[n, j]
            for j in range(k):
                d_r[n, top[n, j]] += (d_g[n, j] - dot) / s
        else:
            for j in range(k):
                d_r[n, top[n, j]] += d_g[n, j]
        dot = pi.dtype.type(0.0)
        for e in range(E):
            dot += pi[n, e] * d_r[n, e]
        for e in range(E):
            d_r[n, e] = pi[n, e] * (d_r[n, e] - dot)


@kernel(parallel=True)
def _combine(outs, g, slot_rows, y):
    """``y_n = Σ_s g_{n,s} outs[row of (n, s)]``."""
    N, k = g.shape
    for n in prange(N):
        yn = y[n]
        for j in range(yn.shape[0]):
            yn[j] = 0.0
        for s in range(k):
            row, w = outs[slot_rows[n * k + s]], g[n, s]
            for j in range(yn.shape[0]):
                yn[j] += w * row[j]


@kernel(parallel=True)
def _combine_back(delta, outs, g, slot_rows, d_outs, d_g):
    """``∂L/∂g_{n,s} = ⟨Δ_n, out⟩``, ``Δ_out = g_{n,s} Δ_n`` (each row written by its one token)."""
    N, k = g.shape
    for n in prange(N):
        for s in range(k):
            p = slot_rows[n * k + s]
            dl, row, d_row, w = delta[n], outs[p], d_outs[p], g[n, s]
            dot = row.dtype.type(0.0)
            for j in range(row.shape[0]):
                dot += dl[j] * row[j]
                d_row[j] = w * dl[j]
            d_g[n, s] = dot


@kernel(parallel=True)
def _scatter(d_rows, slot_rows, k, dx):
    """``Δ_x[n] = Σ_s d_rows[row of (n, s)]``."""
    for n in prange(dx.shape[0]):
        out = dx[n]
        first = d_rows[slot_rows[n * k]]
        for j in range(out.shape[0]):
            out[j] = first[j]
        for s in range(1, k):
            row = d_rows[slot_rows[n * k + s]]
            for j in range(out.shape[0]):
                out[j] += row[j]


def moe_router_forward(x, w_router, k: int, norm_topk_prob: bool):
    """``r = x W_r``, ``π = softmax(r)``, ``K`` = top-k of ``π`` (ties: the lower index), ``g = π_K``
    or ``π_K / Σ_K π``; the slots grouped by expert (EQUATIONS.md, "Mixture of experts").

    Fast :func:`pedestrian.layers.moe.moe_router_forward` (same arguments and results)."""
    d, E = w_router.shape
    rows = np.ascontiguousarray(x).reshape(-1, d)                              # (N, d)
    r, _ = linear_forward(rows, w_router)                                      # (N, E)
    N = rows.shape[0]
    pi, g = np.empty((N, E), x.dtype), np.empty((N, k), x.dtype)
    top = np.empty((N, k), np.int64)
    _route(np.ascontiguousarray(r), k, bool(norm_topk_prob), pi, top, g)
    order, slot_rows, offsets = np.empty(N * k, np.int64), np.empty(N * k, np.int64), np.empty(E + 1, np.int64)
    _group(top, E, order, slot_rows, offsets)
    offsets = tuple(int(o) for o in offsets)
    return (g, offsets), RouteCache(rows, pi, top, g, order, slot_rows, offsets, bool(norm_topk_prob))


def moe_router_backward(d_g, cache: RouteCache, w_router, *, d_pi=None, dweight=None):
    """``Δ_r = π ∘ (∂L/∂π − ⟨π, ∂L/∂π⟩)`` with ``∂L/∂π`` from ``∂L/∂g`` (through the
    renormalisation) plus ``d_pi``; ``dW_r = xᵀ Δ_r``, ``Δ_x = Δ_r W_rᵀ``.

    Fast :func:`pedestrian.layers.moe.moe_router_backward` (same arguments and result)."""
    E = cache.pi.shape[1]
    d_pi = np.zeros(E, cache.pi.dtype) if d_pi is None else np.asarray(d_pi, cache.pi.dtype)
    d_r = np.empty_like(cache.pi)
    _router_delta(np.ascontiguousarray(d_g, cache.pi.dtype), cache.pi, cache.top, cache.g, cache.renorm, d_pi, d_r)
    return linear_backward(d_r, cache.x, w_router, dweight=dweight)


def moe_gather(cache: RouteCache):
    """Fast :func:`pedestrian.layers.moe.moe_gather`: the token rows grouped by expert, ``(N·k, d)``."""
    out = empty_array((cache.order.shape[0], cache.x.shape[1]), cache.x)
    np.take(cache.x, cache.order // cache.top.shape[1], axis=0, out=out)
    return out


def moe_scatter(d_rows, cache: RouteCache):
    """Fast :func:`pedestrian.layers.moe.moe_scatter`: each token's ``k`` rows added, ``(N, d)``."""
    N, k = cache.top.shape
    dx = empty_array((N, d_rows.shape[1]), d_rows)
    _scatter(np.ascontiguousarray(d_rows), cache.slot_rows, k, dx)
    return dx


def moe_combine_forward(outs, cache: RouteCache):
    """Fast :func:`pedestrian.layers.moe.moe_combine_forward`: ``y_n = Σ_s g_{n,s} out_{n,s}``;
    the cache is ``outs`` itself."""
    outs = np.ascontiguousarray(outs)
    y = empty_array((cache.top.shape[0], outs.shape[1]), outs)
    _combine(outs, cache.g, cache.slot_rows, y)
    return y, outs


def moe_combine_backward(delta, combine_cache, cache: RouteCache):
    """Fast :func:`pedestrian.layers.moe.moe_combine_backward`: ``(Δ_outs, ∂L/∂g)`` (``combine_cache``:
    the experts' outputs, :func:`moe_combine_forward`'s cache)."""
    outs = combine_cache
    delta = np.ascontiguousarray(delta).reshape(-1, outs.shape[1])
    d_outs, d_g = empty_array(outs.shape, outs), np.empty(cache.g.shape, outs.dtype)
    _combine_back(delta, outs, cache.g, cache.slot_rows, d_outs, d_g)
    return d_outs, d_g


def moe_forward(x, w_router, w_gate, w_up, w_down, k: int, norm_topk_prob: bool):
    """``y = Σ_{e∈K} g_e SwiGLU_e(x)`` (EQUATIONS.md, "Mixture of experts").

    Fast :func:`pedestrian.layers.moe.moe_forward` (same arguments and results): one product per
    expert and layer over its rows."""
    (g, offsets), route = moe_router_forward(x, w_router, k, norm_topk_prob)
    rows = moe_gather(route)
    parts = [swiglu_mlp_forward(rows[lo:hi], w_gate[e], w_up[e], w_down[e])
             for e, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:]))]
    y, outs = moe_combine_forward(np.concatenate([p[0] for p in parts], axis=0), route)
    return y.reshape(x.shape), (route, [p[1] for p in parts], outs)


def moe_backward(delta, cache, w_router, w_gate, w_up, w_down, *, d_pi=None, dw_router=None, dw_gate=None,
                 dw_up=None, dw_down=None):
    """Fast :func:`pedestrian.layers.moe.moe_backward` (same arguments and result)."""
    route, caches, outs = cache
    d_outs, d_g = moe_combine_backward(delta, outs, route)
    o = route.offsets
    d_rows = np.concatenate([swiglu_mlp_backward(d_outs[o[e]:o[e + 1]], c, w_gate[e], w_up[e], w_down[e],
                                                 dw_gate=None if dw_gate is None else dw_gate[e],
                                                 dw_up=None if dw_up is None else dw_up[e],
                                                 dw_down=None if dw_down is None else dw_down[e])
                             for e, c in enumerate(caches)], axis=0)
    dx = moe_scatter(d_rows, route)
    dx += moe_router_backward(d_g, route, w_router, d_pi=d_pi, dweight=dw_router)
    return dx.reshape(delta.shape)

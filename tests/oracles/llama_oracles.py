"""Oracles of the Llama layers (RMSNorm, SiLU, the SwiGLU MLP): their formulas in plain torch (for
autograd) and first-order rounding bounds for comparing two computations of them.

The bounds (:func:`rmsnorm_bounds`, :func:`swiglu_mlp_bounds`) follow gradcheck.py's rule: each
rounded operation errs by at most ``u = ε/2`` relative to its *absolute terms* (every sign made
positive, so cancellation cannot make a check flaky), a sum or product of ``n`` terms by
``n·u`` of its absolute terms (Higham, "Accuracy and Stability", §3.1: any order, FMA or not),
and an error already in an operand is carried with the operation's derivative. They are evaluated
in float64 on the exact values of the inputs and bound ONE computation in ``dtype`` (any order,
any thread count) against the exact result; two computations differ by at most twice that. Each
is doubled once more for the first-order terms dropped (second-order terms are ``(n·u)²``).
"""

from __future__ import annotations

import numpy as np

#: roundings of one SiLU (or SiLU') evaluation, relative to its absolute terms: exp (the fast
#: path's polynomial: <= 1.5 ulp, 3u), 1 + e, the reciprocal, e·p, x·σ (σ(1 + x(1 − σ)): two
#: more), 8u, doubled for the selects and the float32 exp's reduction
SILU_ROUNDINGS = 16


def torch_rmsnorm(x, w, eps):
    """``x / sqrt(mean_f x² + eps) ∘ w`` in plain torch (the autograd oracle; EQUATIONS.md)."""
    import torch

    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def torch_swiglu_mlp(x, w_gate, w_up, w_down):
    """``(silu(x W_gate) ∘ x W_up) W_down`` in plain torch, ``(f_in, f_out)`` weights."""
    import torch.nn.functional as F

    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


def _sigmoid(z):
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def rmsnorm_bounds(x, w, eps, delta, dtype) -> dict:
    """Per-entry bounds on one ``dtype`` computation's error in ``y``, ``Δ_in``, ``dw``
    (``x (N.., d)``, ``w (d,)``, ``delta`` like ``x``; all float64 holding the exact inputs).

    ``1/r``: ``d`` squares summed (``d·u``), ``/d``, ``+ eps`` (``(d + 2)u``), the square root
    (half of it, ``+u``), the reciprocal (``+u``): ``e_r = (d/2 + 3)u`` relative; ``x̂ = x·(1/r)``
    ``+u``; ``y = x̂ ∘ w`` ``+u``. Backward: ``g = Δ ∘ w``, ``S = mean_f(g ∘ x̂)`` (``d + 3`` roundings
    of ``mean|g x̂|`` plus ``x̂``'s error), ``t = g − x̂ S`` (two more), ``Δ_in = t/r`` (``1/r``'s
    error and one rounding); ``dw = Σ_rows x̂ ∘ Δ`` (``N + 1`` roundings plus ``x̂``'s error).
    """
    u = float(np.finfo(dtype).eps) / 2
    d = x.shape[-1]
    rr = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    xhat = x * rr
    e_r = (d / 2 + 3) * u
    err_xhat = (e_r + u) * np.abs(xhat)
    y = (e_r + 2 * u) * np.abs(xhat * w)
    g_abs = np.abs(delta * w)
    S = np.mean(delta * w * xhat, axis=-1, keepdims=True)
    err_S = (d + 4) * u * np.mean(g_abs * np.abs(xhat), axis=-1, keepdims=True) \
        + np.mean(g_abs * err_xhat, axis=-1, keepdims=True)
    t_abs = g_abs + np.abs(xhat * S)
    err_t = u * g_abs + err_xhat * np.abs(S) + np.abs(xhat) * err_S + 2 * u * t_abs
    dx = rr * (err_t + (e_r + u) * t_abs)
    rows = (-1, d)
    n = np.reshape(x, rows).shape[0]
    dw = np.sum(np.reshape((n + 1) * u * np.abs(xhat * delta) + err_xhat * np.abs(delta), rows), axis=0)
    return {"y": 2 * y, "dx": 2 * dx, "dw": 2 * dw}


def swiglu_mlp_bounds(x, w_gate, w_up, w_down, delta, dtype) -> dict:
    """Per-entry bounds on one ``dtype`` computation's error in ``a9``, ``Δ6``, ``dW_gate``,
    ``dW_up``, ``dW_down`` (``x (N, d)``, ``delta (N, d_out)``, float64 holding the exact inputs).

    ``a7_gate``, ``a7_up``: products of ``d`` terms (``(d + 1)u`` of ``|x||W|``); ``silu``, ``silu'``:
    :data:`SILU_ROUNDINGS` plus the gate's error times ``silu'`` (``silu''``); ``a8`` one product;
    ``a9`` ``m`` terms; backward the same rules through ``Δ8 = Δ9 W_downᵀ``, ``Δ7_up = Δ8 ∘ silu``,
    ``Δ7_gate = Δ8 ∘ a7_up ∘ silu'``, the three weight gradients (``N`` terms) and ``Δ6`` (``2m``
    terms and one addition). Where ``σ`` underflows (gates below about −87 in float32, −708 in
    float64) each pointwise result carries the smallest subnormal's rounding too (times ``|x|``).
    """
    u, tiny = float(np.finfo(dtype).eps) / 2, float(np.finfo(dtype).smallest_subnormal)
    (N, d), m, d_out = x.shape, w_gate.shape[1], w_down.shape[1]
    ax, ag, au, ad = np.abs(x), np.abs(w_gate), np.abs(w_up), np.abs(w_down)
    G, U = x @ w_gate, x @ w_up
    err_G, err_U = (d + 1) * u * (ax @ ag), (d + 1) * u * (ax @ au)
    s = _sigmoid(G)
    silu, dsilu = G * s, s * (1 + G * (1 - s))
    d2silu = s * (1 - s) * (2 + G * (1 - 2 * s))
    under = 4 * tiny * (1 + np.abs(G))                     # σ underflowing (a few subnormal ulp), times x
    err_silu = np.abs(dsilu) * err_G + SILU_ROUNDINGS * u * np.abs(silu) + under
    err_dsilu = np.abs(d2silu) * err_G + SILU_ROUNDINGS * u * s * (1 + np.abs(G) * (1 - s)) + under
    H = silu * U
    err_H = err_silu * np.abs(U) + np.abs(silu) * err_U + u * np.abs(H) + tiny
    err_Y = (m + 1) * u * (np.abs(H) @ ad) + err_H @ ad
    D8 = delta @ w_down.T
    err_D8 = (d_out + 1) * u * (np.abs(delta) @ ad.T)
    Dup, Dg = D8 * silu, D8 * U * dsilu
    err_Dup = err_D8 * np.abs(silu) + np.abs(D8) * err_silu + u * np.abs(Dup) + tiny
    err_Dg = (err_D8 * np.abs(U * dsilu) + np.abs(D8) * err_U * np.abs(dsilu) + np.abs(D8 * U) * err_dsilu
              + 2 * u * np.abs(Dg) + 2 * tiny)
    dWd = (N + 1) * u * (np.abs(H).T @ np.abs(delta)) + err_H.T @ np.abs(delta)
    dWg = (N + 1) * u * (ax.T @ np.abs(Dg)) + ax.T @ err_Dg
    dWu = (N + 1) * u * (ax.T @ np.abs(Dup)) + ax.T @ err_Dup
    dx = (m + 2) * u * (np.abs(Dg) @ ag.T + np.abs(Dup) @ au.T) + err_Dg @ ag.T + err_Dup @ au.T
    return {k: 2 * v for k, v in
            {"y": err_Y, "dx": dx, "dw_gate": dWg, "dw_up": dWu, "dw_down": dWd}.items()}

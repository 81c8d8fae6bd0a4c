"""Fast kernels for layer normalization (reference: :mod:`pedestrian.layers.layernorm`, paper section 5).

NumPy arrays: llm.c's loops -- the forward walks each row once for ``μ``, ``σ`` and ``y``, the
backward once for its two row means and ``Δ_in`` while ``dw``, ``db`` accumulate per block of
rows. Sums in float64 (for float32 rows too: the row is in L1 and the conversion is cheap), the
mean corrected once (the mean of ``x − μ`` added back: Chan, Golub and LeVeque's corrected
two-pass), so float32 stays within PyTorch's accuracy when ``|μ| ≫ σ`` (the paper's ``eps = 0``;
``tests/paper/test_float32_accuracy.py``). The cache holds ``1/σ`` in float64.
"""

from __future__ import annotations

import math

import numpy as np

from ..layers.checks import check_float
from ..layers.layernorm import check_eps
from .jit import kernel, prange
from .schedule import NORM_BLOCK_ROWS
from .workspace import empty_array

@kernel(parallel=True)
def _forward(x, weight, bias, eps, y, xhat, rstd):
    """Per row: ``μ = Σx/d``, ``σ² = Σ(x − μ)²/d − (Σ(x − μ)/d)²``, ``x̂ = (x − μ)/σ``, ``y = x̂ ∘ w + b``."""
    n, d = x.shape
    for r in prange(n):
        s = 0.0
        for j in range(d):
            s += np.float64(x[r, j])
        mu = s / d
        s1 = 0.0
        s2 = 0.0
        for j in range(d):
            c = x[r, j] - mu
            s1 += c
            s2 += c * c
        m1 = s1 / d                                        # the rounding error of μ, corrected
        inv = 1.0 / math.sqrt(max(s2 / d - m1 * m1, 0.0) + eps)
        mu += m1
        rstd[r] = inv
        for j in range(d):
            h = (x[r, j] - mu) * inv
            xhat[r, j] = h
            y[r, j] = h * weight[j] + bias[j]


@kernel(parallel=True)
def _backward(delta, xhat, rstd, weight, out, dw_part, db_part):
    """Per row: ``g = Δ ∘ w``, ``Δ_in = (g − mean g − x̂ ∘ mean(g ∘ x̂)) / σ``; per block of rows
    ``Σ x̂ ∘ Δ`` and ``Σ Δ`` into its row of ``dw_part``, ``db_part``."""
    n, d = delta.shape
    for b in prange(dw_part.shape[0]):
        for j in range(d):
            dw_part[b, j] = 0.0
            db_part[b, j] = 0.0
        for r in range(b * NORM_BLOCK_ROWS, min(n, (b + 1) * NORM_BLOCK_ROWS)):
            sg = 0.0
            sgx = 0.0
            for j in range(d):
                g = np.float64(delta[r, j]) * weight[j]
                sg += g
                sgx += g * xhat[r, j]
                dw_part[b, j] += np.float64(delta[r, j]) * xhat[r, j]
                db_part[b, j] += delta[r, j]
            mean_g = sg / d
            mean_gx = sgx / d
            inv = rstd[r]
            for j in range(d):
                out[r, j] = (np.float64(delta[r, j]) * weight[j] - mean_g - xhat[r, j] * mean_gx) * inv


def layernorm_forward(x, weight, bias, eps: float):
    """``y = (x − μ)/σ ∘ w + b``, ``μ``, ``σ = √(var + ε)`` over the last axis (EQUATIONS.md, "Layer
    normalization").

    Fast :func:`pedestrian.layers.layernorm.layernorm_forward` (same arguments and results;
    the cache holds ``1/σ`` in float64)."""
    check_eps(eps)
    check_float(x, "the layer norm's input")
    d = x.shape[-1]
    x2 = np.ascontiguousarray(x).reshape(-1, d)
    xhat, y = empty_array(x.shape, x), empty_array(x.shape, x)
    rstd = np.empty((*x.shape[:-1], 1), np.float64)
    _forward(x2, weight, np.zeros_like(weight) if bias is None else bias, float(eps),
             y.reshape(-1, d), xhat.reshape(-1, d), rstd.reshape(-1))
    return y, (xhat, rstd, weight)


def layernorm_backward(delta, cache, *, dweight=None, dbias=None):
    """``Δ_in = (1/σ)(g − mean_f(g) − x̂ ∘ mean_f(g ∘ x̂))``, ``g = Δ ∘ w``; ``dw = Σ x̂ ∘ Δ``,
    ``db = Σ Δ`` over the tokens (EQUATIONS.md, "Layer normalization").

    Fast :func:`pedestrian.layers.layernorm.layernorm_backward` (same arguments and result):
    ``Δ_in = (g − mean_f(g) − x̂ ∘ mean_f(g ∘ x̂)) / σ``, ``g = Δ ∘ w``; ``dw``, ``db`` as fixed-order
    sums of per-block partial sums (the same bits for any thread count)."""
    xhat, rstd, weight = cache
    d = delta.shape[-1]
    delta2 = np.ascontiguousarray(delta).reshape(-1, d)
    n = delta2.shape[0]
    delta_in = empty_array(delta.shape, delta)
    blocks = -(-n // NORM_BLOCK_ROWS)
    dw_part, db_part = np.empty((blocks, d)), np.empty((blocks, d))
    _backward(delta2, xhat.reshape(-1, d), rstd.reshape(-1), weight, delta_in.reshape(-1, d), dw_part, db_part)
    if dweight is not None:
        dweight[...] = dw_part.sum(axis=0)
    if dbias is not None:
        dbias[...] = db_part.sum(axis=0)
    return delta_in

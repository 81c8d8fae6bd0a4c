"""Paper section 5 (EQUATIONS.md "Layer normalization"): per token ``x̂ = (x − μ)/σ``,
``σ = sqrt(var(x) + ε)``, ``y = x̂ ∘ w + b``, and its backward
``Δ_in = (1/σ)(g − mean(g) − x̂ ∘ mean(g ∘ x̂))``, ``g = Δ ∘ w``, exact for the paper's ε = 0 and
PyTorch's ε = 1e-5; for both kernel modules, against ``torch.nn.functional.layer_norm``'s autograd
(float64), finite differences, and the layer's invariances (shift, and for ε = 0 scale, of each
token's features). Tolerances: tests/oracles/gradcheck.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch.nn.functional as F

from gradcheck import (
    as_np,
    assert_autograd_close,
    assert_fd_close,
    assert_rounding_close,
    autograd,
    kernels_param,
    numerical_grad,
    projection,
)

EPS = pytest.mark.parametrize("eps", [0.0, 1e-5], ids=["eps0", "eps1e-5"])
BIAS = pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
D = 6


def case(seed, with_bias=True, shape=(2, 3)):
    rng = np.random.default_rng(seed)
    x = 1.5 * rng.standard_normal((*shape, D)) + 0.3
    w = 1.0 + 0.3 * rng.standard_normal(D)
    b = 0.2 * rng.standard_normal(D) if with_bias else None
    return x, w, b, 0.5 * rng.standard_normal(x.shape)


def backward(K, R, cache, with_bias=True):
    dw, db = np.full(D, np.nan), np.full(D, np.nan)                 # must be overwritten
    d_x = K.layernorm_backward(R, cache, dweight=dw, dbias=db if with_bias else None)
    return d_x, dw, db


@kernels_param()
@EPS
@BIAS
def test_layernorm_matches_autograd(K, eps, with_bias):
    x, w, b, R = case(0, with_bias)
    y, cache = K.layernorm_forward(x, w, b, eps)
    d_x, dw, db = backward(K, R, cache, with_bias)
    inputs = {"x": x, "w": w} | ({"b": b} if with_bias else {})
    out, grads = autograd(lambda x, w, b=None: F.layer_norm(x, (D,), w, b, eps), inputs, upstream=R)
    assert_autograd_close(y, out, "y")
    assert_autograd_close(d_x, grads["x"], "Δ_in")
    assert_autograd_close(dw, grads["w"], "∂L/∂w")
    if with_bias:
        assert_autograd_close(db, grads["b"], "∂L/∂b")
    else:
        assert np.all(np.isnan(db))


@kernels_param()
@EPS
@BIAS
def test_layernorm_matches_finite_differences(K, eps, with_bias):
    x, w, b, R = case(1, with_bias)

    def f():
        return projection(K.layernorm_forward(x, w, b, eps)[0], R)

    d_x, dw, db = backward(K, R, K.layernorm_forward(x, w, b, eps)[1], with_bias)
    checks = [("w", dw, w), ("x", d_x, x)] + ([("b", db, b)] if with_bias else [])
    for name, analytic, arr in checks:
        assert_fd_close(analytic, numerical_grad(f, arr), f"layernorm(eps={eps}).{name}")


@kernels_param()
@EPS
def test_input_signal_is_orthogonal_to_ones_and_to_xhat(K, eps):
    """``y`` does not change when a token's features are all shifted by one constant, so each row
    of ``Δ_in`` sums to zero; for ε = 0 neither when they are scaled, so ``Σ_f Δ_in ∘ x̂ = 0`` too
    (for ε > 0 that sum is ``ε/σ² ·`` something, small here)."""
    x, w, b, R = case(2)
    y, cache = K.layernorm_forward(x, w, b, eps)
    d_x, _, _ = backward(K, R, cache)
    xhat = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)
    rstd = 1.0 / np.sqrt(x.var(-1, keepdims=True) + eps)
    # the terms of each row of Δ_in: (1/σ)(|g| + |mean g| + |x̂||mean g x̂|), summed over d features;
    # d + 4 rounded operations per entry and d per sum: (2d + 4)·ε of the absolute terms
    g = np.abs(R * w)
    terms = rstd * (g + g.mean(-1, keepdims=True) + np.abs(xhat) * (g * np.abs(xhat)).mean(-1, keepdims=True))
    bound = 2 * (2 * D + 4) * np.finfo(np.float64).eps * terms.sum(-1)
    assert np.all(np.abs(d_x.sum(-1)) <= bound)
    if eps == 0.0:
        assert np.all(np.abs((d_x * xhat).sum(-1)) <= bound * np.max(np.abs(xhat)))
    # and the forward really is invariant: shift (any ε), scale (ε = 0). x − μ has the absolute
    # terms |x| + |μ|, so x̂ is good to (d + 4)·ε·(|x| + |μ|)/σ and y to |w| times that
    y_shift, _ = K.layernorm_forward(x + 4.0, w, b, eps)
    terms = (np.max(np.abs(x)) + 8.0) * np.max(rstd) * np.abs(w)
    assert_rounding_close(y_shift, y, terms, "y(x + c)")
    if eps == 0.0:
        y_scale, _ = K.layernorm_forward(3.0 * x, w, b, eps)
        assert_rounding_close(y_scale, y, 2 * np.max(np.abs(x)) * np.max(rstd) * np.abs(w), "y(3x)")


@kernels_param()
def test_normalised_rows_have_mean_zero_and_unit_variance(K):
    x, _, _, _ = case(3, shape=(4, 5))
    y, (xhat, rstd, _) = K.layernorm_forward(x, np.ones(D), np.zeros(D), 0.0)
    assert_rounding_close(as_np(y).mean(-1), np.zeros(x.shape[:-1]), np.abs(as_np(y)).mean(-1), "mean_f x̂")
    assert_rounding_close((as_np(y) ** 2).mean(-1), np.ones(x.shape[:-1]), np.ones(1), "var_f x̂")
    assert as_np(rstd).shape == (*x.shape[:-1], 1)


@kernels_param()
def test_negative_eps_is_refused(K):
    with pytest.raises(ValueError, match="layer norm eps must be >= 0, got -1e-05"):
        K.layernorm_forward(np.ones((1, D)), np.ones(D), None, -1e-5)

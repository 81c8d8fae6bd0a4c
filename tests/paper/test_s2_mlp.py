"""Paper section 2 (EQUATIONS.md "Fully connected, activations, residual"): the MLP's pieces --
the fully connected layer ``y = x W + b`` (``dW = xᵀ Δ``, ``db = Σ_tokens Δ``, ``Δ_in = Δ Wᵀ``),
ReLU / exact GELU / GELU-tanh / SiLU, inverted dropout with a fixed mask, and the skip addition --
for both kernel modules, against torch autograd (float64; ``torch.nn.functional``'s own ReLU and
GELUs are the oracle), finite differences, and each piece's properties.
Tolerances: tests/oracles/gradcheck.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradcheck import (
    as_np,
    assert_autograd_close,
    assert_fd_close,
    autograd,
    kernels_param,
    numerical_grad,
    projection,
)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# =========================================================================== fully connected
def linear_case(rng, bias=True):
    x = rng.standard_normal((2, 3, 4))
    W = 0.5 * rng.standard_normal((4, 5))
    b = 0.5 * rng.standard_normal(5) if bias else None
    return x, W, b, 0.5 * rng.standard_normal((2, 3, 5))


def linear_backward(K, R, x, W, with_bias=True):
    dW, db = np.full_like(W, np.nan), np.full(W.shape[1], np.nan)      # must be overwritten
    d_x = K.linear_backward(R, x, W, dweight=dW, dbias=db if with_bias else None)
    return d_x, dW, db


@kernels_param()
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_linear_matches_autograd(K, bias, rng):
    x, W, b, R = linear_case(rng, bias)
    y, cache = K.linear_forward(x, W, b)
    d_x, dW, db = linear_backward(K, R, cache, W, bias)
    inputs = {"x": x, "W": W} | ({"b": b} if bias else {})
    out, grads = autograd(lambda x, W, b=None: x @ W + (0 if b is None else b), inputs, upstream=R)
    assert_autograd_close(y, out, "y")
    assert_autograd_close(d_x, grads["x"], "Δ_in")
    assert_autograd_close(dW, grads["W"], "∂L/∂W")
    if bias:
        assert_autograd_close(db, grads["b"], "∂L/∂b")
    else:
        assert np.all(np.isnan(db))                            # dbias=None: nothing written


@kernels_param()
def test_linear_matches_finite_differences(K, rng):
    x, W, b, R = linear_case(rng)

    def f():
        return projection(K.linear_forward(x, W, b)[0], R)

    d_x, dW, db = linear_backward(K, R, K.linear_forward(x, W, b)[1], W)
    for name, analytic, arr in (("W", dW, W), ("b", db, b), ("x", d_x, x)):
        assert_fd_close(analytic, numerical_grad(f, arr), f"linear.{name}")


@kernels_param()
def test_linear_backward_writes_only_what_is_asked_for(K, rng):
    x, W, b, R = linear_case(rng)
    assert K.linear_backward(R, x, W, need_input=False) is None          # first layer of a chain
    dW = np.full_like(W, np.nan)
    assert K.linear_backward(R, x, W, dweight=dW, need_input=False) is None
    assert np.all(np.isfinite(dW))


@kernels_param()
def test_linear_gradient_into_a_transposed_view(K, rng):
    """Tied logits: ``FC_logits`` uses ``W_tokᵀ``, so its weight gradient is written into the
    transpose of the ``(V, d)`` token-table gradient (a non-contiguous view)."""
    x, W, _, R = linear_case(rng)
    table_grad = np.full((W.shape[1], W.shape[0]), np.nan)      # (f_out, f_in), like dW_tok
    K.linear_backward(R, x, table_grad.T, dweight=table_grad.T, need_input=False)
    _, grads = autograd(lambda x, W: x @ W, {"x": x, "W": W}, upstream=R)
    assert_autograd_close(table_grad.T, grads["W"], "∂L/∂W into a transposed view")


# =========================================================================== activations
ACTIVATIONS = {
    "relu": F.relu,
    "gelu": lambda x: F.gelu(x, approximate="none"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,                       # Llama's (its tails: test_s2_swiglu.py)
}


def activation_input(rng, scale=2.0):
    x = scale * rng.standard_normal((2, 3, 4))
    return np.where(np.abs(x) < 0.05, 0.5, x)     # keep ReLU's kink farther than h from every point


@kernels_param()
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_matches_autograd(K, name, rng):
    x = activation_input(rng)
    R = rng.standard_normal(x.shape)
    y, cache = K.activation_forward(x, name)
    out, grads = autograd(lambda x: ACTIVATIONS[name](x), {"x": x}, upstream=R)
    assert_autograd_close(y, out, f"{name}(x)")
    assert_autograd_close(K.activation_backward(R, cache, name), grads["x"], f"{name}'")


@kernels_param()
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_matches_finite_differences(K, name, rng):
    x = activation_input(rng)
    R = 0.5 * rng.standard_normal(x.shape)

    def f():
        return projection(K.activation_forward(x, name)[0], R)

    _, cache = K.activation_forward(x, name)
    assert_fd_close(K.activation_backward(R, cache, name), numerical_grad(f, x), name)


@kernels_param()
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_of_large_inputs_is_finite_and_exact(K, name):
    """|x| up to 1e3: the GELUs saturate (x or 0) without overflow -- the fast GELU-tanh goes
    through exp(−2u), which overflows to inf for very negative x and must still give 0."""
    x = np.array([-1e3, -60.0, -10.0, 10.0, 60.0, 1e3])
    R = np.ones_like(x)
    with np.errstate(over="raise", invalid="raise", divide="raise"):    # underflow to 0 is right
        y, cache = K.activation_forward(x, name)
        d = K.activation_backward(R, cache, name)
    out, grads = autograd(lambda x: ACTIVATIONS[name](x), {"x": x}, upstream=R)
    assert np.all(np.isfinite(as_np(y))) and np.all(np.isfinite(as_np(d)))
    assert_autograd_close(y, out, f"{name}(±1e3)")
    assert_autograd_close(d, grads["x"], f"{name}'(±1e3)")


def test_unknown_activation_is_refused():
    import pedestrian.kernels as fast
    import pedestrian.layers as reference

    for K in (reference, fast):
        with pytest.raises(ValueError, match="unknown activation 'swish'.*relu"):
            K.activation_forward(np.ones(3), "swish")


# =========================================================================== dropout
@kernels_param()
def test_dropout_mask_and_gradient(K, rng):
    x = rng.standard_normal((2, 3, 8))
    R = 0.3 * rng.standard_normal(x.shape)
    p = 0.3

    def f():  # the same seed each time: the same mask
        return projection(K.dropout_forward(x, p, np.random.default_rng(5))[0], R)

    y, mask = K.dropout_forward(x, p, np.random.default_rng(5))
    kept = mask > 0
    assert np.any(~kept) and np.any(kept)
    assert np.all(mask[kept] == 1.0 / (1.0 - p))          # one division, the same for every entry
    np.testing.assert_array_equal(y, x * mask)
    d_x = K.dropout_backward(R, mask)
    out, grads = autograd(lambda x: x * torch.as_tensor(mask), {"x": x}, upstream=R)
    assert_autograd_close(d_x, grads["x"], "dropout Δ_in")
    assert_fd_close(d_x, numerical_grad(f, x), "dropout.x")


@kernels_param()
def test_dropout_off_is_the_identity_and_bad_p_is_refused(K, rng):
    x = rng.standard_normal((2, 3))
    y, mask = K.dropout_forward(x, 0.0, rng)
    assert y is x and mask is None and K.dropout_backward(x, None) is x
    for p in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\)"):
            K.dropout_forward(x, p, rng)


# =========================================================================== skip addition
@kernels_param()
def test_skip_addition_and_its_backward(K, rng):
    """``y = x + f(x)`` with ``f`` an FC layer: the forward is one IEEE addition per entry (so
    equal to NumPy's ``x + f(x)`` bit for bit), and the signal at ``x`` is ``Δ + Δ Wᵀ`` -- the
    incoming ``Δ`` goes unchanged down the skip and is added to what comes back through ``f``."""
    x = rng.standard_normal((2, 3, 4))
    W, b = 0.5 * rng.standard_normal((4, 4)), 0.5 * rng.standard_normal(4)
    R = rng.standard_normal(x.shape)
    fx, cache = K.linear_forward(x, W, b)
    y = K.add(x, fx)
    np.testing.assert_array_equal(y, x + fx)                    # correctly rounded on any machine
    d_x = K.add(R, K.linear_backward(R, cache, W))
    out, grads = autograd(lambda x: x + (x @ torch.as_tensor(W) + torch.as_tensor(b)), {"x": x}, upstream=R)
    assert_autograd_close(y, out, "x + f(x)")
    assert_autograd_close(d_x, grads["x"], "Δ at the skip's input")


# =========================================================================== expand layer + activation, one call
@kernels_param()
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_linear_activation_matches_autograd(K, name, bias, rng):
    """``a8 = g(a6 W + b)`` (linear_activation_forward) and its backward (``Δ6``, ``Δ7``, ``dW``,
    ``db``) against autograd; ``Δ7`` against autograd's gradient at ``a7``."""
    x, W, b, _ = linear_case(rng, bias)
    R = rng.standard_normal((2, 3, 5))
    (a7, a8), cache = K.linear_activation_forward(x, W, b, name)
    dW, db = np.full_like(W, np.nan), np.full(W.shape[1], np.nan)
    d6, d7 = K.linear_activation_backward(R, cache, W, name, dweight=dW, dbias=db if bias else None)
    inputs = {"x": x, "W": W} | ({"b": b} if bias else {})
    out, grads = autograd(lambda x, W, b=None: ACTIVATIONS[name](x @ W + (0 if b is None else b)), inputs, upstream=R)
    assert_autograd_close(a8, out, f"{name}(x W + b)")
    assert_autograd_close(a7, x @ W + (0 if b is None else b), "a7")
    _, at_a7 = autograd(lambda z: ACTIVATIONS[name](z), {"z": np.asarray(a7)}, upstream=R)
    assert_autograd_close(d7, at_a7["z"], "Δ7")
    assert_autograd_close(d6, grads["x"], "Δ6")
    assert_autograd_close(dW, grads["W"], "∂L/∂W")
    if bias:
        assert_autograd_close(db, grads["b"], "∂L/∂b")
    else:
        assert np.all(np.isnan(db))                            # dbias=None: nothing written


@kernels_param()
def test_linear_activation_matches_finite_differences(K, rng):
    x, W, b, _ = linear_case(rng)
    R = 0.5 * rng.standard_normal((2, 3, 5))

    def f():
        return projection(K.linear_activation_forward(x, W, b, "gelu_tanh")[0][1], R)

    dW, db = np.zeros_like(W), np.zeros_like(b)
    d6, _ = K.linear_activation_backward(R, K.linear_activation_forward(x, W, b, "gelu_tanh")[1], W, "gelu_tanh",
                                         dweight=dW, dbias=db)
    for what, analytic, arr in (("W", dW, W), ("b", db, b), ("x", d6, x)):
        assert_fd_close(analytic, numerical_grad(f, arr), f"linear_activation.{what}")

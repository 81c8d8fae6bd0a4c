"""RMS normalization (EQUATIONS.md "RMS normalization", the Llama family's layer norm): per token
``r = sqrt(mean_f(x²) + ε)``, ``x̂ = x/r``, ``y = x̂ ∘ w``, and its backward
``Δ_in = (1/r)(g − x̂ ∘ mean_f(g ∘ x̂))``, ``g = Δ ∘ w``, ``dw = Σ_tokens x̂ ∘ Δ`` -- for both kernel
modules, against PyTorch autograd (float64), finite differences, Hugging Face's ``LlamaRMSNorm``
(float32 and float64), the layer's invariance (the scale of each token, for ε = 0), float32
against float64 with a bound derived from ε32, NaN propagation and torch tensors.
Tolerances: tests/oracles/gradcheck.py; float32 bounds: tests/oracles/llama_oracles.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pedestrian.layers as reference
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
from llama_oracles import rmsnorm_bounds, torch_rmsnorm

EPS = pytest.mark.parametrize("eps", [0.0, 1e-5], ids=["eps0", "eps1e-5"])
WIDTH = pytest.mark.parametrize("d", [6, 7], ids=["d6", "d7"])


def case(seed, d, shape=(2, 3), dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = 1.5 * rng.standard_normal((*shape, d)) + 0.3
    w = 1.0 + 0.3 * rng.standard_normal(d)
    return x.astype(dtype), w.astype(dtype), (0.5 * rng.standard_normal(x.shape)).astype(dtype)


def backward(K, R, cache, d):
    dw = np.full(d, np.nan, dtype=R.dtype)                          # must be overwritten
    return K.rmsnorm_backward(R, cache, dweight=dw), dw


@kernels_param()
@EPS
@WIDTH
@pytest.mark.parametrize("B", [1, 2, 3])
def test_rmsnorm_matches_autograd(K, eps, d, B):
    """float64 at 1e-9 relative (gradcheck.RTOL_AUTOGRAD): two float64 computations of the same
    formula differ by a few dozen roundings (d + 10 operations per entry, ~1e-14), a wrong
    formula by O(1)."""
    x, w, R = case(B, d, shape=(B, 3))
    y, cache = K.rmsnorm_forward(x, w, eps)
    d_x, dw = backward(K, R, cache, d)
    out, grads = autograd(lambda x, w: torch_rmsnorm(x, w, eps), {"x": x, "w": w}, upstream=R)
    assert_autograd_close(y, out, "y")
    assert_autograd_close(d_x, grads["x"], "Δ_in")
    assert_autograd_close(dw, grads["w"], "∂L/∂w")


@kernels_param()
@EPS
@WIDTH
def test_rmsnorm_matches_finite_differences(K, eps, d):
    x, w, R = case(10 + d, d)

    def f():
        return projection(K.rmsnorm_forward(x, w, eps)[0], R)

    d_x, dw = backward(K, R, K.rmsnorm_forward(x, w, eps)[1], d)
    for name, analytic, arr in (("w", dw, w), ("x", d_x, x)):
        assert_fd_close(analytic, numerical_grad(f, arr), f"rmsnorm(eps={eps}).{name}")


@kernels_param()
def test_scale_invariance_makes_the_input_signal_orthogonal_to_xhat(K):
    """For ε = 0, ``y`` does not change when a token's features are scaled, so ``Σ_f Δ_in ∘ x̂ = 0``
    per row (the layer norm's second invariance; RMSNorm has no shift invariance, so its rows of
    ``Δ_in`` do not sum to zero) -- up to rounding of the row's absolute terms."""
    x, w, R = case(2, 7, shape=(3, 4))
    y, cache = K.rmsnorm_forward(x, w, 0.0)
    d_x, _ = backward(K, R, cache, 7)
    xhat = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True))
    b = rmsnorm_bounds(x, w, 0.0, R, np.float64)
    bound = (np.abs(xhat) * b["dx"]).sum(-1) + 9 * np.finfo(np.float64).eps * np.abs(as_np(d_x) * xhat).sum(-1)
    assert np.all(np.abs((as_np(d_x) * xhat).sum(-1)) <= bound)
    assert np.max(np.abs((as_np(d_x)).sum(-1))) > 1e-3            # (and no shift invariance)
    y3, _ = K.rmsnorm_forward(3.0 * x, w, 0.0)
    assert_rounding_close(y3, y, np.abs(xhat * w), "y(3x)")


@kernels_param()
@WIDTH
def test_rmsnorm_float32_within_its_rounding_bound(K, d):
    """float32 ``y``, ``Δ_in``, ``dw`` against the reference's float64 result of the same (float32)
    numbers, entry by entry within :func:`llama_oracles.rmsnorm_bounds` (derived from ε32: ``d/2 + 5``
    roundings for ``y``, ...). Both modules meet it, so fast and reference float32 differ by at
    most twice it."""
    x, w, R = case(5, d, shape=(3, 40), dtype=np.float32)
    x64, w64, R64 = (a.astype(np.float64) for a in (x, w, R))
    y, cache = K.rmsnorm_forward(x, w, 1e-5)
    d_x, dw = backward(K, R, cache, d)
    y_e, cache_e = reference.rmsnorm_forward(x64, w64, 1e-5)
    d_x_e, dw_e = backward(reference, R64, cache_e, d)
    b = rmsnorm_bounds(x64, w64, 1e-5, R64, np.float32)
    assert y.dtype == np.float32 and d_x.dtype == np.float32
    for name, got, exact in (("y", y, y_e), ("dx", d_x, d_x_e), ("dw", dw, dw_e)):
        err = np.abs(as_np(got) - as_np(exact))
        assert np.all(err <= b[name]), f"{name}: worst error / bound {np.max(err / b[name]):.2f}"


def _hf_rmsnorm(d, eps, w, dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(d, eps=eps).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.as_tensor(w))
    return module


@kernels_param()
@WIDTH
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_rmsnorm_matches_hugging_face_llama_rmsnorm(K, d, dtype):
    """``LlamaRMSNorm``'s forward (weights copied). HF computes in float32 whatever the input (it
    casts float64 down too), then rounds ``x̂`` to the input dtype and multiplies by ``w`` -- the
    order pedestrian follows -- so both sides are held to the float32 bound against the exact
    result, and ours, in float64, to float64 rounding of its absolute terms (HF's float64 output
    is no closer than float32's: shown)."""
    x, w, _ = case(7, d, shape=(2, 5), dtype=dtype)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    hf = _hf_rmsnorm(d, 1e-6, w, getattr(torch, np.dtype(dtype).name))
    with torch.no_grad():
        y_hf = as_np(hf(torch.as_tensor(x)))
    y, _ = K.rmsnorm_forward(x, w, 1e-6)
    exact = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-6) * w64
    bound = rmsnorm_bounds(x64, w64, 1e-6, np.zeros_like(x64), np.float32)["y"]
    assert np.all(np.abs(y_hf - exact) <= bound)
    assert np.all(np.abs(as_np(y) - y_hf) <= 2 * bound)
    if dtype == np.float64:
        assert_rounding_close(y, exact, np.abs(exact), "float64 y")
        assert np.max(np.abs(y_hf - exact)) > 1e3 * np.max(np.abs(as_np(y) - exact))   # HF: float32 inside


@kernels_param()
def test_nan_and_inf_stay_in_their_row(K):
    """No silent numbers: a NaN or an inf in one token's features makes that token's output and
    input signal non-finite (inf: ``x̂ = inf/inf``), and ``dw``; the other tokens are untouched."""
    x, w, R = case(3, 6, shape=(4,))
    clean, _ = K.rmsnorm_forward(x, w, 1e-5)
    for bad in (np.nan, np.inf, -np.inf):
        xb = x.copy()
        xb[1, 2] = bad
        with np.errstate(invalid="ignore"):                                 # (inf/inf: on purpose)
            y, cache = K.rmsnorm_forward(xb, w, 1e-5)
        d_x, dw = backward(K, R, cache, 6)
        assert not np.any(np.isfinite(as_np(y)[1, 2])) and np.all(np.isfinite(as_np(y)[[0, 2, 3]]))
        np.testing.assert_array_equal(as_np(y)[[0, 2, 3]], as_np(clean)[[0, 2, 3]])
        assert np.all(np.isnan(as_np(d_x)[1])) and np.all(np.isfinite(as_np(d_x)[[0, 2, 3]]))
        assert np.any(np.isnan(as_np(dw)))


@kernels_param()
def test_torch_tensors_give_the_numpy_results(K):
    """The array-API reference runs on torch tensors; the fast kernels through zero-copy views."""
    x, w, R = case(4, 7)
    y, cache = K.rmsnorm_forward(x, w, 1e-5)
    d_x, dw = backward(K, R, cache, 7)
    yt, cache_t = K.rmsnorm_forward(torch.as_tensor(x), torch.as_tensor(w), 1e-5)
    dwt = torch.full((7,), float("nan"), dtype=torch.float64)
    d_xt = K.rmsnorm_backward(torch.as_tensor(R), cache_t, dweight=dwt)
    assert isinstance(yt, torch.Tensor) and isinstance(d_xt, torch.Tensor)
    b = rmsnorm_bounds(x, w, 1e-5, R, np.float64)
    for name, a, ref in (("y", yt, y), ("dx", d_xt, d_x), ("dw", dwt, dw)):
        assert np.all(np.abs(as_np(a) - as_np(ref)) <= 2 * b[name]), name


@kernels_param()
def test_negative_eps_is_refused(K):
    with pytest.raises(ValueError, match="RMS norm eps must be >= 0, got -1e-05"):
        K.rmsnorm_forward(np.ones((1, 6)), np.ones(6), -1e-5)

"""SiLU and the SwiGLU MLP (EQUATIONS.md "SiLU and the SwiGLU MLP", the Llama family's MLP):
``a7_gate = a6 W_gate``, ``a7_up = a6 W_up``, ``a8 = silu(a7_gate) ∘ a7_up``, ``a9 = a8 W_down``, and
its backward ``Δ8 = Δ9 W_downᵀ``, ``Δ7_up = Δ8 ∘ silu(a7_gate)``, ``Δ7_gate = Δ8 ∘ a7_up ∘ silu'(a7_gate)``,
``Δ6 = Δ7_gate W_gateᵀ + Δ7_up W_upᵀ`` with the three weight gradients -- for both kernel modules,
against PyTorch autograd (float64), finite differences, Hugging Face's ``LlamaMLP`` (float64 and
float32), float32 against float64 with a bound derived from ε32; SiLU's tails against mpmath.
(SiLU as the block's activation runs the shared activation tests of test_s2_mlp.py too.)
Tolerances: tests/oracles/gradcheck.py; float32 bounds: tests/oracles/llama_oracles.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

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
from llama_oracles import swiglu_mlp_bounds, torch_swiglu_mlp

WIDTHS = pytest.mark.parametrize("d,m", [(6, 8), (7, 5)], ids=["d6-m8", "d7-m5"])
GRADS = ("dw_gate", "dw_up", "dw_down")


def case(seed, d, m, shape=(2, 3), dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*shape, d))
    ws = [rng.standard_normal(s) / np.sqrt(s[0]) * 1.5 for s in ((d, m), (d, m), (m, d))]
    R = 0.5 * rng.standard_normal((*shape, d))
    return [a.astype(dtype) for a in (x, *ws, R)]


def backward(K, R, cache, ws):
    grads = {k: np.full(w.shape, np.nan, dtype=w.dtype) for k, w in zip(GRADS, ws)}   # must be overwritten
    return K.swiglu_mlp_backward(R, cache, *ws, **grads), grads


# =========================================================================== SiLU's tails
TAILS = [-np.inf, -1e30, -1e3, -745.0, -720.0, -100.0, -30.0, -5.0, 0.5, 5.0, 30.0, 100.0, 1e3, 1e30, np.inf]


def _silu_exact(x: float) -> tuple[float, float]:
    """``(silu(x), silu'(x))`` to 50 digits (mpmath: torch requires sympy, which requires it)."""
    import mpmath

    mpmath.mp.dps = 50
    if np.isinf(x):
        return (0.0, 0.0) if x < 0 else (np.inf, 1.0)
    s = 1 / (1 + mpmath.exp(-mpmath.mpf(x)))
    return float(x * s), float(s * (1 + x * (1 - s)))


@kernels_param()
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_silu_tails_are_exact(K, dtype):
    """From −inf to +inf: no NaN, no overflow, and each value within 8 roundings of the exact one
    (SiLU and SiLU' are a handful of operations on ``exp(−|x|)``, no cancellation in the tails),
    plus, where the result is subnormal, ``(1 + |x|)`` times the smallest subnormal's rounding
    (``σ(x)`` rounded in the subnormal range, then multiplied by ``x``). The limits:
    ``silu(−inf) = 0``, ``silu(+inf) = inf``, ``silu'(−inf) = 0``, ``silu'(+inf) = 1`` -- where
    PyTorch's own ``silu(−inf)`` and ``silu'(+inf)`` are NaN."""
    x = np.array(TAILS, dtype=dtype)
    with np.errstate(over="raise", invalid="raise", divide="raise"):     # underflow to 0 is right
        y, cache = K.activation_forward(x, "silu")
        d = K.activation_backward(np.ones_like(x), cache, "silu")
    exact = np.array([_silu_exact(float(v)) for v in x])
    info = np.finfo(dtype)
    for name, got, want in (("silu", y, exact[:, 0]), ("silu'", d, exact[:, 1])):
        got = as_np(got)
        assert not np.any(np.isnan(got)), f"{name}: NaN at {x[np.isnan(got)]}"
        finite = np.isfinite(want)
        assert np.array_equal(got[~finite], want[~finite]), name
        want_r = want[finite].astype(dtype).astype(np.float64)              # the exact value, rounded
        bound = 8 * info.eps * np.abs(want_r) + (1 + np.abs(x[finite])) * info.smallest_subnormal
        assert np.all(np.abs(got[finite] - want_r) <= bound), (name, x[finite][np.abs(got[finite] - want_r) > bound])
    assert as_np(y)[0] == 0 and as_np(d)[0] == 0 and as_np(d)[-1] == 1


@kernels_param()
def test_silu_keeps_nan(K):
    x = np.array([np.nan, 1.0, -np.nan])
    y, cache = K.activation_forward(x, "silu")
    d = K.activation_backward(np.ones(3), cache, "silu")
    assert np.isnan(as_np(y)[[0, 2]]).all() and np.isnan(as_np(d)[[0, 2]]).all() and np.isfinite(as_np(y)[1])


# =========================================================================== the gate
@kernels_param()
def test_swiglu_gate_matches_autograd(K):
    rng = np.random.default_rng(0)
    g, u, R = 2.0 * rng.standard_normal((3, 2, 9)), rng.standard_normal((3, 2, 9)), rng.standard_normal((3, 2, 9))
    a8, cache = K.swiglu_forward(g, u)
    d_gate, d_up = K.swiglu_backward(R, cache)
    out, grads = autograd(lambda g, u: F.silu(g) * u, {"g": g, "u": u}, upstream=R)
    assert_autograd_close(a8, out, "a8")
    assert_autograd_close(d_gate, grads["g"], "Δ7_gate")
    assert_autograd_close(d_up, grads["u"], "Δ7_up")


@kernels_param()
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape,m", [((3, 2), 9), ((1, 1), 1), ((2, 33), 31), ((3, 64), 64), ((2, 100), 257)],
                         ids=["tiny", "one", "odd", "2^13", "2^15+"])
def test_swiglu_gate_on_the_halves_of_the_fused_gate_up_output(K, shape, m, dtype):
    """The model's route: ``a7 = a6 W_gate_up`` is one ``(..., 2m)`` array ``[a7_gate | a7_up]``; the
    gate reads its halves in place and the backward writes ``Δ7 = [Δ7_gate | Δ7_up]`` in one array
    -- the same numbers, bit for bit, as on two separate arrays (elementwise formulas: the same
    operations in the same order), across the kernels' serial / threaded sizes (2^12, 2^15)."""
    rng = np.random.default_rng(m)
    a7 = (2.0 * rng.standard_normal((*shape, 2 * m))).astype(dtype)
    R = rng.standard_normal((*shape, m)).astype(dtype)
    g, u = a7[..., :m], a7[..., m:]
    a8, cache = K.swiglu_forward(g, u)
    d7 = K.swiglu_backward(R, cache, fused=True)
    a8_apart, cache_apart = K.swiglu_forward(np.ascontiguousarray(g), np.ascontiguousarray(u))
    d_gate, d_up = K.swiglu_backward(R, cache_apart)
    np.testing.assert_array_equal(a8, a8_apart)
    assert d7.shape == a7.shape
    np.testing.assert_array_equal(d7, np.concatenate((d_gate, d_up), axis=-1))
    np.testing.assert_array_equal(K.swiglu_backward(R, cache)[0], d_gate)      # (not fused: halves apart)
    if dtype == np.float64 and m == 9:
        out, grads = autograd(lambda g, u: F.silu(g) * u, {"g": g, "u": u}, upstream=R)
        assert_autograd_close(a8, out, "a8")
        assert_autograd_close(d7, np.concatenate((grads["g"], grads["u"]), axis=-1), "Δ7")


# =========================================================================== the MLP
@kernels_param()
@WIDTHS
@pytest.mark.parametrize("B", [1, 2, 3])
def test_swiglu_mlp_matches_autograd(K, d, m, B):
    """float64 at 1e-9 relative (gradcheck.RTOL_AUTOGRAD): the two sides evaluate the same formula
    in float64 with sums of at most ``d + m + B·3`` terms (~1e-14 apart); a wrong one errs by O(1).
    The cache holds ``a6, a7_gate, a7_up, a8`` under those names (the model's activations())."""
    x, wg, wu, wd, R = case(B, d, m, shape=(B, 3))
    y, cache = K.swiglu_mlp_forward(x, wg, wu, wd)
    d_x, grads = backward(K, R, cache, (wg, wu, wd))
    inputs = {"x": x, "w_gate": wg, "w_up": wu, "w_down": wd}
    out, ref = autograd(torch_swiglu_mlp, inputs, upstream=R)
    assert_autograd_close(y, out, "a9")
    assert_autograd_close(d_x, ref["x"], "Δ6")
    for k, name in zip(GRADS, ("w_gate", "w_up", "w_down")):
        assert_autograd_close(grads[k], ref[name], f"∂L/∂{name}")
    assert cache._fields == ("a6", "a7_gate", "a7_up", "a8", "activation") and cache.a6 is x
    assert cache.activation == "silu"
    assert_autograd_close(cache.a7_gate, x @ wg, "a7_gate")
    assert_autograd_close(cache.a7_up, x @ wu, "a7_up")
    assert_autograd_close(cache.a8, F.silu(torch.as_tensor(x @ wg)).numpy() * (x @ wu), "a8")


@kernels_param()
@WIDTHS
def test_swiglu_mlp_matches_finite_differences(K, d, m):
    x, wg, wu, wd, R = case(20 + d, d, m)
    R = 0.25 * R                                                 # |f| <= gradcheck.F_MAX

    def f():
        return projection(K.swiglu_mlp_forward(x, wg, wu, wd)[0], R)

    d_x, grads = backward(K, R, K.swiglu_mlp_forward(x, wg, wu, wd)[1], (wg, wu, wd))
    for name, analytic, arr in (("W_gate", grads["dw_gate"], wg), ("W_up", grads["dw_up"], wu),
                                ("W_down", grads["dw_down"], wd), ("x", d_x, x)):
        assert_fd_close(analytic, numerical_grad(f, arr), f"swiglu_mlp.{name}")


@kernels_param()
@WIDTHS
def test_swiglu_mlp_float32_within_its_rounding_bound(K, d, m):
    """float32 ``a9``, ``Δ6`` and the weight gradients against the reference's float64 result of
    the same (float32) numbers, entry by entry within :func:`llama_oracles.swiglu_mlp_bounds`
    (derived from ε32). Both modules meet it, so fast and reference float32 differ by at most
    twice it."""
    x, wg, wu, wd, R = case(5, d, m, shape=(3, 50), dtype=np.float32)
    x64, wg64, wu64, wd64, R64 = (a.astype(np.float64) for a in (x, wg, wu, wd, R))
    y, cache = K.swiglu_mlp_forward(x, wg, wu, wd)
    d_x, grads = backward(K, R, cache, (wg, wu, wd))
    y_e, cache_e = reference.swiglu_mlp_forward(x64, wg64, wu64, wd64)
    d_x_e, grads_e = backward(reference, R64, cache_e, (wg64, wu64, wd64))
    b = swiglu_mlp_bounds(x64.reshape(-1, d), wg64, wu64, wd64, R64.reshape(-1, d), np.float32)
    assert y.dtype == d_x.dtype == np.float32
    pairs = [("y", y, y_e), ("dx", d_x, d_x_e)] + [(k, grads[k], grads_e[k]) for k in GRADS]
    for name, got, exact in pairs:
        err = np.abs(as_np(got) - as_np(exact)).reshape(b[name].shape)
        assert np.all(err <= b[name]), f"{name}: worst error / bound {np.max(err / b[name]):.2f}"


def _hf_mlp(d, m, wg, wu, wd, dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = LlamaConfig(hidden_size=d, intermediate_size=m, hidden_act="silu", mlp_bias=False,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=2, vocab_size=8)  # (attention unused)
    mlp = LlamaMLP(config).to(dtype)
    with torch.no_grad():                                    # nn.Linear stores (out, in): transpose
        for proj, w in ((mlp.gate_proj, wg), (mlp.up_proj, wu), (mlp.down_proj, wd)):
            proj.weight.copy_(torch.as_tensor(w.T))
    return mlp


@kernels_param()
@WIDTHS
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_swiglu_mlp_matches_hugging_face_llama_mlp(K, d, m, dtype):
    """``LlamaMLP``'s forward (a tiny ``LlamaConfig``, weights copied and transposed): float64 to
    rounding of the absolute terms (gradcheck.RTOL_ROUNDING), float32 within twice the float32
    bound (two float32 computations, each within it)."""
    x, wg, wu, wd, _ = case(9, d, m, dtype=dtype)
    mlp = _hf_mlp(d, m, wg, wu, wd, getattr(torch, np.dtype(dtype).name))
    assert all(p.bias is None for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    with torch.no_grad():
        y_hf = as_np(mlp(torch.as_tensor(x)))
    y, _ = K.swiglu_mlp_forward(x, wg, wu, wd)
    x64, wg64, wu64, wd64 = (a.astype(np.float64) for a in (x, wg, wu, wd))
    if dtype == np.float64:
        terms = (np.abs(F.silu(torch.as_tensor(x64 @ wg64)).numpy() * (x64 @ wu64))) @ np.abs(wd64)
        assert_rounding_close(y, y_hf, terms, "a9 against LlamaMLP")
    else:
        b = swiglu_mlp_bounds(x64.reshape(-1, d), wg64, wu64, wd64, np.zeros((x64.size // d, d)), np.float32)
        assert np.all(np.abs(as_np(y) - y_hf).reshape(-1, d) <= 2 * b["y"])


@kernels_param()
def test_frozen_weights_and_no_input_signal(K):
    """``dw_*=None``: nothing written for that weight; ``need_input=False``: no ``Δ6`` (``None``)."""
    x, wg, wu, wd, R = case(3, 6, 4)
    _, cache = K.swiglu_mlp_forward(x, wg, wu, wd)
    d_x_all, grads_all = backward(K, R, cache, (wg, wu, wd))
    dwd = np.full(wd.shape, np.nan)
    assert K.swiglu_mlp_backward(R, cache, wg, wu, wd, dw_down=dwd, need_input=False) is None
    np.testing.assert_array_equal(dwd, grads_all["dw_down"])
    d_x = K.swiglu_mlp_backward(R, cache, wg, wu, wd)
    np.testing.assert_array_equal(as_np(d_x), as_np(d_x_all))


@kernels_param()
def test_nan_stays_in_its_token(K):
    """No silent numbers: a NaN in one token's input reaches that token's output and ``Δ6`` and
    every weight gradient's rows it touches; the other tokens are untouched."""
    x, wg, wu, wd, R = case(4, 6, 4, shape=(4,))
    clean, _ = K.swiglu_mlp_forward(x, wg, wu, wd)
    x[2, 1] = np.nan
    y, cache = K.swiglu_mlp_forward(x, wg, wu, wd)
    d_x, grads = backward(K, R, cache, (wg, wu, wd))
    assert np.all(np.isnan(as_np(y)[2])) and np.all(np.isnan(as_np(d_x)[2]))
    np.testing.assert_array_equal(as_np(y)[[0, 1, 3]], as_np(clean)[[0, 1, 3]])
    assert all(np.any(np.isnan(grads[k])) for k in GRADS)


@kernels_param()
def test_torch_tensors_give_the_numpy_results(K):
    x, wg, wu, wd, R = case(6, 7, 5)
    y, cache = K.swiglu_mlp_forward(x, wg, wu, wd)
    d_x, grads = backward(K, R, cache, (wg, wu, wd))
    t = [torch.as_tensor(a) for a in (x, wg, wu, wd)]
    yt, cache_t = K.swiglu_mlp_forward(*t)
    grads_t = {k: torch.full(w.shape, float("nan"), dtype=torch.float64) for k, w in zip(GRADS, t[1:])}
    d_xt = K.swiglu_mlp_backward(torch.as_tensor(R), cache_t, *t[1:], **grads_t)
    assert isinstance(yt, torch.Tensor) and isinstance(cache_t.a8, torch.Tensor) and isinstance(d_xt, torch.Tensor)
    b = swiglu_mlp_bounds(x.reshape(-1, 7), wg, wu, wd, R.reshape(-1, 7), np.float64)
    for name, a, ref in [("y", yt, y), ("dx", d_xt, d_x)] + [(k, grads_t[k], grads[k]) for k in GRADS]:
        assert np.all(np.abs(as_np(a) - as_np(ref)).reshape(b[name].shape) <= 2 * b[name]), name


@kernels_param()
def test_weights_of_the_wrong_shapes_are_refused(K):
    """Hugging Face's ``(out, in)`` layout passed untransposed is named, with the fix."""
    x, wg, wu, wd, _ = case(7, 6, 4)
    with pytest.raises(ValueError, match=r"W_gate \(d, m\), W_up \(d, m\), W_down \(m, d_out\).*"
                                         r"got \(4, 6\), \(4, 6\), \(6, 4\).*transpose gate_proj"):
        K.swiglu_mlp_forward(x, wg.T, wu.T, wd.T)

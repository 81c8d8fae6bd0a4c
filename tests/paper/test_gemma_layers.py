"""Gemma's layers (EQUATIONS.md "Gemma"): the RMS norm with ``(1 + w)``, the embedding scaled by
``√d``, the GeGLU MLP (the tanh GELU in SwiGLU's place), and soft-capping ``c · tanh(z / c)``
alone and inside the fused head -- for both kernel modules, against PyTorch autograd (float64),
finite differences, and the identities that reduce them to layers tested elsewhere.

Tolerances: tests/oracles/gradcheck.py (``RTOL_AUTOGRAD = 1e-9``: the two sides evaluate the same
formula in float64, a few hundred ulps apart at most; a wrong formula errs by O(1);
``RTOL_FD``: central differences). Where an identity holds exactly (the same operations on the
same numbers) the test asks for the same bits.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pedestrian.kernels as fast
import pedestrian.layers as reference
from gradcheck import (
    as_np,
    assert_autograd_close,
    assert_fd_close,
    autograd,
    kernels_param,
    numerical_grad,
    projection,
)

SHAPES = pytest.mark.parametrize("shape,d", [((1, 1), 1), ((2, 3), 6), ((3, 5), 7)], ids=["one", "even", "odd"])


# =========================================================================== RMS norm (1 + w)
@kernels_param()
@SHAPES
def test_rmsnorm_offset_matches_autograd(K, shape, d):
    """``y = x̂ ∘ (1 + w)`` (Gemma's ``GemmaRMSNorm``) with weights around 0; ``dw = Σ x̂ ∘ Δ`` (the
    offset is a constant)."""
    rng = np.random.default_rng(d)
    x, w, R = rng.standard_normal((*shape, d)), 0.3 * rng.standard_normal(d), rng.standard_normal((*shape, d))
    y, cache = K.rmsnorm_forward(x, w, 1e-6, offset=1.0)
    dw = np.full(d, np.nan)
    dx = K.rmsnorm_backward(R, cache, dweight=dw)

    def gemma_norm(x, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)
    out, grads = autograd(gemma_norm, {"x": x, "w": w}, upstream=R)
    assert_autograd_close(y, out, "y")
    assert_autograd_close(dx, grads["x"], "Δ_in")
    assert_autograd_close(dw, grads["w"], "dw")


@kernels_param()
def test_rmsnorm_offset_matches_finite_differences(K):
    rng = np.random.default_rng(3)
    x, w, R = rng.standard_normal((2, 3, 5)), 0.3 * rng.standard_normal(5), 0.5 * rng.standard_normal((2, 3, 5))

    def f():
        return projection(K.rmsnorm_forward(x, w, 1e-5, offset=1.0)[0], R)
    dw = np.empty(5)
    dx = K.rmsnorm_backward(R, K.rmsnorm_forward(x, w, 1e-5, offset=1.0)[1], dweight=dw)
    assert_fd_close(dx, numerical_grad(f, x), "x")
    assert_fd_close(dw, numerical_grad(f, w), "w")


@kernels_param()
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_rmsnorm_offset_is_the_norm_of_the_shifted_weight(K, dtype):
    """The offset is added to ``w`` once, rounded, then the plain norm runs (Gemma's order): the
    same bits as the plain norm given ``1 + w`` -- so the fast path's agreement with the reference
    over the shape space is the plain norm's (tests/system/test_llama_layers_property.py). The
    skip-and-norm pair too, and the gradients."""
    rng = np.random.default_rng(0)
    x, r = rng.standard_normal((3, 33, 17)).astype(dtype), rng.standard_normal((3, 33, 17)).astype(dtype)
    w, R = (0.2 * rng.standard_normal(17)).astype(dtype), rng.standard_normal((3, 33, 17)).astype(dtype)
    y, cache = K.rmsnorm_forward(x, w, 1e-6, offset=1.0)
    y1, cache1 = K.rmsnorm_forward(x, 1.0 + w, 1e-6)
    np.testing.assert_array_equal(y, y1)
    dw, dw1 = np.empty_like(w), np.empty_like(w)
    np.testing.assert_array_equal(K.rmsnorm_backward(R, cache, dweight=dw), K.rmsnorm_backward(R, cache1, dweight=dw1))
    np.testing.assert_array_equal(dw, dw1)
    (s, y2), _ = K.add_rmsnorm_forward(x, r, w, 1e-6, offset=1.0)
    (s1, y3), _ = K.add_rmsnorm_forward(x, r, 1.0 + w, 1e-6)
    np.testing.assert_array_equal(y2, y3)
    np.testing.assert_array_equal(s, s1)


# =========================================================================== embedding · √d
@kernels_param()
@pytest.mark.parametrize("positions", [False, True], ids=["no-table", "learned"])
def test_scaled_embedding_matches_autograd(K, positions):
    """``a1 = s · W_tok[a0] (+ W_pos)``; ``dW_tok[t] = Σ_{a0 = t} s · Δ1`` (repeated ids add up),
    ``dW_pos`` unscaled."""
    rng = np.random.default_rng(1)
    V, d, C = 7, 6, 5
    tok, pos = rng.standard_normal((V, d)), rng.standard_normal((C, d)) if positions else None
    ids = np.array([[1, 3, 1, 0], [6, 6, 2, 1]])
    R = rng.standard_normal((2, 4, d))
    s = math.sqrt(d)
    a1, cache = K.embedding_forward(ids, tok, pos, scale=s)
    dtok, dpos = np.full_like(tok, np.nan), None if pos is None else np.full_like(pos, np.nan)
    K.embedding_backward(R, cache, dtok=dtok, dpos=dpos)
    inputs = {"tok": tok} | ({"pos": pos} if positions else {})

    def emb(tok, pos=None):
        out = tok[torch.as_tensor(ids)] * s
        return out if pos is None else out + pos[:4]
    out, grads = autograd(emb, inputs, upstream=R)
    assert_autograd_close(a1, out, "a1")
    assert_autograd_close(dtok, grads["tok"], "dW_tok")
    if positions:
        assert_autograd_close(dpos, grads["pos"], "dW_pos")


@kernels_param()
def test_scaled_embedding_rounds_the_scale_to_the_table_dtype(K):
    """Gemma's ``normalizer`` is ``√d`` as a tensor of the model's dtype: in float32 the scale is
    ``float32(√d)``, and each entry one product of float32 numbers (the same bits as NumPy's)."""
    rng = np.random.default_rng(2)
    tok = rng.standard_normal((5, 8)).astype(np.float32)
    ids = np.array([[0, 4, 2]])
    a1, cache = K.embedding_forward(ids, tok, None, scale=math.sqrt(3072))
    np.testing.assert_array_equal(as_np(a1), tok[ids] * np.float32(math.sqrt(3072)))
    assert float(np.float32(math.sqrt(3072))) != math.sqrt(3072)           # (the rounding is seen)
    dtok = np.empty_like(tok)
    K.embedding_backward(np.ones((1, 3, 8), np.float32), cache, dtok=dtok, accumulate_tok=False)
    np.testing.assert_array_equal(dtok[4], np.full(8, np.float32(math.sqrt(3072))))
    np.testing.assert_array_equal(dtok[1], np.zeros(8, np.float32))


def test_scaled_embedding_fast_equals_reference():
    """The forward ``s · W_tok + W_pos`` may be one fused multiply-add in the fast kernel (one
    rounding instead of two): within ``ε (|s W_tok| + |W_pos|)``. The backward: sums in token order
    (fast: one loop in order; reference: NumPy's unbuffered add) of the same products: at most
    ``n ε`` of their terms' magnitudes (``n = 48`` tokens)."""
    rng = np.random.default_rng(4)
    tok, pos = rng.standard_normal((11, 9)), rng.standard_normal((16, 9))
    ids = rng.integers(0, 11, (3, 16))
    R = rng.standard_normal((3, 16, 9))
    out = {}
    for name, K in (("fast", fast), ("reference", reference)):
        a1, cache = K.embedding_forward(ids, tok, pos, scale=3.0)
        dtok, dpos = np.empty_like(tok), np.empty_like(pos)
        K.embedding_backward(R, cache, dtok=dtok, dpos=dpos)
        out[name] = (as_np(a1), dtok, dpos)
    eps = np.finfo(np.float64).eps
    np.testing.assert_array_less(np.abs(out["fast"][0] - out["reference"][0]),
                                 eps * (3 * np.abs(tok[ids]) + np.abs(pos[:16])) + 1e-300)
    for a, b in zip(out["fast"][1:], out["reference"][1:]):
        n = 48                                                              # at most every token
        assert np.all(np.abs(a - b) <= n * eps * 3 * np.abs(R).sum((0, 1)))


# =========================================================================== GeGLU
def _geglu(g, u):
    return F.gelu(g, approximate="tanh") * u


@kernels_param()
def test_geglu_gate_matches_autograd(K):
    rng = np.random.default_rng(0)
    g, u, R = 2.0 * rng.standard_normal((3, 2, 9)), rng.standard_normal((3, 2, 9)), rng.standard_normal((3, 2, 9))
    a8, cache = K.swiglu_forward(g, u, "gelu_tanh")
    d_gate, d_up = K.swiglu_backward(R, cache)
    out, grads = autograd(_geglu, {"g": g, "u": u}, upstream=R)
    assert_autograd_close(a8, out, "a8")
    assert_autograd_close(d_gate, grads["g"], "Δ7_gate")
    assert_autograd_close(d_up, grads["u"], "Δ7_up")


@kernels_param()
@pytest.mark.parametrize("d,m", [(6, 8), (7, 5)])
def test_geglu_mlp_matches_autograd_and_finite_differences(K, d, m):
    """``a9 = (gelu_tanh(a6 W_gate) ∘ a6 W_up) W_down`` (Gemma's ``GemmaMLP`` with
    ``hidden_activation = gelu_pytorch_tanh``) and its backward."""
    rng = np.random.default_rng(d)
    x = rng.standard_normal((2, 3, d))
    ws = [rng.standard_normal(s) / np.sqrt(s[0]) * 1.5 for s in ((d, m), (d, m), (m, d))]
    R = 0.25 * rng.standard_normal((2, 3, d))
    y, cache = K.swiglu_mlp_forward(x, *ws, activation="gelu_tanh")
    grads = {k: np.full(w.shape, np.nan) for k, w in zip(("dw_gate", "dw_up", "dw_down"), ws)}
    dx = K.swiglu_mlp_backward(R, cache, *ws, **grads)
    assert cache.activation == "gelu_tanh"

    def mlp(x, wg, wu, wd):
        return _geglu(x @ wg, x @ wu) @ wd
    out, ref = autograd(mlp, {"x": x, "wg": ws[0], "wu": ws[1], "wd": ws[2]}, upstream=R)
    assert_autograd_close(y, out, "a9")
    assert_autograd_close(dx, ref["x"], "Δ6")
    for k, name in zip(grads, ("wg", "wu", "wd")):
        assert_autograd_close(grads[k], ref[name], k)

    def f():
        return projection(K.swiglu_mlp_forward(x, *ws, activation="gelu_tanh")[0], R)
    assert_fd_close(dx, numerical_grad(f, x), "x")
    assert_fd_close(grads["dw_gate"], numerical_grad(f, ws[0]), "W_gate")


@kernels_param()
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape,m", [((1, 1), 1), ((2, 33), 31), ((3, 64), 64), ((2, 100), 257)])
def test_geglu_is_the_tanh_gelu_times_up(K, shape, m, dtype):
    """The gate is the activation's own kernel times ``up`` (the same operations, the same bits)
    -- on two arrays and on the halves of the fused ``[a7_gate | a7_up]``, at the kernels' serial
    and threaded sizes. So the fast GeGLU agrees with the reference wherever the fast tanh GELU
    does (its property tests: tests/system/test_fast_path_property.py, tests/paper/test_s2_mlp.py)."""
    rng = np.random.default_rng(m)
    a7 = (3.0 * rng.standard_normal((*shape, 2 * m))).astype(dtype)
    R = rng.standard_normal((*shape, m)).astype(dtype)
    g, u = a7[..., :m], a7[..., m:]
    gelu, act = K.activation_forward(np.ascontiguousarray(g), "gelu_tanh")
    want_a8 = gelu * u
    want_gate = K.activation_backward(R * u, act, "gelu_tanh")
    for gate, up in ((g, u), (np.ascontiguousarray(g), np.ascontiguousarray(u))):
        a8, cache = K.swiglu_forward(gate, up, "gelu_tanh")
        assert a8.dtype == dtype
        np.testing.assert_array_equal(a8, want_a8)
        d7 = K.swiglu_backward(R, cache, fused=True)
        np.testing.assert_array_equal(d7, np.concatenate((want_gate, R * gelu), axis=-1))


@kernels_param()
def test_gate_activation_other_than_silu_or_gelu_tanh_is_refused(K):
    with pytest.raises(ValueError, match="gelu_tanh"):
        K.swiglu_forward(np.ones(3), np.ones(3), "relu")


# =========================================================================== soft-cap
@kernels_param()
@pytest.mark.parametrize("cap", [0.7, 30.0])
def test_softcap_matches_autograd_and_finite_differences(K, cap):
    rng = np.random.default_rng(5)
    z, R = 4.0 * rng.standard_normal((2, 3, 11)), rng.standard_normal((2, 3, 11))
    y, cache = K.softcap_forward(z, cap)
    dz = K.softcap_backward(R, cache)
    out, grads = autograd(lambda z: cap * torch.tanh(z / cap), {"z": z}, upstream=R)
    assert_autograd_close(y, out, "y")
    assert_autograd_close(dz, grads["z"], "Δ_in")
    assert_fd_close(dz, numerical_grad(lambda: projection(K.softcap_forward(z, cap)[0], 0.5 * R), z) * 2, "z")
    assert np.all(np.abs(as_np(y)) <= cap)


@kernels_param()
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_softcap_limits_and_nan(K, dtype):
    """``±inf ↦ ±c`` with slope 0, ``0 ↦ 0`` with slope 1, tiny inputs kept (``tanh u ≈ u``), NaN stays NaN."""
    z = np.array([-np.inf, -1e30, -1e-30, 0.0, 1e-30, 1e30, np.inf, np.nan], dtype)
    y, cache = K.softcap_forward(z, 30.0)
    d = as_np(K.softcap_backward(np.ones_like(z), cache))
    y = as_np(y)
    np.testing.assert_array_equal(y[[0, 1, 3, 5, 6]], np.array([-30, -30, 0, 30, 30], dtype))
    np.testing.assert_allclose(y[[2, 4]], z[[2, 4]], rtol=4 * np.finfo(dtype).eps)
    np.testing.assert_array_equal(d[[0, 1, 3, 5, 6]], np.array([0, 0, 1, 0, 0], dtype))
    assert np.isnan(y[7]) and np.isnan(d[7])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_softcap_fast_equals_reference(dtype):
    """One ``tanh`` (libm's in the fast kernel, formed in float64; NumPy's in the reference, in the
    data's dtype) and a product or two: within 4 ε of the data's dtype relative, plus the
    reference's own float32 rounding of ``z / c``."""
    rng = np.random.default_rng(6)
    z = (np.exp(rng.uniform(-20, 6, (3, 257))) * rng.choice([-1, 1], (3, 257))).astype(dtype)
    R = rng.standard_normal((3, 257)).astype(dtype)
    eps = float(np.finfo(dtype).eps)
    (yf, cf), (yr, cr) = fast.softcap_forward(z, 5.0), reference.softcap_forward(z, 5.0)
    np.testing.assert_array_less(np.abs(yf - yr), 4 * eps * np.abs(yr.astype(np.float64)) + 1e-300)
    df, dr = fast.softcap_backward(R, cf), reference.softcap_backward(R, cr)
    t = np.tanh(z.astype(np.float64) / 5.0)
    np.testing.assert_array_less(np.abs(df - dr), 8 * eps * np.abs(R) * (1 - t * t + 2 * np.abs(t) * eps) + 1e-300
                                 + 4 * eps * np.abs(R))


# =========================================================================== the fused head, capped
def _head_oracle(h, W, b, y, cap):
    def loss(h, W, b):
        z = h @ W + b
        z = cap * torch.tanh(z / cap)
        return F.cross_entropy(z.reshape(-1, z.shape[-1]), torch.as_tensor(y).reshape(-1), ignore_index=-100)
    return autograd(loss, {"h": h, "W": W, "b": b})


@kernels_param()
@pytest.mark.parametrize("chunk_rows", [None, 1, 4])
def test_fused_head_with_softcap_matches_autograd(K, chunk_rows):
    """``L = CE(c · tanh((h W + b) / c))`` and its gradients, a chunk of rows at a time (chunks of 1
    and 4 rows of 9, and one chunk), an ignored target included."""
    rng = np.random.default_rng(7)
    h, W, b = rng.standard_normal((3, 3, 5)), 2.0 * rng.standard_normal((5, 13)), rng.standard_normal(13)
    y = rng.integers(0, 13, (3, 3))
    y[1, 1] = -100
    loss, cache = K.head_loss_forward(h, W, b, y, chunk_rows=chunk_rows, softcap=3.0)
    dW, db = np.full_like(W, np.nan), np.full_like(b, np.nan)
    dh = K.head_loss_backward(cache, dweight=dW, dbias=db)
    out, grads = _head_oracle(h, W, b, y, 3.0)
    assert_autograd_close(np.asarray(loss), out, "loss")
    assert_autograd_close(dh, grads["h"], "Δ11")
    assert_autograd_close(dW, grads["W"], "dW")
    assert_autograd_close(db, grads["b"], "db")
    loss_only, _ = K.head_loss_forward(h, W, b, y, chunk_rows=chunk_rows, softcap=3.0, grad=False)
    assert_autograd_close(np.asarray(loss_only), out, "loss (no gradients)")


@kernels_param()
def test_fused_head_softcap_refuses_a_bad_cap(K):
    h, W, y = np.ones((1, 2, 3)), np.ones((3, 4)), np.zeros((1, 2), np.int64)
    for cap in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="soft-cap"):
            K.head_loss_forward(h, W, None, y, softcap=cap)

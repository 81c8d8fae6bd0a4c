"""Gemma's pieces on the GPU table (Triton on CUDA, or its interpreter on CPU tensors) against the
reference layers, tiny shapes: soft-capping alone and in the fused head, the GeGLU gate, the
embedding's scaled backward, the RMS norm with ``(1 + w)``.

Tolerance: ``gpu_helpers.bound(n, k, S)`` (same formulas, sums in another order, ``k`` rounded
elementwise operations). The soft-cap's ``tanh`` is written out in the kernel (``(1 − e)/(1 + e)``,
``e = e^{−2|a|}``, its series below ``2⁻⁵``): at most 16 ε relative where ``1 − e`` cancels most
(``|a| = 2⁻⁵``), so ``k = 32`` for it; the GELU's as tests/gpu/test_activations.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpu_helpers import DTYPES, assert_close, bound, eps, numpy, table, tensor

from pedestrian import layers


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_forward_and_backward_equal_the_reference(dtype):
    K = table(dtype)
    rng = np.random.default_rng(0)
    z = np.concatenate([rng.normal(0, 40, 40), rng.normal(0, 1e-3, 20), [0.0, 1e-30, -3e-2, 3.2e-2]]).astype(dtype)
    delta = rng.normal(0, 1, z.shape).astype(dtype)
    want, cache = layers.softcap_forward(z.astype(np.float64), 30.0)
    want_in = layers.softcap_backward(delta.astype(np.float64), cache)
    got, gcache = K.softcap_forward(tensor(z), 30.0)
    assert_close(got, want, bound(0, 32, 30.0, dtype), "y")
    small = np.abs(z) < 1.0                                                   # relative there: tanh u ≈ u
    assert np.all(np.abs(numpy(got)[small] - want[small]) <= 32 * eps(dtype) * np.abs(want[small]) + 1e-300)
    assert_close(K.softcap_backward(tensor(delta), gcache), want_in, bound(0, 32, np.abs(delta).max(), dtype), "Δ_in")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_head_with_softcap_equals_the_reference(dtype, monkeypatch):
    """The capped head (Gemma 2's final logits): the same bound as tests/gpu/test_head_loss.py with
    the cap's ``k`` added; the cap is a contraction (``|∂y/∂z| <= 1``), so the logits' error does
    not grow through it."""
    from pedestrian.gpu import head_loss

    monkeypatch.setattr(head_loss, "BLOCK", 16)
    B, T, d, V = 2, 5, 6, 37
    rng = np.random.default_rng(1)
    h, W, b = rng.standard_normal((B, T, d)), 2 * rng.standard_normal((d, V)), rng.standard_normal(V)
    y = rng.integers(0, V, (B, T))
    y[1, :3] = -100
    want_loss, want = layers.head_loss_forward(h, W, b, y, softcap=3.0)
    loss, cache = head_loss.head_loss_forward(tensor(h, dtype), tensor(W, dtype), tensor(b, dtype), tensor(y),
                                              chunk_rows=4, softcap=3.0)
    dW, db = tensor(np.empty_like(W), dtype), tensor(np.empty_like(b), dtype)
    dh = head_loss.head_loss_backward(cache, dweight=dW, dbias=db)
    N, S = B * T, float(np.abs(h).max() * np.abs(W).max() * d)
    tol = lambda scale: (N + V + d + 40) * eps(dtype) * scale            # noqa: E731
    assert_close(loss, want_loss, tol(S + 2.0), "loss")
    assert_close(dh, want.dh, tol(2.0 * np.abs(W).max() * (1 + 2 * d * S)), "Δ11")
    assert_close(dW, want.dweight, tol(2.0 * np.abs(h).max() * N * (1 + 2 * d * S)), "dW")
    assert_close(db, want.dbias, tol(2.0 * N * (1 + 2 * d * S)), "db")
    loss_only, _ = head_loss.head_loss_forward(tensor(h, dtype), tensor(W, dtype), tensor(b, dtype), tensor(y),
                                               grad=False, softcap=3.0)
    assert_close(loss_only, want_loss, tol(S + 2.0), "loss (evaluation)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3, 5), (3, 2, 1100)])
def test_geglu_gate_equals_the_reference(shape, dtype):
    """As the SwiGLU gate's test (tests/gpu/test_activations.py), with the tanh GELU."""
    K = table(dtype)
    rng = np.random.default_rng(shape[-1])
    m = shape[-1]
    a7 = rng.normal(0.0, 2.0, (*shape[:-1], 2 * m)).astype(dtype)
    delta = rng.normal(0.0, 1.0, shape).astype(dtype)
    gate, up = a7[..., :m], a7[..., m:]
    t7 = tensor(a7)
    want, _ = layers.swiglu_forward(gate.astype(np.float64), up.astype(np.float64), "gelu_tanh")
    got, cache = K.swiglu_forward(t7[..., :m], t7[..., m:], "gelu_tanh")
    scale = np.maximum(1.0, np.abs(gate)) ** 3 * np.maximum(1.0, np.abs(up))
    tol = 32 * eps(dtype)
    assert np.all(np.abs(numpy(got) - want) <= tol * scale), "a8"
    want_gate, want_up = layers.swiglu_backward(delta.astype(np.float64), (gate.astype(np.float64),
                                                                          up.astype(np.float64), "gelu_tanh"))
    fused = numpy(K.swiglu_backward(tensor(delta), cache, fused=True))
    scale_b = scale * np.abs(delta).max()
    assert np.all(np.abs(fused[..., :m] - want_gate) <= tol * scale_b), "Δ7_gate"
    assert np.all(np.abs(fused[..., m:] - want_up) <= tol * scale_b), "Δ7_up"


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_embedding_backward_equals_the_reference(dtype):
    K = table(dtype)
    V, d, B, T = 11, 33, 2, 9
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, V, (B, T))
    tokens[0, :3] = 4
    delta = rng.normal(0.0, 1.0, (B, T, d)).astype(dtype)
    s = math.sqrt(d)
    want = np.zeros((V, d))
    layers.embedding_backward(delta.astype(np.float64), (tokens, None, s), dtok=want)
    got = tensor(np.full((V, d), np.nan, dtype))
    K.embedding_backward(tensor(delta), (tensor(tokens), None, s), dtok=got)
    assert_close(got, want, bound(B * T, 2, s * B * T * np.abs(delta).max(), dtype), "dW_tok")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_offset_equals_the_reference(dtype):
    K = table(dtype)
    rng = np.random.default_rng(4)
    x, r = rng.standard_normal((2, 3, 20)).astype(dtype), rng.standard_normal((2, 3, 20)).astype(dtype)
    w, delta = (0.2 * rng.standard_normal(20)).astype(dtype), rng.standard_normal((2, 3, 20)).astype(dtype)
    (s, want), cache = layers.add_rmsnorm_forward(x.astype(np.float64), r.astype(np.float64),
                                                  w.astype(np.float64), 1e-6, offset=1.0)
    want_dw = np.empty(20)
    want_in = layers.add_rmsnorm_backward(delta.astype(np.float64), cache, delta.astype(np.float64), dweight=want_dw)
    (_, got), gcache = K.add_rmsnorm_forward(tensor(x), tensor(r), tensor(w), 1e-6, offset=1.0)
    assert_close(got, want, bound(20, 8, 4.0 * np.abs(s).max(), dtype), "y")
    dw = tensor(np.empty(20, dtype))
    got_in = K.add_rmsnorm_backward(tensor(delta), gcache, tensor(delta), dweight=dw)
    assert_close(got_in, want_in, bound(20, 8, 8.0 * np.abs(delta).max() * 2.0, dtype), "Δ_in")
    assert_close(dw, want_dw, bound(6, 4, 6 * 4.0 * np.abs(delta).max(), dtype), "dw")

"""The GPU's activations and SwiGLU gate (:mod:`pedestrian.gpu.activations`,
:mod:`pedestrian.gpu.swiglu`) against the reference layers, float32 and float64, forward and
backward, odd widths; the tails (±inf, ±50, NaN) as the reference has them.

Tolerance (gpu_helpers.bound): elementwise, no sums; each output is at most ~16 rounded
operations (``erf`` / ``exp`` within a few ulp each, in Triton's libdevice and in NumPy / SciPy)
applied to ``x`` and ``Δ``: ``16·eps`` relative to the magnitudes that enter, ``S = max(1, |x|)·max|Δ|``
per element (``x Φ(x)``, ``x σ(x)`` carry ``|x|`` times the relative error of ``Φ``, ``σ``), and
``|x|³`` in GELU tanh's ``u`` (its error moves ``σ(2u)`` by at most ``eps·|u|·σ'``): ``S`` takes
``(1 + |x|)⁴`` there.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import DTYPES, eps, numpy, table, tensor, torch

from pedestrian import layers
from pedestrian.layers.activations import ACTIVATIONS


def _close(got, want, scale, dtype, what):
    got = numpy(got)
    assert got.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"{what}: NaN where the reference has one")
    inf = np.isinf(want)
    np.testing.assert_array_equal(got[inf], want[inf], err_msg=f"{what}: ±inf")
    ok = ~(nan | inf)
    err = np.abs(got[ok] - want[ok])
    tol = 16 * eps(dtype) * scale[ok]
    assert np.all(err <= tol), f"{what}: worst error {np.max(err / tol):.3g} × the bound"


def _scale(x, delta, name):
    a = np.abs(np.nan_to_num(x.astype(np.float64), posinf=0.0, neginf=0.0))
    s = np.maximum(1.0, a) * (1.0 if delta is None else np.abs(delta).max())
    return s * (1.0 + a) ** 3 if name == "gelu_tanh" else s


def test_the_kernel_constants_are_the_reference_ones():
    from pedestrian.gpu import activations

    assert activations.SATURATE == 1000.0 and list(activations.KINDS) == list(ACTIVATIONS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(1, 3, 7), (2, 5, 33), (3, 41, 27)])   # the last: 3321 values, 4 programs
def test_activation_forward_and_backward_equal_the_reference(name, shape, dtype):
    K = table(dtype)
    rng = np.random.default_rng(len(name) + shape[-1])
    x = rng.normal(0.0, 3.0, shape).astype(dtype)
    x.reshape(-1)[:8] = [-np.inf, -50.0, -1e-30, 0.0, 1e-30, 50.0, np.inf, np.nan]
    delta = rng.normal(0.0, 1.0, shape).astype(dtype)
    with np.errstate(invalid="ignore"):                   # (the reference's 0·∞ in a branch not taken)
        want, _ = layers.activation_forward(x, name)
        want_in = layers.activation_backward(delta, x, name)
    got, cache = K.activation_forward(tensor(x), name)
    _close(got, want, _scale(x, None, name), dtype, f"{name} forward")
    got_in = K.activation_backward(tensor(delta), cache, name)
    _close(got_in, want_in, _scale(x, delta, name), dtype, f"{name} backward")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3, 5), (2, 7, 16), (3, 2, 1100)])   # a row wider than a block
def test_swiglu_gate_on_the_halves_of_one_product_equals_the_reference(shape, dtype):
    K = table(dtype)
    rng = np.random.default_rng(shape[-1])
    m = shape[-1]
    a7 = rng.normal(0.0, 2.0, (*shape[:-1], 2 * m)).astype(dtype)           # [gate | up], as the MLP has it
    delta = rng.normal(0.0, 1.0, shape).astype(dtype)
    gate, up = a7[..., :m], a7[..., m:]
    t7 = tensor(a7)
    want, _ = layers.swiglu_forward(gate, up)
    got, cache = K.swiglu_forward(t7[..., :m], t7[..., m:])
    scale = np.maximum(1.0, np.abs(gate)) * np.maximum(1.0, np.abs(up))
    _close(got, want, scale, dtype, "a8")
    want_gate, want_up = layers.swiglu_backward(delta, (gate, up))
    fused = K.swiglu_backward(tensor(delta), cache, fused=True)
    scale_b = scale * np.abs(delta).max()
    _close(fused[..., :m], want_gate, scale_b, dtype, "Δ7_gate")
    _close(fused[..., m:], want_up, scale_b, dtype, "Δ7_up")
    d_gate, d_up = K.swiglu_backward(tensor(delta), cache)
    np.testing.assert_array_equal(numpy(d_gate), numpy(fused[..., :m]))
    np.testing.assert_array_equal(numpy(d_up), numpy(fused[..., m:]))


# --------------------------------------------------------------------------- the expand layer and its activation
#: max |g'| over the reals: ReLU 1, GELU 1.129, GELU tanh 1.130, SiLU 1.100 (an error in a7 moves a8 by at most this much)
_LIPSCHITZ = 1.2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ACTIVATIONS)
@pytest.mark.parametrize("shape,f_out,bias", [((1, 1, 5), 7, True), ((2, 9, 6), 33, False), ((3, 7, 4), 130, True)],
                         ids=["one-row", "no-bias", "rows-and-columns-off-the-tiles"])
def test_linear_activation_forward_and_backward_equal_the_reference(name, shape, f_out, bias, dtype):
    """``a7 = a6 W + b``, ``a8 = g(a7)`` (the product on torch, then one Triton pass) and
    ``Δ7 = Δ8 ∘ g'(a7)``, ``db`` from per-program column sums, ``dW``, ``Δ6`` against the reference.

    Bounds (gpu_helpers.bound): ``a7`` is a sum of ``f_in`` products plus the bias, ``S`` per entry
    ``Σ_k |x_k W_kj| + |b_j|`` (one rounded add more); ``a8`` carries that error times ``max |g'|``
    (:data:`_LIPSCHITZ`) plus the activation's own ``16·eps`` (the activation test above). The
    backward is given the reference's ``a7``, so ``Δ7`` differs by the activation's bound only, and
    ``db``, ``dW``, ``Δ6`` are sums of ``N``, ``N``, ``f_out`` terms of it (``S`` their magnitudes, plus
    the ``Δ7`` bound carried through)."""
    K = table(dtype)
    rng = np.random.default_rng(f_out + len(name))
    f_in = shape[-1]
    x = rng.normal(0.0, 1.5, shape).astype(dtype)
    w = rng.normal(0.0, 1.0, (f_in, f_out)).astype(dtype)
    b = rng.normal(0.0, 1.0, f_out).astype(dtype) if bias else None
    delta = rng.normal(0.0, 1.0, (*shape[:-1], f_out)).astype(dtype)
    (want7, want8), want_cache = layers.linear_activation_forward(x, w, b, name)
    (got7, got8), cache = K.linear_activation_forward(tensor(x), tensor(w), None if b is None else tensor(b), name)
    s7 = np.abs(x).astype(np.float64) @ np.abs(w) + (0.0 if b is None else np.abs(b))
    tol7 = (f_in + 1) * eps(dtype) * s7
    assert np.all(np.abs(numpy(got7) - want7) <= tol7), "a7"
    tol8 = _LIPSCHITZ * tol7 + 16 * eps(dtype) * _scale(want7, None, name)
    assert np.all(np.abs(numpy(got8) - want8) <= tol8), "a8"
    assert cache[0] is not None and numpy(cache[1]).shape == want7.shape

    want_dw, want_db = np.zeros_like(w), np.zeros(f_out, dtype)
    want6, want_d7 = layers.linear_activation_backward(delta, want_cache, w, name, dweight=want_dw,
                                                       dbias=want_db)
    got_dw, got_db = tensor(np.full_like(w, np.nan)), tensor(np.full(f_out, np.nan, dtype))
    got6, got_d7 = K.linear_activation_backward(tensor(delta), (tensor(x), tensor(want7)), tensor(w), name,
                                                dweight=got_dw, dbias=got_db)
    tol_d7 = 16 * eps(dtype) * _scale(want7, delta, name)
    _close(got_d7, want_d7, _scale(want7, delta, name), dtype, "Δ7")
    n = int(np.prod(shape[:-1]))
    a_d7 = np.abs(want_d7).reshape(n, f_out) + tol_d7.reshape(n, f_out)        # |Δ7| and its error
    a_x = np.abs(x).reshape(n, f_in).astype(np.float64)
    np.testing.assert_array_less(np.abs(numpy(got_db) - want_db), (n + 1) * eps(dtype) * a_d7.sum(0)
                                 + tol_d7.reshape(n, f_out).sum(0) + 1e-300)
    np.testing.assert_array_less(np.abs(numpy(got_dw) - want_dw), (n + 1) * eps(dtype) * (a_x.T @ a_d7)
                                 + a_x.T @ tol_d7.reshape(n, f_out) + 1e-300)
    want6_s = a_d7 @ np.abs(w).T
    np.testing.assert_array_less(np.abs(numpy(got6) - want6).reshape(n, f_in),
                                 (f_out + 1) * eps(dtype) * want6_s + tol_d7.reshape(n, f_out) @ np.abs(w).T + 1e-300)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_activation_backward_of_a_frozen_layer_writes_nothing(dtype):
    """``dweight=None``, ``dbias=None`` (a frozen layer): no partials, no product for ``dW``; ``Δ6``
    and ``Δ7`` are the bits of the call that writes them (the same kernels, the same order)."""
    K = table(dtype)
    rng = np.random.default_rng(3)
    x, w, b = (tensor(rng.normal(size=s).astype(dtype)) for s in [(2, 5, 6), (6, 20), (20,)])
    delta = tensor(rng.normal(size=(2, 5, 20)).astype(dtype))
    _, cache = K.linear_activation_forward(x, w, b, "gelu")
    frozen = K.linear_activation_backward(delta, cache, w, "gelu")
    dw, db = torch.zeros_like(w), torch.zeros_like(b)
    trained = K.linear_activation_backward(delta, cache, w, "gelu", dweight=dw, dbias=db)
    assert all(torch.equal(a, c) for a, c in zip(frozen, trained)) and dw.abs().sum() > 0 and db.abs().sum() > 0

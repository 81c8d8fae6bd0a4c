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

from gpu_helpers import DTYPES, eps, numpy, table, tensor

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

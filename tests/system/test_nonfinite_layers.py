"""No NaN laundered on any path (issue 31): a NaN, +inf or -inf put into one input or weight of
a layer leaves the same entries non-finite on the reference layers (``pedestrian.layers``) and
the fast path (``pedestrian.kernels``), for NumPy arrays and CPU torch tensors, forward and
backward -- every layer a model calls (attention full, tiled and the KV-cache step).

What is compared, per output: the positions of NaN and the positions and signs of ±inf are the
same on both paths (for these inputs the class is well defined: no sum of infinities whose
order could change it, see ``_CASES``), and a NaN put in always reaches every output that
depends on it (no NaN turned into a finite number). The tails of the approximations (GELU's
``Φ``/``φ``, the GELU tanh form, ``exp``, softmax rows) are in ``test_activation_tails_*``.

Known differences, asserted in a weaker form: in causal attention a non-finite value at key
``j`` reaches the outputs of earlier queries through ``0 · NaN`` in ``P v`` -- all of them on the
reference and the full-matrix path, only those of ``j``'s query tile on the tiled path, which
skips the tiles above the diagonal (exact contribution 0); the cases here put the bad entry in
the first tile. The tiled backward's ``D = rowsum(Δ ∘ out)`` (for ``rowsum(dP ∘ P)``) carries
those rows' non-finite outputs on into their ``dq``, ``dk`` (a superset of the reference's
entries, :data:`_TILED_OVER`), and turns NaN into ±inf or back where ``Δ`` holds an infinity
(the same entries non-finite, :data:`_CLASS_FREE`). The full-matrix backwards take ``dq``
from ``k − k̄`` and remove ``dk``'s mean row (float32 accuracy in short sequences): a non-finite
entry there spreads over its whole sequence's ``dq`` or ``dk``, where the tiled backward keeps
to the tiles that read it; for the tiled causal ``dqkv`` the same sequences are compared.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import pedestrian.kernels as fast
import pedestrian.layers as reference
from layer_cases import BAD, CASES, D_HEAD, D_QK, H, QKV
from pedestrian.backend import to_numpy

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]

_CASES = CASES


def _numpy(a):
    return np.asarray(to_numpy(a), dtype=np.float64)


@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("case", list(_CASES))
def test_non_finite_entries_match_on_both_paths(case, backend, bad):
    arr = torch.from_numpy if backend == "torch" else (lambda a: a)
    outs = {name: _CASES[case](K, arr, BAD[bad]) for name, K in (("reference", reference), ("fast", fast))}
    for key, ref in outs["reference"].items():
        r, f = _numpy(ref), _numpy(outs["fast"][key])
        if (case, key) in _TILED_OVER:
            assert np.all(~np.isfinite(f)[~np.isfinite(r)]), f"{case} {key}: a non-finite entry turned finite"
            continue
        if case.startswith("attention-tiled-causal") and key == "dqkv":
            bad_rows = lambda a: ~np.isfinite(a).all(axis=tuple(range(1, a.ndim)))          # per sequence
            assert np.array_equal(bad_rows(r), bad_rows(f)), f"{case} {key}: non-finite sequences differ"
            continue
        if (case, key, bad) in _CLASS_FREE:
            assert np.array_equal(np.isfinite(r), np.isfinite(f)), f"{case} {key}: non-finite positions differ"
            continue
        assert np.array_equal(np.isnan(r), np.isnan(f)), \
            f"{case} {key}: NaN at {np.argwhere(np.isnan(r)).tolist()[:6]} (reference) vs {np.argwhere(np.isnan(f)).tolist()[:6]} (fast)"
        for sign in (1, -1):
            assert np.array_equal(r == sign * np.inf, f == sign * np.inf), f"{case} {key}: {sign:+d}·inf positions differ"
    if bad == "nan":                                     # the NaN reaches what depends on it
        for path, result in outs.items():
            for key, a in result.items():
                assert np.isnan(_numpy(a)).any() or key in _NOT_DEPENDENT.get(case, ()), f"{path} {case} {key}: NaN lost"


#: the tiled backward's ``D = rowsum(Δ ∘ out)`` where ``rowsum(dP ∘ P)`` meets ``+∞ − ∞``: the same
#: entries non-finite, NaN against ±inf may differ (an identity that holds for finite numbers only)
_CLASS_FREE = {(f"attention-tiled-{c}-delta", "dqkv", b) for c in ("causal", "full") for b in ("+inf", "-inf")}
#: a bad value at key 3 of a causal tile reaches the earlier queries' outputs (``0 · NaN`` in
#: ``P v``, as on every path), and the tiled backward's ``D = rowsum(Δ ∘ out)`` takes it on into
#: their ``dq``, ``dk``: the fast path is non-finite on a superset of the reference's entries
_TILED_OVER = {("attention-tiled-causal-v", "dqkv")}

#: outputs that do not depend on the bad entry of a case (so carry no NaN)
_NOT_DEPENDENT = {
    **{f"{a}-delta": ("y",) for a in reference.ACTIVATIONS},
    "layernorm-delta": ("y",), "layernorm-w": ("db", "dw"), "layernorm-x": ("db",),
    **{f"linear-delta-{n}": ("y",) for n in ("small", "blas")},
    **{f"linear-w-{n}": ("db", "dW") for n in ("small", "blas")},
    **{f"linear-x-{n}": ("db", "dx") for n in ("small", "blas")},
    "embedding-delta": ("a1",), "embedding-tok": ("dtok", "dpos"), "embedding-pos": ("dtok", "dpos"),
    **{f"attention-{k}-{c}-delta": ("out", "P") for k in ("matrix", "tiled") for c in ("causal", "full")},
    **{f"attention-{k}-{c}-v": ("P",) for k in ("matrix", "tiled") for c in ("causal", "full")},
    **{f"kv_step-{n}-{p}": ("keys", "values") for n in (1, 3) for p in ("q",)},
    **{f"kv_step-{n}-k": ("values",) for n in (1, 3)},
    **{f"kv_step-{n}-v": ("keys", "P") for n in (1, 3)},
    **{f"kv_step-{n}-cached": ("values",) for n in (1, 3)},
    "lora": ("dD",),
}


def test_relu_keeps_nan_on_the_reference_path():
    """The issue's case: the reference ReLU mapped NaN to 0 (NumPy and torch), and ``[x > 0]``
    made the backward's signal 0 at a NaN input (on both paths)."""
    x = np.array([-1.0, np.nan, 2.0])
    for K in (reference, fast):
        for arr in (lambda a: a, torch.from_numpy):
            y, cache = K.activation_forward(arr(x.copy()), "relu")
            dx = K.activation_backward(arr(np.ones(3)), cache, "relu")
            assert np.array_equal(_numpy(y), [0.0, np.nan, 2.0], equal_nan=True)
            assert np.array_equal(_numpy(dx), [0.0, np.nan, 1.0], equal_nan=True)


# ------------------------------------------------------------------------------ approximation tails
def _tails(dtype):
    info = np.finfo(dtype)
    return np.array([-np.inf, -1e30, -1e20, -1e14, -1e13, -1e4, -info.smallest_subnormal, -0.0, 0.0,
                     info.smallest_subnormal, 1e4, 1e13, 1e20, 1e30, np.inf, np.nan], dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("name", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("K", [reference, fast], ids=["reference", "fast"])
def test_activation_tails(K, name, backend, dtype):
    """Limits of both GELUs: ``g(−∞) = 0``, ``g(∞) = ∞``, ``g'(±∞) = 0, 1``; for ``|x| >= 1e4``
    ``g`` is ``0`` or ``x`` and ``g'`` is ``0`` or ``1`` to the dtype's precision (their exact
    distance from it is below ``e^{−10⁷}``; the fast GELU tanh returned NaN from about −1e13 in
    float32, ``0 · ∞``); at a subnormal ``g(x) = x/2`` and ``g'(x) = 1/2`` (``Φ(0) = ½``,
    ``g(x) − x/2 = O(x²)`` underflows to 0); NaN stays NaN."""
    arr = torch.from_numpy if backend == "torch" else (lambda a: a)
    x = _tails(dtype)
    y, cache = K.activation_forward(arr(x.copy()), name)
    g = _numpy(K.activation_backward(arr(np.ones_like(x)), cache, name))
    y = _numpy(y)
    x64 = x.astype(np.float64)
    big = np.abs(x64) >= 1e4
    expect_y = np.where(big, np.where(x64 > 0, x64, 0.0), x64 / 2)
    expect_g = np.where(big, np.where(x64 > 0, 1.0, 0.0), 0.5)
    expect_y[-1] = expect_g[-1] = np.nan
    info = np.finfo(dtype)
    for got, expect in ((y, expect_y), (g, expect_g)):      # (a subnormal x/2: within one subnormal)
        np.testing.assert_allclose(got, expect, rtol=info.eps, atol=info.smallest_subnormal, equal_nan=True)
        assert np.array_equal(np.isinf(got), np.isinf(expect)), (x, got)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("K", [reference, fast], ids=["reference", "fast"])
def test_softmax_rows_in_the_tails(K, dtype):
    """Logits and attention scores of ±1e30 (and a −∞ logit off the target): the softmax is the
    one-hot limit, the loss its exact value, nothing NaN. Loss of row ``[1e30, −1e30, 0]`` with
    target 1: ``2e30`` (``log Σe`` is ``1e30`` to the dtype's precision); target 0: 0."""
    logits = np.array([[[1e30, -1e30, 0.0], [-np.inf, 0.0, 0.0]]], dtype)
    loss, cache = K.cross_entropy_forward(logits, np.array([[1, 2]]))
    delta = _numpy(K.cross_entropy_backward(cache))
    assert float(loss) == pytest.approx((2e30 + math.log(2.0)) / 2, rel=4 * float(np.finfo(dtype).eps))
    assert np.array_equal(delta, np.array([[[0.5, -0.5, 0.0], [0.0, 0.25, -0.25]]]))
    qkv = np.zeros((1, 3, QKV), dtype)
    qkv[0, :, 0] = 1e15                                      # q·k = ±1e30 for head 0
    qkv[0, 1, H * D_QK] = 1e15 * math.sqrt(D_QK)
    qkv[0, 2, H * D_QK] = -1e15 * math.sqrt(D_QK)
    out, cache = K.multi_head_attention_forward(qkv, H, D_QK, D_HEAD, causal=False)
    p = _numpy(K.attention_weights(cache))[0, 0]
    assert np.all(np.isfinite(p)) and np.array_equal(p, np.tile([0.0, 1.0, 0.0], (3, 1)))

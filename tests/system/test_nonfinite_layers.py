"""No NaN laundered on any path (issue 31): a NaN, +inf or -inf put into one input or weight of
a layer leaves the same entries non-finite on the reference layers (``pedestrian.layers``) and
the fast path (``pedestrian.kernels``), for NumPy arrays and CPU torch tensors, forward and
backward -- every layer a model calls (attention full, tiled and the KV-cache step).

What is compared, per output: the positions of NaN and the positions and signs of ±inf are the
same on both paths (for these inputs the class is well defined: no sum of infinities whose
order could change it, see ``_CASES``), and a NaN put in always reaches every output that
depends on it (no NaN turned into a finite number). The tails of the approximations (GELU's
``Φ``/``φ``, the GELU tanh form, ``exp``, softmax rows) are in ``test_activation_tails_*``.

Known difference, not compared here: in causal attention a non-finite *key or value* at
position ``j`` reaches the queries before ``j`` on the reference and the full-matrix path
(``0 · NaN`` in ``P v`` and ``Pᵀ Δ``), but only those of the same query tile on the tiled path,
which skips the tiles above the diagonal (their exact value is finite). The tiled cases here put
the bad entry in the first tile.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import pedestrian.kernels as fast
import pedestrian.layers as reference
from pedestrian.backend import to_numpy
from pedestrian.kernels.attention_tiled import TILED_MIN_T
from pedestrian.layers import KVBlock

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]

BAD = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf}
H, D_QK, D_HEAD = 2, 3, 4
QKV = H * (2 * D_QK + D_HEAD)


def _rng():
    return np.random.default_rng(31)


def _put(a, index, bad):
    a = a.copy()
    a[index] = bad
    return a


# Each case: f(K, arr, bad) -> {output name: array}, running the layer forward and backward with
# one bad entry; ``arr`` turns a NumPy array into the backend's (identity or torch.from_numpy).
def _activation(name, where):
    def run(K, arr, bad):
        rng = _rng()
        x, d = rng.standard_normal((2, 3, 5)), rng.standard_normal((2, 3, 5))
        x, d = (_put(x, (1, 2, 3), bad), d) if where == "x" else (x, _put(d, (0, 1, 1), bad))
        y, cache = K.activation_forward(arr(x), name)
        return {"y": y, "dx": K.activation_backward(arr(d), cache, name)}
    return run


def _layernorm(where):
    def run(K, arr, bad):
        rng = _rng()
        x, w, b, d = (rng.standard_normal(s) for s in ((2, 3, 6), 6, 6, (2, 3, 6)))
        if where == "x":
            x = _put(x, (1, 0, 2), bad)
        elif where == "w":
            w = _put(w, 4, bad)
        else:
            d = _put(d, (0, 2, 1), bad)
        y, cache = K.layernorm_forward(arr(x), arr(w), arr(b), 1e-5)
        dw, db = arr(np.zeros(6)), arr(np.zeros(6))
        dx = K.layernorm_backward(arr(d), cache, dweight=dw, dbias=db)
        return {"y": y, "dx": dx, "dw": dw, "db": db}
    return run


def _linear(where, rows):
    def run(K, arr, bad):
        rng = _rng()
        x, W, b, d = (rng.standard_normal(s) for s in ((2, rows, 5), (5, 4), 4, (2, rows, 4)))
        if where == "x":
            x = _put(x, (1, 0, 2), bad)
        elif where == "w":
            W = _put(W, (3, 1), bad)
        else:
            d = _put(d, (0, 1, 3), bad)
        y, cache = K.linear_forward(arr(x), arr(W), arr(b))
        dW, db = arr(np.zeros((5, 4))), arr(np.zeros(4))
        dx = K.linear_backward(arr(d), cache, arr(W), dweight=dW, dbias=db)
        return {"y": y, "dx": dx, "dW": dW, "db": db}
    return run


def _add(K, arr, bad):
    rng = _rng()
    return {"y": K.add(arr(_put(rng.standard_normal((2, 3, 4)), (1, 1, 1), bad)), arr(rng.standard_normal((2, 3, 4))))}


def _cross_entropy(column):
    def run(K, arr, bad):
        rng = _rng()
        logits = _put(rng.standard_normal((2, 3, 7)), (0, 1, column), bad)  # target of row (0, 1): 2
        targets = np.array([[1, 2, 3], [0, -100, 6]])
        loss, cache = K.cross_entropy_forward(arr(logits), arr(targets))
        return {"loss": loss, "dlogits": K.cross_entropy_backward(cache)}
    return run


def _embedding(where):
    def run(K, arr, bad):
        rng = _rng()
        tokens = np.array([[1, 2, 1], [0, 1, 4]])
        tok, pos, d = rng.standard_normal((5, 4)), rng.standard_normal((6, 4)), rng.standard_normal((2, 3, 4))
        if where == "tok":
            tok = _put(tok, (1, 2), bad)
        elif where == "pos":
            pos = _put(pos, (2, 0), bad)
        else:
            d = _put(d, (1, 2, 3), bad)
        a1, cache = K.embedding_forward(arr(tokens), arr(tok), arr(pos))
        dtok, dpos = arr(np.zeros((5, 4))), arr(np.zeros((6, 4)))
        K.embedding_backward(arr(d), cache, dtok=dtok, dpos=dpos)
        return {"a1": a1, "dtok": dtok, "dpos": dpos}
    return run


def _attention(T, part, causal):
    """``part``: the q, k or v column block (entry at position 3, in the first tile) or the
    backward's ``Δ``."""
    def run(K, arr, bad):
        rng = _rng()
        qkv, d = rng.standard_normal((2, T, QKV)), rng.standard_normal((2, T, H * D_HEAD))
        column = {"q": 1, "k": H * D_QK + 4, "v": 2 * H * D_QK + 5}.get(part)
        qkv = _put(qkv, (1, 3, column), bad) if column is not None else qkv
        d = _put(d, (0, 3, 2), bad) if part == "delta" else d
        out, cache = K.multi_head_attention_forward(arr(qkv), H, D_QK, D_HEAD, causal=causal)
        p = K.attention_weights(cache)
        dqkv, _ = K.multi_head_attention_backward(arr(d), cache)
        return {"out": out, "P": p, "dqkv": dqkv}
    return run


def _kv_step(part, T_new):
    """A KV-cache step of ``T_new`` tokens after 5 cached ones: the bad entry in the new q/k/v
    or in a cached key; the outputs, ``P`` and the cache written."""
    def run(K, arr, bad):
        rng = _rng()
        L0, capacity = 5, 9
        keys, values = rng.standard_normal((2, H, capacity, D_QK)), rng.standard_normal((2, H, capacity, D_HEAD))
        qkv = rng.standard_normal((2, T_new, QKV))
        if part == "cached":
            keys = _put(keys, (0, 1, 2, 1), bad)
        else:
            qkv = _put(qkv, (1, T_new - 1, {"q": 0, "k": H * D_QK + 1, "v": 2 * H * D_QK + 2}[part]), bad)
        block = KVBlock(arr(keys), arr(values), L0, arr(np.array([0, 2])))
        out, cache = K.multi_head_attention_forward(arr(qkv), H, D_QK, D_HEAD, causal=True, kv_cache=block)
        return {"out": out, "P": K.attention_weights(cache), "keys": block.keys, "values": block.values}
    return run


def _dropout(K, arr, bad):
    rng = _rng()
    x = _put(rng.standard_normal((2, 3, 4)), (1, 2, 0), bad)
    y, mask = K.dropout_forward(arr(x), 0.25, np.random.default_rng(0))
    return {"y": y, "dx": K.dropout_backward(arr(_put(rng.standard_normal((2, 3, 4)), (0, 0, 1), bad)), mask)}


def _lora(K, arr, bad):
    rng = _rng()
    x, D, U, d = (rng.standard_normal(s) for s in ((2, 3, 5), (5, 2), (2, 4), (2, 3, 4)))
    D = _put(D, (1, 1), bad)
    y, cache = K.lora_forward(arr(x), arr(D), arr(U), 0.5)
    dD, dU = arr(np.zeros((5, 2))), arr(np.zeros((2, 4)))
    dx = K.lora_backward(arr(d), cache, arr(D), arr(U), 0.5, dD=dD, dU=dU)
    return {"y": y, "dx": dx, "dD": dD, "dU": dU}


def _rope(K, arr, bad):
    rng = _rng()
    qkv = _put(rng.standard_normal((2, 3, QKV)), (0, 1, 4), bad)
    y, cache = K.rope_forward(arr(qkv), H, D_QK)
    return {"y": y, "dx": K.rope_backward(arr(_put(rng.standard_normal((2, 3, QKV)), (1, 2, 0), bad)), cache)}


_CASES = {
    **{f"{a}-{w}": _activation(a, w) for a in reference.ACTIVATIONS for w in ("x", "delta")},
    **{f"layernorm-{w}": _layernorm(w) for w in ("x", "w", "delta")},
    **{f"linear-{w}-{n}": _linear(w, rows) for w in ("x", "w", "delta") for n, rows in (("small", 3), ("blas", 500))},
    "add": _add,
    "cross_entropy-target": _cross_entropy(2), "cross_entropy-other": _cross_entropy(4),
    **{f"embedding-{w}": _embedding(w) for w in ("tok", "pos", "delta")},
    **{f"attention-{kind}-{'causal' if c else 'full'}-{p}": _attention(T, p, c)
       for kind, T in (("matrix", 7), ("tiled", TILED_MIN_T["numpy"])) for c in (True, False)
       for p in ("q", "k", "v", "delta")},
    **{f"kv_step-{n}-{p}": _kv_step(p, n) for n in (1, 3) for p in ("q", "k", "v", "cached")},
    "dropout": _dropout, "lora": _lora, "rope": _rope,
}


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
                if not (key == "P" and case.startswith("kv_step") and "cached" not in case and "q" not in case):
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
    **{f"kv_step-{n}-v": ("keys",) for n in (1, 3)},
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

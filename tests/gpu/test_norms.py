"""The GPU's layer norm and RMS norm, alone and with the skip fused in front
(:mod:`pedestrian.gpu.norms`), against the reference layers, forward and backward, float32 and
float64, odd widths, row counts across the programs' blocks of 16 rows (the last one partial).

Tolerances (gpu_helpers.bound, with the magnitudes ``S`` that enter each comparison):

- forward: ``μ`` and ``var`` are sums of ``d`` terms; an error ``δμ ≤ d·u·max|x|`` moves ``x̂`` by
  ``δμ/σ``, a relative error ``d·u`` of ``var`` moves it by ``d·u·|x̂|/2``; ``∘ w + b`` adds two
  roundings: ``S = (max|x|/σ + max|x̂|)·max|w| + max|b|`` over ``d`` terms and 8 operations, twice
  (both sides);
- backward (both sides given the same cache, so that only the backward's rounding is compared):
  ``Δ_in = (1/σ)(g − mean g − x̂ ∘ mean(g ∘ x̂))``, the row means sums of ``d`` terms: ``S = (1/σ)·max|g|·
  (1 + max|x̂|²)``; ``dw``, ``db`` sums of ``N`` rows: ``S = N·max|x̂|·max|Δ|``;
- the skip ``s = x + r`` is one IEEE addition on both sides: equal bits.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import DTYPES, assert_close, bound, numpy, table, tensor

from pedestrian import layers

SHAPES = [(1, 5, 7), (2, 17, 33), (3, 3, 16)]         # 5, 34, 9 rows; odd and even widths


def _inputs(shape, dtype, seed, skip=False):
    rng = np.random.default_rng(seed)
    d = shape[-1]
    x = rng.normal(0.3, 1.2, shape).astype(dtype)
    r = rng.normal(0.0, 1.0, shape).astype(dtype) if skip else None
    w = rng.normal(1.0, 0.3, d).astype(dtype)
    b = rng.normal(0.0, 0.3, d).astype(dtype)
    delta = rng.normal(0.0, 1.0, shape).astype(dtype)
    return x, r, w, b, delta


def _forward_tol(x, cache, w, b, dtype):
    xhat, rstd, _ = cache
    scale = (np.abs(x).max() * np.abs(rstd).max() + np.abs(xhat).max()) * np.abs(w).max() + (
        0.0 if b is None else np.abs(b).max())
    return 2 * bound(x.shape[-1], 8, scale, dtype)


def _backward_tols(delta, cache, dtype):
    xhat, rstd, w = (np.asarray(c, dtype=np.float64) for c in cache)
    g = np.abs(delta * w).max()
    n_rows = delta.size // delta.shape[-1]
    t_in = 2 * bound(delta.shape[-1], 8, np.abs(rstd).max() * g * (1 + np.abs(xhat).max() ** 2), dtype)
    t_w = 2 * bound(n_rows, 2, n_rows * np.abs(xhat).max() * np.abs(delta).max(), dtype)
    return t_in, t_w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("skip", [False, True], ids=["alone", "skip-fused"])
def test_norm_forward_and_backward_equal_the_reference(kind, shape, dtype, skip):
    K = table(dtype)
    x, r, w, b, delta = _inputs(shape, dtype, seed=sum(shape), skip=skip)
    rms, eps = kind == "rmsnorm", 1e-5
    b = None if rms else b
    args = (w, eps) if rms else (w, b, eps)
    targs = tuple(tensor(a) if isinstance(a, np.ndarray) else a for a in args)
    if skip:
        (s_ref, y_ref), cache_ref = getattr(layers, f"add_{kind}_forward")(x, r, *args)
        (s, y), cache = getattr(K, f"add_{kind}_forward")(tensor(x), tensor(r), *targs)
        np.testing.assert_array_equal(numpy(s), s_ref)                     # one IEEE addition
    else:
        y_ref, cache_ref = getattr(layers, f"{kind}_forward")(x, *args)
        y, cache = getattr(K, f"{kind}_forward")(tensor(x), *targs)
        s_ref = x
    assert y.dtype == tensor(x).dtype and cache[1].shape == (*shape[:-1], 1)
    tol = _forward_tol(s_ref, cache_ref, w, b, dtype)
    assert_close(y, y_ref, tol, "y")
    assert_close(cache[0], cache_ref[0], tol, "x̂")
    # the backward, both sides from the GPU's cache
    cache_np = tuple(numpy(c).astype(dtype) for c in cache[:2]) + (w,)
    t_in, t_w = _backward_tols(delta, cache_np, dtype)
    dw_ref, dw = np.zeros_like(w), tensor(np.full_like(w, np.nan))
    grads_ref, grads = {"dweight": dw_ref}, {"dweight": dw}
    if not rms:
        db_ref, db = np.zeros_like(w), tensor(np.full_like(w, np.nan))
        grads_ref["dbias"], grads["dbias"] = db_ref, db
    if skip:
        d_skip = np.random.default_rng(1).normal(0.0, 1.0, shape).astype(dtype)
        want = getattr(layers, f"add_{kind}_backward")(delta, cache_np, d_skip, **grads_ref)
        got = getattr(K, f"add_{kind}_backward")(tensor(delta), cache, tensor(d_skip), **grads)
        t_in += 2 * bound(0, 1, np.abs(d_skip).max() + np.abs(want).max(), dtype)   # the skip's one addition
    else:
        want = getattr(layers, f"{kind}_backward")(delta, cache_np, **grads_ref)
        got = getattr(K, f"{kind}_backward")(tensor(delta), cache, **grads)
    assert_close(got, want, t_in, "Δ_in")
    assert_close(dw, dw_ref, t_w, "dweight")
    if not rms:
        assert_close(db, db_ref, t_w, "dbias")


def test_frozen_norm_writes_no_gradient_and_the_weight_gradient_is_the_same_bits_each_run():
    K = table("float32")
    x, _, w, b, delta = _inputs((2, 37, 9), "float32", seed=4)
    _, cache = K.layernorm_forward(tensor(x), tensor(w), tensor(b), 1e-5)
    runs = []
    for _ in range(2):
        dw, db = tensor(np.zeros_like(w)), tensor(np.zeros_like(w))
        K.layernorm_backward(tensor(delta), cache, dweight=dw, dbias=db)
        runs.append((numpy(dw), numpy(db)))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    assert np.all(runs[0][0] != 0)
    out = K.layernorm_backward(tensor(delta), cache)                        # frozen: nothing written
    assert out.shape == x.shape


def test_bad_eps_and_integer_input_are_refused_by_name():
    K = table("float32")
    x = tensor(np.ones((1, 2, 4), np.float32))
    w = tensor(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="layer norm eps must be >= 0"):
        K.layernorm_forward(x, w, None, -1.0)
    with pytest.raises(ValueError, match="RMS norm eps must be >= 0"):
        K.add_rmsnorm_forward(x, x, w, -1.0)
    with pytest.raises(TypeError, match="real floating-point"):
        K.layernorm_forward(tensor(np.ones((1, 2, 4), np.int64)), w, None, 1e-5)

"""The Llama layers' fast path equals the reference over their shape space: a property test of
RMSNorm, SiLU and the SwiGLU MLP, layer by layer.

(``test_fast_path_property.py`` compares whole models; until the model can be built with these
layers, they are compared here on their own, with the same search and the same threads.)

The fast kernels change strategy at thresholds -- serial loops under 2^12 elements, one thread
under 2^15, :data:`pedestrian.kernels.schedule.NORM_BLOCK_ROWS` = 32 rows per block of the norm's
``dw``, the linear layer's "few rows" path (<= 2^12 elements), products shared over the threads
from 2^18 multiply-adds in blocks of 16 rows, the memory pool from 64 KiB -- so the search draws
``B`` 1-3, ``T`` 1-300 (with the values around 32, 64, 128, 256 rows), widths ``d`` 1-64 and
``m`` 1-160 (odd and even), RMS ``eps`` 0 / 1e-6 / 1e-5, inputs of scale 0.1-100 (SiLU's tails,
down to gates where ``σ`` underflows), float64 and float32, with ``PEDESTRIAN_NUM_THREADS`` = 1
and = 2, each in a subprocess of its own (:func:`test_property_with_threads`).

Tolerances: :mod:`llama_oracles`' first-order bounds, per entry, from the absolute terms of each
operation (so cancellation cannot make them flaky). float64: fast and reference each within the
float64 bound of the exact result, so they differ by at most twice it. float32: the fast float32
and the reference float32 each within the float32 bound of the reference's float64 result of the
same (float32) numbers (its own error is 2^-29 of that bound).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import pedestrian.kernels as fast
import pedestrian.layers as reference
from llama_oracles import SILU_ROUNDINGS, rmsnorm_bounds, swiglu_mlp_bounds
from thread_runs import run_with_threads

#: examples per thread count in CI (derandomized: every run checks the same cases)
CI_EXAMPLES = 40
settings.register_profile("llama-ci", max_examples=CI_EXAMPLES, derandomize=True, database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("llama-thorough", max_examples=1500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
THRESHOLD_T = (1, 2, 3, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 300)


def run_layers(K, x, w_norm, eps, weights, d_norm, d_mlp):
    """RMSNorm, SiLU and the SwiGLU MLP forward and backward with module ``K``: name -> float64 array."""
    y, cache = K.rmsnorm_forward(x, w_norm, eps)
    dw = np.full(w_norm.shape, np.nan, dtype=x.dtype)
    dx = K.rmsnorm_backward(d_norm, cache, dweight=dw)
    out = {"rms.y": y, "rms.dx": dx, "rms.dw": dw}
    a9, c = K.swiglu_mlp_forward(x, *weights)
    grads = {k: np.full(w.shape, np.nan, dtype=x.dtype) for k, w in zip(("dw_gate", "dw_up", "dw_down"), weights)}
    d6 = K.swiglu_mlp_backward(d_mlp, c, *weights, **grads)
    out |= {"mlp.y": a9, "mlp.dx": d6} | {f"mlp.{k}": v for k, v in grads.items()}
    s, s_cache = K.activation_forward(c.a7_gate, "silu")
    out |= {"silu.y": s, "silu.dx": K.activation_backward(d_mlp[..., :1] * c.a7_up, s_cache, "silu")}
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


def bounds(x, w_norm, eps, weights, d_norm, d_mlp, dtype):
    """Per-entry bounds on one ``dtype`` computation of :func:`run_layers`' results (float64 inputs)."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    b = {f"rms.{k}": v for k, v in rmsnorm_bounds(x, w_norm, eps, d_norm, dtype).items()}
    b |= {f"mlp.{k}": v for k, v in swiglu_mlp_bounds(rows, *weights, d_mlp.reshape(-1, d), dtype).items()}
    u, tiny = float(np.finfo(dtype).eps) / 2, float(np.finfo(dtype).smallest_subnormal)
    G, U = rows @ weights[0], rows @ weights[1]
    e_G = (d + 1) * u * (np.abs(rows) @ np.abs(weights[0]))            # the gate as each side computed it
    e_U = (d + 1) * u * (np.abs(rows) @ np.abs(weights[1]))
    e = np.exp(-np.abs(G))
    s = np.where(G >= 0, 1 / (1 + e), e / (1 + e))
    dsilu, d2silu = s * (1 + G * (1 - s)), s * (1 - s) * (2 + G * (1 - 2 * s))
    under = 4 * tiny * (1 + np.abs(G))
    b["silu.y"] = 2 * (np.abs(dsilu) * e_G + SILU_ROUNDINGS * u * np.abs(G * s) + under)
    up = np.abs(d_mlp.reshape(-1, d)[:, :1] * U)
    b["silu.dx"] = 2 * (up * (np.abs(d2silu) * e_G + (SILU_ROUNDINGS + 2) * u * s * (1 + np.abs(G) * (1 - s)) + under)
                        + np.abs(d_mlp.reshape(-1, d)[:, :1]) * e_U * np.abs(dsilu) + tiny)
    return b


def make_case(B, T, d, m, eps, scale, seed):
    rng = np.random.default_rng(seed)
    x = scale * rng.standard_normal((B, T, d))
    w_norm = 1.0 + 0.3 * rng.standard_normal(d)
    weights = [rng.standard_normal(s) * 1.5 / np.sqrt(s[0]) for s in ((d, m), (d, m), (m, d))]
    return x, w_norm, eps, weights, rng.standard_normal((B, T, d)), rng.standard_normal((B, T, d))


def check_case(case: dict, dtype: str) -> float:
    """Fast against reference (module docstring); returns the worst error / bound."""
    x, w_norm, eps, weights, d_norm, d_mlp = make_case(**case)
    args = [a.astype(dtype) for a in (x, w_norm)], [w.astype(dtype) for w in weights], \
        [a.astype(dtype) for a in (d_norm, d_mlp)]
    (xs, ws), mlp_w, (dn, dm) = args
    exact64 = [a.astype(np.float64) for a in (xs, ws)], [w.astype(np.float64) for w in mlp_w], \
        [a.astype(np.float64) for a in (dn, dm)]
    (x64, w64), mlp64, (dn64, dm64) = exact64
    b = bounds(x64, w64, eps, mlp64, dn64, dm64, dtype)
    with np.errstate(under="ignore"):
        sides = {"fast": run_layers(fast, xs, ws, eps, mlp_w, dn, dm),
                 "reference": run_layers(reference, xs, ws, eps, mlp_w, dn, dm)}
        exact = sides["reference"] if dtype == "float64" else run_layers(reference, x64, w64, eps, mlp64, dn64, dm64)
    worst = 0.0
    for side, results in sides.items():
        if side == "reference" and dtype == "float64":
            continue                                        # (it is the exact result)
        for name, got in results.items():
            bound = b[name].reshape(got.shape)
            err = np.abs(got - exact[name])
            k = 2 if dtype == "float64" else 1              # float64: two computations, each within it
            assert np.all(err <= k * bound), (f"{case} {dtype} {side}: {name} errs by up to "
                                              f"{np.max(err / bound):.2f} × its bound")
            assert not np.any(np.isnan(got)), f"{case} {dtype} {side}: NaN in {name}"
            worst = max(worst, float(np.max(err / (k * bound), initial=0.0)))
    return worst


@st.composite
def cases(draw) -> dict:
    """One point of the shape space (module docstring)."""
    return dict(B=draw(st.integers(1, 3)), T=draw(st.one_of(st.sampled_from(THRESHOLD_T), st.integers(1, 300))),
                d=draw(st.one_of(st.sampled_from([1, 2, 7, 8, 63, 64]), st.integers(1, 64))),
                m=draw(st.one_of(st.sampled_from([1, 5, 16, 17, 160]), st.integers(1, 160))),
                eps=draw(st.sampled_from([0.0, 1e-6, 1e-5])), scale=draw(st.sampled_from([0.1, 1.0, 10.0, 100.0])),
                seed=draw(st.integers(0, 2**16)))


@pytest.mark.skipif(os.environ.get("PEDESTRIAN_LLAMA_PROPERTY") != "1",
                    reason="runs in its own subprocess per thread count (test_property_with_threads)")
@settings(settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "llama-ci")))
@given(case=cases(), dtype=st.sampled_from(["float64", "float32"]))
@example(case=dict(B=3, T=300, d=64, m=160, eps=1e-5, scale=1.0, seed=1), dtype="float32")
@example(case=dict(B=3, T=257, d=63, m=159, eps=0.0, scale=100.0, seed=2), dtype="float64")
def test_property_in_process(case, dtype):
    worst = check_case(case, dtype)
    path = os.environ.get("PEDESTRIAN_LLAMA_PROPERTY_REPORT")
    if path:                                      # the worst ratio, for the wrapper to print
        old = float(Path(path).read_text()) if Path(path).exists() else 0.0
        Path(path).write_text(str(max(old, worst)))


@pytest.mark.parametrize("threads", [1, 2])
def test_property_with_threads(threads, tmp_path):
    """The property test in a fresh interpreter with ``PEDESTRIAN_NUM_THREADS = threads`` (and the
    BLAS on as many). Prints the worst error / bound it met (``pytest -s`` shows it)."""
    report = tmp_path / "worst.txt"
    run_with_threads(__file__, "test_property_in_process", threads,
                     {"PEDESTRIAN_LLAMA_PROPERTY": "1", "PEDESTRIAN_LLAMA_PROPERTY_REPORT": str(report)})
    print(f"threads={threads}: worst error / bound = {float(report.read_text()):.3f}")

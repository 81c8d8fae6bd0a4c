"""Tiled (flash-style) attention against the full-matrix kernels and the PyTorch oracle (issue 16).

The tiled kernel (`pedestrian.kernels.attention_tiled`) computes the same function as the
full-matrix attention in another order: online softmax over key blocks, causal blocks skipped,
``P`` recomputed in the backward from the stored log-sum-exp, ``rowsum(dP ∘ P) = rowsum(Δ ∘ out)``
(docs/EQUATIONS.md, "Tiled attention"). Compared here:

- the kernel alone against the reference layer (`pedestrian.layers.attention`) and the fast
  full-matrix kernel: output, the signal at ``qkv``, ``Δcausal`` and ``P``, float64, ``<= 1e-12``,
  over T ∈ {1, 7, 64, 65, 200, 1024} (several block sizes, some not dividing T), causal and not,
  B ∈ {1, 3}, d_qk ≠ d_head; on the torch backend too;
- the whole model with the tiled kernel forced on against the same model with it off (every
  gradient, every error signal Δ1 … Δ12, Δcausal, P) ``<= 1e-12``, and against the independent
  PyTorch reference (tests/oracles/torch_reference.py) ``<= 1e-9``;
- that the fast path picks the tiled kernel from ``TILED_MIN_T`` on, that its cache is O(T),
  and that NumPy runs numba's parallel kernels, the same bits on any number of threads;

Tolerances: both sides sum the same float64 terms in another order (at most T = 1024 terms per
sum, a few sums deep), so they differ by a small multiple of ``T · 2⁻⁵³ ≈ 1.1e-13`` relative to
the tensor's largest entry on any IEEE-754 machine, whatever the BLAS kernel: ``1e-12`` holds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pedestrian.kernels import attention as fast_attention
from pedestrian.kernels import attention_tiled
from pedestrian.kernels.attention_tiled import (
    TILED_MIN_T,
    tiled_attention_backward,
    tiled_attention_forward,
    tiled_attention_weights,
    use_tiled,
)
from pedestrian.layers import attention as reference_attention
from gradcheck import EPS64, model_key_bias_bounds, model_one_key_bounds
from torch_reference import default_cfg, delta_names, random_params, reference_loss_and_grads

TOL_ORDER = 1e-12          # same float64 sums in another order (module docstring)
TOL_ORACLE = 1e-9          # against autograd (issue 2's bound for the whole gradient grid)

TS = (1, 7, 64, 65, 200, 1024)
# (block_q, block_k): the defaults, blocks that divide neither 65 nor 200, and block_k not a
# multiple of block_q (a key block then starts inside a query block)
BLOCK_CHOICES = ((None, None), (16, 32), (24, 40))


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b), initial=0.0) / max(float(np.max(np.abs(b), initial=0.0)), 1e-300))


def _full_fast(qkv, n_heads, d_qk, d_head, causal, monkeypatch):
    """The fast path's full-matrix kernel, whatever T (the tiled one switched off)."""
    with monkeypatch.context() as m:
        m.setitem(TILED_MIN_T, "numpy", 1 << 30)
        m.setitem(TILED_MIN_T, "torch", 1 << 30)
        return fast_attention.multi_head_attention_forward(qkv, n_heads, d_qk, d_head, causal=causal)


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("B", [1, 3])
def test_kernel_matches_full_matrix(T, causal, B, monkeypatch):
    n_heads, d_qk, d_head = 2, 5, 3                                          # d_qk ≠ d_head
    rng = np.random.default_rng(T * 10 + B + causal)
    qkv = 2.0 * rng.standard_normal((B, T, n_heads * (2 * d_qk + d_head)))  # O(1)-O(10) scores
    delta = rng.standard_normal((B, T, n_heads * d_head))

    ref_out, ref_cache = reference_attention.multi_head_attention_forward(qkv, n_heads, d_qk, d_head,
                                                                           causal=causal)
    ref_dqkv, ref_dc = reference_attention.multi_head_attention_backward(delta, ref_cache,
                                                                         keep_delta_causal=True)
    full_out, full_cache = _full_fast(qkv, n_heads, d_qk, d_head, causal, monkeypatch)
    full_dqkv, full_dc = fast_attention.multi_head_attention_backward(delta, full_cache,
                                                                      keep_delta_causal=True)
    for block_q, block_k in BLOCK_CHOICES:
        out, cache = tiled_attention_forward(qkv, n_heads, d_qk, d_head, causal=causal,
                                             block_q=block_q, block_k=block_k)
        dqkv, dc = tiled_attention_backward(delta, cache, keep_delta_causal=True)
        dqkv_only, none = tiled_attention_backward(delta, cache)
        assert none is None
        assert np.array_equal(dqkv_only, dqkv)                               # Δcausal costs nothing in value
        p = tiled_attention_weights(cache)
        # rows of Δcausal sum to 0 (section 3); computed, each is within (2L + 2·d_head + 6)·ε·max|dP| of
        # it (gradcheck.key_bias_bound's row term, plus the d_head-term rowsum(Δ ∘ out) the tiled
        # kernel uses): up to ~6e-12 at T = 1024, so an absolute 1e-12 was not a bound
        v = qkv[..., 2 * n_heads * d_qk:].reshape(B, T, n_heads, d_head).transpose(0, 2, 1, 3)
        dP = delta.reshape(B, T, n_heads, d_head).transpose(0, 2, 1, 3) @ v.transpose(0, 1, 3, 2)
        row_bound = (2 * T + 2 * d_head + 6) * EPS64 * np.abs(dP).max(-1)
        assert np.all(np.abs(dc.sum(-1)) <= row_bound)
        for name, got, full, ref in (("out", out, full_out, ref_out), ("d_qkv", dqkv, full_dqkv, ref_dqkv),
                                     ("Δcausal", dc, full_dc, ref_dc), ("P", p, full_cache["p"], ref_cache["p"])):
            if name == "Δcausal" and T == 1:
                # one key: Δcausal is its own row sum, ≡ 0; rounding noise on every side (an OpenBLAS
                # kernel without FMA gives 5.6e-17 where another gives exact zeros: no relative error)
                assert all(np.all(np.abs(x[..., 0]) <= row_bound) for x in (got, full, ref)), name
                continue
            assert _rel(got, full) <= TOL_ORDER, (name, block_q, block_k)
            assert _rel(got, ref) <= TOL_ORDER, (name, block_q, block_k)
        if causal:                                                           # the skipped blocks are exact zeros
            upper = np.triu(np.ones((T, T), dtype=bool), 1)
            assert not np.any(p[..., upper]) and not np.any(dc[..., upper])


def test_kernel_matches_autograd():
    """The kernel alone against torch autograd of softmax(q kᵀ/√d_qk) v (causal, several key blocks)."""
    n_heads, d_qk, d_head, B, T = 3, 4, 6, 2, 200
    rng = np.random.default_rng(5)
    qkv = rng.standard_normal((B, T, n_heads * (2 * d_qk + d_head)))
    delta = rng.standard_normal((B, T, n_heads * d_head))
    out, cache = tiled_attention_forward(qkv, n_heads, d_qk, d_head, block_q=32, block_k=64)
    dqkv, _ = tiled_attention_backward(delta, cache)

    x = torch.tensor(qkv, requires_grad=True)
    hq = n_heads * d_qk
    q, k, v = (t.reshape(B, T, n_heads, -1).transpose(1, 2)
               for t in (x[..., :hq], x[..., hq:2 * hq], x[..., 2 * hq:]))
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    s = (q @ k.transpose(-1, -2) / d_qk ** 0.5).masked_fill(future, float("-inf"))
    y = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, -1)
    y.backward(torch.tensor(delta))
    assert _rel(out, y.detach().numpy()) <= TOL_ORACLE
    assert _rel(dqkv, x.grad.numpy()) <= TOL_ORACLE


@pytest.mark.parametrize("T,causal", [(7, True), (200, True), (65, False)])
def test_kernel_torch_backend(T, causal, one_torch_thread):
    """The kernel's torch loop (what a GPU's tensors run; called here with CPU tensors) agrees
    with the numba loops on NumPy arrays, no autograd."""
    n_heads, d_qk, d_head, B = 2, 5, 3, 3
    rng = np.random.default_rng(T)
    qkv = rng.standard_normal((B, T, n_heads * (2 * d_qk + d_head)))
    delta = rng.standard_normal((B, T, n_heads * d_head))
    out, cache = tiled_attention_forward(qkv, n_heads, d_qk, d_head, causal=causal, block_q=16, block_k=32)
    dqkv, dc = tiled_attention_backward(delta, cache, keep_delta_causal=True)
    out_t, cache_t = tiled_attention_forward(torch.tensor(qkv), n_heads, d_qk, d_head, causal=causal,
                                             block_q=16, block_k=32)
    dqkv_t, dc_t = tiled_attention_backward(torch.tensor(delta), cache_t, keep_delta_causal=True)
    assert isinstance(out_t, torch.Tensor) and not out_t.requires_grad
    for got, want in ((out_t, out), (dqkv_t, dqkv), (dc_t, dc),
                      (tiled_attention_weights(cache_t), tiled_attention_weights(cache))):
        assert _rel(got.numpy(), want) <= TOL_ORDER


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_running_maximum_on_ordinary_and_far_scores(causal, dtype):
    """The online softmax (a running row maximum, the sums rescaled per key block) on ordinary
    scores and where one key scores far above the others (~+60: ``e^60`` would overflow a
    float32 sum taken against any other key's score): every path gives the full-matrix results.
    Bounds: float64 as in the module docstring; float32, ``2⁻²⁴`` per rounded operation times a
    few hundred terms and layers of sums, ``1e-4`` relative."""
    n_heads, d_qk, d_head, T = 2, 4, 3, 300
    rng = np.random.default_rng(7 + causal)
    tol = TOL_ORDER if dtype == "float64" else 1e-4

    def compare(qkv):
        out, cache = tiled_attention_forward(qkv, n_heads, d_qk, d_head, causal=causal, block_q=32, block_k=64)
        delta = np.ones_like(out)
        dqkv, _ = tiled_attention_backward(delta, cache)
        wide = qkv.astype(np.float64)
        ref_out, ref_cache = reference_attention.multi_head_attention_forward(wide, n_heads, d_qk, d_head,
                                                                               causal=causal)
        ref_dqkv, _ = reference_attention.multi_head_attention_backward(delta.astype(np.float64), ref_cache)
        for name, got, ref in (("out", out, ref_out), ("d_qkv", dqkv, ref_dqkv),
                               ("P", tiled_attention_weights(cache), ref_cache["p"])):
            assert _rel(got, ref) <= tol, name

    qkv = rng.standard_normal((1, T, n_heads * (2 * d_qk + d_head))).astype(dtype)
    compare(qkv)
    far = qkv.copy()                                     # key 150 scores ~+60 against each query's key 0
    hq = n_heads * d_qk
    far[0, :, :hq] = 4.0 * np.abs(far[0, :, :hq])
    far[0, 150, hq:2 * hq] = 6.0
    compare(far)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_extreme_scores_warn_nothing(dtype):
    """A key that scores far above key 0 (``S − S_α0`` ~ 900: ``e^900`` overflows) gives the
    right result and no NumPy ``RuntimeWarning`` reaches the user (issue 22; a former fixed
    reference overflowed here). Tolerance as in :func:`test_running_maximum_on_ordinary_and_far_scores`."""
    import warnings

    n_heads, d_qk, d_head, T = 1, 4, 3, 300
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((1, T, n_heads * (2 * d_qk + d_head)))
    qkv[0, :, :d_qk] = 30.0                              # every query along (1, 1, 1, 1) ...
    qkv[0, 200, d_qk:2 * d_qk] = 30.0                    # ... and key 200 too: S - S_α0 ~ 900 (e^900 = inf)
    qkv = qkv.astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # any warning fails the test
        out, cache = tiled_attention_forward(qkv, n_heads, d_qk, d_head, causal=True)
        dqkv, _ = tiled_attention_backward(np.ones_like(out), cache)
    wide = qkv.astype(np.float64)
    ref_out, ref_cache = reference_attention.multi_head_attention_forward(wide, n_heads, d_qk, d_head, causal=True)
    ref_dqkv, _ = reference_attention.multi_head_attention_backward(np.ones_like(ref_out), ref_cache)
    tol = TOL_ORDER if dtype == "float64" else 1e-4
    assert np.isfinite(out).all() and np.isfinite(dqkv).all()
    assert _rel(out, ref_out) <= tol and _rel(dqkv, ref_dqkv) <= tol


@pytest.mark.parametrize("blocks", [dict(block_q=0), dict(block_k=-1)])
def test_bad_block_size_is_an_error(blocks):
    with pytest.raises(ValueError, match="block sizes must be >= 1"):
        tiled_attention_forward(np.zeros((1, 4, 2 * (2 * 3 + 2))), 2, 3, 2, **blocks)


def test_cache_is_linear_in_T():
    """No (T, T) array is kept between the forward and the backward: O(T) memory."""
    T, n_heads, d_qk, d_head = 1024, 2, 5, 3
    qkv = np.random.default_rng(0).standard_normal((1, T, n_heads * (2 * d_qk + d_head)))
    _, cache = tiled_attention_forward(qkv, n_heads, d_qk, d_head)
    sizes = [a.size for a in cache.values() if isinstance(a, np.ndarray)]
    assert sizes and max(sizes) <= n_heads * T * (max(d_qk, d_head) + 1)   # [q | −ℓ], [v | 1], …


def test_fast_path_picks_tiled_from_the_crossover():
    qkv = np.zeros((1, 4, 2 * (2 * 3 + 2)))
    assert use_tiled(TILED_MIN_T["numpy"], qkv) and not use_tiled(TILED_MIN_T["numpy"] - 1, qkv)
    t = torch.zeros(1)
    assert use_tiled(TILED_MIN_T["torch"], t) and not use_tiled(TILED_MIN_T["torch"] - 1, t)
    T = TILED_MIN_T["numpy"]
    qkv = np.random.default_rng(0).standard_normal((1, T, 2 * (2 * 3 + 2)))
    _, cache = fast_attention.multi_head_attention_forward(qkv, 2, 3, 2)
    assert cache.get("tiled") and "p" not in cache
    _, cache = fast_attention.multi_head_attention_forward(qkv[:, :T - 1], 2, 3, 2)
    assert not cache.get("tiled") and cache["p"].shape == (1, 2, T - 1, T - 1)


def test_numpy_runs_numba_parallel_kernels(monkeypatch):
    """On NumPy arrays both directions run the ``prange`` kernels on numba's threads (their
    parallel compilations), not the torch loop."""
    monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", "2")
    qkv = np.random.default_rng(0).standard_normal((1, 256, 4 * (2 * 3 + 2)))
    out, cache = tiled_attention_forward(qkv, 4, 3, 2, block_q=16, block_k=16)
    tiled_attention_backward(out, cache)
    assert attention_tiled._forward_units.parallel.signatures
    assert attention_tiled._backward_heads.parallel.signatures


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_same_bits_for_any_number_of_threads(causal, dtype, monkeypatch):
    """Each unit of work (forward: a head's query block; backward: a head) writes its own
    outputs and reads nobody else's, so 1, 2 and 3 threads (and the serial compilation a small
    job takes) give the same bits: output, the signal at ``qkv`` and ``Δcausal``."""
    rng = np.random.default_rng(3)
    B, T, n_heads, d_qk, d_head = 3, 200, 2, 5, 3
    qkv = rng.standard_normal((B, T, n_heads * (2 * d_qk + d_head))).astype(dtype)
    delta = rng.standard_normal((B, T, n_heads * d_head)).astype(dtype)

    def run():
        out, cache = tiled_attention_forward(qkv, n_heads, d_qk, d_head, causal=causal, block_q=32, block_k=64)
        return (out, *tiled_attention_backward(delta, cache, keep_delta_causal=True))

    results = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", threads)
        results.append(run())
    from pedestrian.kernels import schedule

    monkeypatch.setattr(schedule, "SERIAL_BELOW", 1 << 40)                       # the serial compilation
    results.append(run())
    for got in results[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(got, results[0]))


# ------------------------------------------------------------------------------ the whole model
# id -> (B, T, cfg overrides); T = 1024 with a small model keeps the autograd oracle quick
MODEL_CASES = {
    "B1-T1024-causal-dqk5-dhead3": (1, 1024, dict(d_qk=5, d_head=3, n_blocks=1, d_model=8, n_heads=2)),
    "B3-T200-noncausal-dqk2-dhead6": (3, 200, dict(d_qk=2, d_head=6, causal=False)),
    "B3-T65-causal-tied-nobias": (3, 65, dict(tie_weights=True, bias=False, d_qk=4, d_head=3)),
    "B1-T7-causal": (1, 7, dict()),
    "B3-T1-causal-1blk": (3, 1, dict(n_blocks=1)),
    "B1-T64-noncausal-dqk3-dhead5": (1, 64, dict(causal=False, d_qk=3, d_head=5)),
}


def _model_step(build_model, cfg, params, tokens, targets, tiled: bool, monkeypatch):
    with monkeypatch.context() as m:
        m.setitem(TILED_MIN_T, "numpy", 1 if tiled else 1 << 30)
        model = build_model(cfg, params, dtype="float64")
        model.fused_head = False                          # Δ12 kept (the fused head: test_model.py's grid)
        loss = model.loss(tokens, targets)
        grads = {k: np.array(g) for k, g in model.backward(keep_deltas=True).items()}
        deltas = {k: np.array(d) for k, d in model.deltas().items()}
        weights = [np.array(p) for p in model.attention_weights()]
        key_bias = model_key_bias_bounds(model)
        one_key = model_one_key_bounds(model) if tokens.shape[1] == 1 else None
    return loss, grads, deltas, weights, key_bias, one_key


@pytest.mark.parametrize("case_id", list(MODEL_CASES))
def test_model_tiled_matches_full_and_autograd(case_id, build_model, token_batch, monkeypatch):
    B, T, overrides = MODEL_CASES[case_id]
    cfg = default_cfg(**{"context_length": T, **overrides})
    params = random_params(cfg, seed=T)
    tokens, targets = token_batch(cfg, B, T, seed=T, n_ignored=min(2, B * T - 1))
    tiled = _model_step(build_model, cfg, params, tokens, targets, True, monkeypatch)
    full = _model_step(build_model, cfg, params, tokens, targets, False, monkeypatch)
    loss, grads, deltas, weights, key_bias, one_key = tiled

    assert abs(loss - full[0]) <= TOL_ORDER * max(abs(full[0]), 1.0)
    assert set(grads) == set(full[1]) and set(deltas) == set(full[2])
    for name, g in grads.items():
        i = int(name.split(".")[1]) if name.startswith("blocks.") else None
        kind = name.split(".", 2)[-1] if i is not None else name
        if name.endswith(".attn.k.bias"):            # exactly 0 in exact arithmetic: noise within its bound
            assert np.all(np.abs(g) <= key_bias[i]) and np.all(np.abs(full[1][name]) <= full[4][i]), name
        elif one_key is not None and i is not None and kind in one_key[i]:   # T = 1: ≡ 0 too (gradcheck.model_one_key_bounds)
            assert np.all(np.abs(g) <= 2 * one_key[i][kind]), name
            assert np.all(np.abs(full[1][name]) <= 2 * full[5][i][kind]), name
        else:
            assert _rel(g, full[1][name]) <= TOL_ORDER, name
    for name, d in deltas.items():                                           # Δ1 … Δ12 and Δcausal
        if one_key is not None and name.endswith("Δcausal"):
            i = int(name.split(".")[1])
            assert np.all(np.abs(d) <= 2 * one_key[i]["Δcausal"]), name
            assert np.all(np.abs(full[2][name]) <= 2 * full[5][i]["Δcausal"]), name
            continue
        assert _rel(d, full[2][name]) <= TOL_ORDER, name
    for p, p_full in zip(weights, full[3]):
        assert _rel(p, p_full) <= TOL_ORDER

    ref_loss, _, ref_grads, ref_deltas = reference_loss_and_grads(params, cfg, tokens, targets)
    assert abs(loss - ref_loss) <= TOL_ORACLE * max(abs(ref_loss), 1.0)
    for name, g in grads.items():
        if name.endswith(".attn.k.bias"):
            continue
        kind = name.split(".", 2)[-1]
        if one_key is not None and name.startswith("blocks.") and kind in one_key[int(name.split(".")[1])]:
            bound = 2 * one_key[int(name.split(".")[1])][kind]        # ≡ 0 with one key: noise, both sides
            assert np.all(np.abs(g) <= bound) and np.all(np.abs(ref_grads[name]) <= bound), name
            continue
        assert _rel(g, ref_grads[name]) <= TOL_ORACLE, name
    for name in delta_names(cfg):
        assert _rel(deltas[name], ref_deltas[name]) <= TOL_ORACLE, name
    assert np.max(np.abs(ref_deltas["Δ1"])) > 1e-6                          # not a comparison of zeros


def test_model_torch_backend_tiled_matches_numpy_full(build_model, token_batch, monkeypatch, one_torch_thread):
    """The torch backend on the CPU runs the numba tiled kernel through NumPy views of its tensors
    (no autograd) to the same result."""
    B, T = 2, 65
    cfg = default_cfg(context_length=T, d_qk=4, d_head=3)
    params = random_params(cfg, seed=1)
    tokens, targets = token_batch(cfg, B, T, seed=1, n_ignored=2)
    _, grads, deltas, weights, _, _ = _model_step(build_model, cfg, params, tokens, targets, False, monkeypatch)
    with monkeypatch.context() as m:
        m.setitem(TILED_MIN_T, "numpy", 1)
        model = build_model(cfg, params, dtype="float64", backend="torch")
        model.fused_head = False
        model.loss(torch.tensor(tokens), torch.tensor(targets))
        grads_t = model.backward(keep_deltas=True)
        deltas_t = model.deltas()
        weights_t = model.attention_weights()
    for name, g in grads.items():
        if not name.endswith(".attn.k.bias"):
            assert _rel(grads_t[name].numpy(), g) <= TOL_ORDER, name
    for name, d in deltas.items():
        assert _rel(deltas_t[name].numpy(), d) <= TOL_ORDER, name
    for p_t, p in zip(weights_t, weights):
        assert _rel(p_t.numpy(), p) <= TOL_ORDER

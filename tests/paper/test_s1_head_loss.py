"""The output head fused with its loss (EQUATIONS.md, "The head fused with its loss"):
``layers.head_loss`` and ``kernels.head_loss`` against the unfused chain ``linear → cross-entropy``.

Tolerance (:func:`bound`), derived. The fused and unfused computations evaluate the same formulas
on the same data in another order: the products ``h W`` of a chunk against the whole (BLAS blocks
them differently), the loss summed chunk by chunk, ``dW`` accumulated over chunks. By the standard
bound on sums (Higham, "Accuracy and Stability", eq. 3.5 / 4.4), a sum of ``n`` terms evaluated in
any order errs by at most ``γ_n ≈ n·u`` times the sum of its terms' magnitudes, ``u = ε/2``. A
logit ``z_ij`` is a sum of ``d`` terms, so it may differ by ``d·ε·Z_i`` (``Z_i = max_j (|h||W|)_ij``);
a softmax moves by at most ``2·max_j |δz_ij|`` relative, so each ``Δ12`` entry differs by at most
``p_ij · 2 d ε Z_i / C`` plus its own few roundings. Then ``dW = hᵀ Δ12`` (``N`` terms), ``Δ11 =
Δ12 Wᵀ`` (``V`` terms), ``db`` (``N`` terms) and the loss (``N`` rows of ``V``-term sums) each
carry their own sums. So, entry by entry, with ``A = (|P| (1 + 2 d Z) + |Y|) / C``::

    |dW_f − dW_u| <= (N + V + d + 8)·ε · (|h|ᵀ A)      |Δ11_f − Δ11_u| <= (N + V + d + 8)·ε · (A |W|ᵀ)
    |db_f − db_u| <= (N + V + d + 8)·ε · Σ_rows A      |L_f − L_u|     <= (N + V + d + 8)·ε · Σ (|lse| + |z_y|) / C

a first-order bound that holds on any IEEE-754 machine, any BLAS, 1 or 2 threads (the 8 covers the
elementwise operations around the sums: exp, division, subtraction, scaling). Float32 is checked
against the float64 computation of the same float32 inputs with ``ε = ε32`` (the float64 side's
own error is 2^-29 times smaller). A wrong formula errs by O(1) relative.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pedestrian.layers.head_loss as head_loss_module
from pedestrian import GPT, GPTConfig, kernels, layers

IMPLEMENTATIONS = {"reference": layers, "fast": kernels}


def case(B, T, d, V, dtype="float64", *, bias=True, tied=False, n_ignored=1, seed=0):
    """``h (B, T, d)``, ``W (d, V)`` (F-ordered when ``tied``: a view of a ``(V, d)`` table), ``b``, targets."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((B, T, d)).astype(dtype)
    W = rng.standard_normal((V, d)).astype(dtype).T if tied else rng.standard_normal((d, V)).astype(dtype)
    b = rng.standard_normal(V).astype(dtype) if bias else None
    y = rng.integers(0, V, (B, T))
    y.reshape(-1)[rng.permutation(B * T)[:n_ignored]] = -100
    return h, W, b, y


def unfused(h, W, b, y, n_total=None):
    """The float64 unfused chain (the reference layers): loss, Δ11, dW, db, and the magnitudes of
    the module docstring's bound (``S`` of each)."""
    h, W = h.astype(np.float64), W.astype(np.float64)
    b = None if b is None else b.astype(np.float64)
    z, _ = layers.linear_forward(h, W, b)
    loss, cache = layers.cross_entropy_forward(z, y, n_total=n_total)
    d12 = layers.cross_entropy_backward(cache)
    dW, db = np.empty_like(W), None if b is None else np.empty_like(b)
    d11 = layers.linear_backward(d12, h, W, dweight=dW, dbias=db)
    V, d = W.shape[1], W.shape[0]
    C = cache[3]
    p, onehot = cache[0], cache[1]
    h2 = h.reshape(-1, d)
    Z = np.max(np.abs(h2) @ np.abs(W), axis=-1, keepdims=True)                  # (N, 1)
    A = (p * (1 + 2 * d * Z) + onehot) / max(C, 1)                             # (N, V)
    zr = z.reshape(-1, V)
    lse = np.log(np.sum(np.exp(zr - zr.max(-1, keepdims=True)), -1)) + zr.max(-1)
    S_loss = float(np.sum((np.abs(lse)[:, None] + np.abs(zr)) * onehot)) / max(C, 1)
    scales = dict(loss=S_loss, dh=(A @ np.abs(W).T).reshape(h.shape), dW=np.abs(h2).T @ A, db=A.sum(0))
    return dict(loss=float(loss), dh=d11, dW=dW, db=db), scales


def bound(N, V, d, dtype) -> float:
    """``(N + V + d + 8)·ε`` (module docstring)."""
    return (N + V + d + 8) * float(np.finfo(dtype).eps)


def fused(impl, h, W, b, y, **kw):
    loss, cache = impl.head_loss_forward(h, W, b, y, **kw)
    dW = np.empty((W.shape[1], W.shape[0]), W.dtype).T if W.flags.f_contiguous and not W.flags.c_contiguous \
        else np.empty_like(W)
    db = None if b is None else np.empty_like(b)
    dh = impl.head_loss_backward(cache, dweight=dW, dbias=db)
    return dict(loss=float(loss), dh=np.asarray(dh), dW=dW, db=db)


def assert_within(got, want, scales, factor, what=""):
    assert abs(got["loss"] - want["loss"]) <= factor * scales["loss"] + 1e-300, (what, "loss")
    for k in ("dh", "dW", "db"):
        if want[k] is None:
            assert got[k] is None, (what, k)
            continue
        err = np.abs(np.asarray(got[k], np.float64) - want[k])
        assert np.all(err <= factor * scales[k]), (what, k, float(np.max(err - factor * scales[k])))


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("tied,bias", [(False, True), (False, False), (True, False)])
@pytest.mark.parametrize("chunk_rows", [1, 4, 7, None])         # 7 does not divide N = 15
def test_fused_equals_unfused(impl, dtype, tied, bias, chunk_rows):
    B, T, d, V = 3, 5, 6, 13
    h, W, b, y = case(B, T, d, V, dtype, bias=bias, tied=tied, n_ignored=3)
    want, scales = unfused(h, W, b, y)
    got = fused(IMPLEMENTATIONS[impl], h, W, b, y, chunk_rows=chunk_rows)
    assert_within(got, want, scales, bound(B * T, V, d, dtype))
    assert np.max(np.abs(want["dW"])) > 1e-3                                    # a real signal


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_micro_batches_with_n_total_add_up_to_the_whole(impl):
    """Two slices, each divided by the whole batch's count: their losses and gradients add up to
    the whole batch's (the accumulation of training steps and ranks, ``n_total``)."""
    h, W, b, y = case(4, 6, 5, 11, n_ignored=5)
    whole, scales = unfused(h, W, b, y)
    n_total = int(np.sum(y != -100))
    parts = [fused(IMPLEMENTATIONS[impl], h[s], W, b, y[s], n_total=n_total, chunk_rows=5)
             for s in (slice(0, 1), slice(1, 4))]
    summed = dict(loss=sum(p["loss"] for p in parts), dh=np.concatenate([p["dh"] for p in parts]),
                  dW=sum(p["dW"] for p in parts), db=sum(p["db"] for p in parts))
    assert_within(summed, whole, scales, 2 * bound(24, 11, 5, "float64"))


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_every_target_ignored_gives_zero_and_evaluation_makes_no_gradient(impl):
    f = IMPLEMENTATIONS[impl]
    h, W, b, y = case(2, 3, 4, 7)
    got = fused(f, h, W, b, np.full_like(y, -100), chunk_rows=2)
    assert got["loss"] == 0.0 and not np.any(got["dh"]) and not np.any(got["dW"]) and not np.any(got["db"])
    loss, cache = f.head_loss_forward(h, W, b, y, grad=False)
    assert cache.dh is None and cache.dweight is None
    assert abs(float(loss) - unfused(h, W, b, y)[0]["loss"]) <= 1e-12
    with pytest.raises(ValueError, match="grad=False"):
        f.head_loss_backward(cache)
    with pytest.raises(ValueError, match="chunk_rows"):
        f.head_loss_forward(h, W, b, y, chunk_rows=0)
    with pytest.raises(ValueError, match="target 7"):
        f.head_loss_forward(h, W, b, np.full_like(y, 7))


def test_chunk_rows_follow_the_memory_budget():
    assert layers.head_chunk_rows(49_152, 4) == (32 << 20) // (49_152 * 4) == 170
    assert layers.head_chunk_rows(10, 8, budget=1) == 1                          # at least one row


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(B=st.integers(1, 3), T=st.integers(1, 9), d=st.integers(1, 12), V=st.integers(1, 40),
       chunk_rows=st.integers(1, 30), bias=st.booleans(), tied=st.booleans(),
       dtype=st.sampled_from(["float64", "float32"]), seed=st.integers(0, 99))
def test_fast_kernel_equals_the_reference(B, T, d, V, chunk_rows, bias, tied, dtype, seed):
    """The property sample: the fast kernel and the reference layer, both against the float64
    unfused chain within the module docstring's bound (so within twice it of each other)."""
    h, W, b, y = case(B, T, d, V, dtype, bias=bias and not tied, tied=tied, n_ignored=seed % 3, seed=seed)
    want, scales = unfused(h, W, b, y)
    for impl in IMPLEMENTATIONS.values():
        assert_within(fused(impl, h, W, b, y, chunk_rows=chunk_rows), want, scales, bound(B * T, V, d, dtype),
                      impl.__name__)


@pytest.mark.parametrize("threads", [1, 2])
def test_fast_kernel_property_with_threads(threads):
    """The property sample again in a process with 1 and with 2 threads (numba's and the BLAS's)."""
    from thread_runs import run_with_threads

    run_with_threads(__file__, "test_fast_kernel_equals_the_reference", threads, {})


@pytest.mark.parametrize("kernels_name", ["fast", "reference"])
@pytest.mark.parametrize("tied", [True, False])
def test_whole_model_fused_equals_unfused_with_uneven_chunks(kernels_name, tied, monkeypatch):
    """Through the whole model, chunks of 4 rows over N = 2·9 = 18 (not a multiple), LoRA-free
    and with the base frozen under LoRA: the same loss and every gradient as the logits kept,
    within the bound above at the head, carried through the chain (1e-12 of each tensor's scale:
    the chain's own reorderings are those of tests/system/test_fast_path_property.py)."""
    V = 23
    monkeypatch.setattr(head_loss_module, "HEAD_CHUNK_BYTES", 4 * V * 8)
    cfg = GPTConfig(vocab_size=V, context_length=12, d_model=10, n_heads=2, n_blocks=2, tie_weights=tied)
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, V, (2, 9)), rng.integers(0, V, (2, 9))
    y[1, :4] = -100
    for lora in (False, True):
        model = GPT(cfg, dtype="float64", kernels=kernels_name, seed=2)
        if lora:
            model.add_lora(["attn_proj"], rank=2, alpha=4.0)
            for name in model.lora_state_dict():
                model.params[name][...] = rng.standard_normal(model.params[name].shape) * 0.1
        model.fused_head = False
        loss_u = model.loss(x, y)
        grads_u = {k: np.array(v) for k, v in model.backward().items()}
        model.fused_head = True
        loss_f = model.loss(x, y)
        assert model._acts.head is not None and model._acts.a12 is None      # the fused path ran
        grads_f = model.backward()
        assert abs(loss_f - loss_u) <= 1e-12 * abs(loss_u)
        assert set(grads_f) == set(grads_u)
        for k, g in grads_u.items():                  # (the key bias's, ≡ 0: noise at the query bias's scale)
            scale = np.max(np.abs(grads_u[k.replace(".k.", ".q.")] if k.endswith("attn.k.bias") else g))
            assert np.max(np.abs(np.asarray(grads_f[k]) - g)) <= 1e-12 * scale, k
        with pytest.raises(KeyError, match="a12 not kept: model.loss fuses"):
            model.activations()["a12"]
        assert model.activations()["a11"].shape == (2, 9, 10)
        assert np.asarray(model.forward(x)).shape == (2, 9, V)                # forward keeps the logits


def test_evaluation_and_adapted_heads():
    """``keep_activations=False`` (evaluation) runs the fused loss without gradients; a head with
    a LoRA adapter keeps the unfused path (its adapter is not in the fused layer)."""
    cfg = GPTConfig(vocab_size=17, context_length=8, d_model=8, n_heads=2, n_blocks=1, tie_weights=False)
    model = GPT(cfg, dtype="float64", seed=1)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 17, (2, 8)), rng.integers(0, 17, (2, 8))
    full = model.loss(x, y)
    evaluated = model.loss(x, y, keep_activations=False)
    assert model._acts.head.dh is None and abs(evaluated - full) <= 1e-14 * full
    model.add_lora(["logits"], rank=2, alpha=2.0)
    model.loss(x, y)
    assert model._acts.head is None and model._acts.a12 is not None

"""DataParallel: a batch split over threads gives the unsplit step's loss and gradients."""

from __future__ import annotations

import numpy as np
import pytest

from gradcheck import (EPS64, RTOL_ROUNDING, adamw_rounding_bounds, flat_layout, gradient_rounding_err,
                       model_key_bias_bounds, norm_rounding_rel)
from pedestrian.backend import to_numpy
from pedestrian.kernels.threads import single_threaded_blas
from pedestrian.config import GPTConfig
from pedestrian.model import GPT
from pedestrian.training.optim import AdamW
from pedestrian.training.parallel import DataParallel, use_data_parallel
from pedestrian.training import train_step

CFG = GPTConfig(vocab_size=23, context_length=12, d_model=16, n_heads=2, n_blocks=2)


def _batch(B: int, T: int = 12, *, seed: int = 0, ignored_rows: tuple = ()):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, size=(B, T))
    targets = rng.integers(0, CFG.vocab_size, size=(B, T))
    for r in ignored_rows:                        # uneven counts per slice: n_total matters
        targets[r, : T - 2] = -100
    return tokens, targets


def _grads(model) -> dict:
    return {k: np.array(to_numpy(v), copy=True) for k, v in model.grads.items()}


def _assert_close(got: dict, want: dict, key_bias_bounds: list) -> None:
    """Per tensor: ``max|got − want| <= RTOL_ROUNDING · max|want|`` (the same sums in another
    order: the rows split over slices). The key-bias gradient, identically 0 in exact arithmetic
    (paper section 3), is rounding noise on both sides: each within its bound
    (``gradcheck.key_bias_bound`` of the whole batch, which covers any order of its terms)."""
    assert got.keys() == want.keys()
    for k in want:
        if k.endswith(".attn.k.bias"):
            bound = key_bias_bounds[int(k.split(".")[1])]
            assert np.all(np.abs(got[k]) <= bound) and np.all(np.abs(want[k]) <= bound), k
            continue
        scale = float(np.max(np.abs(want[k])))
        assert float(np.max(np.abs(got[k] - want[k]))) <= RTOL_ROUNDING * scale, k


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("B,threads", [(4, 2), (5, 2), (3, 3), (7, 4)])
def test_split_batch_equals_whole_batch(backend, B, threads):
    if backend == "torch":
        pytest.importorskip("torch")
    tokens, targets = _batch(B, ignored_rows=(0,))
    whole = GPT(CFG, seed=3, dtype="float64", backend=backend)
    loss = whole.loss(tokens, targets)
    whole.backward(keep_deltas=True)
    want = _grads(whole)

    model = GPT(CFG, seed=3, dtype="float64", backend=backend)
    dp = DataParallel(model, threads=threads)
    got_loss = dp.loss(tokens, targets)
    grads = dp.backward()
    assert abs(got_loss - loss) <= RTOL_ROUNDING * abs(loss)    # positive terms, other orders
    assert grads.keys() == want.keys()
    _assert_close(_grads(model), want, model_key_bias_bounds(whole))


def test_all_targets_of_one_slice_ignored():
    tokens, targets = _batch(4)
    targets[:2] = -100                            # slice 0 counts nothing
    whole = GPT(CFG, seed=1, dtype="float64")
    loss = whole.loss(tokens, targets)
    whole.backward(keep_deltas=True)
    model = GPT(CFG, seed=1, dtype="float64")
    dp = DataParallel(model, threads=2)
    assert abs(dp.loss(tokens, targets) - loss) <= RTOL_ROUNDING * abs(loss)
    dp.backward()
    _assert_close(_grads(model), _grads(whole), model_key_bias_bounds(whole))


def test_lora_frozen_base_and_adapters_changed_between_steps():
    tokens, targets = _batch(4, seed=2)
    model = GPT(CFG, seed=0, dtype="float64")
    dp = DataParallel(model, threads=2)
    dp.loss(tokens, targets)
    dp.backward()                                 # slices now hold base-gradient buffers
    model.add_lora(["blocks.0.attn.q", "blocks.1.mlp_expand"], rank=2, alpha=0.5, seed=1)
    for name in model.params:
        if name.endswith("lora_U"):                 # non-zero U: the adapters change the output
            model.params[name][...] = np.random.default_rng(5).normal(size=model.params[name].shape)
    ref = GPT(CFG, seed=0, dtype="float64")
    ref.add_lora(["blocks.0.attn.q", "blocks.1.mlp_expand"], rank=2, alpha=0.5, seed=1)
    ref.load_state_dict(model.state_dict())
    loss = ref.loss(tokens, targets)
    ref.backward(keep_deltas=True)
    assert abs(dp.loss(tokens, targets) - loss) <= RTOL_ROUNDING * abs(loss)
    grads = dp.backward()
    assert all(".lora_" in k for k in grads)      # the frozen base gets no gradient
    _assert_close(_grads(model), _grads(ref), model_key_bias_bounds(ref))
    dp.close()


def test_train_step_with_data_parallel_matches_plain_training():
    """Three AdamW steps, the batch split over 3 threads or not. Each step starts both sides from
    the same state (written in place: the slices must see it, and every update), so the bounds
    follow from one step: the same gradient summed in other orders, then AdamW's sensitivity to
    that difference (``gradcheck.adamw_rounding_bounds``)."""
    batches = [_batch(6, seed=s) for s in range(3)]
    plain, parallel = GPT(CFG, seed=4, dtype="float64"), GPT(CFG, seed=4, dtype="float64")
    opt_plain, opt_parallel = AdamW(plain, lr=1e-2, weight_decay=0.1), AdamW(parallel, lr=1e-2, weight_decay=0.1)
    runner, n = DataParallel(parallel, threads=3), plain.flat.size
    for tokens, targets in batches:
        parallel.flat[...] = plain.flat
        opt_parallel.load_state_dict(opt_plain.state_dict())
        state, start = opt_plain.state_dict(), plain.flat.copy()
        plain.loss(tokens, targets)
        plain.backward(keep_deltas=True)
        delta = flat_layout(plain, gradient_rounding_err(plain, model_key_bias_bounds(plain)))[0]
        loss, norm = train_step(plain, opt_plain, [(tokens, targets)], 1e-2, grad_clip=1.0)
        loss_dp, norm_dp = train_step(runner, opt_parallel, [(tokens, targets)], 1e-2, grad_clip=1.0)
        assert runner.slices_for(6) == 3
        assert abs(loss_dp - loss) <= RTOL_ROUNDING * loss
        assert abs(norm_dp - norm) <= np.linalg.norm(delta) + norm_rounding_rel(n) * norm
        coef = min(1.0, 1.0 / (norm + 1e-6))
        g_rel = np.linalg.norm(delta) / norm + norm_rounding_rel(n) + 3 * EPS64
        bound = adamw_rounding_bounds(start, [opt_plain.groups[0].grads], [1e-2], betas=opt_plain.betas,
                                      eps=opt_plain.eps, weight_decay=0.1, n_decay=opt_plain.groups[0].n_decay,
                                      g_rel=g_rel, g_err=[delta * coef], m0=state["base.m"], v0=state["base.v"],
                                      t0=state["step"])["params"]
        assert np.all(np.abs(parallel.flat - plain.flat) <= bound), np.max(np.abs(parallel.flat - plain.flat) / bound)
    runner.close()


def test_dropout_is_reproducible_and_differs_per_slice():
    cfg = GPTConfig(**{**CFG.to_dict(), "dropout": 0.3})
    tokens, targets = _batch(4, seed=6)
    tokens[2:] = tokens[:2]                       # the two slices see identical rows
    targets[2:] = targets[:2]
    results = []
    for _ in range(2):
        model = GPT(cfg, seed=9, dtype="float64")
        dp = DataParallel(model, threads=2)
        loss = dp.loss(tokens, targets)
        dp.backward()
        results.append((loss, _grads(model)))
        logits = [model.activations()["a12"], dp._slices(2)[1].activations()["a12"]]
        assert not np.allclose(*logits)           # different dropout masks per slice
        dp.close()
    assert results[1][0] == results[0][0]          # the same seed: the same bits
    for k in results[0][1]:
        np.testing.assert_array_equal(results[1][1][k], results[0][1][k])


def test_one_row_or_one_thread_goes_straight_to_the_model():
    tokens, targets = _batch(1)
    model = GPT(CFG, seed=0, dtype="float64")
    dp = DataParallel(model, threads=2)
    loss = dp.loss(tokens, targets)
    dp.backward()
    assert loss == GPT(CFG, seed=0, dtype="float64").loss(tokens, targets)
    assert dp._replicas == []
    assert model.activations()["a12"].shape == (1, 12, CFG.vocab_size)


def test_errors():
    model = GPT(CFG)
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="threads must be an integer >= 1"):
            DataParallel(model, threads=bad)
    dp = DataParallel(model, threads=2)
    with pytest.raises(ValueError, match="before loss"):
        dp.backward()
    tokens, targets = _batch(4)
    targets[3, 0] = CFG.vocab_size               # out of range: the model's own message
    with pytest.raises(ValueError, match="outside"):
        dp.loss(tokens, targets)
    with pytest.raises(ValueError, match="before loss"):
        dp.backward()                             # the failed loss() left nothing to differentiate
    with pytest.raises(ValueError, match="must equal tokens shape"):
        dp.loss(tokens, targets[:3])
    targets[3, 0] = 0
    assert np.isfinite(dp.loss(tokens, targets))  # an error in a slice does not break it
    dp.backward()
    dp.close()


def test_single_threaded_blas_restores_thread_counts():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    torch = pytest.importorskip("torch")

    def blas_threads():
        return [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]

    before, torch_before = blas_threads(), torch.get_num_threads()
    with single_threaded_blas():
        assert set(blas_threads()) == {1}
        assert torch.get_num_threads() == 1
        with single_threaded_blas():              # nested: still one
            assert set(blas_threads()) == {1}
        assert set(blas_threads()) == {1}
    assert blas_threads() == before
    assert torch.get_num_threads() == torch_before


def test_nested_context_restores_threads():
    threadpoolctl = pytest.importorskip("threadpoolctl")

    def blas_threads():
        return [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]

    before = blas_threads()
    dp = DataParallel(GPT(CFG), threads=2)
    with dp:
        with dp:
            dp.loss(*_batch(4))
            dp.backward()
        assert set(blas_threads()) == {1}
    assert blas_threads() == before


def test_use_data_parallel_rule():
    small = GPT(CFG)
    assert use_data_parallel(small, batch_size=8, threads=2)
    assert not use_data_parallel(small, batch_size=1, threads=2)
    assert not use_data_parallel(small, batch_size=8, threads=1)
    pytest.importorskip("torch")
    assert not use_data_parallel(GPT(CFG, backend="torch"), batch_size=8, threads=2)


def test_explicit_threads_work_when_the_environment_asks_for_one(monkeypatch):
    """``DataParallel(threads=2)`` with ``PEDESTRIAN_NUM_THREADS=1`` (a CI runner, a user who pins
    NumPy to one thread): the slices still run, on a pool with at least one worker, and give the
    unsplit step's loss (the pool used to be sized from the environment alone: 0 workers)."""
    monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", "1")
    tokens, targets = _batch(4, seed=7)
    whole = GPT(CFG, seed=2, dtype="float64")
    loss = whole.loss(tokens, targets)
    with DataParallel(GPT(CFG, seed=2, dtype="float64"), threads=2) as dp:
        assert dp.slices_for(4) == 2
        assert abs(dp.loss(tokens, targets) - loss) <= RTOL_ROUNDING * abs(loss)
        dp.backward()


def test_one_sequence_shares_its_products_over_the_threads(monkeypatch):
    """Batch 1 (``runner_for(..., batch_size=1)``): no batch to split, so the context it returns
    (:class:`~pedestrian.kernels.threads.OwnCores`) holds BLAS to one thread and the fast kernels
    cut each matrix product into row (or weight-column) blocks, one per thread. The step's loss
    and gradients equal the plain step's up to the order of rounded additions."""
    from pedestrian.kernels.threads import OwnCores, product_parts
    from pedestrian.training.parallel import runner_for

    monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", "2")
    cfg = GPTConfig(vocab_size=23, context_length=160, d_model=32, n_heads=2, n_blocks=2, d_mlp=160)
    rng = np.random.default_rng(11)
    tokens, targets = rng.integers(0, 23, size=(1, 160)), rng.integers(0, 23, size=(1, 160))
    plain = GPT(cfg, seed=4, dtype="float64")
    loss = plain.loss(tokens, targets)
    want = _grads_after_backward(plain)
    model = GPT(cfg, seed=4, dtype="float64")
    runner, context = runner_for(model, "auto", 1)
    assert runner is model and isinstance(context, OwnCores)
    like = np.zeros(1)
    assert product_parts(like, 160) == 1                       # outside: the BLAS threads it
    with context:
        assert product_parts(like, 160) == 2 and product_parts(like, 100) == 1   # parts of >= 64 rows
        got_loss = model.loss(tokens, targets)
        got = _grads_after_backward(model)
    assert abs(got_loss - loss) <= RTOL_ROUNDING * abs(loss)
    _assert_close(got, want, model_key_bias_bounds(plain))
    assert runner_for(model, "off", 1)[1].__class__ is not OwnCores


def _grads_after_backward(model) -> dict:
    model.backward(keep_deltas=True)                  # the key-bias bounds read the Δs
    return _grads(model)

"""DataParallel: a batch split over threads gives the unsplit step's loss and gradients."""

from __future__ import annotations

import numpy as np
import pytest

from pedestrian.backend import to_numpy
from pedestrian.kernels.threads import single_threaded_blas
from pedestrian.config import GPTConfig
from pedestrian.model import GPT
from pedestrian.optim import AdamW
from pedestrian.parallel import DataParallel, use_data_parallel
from pedestrian.train import train_step

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


def _assert_close(got: dict, want: dict, rtol: float = 1e-12, atol: float = 1e-13) -> None:
    """Per tensor: ``max|got − want| <= rtol · max|want| + atol``. The ``atol`` is for tensors
    that are zero up to rounding (the key-bias gradient, ~1e-15 either way)."""
    assert got.keys() == want.keys()
    for k in want:
        scale = float(np.max(np.abs(want[k])))
        assert float(np.max(np.abs(got[k] - want[k]))) <= rtol * scale + atol, k


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("B,threads", [(4, 2), (5, 2), (3, 3), (7, 4)])
def test_split_batch_equals_whole_batch(backend, B, threads):
    if backend == "torch":
        pytest.importorskip("torch")
    tokens, targets = _batch(B, ignored_rows=(0,))
    whole = GPT(CFG, seed=3, dtype="float64", backend=backend)
    loss = whole.loss(tokens, targets)
    whole.backward()
    want = _grads(whole)

    model = GPT(CFG, seed=3, dtype="float64", backend=backend)
    dp = DataParallel(model, threads=threads)
    got_loss = dp.loss(tokens, targets)
    grads = dp.backward()
    assert abs(got_loss - loss) <= 1e-12 * abs(loss)
    assert grads.keys() == want.keys()
    _assert_close(_grads(model), want)


def test_all_targets_of_one_slice_ignored():
    tokens, targets = _batch(4)
    targets[:2] = -100                            # slice 0 counts nothing
    whole = GPT(CFG, seed=1, dtype="float64")
    loss = whole.loss(tokens, targets)
    whole.backward()
    model = GPT(CFG, seed=1, dtype="float64")
    dp = DataParallel(model, threads=2)
    assert abs(dp.loss(tokens, targets) - loss) <= 1e-12 * abs(loss)
    dp.backward()
    _assert_close(_grads(model), _grads(whole))


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
    ref.backward()
    assert abs(dp.loss(tokens, targets) - loss) <= 1e-12 * abs(loss)
    grads = dp.backward()
    assert all(".lora_" in k for k in grads)      # the frozen base gets no gradient
    _assert_close(_grads(model), _grads(ref))
    dp.close()


def test_train_step_with_data_parallel_matches_plain_training():
    batches = [_batch(6, seed=s) for s in range(3)]
    losses = {}
    params = {}
    for name in ("plain", "parallel"):            # the slices must see every update
        model = GPT(CFG, seed=4, dtype="float64")
        opt = AdamW(model, lr=1e-2, weight_decay=0.1)
        runner = DataParallel(model, threads=3) if name == "parallel" else model
        losses[name] = [train_step(runner, opt, [b], 1e-2, grad_clip=1.0)[0] for b in batches]
        params[name] = model.state_dict()
    np.testing.assert_allclose(losses["parallel"], losses["plain"], rtol=1e-12)
    _assert_close(params["parallel"], params["plain"], rtol=1e-11)


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
        assert abs(dp.loss(tokens, targets) - loss) <= 1e-12 * abs(loss)
        dp.backward()

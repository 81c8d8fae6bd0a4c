"""DataParallel: a batch split over threads or worker processes gives the unsplit step's loss
and gradients."""

from __future__ import annotations

import numpy as np
import pytest

from pedestrian.backend import single_threaded_blas, to_numpy
from pedestrian.config import GPTConfig
from pedestrian.model import GPT
from pedestrian.optim import AdamW
from pedestrian.parallel import DataParallel, WorkerDied, processes_available, use_data_parallel
from pedestrian.train import train_step

CFG = GPTConfig(vocab_size=23, context_length=12, d_model=16, n_heads=2, n_blocks=2)
#: both ways of running the slices after the first (worker processes only where fork exists)
MODES = [False, pytest.param(True, marks=pytest.mark.skipif(not processes_available(), reason="no fork"))]


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


@pytest.mark.parametrize("backend,processes", [("numpy", False), ("numpy", True), ("torch", False)])
@pytest.mark.parametrize("B,threads", [(4, 2), (5, 2), (3, 3), (7, 4)])
def test_split_batch_equals_whole_batch(backend, processes, B, threads):
    if backend == "torch":
        pytest.importorskip("torch")
    if processes and not processes_available():
        pytest.skip("no fork")
    tokens, targets = _batch(B, ignored_rows=(0,))
    whole = GPT(CFG, seed=3, dtype="float64", backend=backend)
    loss = whole.loss(tokens, targets)
    whole.backward()
    want = _grads(whole)

    model = GPT(CFG, seed=3, dtype="float64", backend=backend)
    dp = DataParallel(model, threads=threads, processes=processes)
    assert dp.processes == processes
    got_loss = dp.loss(tokens, targets)
    grads = dp.backward()
    assert abs(got_loss - loss) <= 1e-12 * abs(loss)
    assert grads.keys() == want.keys()
    _assert_close(_grads(model), want)


@pytest.mark.parametrize("processes", MODES)
def test_all_targets_of_one_slice_ignored(processes):
    tokens, targets = _batch(4)
    targets[:2] = -100                            # slice 0 counts nothing
    whole = GPT(CFG, seed=1, dtype="float64")
    loss = whole.loss(tokens, targets)
    whole.backward()
    model = GPT(CFG, seed=1, dtype="float64")
    dp = DataParallel(model, threads=2, processes=processes)
    assert abs(dp.loss(tokens, targets) - loss) <= 1e-12 * abs(loss)
    dp.backward()
    _assert_close(_grads(model), _grads(whole))


@pytest.mark.parametrize("processes", MODES)
def test_lora_frozen_base_and_adapters_changed_between_steps(processes):
    tokens, targets = _batch(4, seed=2)
    model = GPT(CFG, seed=0, dtype="float64")
    dp = DataParallel(model, threads=2, processes=processes)
    dp.loss(tokens, targets)
    dp.backward()                                 # slices now hold base-gradient buffers
    first_workers = [w._process for w in dp._workers]
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
    if processes:                                 # a new structure: the worker was forked again
        assert len(first_workers) == 1 and not first_workers[0].is_alive()
        assert dp._workers[0]._process is not first_workers[0]
    dp.close()


@pytest.mark.parametrize("processes", MODES)
def test_train_step_with_data_parallel_matches_plain_training(processes):
    batches = [_batch(6, seed=s) for s in range(3)]
    losses = {}
    params = {}
    for name in ("plain", "parallel"):            # the workers must see every update
        model = GPT(CFG, seed=4, dtype="float64")
        opt = AdamW(model, lr=1e-2, weight_decay=0.1)
        runner = DataParallel(model, threads=3, processes=processes) if name == "parallel" else model
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
    for processes in (False, False) + ((True,) if processes_available() else ()):
        model = GPT(cfg, seed=9, dtype="float64")
        dp = DataParallel(model, threads=2, processes=processes)
        loss = dp.loss(tokens, targets)
        dp.backward()
        results.append((loss, _grads(model)))
        if not processes:
            parts = dp._slices
            a, b = parts[0]._cache["a12"], parts[1]._cache["a12"]
            assert not np.allclose(a, b)          # different dropout masks per slice
        dp.close()
    for loss, grads in results[1:]:              # again, and in a worker process: the same bits
        assert loss == results[0][0]
        _assert_close(grads, results[0][1], rtol=0.0, atol=0.0)


@pytest.mark.skipif(not processes_available(), reason="no fork")
def test_processes_give_the_bits_of_threads():
    batches = [_batch(5, seed=s, ignored_rows=(1,)) for s in range(3)]
    runs = {}
    for processes in (False, True):
        model = GPT(CFG, seed=2)                  # float32: any difference in the arithmetic shows
        opt = AdamW(model, lr=1e-2)
        dp = DataParallel(model, threads=2, processes=processes)
        runs[processes] = ([train_step(dp, opt, [b], 1e-2)[0] for b in batches], model.state_dict())
        dp.close()
    assert runs[True][0] == runs[False][0]
    _assert_close(runs[True][1], runs[False][1], rtol=0.0, atol=0.0)


@pytest.mark.skipif(not processes_available(), reason="no fork")
def test_a_killed_worker_is_replaced_and_its_slice_redone(monkeypatch):
    import pedestrian.parallel as parallel

    cfg = GPTConfig(**{**CFG.to_dict(), "dropout": 0.3})    # a redone slice must draw the same masks
    batch = _batch(5, seed=1, ignored_rows=(1,))
    ref = GPT(cfg, seed=2)
    ref_dp = DataParallel(ref, threads=2, processes=False)
    ref_dp.loss(*batch)
    ref_dp.backward()
    want_loss = ref_dp.loss(*batch)
    ref_dp.backward()
    want = _grads(ref)

    model = GPT(cfg, seed=2)
    dp = DataParallel(model, threads=2, processes=True)
    dp.loss(*batch)
    dp.backward()                                 # a worker exists now
    dp._workers[0]._process.kill()                # killed between two steps
    dp._workers[0]._process.join()
    with pytest.warns(RuntimeWarning, match="worker process .* exited unexpectedly.*repeated its slice"):
        assert dp.loss(*batch) == want_loss
    dp._workers[0]._process.kill()                # killed between forward and backward
    dp._workers[0]._process.join()
    with pytest.warns(RuntimeWarning, match="repeated its slice"):
        dp.backward()
    _assert_close(_grads(model), want, rtol=0.0, atol=0.0)   # the bits of the threads
    assert dp._workers[0]._process.is_alive()

    real_send = parallel._Worker.send

    def dying_send(worker, message):              # every worker dies before it answers
        worker._process.kill()
        worker._process.join()
        real_send(worker, message)

    monkeypatch.setattr(parallel._Worker, "send", dying_send)
    with pytest.warns(RuntimeWarning), pytest.raises(WorkerDied, match="exited unexpectedly.*processes=False"):
        dp.loss(*batch)
    monkeypatch.undo()
    assert np.isfinite(dp.loss(*batch))           # and the next call starts afresh
    process = dp._workers[0]._process
    dp.close()
    assert not process.is_alive() and dp._workers == []


def test_one_row_or_one_thread_goes_straight_to_the_model():
    tokens, targets = _batch(1)
    model = GPT(CFG, seed=0, dtype="float64")
    dp = DataParallel(model, threads=2)
    loss = dp.loss(tokens, targets)
    dp.backward()
    assert loss == GPT(CFG, seed=0, dtype="float64").loss(tokens, targets)
    assert dp._slices == []
    assert model.activations()["a12"].shape == (1, 12, CFG.vocab_size)


@pytest.mark.parametrize("processes", MODES)
def test_errors(processes):
    model = GPT(CFG)
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="threads must be an integer >= 1"):
            DataParallel(model, threads=bad)
    dp = DataParallel(model, threads=2, processes=processes)
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
    assert np.isfinite(dp.loss(tokens, targets))  # an error in a worker does not break it
    dp.backward()
    dp.close()


def test_processes_refused_where_they_cannot_work():
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="needs the NumPy backend.*processes=False"):
        DataParallel(GPT(CFG, backend="torch"), threads=2, processes=True)
    assert not DataParallel(GPT(CFG, backend="torch"), threads=2).processes


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

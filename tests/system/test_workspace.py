"""The speed machinery of pedestrian.backend must never change a result or a caller's array.

- ``Workspace``: arrays of the previous step are reused by the next only when nothing outside
  the model refers to them; logits, activations and error signals the caller kept stay intact.
- ``for_row_blocks``: the thread count does not change any result (not even a rounding).
- ``scatter_add_rows``: the sort + segment-sum path equals ``np.add.at``.
"""

from __future__ import annotations

import numpy as np
import pytest

import pedestrian.backend as backend
from pedestrian.config import GPTConfig
from pedestrian.layers.activations import activation_backward, activation_forward
from pedestrian.layers.attention import multi_head_attention_backward, multi_head_attention_forward
from pedestrian.layers.layernorm import layernorm_backward, layernorm_forward
from pedestrian.layers.loss import cross_entropy_backward, cross_entropy_forward
from pedestrian.model import GPT
from pedestrian.optim import AdamW

CFG = GPTConfig(vocab_size=13, context_length=8, d_model=16, n_heads=2, n_blocks=2)


def _batch(seed, B=3, T=8):
    rng = np.random.default_rng(seed)
    return rng.integers(0, CFG.vocab_size, (B, T)), rng.integers(0, CFG.vocab_size, (B, T))


def test_arrays_the_caller_keeps_are_never_reused():
    model = GPT(CFG, dtype="float64")
    x1, y1 = _batch(1)
    logits1 = model.forward(x1, y1)
    model.backward(keep_deltas=True)
    acts1, deltas1 = model.activations(), model.deltas()
    saved = ({k: np.copy(v) for k, v in acts1.items()}, {k: np.copy(v) for k, v in deltas1.items()},
             logits1.copy())
    view = acts1["blocks.0.a7"][0]                          # a view keeps its base alive too
    view_copy = view.copy()
    del acts1["blocks.0.a7"]
    for seed in (2, 3, 4):                                  # steps that would reuse the arrays
        model.loss(*_batch(seed))
        model.backward()
    np.testing.assert_array_equal(logits1, saved[2])
    for k, v in acts1.items():
        np.testing.assert_array_equal(v, saved[0][k], err_msg=k)
    for k, v in deltas1.items():
        np.testing.assert_array_equal(v, saved[1][k], err_msg=k)
    np.testing.assert_array_equal(view, view_copy)


def test_reuse_does_not_change_results_and_memory_stays_bounded():
    """Step after step on a reused workspace gives the same numbers as a fresh model."""
    warm = GPT(CFG, dtype="float64", seed=5)
    for seed in range(6):
        x, y = _batch(seed)
        loss = warm.loss(x, y)
        grads = {k: v.copy() for k, v in warm.backward().items()}
        fresh = GPT(CFG, dtype="float64", seed=5)
        fresh.load_state_dict(warm.state_dict())
        assert fresh.loss(x, y) == loss
        for k, v in fresh.backward().items():
            np.testing.assert_array_equal(v, grads[k], err_msg=k)
    steady = len(warm._workspace)
    assert steady < 40                                      # kept arrays do not pile up
    for T in (3, 5, 7, 4, 6, 6, 6):                         # shapes change: old ones are dropped
        warm.loss(*_batch(T, T=T))
        warm.backward()
        assert len(warm._workspace) < 100                   # at most about two steps' arrays
    assert len(warm._workspace) <= steady


def _ask(ws, *arrays_like):
    """One 'step' that asks the workspace for arrays shaped like these (as the model does)."""
    with ws.active():
        for a in arrays_like:
            backend.empty_array(a.shape, a)
    ws.new_step()


def test_workspace_keeps_only_unreferenced_float_arrays():
    ws = backend.Workspace()
    _ask(ws, np.ones((2, 3), dtype=np.float32), np.ones((4, 5)), np.ones(6), np.ones(7))
    kept_by_caller = np.ones(7)
    base = np.ones((2, 3), dtype=np.float32)
    holder = [{"a": np.ones((4, 5)), "view": base[0], "ints": np.arange(3),
               "nested": (kept_by_caller, [np.zeros(6)])}]
    del base
    ws.recycle(holder)
    assert holder == []
    assert sorted(k[0] for k, v in ws._free.items() if v) == [(2, 3), (4, 5), (6,)]
    with ws.active():
        a = backend.empty_array((4, 5), np.zeros(1))
        assert a.shape == (4, 5) and a.dtype == np.float64
    assert len(ws) == 2
    assert backend.empty_array((4, 5), np.zeros(1)) is not None       # inactive: plain np.empty
    ws.new_step()
    assert len(ws) == 0                                     # not asked for in the last step: dropped


def test_workspace_keeps_no_more_than_a_step_asks_for():
    ws = backend.Workspace()
    _ask(ws, np.ones(5), np.ones(5))                        # a step uses two (5,) arrays
    ws.recycle([np.ones(5) for _ in range(6)])              # six come back
    assert len(ws) == 2


def test_workspace_reuses_torch_tensors_only_when_nothing_shares_them():
    torch = pytest.importorskip("torch")
    ws = backend.Workspace()
    like = torch.zeros(1)
    _ask(ws, *[torch.zeros(4, 3)] * 3)
    shared = torch.ones(4, 3)
    view_kept = shared[1:]                                  # a view the caller still holds
    free = torch.ones(4, 3)
    free_id = id(free)
    holder = [shared.reshape(12), free.reshape(2, 6)]      # views: recycle finds their bases
    del shared, free
    ws.recycle(holder)
    assert len(ws) == 1
    with ws.active():
        again = backend.empty_array((4, 3), like)
    assert id(again) == free_id
    again.fill_(5.0)
    assert bool((view_kept == 1.0).all())                   # the shared storage was never handed out


@pytest.fixture
def two_threads_for_everything(monkeypatch):
    """Force the thread pool on for small jobs (normally only jobs of >= 4M elements use it)."""
    defaults = dict(backend.for_row_blocks.__kwdefaults__)

    def run(threads: int, block: int):
        monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", str(threads))
        monkeypatch.setitem(backend.for_row_blocks.__kwdefaults__, "parallel_min", 1)
        monkeypatch.setitem(backend.for_row_blocks.__kwdefaults__, "block", block)

    yield run
    backend.for_row_blocks.__kwdefaults__.update(defaults)


def test_thread_count_does_not_change_any_result(two_threads_for_everything):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 10, 16))
    d = rng.standard_normal((6, 10, 16))
    w, b = rng.standard_normal(16), rng.standard_normal(16)
    qkv = rng.standard_normal((6, 10, 48))
    logits, targets = rng.standard_normal((6, 10, 13)), rng.integers(0, 13, (6, 10))

    def everything():
        y, c = layernorm_forward(x, w, b, 1e-5)
        out = [y, *layernorm_backward(d, c)]
        a, c = activation_forward(x, "gelu_tanh")
        out += [a, activation_backward(d, c, "gelu_tanh")]
        o, c = multi_head_attention_forward(qkv, 2, 8, 8)
        out += [o, multi_head_attention_backward(d, c)[0]]
        loss, c = cross_entropy_forward(logits, targets)
        out += [loss, cross_entropy_backward(c)]
        model = GPT(CFG, dtype="float64", seed=3)
        opt = AdamW(model, lr=0.1, chunk_size=64)
        model.loss(*_batch(9))
        model.backward()
        opt.step()
        return out + [model.flat.copy()]

    two_threads_for_everything(1, 64)
    one = everything()
    two_threads_for_everything(2, 64)
    two = everything()
    for a, b_ in zip(one, two):
        np.testing.assert_array_equal(a, b_)


def test_scatter_add_rows_matches_add_at():
    rng = np.random.default_rng(3)
    for V, N in ((5, 0), (5, 1), (5, 40), (50, 7)):
        target = rng.standard_normal((V, 3))
        index, rows = rng.integers(0, V, N), rng.standard_normal((N, 3))
        expect = target.copy()
        np.add.at(expect, index, rows)
        backend.scatter_add_rows(target, index, rows)
        np.testing.assert_allclose(target, expect, rtol=1e-14, atol=1e-15)

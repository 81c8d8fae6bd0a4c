"""The fast kernels' machinery must never change a result or a caller's array.

- ``kernels.workspace.Workspace``: an array is handed out again only once nothing outside the pool
  refers to it (no variable, view, list or dict; nor a torch CPU tensor made from it); the
  model's logits, activations and error signals the caller kept stay intact; results with reuse
  equal those without; memory stays bounded step after step and when shapes change.
- the kernels' numba threads, forced on for the smallest jobs: 1 and 2 threads give the same
  results up to rounding (a product cut into row blocks may sum in another order).
- ``backend.scatter_add_rows``: the sort + segment-sum path equals ``np.add.at``.
"""

from __future__ import annotations

import numpy as np
import pytest

import pedestrian.kernels as fast
from pedestrian.backend import scatter_add_rows
from pedestrian.config import GPTConfig
from pedestrian.kernels import schedule
from pedestrian.kernels.schedule import MAX_PER_SHAPE
from pedestrian.kernels.workspace import Workspace, empty_array
from pedestrian.model import GPT
from pedestrian.training.optim import AdamW

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


@pytest.mark.parametrize("kernels", ["fast", "reference"])
def test_reuse_does_not_change_results(kernels):
    """Step after step on a reused workspace gives the same numbers as a fresh model (the same
    operations on the same inputs, on the same machine: bit for bit)."""
    warm = GPT(CFG, dtype="float64", seed=5, kernels=kernels)
    for seed in range(6):
        x, y = _batch(seed)
        loss = warm.loss(x, y)
        grads = {k: v.copy() for k, v in warm.backward().items()}
        fresh = GPT(CFG, dtype="float64", seed=5, kernels=kernels)
        fresh.load_state_dict(warm.state_dict())
        assert fresh.loss(x, y) == loss
        for k, v in fresh.backward().items():
            np.testing.assert_array_equal(v, grads[k], err_msg=k)


MEMORY_SCRIPT = """
import gc, json, tracemalloc
import numpy as np
from pedestrian.config import GPTConfig
from pedestrian.model import GPT

CFG = GPTConfig(vocab_size=13, context_length=8, d_model=16, n_heads=2, n_blocks=2)


def batch(seed, B=3, T=8):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 13, (B, T)), rng.integers(0, 13, (B, T))


def traced_after(model, steps):
    out = []
    for x, y in steps:
        model.loss(x, y)
        model.backward()
        gc.collect()
        out.append(tracemalloc.get_traced_memory()[0])
    return out


model = GPT(CFG, dtype="float64", seed=5)
tracemalloc.start()
base = tracemalloc.get_traced_memory()[0]
one_step = traced_after(model, [batch(0)])[0] - base
warm = traced_after(model, [batch(s) for s in range(1, 10)])[-1]
later = traced_after(model, [batch(s) for s in range(10, 50)])
shifting = traced_after(model, [batch(T, T=T) for T in (3, 5, 7, 4, 6, 6, 6)])
print(json.dumps(dict(base=base, one_step=one_step, warm=warm, later=max(later), shifting=max(shifting))))
"""


def test_memory_stays_bounded_over_many_steps_and_shape_changes():
    """The pool hands the same arrays out again, so step after step no new array memory is
    taken; when the shapes change, arrays of shapes no longer asked for are dropped.

    Measured with tracemalloc (NumPy reports its data allocations to it) in a fresh interpreter:
    what it sees besides arrays -- Python's free lists and caches of small objects -- then grows
    by up to ~35 KiB over the first hundreds of steps and stops, while one (B, T, d) array kept
    per step would add 3 KiB per step, 120 KiB over the 40 steps measured."""
    import json
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True,
                          env=os.environ.copy(), timeout=120)
    assert done.returncode == 0, done.stderr
    m = json.loads(done.stdout)
    activation = 3 * 8 * 16 * 8                             # bytes of one (B, T, d) float64 array
    assert m["one_step"] > 20 * activation                  # the measurement sees the arrays
    assert m["later"] - m["warm"] < 20 * activation, m
    assert m["shifting"] <= m["base"] + 2.5 * m["one_step"], m


@pytest.fixture
def pool_every_size(monkeypatch):
    """The pool's unit tests use small arrays: pool them as if they were large."""
    monkeypatch.setattr(schedule, "MIN_POOLED_BYTES", 0)


def test_small_arrays_are_not_pooled():
    """One generated token's activations are a few hundred bytes: malloc serves them faster than
    the pool's bookkeeping, so they are never kept (MIN_POOLED_BYTES)."""
    from pedestrian.kernels.schedule import MIN_POOLED_BYTES

    ws = Workspace()
    small, = _ask(ws, np.ones(MIN_POOLED_BYTES // 8 - 1))
    large, = _ask(ws, np.ones(MIN_POOLED_BYTES // 8))
    assert len(ws) == 1 and ws.nbytes() == large.nbytes


def _ask(ws, *arrays_like):
    """One 'step' that asks the workspace for arrays shaped like these (as a model does) and
    returns them (the caller decides which to keep)."""
    with ws.active():
        got = [empty_array(a.shape, a) for a in arrays_like]
    return got


def test_an_array_nobody_holds_is_handed_out_again(pool_every_size):
    ws = Workspace()
    like = np.zeros(1)
    a, = _ask(ws, np.ones((4, 5)))
    a_id = id(a)
    del a
    b, = _ask(ws, np.ones((4, 5)))
    assert id(b) == a_id and len(ws) == 1
    c, = _ask(ws, np.ones((4, 5)))                          # b is still held: a second array
    assert c is not b and len(ws) == 2
    assert ws.nbytes() == 2 * 4 * 5 * 8
    with ws.active():
        f32 = empty_array((4, 5), np.zeros(1, dtype=np.float32))
    assert f32.dtype == np.float32 and f32 is not b and f32 is not c      # keyed by dtype too
    assert empty_array((4, 5), like) is not None and len(ws) == 3        # inactive: plain np.empty


@pytest.mark.parametrize("holder", ["variable", "view", "list", "dict", "nested"])
def test_an_array_the_caller_still_holds_is_never_handed_out_again(holder, pool_every_size):
    ws = Workspace()
    a, = _ask(ws, np.ones((3, 4)))
    a[...] = 7.0
    kept = {"variable": lambda: a, "view": lambda: a[1:, ::2], "list": lambda: [a],
            "dict": lambda: {"a": a}, "nested": lambda: ({"x": [a.T]},)}[holder]()
    del a
    for _ in range(3):
        b, = _ask(ws, np.ones((3, 4)))
        b[...] = -1.0                                       # whoever gets an array overwrites it
    flat = kept
    while not isinstance(flat, np.ndarray):
        flat = flat["a"] if isinstance(flat, dict) and "a" in flat else \
            flat[0] if isinstance(flat, (list, tuple)) else flat["x"]
    assert np.all(flat == 7.0), holder


def test_shapes_not_asked_for_in_a_step_are_dropped(pool_every_size):
    ws = Workspace()
    kept = _ask(ws, np.ones(5), np.ones(5), np.ones((2, 2)))
    del kept
    ws.new_step()                                           # (5,) and (2, 2) asked for this step
    assert len(ws) == 3
    _ask(ws, np.ones(5))
    ws.new_step()                                           # only (5,) asked for: (2, 2) dropped
    assert len(ws) == 2
    ws.new_step()                                           # nothing asked for: everything dropped
    assert len(ws) == 0


def test_the_pool_holds_at_most_max_per_shape_arrays_of_one_shape(pool_every_size):
    ws = Workspace()
    kept = _ask(ws, *[np.ones(2)] * (MAX_PER_SHAPE + 5))    # all held at once
    assert len(kept) == MAX_PER_SHAPE + 5 and len({id(a) for a in kept}) == MAX_PER_SHAPE + 5
    assert len(ws) == MAX_PER_SHAPE


def test_a_torch_tensor_keeps_its_pooled_array_in_use(pool_every_size):
    """Torch CPU tensors run the fast kernels through NumPy views, and their results are tensors
    made from the pool's arrays (``torch.from_numpy``): while the caller holds such a tensor its
    array is never handed out again; once it is gone, the array is."""
    torch = pytest.importorskip("torch")
    ws = Workspace()
    x = torch.ones((64, 65), dtype=torch.float64)      # (above schedule.SMALL_ELEMENTS: pooled)
    with ws.active():
        first = fast.add(x, x)
        second = fast.add(x, 2 * x)
    assert len(ws) == 2 and torch.equal(first, 2 * x) and torch.equal(second, 3 * x)
    del first
    with ws.active():
        again = fast.add(x, 3 * x)
    assert len(ws) == 2 and torch.equal(second, 3 * x) and torch.equal(again, 4 * x)


def test_arrays_of_a_kv_cache_step_are_not_overwritten_by_the_next():
    """Generation: each step's logits the caller keeps stay intact while later steps run."""
    from pedestrian.model.kv_cache import KVCache

    model = GPT(CFG, dtype="float64", seed=2)
    cache = KVCache(model, 1)
    kept = []
    for t in range(CFG.context_length):
        logits = model.forward(np.array([[t % CFG.vocab_size]]), kv_cache=cache)
        kept.append((logits, logits.copy()))
    for logits, copy in kept:
        np.testing.assert_array_equal(logits, copy)


@pytest.fixture
def two_threads_for_everything(monkeypatch):
    """Force the numba kernels' threads on for the smallest jobs (normally from 2^15 elements,
    products from 2^18 multiply-adds in blocks of >= 16 rows)."""
    monkeypatch.setattr(schedule, "PARALLEL_MIN_ELEMENTS", 1)
    monkeypatch.setattr(schedule, "SERIAL_BELOW", 1)
    monkeypatch.setattr(schedule, "PARALLEL_MIN_MACS", 1)
    monkeypatch.setattr(schedule, "MIN_PART_ROWS", 1)

    def run(n_threads: int):
        monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", str(n_threads))

    return run


def test_thread_count_does_not_change_any_result(two_threads_for_everything):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 10, 16))
    d = rng.standard_normal((6, 10, 16))
    w, b = rng.standard_normal(16), rng.standard_normal(16)
    qkv = rng.standard_normal((6, 10, 48))
    logits, targets = rng.standard_normal((6, 10, 13)), rng.integers(0, 13, (6, 10))

    def everything():
        y, c = fast.layernorm_forward(x, w, b, 1e-5)
        dw, db = np.zeros(16), np.zeros(16)
        out = [y, fast.layernorm_backward(d, c, dweight=dw, dbias=db), dw, db]
        for name in ("gelu_tanh", "gelu", "relu"):
            a, c = fast.activation_forward(x, name)
            out += [a, fast.activation_backward(d, c, name)]
        o, c = fast.multi_head_attention_forward(qkv, 2, 8, 8)
        out += [o, fast.multi_head_attention_backward(d, c)[0]]
        loss, c = fast.cross_entropy_forward(logits, targets)
        out += [loss, fast.cross_entropy_backward(c)]
        dtok, dpos = np.zeros((13, 16)), np.zeros((10, 16))
        tokens = targets
        out += [fast.embedding_forward(tokens, dtok + w, dpos + b)[0]]
        fast.embedding_backward(d, (tokens, None), dtok=dtok, dpos=dpos)
        out += [dtok, dpos]
        model = GPT(CFG, dtype="float64", seed=3, kernels="fast")
        opt = AdamW(model, lr=0.1, chunk_size=64)
        model.loss(*_batch(9))
        model.backward()
        opt.step()
        return out + [model.flat.copy()]

    two_threads_for_everything(1)
    one = everything()
    two_threads_for_everything(2)
    two, again = everything(), everything()
    for a, b_, c in zip(one, two, again):
        np.testing.assert_array_equal(b_, c)                     # the same threads: the same bits
        scale = max(float(np.max(np.abs(a))), 1e-300)            # float64 sums of <= 60 terms in
        assert float(np.max(np.abs(a - b_))) <= 1e-13 * scale    # another order: ~60 ε64


def test_scatter_add_rows_matches_add_at():
    rng = np.random.default_rng(3)
    for V, N in ((5, 0), (5, 1), (5, 40), (50, 7)):
        target = rng.standard_normal((V, 3))
        index, rows = rng.integers(0, V, N), rng.standard_normal((N, 3))
        expect = target.copy()
        np.add.at(expect, index, rows)
        scatter_add_rows(target, index, rows)
        # the same terms per row in another order: Higham's bound on the absolute terms
        abs_sum = np.abs(target - target)
        np.add.at(abs_sum, index, np.abs(rows))
        n = max(N, 1) + 1
        assert np.all(np.abs(target - expect) <= 2 * n * np.finfo(np.float64).eps * (abs_sum + np.abs(expect)))

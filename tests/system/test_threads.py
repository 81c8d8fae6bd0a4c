"""One pool of threads: numba's, for every kernel of the fast path (issue 23).

The fast kernels share rows, heads and the row blocks of products over numba's threads
(``PEDESTRIAN_NUM_THREADS``), each block of a product one call of a BLAS held to one thread.
What that promises, and what these tests check:

- a step is the same bits every time at a given number of threads; at another it differs only
  by rounding (rows and heads are shared out; a product cut into row blocks may take BLAS's
  small-matrix code, which orders its sums differently; a weight gradient ``xᵀ Δ`` is cut along
  the tokens, one block per thread, the partial sums added in block order);
- each route of such a weight-gradient product (one call, cut along the tokens, row blocks)
  computes the product; a generated token's products run one call of the one-thread BLAS on one
  thread (NumPy's ``@``, whose BLAS threads stay awake between products, on two);
- the BLAS numba calls (SciPy's) runs one thread once a fast kernel has run; NumPy's own BLAS
  keeps its threads (``a @ b`` in a user's code is not slowed down);
- several Python threads may call models at once (numba's threading layer is thread-safe, or,
  where numba fell back to its ``workqueue`` layer, the parallel calls take a lock);
- a bad ``PEDESTRIAN_NUM_THREADS`` is refused with the fix;
- a parallel kernel picks its serial or threaded version from its own job (its first argument's
  size, or its size function), by :mod:`pedestrian.kernels.schedule`'s thresholds; serial in a child
  forked after numba's OpenMP threads started.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pedestrian.config import GPTConfig
from pedestrian.kernels import jit
from pedestrian.model import GPT

CFG = GPTConfig(vocab_size=50, context_length=320, d_model=48, n_heads=3, n_blocks=2, dropout=0.0)

pytestmark = pytest.mark.skipif(not jit.AVAILABLE, reason="numba is not installed")


def _step(dtype: str, B: int, T: int) -> tuple[float, dict]:
    model = GPT(CFG, seed=0, dtype=dtype)
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 50, (B, T)), rng.integers(0, 50, (B, T))
    loss = model.loss(x, y)
    return loss, {k: v.copy() for k, v in model.backward().items()}


@pytest.mark.parametrize("B,T", [(8, 64), (1, 64), (2, 300)], ids=["batch", "one-sequence", "tiled"])
def test_thread_counts_differ_only_by_rounding(B, T, monkeypatch):
    """float64, 1 against 2 threads, relative to the largest entry: sums of at most B·T = 600
    terms in another order differ by a few hundred ε64 of the terms' scale at most (1e-12), and
    the same thread count gives the same bits (float32 too)."""
    runs = {}
    for threads in ("1", "2", "2"):
        monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", threads)
        runs.setdefault(threads, []).append(_step("float64", B, T))
        runs.setdefault(threads + "/32", []).append(_step("float32", B, T))
    for key in ("2", "2/32"):                                   # rerun: the same bits
        (l1, g1), (l2, g2) = runs[key]
        assert l1 == l2 and all(np.array_equal(g, g2[k]) for k, g in g1.items()), key
    (l1, g1), (l2, g2) = runs["1"][0], runs["2"][0]
    assert abs(l1 - l2) <= 1e-12 * abs(l1)
    scale = max(float(np.max(np.abs(g))) for g in g1.values())
    for k, g in g1.items():
        assert float(np.max(np.abs(g - g2[k]))) <= 1e-12 * scale, k


def test_only_the_blas_numba_calls_is_held_to_one_thread():
    """SciPy's BLAS (numba's ``np.dot``) runs one thread once a fast kernel has run; NumPy's keeps
    the thread count it has in a fresh interpreter that imports NumPy alone (the source of the
    expected value: OpenBLAS's own default, or the environment's ``OPENBLAS_NUM_THREADS``)."""
    import subprocess
    import sys

    from threadpoolctl import ThreadpoolController

    fresh = subprocess.run([sys.executable, "-c", "import numpy, threadpoolctl; print(next(i['num_threads'] for i in "
                            "threadpoolctl.threadpool_info() if 'numpy' in i['filepath']))"],
                           capture_output=True, text=True, timeout=120)
    _step("float32", 4, 64)
    blas = ThreadpoolController().select(user_api="blas").lib_controllers
    numpy_blas = [lib for lib in blas if "numpy" in lib.filepath]
    scipy_blas = [lib for lib in blas if "scipy" in lib.filepath and "numpy" not in lib.filepath]
    if not numpy_blas or not scipy_blas or fresh.returncode != 0:
        pytest.skip("NumPy and SciPy share one BLAS library here (not the pip wheels' layout)")
    assert all(lib.num_threads == 1 for lib in scipy_blas)
    assert all(lib.num_threads == int(fresh.stdout) for lib in numpy_blas)


@pytest.mark.parametrize("workqueue", [False, True], ids=["numba's layer", "workqueue lock"])
def test_python_threads_may_call_models_at_once(workqueue, monkeypatch):
    if workqueue:                                          # as where numba fell back to workqueue
        monkeypatch.setattr(jit, "_layer", ["workqueue"])
    want = _step("float64", 4, 64)
    results, errors = [], []

    def worker() -> None:
        try:
            results.append(_step("float64", 4, 64))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 3
    for loss, grads in results:
        assert loss == want[0] and all(np.array_equal(g, want[1][k]) for k, g in grads.items())


def test_bad_thread_count_is_refused(monkeypatch):
    monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", "two")
    with pytest.raises(ValueError, match="PEDESTRIAN_NUM_THREADS must be a positive integer, got 'two'; unset it"):
        jit.num_threads()


def test_bad_thread_count_refuses_a_training_run_before_it_writes_anything(monkeypatch, tmp_path):
    from pedestrian.training.run import train
    from pedestrian.training.settings import TrainSettings
    from pedestrian.training.step import TrainingError

    monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", "0")
    out = tmp_path / "run"
    with pytest.raises(TrainingError, match="PEDESTRIAN_NUM_THREADS must be a positive integer, got '0'"):
        train(TrainSettings(out=str(out), max_steps=1, progress=False, plot=False))
    assert not out.exists()


#: (m, k, n) of a product that takes each route at two threads (MIN_PART_ROWS 16, PARALLEL_MIN_MACS 2^18)
ROUTE_SHAPES = {"one call": (65, 777, 129), "split": (65, 777, 129), "columns": (33, 129, 777),
                "rows": (777, 129, 65), "columns (partials too large)": (65, 777, 129),
                "rows (a transposed a copied in chunks)": (777, 129, 65),
                "split (partials added on the threads)": (200, 900, 190)}    # m·n ≥ PARALLEL_MIN_ELEMENTS


def _operand(rng, rows, cols, layout, dtype):
    """A ``(rows, cols)`` operand stored C-ordered, as the transpose of a C-ordered array (a
    weight gradient's ``xᵀ``, the tied table's ``W_tokᵀ``), or as a band of columns of a wider
    one (a fused region's ``q``)."""
    if layout == "C":
        return rng.standard_normal((rows, cols)).astype(dtype)
    if layout == "transposed":
        return rng.standard_normal((cols, rows)).astype(dtype).T
    return rng.standard_normal((rows, cols + 8)).astype(dtype)[:, 3:3 + cols]


@pytest.mark.parametrize("route", list(ROUTE_SHAPES))
@pytest.mark.parametrize("layouts", [("C", "C"), ("transposed", "C"), ("C", "transposed"), ("band", "band")])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_products_equal_numpy_on_every_route(monkeypatch, route, layouts, bias, dtype):
    """``blas.matmul_into`` cuts a product along its longest side (``blas._route``): the shared
    axis, the output's columns, or its rows, each band one BLAS call on views of the operands
    (``blas.gemm_into``: their strides passed to BLAS, no copy); one call on one thread. Every
    route, with each operand C-ordered, transposed or a band of a wider array, with and without
    a bias (the split route takes none), must be the product; so must a transposed ``a`` copied
    row chunk by row chunk (``schedule.COPY_MIN_STRIDE``). Tolerance: each entry is a sum of
    ``k`` products (and the bias), ``(k + 1)·ε`` of ``Σ|a||b| + |bias|`` bounds any order of
    summation (Higham, ch. 3)."""
    from pedestrian.kernels import blas, schedule

    monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", "1" if route == "one call" else "2")
    if route != "one call" and jit.threads_used() < 2:
        pytest.skip("numba has one thread here (NUMBA_NUM_THREADS)")
    if route == "columns (partials too large)":
        monkeypatch.setattr(schedule, "SPLIT_K_MAX_PARTIAL", 0)
    if route == "rows (a transposed a copied in chunks)":
        monkeypatch.setattr(schedule, "COPY_MIN_STRIDE", 0)          # (the chunk, COPY_ROWS, is compiled in)
    taken = []
    real = blas._route
    monkeypatch.setattr(blas, "_route", lambda *args: taken.append(real(*args)) or taken[-1])
    rng = np.random.default_rng(7)
    m, k, n = ROUTE_SHAPES[route]
    a, b = _operand(rng, m, k, layouts[0], dtype), _operand(rng, k, n, layouts[1], dtype)
    row = rng.standard_normal(n).astype(dtype) if bias else None
    out = np.full((m, n), np.nan, dtype)
    blas.matmul_into(out, a, b, bias=row)
    expected = {"one call": "rows", "split": "columns" if bias else "split",
                "split (partials added on the threads)": "rows" if bias else "split"}.get(route, route.split(" ")[0])
    assert [r for r, _ in taken] == [expected]
    assert taken[0][1] == (1 if route == "one call" else 2)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    exact = a64 @ b64 + (0.0 if row is None else row.astype(np.float64))
    bound = (k + 1) * np.finfo(dtype).eps * (np.abs(a64) @ np.abs(b64) + (0.0 if row is None else np.abs(row)))
    assert np.all(np.abs(out - exact) <= bound)


@pytest.mark.parametrize("shape", [(1, 7, 5), (7, 1, 5), (7, 5, 1), (1, 1, 1), (40, 1, 9000), (9000, 1, 40), (1, 9000, 40)])
@pytest.mark.parametrize("layouts", [("C", "C"), ("transposed", "transposed"), ("band", "transposed"), ("transposed", "band")])
@pytest.mark.parametrize("threads", ["1", "2"])
def test_products_with_an_axis_of_length_one(monkeypatch, shape, layouts, threads):
    """An axis of length 1 may carry any stride (a transposed ``(n, 1)`` array has strides
    ``(8, 8)``): ``blas.gemm_into`` must still hand BLAS a valid layout (a leading dimension at
    least the rows it spans). The first version read such a ``bᵀ`` as row-major with ``ldb = 1``
    and the property test's d_head-1 cases came out wrong by O(1). Bound as above."""
    from pedestrian.kernels import blas

    monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", threads)
    rng = np.random.default_rng(3)
    m, k, n = shape
    a, b = _operand(rng, m, k, layouts[0], np.float64), _operand(rng, k, n, layouts[1], np.float64)
    out = np.full((m, n), np.nan)
    blas.matmul_into(out, a, b)
    bound = (k + 1) * np.finfo(np.float64).eps * (np.abs(a) @ np.abs(b))
    assert np.all(np.abs(out - a @ b) <= bound)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_generated_tokens_products_follow_the_thread_count(monkeypatch, dtype):
    """A few rows times a weight (``blas.few_rows_matmul``, a generated token's products): on one
    thread one call of the one-thread BLAS, not NumPy's ``@`` (whose BLAS keeps its own threads:
    ``PEDESTRIAN_NUM_THREADS=1`` must hold for generation too); on two NumPy's ``@``. Both equal
    the product, a C-contiguous weight and a tied table's transpose, odd and even widths, 1-3 rows,
    2-D or with a batch axis.
    Tolerance: each entry a sum of ``k`` products, ``k·ε`` of ``Σ|x||W|`` (Higham, ch. 3)."""
    from pedestrian.kernels import blas

    taken = []
    one = blas._one_thread_product
    monkeypatch.setattr(blas, "_one_thread_product", lambda *args: (taken.append("one BLAS call"), one(*args)))
    rng = np.random.default_rng(11)
    for threads in ("1", "2"):
        monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", threads)
        if threads == "2" and jit.threads_used() < 2:
            continue                                        # (numba has one thread here)
        for m, k, n in [(1, 577, 578), (2, 576, 1537), (3, 6, 9)]:
            x = rng.standard_normal((m, k)).astype(dtype)
            for w in (rng.standard_normal((k, n)).astype(dtype), rng.standard_normal((n, k)).astype(dtype).T):
                taken.clear()
                y = blas.few_rows_matmul(x, w)
                assert taken == (["one BLAS call"] if threads == "1" else []) and y.shape == (m, n)
                exact = x.astype(np.float64) @ w.astype(np.float64)
                bound = k * np.finfo(dtype).eps * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))
                assert np.all(np.abs(y - exact) <= bound), (threads, m, k, n)
                assert np.array_equal(blas.few_rows_matmul(x[None], w), y[None])      # (B, T, k) as the model calls it


def test_a_model_step_reads_the_thread_count_once_for_its_few_row_products(monkeypatch):
    """Inside a model step (an active workspace) ``few_rows_matmul`` reads the thread count at its
    first product and keeps it until the step's ``new_step``; outside one, at every call."""
    from pedestrian.kernels import blas
    from pedestrian.kernels.workspace import Workspace

    monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", "2")
    if jit.threads_used() < 2:
        pytest.skip("numba has one thread here (NUMBA_NUM_THREADS)")
    taken = []
    one = blas._one_thread_product
    monkeypatch.setattr(blas, "_one_thread_product", lambda *args: (taken.append("one"), one(*args)))
    x, w = np.ones((1, 64)), np.ones((64, 8))
    workspace = Workspace()
    with workspace:
        monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", "1")
        blas.few_rows_matmul(x, w)                          # read: 1 thread
        monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", "2")
        blas.few_rows_matmul(x, w)                          # the same step: still 1
        workspace.new_step()
        blas.few_rows_matmul(x, w)                          # the next step: 2
    monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", "1")
    blas.few_rows_matmul(x, w)                              # no step: read now
    assert taken == ["one", "one", "one"]


def test_a_parallel_kernel_sizes_its_own_job(monkeypatch):
    """Serial under ``SERIAL_BELOW`` elements, one thread under ``PARALLEL_MIN_ELEMENTS``, every
    thread from there -- counted on the first argument (the input), or by the kernel's own size
    function (the attention heads: their scores ``p``); serial in a child forked after OpenMP
    started. (The versions are replaced by recorders: nothing compiles.)"""
    from pedestrian.kernels import activations, attention_loops, schedule

    taken = []
    monkeypatch.setattr(jit, "_layer", ["omp"])
    monkeypatch.setattr(jit, "_use_threads", taken.append)
    monkeypatch.setattr(jit, "CORES", jit.Cores(lambda n: jit._use_threads(n)))     # (none measured yet)
    monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", "2")
    for k in (activations._times, attention_loops.heads_forward):
        monkeypatch.setattr(k, "serial", lambda *args: taken.append("serial"))
        monkeypatch.setattr(k, "parallel", lambda *args: taken.append("parallel"))
    for n in (schedule.SERIAL_BELOW - 1, schedule.SERIAL_BELOW, schedule.PARALLEL_MIN_ELEMENTS):
        activations._times(np.zeros(n), np.zeros(1), np.zeros(3))
    small, large = np.zeros(schedule.SERIAL_BELOW - 1), np.zeros(schedule.PARALLEL_MIN_ELEMENTS)
    attention_loops.heads_forward(large, large, 0.0, 1.0, large, large, large, small, large)   # p decides
    assert taken == ["serial", 1, "parallel", jit.threads_used(), "parallel", "serial"]
    monkeypatch.setattr(jit, "_forked_from_omp", [True])
    taken.clear()
    activations._times(large, large, large)
    assert taken == ["serial"]


_SPIN_CHILD = """
import numpy as np, numba
from pedestrian.config import GPTConfig
from pedestrian.model import GPT
cfg = GPTConfig(vocab_size=50, context_length=64, d_model=32, n_heads=2, n_blocks=2, dropout=0.0)
x = np.random.default_rng(3).integers(0, 50, (8, 64))
GPT(cfg, seed=0).loss(x, x)                 # d_mlp·B·T = 65,536: the MLP's kernels run on the threads
from numba.np.ufunc import omppool
print(numba.threading_layer(), omppool.openmp_vendor)
"""


@pytest.mark.parametrize("policy,spin", [(None, jit.SPIN_ROUNDS), ("ACTIVE", "30000000000")], ids=["default", "yours"])
def test_openmp_threads_spin_briefly_unless_you_say_otherwise(policy, spin):
    """GNU OpenMP reads its wait settings once, when numba loads it; the kernels set
    ``GOMP_SPINCOUNT`` to :data:`jit.SPIN_ROUNDS` for that moment unless you set it or
    ``OMP_WAIT_POLICY``. Read back from OpenMP itself: ``OMP_DISPLAY_ENV`` prints its settings
    when it loads (``GOMP_SPINCOUNT``: the rounds an idle thread spins before it sleeps; 30
    billion for ``ACTIVE``: GCC's libgomp manual)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(OMP_DISPLAY_ENV="VERBOSE", PEDESTRIAN_NUM_THREADS="2", **({"OMP_WAIT_POLICY": policy} if policy else {}))
    child = subprocess.run([sys.executable, "-c", _SPIN_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr
    if child.stdout.split() != ["omp", "GNU"]:
        pytest.skip(f"numba's threads run on {child.stdout.strip()!r} here, not GNU OpenMP")
    assert f"GOMP_SPINCOUNT = '{spin}'" in child.stderr


_IDLE_CHILD = _SPIN_CHILD + """
import time
c0 = time.process_time()
time.sleep(1.0)
print(time.process_time() - c0)
"""


@pytest.mark.parametrize("policy", [None, "ACTIVE"], ids=["default", "spinning forever"])
def test_a_process_idle_between_calls_does_not_burn_a_core(policy):
    """A server that ran a step and waits for the next request: over one second of waiting its
    threads use at most 0.25 CPU seconds -- :data:`jit.SPIN_ROUNDS` rounds of spinning after the
    last region (7.5-8 ms measured on an AMD EPYC; a spin round is a ``pause`` instruction, 10 to
    150 cycles on x86 CPUs, so 300,000 rounds take at most about 45 ms at 1 GHz), then sleep. The
    control: with ``OMP_WAIT_POLICY=ACTIVE`` (30 billion rounds) the idle thread burns most of
    the second, which shows that the measurement sees a spinning thread."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(PEDESTRIAN_NUM_THREADS="2", **({"OMP_WAIT_POLICY": policy} if policy else {}))
    child = subprocess.run([sys.executable, "-c", _IDLE_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr
    layer, vendor, idle_cpu = child.stdout.split()
    if (layer, vendor) != ("omp", "GNU"):
        pytest.skip(f"numba's threads run on {layer!r} / {vendor!r} here, not GNU OpenMP")
    if policy is None:
        assert float(idle_cpu) <= 0.25
    else:
        assert float(idle_cpu) >= 0.5


def test_the_threads_running_a_region_change_no_bit(monkeypatch):
    """How many threads run a region (:class:`jit.Cores`: all, or one where that was faster)
    changes nothing but the time: a step with every region on one thread gives the same bits as
    on all of them -- GPT-2 and Llama layouts, the tiled attention (T = 300), float32 and float64."""
    from pedestrian.config import arch_fields

    monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", "2")
    if jit.threads_used() < 2:
        pytest.skip("numba has one thread here (NUMBA_NUM_THREADS)")
    llama = GPTConfig(vocab_size=50, context_length=320, d_model=48, n_heads=4, n_blocks=2, dropout=0.0,
                      **arch_fields("llama", 48, 4))
    for config in (CFG, llama):
        for dtype, B, T in (("float32", 8, 64), ("float64", 2, 300)):
            runs = []
            for running in (2, 1):
                ran = []

                def run(f, threads, args, running=running, ran=ran):
                    ran.append(running)
                    jit._use_threads(running)
                    return f(*args)

                monkeypatch.setattr(jit.CORES, "run", run)
                model = GPT(config, seed=0, dtype=dtype)
                rng = np.random.default_rng(1)
                x, y = rng.integers(0, 50, (B, T)), rng.integers(0, 50, (B, T))
                runs.append((model.loss(x, y), {k: v.copy() for k, v in model.backward().items()}))
                assert ran, "no region ran on several threads"
            (l1, g1), (l2, g2) = runs
            assert l1 == l2 and all(np.array_equal(g, g2[k]) for k, g in g1.items()), (config.norm, dtype)


def test_the_cores_take_threads_down_and_try_them_again(monkeypatch):
    """The rule of :class:`jit.Cores` on measured windows (the calling thread's CPU time over the
    wall time): a window whose rate is under ``SHARE`` sets the count to the cores it got
    (``int(threads · rate)``, at least 1); all the threads are tried again after ``PROBE_S``, the
    wait doubling after each trial that fails (up to ``PROBE_MAX_S``); a trial fails as soon as
    two regions and ``TRIAL_FAIL_S`` are under ``SHARE``, and passes after a whole window, which
    restores the threads. Regions that overlap another thread's are not counted."""
    from pedestrian.kernels import cores as cores_module

    cores = jit.Cores(lambda n: None)
    clock = [100.0]
    monkeypatch.setattr(cores_module.time, "perf_counter", lambda: clock[0])
    region = cores.WINDOW_S / cores.WINDOW_REGIONS

    def regions_at(rate: float, n: int = cores.WINDOW_REGIONS) -> None:
        for _ in range(n):
            cores._count(2, 2, region, rate * region, clock[0])

    assert cores.threads(2) == 2
    regions_at(0.97)                                           # the cores are there
    assert cores.running is None and cores.threads(2) == 2
    regions_at(0.5)                                            # one core's worth: down to 1
    assert cores.running == 1 and cores.threads(2) == 1
    clock[0] += cores.PROBE_S / 2
    assert cores.threads(2) == 1                               # not yet
    clock[0] += cores.PROBE_S
    assert cores.threads(2) == 2 and cores.trial               # a trial of both threads
    assert region >= cores.TRIAL_FAIL_S
    regions_at(0.6, n=2)                                       # fails after two regions
    assert cores.running == 1 and not cores.trial and cores.wait_s == 4 * cores.PROBE_S
    clock[0] += 1.5 * cores.PROBE_S
    assert cores.threads(2) == 1                               # waits twice as long
    clock[0] += cores.PROBE_S
    assert cores.threads(2) == 2
    regions_at(0.97, n=cores.WINDOW_REGIONS - 1)               # a trial passes only after a window
    assert cores.running == 1 and cores.trial
    regions_at(0.97, n=1)                                      # the machine is free again
    assert cores.running is None and cores.wait_s == cores.PROBE_S
    assert [r for _, r in cores.changes] == [1, None]
    for _ in range(10):                                        # doubling stops at PROBE_MAX_S
        regions_at(0.3)
        clock[0] = cores.next_trial
        assert cores.threads(2) == 2
    assert cores.wait_s == cores.PROBE_MAX_S

    calls = []
    cores = jit.Cores(calls.append)
    monkeypatch.setattr(cores, "_count", lambda *a: calls.append("counted"))
    inner = lambda: cores.run(lambda: calls.append("inner"), 2, ())      # noqa: E731
    cores.run(lambda: inner(), 2, ())                          # a region overlapped by another
    cores.run(lambda: calls.append("alone"), 2, ())
    assert calls == [2, 2, "inner", 2, "alone", "counted"]


_CROWDED_CHILD = """
import os, numpy as np
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})     # two threads on one core
from pedestrian.config import GPTConfig
from pedestrian.model import GPT
from pedestrian.kernels import jit
cfg = GPTConfig(vocab_size=50, context_length=64, d_model=64, n_heads=2, n_blocks=2, dropout=0.0)
x = np.random.default_rng(3).integers(0, 50, (8, 64))
model = GPT(cfg, seed=0)
for _ in range(30):
    model.loss(x, x); model.backward()
print(jit.threads_used(), jit.CORES.running, [r for _, r in jit.CORES.changes])
"""


def test_two_threads_on_one_core_run_on_one():
    """The cores measured, not assumed: a process held to one core (its affinity) with two threads
    asked for gets at most one core's worth of CPU time in its regions, so :class:`jit.Cores`
    runs them on one thread (and a trial of two, if one came, found the same)."""
    import os
    import subprocess
    import sys

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    env = {**os.environ, "PEDESTRIAN_NUM_THREADS": "2", "NUMBA_NUM_THREADS": "2"}
    child = subprocess.run([sys.executable, "-c", _CROWDED_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr
    threads, running, changes = child.stdout.strip().split(" ", 2)
    assert threads == "2" and running == "1" and changes.startswith("[1"), child.stdout

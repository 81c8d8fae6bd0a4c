"""Where users deploy it (issue 31): threads, processes, read-only installs, damaged caches.

- one model shared by several threads (a server's pool): ``generate`` and ``loss`` at once never
  raise, and each thread gets what it gets alone -- the same tokens, the same loss bit for bit
  (the same operations on the same inputs); backward from several threads never raises either,
  each thread's error signals are its own, and a thread holding ``model.lock`` around its
  backward reads its own gradients;
- ``generate`` switches dropout off for its own thread only (``model.training`` is not touched);
- a child forked after the kernels ran (``multiprocessing``'s ``fork``: a Process, a Pool) runs
  them and computes the parent's loss (to rounding: the parent may share rows over threads);
- ``import pedestrian`` imports no numba and writes nothing;
- a read-only package folder and home: ``import pedestrian``, ``pedestrian params`` and the
  reference kernels run, and so do the fast kernels, cached in a private temporary folder after
  one notice;
- a truncated compile-cache file (index or data) is compiled again and replaced, after one line.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import shutil
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import pedestrian
from pedestrian.generation.sampling import Sampling
from pedestrian.config import GPTConfig
from pedestrian.generation.generate import generate
from pedestrian.kernels import jit
from pedestrian.model import GPT

SRC = Path(pedestrian.__file__).resolve().parent.parent

#: d_mlp · B · T = 65,536 elements: the MLP's row kernels take numba's parallel compilation
CFG = GPTConfig(vocab_size=50, context_length=64, d_model=32, n_heads=2, n_blocks=2, dropout=0.0)
RNG = np.random.default_rng(3)
X, Y = RNG.integers(0, 50, (8, 64)), RNG.integers(0, 50, (8, 64))

fast_only = pytest.mark.skipif(not jit.AVAILABLE, reason="numba is not installed")


def _snapshot(grads: dict) -> dict:
    return {k: np.array(v) for k, v in grads.items()}


def test_one_model_serves_four_threads_generating_and_scoring_at_once():
    model = GPT(CFG, seed=0, dtype="float64")
    batches = [(X[i:i + 2], Y[i:i + 2]) for i in range(0, 8, 2)]
    prompts = [X[i:i + 1, :3 + i] for i in range(4)]
    alone_loss = [model.loss(x, y) for x, y in batches]
    alone_tokens = [generate(model, p, 12, Sampling(temperature=0.0)) for p in prompts]

    def job(i: int):
        k = i % 4
        return generate(model, prompts[k], 12, Sampling(temperature=0.0)) if i % 2 else model.loss(*batches[k])

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(job, range(32)))
    for i, got in enumerate(results):
        if i % 2:
            np.testing.assert_array_equal(got, alone_tokens[i % 4])
        else:
            assert got == alone_loss[i % 4], i


def test_threads_training_one_model_get_their_own_signals_and_under_the_lock_their_own_gradients():
    model = GPT(CFG, seed=0, dtype="float64")
    batches = [(X[i:i + 2], Y[i:i + 2]) for i in range(0, 8, 2)]
    alone = []
    for x, y in batches:
        loss = model.loss(x, y)
        grads = _snapshot(model.backward(keep_deltas=True))
        alone.append((loss, grads, model.deltas()["Δ1"].copy()))

    def job(i: int):
        x, y = batches[i % 4]
        loss = model.loss(x, y)
        model.backward(keep_deltas=True)                   # no lock held: must not raise
        d1 = model.deltas()["Δ1"].copy()                   # this thread's own signals
        with model.lock:                                   # the gradients: one set per model
            model.loss(x, y)
            grads = _snapshot(model.backward())
        return loss, grads, d1

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(job, range(16)))
    for i, (loss, grads, d1) in enumerate(results):
        want = alone[i % 4]
        assert loss == want[0]
        np.testing.assert_array_equal(d1, want[2])
        for k, g in grads.items():
            np.testing.assert_array_equal(g, want[1][k], err_msg=k)


def test_generating_in_one_thread_leaves_the_others_in_training_mode():
    """generate runs in eval mode (no dropout) for its own thread only: while it runs, another
    thread's loss still drops out (the model with dropout differs from its eval-mode loss)."""
    import dataclasses
    import threading

    model = GPT(dataclasses.replace(CFG, dropout=0.5), seed=0, dtype="float64")
    x, y = X[:2], Y[:2]
    model.training = False
    eval_loss = model.loss(x, y)
    model.training = True
    started, finish = threading.Event(), threading.Event()

    def pause(ids):                                        # generate waits here, mid-run
        started.set()
        finish.wait(60)

    worker = threading.Thread(target=generate, args=(model, X[:1, :3], 2, Sampling(temperature=0.0)), kwargs=dict(on_token=pause))
    worker.start()
    try:
        assert started.wait(120)
        assert model.training is True
        assert model.loss(x, y) != eval_loss                # dropout applied in this thread
    finally:
        finish.set()
        worker.join(120)
    assert model.training is True


def _child_loss(_=None) -> tuple[float, int]:
    model = GPT(CFG, seed=0, dtype="float64")
    loss = model.loss(X, Y)
    model.backward()
    return loss, jit.threads_used()


def _child_to_pipe(conn) -> None:
    conn.send(_child_loss())
    conn.close()


@fast_only
@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork on this OS")
def test_a_child_forked_after_the_kernels_ran_runs_them():
    """A Process and a Pool of the ``fork`` start method, after the parent ran the kernels
    (their parallel compilations too: numba's threads started). float64, relative to the loss:
    the parent may share rows over 2 threads where the child runs one, sums of at most
    B·T = 512 terms in another order (the bound test_threads.py uses: 1e-12)."""
    want, _ = _child_loss()
    layer = jit._layer[0] if jit._layer else None
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_child_to_pipe, args=(there,))
    child.start()
    child.join(300)
    assert child.exitcode == 0, f"the forked child ended with {child.exitcode} (OpenMP's SIGTERM is -15)"
    got = [here.recv()]
    with ctx.Pool(2) as pool:
        got += pool.map_async(_child_loss, range(2)).get(timeout=300)
    for loss, threads in got:
        assert abs(loss - want) <= 1e-12 * abs(want)
        if layer == "omp":                                 # GNU OpenMP cannot run after fork
            assert threads == 1


def _files(root: Path) -> set:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _package_copy(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    shutil.copytree(SRC / "pedestrian", site / "pedestrian", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "XDG_"))}
    env.pop("PEDESTRIAN_KERNELS", None)
    env.update(PYTHONDONTWRITEBYTECODE="1", PEDESTRIAN_NUM_THREADS="1", **extra)
    return env


def test_import_imports_no_numba_and_writes_nothing(tmp_path):
    site = _package_copy(tmp_path)
    for name in ("home", "cache", "tmp"):
        (tmp_path / name).mkdir()
    code = ("import sys\n"
            "import pedestrian, pedestrian.kernels, pedestrian.model, pedestrian.generation.generate, pedestrian.cli\n"
            "import pedestrian.training.optim\n"
            "from pedestrian.kernels import jit, kernels_for\n"
            "cfg = pedestrian.GPTConfig(vocab_size=11, context_length=8, d_model=8, n_heads=2, n_blocks=1)\n"
            "m = pedestrian.GPT(cfg)\n"
            "print(kernels_for('fast').name, m.kernels_name, len(jit.dispatchers()), 'numba' in sys.modules)\n")
    before = _files(tmp_path)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=_env(PYTHONPATH=str(site), HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp"),
                                NUMBA_CACHE_DIR=str(tmp_path / "cache")))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["fast", "fast", "0", "False"]
    assert _files(tmp_path) == before


def _refuse_writes_to_root() -> None:
    """``preexec_fn``: drop ``CAP_DAC_OVERRIDE`` and ``CAP_DAC_READ_SEARCH`` from the bounding set
    (``prctl(PR_CAPBSET_DROP)``), so that root -- whom permission bits do not stop -- is refused
    writes into read-only folders like everyone else. (Dropping to ``nobody`` instead would not
    do here: the interpreter may live where ``nobody`` cannot read, such as ``/root``.)"""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):                                   # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:            # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


#: a tiny model's loss on the kernels PEDESTRIAN_KERNELS names (the reference, then the fast ones)
READ_ONLY_STEP = """
import sys
import numpy as np
import pedestrian
from pedestrian.config import GPTConfig
from pedestrian.model import GPT
assert 'numba' not in sys.modules
cfg = GPTConfig(vocab_size=11, context_length=8, d_model=8, n_heads=2, n_blocks=1)
tokens = np.arange(16).reshape(2, 8) % 11
print(repr(GPT(cfg, dtype='float64').loss(tokens, (tokens + 1) % 11)))
"""


@fast_only
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="permission bits and prctl as on Linux")
def test_a_read_only_package_and_home_run_with_one_notice(tmp_path):
    site = _package_copy(tmp_path)
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    read_only = [site, *site.rglob("*"), home]
    for path in read_only:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    env = _env(PYTHONPATH=str(site), HOME=str(home), TMPDIR=str(tmp))
    preexec = _refuse_writes_to_root if os.geteuid() == 0 else None

    def run(args, **extra):
        try:
            return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600,
                                  env={**env, **extra}, preexec_fn=preexec)
        except subprocess.SubprocessError as exc:
            pytest.skip(f"cannot make folders read-only for root here: {exc}")

    try:
        params = run(["-m", "pedestrian", "params", "--preset", "char-small"])
        reference = run(["-c", READ_ONLY_STEP], PEDESTRIAN_KERNELS="reference")
        step = run(["-c", READ_ONLY_STEP], PEDESTRIAN_KERNELS="fast")
    finally:
        for path in read_only:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    assert params.returncode == 0 and "total" in params.stdout.lower(), params.stderr
    assert reference.returncode == 0, reference.stderr
    assert step.returncode == 0, step.stderr
    notices = [line for line in step.stderr.splitlines() if "no writable folder" in line]
    assert len(notices) == 1 and notices[0].startswith("pedestrian: ") and "NUMBA_CACHE_DIR" in notices[0], step.stderr
    assert "Traceback" not in step.stderr
    ref, fast = float(reference.stdout), float(step.stdout)
    assert abs(fast - ref) <= 1e-12 * abs(ref)                  # (as tests/paper compare the paths)
    assert not any(p.suffix in (".nbi", ".nbc") for p in site.rglob("*")) and not any(home.iterdir())
    assert any(tmp.rglob("*.nbi")), step.stderr                 # cached in the private folder
    assert not params.stderr and not reference.stderr


ONE_KERNEL = """
import numpy as np
from pedestrian.kernels import layernorm
y, _ = layernorm.layernorm_forward(np.linspace(-1, 1, 24).reshape(3, 8), np.ones(8), np.zeros(8), 1e-5)
print(y.tobytes().hex())
"""


@fast_only
def test_a_truncated_cache_file_is_compiled_again_and_replaced_with_one_line(tmp_path):
    env = _env(PYTHONPATH=str(SRC), NUMBA_CACHE_DIR=str(tmp_path))

    def run():
        r = subprocess.run([sys.executable, "-c", ONE_KERNEL], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        return r

    first = run()
    files = {p.suffix: p for p in tmp_path.rglob("*.nb[ic]")}
    assert set(files) == {".nbi", ".nbc"}, files
    sizes = {k: p.stat().st_size for k, p in files.items()}
    for suffix in (".nbc", ".nbi"):                      # the data file, then the index
        with open(files[suffix], "r+b") as f:
            f.truncate(sizes[suffix] // 2)
        again = run()
        lines = [line for line in again.stderr.splitlines() if "damaged" in line]
        assert len(lines) == 1 and lines[0].startswith("pedestrian: ") and "layernorm" in lines[0], again.stderr
        assert again.stdout == first.stdout                  # the same compiled code, the same bits
        assert files[suffix].stat().st_size > sizes[suffix] // 2           # replaced
    quiet = run()
    assert quiet.stdout == first.stdout and not quiet.stderr      # loaded from the cache again

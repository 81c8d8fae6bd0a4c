"""numba, the compiler of the fast kernels' loops: one decorator, IEEE semantics kept.

Every compiled kernel is ``@kernel`` (a serial loop nest) or ``@kernel(parallel=True)`` (rows
shared over numba's threads with ``prange``). Both are compiled on first use, cached on disk
(``cache=True``: numba's ``__pycache__`` beside this package, or its user-wide cache folder
when the package folder is read-only; ``NUMBA_CACHE_DIR`` overrides), and release the GIL.

Floating point: only the fastmath flags that keep NaN and infinity meaningful -- reassociation,
contraction into fused multiply-adds, reciprocals (:data:`FASTMATH`). Never ``nnan`` / ``ninf``:
a NaN or an inf must propagate to where the training loop catches it. For the same reason
``error_model="numpy"``: ``x / 0`` is ``±inf`` or NaN as in NumPy, not a ``ZeroDivisionError``
(whose check would also stop a loop from vectorising). Sums may therefore be
taken in another order than NumPy's; the tests' tolerances follow from that (n·ε bounds).

The first compile of a process prints one line on stderr (how many kernels, how long); loading
them from the disk cache prints nothing. :func:`dispatchers` lists every compiled kernel (a test
checks that importing pedestrian compiles none).

:data:`AVAILABLE` is False where numba cannot be imported; the model then runs the reference
kernels (:mod:`pedestrian.kernels`).
"""

from __future__ import annotations

import atexit
import functools
import sys
import threading
import time
import types

import os

import numpy as np

try:
    import numba
except ImportError:  # pragma: no cover - exercised by a test that hides numba
    numba = None

__all__ = ["AVAILABLE", "FASTMATH", "kernel", "prange", "dispatchers", "num_threads", "threads_used", "blas_one_thread",
           "PARALLEL_MIN_ELEMENTS"]

#: numba can be imported
AVAILABLE = numba is not None
#: LLVM fast-math flags of every kernel: reassociate, contract (FMA), reciprocal -- no nnan/ninf
FASTMATH = frozenset({"reassoc", "contract", "arcp"})

prange = numba.prange if AVAILABLE else range


_DISPATCHERS: list = []                                # every numba dispatcher made by @kernel


def dispatchers() -> list:
    """The numba dispatchers of every ``@kernel`` (a parallel kernel has two); their
    ``.signatures`` say which have been compiled (or loaded from the disk cache) in this process."""
    return list(_DISPATCHERS)


def _njit(f, parallel: bool):
    d = numba.njit(cache=True, nogil=True, fastmath=set(FASTMATH), parallel=parallel,
                   error_model="numpy")(f)
    _DISPATCHERS.append(d)
    return d


#: the compile notice comes this long after the last compile of the first burst (the kernels of
#: a first step compile one after another, milliseconds of running apart)
NOTICE_AFTER_S = 1.0


if AVAILABLE:
    from numba.core import event as _event

    class _CompileNotice(_event.Listener):
        """Lines on stderr, once per process, when our kernels have to be compiled (a disk-cache
        hit is not a compile): on a terminal, one as the first compile starts (the first step
        waits for it); always, how many and how long, printed :data:`NOTICE_AFTER_S` after the first burst
        of compiles ends (or at exit, whichever comes first). Compiles run under numba's compiler
        lock, one at a time; nested ones (a kernel's callees) count once."""

        def __init__(self) -> None:
            self.depth, self.count, self.seconds, self.start = 0, 0, 0.0, 0.0
            self.done, self.timer, self.lock, self.started = False, None, threading.Lock(), False

        def on_start(self, event) -> None:
            if self.depth == 0:
                self.start = time.perf_counter()
                if self.timer is not None:
                    self.timer.cancel()
                if not self.started and event.data["dispatcher"] in _DISPATCHERS and sys.stderr.isatty():
                    self.started = True                      # (for a person watching a terminal)
                    print("pedestrian: compiling the fast kernels with numba (first use only; up to a "
                          "minute)", file=sys.stderr, flush=True)
            self.depth += 1

        def on_end(self, event) -> None:
            self.depth -= 1
            if self.depth == 0 and event.data["dispatcher"] in _DISPATCHERS and not self.done:
                self.count += 1
                self.seconds += time.perf_counter() - self.start
                self.timer = threading.Timer(NOTICE_AFTER_S, self.say)
                self.timer.daemon = True
                self.timer.start()

        def say(self) -> None:
            with self.lock:
                if self.done or not self.count:
                    return
                self.done = True
            where = numba.config.CACHE_DIR or "beside the package, or numba's user-wide cache folder"
            kernels = "1 fast kernel" if self.count == 1 else f"{self.count} fast kernels"
            print(f"pedestrian: compiled {kernels} with numba in {self.seconds:.1f} s "
                  f"(first use; cached for later runs: {where})", file=sys.stderr, flush=True)

    _notice = _CompileNotice()
    _event.register("numba:compile", _notice)
    atexit.register(_notice.say)


_cores: list = []                                      # the usable cores, read once per process
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_cores.clear)


def num_threads() -> int:
    """Threads of the fast kernels (numba's ``prange`` loops, and the products they share out):
    ``PEDESTRIAN_NUM_THREADS``, or the usable cores (the process's CPU affinity, read on first
    use and again in a forked child).

    Raises:
        ValueError: ``PEDESTRIAN_NUM_THREADS`` is not a positive integer.
    """
    value = os.environ.get("PEDESTRIAN_NUM_THREADS")
    if value is None:
        if not _cores:                                  # (a step asks ~150 times; the call costs 4 µs)
            try:
                _cores.append(max(1, len(os.sched_getaffinity(0))))
            except AttributeError:  # pragma: no cover - not Linux
                _cores.append(max(1, os.cpu_count() or 1))
        return _cores[0]
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"PEDESTRIAN_NUM_THREADS must be a positive integer, got {value!r}; "
                         "unset it to use every available core")
    return int(value)


def threads_used() -> int:
    """The threads a parallel kernel runs on: :func:`num_threads`, at most numba's own limit
    (``NUMBA_NUM_THREADS``, by default the machine's cores); 1 without numba."""
    return max(1, min(num_threads(), numba.config.NUMBA_NUM_THREADS)) if AVAILABLE else 1


_blas_held: list = []                                  # the pid for which the BLAS was held


def blas_one_thread() -> None:
    """Hold the BLAS library that numba's ``np.dot`` calls (SciPy's, through
    ``scipy.linalg.cython_blas``) to one thread, once per process.

    The fast kernels share a product over numba's threads themselves (row blocks, or one head
    per iteration), each block one single-threaded BLAS call: one pool of threads for all the
    work. A BLAS with threads of its own would compete with numba's for the cores (on 2 cores,
    OpenBLAS's and OpenMP's idle threads spinning side by side made a product 5.6x and a row
    kernel 33x slower: docs/kernels.md, "One pool of threads"). NumPy's own BLAS (``a @ b`` in
    your code) keeps its threads; where NumPy and SciPy share one BLAS library (some conda
    builds) it is held too. Uses ``threadpoolctl``.
    """
    if _blas_held and _blas_held[0] == os.getpid():
        return
    import scipy.linalg.cython_blas  # noqa: F401  (loads the library numba calls)
    from threadpoolctl import ThreadpoolController

    site = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(scipy.linalg.cython_blas.__file__))))
    blas = ThreadpoolController().select(user_api="blas").lib_controllers
    own = [lib for lib in blas if os.path.abspath(lib.filepath).startswith(os.path.join(site, "scipy"))]
    for lib in own or blas:                  # SciPy's own copy (pip wheels), else the shared one
        lib.set_num_threads(1)
    _blas_held[:] = [os.getpid()]


#: a ``prange`` job of fewer elements runs on one thread (a parallel region costs ~3-5 µs to
#: start and join: docs/kernels.md)
PARALLEL_MIN_ELEMENTS = 1 << 15
#: :meth:`_Parallel.sized`: smaller jobs run the serial compilation (2.2 against 4.3 µs for a
#: layer norm of one 768-wide row: one generated token)
SERIAL_BELOW = 1 << 12

_threads_now = threading.local()
_workqueue_lock = threading.Lock()


def _use_threads(n: int) -> None:
    """``numba.set_num_threads(n)`` for the calling thread, only when it changes (~3 µs a call)."""
    if getattr(_threads_now, "n", None) != n:
        numba.set_num_threads(n)
        _threads_now.n = n


class _Parallel:
    """A ``prange`` kernel, compiled twice: the parallel version on ``num_threads()`` threads, and
    a serial one for jobs too small for a parallel region (:meth:`sized`).

    numba's threading layer: its default choice (``tbb``, then ``omp``, then ``workqueue``).
    ``workqueue`` must not be entered by two Python threads at once, so where numba fell back to
    it, parallel calls take a lock (threads of your own calling one model at once then wait for
    each other instead of crashing the process)."""

    def __init__(self, f):
        serial = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
        serial.__qualname__ = f.__qualname__ + "__serial"          # its own entry in the disk cache
        self.serial, self.parallel = _njit(serial, False), _njit(f, True)
        functools.update_wrapper(self, f)

    def __call__(self, *args):
        return self.sized(PARALLEL_MIN_ELEMENTS)(*args)

    def sized(self, n_elements: int):
        """The version for a job of ``n_elements``: the serial one under :data:`SERIAL_BELOW`,
        else the parallel one, on ``num_threads()`` threads from :data:`PARALLEL_MIN_ELEMENTS`
        and on one below (the same compiled loops whatever the thread count, so the same bits)."""
        if n_elements < SERIAL_BELOW:
            return self.serial
        _use_threads(threads_used() if n_elements >= PARALLEL_MIN_ELEMENTS else 1)
        return _locked(self.parallel) if _layer_is_workqueue() else self.parallel


_layer: list = []


def _layer_is_workqueue() -> bool:
    if not _layer:
        _start_threads()
        _layer.append(numba.threading_layer())
    return _layer[0] == "workqueue"


@numba.njit(parallel=True, cache=True) if AVAILABLE else (lambda f: f)
def _touch(a):
    for i in numba.prange(a.shape[0]):
        a[i] = i


def _start_threads() -> None:
    """Start numba's threads (its first parallel call) with OpenMP's idle threads waiting
    passively -- ``OMP_WAIT_POLICY=PASSIVE`` for this one start, unless set by you: OpenMP
    reads it once, when numba loads it. By default GNU OpenMP's idle threads spin; on a machine
    whose cores are busy with other work a spinning thread holds a core the others need, and
    every parallel region then waits for a time slice (measured: docs/kernels.md, "One pool of
    threads"). The environment is restored at once (a PyTorch imported later keeps its own)."""
    ours = "OMP_WAIT_POLICY" not in os.environ
    if ours:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        _touch(np.zeros(2))
    finally:
        if ours:
            del os.environ["OMP_WAIT_POLICY"]


def _locked(f):
    def call(*args):
        with _workqueue_lock:
            return f(*args)
    return call


def kernel(func=None, *, parallel: bool = False):
    """``@kernel`` / ``@kernel(parallel=True)``: ``numba.njit`` with :data:`FASTMATH`, the disk
    cache and no GIL; ``parallel`` kernels share their ``prange`` loops over
    :func:`num_threads` threads (:class:`_Parallel`; call them from Python --
    ``kernel.sized(n)(...)`` picks the threads for a job of ``n`` elements -- not from another
    kernel: use ``.serial`` there).
    Without numba the function is returned as it is (plain Python)."""
    def wrap(f):
        if not AVAILABLE:                             # plain Python, the same attributes
            f.serial = f.parallel = f
            f.sized = lambda n_elements: f
            return f
        return _Parallel(f) if parallel else _njit(f, False)

    return wrap if func is None else wrap(func)

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

from .threads import is_worker_thread, num_threads, threads_pay

try:
    import numba
except ImportError:  # pragma: no cover - exercised by a test that hides numba
    numba = None

__all__ = ["AVAILABLE", "FASTMATH", "kernel", "prange", "dispatchers"]

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
        """One line on stderr, once per process, when our kernels had to be compiled (a disk-cache
        hit is not a compile): how many and how long, printed :data:`NOTICE_AFTER_S` after the
        first burst of compiles ends (or at exit, whichever comes first). Compiles run under
        numba's compiler lock, one at a time; nested ones (a kernel's callees) count once."""

        def __init__(self) -> None:
            self.depth, self.count, self.seconds, self.start = 0, 0, 0.0, 0.0
            self.done, self.timer, self.lock = False, None, threading.Lock()

        def on_start(self, event) -> None:
            if self.depth == 0:
                self.start = time.perf_counter()
                if self.timer is not None:
                    self.timer.cancel()
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


class _SerialOrParallel:
    """A ``prange`` kernel compiled twice: the parallel version on the calling thread, the
    serial one inside a worker thread (:func:`pedestrian.kernels.threads.is_worker_thread`: a
    :class:`~pedestrian.training.parallel.DataParallel` slice already has a core of its own, and numba's
    default threading layer must not be entered by two Python threads at once)."""

    def __init__(self, f):
        serial = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
        serial.__qualname__ = f.__qualname__ + "__serial"          # its own entry in the disk cache
        self.serial, self.parallel = _njit(serial, False), _njit(f, True)
        functools.update_wrapper(self, f)

    def __call__(self, *args):
        if is_worker_thread():
            return self.serial(*args)
        _use_threads(_team_size())
        return self.parallel(*args)

    def sized(self, n_elements: int):
        """The version for a job of ``n_elements``. Outside a worker thread the parallel one, on
        numba's threads where a second thread pays (:func:`~pedestrian.kernels.threads.threads_pay`),
        else on one: the same compiled loops whatever the thread count, so the same bits (the
        serial compilation may vectorise a row's sum differently). A job under
        :data:`SERIAL_BELOW` elements (one generated token) runs the serial version: a parallel
        region costs a few microseconds more, whatever its threads."""
        if n_elements < SERIAL_BELOW or is_worker_thread():
            return self.serial
        _use_threads(_team_size() if threads_pay(n_elements) else 1)
        return self.parallel


#: :meth:`_SerialOrParallel.sized`: smaller jobs run the serial version (2.2 against 4.3 µs for a
#: layer norm of one 768-wide row)
SERIAL_BELOW = 1 << 12

_threads_now = threading.local()


def _team_size() -> int:
    return max(1, min(num_threads(), numba.config.NUMBA_NUM_THREADS))


def _use_threads(n: int) -> None:
    """``numba.set_num_threads(n)`` for the calling thread, only when it changes (~3 µs a call)."""
    if getattr(_threads_now, "n", None) != n:
        numba.set_num_threads(n)
        _threads_now.n = n


def kernel(func=None, *, parallel: bool = False):
    """``@kernel`` / ``@kernel(parallel=True)``: ``numba.njit`` with :data:`FASTMATH`, the disk
    cache and no GIL; ``parallel`` kernels share their ``prange`` loops over
    ``PEDESTRIAN_NUM_THREADS`` threads, or run serially inside a worker thread
    (:class:`_SerialOrParallel`; call them from Python -- ``kernel.sized(n)(...)`` picks the
    threads for a job of ``n`` elements -- not from another kernel: use ``.serial`` there).
    Without numba the function is returned as it is (plain Python)."""
    def wrap(f):
        if not AVAILABLE:                             # plain Python, the same attributes
            f.serial = f.parallel = f
            f.sized = lambda n_elements: f
            return f
        return _SerialOrParallel(f) if parallel else _njit(f, False)

    return wrap if func is None else wrap(func)

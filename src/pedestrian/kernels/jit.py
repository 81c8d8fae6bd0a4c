"""numba, the compiler of the fast kernels' loops: one decorator, IEEE semantics kept, loaded at
the first kernel call.

Every compiled kernel is ``@kernel`` (a serial loop nest) or ``@kernel(parallel=True)`` (rows
shared over numba's threads with ``prange``). Importing them imports no numba and compiles and
writes nothing: a kernel's numba dispatcher is made at its first call (numba is imported then),
compiled for its argument types on first use, and releases the GIL.

Floating point: only the fastmath flags that keep NaN and infinity meaningful -- reassociation,
contraction into fused multiply-adds, reciprocals (:data:`FASTMATH`). Never ``nnan`` / ``ninf``:
a NaN or an inf must propagate to where the training loop catches it. For the same reason
``error_model="numpy"``: ``x / 0`` is ``±inf`` or NaN as in NumPy, not a ``ZeroDivisionError``
(whose check would also stop a loop from vectorising). Sums may therefore be
taken in another order than NumPy's; the tests' tolerances follow from that (n·ε bounds). A kernel
marked ``exact`` gets no fast-math flag at all and rounds as NumPy does.

**The disk cache**, chosen when a kernel's dispatcher is made (not at import): numba's own --
``NUMBA_CACHE_DIR`` if set, else ``__pycache__`` beside this package, else numba's user-wide
cache folder. Where none of them is writable (a read-only install and home), a private folder
``pedestrian-numba-<uid>`` in the temporary directory, else no disk cache, after one notice on
stderr. A cache entry that cannot be loaded (a file truncated by a full disk or a killed
process) is compiled again and replaced, after one line on stderr.

The first compile of a process prints one line on stderr (how many kernels, how long); loading
them from the disk cache prints nothing. :func:`dispatchers` lists the dispatchers made so far.

**Threads.** Kernels may be called from several Python threads at once (numba's ``tbb`` and
``omp`` layers are thread-safe; where numba fell back to ``workqueue``, parallel calls take a
lock). Between regions an idle OpenMP thread spins a few milliseconds, then sleeps
(:data:`SPIN_ROUNDS`); where other processes hold the cores, :data:`CORES` runs the regions on
fewer threads (the same bits). **Processes.** GNU OpenMP (numba's ``omp`` layer, the usual one on Linux) cannot run in a
child forked after it started: numba stops such a child with SIGTERM. In a child forked after
numba's threads started on ``omp``, every kernel therefore runs its serial compilation
(:func:`threads_used` is 1); a child started by ``spawn`` or ``forkserver`` has its own threads.

:data:`AVAILABLE` is False where numba is not installed; the model then runs the reference
kernels (:mod:`pedestrian.kernels`).
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import stat
import sys
import tempfile
import threading
import time
import types

import numpy as np

from . import schedule
from .cores import Cores

__all__ = ["AVAILABLE", "CORES", "FASTMATH", "kernel", "prange", "dispatchers", "num_threads", "threads_used",
           "blas_one_thread"]

#: numba is installed (found, not imported: that happens at the first kernel call)
AVAILABLE = importlib.util.find_spec("numba") is not None
#: LLVM fast-math flags of every kernel: reassociate, contract (FMA), reciprocal -- no nnan/ninf
FASTMATH = frozenset({"reassoc", "contract", "arcp"})

#: ``range`` until numba is loaded; a kernel module's ``prange`` becomes numba's when its first
#: kernel is made (:func:`_make`), so that ``parallel=True`` shares those loops out
prange = range

_LOCK = threading.RLock()                              # loading numba, making dispatchers (no compile)
_loaded: list = []                                     # [numba] once imported
_DISPATCHERS: list = []                                # every numba dispatcher made so far
_fallback: dict = {}                                   # "folder": the fallback cache folder (None: none)


def dispatchers() -> list:
    """The numba dispatchers made so far (one per ``@kernel`` called, two for a parallel kernel
    run both ways); their ``.signatures`` say which have been compiled (or loaded from the disk
    cache) in this process."""
    return list(_DISPATCHERS)


class _CompileNotice:
    """Lines on stderr, once per process, when our kernels have to be compiled (a disk-cache
    hit is not a compile): on a terminal, one as the first compile starts (the first step
    waits for it); always, how many and how long, printed :data:`NOTICE_AFTER_S` after the first burst
    of compiles ends (or at exit, whichever comes first). Compiles run under numba's compiler
    lock, one at a time; nested ones (a kernel's callees) count once. (Listens to numba's
    ``numba:compile`` events from the first kernel call on.)"""

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
        where = _fallback.get("folder") or os.environ.get("NUMBA_CACHE_DIR") or \
            "beside the package, or numba's user-wide cache folder"
        cached = f"cached for later runs: {where}" if _fallback.get("folder", "") is not None else "not cached"
        kernels = "1 fast kernel" if self.count == 1 else f"{self.count} fast kernels"
        print(f"pedestrian: compiled {kernels} with numba in {self.seconds:.1f} s "
              f"(first use; {cached})", file=sys.stderr, flush=True)


#: the compile notice comes this long after the last compile of the first burst (the kernels of
#: a first step compile one after another, milliseconds of running apart)
NOTICE_AFTER_S = 1.0


def _numba():
    """numba, imported at the first kernel call: :mod:`.vecmath`'s overloads registered and the
    compile notice listening before anything compiles."""
    if not _loaded:
        with _LOCK:
            if not _loaded:
                import numba
                from numba.core import event

                from . import vecmath

                vecmath.register_overloads()

                class Notice(_CompileNotice, event.Listener):
                    pass

                notice = Notice()
                event.register("numba:compile", notice)
                atexit.register(notice.say)
                _loaded.append(numba)
    return _loaded[0]


def _make(f, parallel: bool, exact: bool = False):
    """The numba dispatcher of ``f`` (nothing compiled yet), cached on disk where numba finds a
    writable folder, else in :func:`_fallback_folder`; its damaged cache entries are compiled again.
    ``exact``: no fast-math flags at all (every product and sum rounded as NumPy rounds it)."""
    numba = _numba()
    if f.__globals__.get("prange") is range:           # the kernel module's `prange`: numba's
        f.__globals__["prange"] = numba.prange
    njit = functools.partial(numba.njit, nogil=True, fastmath=set() if exact else set(FASTMATH), parallel=parallel,
                             error_model="numpy")
    try:
        d = njit(cache=True)(f)                       # NUMBA_CACHE_DIR, __pycache__, user-wide folder
    except RuntimeError as exc:                        # "cannot cache function ...: no locator available"
        if "cannot cache" not in str(exc):
            raise
        d = _in_fallback_folder(njit, f)
    _recompile_damaged_entries(d)
    _DISPATCHERS.append(d)
    return d


def _in_fallback_folder(njit, f):
    """``njit(f)`` cached in :func:`_fallback_folder` (numba reads ``CACHE_DIR`` when the
    dispatcher is made), else not cached on disk."""
    folder = _fallback_folder()
    if folder is not None:
        config = _numba().config
        saved, config.CACHE_DIR = config.CACHE_DIR, folder
        try:
            return njit(cache=True)(f)
        except RuntimeError:                            # not writable either (a read-only file system)
            pass
        finally:
            config.CACHE_DIR = saved
    return njit(cache=False)(f)


def _fallback_folder() -> str | None:
    """Where the kernels are cached when numba finds no writable folder: ``pedestrian-numba-<uid>``
    in the temporary directory, private to this user (a folder others could write would let
    them plant compiled code), else ``None`` (no disk cache). Chosen once, with one notice."""
    if "folder" not in _fallback:
        folder = None
        if hasattr(os, "getuid"):                       # (POSIX: a folder only this user can write)
            folder = os.path.join(tempfile.gettempdir(), f"pedestrian-numba-{os.getuid()}")
            try:
                os.makedirs(folder, mode=0o700, exist_ok=True)
                st = os.lstat(folder)
                private = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077
            except OSError:
                private = False
            folder = folder if private else None
        _fallback["folder"] = folder
        where = f"in {folder}" if folder else "nowhere (each process compiles them again)"
        print(f"pedestrian: no writable folder for numba's compile cache (NUMBA_CACHE_DIR, beside the "
              f"package, numba's user-wide folder), so the compiled kernels are cached {where}; set "
              f"NUMBA_CACHE_DIR to a writable folder to keep them", file=sys.stderr, flush=True)
    return _fallback["folder"]


def _recompile_damaged_entries(dispatcher) -> None:
    """A disk-cache entry of ``dispatcher`` that cannot be loaded (a truncated ``.nbi`` index or
    ``.nbc`` data file: numba would raise on every later run) is dropped -- the function's index
    emptied -- after one line on stderr; numba then compiles it and saves it again. Only
    loading is guarded: typing and compile errors surface as they are."""
    cache = dispatcher._cache                          # numba's FunctionCache (or NullCache)
    load = cache.load_overload

    def load_or_drop(sig, target_context):
        try:
            return load(sig, target_context)
        except Exception as exc:  # noqa: BLE001 - any failure to read an entry means: compile it again
            reason = (str(exc).splitlines() or [""])[0]
            name = f"{dispatcher.py_func.__module__}.{dispatcher.py_func.__qualname__}"
            print(f"pedestrian: a damaged compile-cache entry of {name} was dropped ({type(exc).__name__}: "
                  f"{reason}); compiling it again and replacing it in {getattr(cache, 'cache_path', '?')}",
                  file=sys.stderr, flush=True)
            try:
                cache.flush()
            except OSError:
                pass
            return None

    cache.load_overload = load_or_drop


class _Kernel:
    """One ``@kernel``: calls the numba dispatcher of ``py_func``, made at the first call."""

    def __init__(self, f, parallel: bool = False, exact: bool = False) -> None:
        self.py_func, self._parallel, self._exact, self._dispatcher = f, parallel, exact, None
        functools.update_wrapper(self, f)

    def dispatcher(self):
        """The numba dispatcher (made now if it is not yet: numba is imported, nothing compiled)."""
        if self._dispatcher is None:
            with _LOCK:
                if self._dispatcher is None:
                    self._dispatcher = _make(self.py_func, self._parallel, self._exact)
        return self._dispatcher

    def __call__(self, *args):
        d = self._dispatcher
        return (d if d is not None else self.dispatcher())(*args)

    @property
    def signatures(self) -> list:
        """The argument types compiled (or loaded from the disk cache) in this process so far."""
        return [] if self._dispatcher is None else self._dispatcher.signatures

    @property
    def _numba_type_(self):
        """What numba's ``typeof`` sees where another kernel calls this one: the dispatcher."""
        from numba.core import types as numba_types

        return numba_types.Dispatcher(self.dispatcher())


_cores: list = []                                      # the usable cores, read once per process
_forked_from_omp: list = []                            # [True] in a child forked after OpenMP started


def _after_fork_in_child() -> None:
    """In a forked child: read the cores again; if numba's threads ran on OpenMP in the parent,
    run every kernel's serial compilation here (GNU OpenMP cannot run in a forked child)."""
    _cores.clear()
    numba = sys.modules.get("numba")
    if numba is not None and not _forked_from_omp:
        try:
            if numba.threading_layer() == "omp":
                _forked_from_omp.append(True)
        except ValueError:                             # numba's threads never started
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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
    (``NUMBA_NUM_THREADS``, by default the machine's cores); 1 without numba, and 1 in a child
    forked after numba's OpenMP threads started (the serial compilations run there)."""
    if not AVAILABLE or _forked_from_omp:
        num_threads()                                   # (a bad PEDESTRIAN_NUM_THREADS is still refused)
        return 1
    return max(1, min(num_threads(), _numba().config.NUMBA_NUM_THREADS))


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


_threads_now = threading.local()
_workqueue_lock = threading.Lock()


def _use_threads(n: int) -> None:
    """``numba.set_num_threads(n)`` for the calling thread, only when it changes (~3 µs a call)."""
    if getattr(_threads_now, "n", None) != n:
        _numba().set_num_threads(n)
        _threads_now.n = n


def _first_size(first, *rest) -> int:
    """A parallel kernel's job by default: its first argument's size (each kernel takes its
    input, the largest array, first)."""
    return first.size                  # (a scan of every argument cost 3-5x a call's dispatch)


class _Parallel:
    """A ``prange`` kernel, compiled twice: the parallel version, and a serial one. Each call
    picks by the job's size ``size(*args)`` (:func:`_first_size` unless the kernel says
    otherwise): the serial one under :data:`.schedule.SERIAL_BELOW` (and always in a child forked
    after numba's OpenMP threads started), else the parallel one, on ``threads_used()`` threads
    from :data:`.schedule.PARALLEL_MIN_ELEMENTS` and on one below (the same compiled loops
    whatever the thread count, so the same bits). Of those threads, as many run the region as
    the cores give it (:data:`CORES`): the work's partition is unchanged, so the bits too.

    numba's threading layer: its default choice (``tbb``, then ``omp``, then ``workqueue``).
    ``workqueue`` must not be entered by two Python threads at once, so where numba fell back to
    it, parallel calls take a lock (threads of your own calling one model at once then wait for
    each other instead of crashing the process)."""

    def __init__(self, f, size=None, exact: bool = False):
        serial = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
        serial.__qualname__ = f.__qualname__ + "__serial"          # its own entry in the disk cache
        self.serial, self.parallel = _Kernel(serial, exact=exact), _Kernel(f, parallel=True, exact=exact)
        self.size = size or _first_size
        functools.update_wrapper(self, f)

    def __call__(self, *args):
        n = self.size(*args)
        if n < schedule.SERIAL_BELOW or _forked_from_omp:
            return self.serial(*args)
        workqueue = _layer_is_workqueue()    # (first: numba.set_num_threads would start the threads)
        threads = threads_used() if n >= schedule.PARALLEL_MIN_ELEMENTS else 1
        if workqueue or threads == 1:
            _use_threads(threads)
            return (_locked(self.parallel) if workqueue else self.parallel)(*args)
        return CORES.run(self.parallel, threads, args)


_layer: list = []
_start_lock = threading.Lock()          # (not _LOCK: a kernel compiling elsewhere may need that one)


def _layer_is_workqueue() -> bool:
    if not _layer:
        with _start_lock:
            if not _layer:
                _start_threads()
                _layer.append(_numba().threading_layer())
    return _layer[0] == "workqueue"


def _touch_loop(a):
    for i in prange(a.shape[0]):
        a[i] = i


_touch = _Kernel(_touch_loop, parallel=True)


#: GNU OpenMP's rounds of spinning before an idle thread sleeps, set for the moment numba loads
#: OpenMP unless you set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``: GNU's own default (libgomp
#: manual, GOMP_SPINCOUNT), 7.5-8 ms on an AMD EPYC, so a thread is still awake for the next
#: region of a step (char-small, 2 idle cores: 31-33 against 37-44 ms a step sleeping after each
#: region) and asleep soon after a call (a server between requests: docs/guide.md, "A shared
#: machine"). On a busy machine :data:`CORES` takes the threads down instead.
SPIN_ROUNDS = "300000"


def _start_threads() -> None:
    """Start numba's threads (its first parallel call) with OpenMP's idle threads spinning
    :data:`SPIN_ROUNDS` rounds after a region, then sleeping -- ``GOMP_SPINCOUNT`` for this one
    start, unless you set it or ``OMP_WAIT_POLICY``: OpenMP reads it once, when numba loads it,
    so this must run before anything else starts the threads (``numba.set_num_threads`` does).
    The environment is restored at once (a PyTorch imported later keeps its own)."""
    ours = "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ
    if ours:
        os.environ["GOMP_SPINCOUNT"] = SPIN_ROUNDS
    try:
        _touch(np.zeros(2))
    finally:
        if ours:
            del os.environ["GOMP_SPINCOUNT"]


#: the process's :class:`Cores` (one for every model and Python thread: the cores are shared)
CORES = Cores(lambda n: _use_threads(n))


def _locked(f):
    def call(*args):
        with _workqueue_lock:
            return f(*args)
    return call


def kernel(func=None, *, parallel: bool = False, size=None, exact: bool = False):
    """``@kernel`` / ``@kernel(parallel=True, size=...)``: ``numba.njit`` with :data:`FASTMATH`,
    the disk cache and no GIL, made at the first call; ``parallel`` kernels share their ``prange``
    loops over :func:`num_threads` threads, serial or threaded by the job's size -- ``size(*args)``,
    in elements (multiply-adds for a product), by default the first argument's size
    (:class:`_Parallel`). Call them from Python, not from another kernel: use ``.serial`` there.
    A kernel may call another ``@kernel`` (not parallel). ``exact=True``: no fast-math flags (no
    fused multiply-adds: a kernel that must give NumPy's bits). Without numba the function is
    returned as it is (plain Python)."""
    def wrap(f):
        if not AVAILABLE:                             # plain Python, the same attributes
            f.serial = f.parallel = f
            return f
        return _Parallel(f, size, exact) if parallel else _Kernel(f, exact=exact)

    return wrap if func is None else wrap(func)

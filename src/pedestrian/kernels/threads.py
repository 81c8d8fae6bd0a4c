"""Threads for the fast kernels: a small pool for NumPy's elementwise work, and BLAS throttling.

NumPy's elementwise functions are single-threaded but release the GIL, so a kernel that works
row block by row block (:func:`for_row_blocks`) can share its blocks over a few threads.
PyTorch threads each of its own operations, so there the kernel runs as one call.
:func:`single_threaded_blas` holds the BLAS library (and torch) to one thread while a caller
runs its own threads (:class:`pedestrian.training.parallel.DataParallel`).

Bookkeeping only; no formula lives here.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

from ..backend import is_numpy_array

__all__ = ["num_threads", "single_threaded_blas", "in_worker_thread", "is_worker_thread", "get_pool",
           "for_row_blocks", "run_units", "threads_pay", "product_parts", "OwnCores", "BLOCK_ELEMENTS", "PRODUCT_MIN_ROWS"]

#: elements per block. Measured (2-core AMD EPYC, NumPy 2.4): 2^15 (L2-sized blocks) is 10-25%
#: slower than 2^17 - 2^19 for GELU and layer norm -- per-call overhead outweighs L2 misses
#: (the 32 MiB L3 holds the blocks); still small enough to bound the kernels' temporaries.
BLOCK_ELEMENTS = 1 << 18
#: below this many elements a job runs on the calling thread only. Measured on 2 cores: right
#: after a matrix product, OpenBLAS's worker thread busy-waits for ~0.1 s (2^28 cycles,
#: OPENBLAS_THREAD_TIMEOUT), so a second Python thread waits ~1 ms (median; 4 ms p90) before it
#: gets a core -- longer than a GELU or a layer norm of a small model takes on one thread. Only
#: jobs of several milliseconds (the optimizer, gpt2's logits) gain from the second thread.
PARALLEL_MIN_ELEMENTS = 1 << 22
#: the same threshold while :func:`single_threaded_blas` is active: no BLAS worker is spinning,
#: so a second thread starts at once and jobs from a fraction of a millisecond gain from it
QUIET_PARALLEL_MIN_ELEMENTS = 1 << 17
#: :func:`product_parts`: a matrix product is cut only if every part keeps this many rows
PRODUCT_MIN_ROWS = 64

_pool: ThreadPoolExecutor | None = None
_pool_owner: tuple[int, int] | None = None        # (pid, threads): a forked child makes its own
_in_worker = threading.local()
_quiet_blas = 0                                    # depth of active single_threaded_blas() contexts
_blas_controller = None                            # threadpoolctl controller, made on first use


def num_threads() -> int:
    """Threads for NumPy elementwise work: ``PEDESTRIAN_NUM_THREADS`` or the usable cores.

    (Matrix products are threaded by the BLAS library itself, e.g. ``OPENBLAS_NUM_THREADS``.)

    Raises:
        ValueError: ``PEDESTRIAN_NUM_THREADS`` is not a positive integer.
    """
    value = os.environ.get("PEDESTRIAN_NUM_THREADS")
    if value is None:
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # pragma: no cover - not Linux
            return max(1, os.cpu_count() or 1)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"PEDESTRIAN_NUM_THREADS must be a positive integer, got {value!r}; "
                         "unset it to use every available core")
    return int(value)


def _get_pool(threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_owner
    # at least one worker: a caller that asks for its own thread count (DataParallel(threads=2))
    # may run where num_threads() is 1 (PEDESTRIAN_NUM_THREADS=1)
    threads = max(threads, 2)
    owner = (os.getpid(), threads)
    if _pool is None or _pool_owner != owner:
        _pool = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="pedestrian")
        _pool_owner = owner
    return _pool


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Hold the BLAS library and PyTorch's intra-op pool to one thread inside the block.

    For code that runs its own threads (:class:`pedestrian.training.parallel.DataParallel`: one
    thread per slice of the batch, each calling single-threaded BLAS), so that no BLAS worker
    competes with them for the cores. Inside the block :func:`for_row_blocks` also shares
    smaller jobs (:data:`QUIET_PARALLEL_MIN_ELEMENTS`) over its threads, since no BLAS worker
    is left spinning after a product. Nested blocks are free; the previous thread counts
    come back on exit. Process-wide, like the libraries' own settings: enter it from one
    thread at a time.

    Uses ``threadpoolctl`` (``openblas_set_num_threads`` and friends) and
    ``torch.set_num_threads`` (only if torch is already imported).
    """
    global _quiet_blas, _blas_controller
    if _quiet_blas:
        _quiet_blas += 1
        try:
            yield
        finally:
            _quiet_blas -= 1
        return
    from threadpoolctl import ThreadpoolController

    if _blas_controller is None:
        _blas_controller = ThreadpoolController().select(user_api="blas")
    torch = sys.modules.get("torch")
    torch_threads = torch.get_num_threads() if torch is not None else None
    with _blas_controller.limit(limits=1):
        if torch is not None:
            torch.set_num_threads(1)
        _quiet_blas = 1
        try:
            yield
        finally:
            _quiet_blas = 0
            if torch is not None:
                torch.set_num_threads(torch_threads)


class OwnCores:
    """``with OwnCores():`` -- :func:`single_threaded_blas` as a reusable context: the kernels run
    their own threads on every core meanwhile (the row blocks of :func:`for_row_blocks` from
    :data:`QUIET_PARALLEL_MIN_ELEMENTS`, matrix products cut by :func:`product_parts`, the tiled
    attention's units). For one sequence at a time (batch 1), where
    :class:`pedestrian.training.parallel.DataParallel` has no second row to give a core."""

    def __init__(self) -> None:
        self._contexts: list = []

    def __enter__(self) -> "OwnCores":
        context = single_threaded_blas()
        context.__enter__()
        self._contexts.append(context)          # a stack: the block may nest
        return self

    def __exit__(self, *exc) -> None:
        self._contexts.pop().__exit__(*exc)


def product_parts(like, n_rows: int) -> int:
    """Into how many row blocks a NumPy matrix product of ``n_rows`` output rows is cut, one per
    thread: :func:`num_threads` inside :func:`single_threaded_blas` outside a worker thread (the
    BLAS then has one thread; no worker of it is left spinning), 1 otherwise (the BLAS threads
    the product itself), and only as long as each part keeps :data:`PRODUCT_MIN_ROWS` rows."""
    if not _quiet_blas or not is_numpy_array(like) or getattr(_in_worker, "active", False):
        return 1
    return max(1, min(num_threads(), n_rows // PRODUCT_MIN_ROWS))


def run_units(like, units: list, kernel, threads: int) -> None:
    """``kernel(*unit)`` for every unit, over ``threads`` threads: each takes the next unit left
    (the list is ordered largest first), so a thread that starts late or is slowed down by
    another process does less, not the others wait. Every unit writes its own outputs, so the
    results do not depend on which thread ran what.

    On NumPy the BLAS is held to one thread meanwhile (:func:`single_threaded_blas`; inside a
    worker thread it already is): each of our threads needs a core of its own, and the tiled
    attention's products are too small for BLAS threads to pay -- its forward and backward at
    T = 2048 on a busy machine: 150-470 ms calling a 2-thread OpenBLAS, 79-110 calling a
    1-thread one.
    """
    threads = min(threads, len(units))
    quiet = is_numpy_array(like) and not is_worker_thread()
    if threads <= 1:
        with single_threaded_blas() if quiet else contextlib.nullcontext():
            for unit in units:
                kernel(*unit)
        return
    todo, lock = iter(units), threading.Lock()

    def worker() -> None:
        with in_worker_thread():
            while True:
                with lock:
                    unit = next(todo, None)
                if unit is None:
                    return
                kernel(*unit)

    with single_threaded_blas():
        futures = [get_pool().submit(worker) for _ in range(threads - 1)]
        try:
            worker()
        finally:
            for f in futures:
                f.result()


def in_worker_thread() -> contextlib.AbstractContextManager:
    """Mark the calling thread as one of a parallel team: :func:`for_row_blocks` runs serially."""
    return _WorkerMark()


def is_worker_thread() -> bool:
    """Whether the calling thread is marked by :func:`in_worker_thread` (its kernels run serially)."""
    return getattr(_in_worker, "active", False)


class _WorkerMark:
    def __enter__(self):
        self._before = getattr(_in_worker, "active", False)
        _in_worker.active = True

    def __exit__(self, *exc):
        _in_worker.active = self._before


def threads_pay(n_elements: int) -> bool:
    """Whether a job of ``n_elements`` (a numba kernel's ``prange``) is worth the threads: not
    inside a worker thread, at least two threads, and at least :data:`PARALLEL_MIN_ELEMENTS`
    (:data:`QUIET_PARALLEL_MIN_ELEMENTS` inside :func:`single_threaded_blas`)."""
    if getattr(_in_worker, "active", False):
        return False
    least = QUIET_PARALLEL_MIN_ELEMENTS if _quiet_blas else PARALLEL_MIN_ELEMENTS
    return n_elements >= least and num_threads() >= 2


def get_pool() -> ThreadPoolExecutor:
    """The shared thread pool: ``num_threads() - 1`` workers, at least one (the caller is the first
    thread; a team larger than the pool queues its extra jobs on the workers)."""
    return _get_pool(num_threads())


def for_row_blocks(like, kernel: Callable[[int, int], None], n_rows: int, row_len: int, *,
                   parallel_min: int | None = None, block: int = BLOCK_ELEMENTS) -> None:
    """Call ``kernel(lo, hi)`` on consecutive blocks of rows that together cover ``0 … n_rows``.

    The kernel must only touch rows ``lo:hi`` of its arrays (so blocks are independent).

    - PyTorch (``like`` a tensor): one call ``kernel(0, n_rows)``; torch threads each operation.
    - NumPy: blocks of about ``block`` elements (few, large calls: NumPy's per-call overhead;
      bounded temporaries); with at least ``parallel_min`` elements the blocks are shared out
      in contiguous runs over :func:`num_threads` threads (NumPy releases the GIL inside each
      elementwise loop), the calling thread taking the first run. The blocks do not depend on
      the number of threads, so neither do the results (e.g. per-block partial sums).

    Args:
        like: an array of the job (picks the backend).
        kernel: ``kernel(lo, hi) -> None``.
        n_rows, row_len: the job is ``n_rows`` rows of ``row_len`` elements.
        parallel_min: smallest job worth a second thread (a kernel of many cheap passes hands
            the GIL back and forth once per pass, so it needs a larger job to gain); default
            :data:`PARALLEL_MIN_ELEMENTS`, or :data:`QUIET_PARALLEL_MIN_ELEMENTS` inside
            :func:`single_threaded_blas`.
        block: elements per block (a kernel of small matrix products wants larger blocks).
    """
    if not is_numpy_array(like):
        kernel(0, n_rows)
        return
    step = max(1, block // max(row_len, 1))
    if step >= n_rows:                                     # one block: no pool, no bookkeeping
        kernel(0, n_rows)
        return
    if parallel_min is None:
        parallel_min = QUIET_PARALLEL_MIN_ELEMENTS if _quiet_blas else PARALLEL_MIN_ELEMENTS
    starts = range(0, n_rows, step)                        # the same blocks for any thread count
    threads = 1
    if n_rows * row_len >= parallel_min and not getattr(_in_worker, "active", False):
        threads = min(num_threads(), len(starts))

    def part(first: int, last: int) -> None:               # blocks first .. last-1
        for start in starts[first:last]:
            kernel(start, min(start + step, n_rows))

    if threads == 1:
        part(0, len(starts))
        return

    def worker(first: int, last: int) -> None:             # a kernel's own blocks run serially
        with in_worker_thread():
            part(first, last)

    bounds = [len(starts) * i // threads for i in range(threads + 1)]
    pool = get_pool()                                      # one pool, whatever this job's share
    futures = [pool.submit(worker, bounds[i], bounds[i + 1]) for i in range(1, threads)]
    try:
        worker(bounds[0], bounds[1])
    finally:
        for f in futures:
            f.result()

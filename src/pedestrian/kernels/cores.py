"""How many of a parallel region's threads run it: the cores a region gets, measured.

This module is bookkeeping only; no formula lives here. (:mod:`.jit` makes the process's one
:data:`~.jit.CORES` and runs every multi-thread region through it.)
"""

from __future__ import annotations

import threading
import time

__all__ = ["Cores"]


class Cores:
    """How many of a parallel region's ``threads_used()`` threads run it: all of them while the
    regions get their cores, fewer while other processes hold the cores.

    Measured inside the regions that run on several threads, on the calling thread: its CPU time
    over the wall time (``rate``, from its own precise clock: a process's clock adds its other
    threads' time only at the scheduler's ticks, every 1-4 ms). A thread that has its core runs
    (or spins at the region's end) all through a region: ``rate`` is 1. Beside other jobs every
    thread waits for its turn on a core about as often (the scheduler is fair), the others wait
    for it, and spinning burns the process's share: two threads then took 1.5-2.5x one thread's
    time (docs/guide.md, "A shared machine"). After :data:`WINDOW_S` of measured regions (and
    :data:`WINDOW_REGIONS` at least, or three times as long), a ``rate`` under :data:`SHARE` sets
    the count to the cores the regions got (``int(threads · rate)``, at least 1); all the threads
    are tried again after :data:`PROBE_S` seconds (doubling after each trial that fails, up to
    :data:`PROBE_MAX_S`); a trial fails as soon as two regions and :data:`TRIAL_FAIL_S` show the
    rate under :data:`SHARE`, and passes only after a whole window. A region that another Python
    thread's region overlapped is not counted. ``changes`` lists the last changes (time, threads;
    ``None``: all). The thresholds: measured on a 2-core VM (docs/guide.md, "A shared machine");
    an idle machine's windows read 0.96-1.0, two spinning processes beside ours 0.23-0.47.

    The bits do not depend on it: every kernel cuts its work by ``threads_used()`` (the row
    bands, the partial sums of a product), and this only sets how many threads run those parts
    (``numba.set_num_threads`` on the same compiled loops).
    """

    WINDOW_S = 0.01
    WINDOW_REGIONS = 8
    SHARE = 0.8
    PROBE_S = 0.02
    TRIAL_FAIL_S = 0.001
    PROBE_MAX_S = 8.0

    def __init__(self, use_threads) -> None:
        self.use_threads = use_threads          # numba.set_num_threads for the calling thread
        self.running: int | None = None        # threads running a region (None: all of them)
        self.trial = False                     # this window tries all the threads again
        self.next_trial, self.wait_s = 0.0, self.PROBE_S
        self.wall = self.cpu = 0.0
        self.regions = self.in_flight = self.started = 0
        self.changes: list = []                # (time, threads running) at each change, for logs
        self.lock = threading.Lock()

    def threads(self, threads: int) -> int:
        """The threads of the next region of ``threads``."""
        running = self.running
        if running is None or running >= threads:
            return threads
        if not self.trial and time.perf_counter() >= self.next_trial:
            self.trial, self.wall, self.cpu, self.regions = True, 0.0, 0.0, 0
        return threads if self.trial else running

    def run(self, f, threads: int, args):
        """``f(*args)`` on :meth:`threads` of ``threads``, measured when on several."""
        k = self.threads(threads)
        self.use_threads(k)
        if k == 1:
            return f(*args)
        with self.lock:
            alone, self.in_flight, self.started = self.in_flight == 0, self.in_flight + 1, self.started + 1
            mine = self.started
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return f(*args)
        finally:
            c1, t1 = time.thread_time(), time.perf_counter()
            with self.lock:
                self.in_flight -= 1
                if alone and self.started == mine:
                    self._count(k, threads, t1 - t0, c1 - c0, t1)

    def _count(self, k: int, threads: int, wall: float, cpu: float, now: float) -> None:
        self.wall, self.cpu, self.regions = self.wall + wall, self.cpu + cpu, self.regions + 1
        fails_early = (self.trial and self.regions >= 2 and self.wall >= self.TRIAL_FAIL_S
                       and self.cpu < self.SHARE * self.wall)
        if not fails_early and (self.wall < self.WINDOW_S or
                                (self.regions < self.WINDOW_REGIONS and self.wall < 3 * self.WINDOW_S)):
            return
        rate = self.cpu / self.wall
        self.wall = self.cpu = 0.0
        self.regions = 0
        self.trial = False
        if rate >= self.SHARE:                         # the threads had their cores
            if k == threads and self.running is not None:
                self._set(None, now)
                self.wait_s = self.PROBE_S
            return
        self._set(max(1, min(k - 1, int(k * rate))), now)
        self.next_trial = now + self.wait_s
        self.wait_s = min(2 * self.wait_s, self.PROBE_MAX_S)

    def _set(self, running: int | None, now: float) -> None:
        if running != self.running:
            self.running = running
            self.changes.append((now, running))
            del self.changes[:-64]

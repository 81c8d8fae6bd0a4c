"""Data parallelism on one machine: a batch split over threads or processes, gradients summed.

A small model's training step is hundreds of small operations. NumPy runs its elementwise
operations on one thread, and OpenBLAS's second thread helps the matrix products only a
little at these sizes (and then spins for ~0.1 s, keeping any other thread off the second
core). :class:`DataParallel` instead gives every thread whole rows of the batch: each runs
the model's ordinary hand-written forward and backward (:meth:`GPT.forward`,
:meth:`GPT.backward`) on its slice with a single-threaded BLAS, writing its own gradient
buffer, and the buffers are summed at the end. NumPy and the BLAS release the GIL inside
their loops, so the threads really do run at the same time -- except for the Python between
the calls, which holds the GIL. On the NumPy backend the slices after the first therefore run
in forked worker processes by default (``processes=True``): each has its own interpreter and
GIL, reads the parameters from shared memory at every step and writes its gradient back into
shared memory (measured on 2 cores, char-small: 72 -> 63 ms for forward and backward).

The arithmetic is the unsplit step's. With ``N`` counted targets in the whole batch and
``ℓ_r`` the loss of row ``r``::

    L = (1/N) Σ_r ℓ_r = Σ_s L_s,   L_s = (1/N) Σ_{r in slice s} ℓ_r
    ∂L/∂θ = Σ_s ∂L_s/∂θ

so slice ``s`` computes its cross-entropy divided by the *whole* batch's ``N`` (see
``cross_entropy_forward(n_total=N)``) and the gradients simply add. Results equal
``model.loss``/``model.backward`` on the whole batch up to float rounding (a different
summation order; a test checks the match). Dropout masks are drawn per slice from generators
seeded by ``model.dropout_rng``, so a run is reproducible for a given thread count.

Use::

    dp = DataParallel(model)                # slices: PEDESTRIAN_NUM_THREADS or the cores
    with dp:                                # one BLAS thread per worker while inside
        loss = dp.loss(tokens, targets)     # (B, T) ints; slices of rows, one per thread
        grads = dp.backward()               # = model.grads, the sum over the slices
        optimizer.step(lr)

:func:`pedestrian.train.train_step` accepts a ``DataParallel`` in place of the model.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import mmap
import os
import pickle
import signal
import sys
import time
import traceback
import warnings
import weakref
from multiprocessing.connection import Pipe

import numpy as np

from .backend import (Workspace, for_row_blocks, get_pool, in_worker_thread, is_torch_array, num_threads,
                      single_threaded_blas, to_numpy, QUIET_PARALLEL_MIN_ELEMENTS)
from .layers.loss import IGNORE_INDEX

__all__ = ["DataParallel", "WorkerDied", "use_data_parallel", "runner_for", "processes_available",
           "DATA_PARALLEL_MODES", "SMALL_MODEL_PARAMS"]

#: :func:`use_data_parallel` splits the batch below this many trainable parameters. Measured
#: on 2 cores (``benchmarks/bench_train.py``): char-small (0.8M) is bound by per-operation
#: overhead and gains ~1.4x; gpt2-124M is 70% large matrix products, which the BLAS threads
#: well by itself, and an extra gradient buffer per slice would cost 0.5 GB.
SMALL_MODEL_PARAMS = 20_000_000

#: attributes each slice keeps for itself; everything else (parameters, config, LoRA
#: settings, the training flag) is the model's own, shared
_SLICE_OWN = ("_workspace", "_cache", "_deltas", "_grad_base", "_grad_lora", "dropout_rng",
              "_loss_n_total", "_lora_set", "_grad_lora_for")


def use_data_parallel(model, batch_size: int, threads: int | None = None) -> bool:
    """Whether :class:`DataParallel` should run this model's training steps.

    True for the NumPy backend when there are at least two threads (``threads``, default
    :func:`pedestrian.backend.num_threads`) and two sequences to share, and the model has
    fewer than :data:`SMALL_MODEL_PARAMS` trainable parameters. Never for the torch backend:
    PyTorch threads each operation itself, and its per-operation overhead holds the GIL, so
    threads over the batch did not help there (char-small: 77 ms per step either way).
    """
    threads = num_threads() if threads is None else threads
    return (model.backend == "numpy" and threads >= 2 and batch_size >= 2
            and model.num_params(trainable_only=True) < SMALL_MODEL_PARAMS)


#: the ``data_parallel`` choices of :func:`runner_for` (``pedestrian train --data-parallel``)
DATA_PARALLEL_MODES = ("auto", "on", "off", "threads", "processes")


def runner_for(model, data_parallel: str, batch_size: int):
    """``(runner, context)`` for a training loop: a :class:`DataParallel` and itself (its
    context holds BLAS to one thread per worker), or the model and a null context.

    Args:
        data_parallel: ``"auto"`` (:func:`use_data_parallel`), ``"on"`` (split, worker
            processes where :class:`DataParallel` picks them), ``"threads"`` or
            ``"processes"`` (split, that way), ``"off"``.

    Raises:
        ValueError: an unknown mode; ``"processes"`` where they cannot work.
    """
    if data_parallel not in DATA_PARALLEL_MODES:
        raise ValueError(f"data_parallel must be one of {DATA_PARALLEL_MODES}, got {data_parallel!r}")
    if data_parallel in ("on", "threads", "processes") or (
            data_parallel == "auto" and use_data_parallel(model, batch_size)):
        dp = DataParallel(model, processes={"threads": False, "processes": True}.get(data_parallel))
        if dp.threads > 1:
            return dp, dp
    return model, contextlib.nullcontext()


class DataParallel:
    """Run a training step's forward and backward on row slices of the batch, one per core.

    Args:
        model: a :class:`~pedestrian.model.GPT` (NumPy or torch backend, any dtype, with or
            without LoRA adapters). It is not copied: the slices share its parameters, and
            the summed gradients land in the model's own gradient buffers.
        threads: number of slices, each run by its own thread (or worker process); default
            :func:`pedestrian.backend.num_threads` (``PEDESTRIAN_NUM_THREADS`` or the usable
            cores). A batch of ``B`` rows uses ``min(threads, B)`` of them; with one, the calls
            go straight to the model.
        processes: run slices 1, 2, … in forked worker processes instead of threads (slice 0
            always runs on the calling thread). Default: yes on the NumPy backend on Linux
            (:func:`processes_available`), so that the slices do not share a GIL. A
            worker starts on the first :meth:`loss`, gets the parameters' current values at
            every step through shared memory, and is restarted when the model's structure
            changes (LoRA adapters added or removed, base frozen or not); :meth:`close` (or
            the end of the program) stops it. The results are bit for bit those of threads.

    Memory: one extra gradient buffer (the size of the trainable parameters) per slice
    beyond the first, plus each slice's activations for its rows (together about what the
    whole batch needs); with processes also a copy of the parameters per worker and one
    shared. Worth it for small models, where the step is bound by per-operation overhead
    (measured: ``benchmarks/bench_train.py``); for large ones the BLAS threads its big
    products well on its own.

    Raises:
        ValueError: ``threads`` not an integer >= 1; ``processes=True`` on the torch backend
            (PyTorch's OpenMP runtime does not survive a fork) or off Linux.
    """

    def __init__(self, model, threads: int | None = None, *, processes: bool | None = None):
        if threads is None:
            threads = num_threads()
        elif isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        threads = int(threads)
        if processes is None:
            processes = model.backend == "numpy" and processes_available()
        elif processes and model.backend != "numpy":
            raise ValueError("DataParallel(processes=True) needs the NumPy backend: PyTorch's OpenMP "
                             "runtime cannot be used in a forked child; use processes=False")
        elif processes and not processes_available():
            raise ValueError("DataParallel(processes=True) forks worker processes, which pedestrian does "
                             "only on Linux; use processes=False (threads)")
        self.model = model
        self.threads = threads
        self.processes = bool(processes)
        self._slices: list = []
        self._n_used = 0                        # slices used by the last loss(); 0 = none yet
        self._contexts: list = []
        self._workers: list[_Worker] = []       # slices 1, 2, … when processes
        self._shared_params = None              # the parameters, written here, read by the workers
        self._signature = None                  # the model structure the workers were forked with
        self._messages: list = []               # the last loss() messages (to redo a dead worker's)
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    # ---------------------------------------------------------------- the model's interface
    @property
    def training(self) -> bool:
        """The model's training flag (dropout on or off)."""
        return self.model.training

    @training.setter
    def training(self, value: bool) -> None:
        self.model.training = bool(value)

    def __enter__(self) -> "DataParallel":
        """Hold BLAS (and torch) to one thread per worker until exit (see
        :func:`pedestrian.backend.single_threaded_blas`); also makes the optimizer's
        elementwise work share the cores."""
        context = single_threaded_blas()
        context.__enter__()
        self._contexts.append(context)          # a stack: `with dp:` may nest
        return self

    def __exit__(self, *exc) -> None:
        self._contexts.pop().__exit__(*exc)

    def loss(self, tokens, targets) -> float:
        """Forward of every slice; returns the whole batch's mean loss (nats per counted target).

        Args:
            tokens, targets: ``(B, T)`` integer ids, as for :meth:`GPT.loss`.

        Raises:
            TypeError, ValueError: as :meth:`GPT.forward` (bad ids, shapes, dtypes).
            WorkerDied: a worker process died, and its replacement too (one death is
                repaired: a ``RuntimeWarning``, and the step's result is unchanged).
        """
        tokens_np, targets_np = to_numpy(tokens), to_numpy(targets)        # lists too
        n = self.slices_for(tokens_np.shape[0]) if tokens_np.ndim == 2 else 1
        if n <= 1 or targets_np.shape != tokens_np.shape:
            self._n_used = 1                    # one slice, or let the model report the error
            return self.model.loss(tokens, targets)
        self._sync(n)
        bounds = [tokens_np.shape[0] * s // n for s in range(n + 1)]
        n_total = int(np.count_nonzero(targets_np != IGNORE_INDEX))
        seeds = None
        if self.model.training and self.model.config.dropout > 0:
            seeds = self.model.dropout_rng.integers(0, 2**63 - 1, size=n)
        for part in self._slices[:n]:
            part._loss_n_total = n_total

        def job(s: int) -> float:
            lo, hi = bounds[s], bounds[s + 1]
            if seeds is not None:               # set here: a repeated forward draws the same masks
                self._slices[s].dropout_rng = np.random.default_rng(int(seeds[s]))
            return self._slices[s].loss(_rows(tokens, lo, hi), _rows(targets, lo, hi))

        self._n_used = 0                        # until every slice has its forward
        if self.processes:
            training = self.model.training
            self._messages = [("loss", _rows(tokens_np, bounds[s], bounds[s + 1]),
                               _rows(targets_np, bounds[s], bounds[s + 1]), n_total,
                               None if seeds is None else int(seeds[s]), training) for s in range(1, n)]
            try:
                self._start_workers(n)
                losses = self._run_with_workers(n, lambda: job(0), self._messages)
            except WorkerDied as exc:           # once: a new worker, the whole forward again
                self._restarted(exc)
                self._start_workers(n)
                losses = self._run_with_workers(n, lambda: job(0), self._messages)
        else:
            losses = self._run(n, job)
        self._n_used = n
        return float(sum(losses))

    def backward(self) -> dict:
        """Backward of every slice, then the slices' gradients summed into the model's buffers.

        Returns:
            ``model.grads`` (name -> gradient of the whole batch's mean loss).

        Raises:
            ValueError: no :meth:`loss` since the last backward-able forward.
            WorkerDied: as for :meth:`loss`.
        """
        if self._n_used == 0:
            raise ValueError("backward() called before loss(); call dp.loss(tokens, targets) first")
        if self._n_used == 1:
            return self.model.backward()
        n = self._n_used
        trained = _trained_buffers(self.model)
        if self.processes:
            try:
                self._run_with_workers(n, self._slices[0].backward, [("backward",)] * (n - 1))
            except WorkerDied as exc:           # slice 0's gradient is in place: new workers
                self._restarted(exc)            # redo their slices' forward and backward
                self._start_workers(n)
                self._run_with_workers(n, lambda: None, self._messages)
                self._run_with_workers(n, lambda: None, [("backward",)] * (n - 1))
            for name in trained:                # each worker's sum lies in its shared memory
                _sum_into(getattr(self.model, name).flat, [w.grads[name] for w in self._workers[:n - 1]])
            return self.model.grads
        self._run(n, lambda s: self._slices[s].backward())
        for name in trained:                    # slice 0 wrote the model's own buffers
            others = [getattr(part, name).flat for part in self._slices[1:n]]
            _sum_into(getattr(self.model, name).flat, others)
        return self.model.grads

    def slices_for(self, batch_size: int) -> int:
        """How many slices a batch of ``batch_size`` rows is split into: ``min(threads, B)``
        (1: the model's own forward and backward, unsplit)."""
        return max(1, min(self.threads, batch_size))

    def close(self) -> None:
        """Stop the worker processes (if any); a later :meth:`loss` starts new ones."""
        _stop_workers(self._workers)
        self._shared_params = self._signature = None

    def _restarted(self, exc: "WorkerDied") -> None:
        self.close()
        warnings.warn(f"{exc}; started a new worker and repeated its slice of this step (same "
                      "dropout masks: the result is unchanged)", RuntimeWarning, stacklevel=3)

    # ---------------------------------------------------------------- internals
    def _sync(self, n: int) -> None:
        """Make ``n`` slices that share the model's current parameters and settings."""
        model = self.model
        model._grad_buffers()                   # slice 0 writes the model's own buffers
        while len(self._slices) < n:
            part = copy.copy(model)
            part._workspace, part._cache, part._deltas = Workspace(), None, {}
            part._grad_base = part._grad_lora = part._grad_lora_for = None
            self._slices.append(part)
        shared = {k: v for k, v in vars(model).items() if k not in _SLICE_OWN}
        for s, part in enumerate(self._slices[:n]):
            vars(part).update(shared)
            part._loss_n_total = None
            part.dropout_rng = model.dropout_rng if s == 0 else None
            if s == 0:
                part._grad_base, part._grad_lora = model._grad_base, model._grad_lora
                continue
            if model.freeze_base:
                part._grad_base = None
            if part._grad_lora_for is not model._lora:      # adapters added, removed or replaced
                part._grad_lora, part._grad_lora_for = None, model._lora
            # its gradient buffers come with its first backward (in a worker process, there)

    def _start_workers(self, n: int) -> None:
        """Fork workers for slices 1 … n−1 if they are missing or were forked from a model of
        another structure, and copy the parameters' current values into shared memory."""
        model = self.model
        signature = (model._base, model._lora, model.freeze_base, tuple(model.lora_targets),
                     getattr(model, "lora_rank", None), model.lora_alpha, model.config, model.dtype)
        if self._signature is not None and self._signature != signature:
            self.close()
        flats = _param_flats(model)
        if self._shared_params is None:
            self._shared_params = _shared_array(sum(f.shape[0] for f in flats), model.dtype)
            self._signature = signature
        _copy_flats(flats, self._shared_params, into_shared=True)   # this step's, for every worker
        while len(self._workers) < n - 1:
            self._workers.append(_Worker(self._slices[len(self._workers) + 1], self._shared_params))

    def _run_with_workers(self, n: int, local_job, messages: list) -> list:
        """Send ``messages[s−1]`` to worker ``s``, run ``local_job()`` (slice 0) here meanwhile,
        then collect the workers' answers; the first error (here or in a worker) is raised."""
        workers = self._workers[:n - 1]
        error = None
        for w, message in zip(workers, messages):
            try:
                w.send(message)
            except BaseException as exc:        # noqa: BLE001 -- a dead worker: raised below
                error = error or exc
        with single_threaded_blas(), in_worker_thread():
            results, local_error = _gather(local_job, [w.receive for w in workers])
        if error is None or (local_error is not None and not isinstance(local_error, WorkerDied)):
            error = local_error                 # a real error in a slice before a dead worker
        if error is not None:
            if any(not w.alive for w in workers):
                self.close()                    # the next loss() forks new workers
            raise error
        return results

    def _run(self, n: int, job) -> list:
        """``job(s)`` for ``s < n``: slice 0 on the calling thread, the rest on the pool."""
        torch_backend = self.model.backend == "torch"

        def work(s: int):
            with in_worker_thread():
                if torch_backend:               # the pool threads' own OpenMP setting
                    import torch

                    torch.set_num_threads(1)
                return job(s)

        with single_threaded_blas():
            pool = get_pool()
            futures = [pool.submit(work, s) for s in range(1, n)]
            results, error = _gather(lambda: work(0), [f.result for f in futures])
        if error is not None:
            raise error
        return results


def _gather(local_job, waits: list) -> tuple[list, BaseException | None]:
    """``[local_job(), *(wait() for wait in waits)]`` and the first exception raised, if any:
    every ``wait`` runs even after an error, so no slice is left running unattended."""
    results, errors = [None] * (1 + len(waits)), []
    try:
        results[0] = local_job()
    except BaseException as exc:                # noqa: BLE001 -- returned, raised by the caller
        errors.append(exc)
    for s, wait in enumerate(waits, start=1):
        try:
            results[s] = wait()
        except BaseException as exc:            # noqa: BLE001
            errors.append(exc)
    real = [e for e in errors if not isinstance(e, WorkerDied)]   # a dead worker's slice can be redone
    return results, (real or errors or [None])[0]


class WorkerDied(RuntimeError):
    """A :class:`DataParallel` worker process ended without answering (killed, out of memory).

    :meth:`DataParallel.loss` and :meth:`~DataParallel.backward` start a new worker and redo
    its slice once (with a ``RuntimeWarning``); this is raised when that one dies too."""


def processes_available() -> bool:
    """Whether :class:`DataParallel` forks worker processes here: Linux only (macOS has
    ``os.fork``, but its system libraries are not safe to use in a forked child)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def _shared_array(n: int, dtype) -> np.ndarray:
    """``(n,)`` zeros in anonymous shared memory: a forked child sees the same pages."""
    dtype = np.dtype(dtype)
    buffer = mmap.mmap(-1, max(1, n * dtype.itemsize))      # MAP_SHARED | MAP_ANONYMOUS
    return np.frombuffer(buffer, dtype=dtype, count=n)


class _Child:
    """A forked child process running ``target(*args)``, then ``os._exit``.

    Plain ``os.fork`` rather than :mod:`multiprocessing`: at interpreter exit multiprocessing
    terminates its children with SIGTERM and then waits for them without a time limit, and our
    workers ignore SIGTERM (see :func:`_worker_main`); this module stops its own children.
    """

    def __init__(self, target, args):
        self.exitcode: int | None = None
        with warnings.catch_warnings():         # Python >= 3.12 warns on any fork of a threaded
            warnings.simplefilter("ignore", DeprecationWarning)   # process; the child only runs
            pid = os.fork()                     # NumPy and single-threaded BLAS on its own data
        if pid == 0:                            # the child: never returns into the caller's code
            code = 1
            try:
                target(*args)
                code = 0
            except BaseException:               # noqa: BLE001 -- reported, then the child ends
                with contextlib.suppress(BaseException):
                    traceback.print_exc()
                    sys.stderr.flush()
            finally:
                os._exit(code)
        self.pid = pid
        self.owner = os.getpid()

    def _poll(self, block: bool = False) -> int | None:
        if self.exitcode is None:
            try:
                pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
            except ChildProcessError:           # already reaped
                self.exitcode = -1
                return self.exitcode
            if pid:
                self.exitcode = os.waitstatus_to_exitcode(status)
        return self.exitcode

    def is_alive(self) -> bool:
        return self._poll() is None

    def join(self, timeout: float | None = None) -> None:
        """Wait for the child to end (at most ``timeout`` seconds) and reap it."""
        if timeout is None:
            self._poll(block=True)
            return
        deadline = time.monotonic() + timeout
        while self._poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)

    def kill(self) -> None:
        if self.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


#: workers not yet stopped; stopped at interpreter exit (a weak set: a worker whose
#: DataParallel was garbage-collected has been stopped by its finalizer already)
_live_workers: "weakref.WeakSet[_Worker]" = weakref.WeakSet()


@atexit.register
def _stop_live_workers() -> None:
    for w in list(_live_workers):
        w.stop()


class _Worker:
    """One slice of the batch in a forked child process (:class:`DataParallel` with processes).

    The child is a fork of this process holding ``part``, a slice made by
    :meth:`DataParallel._sync`. It answers two messages over a pipe:

    - ``("loss", tokens, targets, n_total, dropout_seed, training)``: copy the parameters out
      of ``shared_params``, run ``part.loss`` on the rows; answer the loss.
    - ``("backward",)``: run ``part.backward()`` and copy its gradients into :attr:`grads`
      (shared memory); answer ``None``.

    An exception in the child is sent back and raised here; ``None`` (or this process going
    away: the pipe closes) ends the child.
    """

    def __init__(self, part, shared_params):
        self.grads = {}
        sizes = {name: (part._base if name == "_grad_base" else part._lora).flat.shape[0]
                 for name in _trained_buffers(part)}
        shared = _shared_array(sum(sizes.values()), part.dtype)
        offset = 0
        for name, size in sizes.items():
            self.grads[name] = shared[offset:offset + size]
            offset += size
        self._conn, child_conn = Pipe()
        self._process = _Child(_worker_main, (part, child_conn, self._conn, shared_params, self.grads))
        child_conn.close()
        self.alive = True
        self._pending = False                   # a message sent, its answer not yet read
        _live_workers.add(self)

    def send(self, message) -> None:
        if self._pending:                       # the caller was interrupted (Ctrl-C) last time:
            with contextlib.suppress(Exception):  # that answer is stale
                self.receive()
        try:
            self._conn.send(message)
        except (BrokenPipeError, EOFError, OSError):
            self._died()
        self._pending = True

    def receive(self):
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError):
            self._died()
        finally:
            self._pending = False
        if status == "error":
            raise value
        return value

    def _died(self):
        self.alive = False
        self._process.join(timeout=1.0)
        raise WorkerDied(
            f"a DataParallel worker process (pid {self._process.pid}) exited unexpectedly with code "
            f"{self._process.exitcode} (killed, or out of memory?); to run without worker processes "
            "use pedestrian train --data-parallel threads (in Python: DataParallel(processes=False))")

    def stop(self) -> None:
        """End the child: ask it to (``None``), after 2 s kill it; reap it; close the pipe."""
        if self._process.owner != os.getpid():  # a copy of this object inside another worker
            return
        _live_workers.discard(self)
        if self._process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self._process.join(timeout=2.0)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(timeout=2.0)
        self._conn.close()
        self.alive = False


def _stop_workers(workers: list) -> None:
    while workers:
        workers.pop().stop()


def _worker_main(part, conn, parent_end, shared_params, grads) -> None:
    """The forked child's loop (see :class:`_Worker`)."""
    parent_end.close()                          # so that the pipe closes when the parent dies
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C or a stop sent to the process group is
        signal.signal(sig, signal.SIG_IGN)        # the parent's to handle (pedestrian train ends
                                                  # its step and saves); the child ends with the pipe
    flats = _param_flats(part)
    from threadpoolctl import threadpool_limits   # not single_threaded_blas(): its state (and
                                                  # torch's, if imported) is the parent's
    with threadpool_limits(limits=1, user_api="blas"), in_worker_thread():
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            if message is None:
                return
            try:
                if message[0] == "loss":
                    _, tokens, targets, n_total, seed, training = message
                    _copy_flats(flats, shared_params, into_shared=False)
                    part.training = training
                    part._loss_n_total = n_total
                    part.dropout_rng = None if seed is None else np.random.default_rng(seed)
                    answer = ("ok", part.loss(tokens, targets))
                else:
                    part.backward()
                    for name, out in grads.items():
                        np.copyto(out, getattr(part, name).flat)
                    answer = ("ok", None)
            except BaseException as exc:        # noqa: BLE001 -- sent to the parent, raised there
                try:
                    pickle.dumps(exc)
                except Exception:               # noqa: BLE001 -- an exception that cannot travel
                    exc = RuntimeError(f"{type(exc).__name__}: {exc}")
                answer = ("error", exc)
            try:
                conn.send(answer)
            except (BrokenPipeError, OSError):
                return


def _trained_buffers(model) -> list[str]:
    """The model's gradient buffers that a backward fills: ``_grad_base`` unless the base is
    frozen, ``_grad_lora`` when it has adapters."""
    return ([] if model.freeze_base else ["_grad_base"]) + ([] if model._lora is None else ["_grad_lora"])


def _param_flats(model) -> list:
    """The model's flat parameter buffers: the base, then the LoRA adapters if any."""
    return [model._base.flat] + ([] if model._lora is None else [model._lora.flat])


def _copy_flats(flats: list, shared: np.ndarray, *, into_shared: bool) -> None:
    """Copy ``flats`` one after another into ``shared`` (or back out of it)."""
    offset = 0
    for f in flats:
        region = shared[offset:offset + f.shape[0]]
        if into_shared:
            np.copyto(region, f)
        else:
            np.copyto(f, region)
        offset += f.shape[0]


def _rows(a, lo: int, hi: int):
    """Rows ``lo:hi`` of a ``(B, T)`` array, tensor or nested list."""
    if isinstance(a, (list, tuple)):
        return np.asarray(a)[lo:hi]
    return a[lo:hi]


def _sum_into(total, others: list) -> None:
    """``total += Σ others`` (flat buffers), shared over the thread pool in blocks."""
    if is_torch_array(total):
        for o in others:
            total.add_(o)
        return

    def kernel(lo: int, hi: int) -> None:
        for o in others:
            np.add(total[lo:hi], o[lo:hi], out=total[lo:hi])

    # no BLAS worker is spinning now (the slices ran single-threaded BLAS): a second thread pays
    for_row_blocks(total, kernel, int(total.shape[0]), 1, parallel_min=QUIET_PARALLEL_MIN_ELEMENTS,
                   block=1 << 16)

"""A batch split over threads on one machine, gradients summed (small models, NumPy backend).

A small model's training step is hundreds of small operations. NumPy runs its elementwise
operations on one thread, and OpenBLAS's second thread helps the matrix products only a little
at these sizes. :class:`DataParallel` instead gives every thread whole rows of the batch: each
runs the model's ordinary hand-written forward and backward on its slice with a
single-threaded BLAS, writing its own gradient buffer, and the buffers are summed at the end.
NumPy and the BLAS release the GIL inside their loops, so the threads run at the same time
except for the Python between the calls.

The arithmetic is the unsplit step's. With ``N`` counted targets in the whole batch and
``ℓ_r`` the loss of row ``r``::

    L = (1/N) Σ_r ℓ_r = Σ_s L_s,   L_s = (1/N) Σ_{r in slice s} ℓ_r
    ∂L/∂θ = Σ_s ∂L_s/∂θ

so slice ``s`` computes its cross-entropy divided by the *whole* batch's ``N``
(``model.loss(..., n_total=N)``) and the gradients simply add. Results equal ``model.loss`` /
``model.backward`` on the whole batch up to float rounding (a different summation order; a test
checks the match). Dropout masks are keyed by the row
(:class:`~pedestrian.distributed.RowKeyedRNG`), so a row gets the same mask whatever the number
of slices.

Several processes or machines: :mod:`pedestrian.distributed` (``torch.distributed``); each rank
may split its own rows over threads with this class.

Use::

    dp = DataParallel(model)                # slices: PEDESTRIAN_NUM_THREADS or the cores
    with dp:                                # one BLAS thread per slice while inside
        loss = dp.loss(tokens, targets)     # (B, T) ints; slices of rows, one per thread
        grads = dp.backward()               # = model.grads, the sum over the slices
        optimizer.step(lr)
"""

from __future__ import annotations

import contextlib

import numpy as np

from ..backend import to_numpy
from ..distributed import RowKeyedRNG
from ..kernels.threads import OwnCores, get_pool, in_worker_thread, num_threads
from ..layers.loss import IGNORE_INDEX

__all__ = ["DataParallel", "use_data_parallel", "runner_for", "DATA_PARALLEL_MODES", "SMALL_MODEL_PARAMS"]

#: :func:`use_data_parallel` splits the batch below this many trainable parameters. Measured
#: on 2 cores (``benchmarks/bench_train.py``): char-small (0.8M) is bound by per-operation
#: overhead and gains from the split; gpt2-124M is 70% large matrix products, which the BLAS
#: threads well by itself, and an extra gradient buffer per slice would cost 0.5 GB.
SMALL_MODEL_PARAMS = 20_000_000

#: the ``data_parallel`` choices of :func:`runner_for` (``pedestrian train --data-parallel``)
DATA_PARALLEL_MODES = ("auto", "on", "off")


def use_data_parallel(model, batch_size: int, threads: int | None = None) -> bool:
    """Whether :class:`DataParallel` should run this model's training steps.

    True for the NumPy backend when there are at least two threads (``threads``, default
    :func:`pedestrian.kernels.threads.num_threads`) and two sequences to share, and the model
    has fewer than :data:`SMALL_MODEL_PARAMS` trainable parameters. Never for the torch
    backend: PyTorch threads each operation itself, and its per-operation overhead holds the
    GIL, so threads over the batch did not help there.
    """
    return batch_size >= 2 and _threads_help(model, threads)


def _threads_help(model, threads: int | None = None) -> bool:
    """NumPy backend, at least two threads, fewer than :data:`SMALL_MODEL_PARAMS` trainable
    parameters: a model whose steps gain from our own threads (:class:`DataParallel` over the
    rows, or :class:`~pedestrian.kernels.threads.OwnCores` for a single sequence)."""
    threads = num_threads() if threads is None else threads
    return (model.backend == "numpy" and threads >= 2
            and model.num_params(trainable_only=True) < SMALL_MODEL_PARAMS)


def runner_for(model, data_parallel: str, batch_size: int):
    """``(runner, context)`` for a training loop: a :class:`DataParallel` and itself (its
    context holds BLAS to one thread per slice); for one sequence, the model and an
    :class:`~pedestrian.kernels.threads.OwnCores` (the kernels share it over the threads); else
    the model and a null context.

    Args:
        data_parallel: ``"auto"`` (:func:`use_data_parallel`), ``"on"``, ``"off"``.
        batch_size: the rows this process computes per micro-batch.

    Raises:
        ValueError: an unknown mode.
    """
    if data_parallel not in DATA_PARALLEL_MODES:
        raise ValueError(f"data_parallel must be one of {DATA_PARALLEL_MODES}, got {data_parallel!r}")
    if data_parallel == "on" or (data_parallel == "auto" and use_data_parallel(model, batch_size)):
        dp = DataParallel(model)
        if dp.threads > 1:
            return dp, dp
    if data_parallel != "off" and batch_size == 1 and _threads_help(model):
        return model, OwnCores()              # one sequence: the kernels' own threads share it
    return model, contextlib.nullcontext()


class DataParallel:
    """Run a training step's forward and backward on row slices of the batch, one per thread.

    Args:
        model: a :class:`~pedestrian.model.GPT`. Slice 0 is the model itself; the others are
            :meth:`~pedestrian.model.GPT.replica` s sharing its parameters. The summed gradients
            land in the model's own gradient buffers.
        threads: number of slices, each run by its own thread; default
            :func:`pedestrian.kernels.threads.num_threads` (``PEDESTRIAN_NUM_THREADS`` or the
            usable cores). A batch of ``B`` rows uses ``min(threads, B)``; with one, the calls go
            straight to the model.

    Memory: one extra gradient buffer (the size of the trainable parameters) per slice beyond
    the first, plus each slice's activations for its rows.

    Raises:
        ValueError: ``threads`` not an integer >= 1.
    """

    def __init__(self, model, threads: int | None = None):
        if threads is None:
            threads = num_threads()
        elif isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        self.model = model
        self.threads = int(threads)
        self._replicas: list = []
        self._structure = None
        self._n_used = 0                        # slices used by the last loss(); 0 = none yet
        self._cores = OwnCores()

    @property
    def training(self) -> bool:
        """The model's training flag (dropout on or off)."""
        return self.model.training

    @training.setter
    def training(self, value: bool) -> None:
        self.model.training = bool(value)

    @property
    def dropout_rng(self):
        """The model's dropout generator (the training loop sets a row-keyed one per micro-batch)."""
        return self.model.dropout_rng

    @dropout_rng.setter
    def dropout_rng(self, value) -> None:
        self.model.dropout_rng = value

    def __enter__(self) -> "DataParallel":
        """Hold BLAS (and torch) to one thread per slice until exit (see
        :func:`pedestrian.kernels.threads.single_threaded_blas`; ``with dp:`` may nest)."""
        self._cores.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._cores.__exit__(*exc)

    def slices_for(self, batch_size: int) -> int:
        """How many slices a batch of ``batch_size`` rows is split into: ``min(threads, B)``."""
        return max(1, min(self.threads, batch_size))

    def close(self) -> None:
        """Drop the replicas (their activations and gradient buffers)."""
        self._replicas, self._structure = [], None

    def loss(self, tokens, targets, *, n_total: int | None = None) -> float:
        """Forward of every slice; returns the batch's loss (nats per counted target).

        ``n_total``: as :meth:`GPT.loss <pedestrian.model.GPT.loss>` (these rows are part of a
        larger batch of ``n_total`` counted targets). With dropout on, slice ``s`` draws from the
        model's :class:`~pedestrian.distributed.RowKeyedRNG` moved to its first row (a plain
        generator is first turned into one, from one draw of it), so every row gets the mask it
        gets unsplit.

        Raises:
            TypeError, ValueError: as :meth:`GPT.forward` (bad ids, shapes, dtypes).
        """
        tokens_np, targets_np = to_numpy(tokens), to_numpy(targets)
        n = self.slices_for(tokens_np.shape[0]) if tokens_np.ndim == 2 else 1
        if n <= 1 or targets_np.shape != tokens_np.shape:
            self._n_used = 1                    # one slice, or let the model report the error
            return self.model.loss(tokens, targets, n_total=n_total)
        parts = self._slices(n)
        bounds = [tokens_np.shape[0] * s // n for s in range(n + 1)]
        if n_total is None:
            n_total = int(np.count_nonzero(targets_np != IGNORE_INDEX))
        own = self.model.dropout_rng
        if self.model.training and (self.model.config.dropout > 0 or self.model.lora_dropout > 0):
            rows = own if isinstance(own, RowKeyedRNG) else RowKeyedRNG((int(own.integers(0, 2**63 - 1)),))
            for part, lo in zip(parts, bounds):
                part.dropout_rng = rows.rows_from(lo)
        self._n_used = 0
        try:
            losses = self._run(n, lambda s: parts[s].loss(tokens[bounds[s]:bounds[s + 1]],
                                                          targets[bounds[s]:bounds[s + 1]], n_total=n_total))
        finally:
            self.model.dropout_rng = own          # slice 0 is the model itself
        self._n_used = n
        return float(sum(losses))

    def backward(self) -> dict:
        """Backward of every slice, then the slices' gradients summed into the model's buffers.

        Returns:
            ``model.grads`` (name -> gradient of the whole batch's mean loss).

        Raises:
            ValueError: no :meth:`loss` since the last backward-able forward.
        """
        if self._n_used == 0:
            raise ValueError("backward() called before loss(); call dp.loss(tokens, targets) first")
        n = self._n_used
        if n == 1:
            return self.model.backward()
        parts = self._slices(n)
        self._run(n, lambda s: parts[s].backward())
        for i, total in enumerate(self.model.trainable_buffers()):
            for part in parts[1:]:                 # slice 0 wrote the model's own buffers
                total.grads[...] += part.trainable_buffers()[i].grads
        return self.model.grads

    def _slices(self, n: int) -> list:
        """The model and ``n - 1`` replicas sharing its current parameters and adapters."""
        model = self.model
        structure = (tuple(model.lora_targets), model.freeze_base,
                     tuple(id(b.params) for b in model.trainable_buffers()))
        if structure != self._structure:
            self._replicas, self._structure = [], structure
        while len(self._replicas) < n - 1:
            self._replicas.append(model.replica())
        for r in self._replicas:
            r.training = model.training
        return [model] + self._replicas[:n - 1]

    def _run(self, n: int, job) -> list:
        """``job(s)`` for ``s = 0 … n-1``: slice 0 on this thread, the others on the pool."""
        def worker(s):
            with in_worker_thread():
                return job(s)

        pool = get_pool()
        futures = [pool.submit(worker, s) for s in range(1, n)]
        try:
            first = worker(0)
        finally:
            results = [f.result() for f in futures]
        return [first] + results

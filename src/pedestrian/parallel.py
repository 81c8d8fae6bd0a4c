"""Data parallelism inside one process: the batch split over threads, the gradients summed.

A small model's training step is hundreds of small operations. NumPy runs its elementwise
operations on one thread, and OpenBLAS's second thread helps the matrix products only a
little at these sizes (and then spins for ~0.1 s, keeping any other thread off the second
core). :class:`DataParallel` instead gives every thread whole rows of the batch: each runs
the model's ordinary hand-written forward and backward (:meth:`GPT.forward`,
:meth:`GPT.backward`) on its slice with a single-threaded BLAS, writing its own gradient
buffer, and the buffers are summed at the end. NumPy and the BLAS release the GIL inside
their loops, so the threads really do run at the same time.

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

    dp = DataParallel(model)                # threads: PEDESTRIAN_NUM_THREADS or the cores
    with dp:                                # one BLAS thread per worker while inside
        loss = dp.loss(tokens, targets)     # (B, T) ints; slices of rows, one per thread
        grads = dp.backward()               # = model.grads, the sum over the slices
        optimizer.step(lr)

:func:`pedestrian.train.train_step` accepts a ``DataParallel`` in place of the model.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np

from .backend import (Workspace, for_row_blocks, get_pool, in_worker_thread, is_torch_array, num_threads,
                      single_threaded_blas, to_numpy, QUIET_PARALLEL_MIN_ELEMENTS)
from .layers.loss import IGNORE_INDEX

__all__ = ["DataParallel", "use_data_parallel", "runner_for", "SMALL_MODEL_PARAMS"]

#: :func:`use_data_parallel` picks threads over the batch below this many trainable
#: parameters. Measured on 2 cores (``benchmarks/bench_train.py``): char-small (0.8M) is bound
#: by per-operation overhead and gains ~1.4x; gpt2-124M is 70% large matrix products, which
#: the BLAS threads well by itself, and an extra gradient buffer per thread would cost 0.5 GB.
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


def runner_for(model, data_parallel: str, batch_size: int):
    """``(runner, context)`` for a training loop: a :class:`DataParallel` and itself (its
    context holds BLAS to one thread per worker), or the model and a null context.

    Args:
        data_parallel: ``"on"``, ``"off"`` or ``"auto"`` (:func:`use_data_parallel`).
    """
    if data_parallel == "on" or (data_parallel == "auto" and use_data_parallel(model, batch_size)):
        dp = DataParallel(model)
        if dp.threads > 1:
            return dp, dp
    return model, contextlib.nullcontext()


class DataParallel:
    """Run a training step's forward and backward on row slices of the batch, one per thread.

    Args:
        model: a :class:`~pedestrian.model.GPT` (NumPy or torch backend, any dtype, with or
            without LoRA adapters). It is not copied: the slices share its parameters, and
            the summed gradients land in the model's own gradient buffers.
        threads: number of slices / threads; default :func:`pedestrian.backend.num_threads`
            (``PEDESTRIAN_NUM_THREADS`` or the usable cores). A batch of ``B`` rows uses
            ``min(threads, B)`` of them; with one, the calls go straight to the model.

    Memory: one extra gradient buffer (the size of the trainable parameters) per thread
    beyond the first, plus each thread's activations for its rows (together about what the
    whole batch needs). Worth it for small models, where the step is bound by per-operation
    overhead (measured: ``benchmarks/bench_train.py``); for large ones the BLAS threads its
    big products well on its own.

    Raises:
        ValueError: ``threads`` not an integer >= 1.
    """

    def __init__(self, model, threads: int | None = None):
        if threads is None:
            threads = num_threads()
        elif isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        threads = int(threads)
        self.model = model
        self.threads = threads
        self._slices: list = []
        self._n_used = 0                        # slices used by the last loss(); 0 = none yet
        self._contexts: list = []

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
        """
        tokens_np, targets_np = to_numpy(tokens), to_numpy(targets)        # lists too
        n = min(self.threads, tokens_np.shape[0]) if tokens_np.ndim == 2 else 1
        if n <= 1 or targets_np.shape != tokens_np.shape:
            self._n_used = 1                    # one slice, or let the model report the error
            return self.model.loss(tokens, targets)
        self._sync(n)
        bounds = [tokens_np.shape[0] * s // n for s in range(n + 1)]
        n_total = int(np.count_nonzero(targets_np != IGNORE_INDEX))
        seeds = None
        if self.model.training and self.model.config.dropout > 0:
            seeds = self.model.dropout_rng.integers(0, 2**63 - 1, size=n)
        for s, part in enumerate(self._slices[:n]):
            part._loss_n_total = n_total
            if seeds is not None:
                part.dropout_rng = np.random.default_rng(int(seeds[s]))

        def job(s: int) -> float:
            lo, hi = bounds[s], bounds[s + 1]
            return self._slices[s].loss(_rows(tokens, lo, hi), _rows(targets, lo, hi))

        self._n_used = 0                        # until every slice has its forward
        losses = self._run(n, job)
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
        if self._n_used == 1:
            return self.model.backward()
        n = self._n_used
        self._run(n, lambda s: self._slices[s].backward())
        trained = ([] if self.model.freeze_base else ["_grad_base"]) \
            + ([] if self.model._lora is None else ["_grad_lora"])
        for name in trained:                    # slice 0 wrote the model's own buffers
            others = [getattr(part, name).flat for part in self._slices[1:n]]
            _sum_into(getattr(self.model, name).flat, others)
        return self.model.grads

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
            part._grad_buffers()

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
            results, error = [None] * n, None
            try:
                results[0] = work(0)
            except BaseException as exc:        # noqa: BLE001 -- re-raised below, after the others
                error = exc
            for s, f in enumerate(futures, start=1):
                try:
                    results[s] = f.result()
                except BaseException as exc:    # noqa: BLE001
                    error = error or exc
        if error is not None:
            raise error
        return results


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

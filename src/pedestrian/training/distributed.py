"""Several processes training one model: the process group as the training loop sees it.

Data parallelism over *ranks* (processes, on one machine or many), with ``torch.distributed``
(gloo on CPUs, NCCL on GPUs), started by PyTorch's own launcher (``torchrun``, or
``pedestrian train --nproc N``, which calls the same launcher in-process). Each rank holds a full
replica of the model and runs the hand-derived forward and backward on its share of every batch;
then the ranks add their gradients with one ``all_reduce`` of the flat gradient buffer per
optimizer step, and every rank takes the same AdamW step.

**Identical global batches.** Every rank draws the *same* global batch of ``B`` rows from the
same data RNG (seeded identically, saved in the checkpoint) and takes its own rows: rank ``r``
of ``W`` takes rows ``B·r//W … B·(r+1)//W`` (:meth:`SingleProcess.rows`). Each rank divides its
loss by the number of counted targets of the *whole* step -- every row of every global
micro-batch (``model.loss(..., n_total=N)``, the ignore index respected; every rank counts the
same global batches, :func:`pedestrian.training.loop.train_step`) -- so the sum over ranks and
micro-batches is the step's mean loss and gradient::

    L = (1/N) Σ_rows ℓ_row = Σ_r L_r,   ∂L/∂θ = Σ_r ∂L_r/∂θ      (one all_reduce, SUM)

Dropout masks are drawn *per global row* (:class:`RowKeyedRNG`), so a row gets the same mask
however the batch is split over ranks. A run with ``W`` ranks therefore computes what one process computes with the same
``B``, up to the order of float additions.

**The interface** (the loop never asks for the world size; one process is :class:`SingleProcess`,
several :class:`TorchProcessGroup`, with the same methods)::

    group.rank, group.world_size, group.is_writer (rank 0), group.device
    group.rows(B)                  this rank's rows of a global batch (a slice)
    group.sum_buffers(buffers)     all_reduce SUM in place: the flat gradient buffers
    group.sum(values)              floats summed over ranks (the loss, validation losses)
    group.max(value)               an int's maximum over ranks (the stop decision)
    group.broadcast(obj)           rank 0's object (the tokenizer)
    group.broadcast_buffers(arrays)  rank 0's arrays, in place (the initial parameters)
    group.close()

A rank that dies (or stops answering for ``timeout`` seconds) makes the next collective of the
others fail; they raise :class:`CommunicationError`, and :func:`pedestrian.training.train` turns it
into one error naming the last checkpoint.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
import uuid

import numpy as np

from ..atomic import write_file
from ..backend import is_torch_array

__all__ = ["SingleProcess", "TorchProcessGroup", "CommunicationError", "RowKeyedRNG", "process_group",
           "launched_rank", "require_torch", "launch", "LaunchFailure", "record_error", "reports_to_launcher",
           "TORCH_EXTRA", "DEVICES"]

#: the pip extra that brings PyTorch (pyproject.toml)
TORCH_EXTRA = 'pip install -e ".[torch]"'
#: ``--device`` choices
DEVICES = ("cpu", "cuda")
#: set by :func:`launch` in the ranks' environment: they report errors to the launcher, which
#: prints one line for the whole run
_LAUNCHED_BY_PEDESTRIAN = "PEDESTRIAN_LAUNCHED"


class CommunicationError(RuntimeError):
    """A collective operation failed: another rank died, was killed, or did not answer in time."""


# ---------------------------------------------------------------------------------------- dropout
class RowKeyedRNG:
    """Stands in for ``model.dropout_rng``: dropout masks keyed by the global row, so a row gets
    the same mask however a batch is split over threads or ranks.

    ``random(shape)`` (the one method the dropout layers call) returns a ``shape`` array of
    uniform floats in ``[0, 1)`` whose row ``b`` (first axis) is
    ``np.random.default_rng([*key, call, first_row + b]).random(shape[1:])``, where ``call``
    counts this object's calls (the model's dropout sites in forward order).

    The training loop makes one per micro-batch with ``key = (seed, step, micro_batch)`` and
    ``first_row`` = the first global row this process computes; a batch split hands each slice
    :meth:`rows_from` its offset. A resumed run redraws the same masks from ``(seed, step)``
    alone: no generator state needs saving.
    """

    def __init__(self, key: tuple, first_row: int = 0, calls: int = 0):
        self.key = tuple(int(k) for k in key)
        if any(k < 0 for k in self.key) or first_row < 0:
            raise ValueError(f"RowKeyedRNG key and first_row must be >= 0, got {self.key}, {first_row}")
        self.first_row, self.calls = int(first_row), int(calls)

    def random(self, shape) -> np.ndarray:
        shape = tuple(int(n) for n in shape)
        out = np.empty(shape)
        for b in range(shape[0]):
            np.random.default_rng([*self.key, self.calls, self.first_row + b]).random(out=out[b])
        self.calls += 1
        return out

    def rows_from(self, offset: int) -> "RowKeyedRNG":
        """The generator of the rows from ``offset`` on (a slice of this one's batch), at the
        same call count."""
        return RowKeyedRNG(self.key, self.first_row + offset, self.calls)

    def __repr__(self) -> str:
        return f"RowKeyedRNG(key={self.key}, first_row={self.first_row}, calls={self.calls})"


# ---------------------------------------------------------------------------------------- groups
class SingleProcess:
    """The process group of a run in one process: rank 0 of 1, every collective the identity.

    Args:
        device: where the model's arrays live (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
    """

    rank, world_size, local_rank, local_world_size = 0, 1, 0, 1

    def __init__(self, device: str = "cpu"):
        self.device = device

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes every file of a run (checkpoints, log, plot) and prints."""
        return self.rank == 0

    def rows(self, batch_size: int) -> slice:
        """This rank's rows of a global batch of ``batch_size``: ``B·r//W … B·(r+1)//W``."""
        W, r = self.world_size, self.rank
        return slice(batch_size * r // W, batch_size * (r + 1) // W)

    def sum_buffers(self, buffers: list, what: str = "the gradients") -> None:
        """Sum each array over the ranks, in place (the flat gradient buffers)."""

    def sum(self, values: list, what: str = "the loss") -> list[float]:
        """Each float summed over the ranks."""
        return [float(v) for v in values]

    def max(self, value: int, what: str = "the stop decision") -> int:
        """An integer's maximum over the ranks."""
        return int(value)

    def broadcast(self, obj, what: str = "the setup"):
        """Rank 0's ``obj`` (any picklable object), on every rank."""
        return obj

    def broadcast_buffers(self, buffers: list, what: str = "the parameters") -> None:
        """Overwrite each array with rank 0's, in place."""

    def close(self) -> None:
        """Leave the group."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank {self.rank} of {self.world_size}, device {self.device})"


class TorchProcessGroup(SingleProcess):
    """One rank of a ``torch.distributed`` process group (:func:`process_group` makes it).

    Collectives on NumPy buffers go through gloo on tensors that share their memory
    (``torch.from_numpy``: no copy); torch tensors (CPU or GPU) are passed as they are.

    Raises (every method): :class:`CommunicationError` when the collective fails (a rank died or
    timed out), naming what was being exchanged.
    """

    def __init__(self, rank: int, world_size: int, local_rank: int, local_world_size: int, device: str,
                 backend: str):
        super().__init__(device)
        self.rank, self.world_size = rank, world_size
        self.local_rank, self.local_world_size = local_rank, local_world_size
        self.backend = backend
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        # gloo reduces CPU tensors, NCCL those on this rank's GPU
        self._comm_device = torch.device(device) if backend == "nccl" else torch.device("cpu")

    def _run(self, what: str, op):
        try:
            return op()
        except RuntimeError as exc:                      # DistBackendError, gloo's connection errors
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CommunicationError(f"rank {self.rank} of {self.world_size} lost contact with the other "
                                     f"ranks while exchanging {what} ({detail[:200]})") from exc

    def _tensor(self, a):
        return a if is_torch_array(a) else self._torch.from_numpy(a)

    def sum_buffers(self, buffers, what="the gradients"):
        sum_op = self._dist.ReduceOp.SUM
        for a in buffers:
            self._run(what, lambda: self._dist.all_reduce(self._tensor(a), op=sum_op))

    def sum(self, values, what="the loss"):
        t = self._torch.tensor([float(v) for v in values], dtype=self._torch.float64, device=self._comm_device)
        self._run(what, lambda: self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM))
        return [float(v) for v in t.cpu().tolist()]

    def max(self, value, what="the stop decision"):
        t = self._torch.tensor([int(value)], dtype=self._torch.int64, device=self._comm_device)
        self._run(what, lambda: self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX))
        return int(t.item())

    def broadcast(self, obj, what="the setup"):
        box = [obj]
        self._run(what, lambda: self._dist.broadcast_object_list(box, src=0, device=self._comm_device))
        return box[0]

    def broadcast_buffers(self, buffers, what="the parameters"):
        for a in buffers:
            self._run(what, lambda: self._dist.broadcast(self._tensor(a), src=0))

    def close(self):
        if self._dist.is_initialized():
            self._dist.destroy_process_group()


def launched_rank() -> bool:
    """Whether this process is one rank of several started by a launcher (``torchrun``,
    ``pedestrian train --nproc``): its environment names a ``RANK`` and a ``WORLD_SIZE`` > 1."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def require_torch(what: str):
    """``torch.distributed``, or a :class:`ValueError` of one line saying what to install."""
    try:
        import torch.distributed as dist
    except ImportError:
        raise ValueError(f"{what} needs PyTorch (torch.distributed starts and connects the processes), "
                         f"which is not installed: install it with {TORCH_EXTRA}, or train in one process "
                         "(leave out --nproc)") from None
    return dist


def process_group(device: str = "cpu", timeout: float = 300.0) -> SingleProcess:
    """The process group of this process: a :class:`TorchProcessGroup` when a launcher started it
    as one of several ranks (:func:`launched_rank`; the environment of ``torchrun``: ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), else :class:`SingleProcess`.

    Several ranks: ``torch.distributed.init_process_group`` with gloo on CPUs, NCCL on GPUs (each
    rank then uses ``cuda:LOCAL_RANK``), and ``timeout`` seconds for every collective. Unless
    ``PEDESTRIAN_NUM_THREADS`` is set, each rank gets ``cores // ranks on this machine`` threads.

    Args:
        device: ``"cpu"`` or ``"cuda"`` (``--device``).
        timeout: seconds a rank waits in a collective for the others before failing.

    Raises:
        ValueError: PyTorch missing; ``cuda`` asked for but not available.
    """
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {DEVICES}, got {device!r}")
    if not launched_rank():
        if device == "cuda":
            _check_cuda()
        return SingleProcess(device)
    dist = require_torch("several ranks")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if "PEDESTRIAN_NUM_THREADS" not in os.environ:      # the cores are shared by the ranks on this machine
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
        os.environ["PEDESTRIAN_NUM_THREADS"] = str(max(1, cores // local_world_size))
    if device == "cuda":
        import torch

        _check_cuda()
        torch.cuda.set_device(local_rank)
        backend, device = "nccl", f"cuda:{local_rank}"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
    return TorchProcessGroup(rank, world_size, local_rank, local_world_size, device, backend)


def _check_cuda() -> None:
    try:
        import torch
    except ImportError:
        raise ValueError(f"--device cuda needs PyTorch with CUDA: install it ({TORCH_EXTRA}, or the CUDA build "
                         "from pytorch.org), or use --device cpu") from None
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: PyTorch sees no CUDA GPU here (torch.cuda.is_available() is False); "
                         "use --device cpu")


# ---------------------------------------------------------------------------------------- errors
def record_error(message: str, lost_contact: bool = False, crashed: bool = False) -> None:
    """Write a rank's error where PyTorch's launcher reads it (``TORCHELASTIC_ERROR_FILE``, the
    JSON of ``torch.distributed.elastic``'s error files), so the launcher can report it.

    Its kind (``extraInfo["pedestrian"]``, read by the launcher's report): ``"error"`` (an error
    of this rank's own, ``message`` is the whole line), ``"lost_contact"`` (another rank failed
    first), ``"crash"`` (an unexpected exception; its traceback follows on stderr)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    kind = "lost_contact" if lost_contact else "crash" if crashed else "error"
    data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time())), "pedestrian": kind}}}
    try:                      # whole or absent: the launcher may read it while this rank is stopped
        write_file(path, json.dumps(data), what="the launcher's error file")
    except OSError:  # pragma: no cover - the launcher's folder is gone
        pass


def reports_to_launcher() -> bool:
    """Whether this rank was started by ``pedestrian train --nproc``: it then prints no error
    line itself (the launcher prints one for the run, from :func:`record_error`)."""
    return launched_rank() and os.environ.get(_LAUNCHED_BY_PEDESTRIAN) == "1"


# ---------------------------------------------------------------------------------------- launcher
class LaunchFailure(ValueError):
    """A rank failed; ``str()`` is the one line to print, ``interrupted`` says the ranks stopped
    on Ctrl-C / SIGTERM (each saved its checkpoint and said so)."""

    def __init__(self, message: str, interrupted: bool = False):
        super().__init__(message)
        self.interrupted = interrupted


def launch(nproc: int, argv: list[str], describe_checkpoint, *, shutdown_timeout: int = 120) -> None:
    """Start ``nproc`` ranks of ``python -m pedestrian ARGV`` on this machine with PyTorch's
    launcher (``torch.distributed.launcher.api.elastic_launch``, what ``torchrun --standalone``
    runs: a c10d rendezvous on a free local port; it starts, watches and stops the processes).

    Each rank gets ``OMP_NUM_THREADS`` and ``PEDESTRIAN_NUM_THREADS`` of ``cores // nproc`` unless
    they are set. On Ctrl-C or SIGTERM the launcher passes the signal on; the ranks finish their
    step and save (``shutdown_timeout`` seconds, then they are killed; the checkpoint files are
    written atomically, so a kill leaves the previous one).

    Args:
        describe_checkpoint: ``() -> str``, what is on disk now (for the failure message).

    Raises:
        ValueError: PyTorch missing (one line naming the extra to install).
        LaunchFailure: a rank failed or was killed (one line: which, why, the last checkpoint).
    """
    require_torch(f"--nproc {nproc}")
    import logging

    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    env = {_LAUNCHED_BY_PEDESTRIAN: "1", "OMP_NUM_THREADS": str(max(1, cores // nproc)),
           "PEDESTRIAN_NUM_THREADS": str(max(1, cores // nproc))}
    saved = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if k == _LAUNCHED_BY_PEDESTRIAN or k not in os.environ:
            os.environ[k] = v
    # the launcher's own log lines (each of its modules sets its level): its failures come back
    # as exceptions, and the one line printed for them says what the user needs
    quiet = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
             if name.startswith("torch.distributed.elastic")]
    old_levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1, logs_specs=DefaultLogsSpecs(), shutdown_timeout=shutdown_timeout)
    try:
        elastic_launch(config, sys.executable)("-m", "pedestrian", *argv)
    except ChildFailedError as exc:
        raise LaunchFailure(*_failure_line(exc.failures, nproc, describe_checkpoint)) from None
    except SignalException as exc:
        raise LaunchFailure(f"stopped by {signal.Signals(exc.sigval).name}; {describe_checkpoint()}",
                            interrupted=True) from None
    finally:
        for q, level in zip(quiet, old_levels):
            q.setLevel(level)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _failure_line(failures: dict, nproc: int, describe_checkpoint) -> tuple[str, bool]:
    """The one line for a failed launch, naming the rank that failed first for a cause of its own.

    ``failures``: ``{rank: ProcessFailure}`` in the order the launcher saw the ranks end. Once one
    rank fails the launcher sends SIGTERM to the others, and the others lose contact with it, so
    a rank killed by SIGTERM without a record of its own, or one that lost contact, is a
    consequence. The cause, in this order: a rank's own error message or recorded exception
    (:func:`record_error`, even if the launcher then killed it while it was exiting), then a rank
    that ended on its own (an exit code, a signal other than SIGTERM), then the consequences --
    within each, the earliest (the records' times, which the ranks wrote; else the launcher's
    order, exact between its polls, by rank within one). Every rank stopped on a signal (exit
    130) is an interrupt (``True``)."""
    def kind(f):
        data = f.error_file_data.get("message") if isinstance(f.error_file_data, dict) else None
        return data.get("extraInfo", {}).get("pedestrian") if isinstance(data, dict) else None

    def text(f):
        data = f.error_file_data["message"]
        return data["message"] if isinstance(data, dict) else str(data)

    ranks = sorted(failures)
    # every rank stopped on a signal: each saved and exited 130, or had already left its training
    # loop (its own handlers gone) when the launcher, seeing a rank end with 130, sent it SIGTERM
    stopped = [r for r in ranks if failures[r].exitcode == 130]
    if stopped and all(r in stopped or failures[r].exitcode == -signal.SIGTERM for r in ranks):
        return f"every rank stopped on a signal; {describe_checkpoint()}", True
    order = list(failures)

    def cause(r):
        f, k = failures[r], kind(failures[r])
        if k in ("error", "crash"):                     # the times the ranks wrote their records
            return 0, f.timestamp, order.index(r)
        own = k is None and f.exitcode != -signal.SIGTERM
        return 1 if own else 2, 0, order.index(r)       # no record: the launcher's order

    r = min(failures, key=cause)
    f, k = failures[r], kind(failures[r])
    if k in ("error", "lost_contact"):                  # whole lines, naming what is on disk
        return text(f), False
    if k == "crash":
        return f"{text(f)} and the run stopped; {describe_checkpoint()}", False
    how = f"was killed by {f.signal_name()}" if f.exitcode < 0 else f"ended with exit code {f.exitcode}"
    return f"rank {r} of {nproc} {how} and the run stopped; {describe_checkpoint()}", False

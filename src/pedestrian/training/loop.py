"""The training loop shared by ``pedestrian train`` and ``pedestrian finetune``: take a step
(:func:`pedestrian.training.step.train_step`), count the skipped ones, decide when to stop.

The loop (:class:`Trainer`) holds only what every run needs: take a step, count the skipped ones,
ask :meth:`Trainer.should_stop` -- the one place where the loop decides to stop -- and call the
callbacks of two events, ``"step_end"`` and ``"stop"``. Logging, progress, validation,
checkpoints and the time guard are small callback objects in this module
(:class:`StepLog`, :class:`Progress`, :class:`Evaluation`, :class:`Checkpoints`,
:class:`TimeGuard`, :func:`finish`); :func:`pedestrian.training.train` and
:func:`pedestrian.finetune.finetune` wire them. Every file goes through one object, ``files``
(:class:`pedestrian.training.RunFiles`).

Several processes (:mod:`pedestrian.distributed`): every rank gets the same global micro-batches
and computes its rows of each (``rows = group.rows(B)``), dividing by the counted targets ``n``
of the whole step (all ranks, all micro-batches); the gradients and the loss are summed over the
ranks between the backward and the norm (:func:`train_step`), so every rank sees the same
numbers and takes the same update. The loop never asks how many ranks there are: one process has a
:class:`~pedestrian.distributed.SingleProcess` group whose sums are the identity. Stop decisions
are agreed (:meth:`Trainer.should_stop`: the most urgent reason of any rank wins, through one tiny
all_reduce), and a rank that writes nothing gets a ``files`` object that does nothing.

Dropout: with a ``dropout_seed`` the loop gives the model a
:class:`~pedestrian.distributed.RowKeyedRNG` per micro-batch, keyed by ``(seed, step,
micro-batch)`` and the global row, so masks depend neither on how the batch is split (threads,
ranks) nor on anything but the step: a resumed run draws the same masks.

Interruptions: while :meth:`Trainer.run` runs in the main thread, ``Ctrl-C`` (SIGINT) and SIGTERM
only record a stop request (:func:`request_stop`, which a closed stdout also calls); the step in
progress finishes, then the ``"stop"`` callbacks save a checkpoint of it. A second ``Ctrl-C``
stops at once (``KeyboardInterrupt``), keeping the last saved checkpoint.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import threading
import time
from typing import Any, Callable


from ..finite import finite_or_none
from .optim import AdamW
from ..distributed import SingleProcess
from .step import (TrainingError, empty_like, estimate_loss, non_finite_tensors, skip_reason, state_is_finite,
                   train_step)


log = logging.getLogger("pedestrian.train")

#: stop requests of this process (signal names, "stdout closed"), read at each decision point;
#: cleared when a :class:`Trainer` is made
_stop_requests: list[str] = []


def request_stop(reason: str) -> None:
    """Ask the running loop to stop after the step in progress, as ``Ctrl-C`` does: it saves a
    checkpoint of that step and returns ``"interrupted"``. Safe to call from a signal or
    logging handler; a request made before the loop starts is seen at its first step."""
    if reason not in _stop_requests:
        _stop_requests.append(reason)


STOP_REASONS = ("max_steps", "stop_step", "max_minutes", "non_finite", "interrupted")


class Trainer:
    """Steps until a stop; logging, validation, checkpoints and the rest are callbacks.

    Args:
        runner: the model, or a :class:`~pedestrian.training.parallel.DataParallel` over it.
        optimizer: :class:`~pedestrian.training.optim.AdamW` over the model's trainable buffers.
        schedule: ``schedule(step) -> lr`` (e.g. :class:`~pedestrian.training.optim.CosineSchedule`).
        next_batches: ``() -> [(x, y), ...]``, the global micro-batches of one step (the same on
            every rank).
        step: steps done before this run (a resumed run's checkpoint step).
        end: the last step; ``end_reason`` is the stop reason when it is reached.
        grad_clip: global gradient-norm threshold (0 = off).
        max_skipped_steps: stop after this many skipped steps in a row (module docstring).
        tokens_per_step: for the tokens/s figures (of the whole global batch).
        context: entered around every model pass (DataParallel's one-BLAS-thread-per-slice).
        skipped_total: skipped steps before this run (from the checkpoint).
        group: the process group (:mod:`pedestrian.distributed`); ``None``: one process.
        dropout_seed: draw dropout masks keyed by ``(dropout_seed, step, micro-batch)`` and the
            global row (module docstring); ``None``: from the model's own ``dropout_rng``.

    Attributes the callbacks read (and some write): ``step``, ``lr``, ``loss``, ``grad_norm``,
    ``skipped`` (the last step's reason, or ``None``), ``skipped_in_a_row``, ``skipped_total``,
    ``val_loss``, ``last_eval``, ``last_save``, ``step_seconds``, ``steps_this_run``,
    ``stop_reason``, ``batches`` (the last step's global micro-batches), ``stop_checks`` (extra
    ``trainer -> reason or None``, e.g. the time guard; a reason from :data:`STOP_REASONS`), ``group``.
    """

    def __init__(self, runner, optimizer: AdamW, schedule: Callable[[int], float],
                 next_batches: Callable[[], list], *, step: int, end: int, end_reason: str = "max_steps",
                 grad_clip: float = 0.0, max_skipped_steps: int = 5, tokens_per_step: int = 0,
                 context=None, skipped_total: int = 0, group=None, dropout_seed: int | None = None):
        import contextlib

        self.runner, self.optimizer, self.schedule, self.next_batches = runner, optimizer, schedule, next_batches
        self.step, self.end, self.end_reason = step, end, end_reason
        self.grad_clip, self.max_skipped_steps = grad_clip, max_skipped_steps
        self.tokens_per_step = tokens_per_step
        self.context = context if context is not None else contextlib.nullcontext()
        self.group = SingleProcess() if group is None else group
        self.dropout_seed = dropout_seed
        self.accum: list | None = None              # gradient-accumulation buffers (k > 1)
        self.lr = math.nan
        self.loss = self.grad_norm = self.val_loss = math.nan
        self.skipped: str | None = None
        self.skipped_in_a_row, self.skipped_total = 0, skipped_total
        self.last_eval = self.last_save = -1
        self.step_seconds, self.steps_this_run = 0.0, 0
        self.t_loop = time.perf_counter()
        self.stop_reason: str | None = None
        self.interrupted_by = ""                    # the first stop request ("SIGINT", "stdout closed")
        self.stop_checks: list[Callable[["Trainer"], str | None]] = []
        self.batches: list = []                     # the last step's micro-batches
        self._callbacks: dict[str, list] = {"step_end": [], "stop": []}
        _stop_requests.clear()                      # a new run starts without requests

    def on(self, event: str, *callbacks: Callable[["Trainer"], Any]) -> "Trainer":
        """Call ``callback(trainer)`` at each ``event`` (``"step_end"`` or ``"stop"``), in order."""
        self._callbacks[event].extend(callbacks)
        return self

    def trigger(self, event: str) -> None:
        for callback in self._callbacks[event]:
            callback(self)

    def should_stop(self) -> str | None:
        """The one decision point, before every step: a stop reason, or ``None`` to go on.

        ``"interrupted"`` (a stop request: SIGINT, SIGTERM, a closed stdout), ``"non_finite"``
        (``max_skipped_steps`` skipped in a row), ``end_reason`` (``end`` reached), then the
        :attr:`stop_checks` (``"max_minutes"``). With several ranks every rank gets the most
        urgent reason any of them found (:data:`STOP_REASONS`).

        Raises:
            CommunicationError: another rank failed.
        """
        reason = self._own_reason()
        agreed = self.group.max(STOP_REASONS.index(reason) + 1 if reason else 0)
        if agreed and STOP_REASONS[agreed - 1] == "interrupted" and not self.interrupted_by:
            self.interrupted_by = "another rank"
        return STOP_REASONS[agreed - 1] if agreed else None

    def _own_reason(self) -> str | None:
        if _stop_requests:
            self.interrupted_by = _stop_requests[0]
            return "interrupted"
        if self.skipped_in_a_row >= self.max_skipped_steps:
            return "non_finite"
        if self.step >= self.end:
            return self.end_reason
        for check in self.stop_checks:
            reason = check(self)
            if reason:
                return reason
        return None

    def run(self) -> str:
        """Run steps until :meth:`should_stop` says why; call the ``"stop"`` callbacks; return
        the reason (also in :attr:`stop_reason`). The model's own ``dropout_rng`` is back in
        place afterwards.

        Raises:
            CommunicationError: another rank failed (nothing is written after it).
        """
        old_handlers = _install_stop_handlers()
        own_rng = getattr(self.runner, "dropout_rng", None)
        try:
            self.t_loop = time.perf_counter()
            while (reason := self.should_stop()) is None:
                self.lr = self.schedule(self.step)
                self.batches = batches = self.next_batches()
                if len(batches) > 1 and self.accum is None:
                    self.accum = [empty_like(g.grads) for g in self.optimizer.groups]
                key = None if self.dropout_seed is None else (self.dropout_seed, self.step)
                t0 = time.perf_counter()
                with self.context:
                    self.loss, self.grad_norm = train_step(self.runner, self.optimizer, batches, self.lr,
                                                           self.grad_clip, self.accum, self.group, key)
                self.step_seconds = time.perf_counter() - t0
                self.step += 1
                self.steps_this_run += 1
                self._count_skip()
                self.trigger("step_end")
            self.stop_reason = reason
            self.trigger("stop")
            return reason
        finally:
            if own_rng is not None:
                self.runner.dropout_rng = own_rng
            _restore_handlers(old_handlers)

    def _count_skip(self) -> None:
        self.skipped = skip_reason(self.loss, self.grad_norm, self.grad_clip, self.optimizer)
        if self.skipped is None:
            self.skipped_in_a_row = 0
            return
        self.skipped_in_a_row += 1
        self.skipped_total += 1
        log.warning(f"step {self.step}: {self.skipped}; the update is skipped (weights and AdamW moments "
                    f"unchanged), {self.skipped_in_a_row} in a row (the run stops at "
                    f"{self.max_skipped_steps}: --max-skipped-steps)")

    def tokens_per_second(self) -> float:
        """Mean training throughput of this run so far (validation and saving included)."""
        return self.tokens_per_step * self.steps_this_run / max(time.perf_counter() - self.t_loop, 1e-9)

    def non_finite_message(self, kept: str) -> str:
        """The error of a ``"non_finite"`` stop; ``kept`` says which checkpoint is the last good
        one (:meth:`Checkpoints.kept` with ``good=True``)."""
        first = self.step - self.skipped_in_a_row + 1
        steps = f"step {first}" if first == self.step else f"steps {first}-{self.step}"
        return (f"{self.skipped} and {self.skipped_in_a_row} step(s) in a row were skipped ({steps}), "
                f"so the run stopped; {kept}. Lower --lr or --grad-clip and start again (--overwrite, "
                "or --out NEW_DIR)")


def _install_stop_handlers() -> dict:
    """SIGINT / SIGTERM call :func:`request_stop` (the loop stops between steps); a second
    SIGINT raises ``KeyboardInterrupt`` at once. Only possible in the main thread: elsewhere
    nothing is installed (and a ``KeyboardInterrupt`` ends the run without a save)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, frame):
        if _stop_requests and signum == signal.SIGINT:
            raise KeyboardInterrupt
        request_stop(signal.Signals(signum).name)

    old = {}
    for sig in (signal.SIGINT, getattr(signal, "SIGTERM", None)):
        if sig is None:
            continue
        try:
            old[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):  # pragma: no cover - unusual embedding
            pass
    return old


def _restore_handlers(old: dict) -> None:
    for sig, h in old.items():
        if h is not None:
            signal.signal(sig, h)


# ---------------------------------------------------------------------------------------- callbacks
class StepLog:
    """``"step_end"``: one ``log.jsonl`` record per step: ``step``, ``loss``, ``lr``,
    ``grad_norm``, ``time_s`` (since ``t_start``), ``tokens_per_s`` (of the step itself), and
    ``"skipped": true`` for a skipped step (its non-finite numbers are written as ``null``)."""

    def __init__(self, files, t_start: float):
        self.files, self.t_start = files, t_start

    def __call__(self, t: Trainer) -> None:
        record = {"step": t.step, "loss": finite_or_none(t.loss), "lr": t.lr,
                  "grad_norm": finite_or_none(t.grad_norm),
                  "time_s": round(time.perf_counter() - self.t_start, 4),
                  "tokens_per_s": round(t.tokens_per_step / max(t.step_seconds, 1e-9), 1)}
        if t.skipped:
            record["skipped"] = True
        self.files.log(record)


class Progress:
    """``"step_end"``: a tqdm bar on stderr with the loss, the last validation loss and tokens/s."""

    def __init__(self, t: Trainer, desc: str, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=t.end, initial=t.step, desc=desc, unit="step", disable=not enabled,
                        file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

    def postfix(self, t: Trainer, refresh: bool = False) -> None:
        loss = f"{t.loss:.4f}" if math.isfinite(t.loss) else "-"
        val = f"{t.val_loss:.4f}" if math.isfinite(t.val_loss) else "-"
        self.bar.set_postfix_str(f"loss {loss}, val {val}, {t.tokens_per_second():,.0f} tok/s", refresh=refresh)

    def __call__(self, t: Trainer) -> None:
        self.bar.update(1)
        self.postfix(t)

    def close(self) -> None:
        self.bar.close()


class Evaluation:
    """Validation: the mean loss over fixed batches, dropout off (each rank its rows of each batch,
    with a ``group``); ``"step_end"`` runs it every ``interval`` steps. Writes ``{"step", "val_loss"}`` to the log; a non-finite result is
    warned about and recorded as ``null`` (it never becomes the best)."""

    def __init__(self, runner, batches, interval: int, files, progress: Progress | None = None, context=None,
                 group=None):
        import contextlib

        self.runner, self.batches, self.interval, self.files = runner, batches, interval, files
        self.progress, self.group = progress, group
        self.context = context if context is not None else contextlib.nullcontext()

    def __call__(self, t: Trainer) -> None:
        if t.step % self.interval == 0:
            self.run(t, say=True)

    def run(self, t: Trainer, say: bool = False) -> float:
        with self.context:
            loss = estimate_loss(self.runner, self.batches, self.group)
        t.val_loss, t.last_eval = loss, t.step
        self.files.log({"step": t.step, "val_loss": finite_or_none(loss)})
        if self.progress is not None:
            self.progress.postfix(t, refresh=not say)
        if not math.isfinite(loss):
            log.warning(f"step {t.step}: the validation loss is {loss}; it is not counted as the best")
        elif say:
            train = f"train loss {t.loss:.4f}, " if math.isfinite(t.loss) else ""
            log.info(f"step {t.step}: {train}val loss {loss:.4f}")
        return loss


class Checkpoints:
    """``"step_end"``: ``save(trainer)`` every ``interval`` steps, after checking that the weights
    and AdamW moments are finite (:func:`state_is_finite`; if not, :class:`TrainingError` naming
    the last good checkpoint, and nothing is written).

    Args:
        save: writes the checkpoint of the trainer's current step (and may set
            ``trainer.last_save`` as soon as the checkpoint proper is on disk).
        folder: where it goes, and name: what it is (``"checkpoint"``), for messages.
        previous: a description of what was there before this run saved anything (``None``:
            nothing), e.g. ``"the previous run in runs/x is left as it was"``.
        model: names the tensors in the message (else the flat buffers are named).
        go_on: how to go on from a saved checkpoint (the end of the message).
    """

    def __init__(self, save: Callable[[Trainer], None], interval: int, folder, previous: str | None = None,
                 name: str = "checkpoint", model=None,
                 go_on: str = "start again with a lower --lr (--overwrite, or --out NEW_DIR)"):
        self.save, self.interval, self.folder, self.previous = save, interval, folder, previous
        self.name, self.model, self.go_on = name, model, go_on

    def __call__(self, t: Trainer) -> None:
        if t.step % self.interval == 0:
            self.save_now(t)

    def save_now(self, t: Trainer) -> None:
        if not state_is_finite(t.optimizer):
            then = self.go_on if t.last_save >= 0 else "start again with a lower --lr"
            raise TrainingError(f"refusing to save a checkpoint after step {t.step}, a weight or an AdamW "
                                f"moment is not finite: {non_finite_tensors(self.model, t.optimizer)}; the run "
                                f"stopped and {self.kept(t, good=True)}. To go on, {then}")
        self.save(t)
        t.last_save = t.step

    def kept(self, t: Trainer, good: bool = False) -> str:
        """What is on disk when the run fails now (``good``: say that it is the last good one)."""
        if t.last_save >= 0:
            return f"the {self.name} of step {t.last_save} in {self.folder} is kept" + (
                " (the last good one)" if good else "")
        if self.previous:
            return f"nothing was saved ({self.previous})"
        return f"no {self.name} was written"


class TimeGuard:
    """A stop check: ``"max_minutes"`` once ``max_minutes`` since ``t_start`` are used up, keeping a
    reserve for the final validation and checkpoint (1.5 × the longest validation + save seen).
    :meth:`mark` and :meth:`measure` go around the validation and checkpoint callbacks."""

    def __init__(self, max_minutes: float | None, t_start: float):
        self.limit = None if max_minutes is None else max_minutes * 60.0
        self.t_start, self.reserve, self.t_mark = t_start, 0.0, 0.0

    def __call__(self, t: Trainer) -> str | None:
        if self.limit is not None and time.perf_counter() - self.t_start + self.reserve >= self.limit:
            return "max_minutes"
        return None

    def mark(self, t: Trainer) -> None:
        self.t_mark = time.perf_counter()

    def measure(self, t: Trainer) -> None:
        if t.last_eval == t.step or t.last_save == t.step:
            self.reserve = max(self.reserve, 1.5 * (time.perf_counter() - self.t_mark))


def finish(evaluation: Evaluation, checkpoints: Checkpoints) -> Callable[[Trainer], None]:
    """The ``"stop"`` callback: an interrupted run saves its last step as it is; a run that ended
    (its last step, the time guard) validates it unless just done and saves it unless just done;
    a ``"non_finite"`` stop writes nothing."""

    def at_stop(t: Trainer) -> None:
        if t.stop_reason == "non_finite":
            return
        if t.stop_reason != "interrupted" and (t.last_eval != t.step or not math.isfinite(t.val_loss)):
            evaluation.run(t)
        if t.last_save != t.step:
            checkpoints.save_now(t)

    return at_stop

"""The training loop shared by ``pedestrian train`` and ``pedestrian finetune``.

:meth:`Trainer.run` is the whole loop on one screen: ask whether to stop
(:meth:`Trainer.should_stop`, the one decision point), take a step
(:func:`pedestrian.training.step.train_step`), log it, validate and save a checkpoint on their
intervals; at the stop, validate and save the last step. Two things differ between callers and
are handed in: what a checkpoint holds (:class:`Checkpoints`' ``save`` function) and extra work
after a step (:meth:`Trainer.on`: ``pedestrian train``'s gradient-norm record). Every file goes
through one object, ``files`` (:class:`pedestrian.training.files.RunFiles`).

Several processes (:mod:`pedestrian.training.distributed`): every rank gets the same global micro-batches
and computes its rows of each (``rows = group.rows(B)``), dividing by the counted targets ``n``
of the whole step (all ranks, all micro-batches); the gradients and the loss are summed over the
ranks between the backward and the norm (:func:`train_step`), so every rank sees the same
numbers and takes the same update. The loop never asks how many ranks there are: one process has a
:class:`~pedestrian.training.distributed.SingleProcess` group whose sums are the identity. Stop decisions
are agreed (:meth:`Trainer.should_stop`: the most urgent reason of any rank wins, through one tiny
all_reduce), and a rank that writes nothing gets a ``files`` object that does nothing.

Dropout: with a ``dropout_seed`` the loop gives the model a
:class:`~pedestrian.training.distributed.RowKeyedRNG` per micro-batch, keyed by ``(seed, step,
micro-batch)`` and the global row, so masks depend neither on how the batch is split (threads,
ranks) nor on anything but the step: a resumed run draws the same masks.

Interruptions: while :meth:`Trainer.run` runs in the main thread, ``Ctrl-C`` (SIGINT) and SIGTERM
only record a stop request (:func:`request_stop`, which a closed stdout also calls); the step in
progress finishes, then a checkpoint of it is saved. A second ``Ctrl-C`` stops at once
(``KeyboardInterrupt``), keeping the last saved checkpoint.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..model.finite import finite_or_none
from .blockwise import blockwise_step
from .distributed import SingleProcess
from .files import NoFiles
from .optim import AdamW
from .step import (TrainingError, empty_like, estimate_loss, non_finite_tensors, skip_reason, state_is_finite,
                   train_step)

log = logging.getLogger("pedestrian.train")
_NO_FILES = NoFiles()

#: stop requests of this process (signal names, "stdout closed"), read at each decision point;
#: cleared when a :class:`Trainer` is made
_stop_requests: list[str] = []


def request_stop(reason: str) -> None:
    """Ask the running loop to stop after the step in progress, as ``Ctrl-C`` does: it saves a
    checkpoint of that step and returns ``"interrupted"``. Safe to call from a signal or
    logging handler; a request made before the loop starts is seen at its first step."""
    if reason not in _stop_requests:
        _stop_requests.append(reason)


#: stop reasons, least urgent first: when ranks disagree (a signal reached one, rank 0's time
#: guard ran out) the most urgent one wins, on every rank
STOP_REASONS = ("max_steps", "stop_step", "max_minutes", "non_finite", "interrupted")


@dataclass
class Optimization:
    """The update of a step: the optimizer, its learning-rate schedule and the gradient clip.

    Attributes:
        optimizer: :class:`~pedestrian.training.optim.AdamW` over the model's trainable buffers.
        schedule: ``schedule(step) -> lr`` (:class:`~pedestrian.training.optim.CosineSchedule`).
        grad_clip: global gradient-norm threshold (0 = off).
        in_backward: apply AdamW block by block inside the backward
            (:func:`~pedestrian.training.blockwise.blockwise_step`; ``grad_clip`` 0).
        step: another step function (DPO's, :func:`pedestrian.training.dpo.dpo_step`).
    """

    optimizer: AdamW
    schedule: Callable[[int], float]
    grad_clip: float = 0.0
    in_backward: bool = False
    #: the step function (``train_step``'s arguments; returns ``(loss, grad_norm)`` or ``(loss,
    #: grad_norm, metrics)``, the metrics logged with the step); ``None``: ``train_step``
    step: Callable | None = None


@dataclass
class Batches:
    """What the steps read: the training micro-batches, the dropout masks' seed, the fixed
    validation batches and how often they are read.

    Attributes:
        next: ``() -> [(x, y), ...]``, the global micro-batches of one step (the same on every rank).
        tokens_per_step: tokens of one global step, for the tokens/s figures.
        validation, eval_interval: the fixed validation batches, evaluated every
            ``eval_interval`` steps (0: never) and at the end (:meth:`Trainer.evaluate`).
        dropout_seed: draw dropout masks keyed by ``(dropout_seed, step, micro-batch)`` and the
            global row (module docstring); ``None``: from the model's own ``dropout_rng``.
        rng: the generator ``next`` draws with, whose state a checkpoint keeps (``None``: none).
    """

    next: Callable[[], list]
    tokens_per_step: int = 0
    validation: Sequence = ()
    eval_interval: int = 0
    dropout_seed: int | None = None
    rng: Any = None
    #: ``(model, validation, group) -> loss`` of the validation batches; ``None``: the mean
    #: cross-entropy (:func:`~pedestrian.training.step.estimate_loss`)
    estimate: Callable | None = None


@dataclass
class StopRules:
    """When the loop stops (:meth:`Trainer.should_stop` reads them before every step).

    Attributes:
        end: the last step; ``end_reason`` is the stop reason when it is reached.
        max_skipped_steps: stop after this many skipped steps in a row (``"non_finite"``).
        max_minutes, t_start: stop with ``"max_minutes"`` once ``max_minutes`` since ``t_start``
            (a ``time.perf_counter()``, default now) are used up, keeping a reserve for the final
            validation and checkpoint (1.5 × the longest validation + save seen); ``None``: no
            limit. ``t_start`` is also the origin of the log's ``time_s``.
    """

    end: int
    end_reason: str = "max_steps"
    max_skipped_steps: int = 5
    max_minutes: float | None = None
    t_start: float = field(default_factory=time.perf_counter)


class Trainer:
    """Steps until a stop, logging, validating and saving on the way.

    Args:
        model: the model (:class:`~pedestrian.model.GPT`).
        optimization: the optimizer, its schedule and the clip (:class:`Optimization`).
        batches: what the steps read (:class:`Batches`).
        stop: when to stop (:class:`StopRules`).
        checkpoints: the run's files (:class:`Checkpoints`: the log and what a checkpoint holds);
            ``None``: nothing is written. An attribute: a caller may set it after building the
            trainer (the run's files are opened last).
        group: the process group (:mod:`pedestrian.training.distributed`); ``None``: one process.
        progress: the label of a progress bar on stderr; ``None``: no bar.

    A resumed run starts at its checkpoint's step: :meth:`resume`. :func:`pedestrian.training.job.build_trainer`
    builds all of it from a run's settings, for ``pedestrian train`` and ``pedestrian finetune`` alike.

    Attributes a caller reads (the ``save`` function and the ``on`` callbacks too): ``step``,
    ``lr``, ``loss``, ``grad_norm``, ``skipped`` (the last step's reason, or ``None``),
    ``skipped_in_a_row``, ``skipped_total``, ``val_loss``, ``last_eval``, ``last_save``,
    ``stop_reason``, ``interrupted_by``, ``batches`` (the last step's global micro-batches).
    """

    def __init__(self, model, optimization: Optimization, batches: Batches, stop: StopRules,
                 checkpoints: Checkpoints | None = None, *, group=None, progress: str | None = None):
        self.model, self.optimization, self.data, self.stop = model, optimization, batches, stop
        self.checkpoints = checkpoints              # may be given later: the run's files open last
        self.group = SingleProcess() if group is None else group
        self.progress = progress
        self.step = 0
        self.reserve = 0.0                          # seconds kept for the final validation and save
        self.accum: list | None = None              # gradient-accumulation buffers (k > 1)
        self.lr = math.nan
        self.loss = self.grad_norm = self.val_loss = math.nan
        self.skipped: str | None = None
        self.skipped_in_a_row, self.skipped_total = 0, 0
        self.last_eval = self.last_save = -1
        self.step_seconds, self.steps_this_run = 0.0, 0
        self.t_loop = self.t_warm = time.perf_counter()
        self.stop_reason: str | None = None
        self.interrupted_by = ""                    # the first stop request ("SIGINT", "stdout closed")
        self.batches: list = []                     # the last step's micro-batches
        self.metrics: dict = {}                     # the last step's own numbers (DPO's margin, accuracy)
        self.after_step: list[Callable[[Trainer], Any]] = []
        self.bar = None                             # the progress bar while run() runs
        _stop_requests.clear()                      # a new run starts without requests

    def resume(self, step: int, skipped_total: int = 0) -> "Trainer":
        """Start after ``step`` steps, ``skipped_total`` of them skipped (a checkpoint's), the
        checkpoint counting as this step's validation and save."""
        self.step, self.skipped_total = step, skipped_total
        self.last_eval = self.last_save = step
        return self

    @property
    def optimizer(self) -> AdamW:
        return self.optimization.optimizer

    @property
    def files(self):
        """Where the log goes: the checkpoints' ``files``, or nothing while there are none."""
        return _NO_FILES if self.checkpoints is None else self.checkpoints.files

    def on(self, event: str, *callbacks: Callable[["Trainer"], Any]) -> "Trainer":
        """Call ``callback(trainer)`` after every step (``event`` ``"step_end"``, the only one),
        in order, after the validation of that step and before its checkpoint."""
        if event != "step_end":
            raise ValueError(f'the loop has one event, "step_end", not {event!r}')
        self.after_step.extend(callbacks)
        return self

    def run(self) -> str:
        """Run steps until :meth:`should_stop` says why, then validate and save the last step
        (an interrupted run saves it without validating; a ``"non_finite"`` stop writes nothing).
        Returns the reason (also in :attr:`stop_reason`). The model's own ``dropout_rng`` is
        back in place afterwards.

        Raises:
            TrainingError: a checkpoint refused (a weight or AdamW moment is not finite).
            CommunicationError: another rank failed (nothing is written after it).
        """
        own_rng, old_handlers = getattr(self.model, "dropout_rng", None), _install_stop_handlers()
        try:
            self.t_loop = time.perf_counter()
            while (reason := self.should_stop()) is None:
                self.lr = self.optimization.schedule(self.step)
                self.batches = self.data.next()
                t0 = time.perf_counter()
                step = self.optimization.step or (blockwise_step if self.optimization.in_backward else train_step)
                self.loss, self.grad_norm, *metrics = step(self.model, self.optimizer, self.batches, self.lr,
                                                           self.optimization.grad_clip, self._accumulator(),
                                                           self.group, self._dropout_key())
                self.metrics = metrics[0] if metrics else {}
                self.step_seconds = time.perf_counter() - t0
                self.step, self.steps_this_run = self.step + 1, self.steps_this_run + 1
                if self.steps_this_run == 1:
                    self.t_warm = time.perf_counter()
                self._count_skip()
                self.files.log(self._step_record())
                if self.bar is None:         # from the end of the first step: its compile is in
                    self.bar = self._progress_bar()      # no rate and no time left
                    self._postfix(refresh=True)
                else:                        # (the postfix first: the update draws this step's loss)
                    self._postfix()
                    self.bar.update(1)
                t_chores = time.perf_counter()
                if self.data.eval_interval and self.step % self.data.eval_interval == 0:
                    self.evaluate(say=True)
                for callback in self.after_step:
                    callback(self)
                if self.checkpoints is not None and self._checkpoint_due():
                    self.checkpoints.save_now(self)
                if self.step in (self.last_eval, self.last_save):       # the time guard's reserve
                    self.reserve = max(self.reserve, 1.5 * (time.perf_counter() - t_chores))
            self.stop_reason = reason
            if reason != "non_finite":
                if reason != "interrupted" and self.data.validation and (
                        self.last_eval != self.step or not math.isfinite(self.val_loss)):
                    self.evaluate()
                if self.checkpoints is not None and self.last_save != self.step:
                    self.checkpoints.save_now(self)
            return reason
        finally:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            if own_rng is not None:
                self.model.dropout_rng = own_rng
            _restore_handlers(old_handlers)

    def should_stop(self) -> str | None:
        """The one decision point, before every step: a stop reason, or ``None`` to go on.

        ``"interrupted"`` (a stop request: SIGINT, SIGTERM, a closed stdout), ``"non_finite"``
        (``max_skipped_steps`` skipped in a row), ``end_reason`` (``end`` reached), then
        ``"max_minutes"``. With several ranks every rank gets the most urgent reason any of them
        found (:data:`STOP_REASONS`).

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
        if self.skipped_in_a_row >= self.stop.max_skipped_steps:
            return "non_finite"
        if self.step >= self.stop.end:
            return self.stop.end_reason
        limit = self.stop.max_minutes
        if limit is not None and time.perf_counter() - self.stop.t_start + self.reserve >= limit * 60.0:
            return "max_minutes"
        return None

    def evaluate(self, say: bool = False) -> float:
        """The validation loss of this step: the mean over ``val_batches``, dropout off (each
        rank its rows of each batch). Writes ``{"step", "val_loss"}`` to the log (``say``: and
        to the logger); a non-finite result is warned about and recorded as ``null`` (it never
        becomes the best)."""
        loss = (self.data.estimate or estimate_loss)(self.model, self.data.validation, self.group)
        self.val_loss, self.last_eval = loss, self.step
        self.files.log({"step": self.step, "val_loss": finite_or_none(loss)})
        self._postfix(refresh=not say)
        if not math.isfinite(loss):
            log.warning(f"step {self.step}: the validation loss is {loss}; it is not counted as the best")
        elif say:
            train = f"train loss {self.loss:.4f}, " if math.isfinite(self.loss) else ""
            log.info(f"step {self.step}: {train}val loss {loss:.4f}")
        return loss

    def tokens_per_second(self) -> float:
        """Mean training throughput of this run so far after its first step (validation and saving
        included), tokens a second: the first step of a first run also compiles the kernels (tens
        of seconds), which no later step repeats. Before a second step: the first step's own."""
        start, steps = (self.t_loop, self.steps_this_run) if self.steps_this_run < 2 else \
            (self.t_warm, self.steps_this_run - 1)
        return self.data.tokens_per_step * steps / max(time.perf_counter() - start, 1e-9)

    def non_finite_message(self, kept: str) -> str:
        """The error of a ``"non_finite"`` stop; ``kept`` says which checkpoint is the last good
        one (:meth:`Checkpoints.kept` with ``good=True``)."""
        first = self.step - self.skipped_in_a_row + 1
        steps = f"step {first}" if first == self.step else f"steps {first}-{self.step}"
        return (f"{self.skipped} and {self.skipped_in_a_row} step(s) in a row were skipped ({steps}), "
                f"so the run stopped; {kept}. Lower --lr or --grad-clip and start again (--overwrite, "
                "or --out NEW_DIR)")

    # ---- the pieces of run()
    def _accumulator(self) -> list | None:
        if len(self.batches) > 1 and self.accum is None:
            self.accum = [empty_like(g.grads) for g in self.optimizer.groups]
        return self.accum

    def _dropout_key(self) -> tuple[int, int] | None:
        seed = self.data.dropout_seed
        return None if seed is None else (seed, self.step)

    def _checkpoint_due(self) -> bool:
        every = self.checkpoints.interval or self.data.eval_interval    # 0: at every validation
        return bool(every) and self.step % every == 0

    def _count_skip(self) -> None:
        self.skipped = skip_reason(self.loss, self.grad_norm, self.optimization.grad_clip, self.optimizer)
        if self.skipped is None:
            self.skipped_in_a_row = 0
            return
        self.skipped_in_a_row += 1
        self.skipped_total += 1
        log.warning(f"step {self.step}: {self.skipped}; the update is skipped (weights and AdamW moments "
                    f"unchanged), {self.skipped_in_a_row} in a row (the run stops at "
                    f"{self.stop.max_skipped_steps}: --max-skipped-steps)")

    def _step_record(self) -> dict:
        """The step's ``log.jsonl`` record: ``step``, ``loss``, ``lr``, ``grad_norm``, ``time_s``
        (since ``t_start``), ``tokens_per_s`` (of the step itself), and ``"skipped": true`` for a
        skipped step (its non-finite numbers are written as ``null``)."""
        record = {"step": self.step, "loss": finite_or_none(self.loss), "lr": self.lr,
                  "grad_norm": finite_or_none(self.grad_norm),
                  "time_s": round(time.perf_counter() - self.stop.t_start, 4),
                  "tokens_per_s": round(self.data.tokens_per_step / max(self.step_seconds, 1e-9), 1)}
        record.update({k: finite_or_none(v) for k, v in self.metrics.items()})
        if self.skipped:
            record["skipped"] = True
        return record

    def _progress_bar(self):
        from tqdm import tqdm

        return tqdm(total=self.stop.end, initial=self.step, desc=self.progress or "", unit="step",
                    disable=self.progress is None, file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

    def _postfix(self, refresh: bool = False) -> None:
        if self.bar is not None:
            loss = f"{self.loss:.4f}" if math.isfinite(self.loss) else "-"
            val = f"{self.val_loss:.4f}" if math.isfinite(self.val_loss) else "-"
            self.bar.set_postfix_str(f"loss {loss}, val {val}, {self.tokens_per_second():,.0f} tok/s",
                                     refresh=refresh)


class Checkpoints:
    """A run's files as the loop sees them: the log (``files``) and its checkpoints.
    :meth:`save_now` checks that the weights and AdamW moments are finite
    (:func:`state_is_finite`; if not, :class:`TrainingError` naming the last good checkpoint, and
    nothing is written), then calls ``save``.

    Args:
        files: where every file of the run goes (:class:`~pedestrian.training.files.RunFiles`;
            :class:`~pedestrian.training.files.NoFiles` on a rank that writes nothing).
        save: ``save(trainer)`` writes the checkpoint of the trainer's current step through
            ``files`` (and may set ``trainer.last_save`` as soon as the checkpoint proper is on disk).
        folder: where it goes, and name: what it is (``"checkpoint"``), for messages.
        interval: the loop saves every ``interval`` steps; 0: at every validation.
        previous: a description of what was there before this run saved anything (``None``:
            nothing), e.g. ``"the previous run in runs/x is left as it was"``.
        go_on: how to go on from a saved checkpoint after a non-finite weight (the end of that message).
        resume_command: the command that continues the run from its last checkpoint (``None``:
            the run cannot be resumed); start_again: what to do when there is nothing to resume
            (:meth:`retry`).
    """

    def __init__(self, files, save: Callable[[Trainer], None], folder, *, interval: int = 0,
                 previous: str | None = None, name: str = "checkpoint",
                 go_on: str = "start again with a lower --lr (--overwrite, or --out NEW_DIR)",
                 resume_command: str | None = None, start_again: str = "start again"):
        self.files, self.save, self.folder, self.interval = files, save, folder, interval
        self.previous, self.name, self.go_on = previous, name, go_on
        self.resume_command, self.start_again = resume_command, start_again

    def save_now(self, t: Trainer) -> None:
        if not state_is_finite(t.optimizer):
            then = self.go_on if t.last_save >= 0 else "start again with a lower --lr"
            raise TrainingError(f"refusing to save a checkpoint after step {t.step}, a weight or an AdamW "
                                f"moment is not finite: {non_finite_tensors(t.model, t.optimizer)}; the run "
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

    def retry(self, t: Trainer) -> str:
        """How to go on after a failure now: continue from the last checkpoint, or start again."""
        if self.resume_command and t.last_save >= 0:
            return f"continue with: {self.resume_command}"
        return self.start_again


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

"""``pedestrian train``: the settings, the data, and :func:`train`, which wires the shared loop.

:func:`train` runs the whole job: it builds (or resumes) the model, has
:func:`pedestrian.training.job.build_trainer` make the optimizer, schedule, batches and stop rules
from the settings (and a resumed run's state from its checkpoint), and runs the
:class:`pedestrian.training.loop.Trainer`, which logs every step to ``<out>/log.jsonl``,
evaluates a fixed set of validation batches every ``eval_interval`` steps (after which a callback
logs the norms of every block's error signals and gradients on that step's batch,
:func:`gradient_record`), keeps ``<out>/latest`` and ``<out>/best`` checkpoints (the ``save``
function here) and stops in time (``max_minutes``); :func:`train` draws
``<out>/loss_curve.png`` and ``<out>/gradients.png`` at the end. Resuming restores the parameters, the AdamW moments and
step, the data and dropout RNG states and the settings, so ``N + N`` steps reproduce ``2N``
steps bit for bit (NumPy backend; a test). The step itself (gradient accumulation, clipping,
AdamW) is :func:`pedestrian.training.step.train_step`. Plugged layers (``--layer``): checked
before the first step, matched on resume (:mod:`pedestrian.training.plugged`).

Non-finite numbers (the rule of :mod:`pedestrian.training.step`): a step whose loss or gradient norm is
NaN or inf is skipped -- no update, weights and AdamW moments untouched -- with a warning naming
the step; ``max_skipped_steps`` (default 5) skipped steps in a row stop the run with an error
that names the last good checkpoint. A non-finite validation loss never makes a "best"
checkpoint, and no checkpoint is ever written with a non-finite weight or moment.

Interruptions: while :func:`train` runs in the main thread, ``Ctrl-C`` (SIGINT) and SIGTERM only
set a flag; the step in progress finishes, then a checkpoint of that step is saved (atomically)
and :func:`train` returns with ``stop_reason`` ``"interrupted"``. Resuming from it is exact. A
second ``Ctrl-C`` stops at once (``KeyboardInterrupt``), keeping the last saved checkpoint.

``--overwrite``: the old run's ``log.jsonl`` and checkpoints are kept untouched until the new run
commits its first checkpoint; until then the new log is written to ``log.jsonl.new``.

Messages go to the logger ``pedestrian.train`` (INFO: what the run does; WARNING: skipped steps
and settings worth a second look); ``pedestrian train`` prints them, ``logging.basicConfig(level=
logging.INFO)`` shows them in a program of your own.

Several processes (ranks; :mod:`pedestrian.training.distributed`): started by ``torchrun`` or
``pedestrian train --nproc N``, :func:`train` joins the process group its environment names.
Every rank draws the same global batches of ``batch_size`` rows and computes its share of the
rows; gradients and losses are summed over the ranks once per step. Rank 0 alone writes the
log, the checkpoints and the plot, and prints; the others follow its stop decisions. A
checkpoint records the number of ranks (``meta["world_size"]``); resuming with the same number
is exact, and with another number continues the same run up to the order of float additions
(the batches and dropout masks are those of the global rows, whoever computes them).
"""

from __future__ import annotations

import logging
import math
import os
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint import Checkpoint, load_checkpoint, read_state
from ..text.data import BUNDLED_CORPUS
from .distributed import (CommunicationError, LaunchFailure, launch, launched_rank, process_group,
                          reports_to_launcher)
from ..model.finite import finite_or_none
from ..kernels.jit import threads_used
from .corpus import prepare_data
from .files import NoFiles, RunFiles, gradient_record
from .job import build_trainer, failures_explained
from .loop import Checkpoints, Trainer
from .plugged import check_layers, layer_paths, match_recorded
from .settings import TrainSettings, absolute_path, memory_plan, per_run_flags, resume_settings
from .step import TrainingError

log = logging.getLogger("pedestrian.train")

# ---------------------------------------------------------------------------------------- train
@dataclass
class TrainResult:
    """What :func:`train` did: final step, losses, timing, files."""

    step: int
    train_loss: float
    val_loss: float
    best_val_loss: float
    seconds: float
    tokens_per_second: float
    stop_reason: str
    out: Path
    model: Any = None
    tokenizer: Any = None
    is_writer: bool = True                    # rank 0 (or the only process): it wrote the files
    resume_command: str = ""                  # how to continue this run
    eval_batches: int = 0                     # the validation batches of val_loss (a resumed run: its own)


def _resumed(settings: TrainSettings, explicit: set[str], out: Path, group) -> tuple[TrainSettings, Checkpoint]:
    """The checkpoint in ``out/latest`` and the settings to go on with
    (:func:`~pedestrian.training.settings.resume_settings`: the checkpoint's own, with the
    :data:`RESUMABLE_SETTINGS` given explicitly and the :data:`PER_RUN_SETTINGS` of this
    invocation; any other explicit setting must match the checkpoint's)."""
    ckpt = load_checkpoint(out / "latest", backend=settings.backend, device=_device(settings, group))
    saved = ckpt.meta.get("settings")
    if saved is None:
        raise TrainingError(f"checkpoint {ckpt.path} was not written by `pedestrian train` "
                            "(no training settings in it); it cannot be resumed")
    try:
        saved = resume_settings(settings, TrainSettings.from_dict(saved), explicit, run=f"{out} was trained",
                                config=ckpt.config.to_dict())      # (derived widths resolved)
    except ValueError as exc:
        raise TrainingError(str(exc)) from None
    saved.validate()
    if ckpt.state.get("optimizer") is None:
        raise TrainingError(f"checkpoint {ckpt.path} holds no optimizer state; it cannot be resumed")
    if ckpt.step >= saved.max_steps:
        raise TrainingError(f"the run in {out} is at step {ckpt.step}, which already reaches --max-steps "
                            f"{saved.max_steps}; pass a larger --max-steps to train on (the cosine "
                            "schedule is stretched to it)")
    return saved, ckpt


def _device(settings: TrainSettings, group):
    """The model's device: ``None`` on the CPU, this rank's GPU with ``--device cuda``."""
    return None if settings.device == "cpu" else group.device


def _warn_other_ranks(ckpt: Checkpoint | None, group) -> None:
    """A warning when a resumed run has another number of ranks than the checkpoint's steps."""
    then = ckpt.meta.get("world_size", 1) if ckpt is not None else group.world_size
    if then != group.world_size:
        log.warning(f"the checkpoint's steps ran on {then} rank(s); this run has {group.world_size}: it "
                    "continues the same run (same batches, same dropout masks), equal up to the order of "
                    "float additions but not bit for bit; for that, resume with the same --nproc")


def launch_ranks(settings: TrainSettings, argv: list[str], resume_flags: str = "") -> bool:
    """Start the ranks ``--nproc N`` asks for, when no launcher started this process: ``N`` ranks
    of ``pedestrian ARGV`` on this machine through PyTorch's launcher
    (:func:`pedestrian.training.distributed.launch`). Under a launcher (``torchrun``, or this
    function's own ranks) nothing is started, and ``--nproc`` must be 1 or the launcher's ranks
    on this machine.

    Args:
        argv: the command line of every rank (``pedestrian``'s, without the program name).
        resume_flags: more flags for the resume command a failure prints (``" --no-sample"``).

    Returns:
        ``True`` when ranks were started and all finished; ``False`` when this process is to
        train itself (one process, or a rank).

    Raises:
        TrainingError: bad settings, an ``--nproc`` that contradicts the launcher, or a rank that
            failed (one line: which, why, the checkpoint kept and how to continue).
        LaunchFailure: ``interrupted``: the ranks stopped on Ctrl-C / SIGTERM (each saved a
            checkpoint; the message says how to continue).
    """
    if launched_rank():
        here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if settings.nproc not in (1, here):
            raise TrainingError(f"--nproc {settings.nproc}, but the launcher started {here} ranks on this machine; "
                                "leave --nproc out under torchrun (--nproc-per-node sets it)")
        return False
    if settings.nproc == 1:
        return False
    settings.validate()
    out = settings.run_dir()

    def on_disk() -> str:
        try:
            folder, state = read_state(out / "latest")
        except (FileNotFoundError, ValueError):
            return f"no checkpoint was written in {out}"
        return (f"the checkpoint of step {state.get('step')} in {folder} is kept; continue with: pedestrian train "
                f"--out {out} --resume --nproc {settings.nproc}{per_run_flags(settings)}{resume_flags}")

    try:
        launch(settings.nproc, argv, on_disk)
    except LaunchFailure as exc:
        if exc.interrupted:
            raise
        raise TrainingError(str(exc)) from None
    return True


def train(settings: TrainSettings, *, resume: bool = False, explicit: set[str] | None = None,
          overwrite: bool = False, group=None) -> TrainResult:
    """Run (or resume) a training job (module docstring; messages go to the ``pedestrian.train`` logger).

    Args:
        settings: all settings; on resume only :data:`RESUMABLE_SETTINGS` are taken from it,
            the rest come from the checkpoint.
        resume: continue from ``<out>/latest``.
        explicit: names of the settings the user gave (flags or config file): field names,
            ``"model.<GPTConfig field>"`` for single model fields, or ``"model"`` for the whole
            model dict. On resume any of them outside :data:`RESUMABLE_SETTINGS` must equal the
            checkpoint's.
        overwrite: start afresh even if ``<out>`` already holds a checkpoint (it -- and its
            ``log.jsonl`` and ``best/`` -- is replaced only when the new run writes its first
            checkpoint; the new log goes to ``log.jsonl.new`` until then).
        group: the process group (:mod:`pedestrian.training.distributed`); ``None``: the one this
            process's environment names (one process, or a rank started by ``torchrun``), joined
            here and left at the end.

    Returns:
        a :class:`TrainResult` (the same numbers on every rank; ``is_writer`` on rank 0);
        ``stop_reason`` is ``"max_steps"``, ``"stop_step"``, ``"max_minutes"``, or
        ``"interrupted"`` (SIGINT / SIGTERM on any rank, or :func:`pedestrian.training.loop.request_stop`,
        e.g. a closed stdout: a checkpoint of the last finished step was saved; see the module
        docstring).

    Raises:
        KeyboardInterrupt: a second ``Ctrl-C`` while stopping (the last checkpoint is kept).
        TrainingError / ValueError / FileNotFoundError: bad settings or data, an existing run
            without ``resume``/``overwrite``, a checkpoint that does not match the settings,
            ``max_skipped_steps`` non-finite steps in a row or a non-finite weight, another rank
            that failed or stopped answering (the message names the last good checkpoint, which
            is kept). Nothing on disk is changed before the inputs are validated.
    """
    t_start = time.perf_counter()
    settings.validate(resuming=resume)
    if settings.data is not None:             # recorded absolute: a resume or eval elsewhere finds it
        settings = dataclasses.replace(settings, data=absolute_path(settings.data))
    own_group = group is None
    if own_group:
        group = process_group(settings.device, settings.dist_timeout)
    quiet = None if group.is_writer else _Quiet()       # only rank 0 speaks
    try:
        return _train(settings, resume, set(explicit or ()), overwrite, group, t_start)
    except CommunicationError as exc:                 # before the loop: nothing was written
        raise TrainingError(f"{exc}; the run stopped before its first step and wrote nothing") from exc
    finally:
        if quiet is not None:
            quiet.close()
        if own_group:
            group.close()


class _Quiet:
    """Holds the ``pedestrian`` loggers to errors (on ranks other than 0) until :meth:`close`."""

    def __init__(self):
        self.logger = logging.getLogger("pedestrian")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def close(self) -> None:
        self.logger.setLevel(self.level)


def _train(settings: TrainSettings, resume: bool, explicit: set[str], overwrite: bool, group,
           t_start: float) -> TrainResult:
    out = settings.run_dir()
    had_run = (out / "latest" / "state.json").is_file() or (out / ".latest.old" / "state.json").is_file()
    ckpt = None
    if resume:
        settings, ckpt = _resumed(settings, explicit, out, group)
        if "layer" in explicit:
            match_recorded(settings.layer, ckpt)
    elif had_run and not overwrite:
        raise TrainingError(f"{out} already holds a checkpoint (step {read_state(out)[1].get('step')}); pass "
                            "--resume to continue it, --out NEW_DIR for a new run, or --overwrite to replace it")
    layers = {} if resume else layer_paths(settings.layer)     # {slot: path}; a resumed run has its own
    if settings.batch_size < group.world_size:
        raise TrainingError(f"--batch-size {settings.batch_size} is smaller than the {group.world_size} ranks: each "
                            f"rank computes its share of every batch's rows; use --batch-size >= {group.world_size}")
    tokenizer, train_tokens, val_tokens = prepare_data(settings, ckpt.tokenizer if ckpt else None, group)
    config = settings.model_config(tokenizer.vocab_size)
    if ckpt is not None and ckpt.config != config:
        raise TrainingError(f"the checkpoint in {ckpt.path} has model config {ckpt.config}, which "
                            f"does not match its own training settings {config}; it is damaged")
    if ckpt is None:
        from ..model import GPT

        model = GPT(config, seed=settings.seed, dtype=settings.dtype, backend=settings.backend,
                    device=_device(settings, group), layers=layers, precision=settings.precision)
    else:
        model = ckpt.model
        if settings.precision != model.precision:          # (checkpoints are float32: the same weights)
            from ..model import GPT

            model = GPT(config, dtype=settings.dtype, backend=settings.backend, device=_device(settings, group),
                        precision=settings.precision)
            model.load_state_dict(ckpt.model.state_dict())
    if settings.check_layers:
        check_layers(model, quiet=not group.is_writer)
    trainer = build_trainer(settings, model, (train_tokens, val_tokens), label="train", t_start=t_start,
                            resume=ckpt, group=group)
    _warn_other_ranks(ckpt, group)
    best_val = ckpt.meta.get("best_val_loss") if ckpt else None
    best_val = math.inf if best_val is None else float(best_val)
    files = RunFiles(out, keep_records_to=ckpt.step if ckpt else None, replacing=ckpt is None and had_run,
                     stale=("best",)) if group.is_writer else NoFiles()

    def save(t: Trainer) -> None:
        nonlocal best_val
        val = t.val_loss if t.last_eval == t.step else math.nan
        is_best = math.isfinite(val) and val <= best_val
        best_val = val if is_best else best_val
        meta = {"settings": settings.to_dict(), "data_rng": t.data.rng.bit_generator.state,
                "val_loss": finite_or_none(val), "train_loss": finite_or_none(t.loss),
                "best_val_loss": finite_or_none(best_val), "tokens_seen": t.step * t.data.tokens_per_step,
                "world_size": group.world_size, "skipped_steps": t.skipped_total}
        files.save_checkpoint("latest", model, t.optimizer, tokenizer, t.step, meta)
        t.last_save = t.step                  # kept even if copying it to best/ fails
        if is_best:
            files.copy_checkpoint("latest", "best")

    resume_command = f"pedestrian train --out {out} --resume"
    if reports_to_launcher():
        resume_command += f" --nproc {group.world_size}"
    elif group.world_size > 1:
        resume_command = f"torchrun <the same options> -m {resume_command}"
    resume_command += per_run_flags(settings)
    trainer.checkpoints = Checkpoints(
        files, save, out / "latest", interval=settings.checkpoint_interval, resume_command=resume_command,
        previous=f"the previous run in {out} is left as it was" if had_run else None,
        go_on=f"continue from it with: {resume_command} (the same settings redo the same steps), or start "
        "again with a lower --lr (--overwrite, or --out NEW_DIR)")
    _say_plan(settings, model, tokenizer, train_tokens, val_tokens, trainer, ckpt, out, group)

    def gradient_norms(t: Trainer) -> None:   # after each validation, on the step's own batch; rank 0 logs
        if group.is_writer and t.step % settings.eval_interval == 0 and t.skipped is None and \
                not settings.update_in_backward:          # (it would write a whole-model gradient)
            files.log(gradient_record(model, *t.batches[0], t.step))

    trainer.on("step_end", gradient_norms)
    title = (f"{settings.data or 'Shakespeare'} ({settings.tokenizer}), {model.num_params(trainable_only=True):,} "
             f"params, d_model {config.d_model}, {config.n_blocks} blocks")
    with failures_explained(trainer, plot=title if settings.plot else None):
        reason = trainer.run()
    result = TrainResult(step=trainer.step, train_loss=trainer.loss, val_loss=trainer.val_loss,
                         best_val_loss=best_val, seconds=time.perf_counter() - t_start,
                         tokens_per_second=trainer.tokens_per_second(), stop_reason=reason, out=out,
                         model=model, tokenizer=tokenizer, is_writer=group.is_writer,
                         resume_command=resume_command, eval_batches=settings.eval_batches)
    if reason == "interrupted":
        log.info(f"interrupted ({trainer.interrupted_by}) after step {result.step}: checkpoint saved in "
                 f"{out / 'latest'}")
    else:
        log.info(f"done ({reason}): step {result.step}, train loss {_fmt(result.train_loss)}, val loss "
                 f"{_fmt(result.val_loss)} (best {_fmt(best_val)}), {result.seconds / 60:.1f} min, "
                 f"{result.tokens_per_second:,.0f} tokens/s; checkpoints in {out}")
    return result


def _fmt(x: float) -> str:
    return f"{x:.4f}" if math.isfinite(x) else "-"


def _say_plan(settings, model, tokenizer, train_tokens, val_tokens, trainer, ckpt, out, group) -> None:
    """The opening lines of a run: model, data, steps, ranks, threads, the memory flags (and a warm-up
    warning)."""
    B, T, k = settings.batch_size, settings.context_length, settings.grad_accum
    log.info(f"pedestrian train: {model.num_params(trainable_only=True):,} parameters, {model.config}")
    for slot, layer in model.slots.plugged.items():
        log.info(f"plugged: the {slot} slot runs {layer.path} (parameters per instance: {dict(layer.shapes)})")
    log.info(f"data: {settings.data or BUNDLED_CORPUS} ({settings.tokenizer} tokenizer, {tokenizer.vocab_size} "
             f"ids): {train_tokens.shape[0]:,} training / {val_tokens.shape[0]:,} validation tokens")
    log.info(f"steps {trainer.step} -> {trainer.stop.end} of {settings.max_steps}, batch {B}x{k}x{T} tokens, "
             f"lr {settings.lr:g} (warm-up {settings.warmup_steps}, cosine to {settings.min_lr:g}); "
             f"out: {out}" + (f"; resumed from {ckpt.path}" if ckpt else ""))
    if group.world_size > 1:
        rows = group.rows(B)
        log.info(f"ranks: {group.world_size} ({group.backend} on {group.device}), each computing about "
                 f"{rows.stop - rows.start} of the {B} rows of every batch; rank 0 writes the files")
    if model.backend == "numpy" and model.kernels_name == "fast":
        log.info(f"threads: {threads_used()} (the fast kernels' numba threads; PEDESTRIAN_NUM_THREADS sets them)")
    if memory_plan(settings, model.config.n_blocks):
        log.info(memory_plan(settings, model.config.n_blocks))
    if settings.warmup_steps >= settings.max_steps:
        log.warning(f"--warmup-steps {settings.warmup_steps} >= --max-steps {settings.max_steps}: the "
                    f"learning rate never reaches its peak {settings.lr:g}; pass a smaller --warmup-steps")


# ------------------------------------------------------------------------------ after the run
def final_samples(out, n: int = 2, chars: int = 200) -> tuple[Path, list[str]]:
    """``(folder, texts)``: ``n`` samples of at most ``chars`` characters (stripped) from the run
    in ``out`` -- its ``best`` checkpoint, else ``latest`` -- as ``pedestrian train`` prints them
    at the end: temperature 0.8, top-k 40, seed 0 (:func:`pedestrian.generation.generate.generate`),
    each started from ``<|endoftext|>`` (a BPE tokenizer's) or a newline."""
    from ..generation.generate import Sampling, generate

    out = Path(out)
    folder = out / "best" if (out / "best" / "state.json").is_file() else out / "latest"
    ckpt = load_checkpoint(folder)
    model, tok = ckpt.model, ckpt.tokenizer
    model.training = False
    start = getattr(tok, "special_tokens", {}).get("<|endoftext|>")
    if start is None:
        try:
            start = tok.encode("\n")[0]
        except (ValueError, IndexError):
            start = 0
    per_token = 1 if tok.to_dict().get("kind") == "char" else 3       # BPE: ~3-4 characters a token
    ids = generate(model, np.full((n, 1), start, dtype=np.int64), max(1, chars // per_token),
                   Sampling(temperature=0.8, top_k=min(40, model.config.vocab_size), seed=0))
    texts = [tok.decode([int(t) for t in row[1:] if int(t) != start or per_token == 1])[:chars].strip()
             for row in ids]
    return folder, texts

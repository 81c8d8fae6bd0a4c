"""What ``pedestrian train`` and ``pedestrian finetune`` share around the loop: the
:class:`~pedestrian.training.loop.Trainer` built from a run's settings (:func:`build_trainer`,
the one place where a setting such as ``lr`` becomes a part of the loop: the optimizer, its
schedule, the batches, the stop rules, and a resumed run's state), and its failures, each turned
into one message that names what is kept on disk and how to go on (:func:`failures_explained`).

The settings are a :class:`~pedestrian.training.settings.TrainSettings` or a
:class:`~pedestrian.training.finetune.FinetuneSettings`: the fields they share mean the same
thing in both (``lr``, ``batch_size``, ``eval_interval``, ...), and ``stop_step``,
``max_minutes`` and ``eps``, flags of ``pedestrian train`` only, are fixed class attributes of
the fine-tuning settings.
"""

from __future__ import annotations

import contextlib

import numpy as np

from ..atomic import WriteError
from ..checkpoint import NonFiniteError
from ..text.tokens import TokenDataset
from .distributed import CommunicationError, SingleProcess
from .loop import Batches, Optimization, StopRules, Trainer
from .optim import AdamW, CosineSchedule
from .step import TrainingError


def build_trainer(settings, model, tokens: tuple[np.ndarray, np.ndarray] | None, *, label: str, t_start: float,
                  resume=None, group=None, batches: Batches | None = None) -> Trainer:
    """The :class:`Trainer` of a run, every part made from ``settings`` (and ``resume``).

    The model: put in training mode (``recompute`` as the settings say), its trainable parameters
    made rank 0's on every rank.
    Optimization: :class:`~pedestrian.training.optim.AdamW` over the model's trainable buffers
    (``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``) with a
    :class:`~pedestrian.training.optim.CosineSchedule` (``lr`` after ``warmup_steps`` down to
    ``min_lr`` at ``max_steps``), ``grad_clip`` and ``update_in_backward``.
    Batches: ``grad_accum`` micro-batches of ``batch_size`` windows of ``settings.window(model)``
    tokens drawn from the training tokens with a generator seeded by ``seed`` (``Batches.rng``),
    dropout keyed by ``seed``, and ``eval_batches`` fixed validation batches (seed ``seed + 1``)
    every ``eval_interval`` steps.
    Stop: ``max_steps`` (or ``stop_step``, before it), ``max_skipped_steps``, and ``max_minutes``
    since ``t_start`` on rank 0 (whose clock decides for every rank).

    Args:
        tokens: ``(train, validation)`` token arrays, or datasets with ``get_batch`` and
            ``fixed_batches`` as :class:`~pedestrian.text.tokens.TokenDataset`'s (conversations:
            :class:`~pedestrian.text.chat.ChatRows`).
        label: the progress bar's label (shown when ``settings.progress``, on rank 0).
        t_start: when the run started (a ``time.perf_counter()``): the origin of ``max_minutes``.
        resume: the :class:`~pedestrian.checkpoint.Checkpoint` a resumed run continues (its model
            is ``model``): the AdamW state, the batches' generator state (``meta["data_rng"]``),
            the step and the skipped steps (``meta["skipped_steps"]``) are taken from it;
            ``None``: a new run at step 0.
        group: the process group (:mod:`pedestrian.training.distributed`); ``None``: one process.
        batches: what the steps read, made by the caller (DPO's pairs,
            :func:`pedestrian.training.dpo.read_preference_data`; ``tokens`` is then ``None``),
            its ``rng`` the generator a checkpoint keeps.

    Returns:
        the trainer, at ``resume``'s step, without checkpoints: the caller sets
        ``trainer.checkpoints`` (:class:`~pedestrian.training.loop.Checkpoints`: the run's files
        and what a checkpoint holds), opening the run's files only once all of this has held.

    Raises:
        TrainingError: a checkpoint whose optimizer step does not match its own step.
    """
    group = SingleProcess() if group is None else group
    if settings.recompute_blocks > model.config.n_blocks:
        raise TrainingError(f"--recompute-blocks {settings.recompute_blocks}: the model has {model.config.n_blocks} "
                            "blocks; give at most that many (or --recompute for all of them)")
    model.training, model.recompute = True, settings.recompute_blocks or settings.recompute
    group.broadcast_buffers([b.params for b in model.trainable_buffers()], "the initial parameters")
    optimizer = AdamW(model, lr=settings.lr, betas=(settings.beta1, settings.beta2), eps=settings.eps,
                      weight_decay=settings.weight_decay)
    rng, step, skipped = np.random.default_rng(settings.seed) if batches is None else batches.rng, 0, 0
    if resume is not None:
        optimizer.load_state_dict(resume.optimizer_state())
        rng.bit_generator.state = resume.meta["data_rng"]
        step, skipped = resume.step, int(resume.meta.get("skipped_steps", 0))
        if optimizer.step_count != step - skipped:
            raise TrainingError(f"checkpoint {resume.path} is inconsistent: optimizer step {optimizer.step_count} "
                                f"!= step {step} - {skipped} skipped")
    B, T, k = settings.batch_size, settings.window(model), settings.grad_accum
    end, end_reason = settings.max_steps, "max_steps"
    if settings.stop_step is not None and settings.stop_step < settings.max_steps:
        end, end_reason = settings.stop_step, "stop_step"
    optimization = Optimization(optimizer, CosineSchedule(settings.lr, settings.warmup_steps, settings.max_steps,
                                                          settings.min_lr), settings.grad_clip,
                                getattr(settings, "update_in_backward", False))      # (train only)
    if batches is None:
        train_ds, val_ds = (t if hasattr(t, "get_batch") else TokenDataset(t) for t in tokens)   # (or rows: chat)
        batches = Batches(lambda: [train_ds.get_batch(rng, B, T) for _ in range(k)], tokens_per_step=B * T * k,
                          validation=val_ds.fixed_batches(settings.seed + 1, settings.eval_batches, B, T),
                          eval_interval=settings.eval_interval, dropout_seed=settings.seed, rng=rng)
    stop = StopRules(end, end_reason, settings.max_skipped_steps,
                     settings.max_minutes if group.is_writer else None, t_start)    # rank 0's clock decides
    trainer = Trainer(model, optimization, batches, stop, group=group,
                      progress=label if settings.progress and group.is_writer else None)
    return trainer.resume(step, skipped) if resume is not None else trainer


@contextlib.contextmanager
def failures_explained(trainer: Trainer, plot: str | None = None):
    """``with failures_explained(trainer): trainer.run() ...``: a failure in the body becomes one
    message naming what is kept (:meth:`Checkpoints.kept`) and how to go on
    (:meth:`Checkpoints.retry`); the run's files are closed at the end; a run that stopped on
    ``max_skipped_steps`` non-finite steps raises after the body; else, given a ``plot`` title,
    ``loss_curve.png`` and ``gradients.png`` are drawn from the log.

    Raises:
        WriteError: a file could not be written (the advice added; for a plot: that the run is
            saved, and how to draw it from the log).
        TrainingError: a refused non-finite checkpoint, another rank that failed
            (:class:`CommunicationError`), or a ``"non_finite"`` stop.
    """
    c = trainer.checkpoints
    try:
        yield trainer
    except WriteError as exc:                 # a full disk, ...: say what is kept and how to go on
        raise exc.advise(c.kept(trainer), c.retry(trainer)) from exc
    except NonFiniteError as exc:             # save_checkpoint refused a NaN / inf (the loop checks first)
        raise TrainingError(f"{exc}; {c.kept(trainer, good=True)}; start again with a lower --lr") from exc
    except CommunicationError as exc:         # another rank died or stopped answering
        raise TrainingError(f"{exc} at step {trainer.step + 1}; the run stopped; {c.kept(trainer)}; "
                            f"{c.retry(trainer)}") from exc
    finally:
        trainer.files.close()
    if trainer.stop_reason == "non_finite":
        raise TrainingError(trainer.non_finite_message(c.kept(trainer, good=True)))
    if plot is not None:
        try:
            trainer.files.plot(plot)
        except WriteError as exc:
            log = trainer.files.out / "log.jsonl"
            raise exc.advise(f"the run itself is saved ({c.kept(trainer)})",
                             f"draw it from the log with: python -c \"from pedestrian.training import *; "
                             f"plot_loss_curve(read_log('{log}'), '{log.parent / 'loss_curve.png'}')\"") from exc

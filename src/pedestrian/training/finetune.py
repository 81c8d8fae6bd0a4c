"""LoRA fine-tuning of a Hugging Face model (GPT-2, Llama, Qwen2, Qwen3, Mistral, Gemma 2/3, SmolLM3,
OLMo 2, Mixtral, Qwen3-MoE or OLMoE) on a text file (paper section 6).

The base weights are frozen (``model.add_lora(..., freeze_base=True)``: their gradients are
never computed) and only the adapters ``X.lora_D`` / ``X.lora_U`` are trained, by the loop
``pedestrian train`` runs (:class:`pedestrian.training.loop.Trainer`: hand-derived backward, gradient
accumulation, clipping, the non-finite rule, validation, checkpoints, Ctrl-C) with
:class:`pedestrian.training.optim.AdamW` over the flat adapter buffer and a
:class:`~pedestrian.training.optim.CosineSchedule`.

A run folder (``--out``) receives::

    adapter/      an adapter-only pedestrian checkpoint (small: adapters, their AdamW moments,
                  the tokenizer, the settings, and which base it belongs to -- the base
                  directory and the SHA-256 of its weight file)
    peft/         the same adapters as a PEFT directory (adapter_config.json +
                  adapter_model.safetensors), for transformers + peft
    log.jsonl     one record per step ({"step", "loss", "lr", "grad_norm", "time_s",
                  "tokens_per_s"}, "skipped": true for a skipped step) and per evaluation
                  ({"step", "val_loss"})
    loss_curve.png
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import shlex
import time
from dataclasses import dataclass
from typing import ClassVar
from pathlib import Path


from ..model.layout import LORA_LAYER_KINDS
from .specs import NON_ZERO, POSITIVE, POSITIVE_INT, PROBABILITY, add_flags, check, setting, specs, with_defaults
from ..load import LoadedModel, adapter_base, adapter_checkpoint_dir, base_fingerprint, load_finetuned, load_model  # noqa: F401 (their home was here)
from .settings import TAG_PER_RUN as _PER_RUN
from .settings import RunSettings, absolute_path, memory_plan, training_window

__all__ = ["FinetuneSettings", "FinetuneResult", "finetune", "DEFAULT_TARGETS"]

log = logging.getLogger("pedestrian.finetune")

#: Hu et al. (2021), LoRA, section 7.1: adapting W_q and W_v is the usual cheap choice.
DEFAULT_TARGETS = ("q", "v")

_LORA, _DPO, _OPTIM, _LOOP = "LoRA", "DPO", "optimisation", "loop"


@dataclass(kw_only=True)
class FinetuneSettings(with_defaults(RunSettings, batch_size=8, max_steps=200, lr=1e-3, min_lr=1e-4, warmup_steps=10,
                                     weight_decay=0.0, beta2=0.999, seed=0, eval_interval=50, eval_batches=10)):
    """Settings of a LoRA fine-tuning run: the ``pedestrian finetune`` flags, each declared once
    (type, default, help, valid values; see :mod:`pedestrian.training.specs`): those a training run
    shares in :class:`~pedestrian.training.settings.RunSettings` (with the defaults above), the
    fine-tuning's own below.

    ``lora_alpha`` is the paper's scalar ``α`` (PEFT's ``lora_alpha / r``); ``lora_targets`` are
    layer kinds (``q k v attn_proj mlp_gate mlp_expand mlp_contract logits``, ``all``), their Llama
    names (``q_proj`` ... ``down_proj``, ``lm_head``) or full layer names.
    """

    hf_dir: str = setting(help="the base: a Hugging Face GPT-2, Llama, Qwen2, Qwen3, Mistral, Gemma 2/3, SmolLM3, "
                                "OLMo 2, Mixtral, Qwen3-MoE or OLMoE directory with its tokenizer", kind=str,
                          metavar="DIR", required=True, tags=_PER_RUN)       # (on resume: checked by its SHA-256)
    data: str | None = setting(None, "UTF-8 text file (or folder of *.txt), tokenized with the base's tokenizer "
                               "(or --dpo); or a conversations file, *.jsonl (one {\"messages\": [...]} or "
                               "{\"prompt\", \"completion\"} a line), rendered with the base's chat template, the "
                               "loss on the assistant's tokens", kind=str, metavar="PATH")
    dpo: str | None = setting(None, "preference pairs (JSONL of prompt / chosen / rejected: strings, or TRL's "
                              "message lists) to train on with DPO instead of --data", kind=str, metavar="PAIRS",
                              group=_DPO)
    dpo_beta: float = setting(0.1, "DPO's beta: how far the policy may move from the reference (the base "
                              "without the adapters)", rule=POSITIVE, metavar="BETA", group=_DPO)
    lora_rank: int = setting(8, "adapter rank r", rule=POSITIVE_INT, metavar="R", group=_LORA, required=True)
    lora_alpha: float = setting(1.0, "the paper's scalar alpha: the adapter adds alpha * x D U (PEFT's "
                                "lora_alpha / r)", rule=NON_ZERO, metavar="ALPHA", group=_LORA)
    lora_targets: list = setting(list(DEFAULT_TARGETS), f"layers that get adapters: {' '.join(LORA_LAYER_KINDS)}, "
                                 "their Llama names (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj "
                                 "lm_head), all, or full names like blocks.0.attn.q", metavar="KIND", group=_LORA)
    lora_dropout: float = setting(0.0, "dropout on the adapters' input while training (PEFT's "
                                  "lora_dropout)", rule=PROBABILITY, metavar="P",
                                  group=_LORA)
    train_on_all_tokens: bool = setting(False, "with a conversations file: count every token in the loss, not "
                                        "only the assistant's", group=_OPTIM)
    pack: bool = setting(False, "with a conversations file: pack short conversations into each window, first fit "
                         "(each attends only to itself, its positions from 0; TRL's packing), not one a row",
                         group=_OPTIM)
    context_length: int | None = setting(None, "training window (default: min(256, the model's context))",
                                         kind=int, rule=POSITIVE_INT, metavar="T", group=_OPTIM)
    out: str = setting("runs/finetune", "run folder", metavar="DIR", group=_LOOP, tags=_PER_RUN)
    overwrite: bool = setting(False, "replace an existing run in --out (kept until the first checkpoint)",
                              group=_LOOP, tags=_PER_RUN)
    resume: bool = setting(False, "continue the run in --out from its adapter checkpoint (the same command "
                           "with --resume: its recorded settings, adapters, AdamW moments and batch order; "
                           "--max-steps may be raised)", group=_LOOP, tags=_PER_RUN)

    #: ``pedestrian train`` flags that fine-tuning fixes (class attributes, not settings: no
    #: flag, not in :meth:`to_dict`): no ``--stop-step``, no time budget, AdamW's default epsilon
    stop_step: ClassVar[None] = None
    max_minutes: ClassVar[None] = None
    eps: ClassVar[float] = 1e-8

    def window(self, model) -> int:
        """Tokens of a training window: ``context_length``, default ``min(256, the model's context)``.

        Raises:
            ValueError: longer than the model's context.
        """
        C = model.config.context_length
        T = training_window(self.context_length, C)
        if T > C:
            raise ValueError(f"--context-length {T} is longer than the model's context ({C} positions)")
        return T

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting (by its flag) and its valid values
        (or a bad ``PEDESTRIAN_NUM_THREADS``), before any file is written."""
        check(self)
        if (self.data is None) == (self.dpo is None):
            raise ValueError("give the text to fine-tune on with --data PATH, or preference pairs with --dpo "
                             "PAIRS.jsonl (one of them)")
        from .conversations import is_conversations

        used = [flag for flag, on in (("--pack", self.pack), ("--train-on-all-tokens", self.train_on_all_tokens)) if on]
        if used and self.dpo is not None:
            raise ValueError(f"{' and '.join(used)} {'apply' if len(used) > 1 else 'applies'} to a conversations file "
                             "(--data FILE.jsonl), not to --dpo (a pair's loss is its answers' tokens); leave "
                             f"{' and '.join(used)} out")
        if used and not is_conversations(self.data):
            raise ValueError(f"{' and '.join(used)} {'apply' if len(used) > 1 else 'applies'} to a conversations file "
                             "(--data FILE.jsonl); "
                             f"{self.data} is not one (plain text counts every token already)")
        from ..kernels.jit import num_threads

        num_threads()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def add_flags(cls, parser) -> None:
        """``pedestrian finetune``'s flags, one per setting (:func:`pedestrian.training.specs.add_flags`),
        and ``train``'s ``--update-in-backward``, hidden, so that :meth:`from_args` refuses it in one line."""
        add_flags(parser, cls, groups={_LORA: parser.add_argument_group(_LORA)})    # (LoRA's first)
        parser.add_argument("--update-in-backward", action="store_true", help=argparse.SUPPRESS)

    @classmethod
    def from_args(cls, args) -> "FinetuneSettings":
        """The settings of ``pedestrian finetune``'s parsed arguments (an ``argparse.Namespace``
        from :func:`pedestrian.training.specs.add_flags`): the flags given, the defaults for the rest.

        Raises:
            ValueError: ``--update-in-backward`` (a ``train`` flag the command takes only to refuse it)."""
        if getattr(args, "update_in_backward", False):
            raise ValueError("--update-in-backward is a flag of `pedestrian train`: finetune trains only the LoRA "
                             "adapters, whose gradient is small; for less memory pass --recompute or --recompute-blocks N")
        given = {name: getattr(args, name) for name in specs(cls)}
        return cls(**{name: value for name, value in given.items() if value is not None})

    @staticmethod
    def explicit(args) -> frozenset:
        """The settings ``pedestrian finetune``'s parsed arguments give (the flags on the command line)."""
        return frozenset(name for name in specs(FinetuneSettings) if getattr(args, name, None) is not None)


@dataclass
class FinetuneResult:
    """What :func:`finetune` did."""

    step: int
    train_loss: float
    val_loss: float
    initial_val_loss: float
    trainable_params: int
    total_params: int
    seconds: float
    out: Path
    model: object = None
    tokenizer: object = None
    stop_reason: str = "max_steps"
    resume_command: str = ""        #: how to continue this run (after an interrupt, or to more steps)
    peft: Path | None = None        #: the PEFT directory written (None: adapters PEFT cannot hold, said in the log)


def finetune(settings: FinetuneSettings, *, explicit=None) -> FinetuneResult:
    """Run a LoRA fine-tuning job with the loop of ``pedestrian train`` (:mod:`pedestrian.training.loop`:
    the same step, non-finite rule, validation, checkpoints and ``Ctrl-C`` handling); see the
    module docstring for what it writes. Messages go to the ``pedestrian.finetune`` logger.

    Args:
        settings: the run's settings; with ``resume``, those of ``explicit`` must match the run's
            record but for those that may change (:func:`~pedestrian.training.settings.resume_rules`:
            ``--max-steps`` ...), which replace it.
        explicit: the names of the settings given (``FinetuneSettings.explicit(args)``); ``None``
            (a call from Python): every setting, so each must equal the run's record but for the
            ones that may change.

    Returns:
        a :class:`FinetuneResult`; ``stop_reason`` ``"max_steps"``, or ``"interrupted"`` (SIGINT
        / SIGTERM: the adapters of the last finished step were saved, checkpoint and PEFT).

    Raises:
        ValueError / FileNotFoundError: bad settings, started as a rank of several (torchrun), a
            base that is not a Hugging Face directory of a family pedestrian reads (or asks for what
            pedestrian does not implement), a corpus too short for one window, a ``resume`` that
            does not match the run's record (settings, base weights, text), an existing run in ``out``
            without ``overwrite`` (with it, the old run is kept until the first checkpoint),
            ``max_skipped_steps`` non-finite steps in a row (:class:`pedestrian.training.loop.TrainingError`,
            naming the last good checkpoint). Nothing is written before the inputs are validated.
        WriteError (an ``OSError``): a file of the run cannot be written (no space, no
            permission, read-only, ...); the message names the last adapter checkpoint saved.
    """
    from ..interop.hf import HFFolder
    from ..interop.peft import save_peft_adapter
    from ..interop.peft_experts import PeftRefused
    from ..model.finite import finite_or_none
    from .conversations import conversation_rows, is_conversations
    from .corpus import data_fingerprint, prepare_data
    from .distributed import launched_rank
    from .adapter_runs import is_train_run, resumed
    from .files import RunFiles
    from .job import build_trainer, failures_explained
    from .loop import Checkpoints, Trainer

    t_start = time.perf_counter()
    settings.validate()
    if launched_rank():          # N copies would all write the same files: one process only, for now
        raise ValueError("pedestrian finetune runs in one process; start it without torchrun (several ranks "
                         "are for pedestrian train)")
    out = Path(settings.out).expanduser()
    had_run = out.exists() and any(out.iterdir())
    ckpt = base = None
    if settings.resume:
        given = frozenset(specs(settings)) if explicit is None else frozenset(explicit)
        settings, ckpt, tokenizer, base = resumed(settings, out, given)
        model = ckpt.model
    elif had_run and not settings.overwrite:
        if is_train_run(out):
            raise ValueError(f"{out} holds a `pedestrian train` run; choose another --out for the fine-tuning (or "
                             "--overwrite to replace that run)")
        raise ValueError(f"{out} already holds a run; pass --resume to continue it, choose another --out, or "
                         "pass --overwrite")
    else:
        settings = dataclasses.replace(settings, data=settings.data and absolute_path(settings.data),   # (recorded
                                       dpo=settings.dpo and absolute_path(settings.dpo))               # so)
        folder = HFFolder(settings.hf_dir)
        tokenizer = folder.tokenizer()                 # cheap: fail before reading the weights
        model = folder.model(dtype=settings.dtype, backend=settings.backend)
    T = settings.window(model)
    if settings.dpo:
        from .dpo import read_preference_data

        batches, data_sha, data_line = read_preference_data(settings, tokenizer, T)
    elif is_conversations(settings.data):       # one conversation a row, the assistant's tokens counted
        train_tokens, val_tokens, data_sha = conversation_rows(settings, tokenizer, T, model)
        batches = None
        data_line = (f"data: {settings.data}: {sum(map(len, train_tokens.lines)):,} training / "
                     f"{sum(map(len, val_tokens.lines)):,} validation conversations"
                     + (f" packed in {len(train_tokens):,} / {len(val_tokens):,} windows" if settings.pack else ""))
    else:
        _, train_tokens, val_tokens = prepare_data(settings, tokenizer, window=T)
        data_sha, batches = data_fingerprint(train_tokens, val_tokens), None
        data_line = (f"data: {settings.data}: {train_tokens.shape[0]:,} training / {val_tokens.shape[0]:,} "
                     "validation tokens")
    what = "preference pairs" if settings.dpo else "conversations" if is_conversations(settings.data) else "text"
    if ckpt is not None and ckpt.meta.get("data_sha256") not in (None, data_sha):
        raise ValueError(f"the {what} in {settings.dpo or settings.data} is not the one the run in {out} was fine-tuned "
                         f"on (it changed since); resuming needs the same {what}: restore it, or start again with "
                         "--overwrite")
    if ckpt is not None:
        log.info(f"resumed from {ckpt.path} at step {ckpt.step}")
    else:
        model.add_lora(settings.lora_targets, settings.lora_rank, settings.lora_alpha, seed=settings.seed,
                       dropout=settings.lora_dropout, freeze_base=True)
    base = base or folder.fingerprint()                           # (a resume has hashed it already)
    n_train, n_total = model.num_params(trainable_only=True), model.num_params()
    log.info(f"pedestrian finetune: LoRA r={settings.lora_rank}, alpha={settings.lora_alpha:g} on "
             f"{len(model.lora_targets)} layers: {n_train:,} trainable of {n_total:,} parameters "
             f"({100 * n_train / n_total:.2f}%); base frozen")
    log.info(f"{data_line}; batch {settings.batch_size}x{settings.grad_accum}x{T}; {settings.max_steps} step{'' if settings.max_steps == 1 else 's'}; "
             f"out: {out}")
    if memory_plan(settings, model.config.n_blocks):
        log.info(memory_plan(settings, model.config.n_blocks))
    files = RunFiles(out, keep_records_to=ckpt.step if ckpt else None, replacing=had_run and ckpt is None,
                     stale=("peft",))
    initial_val = math.nan

    def save(t: Trainer) -> None:
        meta = {"finetune": settings.to_dict(), "data_rng": t.data.rng.bit_generator.state,
                "val_loss": finite_or_none(t.val_loss), "train_loss": finite_or_none(t.loss),
                "initial_val_loss": finite_or_none(initial_val), "skipped_steps": t.skipped_total,
                "data_sha256": data_sha}
        files.save_checkpoint("adapter", model, t.optimizer, tokenizer, t.step, meta, params="lora", base=base)

    trainer = build_trainer(settings, model, None if batches else (train_tokens, val_tokens),
                            label="finetune --dpo" if settings.dpo else "finetune", t_start=t_start, resume=ckpt,
                            batches=batches)
    if settings.dpo:
        from .dpo import dpo_training

        dpo_training(trainer, settings.dpo_beta)
    previous = (f"the adapter checkpoint of step {ckpt.step} in {out / 'adapter'} is kept" if ckpt else
                f"the previous run in {out} is left as it was" if had_run else None)
    trainer.checkpoints = Checkpoints(files, save, out / "adapter", name="adapter checkpoint", previous=previous,
                                      go_on="run the fine-tuning again with a lower --lr and --overwrite",
                                      start_again="run the fine-tuning again with --overwrite")
    title = (f"{'DPO, ' if settings.dpo else ''}LoRA r={settings.lora_rank} on {Path(settings.hf_dir).name}, "
             f"{settings.dpo or settings.data}")
    with failures_explained(trainer, plot=title if settings.plot else None):
        recorded = ckpt.meta.get("initial_val_loss") if ckpt else None
        initial_val = trainer.evaluate() if recorded is None else float(recorded)
        if math.isfinite(initial_val) and ckpt is None:
            log.info(f"step 0: val loss {initial_val:.4f}")
        peft = None
        if trainer.run() != "non_finite":
            try:
                peft = save_peft_adapter(model, out / "peft", base_model_name_or_path=base["hf_dir"], overwrite=True)
            except PeftRefused as exc:
                log.info(f"no PEFT files: {exc}; the adapters are in {out / 'adapter'}")
    reason = trainer.stop_reason
    seconds = time.perf_counter() - t_start
    loss, val_loss = trainer.loss, trainer.val_loss
    at = "" if trainer.last_eval == trainer.step else f" (at step {trainer.last_eval}, the last evaluation)"
    log.info(f"{'interrupted' if reason == 'interrupted' else 'done'}: step {trainer.step}, train loss "
             f"{loss:.4f}, val loss {initial_val:.4f} -> {val_loss:.4f}{at}, {seconds / 60:.1f} min; adapters "
             f"in {out / 'adapter'}" + (f" and {peft}" if peft else ""))
    return FinetuneResult(step=trainer.step, train_loss=loss, val_loss=val_loss, initial_val_loss=initial_val,
                          trainable_params=n_train, total_params=n_total, seconds=seconds, out=out,
                          model=model, tokenizer=tokenizer, stop_reason=reason, peft=peft,
                          resume_command="pedestrian finetune " + " ".join(shlex.quote(str(a)) for a in (
                              "--hf-dir", settings.hf_dir, *(("--dpo", settings.dpo) if settings.dpo else
                                                             ("--data", settings.data)), "--lora-rank",
                              settings.lora_rank, "--out", out, "--resume")))

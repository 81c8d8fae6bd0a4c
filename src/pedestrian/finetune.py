"""LoRA fine-tuning of a Hugging Face GPT-2 on a text file (paper section 6).

The base weights are frozen (``model.add_lora(..., freeze_base=True)``: their gradients are
never computed) and only the adapters ``X.lora_D`` / ``X.lora_U`` are trained, by the same
pieces ``pedestrian train`` uses: :func:`pedestrian.train.train_step` (hand-derived backward,
gradient accumulation, clipping) and :class:`pedestrian.optim.AdamW` over the flat adapter
buffer, with a :class:`~pedestrian.optim.CosineSchedule`.

A run folder (``--out``) receives::

    adapter/      an adapter-only pedestrian checkpoint (small: adapters, their AdamW moments,
                  the tokenizer, the settings, and which base it belongs to -- the base
                  directory and the SHA-256 of its weight file)
    peft/         the same adapters as a PEFT directory (adapter_config.json +
                  adapter_model.safetensors), for transformers + peft
    log.jsonl     one record per step ({"step", "loss", "lr", "grad_norm"}) and per evaluation
                  ({"step", "val_loss"})
    loss_curve.png
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = ["FinetuneSettings", "FinetuneResult", "finetune", "load_finetuned", "adapter_base",
           "adapter_checkpoint_dir",
           "base_fingerprint", "DEFAULT_TARGETS"]

#: Hu et al. (2021), LoRA, section 7.1: adapting W_q and W_v is the usual cheap choice.
DEFAULT_TARGETS = ("q", "v")


@dataclass
class FinetuneSettings:
    """Settings of a LoRA fine-tuning run (the ``pedestrian finetune`` flags).

    Attributes:
        hf_dir: the base model, a Hugging Face GPT-2 directory (with its tokenizer).
        data: a UTF-8 text file (or folder of ``*.txt``), tokenized with the base's tokenizer.
        lora_rank: ``r``. lora_alpha: the paper's scalar ``α`` (PEFT's ``lora_alpha / r``).
        lora_targets: layer kinds (``q k v attn_proj mlp_expand mlp_contract logits``, ``all``)
            or full layer names.
        lora_dropout: dropout probability on the adapters' input while training (PEFT's
            ``lora_dropout``; :meth:`pedestrian.model.GPT.add_lora`).
        context_length: training window (default ``min(256, the model's context_length)``).
        batch_size, grad_accum, max_steps, lr, min_lr, warmup_steps, weight_decay, beta1,
        beta2, grad_clip: as in :class:`pedestrian.train.TrainSettings`.
        val_fraction: the last fraction of the tokens is held out for validation.
        eval_interval, eval_batches: validation every this many steps, on this many fixed
            batches.
        seed: adapter initialisation and batch sampling.
        dtype, backend: compute precision and array library.
        out: run folder. overwrite: replace an existing run there. progress, plot: tqdm bar,
            loss_curve.png.
    """

    hf_dir: str
    data: str
    lora_rank: int = 8
    lora_alpha: float = 1.0
    lora_targets: list = field(default_factory=lambda: list(DEFAULT_TARGETS))
    context_length: int | None = None
    batch_size: int = 8
    grad_accum: int = 1
    max_steps: int = 200
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = 1.0
    val_fraction: float = 0.1
    eval_interval: int = 50
    eval_batches: int = 10
    seed: int = 0
    dtype: str = "float32"
    backend: str = "numpy"
    out: str = "runs/finetune"
    overwrite: bool = False
    progress: bool = True
    plot: bool = True
    lora_dropout: float = 0.0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting and its valid range."""
        for name in ("lora_rank", "batch_size", "grad_accum", "max_steps", "eval_interval", "eval_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{_flag(name)} must be a positive integer, got {v!r}")
        if self.context_length is not None and (not isinstance(self.context_length, int)
                                                or self.context_length < 1):
            raise ValueError(f"--context-length must be a positive integer, got {self.context_length!r}")
        if not (isinstance(self.lora_alpha, (int, float)) and math.isfinite(self.lora_alpha)
                and self.lora_alpha != 0):
            raise ValueError(f"--lora-alpha must be a finite non-zero number, got {self.lora_alpha!r}")
        if isinstance(self.lora_dropout, bool) or not isinstance(self.lora_dropout, (int, float)) \
                or not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"--lora-dropout must be a probability in [0, 1), got {self.lora_dropout!r}")
        if not 0.0 < float(self.val_fraction) < 1.0:
            raise ValueError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        if not (math.isfinite(self.lr) and self.lr > 0) or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need a finite --lr > 0 and 0 <= --min-lr <= --lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup_steps < 0 or self.seed < 0:
            raise ValueError("--warmup-steps and --seed must be >= 0")
        for name in ("weight_decay", "grad_clip"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"--{_flag(name)} must be a finite number >= 0, got {v!r}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be in [0, 1), got {getattr(self, name)!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return name.replace("_", "-")


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


def base_fingerprint(hf_dir) -> dict:
    """``{"hf_dir", "weights", "sha256"}`` of a base model directory: which weight file holds
    its tensors (see :func:`pedestrian.interop.hf.open_hf_weights`) and that file's SHA-256, so
    an adapter can later be matched against the very weights it was trained on."""
    from .interop.hf import open_hf_weights

    source = Path(open_hf_weights(hf_dir).source)
    h = hashlib.sha256()
    with open(source, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return {"hf_dir": str(Path(hf_dir).expanduser().resolve()), "weights": source.name,
            "sha256": h.hexdigest()}


def adapter_checkpoint_dir(path) -> Path | None:
    """The adapter-only checkpoint ``path`` stands for, or ``None`` if it is not one.

    Accepts a ``pedestrian finetune`` run folder (its ``adapter/``), the adapter checkpoint
    folder itself, or one of its files. Never raises for a path that is something else
    (a full checkpoint, a train run folder, nothing at all): it returns ``None`` then.
    """
    from .checkpoint import read_state

    p = Path(path).expanduser()
    if p.is_file():
        p = p.parent
    for candidate in (p, p / "adapter"):
        if (candidate / "state.json").is_file():
            try:
                folder, state = read_state(candidate)
            except (OSError, ValueError):
                return None
            return folder if state.get("params") == "lora" else None
    return None


def _adapter_state(adapter_dir) -> tuple[Path, dict]:
    from .checkpoint import read_state

    p = Path(adapter_dir).expanduser()
    if not (p / "state.json").is_file() and (p / "adapter" / "state.json").is_file():
        p = p / "adapter"
    folder, state = read_state(p)
    if state.get("params") != "lora":
        raise ValueError(f"{folder} is a full checkpoint, not an adapter-only one; use --checkpoint "
                         "(pedestrian.checkpoint.load_checkpoint) for it")
    return folder, state


def adapter_base(adapter_dir) -> dict:
    """The base recorded in an adapter-only checkpoint: ``{"config", "hf_dir", "weights",
    "sha256"}`` (whatever was recorded; see :func:`base_fingerprint`)."""
    return dict(_adapter_state(adapter_dir)[1].get("base") or {})


def load_finetuned(adapter_dir, hf_dir=None, *, dtype: str | None = None, backend: str = "numpy"):
    """A fine-tuned model: the base GPT-2 with the adapters of an adapter-only checkpoint.

    Args:
        adapter_dir: the checkpoint (``RUN/adapter``, or the run folder ``RUN``).
        hf_dir: the base directory (default: the one recorded in the checkpoint).
        dtype: default: the checkpoint's.

    Returns:
        ``(model, tokenizer)``, adapters attached (unmerged).

    Raises:
        FileNotFoundError: no checkpoint or no base directory.
        ValueError: not an adapter-only checkpoint, or a base whose weights differ from the
            ones the adapters were trained on (SHA-256 of the weight file) or whose config
            differs.
    """
    from .checkpoint import load_checkpoint
    from .interop.hf import load_pretrained

    folder, state = _adapter_state(adapter_dir)
    recorded = state.get("base") or {}
    base_dir = hf_dir if hf_dir is not None else recorded.get("hf_dir")
    if base_dir is None:
        raise ValueError(f"{folder} does not record its base model directory; pass --hf-dir BASE_DIR")
    if hf_dir is None and not (Path(base_dir) / "config.json").is_file():
        raise FileNotFoundError(f"the base model of the adapters in {folder}, {base_dir}, is gone; "
                                "pass --hf-dir BASE_DIR (the Hugging Face GPT-2 directory they were "
                                "trained on)")
    if recorded.get("sha256"):
        now = base_fingerprint(base_dir)
        if now["sha256"] != recorded["sha256"]:
            raise ValueError(f"the adapters in {folder} were trained on other weights than those in "
                             f"{base_dir} ({recorded.get('weights')} SHA-256 {recorded['sha256'][:12]}..., "
                             f"found {now['weights']} {now['sha256'][:12]}...); pass the right base "
                             "with --hf-dir")
    model, tokenizer = load_pretrained(base_dir, dtype=dtype or state.get("dtype", "float32"), backend=backend)
    ckpt = load_checkpoint(folder, backend=backend, base_model=model)
    return ckpt.model, ckpt.tokenizer or tokenizer


def finetune(settings: FinetuneSettings, *, echo: Callable[[str], None] | None = None) -> FinetuneResult:
    """Run a LoRA fine-tuning job (see the module docstring for what it writes).

    Raises:
        ValueError / FileNotFoundError: bad settings, a base that is not GPT-2, a corpus too
            short for one window, an existing run in ``out`` without ``overwrite``, a
            non-finite loss. Nothing is written before the inputs are validated.
        WriteError (an ``OSError``): a file of the run cannot be written (no space, no
            permission, read-only, ...); the message names the last adapter checkpoint saved.
    """
    from tqdm import tqdm

    from .atomic import AppendLog, WriteError, make_dirs

    from .checkpoint import save_checkpoint
    from .data import TokenDataset, encode_to_token_file
    from .interop.hf import load_pretrained
    from .interop.peft import save_peft_adapter
    from .optim import AdamW, CosineSchedule
    from .train import estimate_loss, plot_loss_curve, read_log, split_tokens, train_step

    t_start = time.perf_counter()
    say = echo or (lambda s: tqdm.write(s, file=sys.stdout))
    settings.validate()
    out = Path(settings.out).expanduser()
    if out.exists() and any(out.iterdir()) and not settings.overwrite:
        raise ValueError(f"{out} already holds a run; choose another --out or pass --overwrite")
    model, tokenizer = load_pretrained(settings.hf_dir, dtype=settings.dtype, backend=settings.backend)
    C = model.config.context_length
    T = settings.context_length or min(256, C)
    if T > C:
        raise ValueError(f"--context-length {T} is longer than the model's context ({C} positions)")
    tokens = encode_to_token_file(Path(settings.data).expanduser(), tokenizer)
    train_tokens, val_tokens = split_tokens(tokens, settings.val_fraction)
    for name, part in (("training", train_tokens), ("validation", val_tokens)):
        if part.shape[0] < T + 1:
            raise ValueError(f"{settings.data} is too short: {tokens.shape[0]} tokens, {part.shape[0]} in "
                             f"the {name} split, but one window needs {T + 1}; use more text or a "
                             "smaller --context-length")
    model.add_lora(settings.lora_targets, settings.lora_rank, settings.lora_alpha, seed=settings.seed,
                   dropout=settings.lora_dropout, freeze_base=True)
    base = base_fingerprint(settings.hf_dir)
    train_ds, val_ds = TokenDataset(train_tokens), TokenDataset(val_tokens)
    B, k = settings.batch_size, settings.grad_accum
    val_batches = val_ds.fixed_batches(settings.seed + 1, settings.eval_batches, B, T)
    rng = np.random.default_rng(settings.seed)
    optimizer = AdamW(model, lr=settings.lr, betas=(settings.beta1, settings.beta2),
                      weight_decay=settings.weight_decay)
    schedule = CosineSchedule(settings.lr, settings.warmup_steps, settings.max_steps, settings.min_lr)
    n_train, n_total = model.num_params(trainable_only=True), model.num_params()
    say(f"pedestrian finetune: LoRA r={settings.lora_rank}, alpha={settings.lora_alpha:g} on "
        f"{len(model.lora_targets)} layers: {n_train:,} trainable of {n_total:,} parameters "
        f"({100 * n_train / n_total:.2f}%); base frozen")
    say(f"data: {settings.data}: {train_tokens.shape[0]:,} training / {val_tokens.shape[0]:,} validation "
        f"tokens; batch {B}x{k}x{T}; {settings.max_steps} steps; out: {out}")

    make_dirs(out, "the run folder")
    log_path = out / "log.jsonl"
    log = AppendLog(log_path, "the fine-tuning log", truncate=True)
    saved = [None]                             # the step of the last adapter checkpoint

    def advice(exc: WriteError) -> WriteError:
        kept = (f"the adapter checkpoint of step {saved[0]} in {out / 'adapter'} is kept"
                if saved[0] is not None else "no adapter checkpoint was saved")
        return exc.advise(kept, "run the fine-tuning again with --overwrite")

    def evaluate(step: int) -> float:
        loss = estimate_loss(model, val_batches)
        log.write(json.dumps({"step": step, "val_loss": loss}) + "\n")
        log.flush()
        return loss

    def save(step: int, val_loss: float, train_loss: float) -> None:
        meta = {"finetune": settings.to_dict(), "val_loss": val_loss if math.isfinite(val_loss) else None,
                "train_loss": train_loss if math.isfinite(train_loss) else None}
        save_checkpoint(out / "adapter", model, optimizer, tokenizer, step, meta, params="lora", base=base)
        saved[0] = step

    model.training = True
    step, loss = 0, math.nan
    try:
        initial_val = val_loss = evaluate(0)
        say(f"step 0: val loss {val_loss:.4f}")
        bar = tqdm(total=settings.max_steps, desc="finetune", unit="step", disable=not settings.progress,
                   file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
        with bar:
            while step < settings.max_steps:
                lr = schedule(step)
                batches = [train_ds.get_batch(rng, B, T) for _ in range(k)]
                loss, norm = train_step(model, optimizer, batches, lr, settings.grad_clip)
                step += 1
                if not math.isfinite(loss):
                    raise ValueError(f"the training loss became {loss} at step {step}; lower --lr")
                log.write(json.dumps({"step": step, "loss": loss, "lr": lr, "grad_norm": norm}) + "\n")
                bar.update(1)
                bar.set_postfix_str(f"loss {loss:.4f}, val {val_loss:.4f}", refresh=False)
                if step % settings.eval_interval == 0 or step == settings.max_steps:
                    val_loss = evaluate(step)
                    say(f"step {step}: train loss {loss:.4f}, val loss {val_loss:.4f}")
                    save(step, val_loss, loss)
    except WriteError as exc:
        raise advice(exc) from exc
    finally:
        log.close()
    try:
        save_peft_adapter(model, out / "peft", base_model_name_or_path=base["hf_dir"], overwrite=True)
        if settings.plot:
            plot_loss_curve(read_log(log_path), out / "loss_curve.png",
                            title=f"LoRA r={settings.lora_rank} on {Path(settings.hf_dir).name}, {settings.data}")
    except WriteError as exc:
        raise advice(exc) from exc
    seconds = time.perf_counter() - t_start
    say(f"done: step {step}, train loss {loss:.4f}, val loss {initial_val:.4f} -> {val_loss:.4f}, "
        f"{seconds / 60:.1f} min; adapters in {out / 'adapter'} and {out / 'peft'}")
    return FinetuneResult(step=step, train_loss=loss, val_loss=val_loss, initial_val_loss=initial_val,
                          trainable_params=n_train, total_params=n_total, seconds=seconds, out=out,
                          model=model, tokenizer=tokenizer)

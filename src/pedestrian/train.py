"""The training loop: data, AdamW steps, validation, logging, checkpoints, the loss curve.

One update (:func:`train_step`)::

    for each of k micro-batches:  loss_i = model.loss(x_i, y_i); model.backward()   (hand-derived)
    g = (1/k) Σ_i g_i                       gradient accumulation (see below)
    g ← g · min(1, clip / (‖g‖ + 1e-6))     global-norm clipping (torch's convention)
    θ ← AdamW(θ, g, lr = schedule(step))    optimizer.py

Gradient accumulation convention: every micro-batch's gradient is that of its own *mean*
loss, and the update uses their plain average. That equals the gradient of one batch ``k``
times larger whenever every micro-batch counts the same number of targets -- always true for
the fixed-size windows used here (no ignored targets). The backward overwrites the model's
gradient buffers, so the running sum lives in a separate buffer.

:func:`train` runs the whole job: it builds (or resumes) the model, optimizer and data RNG,
logs every step to ``<out>/log.jsonl``, evaluates a fixed set of validation batches every
``eval_interval`` steps (and then logs the norms of every block's error signals and gradients on
the step's batch, :func:`gradient_record`), keeps ``<out>/latest`` and ``<out>/best`` checkpoints,
and draws ``<out>/loss_curve.png`` and ``<out>/gradients.png`` at the end. Resuming restores the parameters, the AdamW moments and
step, the data and dropout RNG states and the settings, so ``N + N`` steps reproduce ``2N``
steps bit for bit (NumPy backend; a test).

Interruptions: while :func:`train` runs in the main thread, ``Ctrl-C`` (SIGINT) and SIGTERM only
set a flag; the step in progress finishes, then a checkpoint of that step is saved (atomically)
and :func:`train` returns with ``stop_reason`` ``"interrupted"``. Resuming from it is exact. A
second ``Ctrl-C`` stops at once (``KeyboardInterrupt``), keeping the last saved checkpoint.

``--overwrite``: the old run's ``log.jsonl`` and checkpoints are kept untouched until the new run
commits its first checkpoint; until then the new log is written to ``log.jsonl.new``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .backend import is_torch_array
from .checkpoint import (Checkpoint, copy_checkpoint, load_checkpoint, read_state, save_checkpoint)
from .config import GPTConfig
from .data import BUNDLED_CORPUS, TokenDataset, encode_to_token_file, iter_corpus_pieces, load_corpus, \
    split_train_val
from .optim import AdamW, CosineSchedule, ParamGroup, clip_grad_norm, global_grad_norm
from .parallel import DATA_PARALLEL_MODES, runner_for

__all__ = ["TrainSettings", "DEFAULT_MODEL", "TrainResult", "TrainingError", "train", "train_step",
           "estimate_loss", "evaluate_tokens", "prepare_data", "build_tokenizer", "split_tokens",
           "read_log", "plot_loss_curve", "gradient_record", "plot_gradients", "RESUMABLE_SETTINGS",
           "PER_RUN_SETTINGS"]

#: The default model of ``pedestrian train`` (vocab_size comes from the tokenizer): 812,288
#: parameters with the 84-character Shakespeare vocabulary. With the default TrainSettings
#: (3,000 steps of 16 x 64 tokens, lr 2e-3 -> 2e-4) it reached 1.68 nats per character on the
#: whole held-out split in 4.7 minutes on an idle 2-core machine (11,100 tokens/s, batch split
#: over both cores by DataParallel); max_minutes = 9 bounds a slower machine.
DEFAULT_MODEL: dict = dict(context_length=64, d_model=128, n_heads=4, n_blocks=4, mlp_ratio=4,
                           activation="gelu_tanh", ln_eps=1e-5, bias=True, tie_weights=True,
                           causal=True, dropout=0.0)

#: settings of one invocation: on resume they come from the command, not the checkpoint
PER_RUN_SETTINGS = frozenset({"stop_step", "max_minutes", "progress", "plot", "out", "data_parallel"})
#: settings that may differ from the checkpoint's when resuming (they do not change what the
#: first N steps computed): given explicitly they win, otherwise the checkpoint's are kept.
#: Any other explicitly given setting must match the checkpoint.
RESUMABLE_SETTINGS = PER_RUN_SETTINGS | {"max_steps", "eval_interval", "checkpoint_interval"}


class TrainingError(ValueError):
    """Training cannot start or continue (bad settings, a non-finite loss, an existing run)."""


@dataclass
class TrainSettings:
    """Every setting of a training run (the ``pedestrian train`` flags / TOML keys).

    Data:
        data: corpus file or folder (``None`` = the bundled Shakespeare plays).
        tokenizer: ``"char"`` or ``"bpe"`` (byte-level BPE trained on the training split).
        bpe_vocab_size: vocabulary size of a new BPE tokenizer.
        val_fraction: the last fraction of the tokens is the validation split.
    Model:
        model: :class:`GPTConfig` fields except ``vocab_size`` (set from the tokenizer).
        dtype / backend: ``"float32"``/``"float64"``, ``"numpy"``/``"torch"``.
    Optimisation:
        batch_size (B windows of context_length + 1 tokens per micro-batch), grad_accum (k
        micro-batches per update), max_steps (updates; the cosine schedule spans them), lr
        (peak), min_lr (end of the cosine), warmup_steps, weight_decay, beta1, beta2, eps,
        grad_clip (global-norm threshold; 0 = off).
    Loop:
        seed (model init, dropout and data RNG), eval_interval (steps between validations),
        eval_batches (size of the fixed validation set, in batches), checkpoint_interval
        (steps between checkpoints; 0 = at every validation), max_minutes (wall-clock budget
        for the whole run: training stops early, then validates, saves and plots), stop_step
        (stop after this step as if interrupted; the schedule still spans max_steps), out
        (run folder; default ``runs/<corpus>_<tokenizer>``), progress (tqdm bar), plot,
        data_parallel (``"auto"``, ``"on"``, ``"off"``: split each batch over threads with
        :class:`pedestrian.parallel.DataParallel`; ``"auto"`` does so for models under
        :data:`pedestrian.parallel.SMALL_MODEL_PARAMS` parameters when there are two or more
        cores, see :func:`pedestrian.parallel.use_data_parallel`). Resuming reproduces a run
        bit for bit when the number of slices is the same.
    """

    data: str | None = None
    tokenizer: str = "char"
    bpe_vocab_size: int = 1024
    val_fraction: float = 0.1
    model: dict = field(default_factory=lambda: dict(DEFAULT_MODEL))
    dtype: str = "float32"
    backend: str = "numpy"
    batch_size: int = 16
    grad_accum: int = 1
    max_steps: int = 3000
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1337
    eval_interval: int = 250
    eval_batches: int = 20
    checkpoint_interval: int = 0
    max_minutes: float | None = 9.0
    stop_step: int | None = None
    out: str | None = None
    progress: bool = True
    plot: bool = True
    data_parallel: str = "auto"

    def validate(self) -> None:
        """Raise :class:`TrainingError` naming the first bad setting and its valid range."""
        def positive_int(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise TrainingError(f"--{_flag(name)} must be a positive integer, got {v!r}")

        for name in ("batch_size", "grad_accum", "max_steps", "eval_interval", "eval_batches"):
            positive_int(name)
        if self.tokenizer not in ("char", "bpe"):
            raise TrainingError(f"--tokenizer must be 'char' or 'bpe', got {self.tokenizer!r}")
        if self.tokenizer == "bpe":
            positive_int("bpe_vocab_size")
        if not 0.0 < float(self.val_fraction) < 1.0:
            raise TrainingError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        for name in ("warmup_steps", "checkpoint_interval", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TrainingError(f"--{_flag(name)} must be an integer >= 0, got {v!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise TrainingError(f"--lr must be a finite number > 0, got {self.lr!r}")
        if not (isinstance(self.min_lr, (int, float)) and 0 <= self.min_lr <= self.lr):
            raise TrainingError(f"--min-lr must be in [0, lr={self.lr:g}], got {self.min_lr!r}")
        if not (isinstance(self.val_fraction, (int, float)) and not isinstance(self.val_fraction, bool)):
            raise TrainingError(f"--val-fraction must be a number in (0, 1), got {self.val_fraction!r}")
        for name in ("weight_decay", "eps", "grad_clip"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise TrainingError(f"--{_flag(name)} must be a finite number >= 0, got {v!r}")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v < 1):
                raise TrainingError(f"--{_flag(name)} must be in [0, 1), got {v!r}")
        if self.max_minutes is not None and not (isinstance(self.max_minutes, (int, float))
                                                 and self.max_minutes > 0):
            raise TrainingError(f"--max-minutes must be > 0, got {self.max_minutes!r}")
        if self.stop_step is not None and (not isinstance(self.stop_step, int) or self.stop_step < 1):
            raise TrainingError(f"--stop-step must be a positive integer, got {self.stop_step!r}")
        if self.dtype not in ("float32", "float64"):
            raise TrainingError(f"--dtype must be 'float32' or 'float64', got {self.dtype!r}")
        if self.backend not in ("numpy", "torch"):
            raise TrainingError(f"--backend must be 'numpy' or 'torch', got {self.backend!r}")
        if self.data_parallel not in DATA_PARALLEL_MODES:
            raise TrainingError(f"--data-parallel must be one of {', '.join(DATA_PARALLEL_MODES)}, "
                                f"got {self.data_parallel!r}")
        if "vocab_size" in self.model:
            raise TrainingError("the model's vocab_size is set by the tokenizer; do not give it")
        try:
            self.model_config(vocab_size=1)
        except (TypeError, ValueError) as exc:
            raise TrainingError(f"invalid model settings: {exc}") from None

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The :class:`GPTConfig` for a tokenizer of ``vocab_size`` ids."""
        return GPTConfig(vocab_size=vocab_size, **self.model)

    @property
    def context_length(self) -> int:
        return int(self.model["context_length"])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainSettings":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TrainingError(f"unknown training setting(s) {unknown}")
        return cls(**data)

    def run_dir(self) -> Path:
        """``out``, or ``runs/<corpus name>_<tokenizer>`` (``runs/shakespeare_char``)."""
        if self.out:
            return Path(self.out).expanduser()
        corpus = Path(self.data).expanduser() if self.data else BUNDLED_CORPUS
        stem = corpus.stem if corpus.suffix else corpus.name
        return Path("runs") / f"{stem or 'corpus'}_{self.tokenizer}"


def _flag(name: str) -> str:
    return name.replace("_", "-")


# ---------------------------------------------------------------------------------------- data
def build_tokenizer(settings: TrainSettings, corpus: Path):
    """A new tokenizer for ``corpus``.

    ``char``: the sorted set of characters of the whole corpus (train and validation, so the
    validation text never holds an unknown character), read piece by piece. ``bpe``: byte-level
    BPE of ``bpe_vocab_size`` ids trained on the training split only.
    """
    from .tokenizer import BPETokenizer, CharTokenizer

    if settings.tokenizer == "char":
        chars: set[str] = set()
        for piece in iter_corpus_pieces(corpus):
            chars.update(piece)
        return CharTokenizer(sorted(chars))
    train_text, _ = split_train_val(load_corpus(corpus), settings.val_fraction)
    return BPETokenizer.train(train_text, vocab_size=settings.bpe_vocab_size)


def split_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` views: the last ``round(n · val_fraction)`` tokens are validation.

    For the character tokenizer this is exactly :func:`pedestrian.data.split_train_val` (one
    token per character).
    """
    n = int(tokens.shape[0])
    n_val = round(n * val_fraction)
    return tokens[: n - n_val], tokens[n - n_val:]


def prepare_data(settings: TrainSettings, tokenizer=None):
    """Tokenizer and the encoded train / validation token streams of the corpus.

    The corpus is encoded once into a token file cached beside it (memory-mapped; see
    :func:`pedestrian.data.encode_to_token_file`).

    Args:
        settings: uses ``data``, ``tokenizer``, ``bpe_vocab_size``, ``val_fraction`` and the
            context length.
        tokenizer: an existing tokenizer (resume / eval); else one is built.

    Returns:
        ``(tokenizer, train_tokens, val_tokens)``.

    Raises:
        FileNotFoundError / ValueError: missing, empty or non-UTF-8 corpus; a character the
            given tokenizer does not know; a split shorter than one window
            (``context_length + 1`` tokens).
    """
    corpus = Path(settings.data).expanduser() if settings.data else BUNDLED_CORPUS
    if settings.data is None and not BUNDLED_CORPUS.is_dir():
        from .data import bundled_corpus

        bundled_corpus()  # raises the explanatory error
    if tokenizer is None:
        tokenizer = build_tokenizer(settings, corpus)
    tokens = encode_to_token_file(corpus, tokenizer)
    train_tokens, val_tokens = split_tokens(tokens, settings.val_fraction)
    need = settings.context_length + 1
    for name, part in (("training", train_tokens), ("validation", val_tokens)):
        if part.shape[0] < need:
            raise TrainingError(
                f"corpus {corpus} is too short: {tokens.shape[0]} tokens in all, {part.shape[0]} in the "
                f"{name} split (val_fraction {settings.val_fraction}), but one window needs "
                f"context_length + 1 = {need}. Use a longer corpus or a smaller --context-length.")
    return tokenizer, train_tokens, val_tokens


# ---------------------------------------------------------------------------------------- steps
def _copy_into(dst, src) -> None:
    if is_torch_array(dst):
        dst.copy_(src)
    else:
        np.copyto(dst, src)


def _add_into(dst, src) -> None:
    if is_torch_array(dst):
        dst.add_(src)
    else:
        np.add(dst, src, out=dst)


def _scale(dst, factor: float) -> None:
    if is_torch_array(dst):
        dst.mul_(factor)
    else:
        np.multiply(dst, factor, out=dst)


def train_step(model, optimizer: AdamW, batches, lr: float, grad_clip: float = 0.0,
               accum_buffers: list | None = None) -> tuple[float, float]:
    """One optimizer update from ``k = len(batches)`` micro-batches.

    Args:
        model: a :class:`~pedestrian.model.GPT` in training mode (or not: dropout follows
            ``model.training``).
        optimizer: an :class:`~pedestrian.optim.AdamW` over the model's flat buffers.
        batches: list of ``(x, y)`` int arrays ``(B, T)``; every micro-batch must count the
            same number of targets for the update to equal one big batch (module docstring).
        lr: learning rate of this update.
        grad_clip: global-norm threshold (``0`` = no clipping).
        accum_buffers: optional preallocated arrays shaped like each group's gradients (saves
            an allocation per step when ``k > 1``).

    Returns:
        ``(loss, grad_norm)``: the mean of the micro-batch losses (nats per token) and the
        global gradient norm before clipping.
    """
    groups: list[ParamGroup] = optimizer.groups
    k = len(batches)
    if k < 1:
        raise ValueError("train_step needs at least one micro-batch")
    if k > 1 and accum_buffers is None:
        accum_buffers = [_empty_like(g.grads) for g in groups]
    total = 0.0
    for i, (x, y) in enumerate(batches):
        total += model.loss(x, y)
        model.backward()
        if k == 1:
            break
        for g, acc in zip(groups, accum_buffers):
            if i == 0:
                _copy_into(acc, g.grads)
            elif i < k - 1:
                _add_into(acc, g.grads)
            else:                                   # last one: g ← (g + Σ previous) / k
                _add_into(g.grads, acc)
                _scale(g.grads, 1.0 / k)
    norm = clip_grad_norm(groups, grad_clip) if grad_clip > 0 else global_grad_norm([g.grads for g in groups])
    optimizer.step(lr)
    return total / k, norm


def _empty_like(a):
    if is_torch_array(a):
        import torch

        return torch.empty_like(a)
    return np.empty_like(a)


def estimate_loss(model, batches) -> float:
    """Mean loss over fixed ``(x, y)`` batches with dropout off (``model.training`` restored)."""
    was_training = model.training
    model.training = False
    try:
        return float(np.mean([model.loss(x, y) for x, y in batches]))
    finally:
        model.training = was_training


def evaluate_tokens(model, tokens: np.ndarray, batch_size: int = 32, max_batches: int | None = None,
                    progress: bool = False) -> tuple[float, int]:
    """Mean next-token loss over a whole token stream, every target counted once.

    The stream is cut into consecutive non-overlapping windows of ``context_length`` inputs
    (the next token of each window starts the following one); a shorter final window covers
    the remainder. Dropout is off.

    Args:
        tokens: 1-D ids (e.g. a memory-mapped validation split), at least 2.
        batch_size: windows per forward pass.
        max_batches: stop after this many full batches (``None`` = the whole stream).

    Returns:
        ``(loss, n_targets)``: nats per token, averaged over all ``n_targets`` targets.
    """
    T = model.config.context_length
    n = int(tokens.shape[0])
    if n < 2:
        raise ValueError(f"need at least 2 tokens to evaluate, got {n}")
    n_windows = (n - 1) // T
    was_training = model.training
    model.training = False
    total, count = 0.0, 0
    starts = list(range(0, n_windows * T, T))
    chunks = [starts[i:i + batch_size] for i in range(0, len(starts), batch_size)]
    if max_batches is not None:
        chunks = chunks[:max_batches]
    from tqdm import tqdm

    try:
        for chunk in tqdm(chunks, desc="eval", unit="batch", disable=not progress, file=sys.stderr):
            idx = np.asarray(chunk)[:, None] + np.arange(T + 1)
            w = np.asarray(tokens[idx], dtype=np.int64)
            total += model.loss(w[:, :-1], w[:, 1:]) * w[:, 1:].size
            count += w[:, 1:].size
        rest = n - 1 - n_windows * T
        if rest > 0 and (max_batches is None or len(chunks) * batch_size >= n_windows):
            w = np.asarray(tokens[n_windows * T:], dtype=np.int64)[None, :]
            total += model.loss(w[:, :-1], w[:, 1:]) * rest
            count += rest
    finally:
        model.training = was_training
    return total / count, count


# ---------------------------------------------------------------------------------------- logs
def read_log(path) -> list[dict]:
    """The records of a ``log.jsonl`` (``[]`` if it does not exist)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a kill: everything after it is lost anyway
    return out


def _rewrite_log(path: Path, records: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    os.replace(tmp, path)


def plot_loss_curve(records: list[dict], path, title: str = "") -> Path:
    """Draw training loss (per step and smoothed) and validation loss against the step.

    Args:
        records: ``log.jsonl`` records (``{"step", "loss"}`` and ``{"step", "val_loss"}``).
        path: the PNG to write (matplotlib, Agg backend; written atomically).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if train:
        s, l = np.array(train).T
        ax.plot(s, l, color="tab:blue", alpha=0.25, lw=0.7, label="train (per step)")
        w = max(1, min(50, len(l) // 20))
        if w > 1:
            smooth = np.convolve(l, np.ones(w) / w, mode="valid")
            ax.plot(s[w - 1:], smooth, color="tab:blue", lw=1.5, label=f"train ({w}-step mean)")
    if val:
        s, l = np.array(val).T
        ax.plot(s, l, "o-", color="tab:orange", ms=3, lw=1.2, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(".tmp-" + path.name)
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path


def gradient_record(model, x, y, step: int) -> dict:
    """The norms of every block's error signals Δ2 … Δ10 and of its gradients, for the log.

    One extra forward and ``backward(keep_deltas=True)`` of the GPT ``model`` on ``(x, y)`` (the
    step's batch), with dropout off so no random state is consumed (a resumed run stays bit for
    bit the same). The model's activations and gradient buffers are overwritten; the next step
    overwrites them again.

    Returns:
        ``{"step", "delta_norms": {"blocks.i": {"Δ2": ‖Δ2‖, …, "Δ10": …}, "Δ1": …, "Δ11": …},
        "grad_norms": {"blocks.i": {"ln1", "attn.qkv", "attn_proj", "ln2", "mlp_expand",
        "mlp_contract"}, "tok_emb", "pos_emb" (learned positions), "ln_final", "logits"
        (untied)}}``: Frobenius norms over the whole batch (``Δ_n = dL/da_n`` of the mean loss).
    """
    from .backend import to_numpy

    def norm(*arrays) -> float:
        return float(math.sqrt(sum(float(np.sum(np.square(np.asarray(to_numpy(a), dtype=np.float64))))
                                   for a in arrays)))

    was_training = model.training
    model.training = False
    try:
        model.loss(x, y)
        grads = model.backward(keep_deltas=True)
        deltas = model.deltas()
    finally:
        model.training = was_training
    delta_norms: dict = {"Δ1": norm(deltas["Δ1"]), "Δ11": norm(deltas["Δ11"])}
    grad_groups: dict = {}
    for name, g in grads.items():
        parts = name.split(".")
        if parts[0] == "blocks":
            group = "attn.qkv" if parts[2] == "attn" else parts[2]
            grad_groups.setdefault(f"blocks.{parts[1]}", {}).setdefault(group, []).append(g)
        else:
            grad_groups.setdefault(parts[0], []).append(g)
    grad_norms = {k: ({g: norm(*v) for g, v in groups.items()} if isinstance(groups, dict) else norm(*groups))
                  for k, groups in grad_groups.items()}
    for i in range(model.config.n_blocks):
        delta_norms[f"blocks.{i}"] = {f"Δ{n}": norm(deltas[f"blocks.{i}.Δ{n}"]) for n in range(2, 11)}
    return {"step": step, "delta_norms": delta_norms, "grad_norms": grad_norms}


def plot_gradients(records: list[dict], path, title: str = "", max_blocks: int = 6) -> Path:
    """Draw the :func:`gradient_record` entries of a log over the run: for each block (up to
    ``max_blocks``, evenly spread, first and last included) the norms of Δ2 … Δ10 (top row) and
    of its gradient groups (bottom row) against the step, log scale, so vanishing or exploding
    signals show as lines falling or rising by orders of magnitude.

    Args:
        records: ``log.jsonl`` records (those without ``"delta_norms"`` are skipped).
        path: the PNG to write (matplotlib, Agg backend; written atomically).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in records if "delta_norms" in r]
    blocks = sorted({k for r in recs for k in r["delta_norms"] if k.startswith("blocks.")},
                    key=lambda k: int(k.split(".")[1]))
    if len(blocks) > max_blocks:
        blocks = [blocks[round(j * (len(blocks) - 1) / (max_blocks - 1))] for j in range(max_blocks)]
    n = max(1, len(blocks))
    fig, axes = plt.subplots(2, n, figsize=(2.9 * n + 2.2, 6.4), dpi=120, squeeze=False, sharey="row")
    steps = [r["step"] for r in recs]
    deltas = [f"Δ{k}" for k in range(2, 11)]
    groups = ("ln1", "attn.qkv", "attn_proj", "ln2", "mlp_expand", "mlp_contract")
    colors = plt.get_cmap("tab10")(np.arange(len(deltas)))
    group_colors = plt.get_cmap("tab10")(np.arange(len(groups)))
    for j, block in enumerate(blocks):
        top, bottom = axes[0, j], axes[1, j]
        for name, color in zip(deltas, colors):
            top.plot(steps, [r["delta_norms"][block][name] for r in recs], color=color, lw=1.3, label=name)
        for name, color in zip(groups, group_colors):
            values = [r["grad_norms"].get(block, {}).get(name) for r in recs]
            if any(v is not None for v in values):
                bottom.plot(steps, values, color=color, lw=1.3, label=name)
        top.set_title(f"block {block.split('.')[1]}", fontsize=10)
        bottom.set_xlabel("step")
        for ax in (top, bottom):
            ax.set_yscale("log")
            ax.grid(alpha=0.3, which="both")
            ax.tick_params(labelsize=8)
    axes[0, 0].set_ylabel("‖Δ_n‖ of the block's a_n")
    axes[1, 0].set_ylabel("‖gradient‖ per layer")
    if recs:
        axes[0, -1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5), title="error signal")
        axes[1, -1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5), title="parameters")
    else:
        axes[0, 0].text(0.5, 0.5, "no gradient records yet\n(the run ended before --eval-interval)",
                        ha="center", va="center", transform=axes[0, 0].transAxes)
    fig.suptitle(title or "error signals and gradients over the run (Frobenius norms, whole batch)", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(".tmp-" + path.name)
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path


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


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _rng_state(rng: np.random.Generator) -> dict:
    return rng.bit_generator.state


def _install_stop_handlers(flag: list) -> dict:
    """SIGINT / SIGTERM append their name to ``flag`` (the loop stops between steps); a second
    SIGINT raises ``KeyboardInterrupt`` at once. Only possible in the main thread: elsewhere
    nothing is installed (and a ``KeyboardInterrupt`` ends the run without a save)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, frame):
        if flag and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag.append(signal.Signals(signum).name)

    old = {}
    for sig in (signal.SIGINT, getattr(signal, "SIGTERM", None)):
        if sig is None:
            continue
        try:
            old[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):  # pragma: no cover - unusual embedding
            pass
    return old


def _silence_stdout() -> None:
    """Point file descriptor 1 at ``/dev/null`` (its reader went away: later writes, including
    the interpreter's final flush, must not raise ``BrokenPipeError``)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # pragma: no cover - no real stdout
        pass


def _restore_handlers(old: dict) -> None:
    for sig, h in old.items():
        if h is not None:
            signal.signal(sig, h)


def train(settings: TrainSettings, *, resume: bool = False, explicit: set[str] | None = None,
          overwrite: bool = False, echo: Callable[[str], None] | None = None) -> TrainResult:
    """Run (or resume) a training job.

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
        echo: where to print progress messages (default: stdout via tqdm.write; if that
            pipe closes, e.g. ``pedestrian train | head``, the run stops as on SIGINT).

    Returns:
        a :class:`TrainResult`; ``stop_reason`` is ``"max_steps"``, ``"stop_step"``,
        ``"max_minutes"``, or ``"interrupted"`` (SIGINT / SIGTERM / a closed stdout: a
        checkpoint of the last finished step was saved; see the module docstring).

    Raises:
        KeyboardInterrupt: a second ``Ctrl-C`` while stopping (the last checkpoint is kept).
        TrainingError / ValueError / FileNotFoundError: bad settings or data, an existing run
            without ``resume``/``overwrite``, a checkpoint that does not match the settings,
            a non-finite loss (the last checkpoint is kept). Nothing on disk is changed before the inputs are
            validated.
    """
    from tqdm import tqdm

    t_start = time.perf_counter()
    stop_signal: list[str] = []         # set by SIGINT / SIGTERM or a closed stdout, checked between steps
    write = echo or (lambda s: tqdm.write(s, file=sys.stdout))

    def say(text: str) -> None:
        try:
            write(text)
        except BrokenPipeError:         # stdout closed (`pedestrian train | head`): stop between
            if echo is None:            # steps and save, as for Ctrl-C; print nothing more there
                _silence_stdout()
            if "stdout closed" not in stop_signal:
                stop_signal.append("stdout closed")

    settings.validate()
    out = settings.run_dir()
    latest = out / "latest"
    log_path = out / "log.jsonl"
    has_ckpt = (latest / "state.json").is_file() or (out / ".latest.old" / "state.json").is_file()

    ckpt: Checkpoint | None = None
    if resume:
        ckpt = load_checkpoint(latest, backend=settings.backend)
        saved = ckpt.meta.get("settings")
        if saved is None:
            raise TrainingError(f"checkpoint {ckpt.path} was not written by `pedestrian train` "
                                "(no training settings in it); it cannot be resumed")
        saved = TrainSettings.from_dict(saved)
        conflicts = []
        for name in sorted(explicit or ()):
            if name in RESUMABLE_SETTINGS:
                continue
            if name == "model":                      # the whole model dict was given
                keys = [f"model.{k}" for k in settings.model]
            else:
                keys = [name]
            for key in keys:
                if key.startswith("model."):
                    k = key[len("model."):]
                    mine = settings.model.get(k)
                    theirs = ckpt.config.to_dict().get(k)     # derived widths resolved
                else:
                    k, mine, theirs = key, getattr(settings, key), getattr(saved, key)
                if mine != theirs:
                    conflicts.append(f"{k}={theirs!r} (you gave {mine!r})")
        if conflicts:
            raise TrainingError(
                f"the checkpoint in {ckpt.path} was trained with a different config: "
                + "; ".join(conflicts) + ". Resume without those settings, or start a new run "
                "with --out NEW_DIR")
        for name in RESUMABLE_SETTINGS:
            if name in (explicit or ()) or name in PER_RUN_SETTINGS:
                setattr(saved, name, getattr(settings, name))
        settings = saved
        settings.validate()
        if ckpt.state.get("optimizer") is None:
            raise TrainingError(f"checkpoint {ckpt.path} holds no optimizer state; it cannot be resumed")
        if ckpt.step >= settings.max_steps:
            raise TrainingError(f"the run in {out} already finished all {settings.max_steps} steps "
                                f"(checkpoint at step {ckpt.step}); pass a larger --max-steps to "
                                "train on (the cosine schedule is stretched to it)")
    elif has_ckpt and not overwrite:
        _, state = read_state(out)
        raise TrainingError(
            f"{out} already holds a checkpoint (step {state.get('step')}); pass --resume to continue "
            "it, --out NEW_DIR for a new run, or --overwrite to replace it")

    tokenizer, train_tokens, val_tokens = prepare_data(settings, ckpt.tokenizer if ckpt else None)
    config = settings.model_config(tokenizer.vocab_size)
    if ckpt is not None and ckpt.config != config:
        raise TrainingError(f"the checkpoint in {ckpt.path} has model config {ckpt.config}, which "
                            f"does not match its own training settings {config}; it is damaged")
    B, T, k = settings.batch_size, settings.context_length, settings.grad_accum
    tokens_per_step = B * T * k
    train_ds, val_ds = TokenDataset(train_tokens), TokenDataset(val_tokens)
    val_batches = val_ds.fixed_batches(settings.seed + 1, settings.eval_batches, B, T)

    if ckpt is None:
        from .model import GPT

        model = GPT(config, seed=settings.seed, dtype=settings.dtype, backend=settings.backend)
        data_rng = np.random.default_rng(settings.seed)
        step, best_val = 0, math.inf
    else:
        model = ckpt.model
        data_rng = np.random.default_rng()
        data_rng.bit_generator.state = ckpt.meta["data_rng"]
        step = ckpt.step
        best_val = ckpt.meta.get("best_val_loss")
        best_val = math.inf if best_val is None else float(best_val)
    model.training = True
    optimizer = AdamW(model, lr=settings.lr, betas=(settings.beta1, settings.beta2), eps=settings.eps,
                      weight_decay=settings.weight_decay)
    if ckpt is not None:
        optimizer.load_state_dict(ckpt.optimizer_state())
        if optimizer.step_count != step:
            raise TrainingError(f"checkpoint {ckpt.path} is inconsistent: optimizer step "
                                f"{optimizer.step_count} != step {step}")
    schedule = CosineSchedule(settings.lr, settings.warmup_steps, settings.max_steps, settings.min_lr)
    accum = [_empty_like(g.grads) for g in optimizer.groups] if k > 1 else None
    try:
        runner, parallel_context = runner_for(model, settings.data_parallel, B)
    except ValueError as exc:                 # e.g. processes on the torch backend
        raise TrainingError(f"--data-parallel {settings.data_parallel}: {exc}") from None
    split = runner.slices_for(B) if runner is not model else 1
    others = "other thread(s)"
    was_split = ckpt.meta.get("data_parallel_threads") if ckpt is not None else None
    if was_split is not None and was_split != split:
        if was_split == 1:
            advice = "--data-parallel off"
        else:
            advice = f"PEDESTRIAN_NUM_THREADS={was_split}" + (
                " without --data-parallel off" if settings.data_parallel == "off" else "")
        print(f"warning: the checkpoint's steps split each batch into {was_split} slice(s), this run into "
              f"{split}: the continuation is valid but will differ slightly from an uninterrupted run "
              f"(summation order, dropout masks); to reproduce it bit for bit use {advice}", file=sys.stderr)

    out.mkdir(parents=True, exist_ok=True)
    pending_log = out / "log.jsonl.new"       # a new run's log while an old run is still on disk
    if pending_log.exists():
        pending_log.unlink()                  # left by an overwrite that never saved: not ours
    records = [r for r in read_log(log_path) if r.get("step", 0) <= step] if ckpt else []
    replacing = ckpt is None and has_ckpt      # --overwrite: keep the old run until our first save
    if replacing:
        log_file = open(pending_log, "w", encoding="utf-8")
    else:
        _rewrite_log(log_path, records)      # drop steps after the checkpoint (or an old run's)
        log_file = open(log_path, "a", encoding="utf-8")

    end = settings.max_steps if settings.stop_step is None else min(settings.stop_step, settings.max_steps)
    ckpt_every = settings.checkpoint_interval or settings.eval_interval
    n_params = model.num_params(trainable_only=True)
    say(f"pedestrian train: {n_params:,} parameters, {config}")
    say(f"data: {settings.data or BUNDLED_CORPUS} ({settings.tokenizer} tokenizer, {tokenizer.vocab_size} "
        f"ids): {train_tokens.shape[0]:,} training / {val_tokens.shape[0]:,} validation tokens")
    say(f"steps {step} -> {end} of {settings.max_steps}, batch {B}x{k}x{T} tokens, "
        f"lr {settings.lr:g} (warm-up {settings.warmup_steps}, cosine to {settings.min_lr:g}); "
        f"out: {out}" + (f"; resumed from {ckpt.path}" if ckpt else ""))
    say(f"threads: each batch split into {split} slices, one on this thread and {split - 1} in {others} "
        f"(data-parallel {settings.data_parallel})" if split > 1 else
        f"threads: one model pass per step (data-parallel {settings.data_parallel}); BLAS threads the products")
    if settings.warmup_steps >= settings.max_steps:
        print(f"warning: --warmup-steps {settings.warmup_steps} >= --max-steps {settings.max_steps}: the "
              f"learning rate never reaches its peak {settings.lr:g}; pass a smaller --warmup-steps",
              file=sys.stderr)

    def save(val_loss: float, train_loss: float) -> None:
        nonlocal best_val, last_save, replacing, log_file
        is_best = math.isfinite(val_loss) and val_loss <= best_val
        if is_best:
            best_val = val_loss
        meta = {"settings": settings.to_dict(), "data_rng": _rng_state(data_rng),
                "val_loss": _finite_or_none(val_loss), "train_loss": _finite_or_none(train_loss),
                "best_val_loss": _finite_or_none(best_val), "tokens_seen": step * tokens_per_step,
                "data_parallel_threads": split}
        save_checkpoint(latest, model, optimizer, tokenizer, step, meta)
        if replacing:                         # the new run is committed: its log replaces the old
            log_file.close()
            os.replace(pending_log, log_path)
            log_file = open(log_path, "a", encoding="utf-8")
            replacing = False
            if not is_best:
                import shutil

                shutil.rmtree(out / "best", ignore_errors=True)     # the old run's best
        if is_best:
            copy_checkpoint(latest, out / "best")
        last_save = step

    def kept() -> str:                        # what is on disk when the run fails
        if last_save >= 0:
            return f"the checkpoint of step {last_save} in {latest} is kept"
        if has_ckpt:
            return f"nothing was saved (the previous run in {out} is left as it was)"
        return "no checkpoint was written"

    def validate() -> float:
        nonlocal last_eval
        with parallel_context:
            loss = estimate_loss(runner, val_batches)
        log_file.write(json.dumps({"step": step, "val_loss": loss}) + "\n")
        log_file.flush()
        last_eval = step
        return loss

    def postfix() -> str:
        rate = tokens_per_step * steps_this_run / max(time.perf_counter() - t_loop, 1e-9)
        val = f"{val_loss:.4f}" if math.isfinite(val_loss) else "-"
        return f"loss {last_loss:.4f}, val {val}, {rate:,.0f} tok/s"

    bar = tqdm(total=end, initial=step, desc="train", unit="step", disable=not settings.progress,
               file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
    last_loss, val_loss = math.nan, math.nan
    last_eval = last_save = step if ckpt is not None else -1
    stop_reason = "max_steps" if end == settings.max_steps else "stop_step"
    reserve = 0.0                       # seconds the final validation + checkpoint will take
    t_loop = time.perf_counter()
    steps_this_run = 0
    old_handlers = _install_stop_handlers(stop_signal)
    try:
        while step < end:
            if stop_signal:
                stop_reason = "interrupted"
                break
            if settings.max_minutes is not None:
                if time.perf_counter() - t_start + reserve >= settings.max_minutes * 60:
                    stop_reason = "max_minutes"
                    break
            t0 = time.perf_counter()
            lr = schedule(step)
            batches = [train_ds.get_batch(data_rng, B, T) for _ in range(k)]
            with parallel_context:
                last_loss, norm = train_step(runner, optimizer, batches, lr, settings.grad_clip, accum)
            step += 1
            steps_this_run += 1
            dt = time.perf_counter() - t0
            if not math.isfinite(last_loss):
                raise TrainingError(f"the training loss became {last_loss} at step {step}; {kept()}. "
                                    "Lower --lr or --grad-clip and "
                                    + ("resume or restart" if last_save >= 0 else "start again"))
            log_file.write(json.dumps({
                "step": step, "loss": last_loss, "lr": lr, "grad_norm": norm,
                "time_s": round(time.perf_counter() - t_start, 4),
                "tokens_per_s": round(tokens_per_step / dt, 1)}) + "\n")
            bar.update(1)
            bar.set_postfix_str(postfix(), refresh=False)
            t1 = time.perf_counter()
            if step % settings.eval_interval == 0:
                val_loss = validate()
                log_file.write(json.dumps(gradient_record(model, *batches[0], step)) + "\n")
                bar.set_postfix_str(postfix(), refresh=False)
                say(f"step {step}: train loss {last_loss:.4f}, val loss {val_loss:.4f}")
            if step % ckpt_every == 0:
                save(val_loss if last_eval == step else math.nan, last_loss)
            if last_eval == step or last_save == step:
                reserve = max(reserve, 1.5 * (time.perf_counter() - t1))
        if stop_signal:
            stop_reason = "interrupted"
        if stop_reason == "interrupted":
            if last_save != step:              # between steps: a consistent state to save
                save(val_loss if last_eval == step else math.nan, last_loss)
        else:
            if last_eval != step or not math.isfinite(val_loss):
                val_loss = validate()
                bar.set_postfix_str(postfix(), refresh=True)
            if last_save != step:
                save(val_loss, last_loss)
    finally:
        _restore_handlers(old_handlers)
        bar.close()
        log_file.close()
        if runner is not model:
            runner.close()
        if replacing and pending_log.exists():
            pending_log.unlink()               # never committed: the old run stays as it was
    seconds = time.perf_counter() - t_start
    tps = tokens_per_step * steps_this_run / max(time.perf_counter() - t_loop, 1e-9)
    if settings.plot:
        plot_loss_curve(read_log(log_path), out / "loss_curve.png",
                        title=f"{settings.data or 'Shakespeare'} ({settings.tokenizer}), "
                              f"{n_params:,} params, d_model {config.d_model}, {config.n_blocks} blocks")
        plot_gradients(read_log(log_path), out / "gradients.png")
    if stop_reason == "interrupted":
        say(f"interrupted ({stop_signal[0] if stop_signal else 'stop'}) after step {step}: checkpoint "
            f"saved in {latest}")
        return TrainResult(step=step, train_loss=last_loss, val_loss=val_loss, best_val_loss=best_val,
                           seconds=seconds, tokens_per_second=tps,
                           stop_reason=stop_reason, out=out, model=model, tokenizer=tokenizer)
    val_text = f"{val_loss:.4f}" if math.isfinite(val_loss) else "-"
    say(f"done ({stop_reason}): step {step}, train loss {last_loss:.4f}, val loss {val_text} "
        f"(best {best_val:.4f}), {seconds / 60:.1f} min, {tps:,.0f} tokens/s; checkpoints in {out}")
    return TrainResult(step=step, train_loss=last_loss, val_loss=val_loss, best_val_loss=best_val,
                       seconds=seconds, tokens_per_second=tps, stop_reason=stop_reason, out=out,
                       model=model, tokenizer=tokenizer)

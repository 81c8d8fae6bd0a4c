"""``pedestrian train``: the settings, the data, and :func:`train`, which wires the shared loop.

:func:`train` runs the whole job: it builds (or resumes) the model, optimizer and data RNG, and
runs :class:`pedestrian.loop.Trainer` with callbacks that log every step to ``<out>/log.jsonl``,
evaluate a fixed set of validation batches every ``eval_interval`` steps (and then log the norms
of every block's error signals and gradients on that step's batch, :func:`gradient_record`), keep
``<out>/latest`` and ``<out>/best`` checkpoints and stop in time (``max_minutes``); it draws
``<out>/loss_curve.png`` and ``<out>/gradients.png`` at the end. Resuming restores the parameters, the AdamW moments and
step, the data and dropout RNG states and the settings, so ``N + N`` steps reproduce ``2N``
steps bit for bit (NumPy backend; a test). The step itself (gradient accumulation, clipping,
AdamW) is :func:`pedestrian.loop.train_step`.

Non-finite numbers (the rule of :mod:`pedestrian.loop`): a step whose loss or gradient norm is
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

Several processes (ranks; :mod:`pedestrian.distributed`): started by ``torchrun`` or
``pedestrian train --nproc N``, :func:`train` joins the process group its environment names.
Every rank draws the same global batches of ``batch_size`` rows and computes its share of the
rows; gradients and losses are summed over the ranks once per step. Rank 0 alone writes the
log, the checkpoints and the plot, and prints; the others follow its stop decisions. A
checkpoint records the number of ranks (``meta["world_size"]``); resuming with the same number
is exact, and with another number continues the same run up to the order of float additions
(the batches and dropout masks are those of the global rows, whoever computes them).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import AppendLog, WriteError, make_dirs, write_file
from .checkpoint import (Checkpoint, NonFiniteError, copy_checkpoint, load_checkpoint, read_state,
                         save_checkpoint)
from .config import GPTConfig
from .data import BUNDLED_CORPUS, TokenDataset, encode_to_token_file, iter_corpus_pieces, iter_train_pieces
from .loop import (Checkpoints, Evaluation, Progress, StepLog, TimeGuard, Trainer, TrainingError, estimate_loss,
                   finish, train_step)
from .distributed import DEVICES, CommunicationError, process_group, reports_to_launcher
from .optim import AdamW, CosineSchedule
from .parallel import DATA_PARALLEL_MODES, runner_for
from .settings import (HALF_OPEN_UNIT, NON_NEGATIVE, NON_NEGATIVE_INT, OPEN_UNIT, POSITIVE, POSITIVE_INT, at_most,
                       check, setting, specs)

__all__ = ["TrainSettings", "DEFAULT_MODEL", "TrainResult", "TrainingError", "train", "train_step",
           "estimate_loss", "evaluate_tokens", "prepare_data", "build_tokenizer", "split_tokens",
           "read_log", "plot_loss_curve", "gradient_record", "plot_gradients", "RunFiles",
           "RESUMABLE_SETTINGS", "PER_RUN_SETTINGS"]

log = logging.getLogger("pedestrian.train")

#: The default model of ``pedestrian train`` (vocab_size comes from the tokenizer): 812,288
#: parameters with the 84-character Shakespeare vocabulary. With the default TrainSettings
#: (3,000 steps of 16 x 64 tokens, lr 2e-3 -> 2e-4) it reached 1.68 nats per character on the
#: whole held-out split in 4.7 minutes on an idle 2-core machine (11,100 tokens/s, batch split
#: over both cores by DataParallel); max_minutes = 9 bounds a slower machine.
DEFAULT_MODEL: dict = dict(context_length=64, d_model=128, n_heads=4, n_blocks=4, mlp_ratio=4,
                           activation="gelu_tanh", ln_eps=1e-5, bias=True, tie_weights=True,
                           causal=True, dropout=0.0)

#: tags of TrainSettings fields: "per_run" settings belong to one invocation (on resume they
#: come from the command, not the checkpoint); "resumable" ones may differ from the
#: checkpoint's when resuming (they do not change what the first N steps computed): given
#: explicitly they win, otherwise the checkpoint's are kept.
_PER_RUN, _RESUMABLE = {"per_run"}, {"resumable"}
_DATA, _MODEL, _OPTIM, _LOOP = "data", "model", "optimisation", "loop"


@dataclass
class TrainSettings:
    """Every setting of a training run: the ``pedestrian train`` flags and TOML keys, each
    declared once below (type, default, help, valid values; see :mod:`pedestrian.settings`).

    ``model`` holds the :class:`GPTConfig` fields except ``vocab_size`` (set from the
    tokenizer). ``data_parallel`` (``"auto"``, ``"on"``, ``"off"``) splits each batch over
    threads with :class:`pedestrian.parallel.DataParallel`; ``"auto"`` does so for models under
    :data:`pedestrian.parallel.SMALL_MODEL_PARAMS` parameters when there are two or more cores
    (:func:`pedestrian.parallel.use_data_parallel`). ``nproc`` > 1 starts that many ranks on
    this machine through PyTorch's launcher (``pedestrian train --nproc N``; see
    :mod:`pedestrian.distributed`). Resuming reproduces a run bit for bit when the number of ranks
    and of slices is the same.
    """

    data: str | None = setting(None, "UTF-8 text file or folder of *.txt files (default: the bundled "
                               "Shakespeare plays)", kind=str, metavar="PATH", group=_DATA)
    tokenizer: str = setting("char", "character-level or byte-level BPE", choices=("char", "bpe"), group=_DATA)
    bpe_vocab_size: int = setting(1024, "vocabulary of a new BPE tokenizer", rule=POSITIVE_INT, metavar="N",
                                  group=_DATA)
    val_fraction: float = setting(0.1, "last fraction of the tokens held out for validation", rule=OPEN_UNIT,
                                  metavar="F", group=_DATA)
    model: dict = setting(DEFAULT_MODEL, "GPTConfig fields except vocab_size", kind=dict, flag=False)
    dtype: str = setting("float32", "parameter dtype", choices=("float32", "float64"), group=_MODEL)
    backend: str = setting("numpy", "array library", choices=("numpy", "torch"), group=_MODEL)
    device: str = setting("cpu", "where the arrays live; cuda needs --backend torch (ranks on GPUs talk "
                          "through NCCL, on CPUs through gloo)", choices=DEVICES, group=_MODEL, tags=_PER_RUN)
    batch_size: int = setting(16, "windows of context_length + 1 tokens per micro-batch", rule=POSITIVE_INT,
                              metavar="B", group=_OPTIM)
    grad_accum: int = setting(1, "micro-batches per update", rule=POSITIVE_INT, metavar="K", group=_OPTIM)
    max_steps: int = setting(3000, "optimizer updates; the cosine schedule spans them", rule=POSITIVE_INT,
                             metavar="N", group=_OPTIM, tags=_RESUMABLE)
    lr: float = setting(2e-3, "peak learning rate, reached after the linear warm-up", rule=POSITIVE,
                        group=_OPTIM)
    min_lr: float = setting(2e-4, "learning rate at the end of the cosine decay", rule=at_most("lr"),
                            group=_OPTIM)
    warmup_steps: int = setting(100, "linear warm-up updates", rule=NON_NEGATIVE_INT, metavar="N", group=_OPTIM)
    weight_decay: float = setting(0.1, "decoupled weight decay of the 2-D weights, not of biases or layer norms",
                                  rule=NON_NEGATIVE, group=_OPTIM)
    beta1: float = setting(0.9, "AdamW's first-moment decay", rule=HALF_OPEN_UNIT, group=_OPTIM)
    beta2: float = setting(0.99, "AdamW's second-moment decay", rule=HALF_OPEN_UNIT, group=_OPTIM)
    eps: float = setting(1e-8, "AdamW's epsilon, added to the root of the second moment", rule=POSITIVE,
                         group=_OPTIM)
    grad_clip: float = setting(1.0, "global gradient-norm clip; 0 = off", rule=NON_NEGATIVE, metavar="NORM",
                               group=_OPTIM)
    max_skipped_steps: int = setting(5, "stop after this many steps in a row whose loss or gradient is not "
                                     "finite (each is skipped: no update)", rule=POSITIVE_INT, metavar="K",
                                     group=_OPTIM, tags=_RESUMABLE)
    seed: int = setting(1337, "model init, dropout and batch sampling seed", rule=NON_NEGATIVE_INT, group=_LOOP)
    eval_interval: int = setting(250, "steps between validations", rule=POSITIVE_INT, metavar="N", group=_LOOP,
                                 tags=_RESUMABLE)
    eval_batches: int = setting(20, "fixed validation batches", rule=POSITIVE_INT, metavar="N", group=_LOOP)
    checkpoint_interval: int = setting(0, "steps between checkpoints; 0 = at every validation",
                                       rule=NON_NEGATIVE_INT, metavar="N", group=_LOOP, tags=_RESUMABLE)
    max_minutes: float | None = setting(9.0, "wall-clock budget: stop early, validate, save and plot; 0 = none",
                                        rule=POSITIVE, optional=True, none_means=0, metavar="M", group=_LOOP,
                                        tags=_PER_RUN)
    stop_step: int | None = setting(None, "stop after step N as if interrupted (the schedule still spans "
                                    "--max-steps)", kind=int, rule=POSITIVE_INT, metavar="N", group=_LOOP,
                                    tags=_PER_RUN)
    out: str | None = setting(None, "run folder (default runs/<corpus>_<tokenizer>)", kind=str, metavar="DIR",
                              group=_LOOP, tags=_PER_RUN)
    progress: bool = setting(True, "no progress bar", group=_LOOP, tags=_PER_RUN)
    plot: bool = setting(True, "no loss_curve.png", group=_LOOP, tags=_PER_RUN)
    data_parallel: str = setting("auto", "split each batch into slices, one per core, each on its own thread "
                                 "with single-threaded BLAS (auto: NumPy models under 20M parameters; slices: "
                                 "PEDESTRIAN_NUM_THREADS or the cores)", choices=DATA_PARALLEL_MODES,
                                 group=_LOOP, tags=_PER_RUN)
    nproc: int = setting(1, "processes (ranks) on this machine, each computing its share of every batch; "
                         "started through PyTorch's launcher (needs the torch extra); under torchrun "
                         "leave it out", rule=POSITIVE_INT, metavar="N", group=_LOOP, tags=_PER_RUN)
    dist_timeout: float = setting(300.0, "seconds a rank waits for the others in an exchange before the run "
                                  "stops with an error", rule=POSITIVE, metavar="S", group=_LOOP, tags=_PER_RUN)

    def validate(self) -> None:
        """Raise :class:`TrainingError` naming the first bad setting (by its flag) and its valid
        values (:func:`pedestrian.settings.check`), or a bad model setting."""
        try:
            check(self)
        except ValueError as exc:
            raise TrainingError(str(exc)) from None
        if "vocab_size" in self.model:
            raise TrainingError("the model's vocab_size is set by the tokenizer; do not give it")
        if self.device == "cuda" and self.backend != "torch":
            raise TrainingError("--device cuda needs --backend torch (NumPy arrays live on the CPU)")
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
        """From :meth:`to_dict` (a checkpoint's); settings it lacks (added later) get their defaults."""
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


def per_run_flags(settings: TrainSettings) -> str:
    """The switches of this invocation that a printed ``--resume`` command must repeat, since on
    resume they come from the command, not the checkpoint (``" --no-progress --no-plot"``, or
    ``""``)."""
    return "".join(f" {flag}" for flag, off in (("--no-progress", not settings.progress),
                                                  ("--no-plot", not settings.plot)) if off)


#: settings of one invocation: on resume they come from the command, not the checkpoint
PER_RUN_SETTINGS = frozenset(n for n, s in specs(TrainSettings).items() if s.tags & _PER_RUN)
#: settings that may differ from the checkpoint's when resuming (they do not change what the
#: first N steps computed): given explicitly they win, otherwise the checkpoint's are kept.
#: Any other explicitly given setting must match the checkpoint.
RESUMABLE_SETTINGS = PER_RUN_SETTINGS | {n for n, s in specs(TrainSettings).items() if s.tags & _RESUMABLE}


# ---------------------------------------------------------------------------------------- data
def build_tokenizer(settings: TrainSettings, corpus: Path):
    """A new tokenizer for ``corpus``.

    ``char``: the sorted set of characters of the whole corpus (train and validation, so the
    validation text never holds an unknown character), read piece by piece. ``bpe``: byte-level
    BPE of ``bpe_vocab_size`` ids trained on the training split only, streamed piece by piece
    (:func:`pedestrian.data.iter_train_pieces`).
    """
    from .tokenizer import BPETokenizer, CharTokenizer

    if settings.tokenizer == "char":
        chars: set[str] = set()
        for piece in iter_corpus_pieces(corpus):
            chars.update(piece)
        return CharTokenizer(sorted(chars))
    return BPETokenizer.train(iter_train_pieces(corpus, settings.val_fraction),
                              vocab_size=settings.bpe_vocab_size)


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


# ---------------------------------------------------------------------------------------- evaluation, logs
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
    write_file(path, "".join(json.dumps(r) + "\n" for r in records), what="the training log")


def plot_loss_curve(records: list[dict], path, title: str = "") -> Path:
    """Draw training loss (per step and smoothed) and validation loss against the step.

    Args:
        records: ``log.jsonl`` records (``{"step", "loss"}`` and ``{"step", "val_loss"}``).
        path: the PNG to write (matplotlib, Agg backend; written atomically).

    Raises:
        WriteError (an ``OSError``): the PNG cannot be written; a previous one is left as it was.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]      # skipped: null
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
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
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    return write_file(path, png.getvalue(), what="the loss curve")


# ---------------------------------------------------------------------------------------- files
class RunFiles:
    """Every file a run writes in its folder, through one object: ``log.jsonl``, the checkpoint
    folders and ``loss_curve.png``.

    Every write goes through :mod:`pedestrian.atomic`: an OS failure (no space, no permission,
    ...) is a :class:`~pedestrian.atomic.WriteError` naming the file, and what was there before
    is left intact.

    Args:
        out: the run folder (created).
        keep_records_to: a resumed run keeps the log records up to its checkpoint's step (the
            ones written after that checkpoint are dropped); ``None``: a new log.
        replacing: ``out`` holds an older run (``--overwrite``). Its files stay untouched until
            this run saves its first checkpoint -- until then the log goes to ``log.jsonl.new``
            -- and then the new log replaces the old one and the old run's ``stale`` folders
            (``best``) are removed. A run that never saves leaves the old one as it was.
        stale: see ``replacing``.
    """

    def __init__(self, out, *, keep_records_to: int | None = None, replacing: bool = False, stale=()):
        self.out = Path(out)
        self.path, self.pending = self.out / "log.jsonl", self.out / "log.jsonl.new"
        self.replacing, self.stale = replacing, tuple(stale)
        make_dirs(self.out, "the run folder")
        if self.pending.exists():
            self.pending.unlink()             # left by an overwrite that never saved: not ours
        if replacing:
            self._file = AppendLog(self.pending, "the training log", truncate=True)
        else:
            kept = ([r for r in read_log(self.path) if r.get("step", 0) <= keep_records_to]
                    if keep_records_to is not None else [])
            _rewrite_log(self.path, kept)      # drop steps after the checkpoint (or an old run's)
            self._file = AppendLog(self.path, "the training log")

    def log(self, record: dict) -> None:
        """Append one record, one ``os.write`` (a JSON line; non-finite numbers must already be
        ``None``)."""
        self._file.write(json.dumps(record, allow_nan=False) + "\n")

    def save_checkpoint(self, name: str, model, optimizer, tokenizer, step: int, meta: dict, **kw) -> Path:
        """:func:`pedestrian.checkpoint.save_checkpoint` into ``out/name`` (atomic)."""
        folder = save_checkpoint(self.out / name, model, optimizer, tokenizer, step, meta, **kw)
        if self.replacing:                    # the new run is committed: its log replaces the old
            self._file.close()
            os.replace(self.pending, self.path)
            self._file = AppendLog(self.path, "the training log")
            self.replacing = False
            for stale in self.stale:
                shutil.rmtree(self.out / stale, ignore_errors=True)
        return folder

    def copy_checkpoint(self, src: str, dst: str) -> None:
        copy_checkpoint(self.out / src, self.out / dst)

    def plot(self, title: str) -> Path | None:
        """``loss_curve.png`` and ``gradients.png`` from the log (not while an older run is still
        the committed one)."""
        if self.replacing:
            return None
        records = read_log(self.path)
        plot_gradients(records, self.out / "gradients.png", title=title)
        return plot_loss_curve(records, self.out / "loss_curve.png", title=title)

    def close(self) -> None:
        self._file.close()
        if self.replacing and self.pending.exists():
            self.pending.unlink()              # never committed: the old run stays as it was


class NoFiles:
    """The ``files`` of a rank that writes nothing (every rank but rank 0): :class:`RunFiles`'s
    methods, doing nothing."""

    def log(self, record: dict) -> None:
        pass

    def save_checkpoint(self, *args, **kwargs) -> None:
        pass

    def copy_checkpoint(self, src: str, dst: str) -> None:
        pass

    def plot(self, title: str) -> None:
        pass

    def close(self) -> None:
        pass


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
        (untied)}}``: Frobenius norms over the whole batch (``Δ_n = dL/da_n`` of the mean loss);
        ``None`` where a norm is not finite.
    """
    from .backend import to_numpy

    def norm(*arrays) -> float | None:                 # None: not finite (the log is strict JSON)
        value = math.sqrt(sum(float(np.sum(np.square(np.asarray(to_numpy(a), dtype=np.float64))))
                              for a in arrays))
        return value if math.isfinite(value) else None

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
            values = [r["delta_norms"][block][name] for r in recs]
            top.plot(steps, [np.nan if v is None else v for v in values], color=color, lw=1.3, label=name)
        for name, color in zip(groups, group_colors):
            values = [r["grad_norms"].get(block, {}).get(name) for r in recs]
            if any(v is not None for v in values):
                bottom.plot(steps, [np.nan if v is None else v for v in values], color=color, lw=1.3, label=name)
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
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    return write_file(path, png.getvalue(), what="the gradient plot")


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


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _resumed(settings: TrainSettings, explicit: set[str], out: Path, group) -> tuple[TrainSettings, Checkpoint]:
    """The checkpoint in ``out/latest`` and the settings to go on with: the checkpoint's own,
    with the :data:`RESUMABLE_SETTINGS` given explicitly and the :data:`PER_RUN_SETTINGS` of
    this invocation. Any other explicit setting must match the checkpoint's."""
    ckpt = load_checkpoint(out / "latest", backend=settings.backend, device=_device(settings, group))
    saved = ckpt.meta.get("settings")
    if saved is None:
        raise TrainingError(f"checkpoint {ckpt.path} was not written by `pedestrian train` "
                            "(no training settings in it); it cannot be resumed")
    saved = TrainSettings.from_dict(saved)
    conflicts = []
    for name in sorted(explicit - RESUMABLE_SETTINGS):
        keys = [f"model.{k}" for k in settings.model] if name == "model" else [name]   # "model": all given
        for key in keys:
            if key.startswith("model."):
                k = key[len("model."):]
                mine, theirs = settings.model.get(k), ckpt.config.to_dict().get(k)   # derived widths resolved
            else:
                k, mine, theirs = key, getattr(settings, key), getattr(saved, key)
            if mine != theirs:
                conflicts.append(f"{k}={theirs!r} (you gave {mine!r})")
    if conflicts:
        raise TrainingError(f"the checkpoint in {ckpt.path} was trained with a different config: "
                            + "; ".join(conflicts) + ". Resume without those settings, or start a new run "
                            "with --out NEW_DIR")
    for name in RESUMABLE_SETTINGS:
        if name in explicit or name in PER_RUN_SETTINGS:
            setattr(saved, name, getattr(settings, name))
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


def _start(settings: TrainSettings, config: GPTConfig, ckpt: Checkpoint | None, group):
    """``(model, optimizer, data_rng)``: new, or as the checkpoint left them; every rank starts
    from rank 0's parameters."""
    if ckpt is None:
        from .model import GPT

        model = GPT(config, seed=settings.seed, dtype=settings.dtype, backend=settings.backend,
                    device=_device(settings, group))
        data_rng = np.random.default_rng(settings.seed)
    else:
        model, data_rng = ckpt.model, np.random.default_rng()
        data_rng.bit_generator.state = ckpt.meta["data_rng"]
    model.training = True
    group.broadcast_buffers([b.params for b in model.trainable_buffers()], "the initial parameters")
    optimizer = AdamW(model, lr=settings.lr, betas=(settings.beta1, settings.beta2), eps=settings.eps,
                      weight_decay=settings.weight_decay)
    if ckpt is not None:
        optimizer.load_state_dict(ckpt.optimizer_state())
        skipped = int(ckpt.meta.get("skipped_steps", 0))
        if optimizer.step_count != ckpt.step - skipped:
            raise TrainingError(f"checkpoint {ckpt.path} is inconsistent: optimizer step {optimizer.step_count} "
                                f"!= step {ckpt.step} - {skipped} skipped")
    return model, optimizer, data_rng


def _runner(settings: TrainSettings, model, ckpt: Checkpoint | None, group):
    """``(runner, context, slices)`` of :func:`pedestrian.parallel.runner_for` for this rank's rows,
    with a warning when a resumed run splits its batches differently from the checkpoint's steps."""
    rows = group.rows(settings.batch_size)
    try:
        runner, context = runner_for(model, settings.data_parallel, rows.stop - rows.start)
    except ValueError as exc:                 # e.g. an unknown mode
        raise TrainingError(f"--data-parallel {settings.data_parallel}: {exc}") from None
    split = runner.slices_for(rows.stop - rows.start) if runner is not model else 1
    if ckpt is not None:
        then = (ckpt.meta.get("world_size", 1), ckpt.meta.get("data_parallel_threads"))
        if then[0] != group.world_size or then[1] not in (None, split):
            log.warning(f"the checkpoint's steps ran on {then[0]} rank(s), each batch split into {then[1] or 1} "
                        f"slice(s) per rank; this run has {group.world_size} rank(s) and {split} slice(s): it "
                        "continues the same run (same batches, same dropout masks), equal up to the order of "
                        "float additions but not bit for bit; for that, resume with the same --nproc and "
                        "PEDESTRIAN_NUM_THREADS")
    return runner, context, split


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
        group: the process group (:mod:`pedestrian.distributed`); ``None``: the one this
            process's environment names (one process, or a rank started by ``torchrun``), joined
            here and left at the end.

    Returns:
        a :class:`TrainResult` (the same numbers on every rank; ``is_writer`` on rank 0);
        ``stop_reason`` is ``"max_steps"``, ``"stop_step"``, ``"max_minutes"``, or
        ``"interrupted"`` (SIGINT / SIGTERM on any rank, or :func:`pedestrian.loop.request_stop`,
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
    settings.validate()
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
    elif had_run and not overwrite:
        raise TrainingError(f"{out} already holds a checkpoint (step {read_state(out)[1].get('step')}); pass "
                            "--resume to continue it, --out NEW_DIR for a new run, or --overwrite to replace it")
    if settings.batch_size < group.world_size:
        raise TrainingError(f"--batch-size {settings.batch_size} is smaller than the {group.world_size} ranks: each "
                            f"rank computes its share of every batch's rows; use --batch-size >= {group.world_size}")
    # rank 0 builds the tokenizer and the token file first; the others take its tokenizer
    tokenizer = ckpt.tokenizer if ckpt else None
    if group.is_writer:
        tokenizer, train_tokens, val_tokens = prepare_data(settings, tokenizer)
    shared = group.broadcast(tokenizer.to_dict() if group.is_writer else None, "the tokenizer")
    if not group.is_writer:
        from .tokenizer import load_tokenizer

        tokenizer, train_tokens, val_tokens = prepare_data(settings, load_tokenizer(shared))
    config = settings.model_config(tokenizer.vocab_size)
    if ckpt is not None and ckpt.config != config:
        raise TrainingError(f"the checkpoint in {ckpt.path} has model config {ckpt.config}, which "
                            f"does not match its own training settings {config}; it is damaged")
    B, T, k = settings.batch_size, settings.context_length, settings.grad_accum
    train_ds, val_ds = TokenDataset(train_tokens), TokenDataset(val_tokens)
    model, optimizer, data_rng = _start(settings, config, ckpt, group)
    runner, context, split = _runner(settings, model, ckpt, group)
    end = settings.max_steps if settings.stop_step is None else min(settings.stop_step, settings.max_steps)
    trainer = Trainer(runner, optimizer, CosineSchedule(settings.lr, settings.warmup_steps, settings.max_steps,
                                                        settings.min_lr),
                      lambda: [train_ds.get_batch(data_rng, B, T) for _ in range(k)],
                      step=ckpt.step if ckpt else 0, end=end,
                      end_reason="max_steps" if end == settings.max_steps else "stop_step",
                      grad_clip=settings.grad_clip, max_skipped_steps=settings.max_skipped_steps,
                      tokens_per_step=B * T * k, context=context,
                      skipped_total=int(ckpt.meta.get("skipped_steps", 0)) if ckpt else 0,
                      group=group, dropout_seed=settings.seed)
    if ckpt is not None:
        trainer.last_eval = trainer.last_save = ckpt.step
    best_val = ckpt.meta.get("best_val_loss") if ckpt else None
    best_val = math.inf if best_val is None else float(best_val)
    files = RunFiles(out, keep_records_to=ckpt.step if ckpt else None, replacing=ckpt is None and had_run,
                     stale=("best",)) if group.is_writer else NoFiles()

    def save(t: Trainer) -> None:
        nonlocal best_val
        val = t.val_loss if t.last_eval == t.step else math.nan
        is_best = math.isfinite(val) and val <= best_val
        best_val = val if is_best else best_val
        meta = {"settings": settings.to_dict(), "data_rng": data_rng.bit_generator.state,
                "val_loss": _finite_or_none(val), "train_loss": _finite_or_none(t.loss),
                "best_val_loss": _finite_or_none(best_val), "tokens_seen": t.step * t.tokens_per_step,
                "world_size": group.world_size, "data_parallel_threads": split, "skipped_steps": t.skipped_total}
        files.save_checkpoint("latest", model, optimizer, tokenizer, t.step, meta)
        t.last_save = t.step                  # kept even if copying it to best/ fails
        if is_best:
            files.copy_checkpoint("latest", "best")

    resume_command = f"pedestrian train --out {out} --resume"
    if reports_to_launcher():
        resume_command += f" --nproc {group.world_size}"
    elif group.world_size > 1:
        resume_command = f"torchrun <the same options> -m {resume_command}"
    resume_command += per_run_flags(settings)
    _say_plan(settings, model, tokenizer, train_tokens, val_tokens, trainer, split, ckpt, out, group)
    progress = Progress(trainer, "train", settings.progress and group.is_writer)
    evaluation = Evaluation(runner, val_ds.fixed_batches(settings.seed + 1, settings.eval_batches, B, T),
                            settings.eval_interval, files, progress, context, group)
    checkpoints = Checkpoints(save, settings.checkpoint_interval or settings.eval_interval, out / "latest",
                              previous=f"the previous run in {out} is left as it was" if had_run else None,
                              model=model, go_on=f"continue from it with: {resume_command} "
                              "(the same settings redo the same steps), or start again with a lower --lr "
                              "(--overwrite, or --out NEW_DIR)")
    guard = TimeGuard(settings.max_minutes, t_start)
    if group.is_writer:                       # rank 0's clock decides for every rank
        trainer.stop_checks.append(guard)

    def gradient_norms(t: Trainer) -> None:   # after each validation, on the step's own batch; rank 0 logs
        if group.is_writer and t.step % settings.eval_interval == 0 and t.skipped is None:
            files.log(gradient_record(model, *t.batches[0], t.step))

    trainer.on("step_end", StepLog(files, t_start), progress, guard.mark, evaluation, gradient_norms, checkpoints,
               guard.measure)
    trainer.on("stop", finish(evaluation, checkpoints))
    try:
        reason = trainer.run()
    except WriteError as exc:                 # a full disk, ...: say what is kept and how to go on
        raise exc.advise(checkpoints.kept(trainer), f"continue with: {resume_command}"
                         if trainer.last_save >= 0 else "start again") from exc
    except NonFiniteError as exc:             # save_checkpoint refused a NaN / inf (the loop checks first)
        raise TrainingError(f"{exc}; {checkpoints.kept(trainer, good=True)}; start again with a lower --lr") from exc
    except CommunicationError as exc:         # another rank died or stopped answering
        then = f"; continue with: {resume_command}" if trainer.last_save >= 0 else "; start again"
        raise TrainingError(f"{exc} at step {trainer.step + 1}; the run stopped; {checkpoints.kept(trainer)}"
                            f"{then}") from exc
    finally:
        progress.close()
        files.close()
        if runner is not model:
            runner.close()
    if reason == "non_finite":
        raise TrainingError(trainer.non_finite_message(checkpoints.kept(trainer, good=True)))
    if settings.plot:
        try:
            files.plot(f"{settings.data or 'Shakespeare'} ({settings.tokenizer}), "
                       f"{model.num_params(trainable_only=True):,} params, d_model {config.d_model}, "
                       f"{config.n_blocks} blocks")
        except WriteError as exc:
            raise exc.advise(f"the run itself is saved ({checkpoints.kept(trainer)})",
                             f"draw it from the log with: python -c \"from pedestrian.train import *; "
                             f"plot_loss_curve(read_log('{out / 'log.jsonl'}'), '{out / 'loss_curve.png'}')\"") from exc
    result = TrainResult(step=trainer.step, train_loss=trainer.loss, val_loss=trainer.val_loss,
                         best_val_loss=best_val, seconds=time.perf_counter() - t_start,
                         tokens_per_second=trainer.tokens_per_second(), stop_reason=reason, out=out,
                         model=model, tokenizer=tokenizer, is_writer=group.is_writer,
                         resume_command=resume_command)
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


def _say_plan(settings, model, tokenizer, train_tokens, val_tokens, trainer, split, ckpt, out, group) -> None:
    """The opening lines of a run: model, data, steps, ranks and threads (and a warm-up warning)."""
    B, T, k = settings.batch_size, settings.context_length, settings.grad_accum
    log.info(f"pedestrian train: {model.num_params(trainable_only=True):,} parameters, {model.config}")
    log.info(f"data: {settings.data or BUNDLED_CORPUS} ({settings.tokenizer} tokenizer, {tokenizer.vocab_size} "
             f"ids): {train_tokens.shape[0]:,} training / {val_tokens.shape[0]:,} validation tokens")
    log.info(f"steps {trainer.step} -> {trainer.end} of {settings.max_steps}, batch {B}x{k}x{T} tokens, "
             f"lr {settings.lr:g} (warm-up {settings.warmup_steps}, cosine to {settings.min_lr:g}); "
             f"out: {out}" + (f"; resumed from {ckpt.path}" if ckpt else ""))
    if group.world_size > 1:
        rows = group.rows(B)
        log.info(f"ranks: {group.world_size} ({group.backend} on {group.device}), each computing about "
                 f"{rows.stop - rows.start} of the {B} rows of every batch; rank 0 writes the files")
    log.info(f"threads: each batch split into {split} slices, one on this thread and {split - 1} in other "
             f"thread(s) (data-parallel {settings.data_parallel})" if split > 1 else
             f"threads: one model pass per step (data-parallel {settings.data_parallel}); BLAS threads the products")
    if settings.warmup_steps >= settings.max_steps:
        log.warning(f"--warmup-steps {settings.warmup_steps} >= --max-steps {settings.max_steps}: the "
                    f"learning rate never reaches its peak {settings.lr:g}; pass a smaller --warmup-steps")

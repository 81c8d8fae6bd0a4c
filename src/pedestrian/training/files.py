"""A run's files: ``log.jsonl`` (one JSON record a step), the checkpoints ``latest`` / ``best``,
and the two plots (``loss_curve.png``, ``gradients.png``); :class:`RunFiles` is the one object
through which a run writes, :class:`NoFiles` the one a rank that writes nothing gets.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import shutil
from pathlib import Path

import numpy as np

from ..atomic import AppendLog, make_dirs, write_file
from ..checkpoint import copy_checkpoint, save_checkpoint
from ..model import eval_mode

log = logging.getLogger("pedestrian.train")

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
        "mlp_contract"; a plugged activation's "act", a plugged MLP's "mlp"}, "tok_emb",
        "pos_emb" (learned positions), "ln_final", "logits" (untied)}}``: Frobenius norms over
        the whole batch (``Δ_n = dL/da_n`` of the mean loss); ``None`` where a norm is not finite.
    """
    from ..backend import to_numpy

    def norm(*arrays) -> float | None:                 # None: not finite (the log is strict JSON)
        value = math.sqrt(sum(float(np.sum(np.square(np.asarray(to_numpy(a), dtype=np.float64))))
                              for a in arrays))
        return value if math.isfinite(value) else None

    with eval_mode(model):
        model.loss(x, y)
        grads = model.backward(keep_deltas=True)
        deltas = model.deltas()
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
        prefix = f"blocks.{i}."                            # Δ2 … Δ10 (SwiGLU: Δ7_gate, Δ7_up for Δ7)
        names = [k[len(prefix):] for k in deltas if k.startswith(prefix) and not k.endswith("Δcausal")]
        delta_norms[f"blocks.{i}"] = {n: norm(deltas[prefix + n]) for n in reversed(names)}
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
    deltas = list(recs[0]["delta_norms"][blocks[0]]) if recs and blocks else [f"Δ{k}" for k in range(2, 11)]
    groups = ("ln1", "attn.qkv", "attn_proj", "ln2", "mlp_gate", "mlp_expand", "act", "mlp_contract", "mlp")
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
        axes[0, 0].text(0.5, 0.5, "no gradient records\n(the run ended before --eval-interval,\nor ran with --update-in-backward)",
                        ha="center", va="center", transform=axes[0, 0].transAxes)
    fig.suptitle(title or "error signals and gradients over the run (Frobenius norms, whole batch)", fontsize=10)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    return write_file(path, png.getvalue(), what="the gradient plot")

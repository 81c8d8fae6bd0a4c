"""Draw the attention weights P of every block and head for a prompt: one heat map per (block,
head), query tokens down the side, key tokens along the bottom, weights from 0 to 1 on one shared
colour scale (row α of a map is the softmax distribution query α gives every key; with a causal
mask the upper triangle is 0).

The prompt is encoded with the checkpoint's tokenizer; a prompt longer than the context keeps
its last context_length tokens (a note says so). Characters are labelled as themselves, with
'⏎' for a newline and '␣' for a space. The PNG is written atomically (matplotlib, Agg).

Examples:
  pedestrian attention --checkpoint runs/shakespeare_char/best --prompt "ROMEO: But soft" --out attn.png
  pedestrian attention --checkpoint runs/gpt2_bpe/latest --prompt "The meaning of life" --out a.png --dpi 150
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="CKPT", help="checkpoint or run folder")
    parser.add_argument("--prompt", required=True, help="the text whose attention is drawn")
    parser.add_argument("--out", required=True, metavar="FILE.png", help="the PNG to write")
    parser.add_argument("--dpi", type=int, default=110, help="resolution (default 110)")


def token_labels(tokenizer, ids) -> list[str]:
    """A short printable label per token: its own text, ⏎ for newlines, ␣ for spaces."""
    out = []
    for i in ids:
        text = tokenizer.decode([int(i)])
        text = text.replace("\n", "⏎").replace(" ", "␣").replace("\t", "⇥") or "∅"
        out.append(text if len(text) <= 8 else text[:7] + "…")
    return out


def plot_attention(weights: list, labels: list[str], path, *, title: str = "", dpi: int = 110) -> Path:
    """One heat map per block (rows) and head (columns) of ``P``.

    Args:
        weights: list over blocks of ``(n_heads, T, T)`` arrays (one sequence).
        labels: ``T`` token labels (both axes).
        path: the PNG to write (atomically, :func:`pedestrian.atomic.write_file`).
        title: figure title.

    Returns:
        the path written.

    Raises:
        WriteError (an ``OSError``): the OS refused the write; the old file is unchanged.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_blocks, n_heads, T = len(weights), weights[0].shape[0], len(labels)
    font = 7 if T <= 48 else 6
    cell = min(8.0, max(2.6, T * (font + 2) / 72))           # inches per map: room for every label
    stride = max(1, math.ceil(T / (cell * 72 / (font + 2))))  # up to ~64 tokens; then every k-th
    fig, axes = plt.subplots(n_blocks, n_heads, figsize=(n_heads * cell + 1.4, n_blocks * cell + 1.0),
                             dpi=dpi, squeeze=False, constrained_layout=True)
    fig.get_layout_engine().set(h_pad=0.12, hspace=0.04)    # room between a row's labels and the next titles
    ticks = np.arange(0, T, stride)
    image = None
    for i in range(n_blocks):
        for h in range(n_heads):
            ax = axes[i, h]
            image = ax.imshow(np.asarray(weights[i][h], dtype=np.float64), cmap="viridis", vmin=0.0,
                              vmax=1.0, interpolation="nearest", aspect="equal")
            ax.set_title(f"block {i}, head {h}", fontsize=9)
            ax.set_xticks(ticks, [labels[t] for t in ticks], fontsize=font, rotation=90)
            ax.set_yticks(ticks, [labels[t] for t in ticks], fontsize=font)
            if i == n_blocks - 1:
                ax.set_xlabel("key (attended to)", fontsize=8)
            if h == 0:
                ax.set_ylabel("query", fontsize=8)
    bar = fig.colorbar(image, ax=axes, shrink=0.6, pad=0.01)
    bar.set_label("attention weight P", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    import io

    from ..atomic import write_file

    png = io.BytesIO()
    try:
        fig.savefig(png, format="png")
    finally:
        plt.close(fig)
    # through the one atomic writer: a full disk or a read-only folder is one WriteError that
    # says the old picture is unchanged (issue 13, part 3)
    return write_file(Path(path), png.getvalue(), what="the attention picture")


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import load_checkpoint

    out = Path(args.out).expanduser()
    if out.suffix.lower() != ".png":
        raise ValueError(f"--out must name a .png file, got {args.out!r}")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"the folder of --out does not exist: {out.parent}; create it first")
    if args.dpi < 20:
        raise ValueError(f"--dpi must be at least 20, got {args.dpi}")
    ckpt = load_checkpoint(args.checkpoint, dtype="float64")
    model, tokenizer = ckpt.model, ckpt.tokenizer
    if tokenizer is None:
        raise ValueError(f"checkpoint {args.checkpoint} has no tokenizer, so the prompt cannot be encoded")
    ids = list(tokenizer.encode(args.prompt))
    if not ids:
        raise ValueError("--prompt is empty: give at least one character to attend over")
    C = model.config.context_length
    if len(ids) > C:
        print(f"note: the prompt has {len(ids)} tokens; drawing its last {C} (the context length)",
              file=sys.stderr)
        ids = ids[-C:]
    model.training = False
    model.forward(np.asarray([ids], dtype=np.int64))
    weights = [np.asarray(p)[0] for p in model.attention_weights()]          # (n_heads, T, T) each
    c = model.config
    title = (f"attention weights P of {args.checkpoint} (step {ckpt.step}): {c.n_blocks} blocks × {c.n_heads} heads, "
             f"{len(ids)} tokens, positions {c.position_encoding}" + ("" if c.causal else ", non-causal"))
    plot_attention(weights, token_labels(tokenizer, ids), out, title=title, dpi=args.dpi)
    print(f"wrote {out} ({c.n_blocks} × {c.n_heads} maps of {len(ids)} × {len(ids)} weights)")
    return 0

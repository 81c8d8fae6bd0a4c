"""Draw the attention weights P of every block and head for a prompt: one heat map per (block,
head), query tokens down the side, key tokens along the bottom, weights from 0 to 1 on one shared
colour scale (row α of a map is the softmax distribution query α gives every key; with a causal
mask the upper triangle is 0).

--gradients draws one training step instead (paper section 3.2): the next-token loss of the
prompt (tokens 0 … T-2 predict tokens 1 … T-1), and beside each head's P its Δcausal =
∂L/∂ρ_causal, the softmax backward that feeds the queries' and keys' gradients. Δcausal is
drawn in blue (negative) and red (positive) around white 0, each map on its own symmetric scale
(written in its title); every row of it sums to 0 and the masked entries are exactly 0.

The model: a checkpoint (--checkpoint; the prompt is encoded with its tokenizer), or a fresh
random model (--random: GPT-2's initialisation with --seed, widths --n-blocks, --n-heads,
--d-model; a character tokenizer of the prompt's own characters) -- no training needed.
A prompt longer than the context keeps its last context_length tokens (a note says so).
Characters are labelled as themselves, with '⏎' for a newline and '␣' for a space. The PNG is
written atomically (matplotlib, Agg).

Examples:
  pedestrian attention --checkpoint runs/shakespeare_char/best --prompt "ROMEO: But soft" --out attn.png
  pedestrian attention --checkpoint runs/gpt2_bpe/latest --prompt "The meaning of life" --out a.png --dpi 150
  pedestrian attention --checkpoint runs/shakespeare_char/best --prompt "ROMEO: But soft" --gradients --out step.png
  pedestrian attention --random --n-blocks 2 --n-heads 2 --prompt "to be or not to be" --gradients --out step.png
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np


#: --random's widths when not given
RANDOM_DEFAULTS = dict(n_blocks=2, n_heads=2, d_model=16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", metavar="CKPT", help="checkpoint or run folder")
    parser.add_argument("--random", action="store_true",
                        help="a fresh random model instead of a checkpoint (see --n-blocks, --n-heads, --d-model, --seed)")
    parser.add_argument("--prompt", required=True, help="the text whose attention is drawn")
    parser.add_argument("--out", required=True, metavar="FILE.png", help="the PNG to write")
    parser.add_argument("--gradients", action="store_true",
                        help="one training step: P beside Δcausal for every block and head")
    parser.add_argument("--dpi", type=int, default=110, help="resolution (default 110)")
    parser.add_argument("--n-blocks", type=int, default=None, help="--random: blocks (default 2)")
    parser.add_argument("--n-heads", type=int, default=None, help="--random: heads per block (default 2)")
    parser.add_argument("--d-model", type=int, default=None,
                        help="--random: width d, divisible by --n-heads (default 16)")
    parser.add_argument("--seed", type=int, default=None, help="--random: initialisation seed (default 0)")


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
    return _write_png(fig, path)


def _write_png(fig, path) -> Path:
    """Render ``fig`` to PNG, close it, and write it through the one atomic writer: a full disk or
    a read-only folder is one WriteError that says the old picture is unchanged (issue 13, part 3)."""
    import io

    import matplotlib.pyplot as plt

    from ..atomic import write_file

    png = io.BytesIO()
    try:
        fig.savefig(png, format="png")
    finally:
        plt.close(fig)
    return write_file(Path(path), png.getvalue(), what="the attention picture")


def plot_step(weights: list, delta_causal: list, labels: list[str], path, *, title: str = "",
              dpi: int = 110) -> Path:
    """One training step, per block (rows) and head: ``P`` and, beside it, ``Δcausal`` (paper 3.2).

    Args:
        weights: list over blocks of ``(n_heads, T, T)`` arrays, ``P`` of one sequence.
        delta_causal: the same shapes: ``Δcausal = ∂L/∂ρ_causal`` of that sequence.
        labels: ``T`` token labels (both axes).
        path, title, dpi: as :func:`plot_attention`.

    Returns:
        the path written: a grid of ``n_blocks`` rows and ``2 · n_heads`` heat maps per row.

    Raises:
        WriteError (an ``OSError``): the OS refused the write; the old file is unchanged.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_blocks, n_heads, T = len(weights), weights[0].shape[0], len(labels)
    font = 7 if T <= 48 else 6
    cell = min(6.0, max(2.4, T * (font + 2) / 72))
    stride = max(1, math.ceil(T / (cell * 72 / (font + 2))))
    fig, axes = plt.subplots(n_blocks, 2 * n_heads, figsize=(2 * n_heads * cell + 1.6, n_blocks * cell + 1.0),
                             dpi=dpi, squeeze=False, constrained_layout=True)
    fig.get_layout_engine().set(h_pad=0.12, hspace=0.04)
    ticks = np.arange(0, T, stride)
    p_image = None
    for i in range(n_blocks):
        for h in range(n_heads):
            p = np.asarray(weights[i][h], dtype=np.float64)
            dc = np.asarray(delta_causal[i][h], dtype=np.float64)
            scale = float(np.max(np.abs(dc))) or 1.0
            for ax, data, kind in ((axes[i, 2 * h], p, "P"), (axes[i, 2 * h + 1], dc, "Δcausal")):
                if kind == "P":
                    p_image = ax.imshow(data, cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
                    ax.set_title(f"block {i}, head {h}: P", fontsize=9)
                else:
                    ax.imshow(data, cmap="RdBu_r", vmin=-scale, vmax=scale, interpolation="nearest")
                    ax.set_title(f"block {i}, head {h}: Δcausal (±{scale:.1e})", fontsize=9)
                ax.set_xticks(ticks, [labels[t] for t in ticks], fontsize=font, rotation=90)
                ax.set_yticks(ticks, [labels[t] for t in ticks], fontsize=font)
                if i == n_blocks - 1:
                    ax.set_xlabel("key β", fontsize=8)
                if ax is axes[i, 0]:
                    ax.set_ylabel("query α", fontsize=8)
    bar = fig.colorbar(p_image, ax=axes, shrink=0.6, pad=0.01)
    bar.set_label("attention weight P", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    return _write_png(fig, path)


def _random_model(args: argparse.Namespace):
    """``--random``: a fresh model and a character tokenizer of the prompt's characters."""
    from ..config import GPTConfig
    from ..model import GPT
    from ..tokenizer import CharTokenizer

    widths = {k: (RANDOM_DEFAULTS[k] if getattr(args, k) is None else getattr(args, k)) for k in RANDOM_DEFAULTS}
    if not args.prompt:
        raise ValueError("--prompt is empty: give at least one character to attend over")
    tokenizer = CharTokenizer.from_text(args.prompt)
    context = max(len(args.prompt), 2)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, context_length=context, **widths)
    seed = 0 if args.seed is None else args.seed
    model = GPT(config, seed=seed, dtype="float64")
    return model, tokenizer, f"a fresh random model (GPT-2 initialisation, seed {seed})"


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser()
    if out.suffix.lower() != ".png":
        raise ValueError(f"--out must name a .png file, got {args.out!r}")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"the folder of --out does not exist: {out.parent}; create it first")
    if args.dpi < 20:
        raise ValueError(f"--dpi must be at least 20, got {args.dpi}")
    if (args.checkpoint is None) == (not args.random):
        raise ValueError("give either --checkpoint CKPT or --random (a fresh random model), not "
                         + ("both" if args.random else "neither"))
    random_flags = [f"--{k.replace('_', '-')}" for k in (*RANDOM_DEFAULTS, "seed") if getattr(args, k) is not None]
    if args.checkpoint is not None and random_flags:
        raise ValueError(f"{', '.join(random_flags)} set{'s' if len(random_flags) == 1 else ''} up --random's "
                         "model; a checkpoint has its own")
    for k in RANDOM_DEFAULTS:
        if getattr(args, k) is not None and getattr(args, k) < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be a positive integer, got {getattr(args, k)}")
    if args.random:
        model, tokenizer, source = _random_model(args)
    else:
        from ..checkpoint import load_checkpoint

        ckpt = load_checkpoint(args.checkpoint, dtype="float64")
        model, tokenizer = ckpt.model, ckpt.tokenizer
        source = f"{args.checkpoint} (step {ckpt.step})"
        if tokenizer is None:
            raise ValueError(f"checkpoint {args.checkpoint} has no tokenizer, so the prompt cannot be encoded")
    ids = list(tokenizer.encode(args.prompt))
    if not ids:
        raise ValueError("--prompt is empty: give at least one character to attend over")
    C = model.config.context_length + (1 if args.gradients else 0)   # + the last step's target
    if len(ids) > C:
        print(f"note: the prompt has {len(ids)} tokens; drawing its last {C} (the context length"
              + (" + the last target)" if args.gradients else ")"), file=sys.stderr)
        ids = ids[-C:]
    if args.gradients and len(ids) < 2:
        raise ValueError("--gradients needs a prompt of at least 2 tokens (one to read, one to predict)")
    model.training = False
    c = model.config
    shape = f"{c.n_blocks} blocks × {c.n_heads} heads, positions {c.position_encoding}" + ("" if c.causal else ", non-causal")
    if not args.gradients:
        model.forward(np.asarray([ids], dtype=np.int64))
        weights = [np.asarray(p)[0] for p in model.attention_weights()]          # (n_heads, T, T) each
        title = f"attention weights P of {source}: {shape}, {len(ids)} tokens"
        plot_attention(weights, token_labels(tokenizer, ids), out, title=title, dpi=args.dpi)
        print(f"wrote {out} ({c.n_blocks} × {c.n_heads} maps of {len(ids)} × {len(ids)} weights)")
        return 0
    x, y = np.asarray([ids[:-1]], dtype=np.int64), np.asarray([ids[1:]], dtype=np.int64)
    loss = model.loss(x, y)
    model.backward(keep_deltas=True)
    weights = [np.asarray(p)[0] for p in model.attention_weights()]
    deltas = model.deltas()
    delta_causal = [np.asarray(deltas[f"blocks.{i}.Δcausal"])[0] for i in range(c.n_blocks)]
    T = x.shape[1]
    title = (f"one step of {source}: {shape}\nnext-token loss {loss:.3f} on {T} tokens; beside each P "
             "its Δcausal = ∂L/∂ρ_causal (blue < 0 < red, own scale per map)")
    plot_step(weights, delta_causal, token_labels(tokenizer, ids[:-1]), out, title=title, dpi=args.dpi)
    print(f"wrote {out} ({c.n_blocks} × {c.n_heads} heads, P beside Δcausal: {2 * c.n_blocks * c.n_heads} "
          f"maps of {T} × {T}; loss {loss:.4f})")
    return 0

"""Pictures of attention: the weights ``P`` of every block and head for one input
(:func:`plot_attention`), and one training step's ``P`` beside its ``Δcausal = ∂L/∂ρ_causal``
(:func:`plot_step`, paper section 3.2). ``pedestrian attention`` draws them; the pictures of a
training run (loss curve, gradient norms) are :mod:`pedestrian.training.files`'.

Characters are labelled as themselves, with '⏎' for a newline and '␣' for a space
(:func:`token_labels`). A PNG is written atomically (matplotlib, Agg). What they show is
computed by :func:`attention_maps`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def token_labels(tokenizer, ids) -> list[str]:
    """A short printable label per token: its own text, ⏎ for newlines, ␣ for spaces."""
    out = []
    for i in ids:
        text = tokenizer.decode([int(i)])
        text = text.replace("\n", "⏎").replace(" ", "␣").replace("\t", "⇥") or "∅"
        out.append(text if len(text) <= 8 else text[:7] + "…")
    return out


def random_model(prompt: str, seed: int = 0, **widths):
    """``(model, tokenizer)`` for ``pedestrian attention --random``: a float64 GPT with GPT-2's
    initialisation (``seed``; ``widths``: ``n_blocks``, ``n_heads``, ``d_model``) and a character
    tokenizer of ``prompt``'s own characters; context ``max(len(prompt), 2)``.

    Raises:
        ValueError: an empty prompt, or widths :class:`pedestrian.config.GPTConfig` refuses.
    """
    from ..config import GPTConfig
    from ..model import GPT
    from ..text.tokenizer import CharTokenizer

    if not prompt:
        raise ValueError("--prompt is empty: give at least one character to attend over")
    tokenizer = CharTokenizer.from_text(prompt)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, context_length=max(len(prompt), 2), **widths)
    return GPT(config, seed=seed, dtype="float64"), tokenizer


def attention_maps(model, ids, gradients: bool = False) -> tuple[list, list | None, float | None]:
    """``(weights, delta_causal, loss)`` of ``model`` on the token ids ``ids`` (one sequence).

    ``weights``: per block, ``P`` as a float NumPy array ``(n_heads, T, T)``. Without
    ``gradients`` a forward of ``ids`` (``T = len(ids)``; ``delta_causal`` and ``loss`` are
    ``None``); with it one training step (paper section 3.2): the next-token loss of ``ids[:-1]``
    predicting ``ids[1:]`` (``T = len(ids) - 1``) and, per block, ``Δcausal = ∂L/∂ρ_causal``
    ``(n_heads, T, T)``. The model is put in evaluation mode (no dropout).
    """
    model.training = False
    ids = np.asarray([ids], dtype=np.int64)
    if not gradients:
        model.forward(ids)
        return [np.asarray(p)[0] for p in model.attention_weights()], None, None
    loss = model.loss(ids[:, :-1], ids[:, 1:])
    model.backward(keep_deltas=True)
    deltas = model.deltas()
    delta_causal = [np.asarray(deltas[f"blocks.{i}.Δcausal"])[0] for i in range(model.config.n_blocks)]
    return [np.asarray(p)[0] for p in model.attention_weights()], delta_causal, float(loss)


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
    return _finish(fig, axes, image, title, path)


def _finish(fig, axes, image, title: str | None, path):
    """The colour bar of the weights ``P`` (``image``), the title, and the PNG written."""
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
    return _finish(fig, axes, p_image, title, path)

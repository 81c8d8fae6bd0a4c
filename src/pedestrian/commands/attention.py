"""Draw the attention weights P of every block and head for a prompt: one heat map per (block,
head), query tokens down the side, key tokens along the bottom, weights from 0 to 1 on one shared
colour scale (a causal mask zeroes the upper triangle).

--gradients draws one training step instead (paper section 3.2): beside each head's P its
Δcausal = ∂L/∂ρ_causal for the prompt's next-token loss, blue < 0 < red (rows sum to 0).

The model: a checkpoint (--checkpoint, with its tokenizer), or a fresh random model (--random:
--seed, --n-blocks, --n-heads, --d-model, a character tokenizer of the prompt). A prompt longer
than the context keeps its last context_length tokens. The drawing: pedestrian.paper.pictures.

Examples:
  pedestrian attention --checkpoint runs/shakespeare_char/best --prompt "ROMEO: But soft" --out attn.png
  pedestrian attention --checkpoint runs/gpt2_bpe/latest --prompt "The meaning of life" --out a.png --dpi 150
  pedestrian attention --checkpoint runs/shakespeare_char/best --prompt "ROMEO: But soft" --gradients --out step.png
  pedestrian attention --random --n-blocks 2 --n-heads 2 --prompt "to be or not to be" --gradients --out step.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..paper.pictures import attention_maps, random_model, plot_attention, plot_step, token_labels

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
        widths = {k: (RANDOM_DEFAULTS[k] if getattr(args, k) is None else getattr(args, k)) for k in RANDOM_DEFAULTS}
        seed = 0 if args.seed is None else args.seed
        model, tokenizer = random_model(args.prompt, seed, **widths)
        source = f"a fresh random model (GPT-2 initialisation, seed {seed})"
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
    c = model.config
    shape = f"{c.n_blocks} blocks × {c.n_heads} heads, positions {c.position_encoding}" + ("" if c.causal else ", non-causal")
    weights, delta_causal, loss = attention_maps(model, ids, args.gradients)
    if not args.gradients:
        title = f"attention weights P of {source}: {shape}, {len(ids)} tokens"
        plot_attention(weights, token_labels(tokenizer, ids), out, title=title, dpi=args.dpi)
        print(f"wrote {out} ({c.n_blocks} × {c.n_heads} maps of {len(ids)} × {len(ids)} weights)")
        return 0
    T = len(ids) - 1
    title = (f"one step of {source}: {shape}\nnext-token loss {loss:.3f} on {T} tokens; beside each P "
             "its Δcausal = ∂L/∂ρ_causal (blue < 0 < red, own scale per map)")
    plot_step(weights, delta_causal, token_labels(tokenizer, ids[:-1]), out, title=title, dpi=args.dpi)
    print(f"wrote {out} ({c.n_blocks} × {c.n_heads} heads, P beside Δcausal: {2 * c.n_blocks * c.n_heads} "
          f"maps of {T} × {T}; loss {loss:.4f})")
    return 0

"""Forward and backward on real text, then check every hand-derived gradient by finite differences.

Takes a few windows of the bundled Shakespeare (or --data), a character tokenizer and a tiny
float64 GPT, runs a0 -> a12 and back, prints the size of every error signal Δ12 ... Δ1 (how the
gradient flows back through the paper's numbered activations), and compares, for every
parameter tensor, a few gradient entries with central finite differences
(L(θ+h) − L(θ−h)) / 2h. An entry passes when |numeric − analytic| <= atol + rtol·|numeric|
(finite differences themselves are only good to about h² + ε/h ≈ 1e-10 absolute); exit status 1
if any entry fails. The relative error |numeric − analytic| / |numeric| is shown only where
|numeric| >= atol ('-' otherwise: a gradient that is exactly zero, e.g. that of the attention
key bias, which softmax's shift invariance cancels, has no meaningful relative error).

Examples:
  pedestrian demo
  pedestrian demo --entries 10 --seed 3
  pedestrian demo --data my_text.txt --step 1e-6
"""

from __future__ import annotations

import argparse

import numpy as np

from ..config import GPTConfig
from ..data import TokenDataset, load_corpus
from ..model import GPT
from ..tokenizer import CharTokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", help="text file or folder (default: the bundled Shakespeare)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--entries", type=int, default=3, help="entries checked per parameter tensor (>= 1)")
    parser.add_argument("--step", type=float, default=1e-5, help="finite-difference step h (> 0)")
    parser.add_argument("--rtol", type=float, default=1e-6, help="relative tolerance")
    parser.add_argument("--atol", type=float, default=1e-8, help="absolute tolerance")


def run(args: argparse.Namespace) -> int:
    import math

    if args.entries < 1:
        raise ValueError(f"--entries must be a positive integer, got {args.entries}")
    if not (math.isfinite(args.step) and args.step > 0):
        raise ValueError(f"--step must be a finite number > 0 (e.g. 1e-5), got {args.step}")
    for name in ("rtol", "atol"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"--{name} must be a finite number >= 0, got {v}")
    text = load_corpus(args.data)[:200_000]
    tokenizer = CharTokenizer.from_text(text)
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, context_length=16, d_model=24, n_heads=3,
                       n_blocks=2, d_qk=6, d_head=8)
    model = GPT(config, seed=args.seed, dtype="float64")
    rng = np.random.default_rng(args.seed)
    for name, p in model.params.items():          # larger random weights than the init, so every
        if name.endswith("bias"):                 # path carries a visible signal
            p[...] = rng.normal(0, 0.1, p.shape)
        elif p.ndim == 2:
            p[...] = rng.normal(0, 0.3, p.shape)
    x, y = TokenDataset(ids).get_batch(rng, 4, config.context_length)
    print(f"text: {len(text):,} characters, vocabulary {tokenizer.vocab_size}; "
          f"batch {x.shape}, first window: {tokenizer.decode(x[0])!r}")
    print(f"model: {config}")
    loss = model.loss(x, y)
    grads = {k: v.copy() for k, v in model.backward(keep_deltas=True).items()}
    print(f"loss a12 -> {loss:.6f} nats/char (uniform guess: {np.log(tokenizer.vocab_size):.4f})\n")
    print("error signals (Δ_i = dL/da_i), root mean square:")
    for name, delta in model.deltas().items():
        if not name.endswith("Δcausal"):
            print(f"  {name:<16} {tuple(delta.shape)!s:<14} {np.sqrt(np.mean(delta ** 2)):.3e}")
    print(f"\n{'parameter':<30}{'entries':>8}{'max abs err':>14}{'max rel err':>14}")
    failed = 0
    for name, p in model.params.items():
        flat_index = rng.choice(p.size, size=min(args.entries, p.size), replace=False)
        abs_errs, rel_errs = [], []
        for fi in flat_index:
            idx = np.unravel_index(fi, p.shape)
            old = p[idx]
            p[idx] = old + args.step
            up = model.loss(x, y)
            p[idx] = old - args.step
            down = model.loss(x, y)
            p[idx] = old
            numeric = (up - down) / (2 * args.step)
            analytic = grads[name][idx]
            err = abs(numeric - analytic)
            abs_errs.append(err)
            if abs(numeric) >= args.atol and abs(numeric) > 0:
                rel_errs.append(err / abs(numeric))
            failed += err > args.atol + args.rtol * abs(numeric)
        rel = f"{max(rel_errs):>14.2e}" if rel_errs else f"{'-':>14}"
        print(f"{name:<30}{len(abs_errs):>8}{max(abs_errs):>14.2e}{rel}")
    print(f"\n{failed} entries outside |numeric − analytic| <= {args.atol:g} + {args.rtol:g}·|numeric| "
          f"-> {'OK' if not failed else 'FAILED'}")
    return 0 if not failed else 1

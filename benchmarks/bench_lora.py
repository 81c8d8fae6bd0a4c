"""Cost of a LoRA fine-tuning step with a frozen base against a full training step.

Run by hand (never a timed test): ``python benchmarks/bench_lora.py``. Both kinds of step are
alternated in one process and timed as CPU time (``time.process_time``), best of N, so load from
other processes mostly stays out. The frozen base skips every base weight-gradient matmul and the
base AdamW update; it still needs every input signal Δ down to block 0.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pedestrian import GPT, GPTConfig
from pedestrian.training.optim import AdamW
from pedestrian.training import train_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-blocks", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--vocab-size", type=int, default=50257)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--context-length", type=int, default=64)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-targets", nargs="+", default=["all"])
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    cfg = GPTConfig(vocab_size=args.vocab_size, context_length=args.context_length,
                    d_model=args.d_model, n_heads=args.d_model // 64, n_blocks=args.n_blocks)
    full, lora = GPT(cfg), GPT(cfg)
    lora.add_lora(args.lora_targets, rank=args.lora_rank)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch_size, cfg.context_length + 1))
    batch = [(x[:, :-1], x[:, 1:])]
    models = {"full": (full, AdamW(full)), "lora": (lora, AdamW(lora))}
    times: dict[str, list[float]] = {"full": [], "lora": []}
    for i in range(args.repeats + 1):
        for name in (("full", "lora") if i % 2 else ("lora", "full")):
            model, opt = models[name]
            t = time.process_time()
            train_step(model, opt, batch, lr=1e-4)
            if i:                                     # the first round warms up
                times[name].append(time.process_time() - t)
    best = {k: min(v) for k, v in times.items()}
    print(f"config: {cfg}")
    print(f"LoRA r={args.lora_rank} on {' '.join(args.lora_targets)}: "
          f"{lora.num_params(trainable_only=True):,} trainable of {lora.num_params():,}")
    print(f"full step {best['full'] * 1e3:.1f} ms CPU, frozen-base LoRA step {best['lora'] * 1e3:.1f} ms CPU, "
          f"ratio {best['lora'] / best['full']:.2f}")


if __name__ == "__main__":
    main()

"""Print the parameter table (per layer, per kind, total) of a preset or config, without allocating.

Examples:
  pedestrian params --preset gpt2
  pedestrian params --preset gpt2 --lora-rank 16 --lora-targets logits
  pedestrian params --vocab-size 65 --context-length 64 --d-model 128 --n-heads 4 --n-blocks 4
  pedestrian params --preset gpt2 --d-mlp 3000 --no-qkv-bias
  pedestrian params --preset gpt2 --position-encoding rope     # no position table: 786,432 fewer
  pedestrian params --hf-dir SmolLM2-135M --lora-rank 8 --lora-targets q v
"""

from __future__ import annotations

import argparse

from ..training.describe import described_model
from ..model.layout import LORA_LAYER_KINDS
from ..paper.explain import params_table
from ..training.settings import add_model_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser, "qkv_bias")
    parser.add_argument("--hf-dir", metavar="DIR", help="a Hugging Face model folder (its config.json; no weights "
                        "read) instead of a preset")
    parser.add_argument("--lora-rank", type=int, help="also count LoRA adapters of this rank")
    parser.add_argument("--lora-targets", nargs="+", default=["all"],
                        help=f"LoRA layer kinds: {' '.join(LORA_LAYER_KINDS)} or all (default all)")
    parser.add_argument("--per-block", action="store_true", help="list every block's parameters "
                        "(default: block 0 only, the others are identical)")


def run(args: argparse.Namespace) -> int:
    config = described_model(args, default="gpt2").config
    if args.lora_rank is not None and args.lora_rank < 1:
        raise ValueError(f"--lora-rank must be a positive integer, got {args.lora_rank}")
    lora = None if args.lora_rank is None else (args.lora_rank, args.lora_targets)
    print(params_table(config, args.per_block, lora))
    return 0

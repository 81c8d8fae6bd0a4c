"""Print the parameter table (per layer, per kind, total) of a preset or config, without allocating.

Examples:
  pedestrian params --preset gpt2
  pedestrian params --preset gpt2 --lora-rank 16 --lora-targets logits
  pedestrian params --vocab-size 65 --context-length 64 --d-model 128 --n-heads 4 --n-blocks 4
  pedestrian params --preset gpt2 --d-mlp 3000 --no-qkv-bias
  pedestrian params --preset gpt2 --position-encoding rope     # no position table: 786,432 fewer
"""

from __future__ import annotations

import argparse

from ..model.layout import LORA_LAYER_KINDS
from ..paper.explain import params_table
from ..training.settings import add_model_flags, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser, "qkv_bias")
    parser.add_argument("--lora-rank", type=int, help="also count LoRA adapters of this rank")
    parser.add_argument("--lora-targets", nargs="+", default=["all"],
                        help=f"LoRA layer kinds: {' '.join(LORA_LAYER_KINDS)} or all (default all)")
    parser.add_argument("--per-block", action="store_true", help="list every block's parameters "
                        "(default: block 0 only, the others are identical)")


def run(args: argparse.Namespace) -> int:
    if args.preset is None and args.vocab_size is None:
        args.preset = "gpt2"
    config = config_from_args(args)
    if args.lora_rank is not None and args.lora_rank < 1:
        raise ValueError(f"--lora-rank must be a positive integer, got {args.lora_rank}")
    lora = None if args.lora_rank is None else (args.lora_rank, args.lora_targets)
    print(params_table(config, args.per_block, lora))
    return 0

"""Print the paper's table for a model: every activation a_i and error signal Δ_i of one training
step, with its shape, formula, the parameters it touches, forward and backward FLOPs and the
memory the forward keeps for it; totals at the bottom, beside the 6·N·tokens rule.

The model: a checkpoint (--checkpoint: its config, dtype, batch and context), a `pedestrian
train` settings file (--config FILE.toml), a Hugging Face model folder (--hf-dir DIR: its
config.json), a preset (--preset, with the field flags of `pedestrian params`), or else the
default model of `pedestrian train` on the bundled plays (84 characters). --batch-size and
--seq-len set B and T (default: the run's batch size, or 1, and the context length; a
`pedestrian finetune` run's micro-batch and training window, with a line on its LoRA adapters).
Nothing is allocated (pedestrian.training.describe). How FLOPs and memory are counted: the
notes under the table and pedestrian.paper.explain.

Examples:
  pedestrian explain
  pedestrian explain --preset gpt2 --batch-size 8 --seq-len 1024
  pedestrian explain --preset char-small --position-encoding rope
  pedestrian explain --checkpoint runs/shakespeare_char/best
  pedestrian explain --config configs/shakespeare_char.toml
  pedestrian explain --preset smollm2-135m --seq-len 2048 --unfused-head
  pedestrian explain --hf-dir Qwen3-30B-A3B --seq-len 512
"""

from __future__ import annotations

import argparse

from ..training.describe import described_model
from ..paper.explain import explain_table, lora_run_note
from ..training.settings import add_model_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("which model (at most one of these)")
    src.add_argument("--checkpoint", metavar="CKPT", help="a checkpoint folder or run folder")
    src.add_argument("--config", metavar="FILE.toml", help="a `pedestrian train` settings file")
    src.add_argument("--hf-dir", metavar="DIR", help="a Hugging Face model folder (its config.json; no weights read)")
    add_model_flags(parser)                       # --preset and the field flags
    parser.add_argument("--batch-size", type=int, metavar="B", help="sequences per step")
    parser.add_argument("--seq-len", type=int, metavar="T", help="tokens per sequence (default: context length)")
    parser.add_argument("--dtype", choices=["float32", "float64"], help="for the memory column (default float32, "
                        "or the checkpoint's)")
    parser.add_argument("--unfused-head", action="store_true", help="count the step as model.fused_head = False "
                        "runs it: the logits and their softmax kept whole (default: model.loss's fused head)")


def run(args: argparse.Namespace) -> int:
    from ..training.finetune import training_window

    d = described_model(args)
    config, dtype, finetune = d.config, d.dtype, d.finetune
    B = args.batch_size if args.batch_size is not None else (d.batch_size or 1)
    window = training_window(finetune.get("context_length"), config.context_length) if finetune else None
    T = args.seq_len if args.seq_len is not None else (window or config.context_length)
    print(explain_table(config, B, T, dtype, d.layers, fused_head=not args.unfused_head))
    if finetune:
        print("\n" + lora_run_note(config, finetune["lora_rank"], finetune["lora_targets"]))
    return 0

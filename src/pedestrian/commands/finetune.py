"""LoRA fine-tuning of a Hugging Face GPT-2 directory on a text file: the base weights stay
frozen (their gradients are never computed) and only small adapters are trained.

Writes, under --out: adapter/ (an adapter-only checkpoint, a small file), peft/ (the same
adapters as a PEFT directory for transformers + peft), log.jsonl and loss_curve.png.

Examples:
  pedestrian finetune --hf-dir gpt2 --data my_notes.txt --lora-rank 8
  pedestrian finetune --hf-dir gpt2 --data corpus/ --lora-rank 16 --lora-alpha 2 \\
      --lora-targets q k v attn_proj mlp_expand mlp_contract --max-steps 500 --out runs/ft
  pedestrian export-hf --adapter runs/ft --out gpt2-ft     # merge into a new GPT-2 directory
  pedestrian sample --hf-dir gpt2-ft --prompt "Dear diary,"
"""

from __future__ import annotations

import argparse

from ..config import LORA_LAYER_KINDS

_FIELDS = ("hf_dir", "data", "lora_rank", "lora_alpha", "lora_targets", "context_length", "batch_size",
           "grad_accum", "max_steps", "lr", "min_lr", "warmup_steps", "weight_decay", "beta1", "beta2",
           "grad_clip", "val_fraction", "eval_interval", "eval_batches", "seed", "dtype", "backend", "out",
           "overwrite", "progress", "plot", "lora_dropout")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf-dir", required=True, metavar="DIR",
                        help="the base: a Hugging Face GPT-2 directory with its tokenizer")
    parser.add_argument("--data", required=True, metavar="PATH",
                        help="UTF-8 text file (or folder of *.txt), tokenized with the base's tokenizer")
    g = parser.add_argument_group("LoRA")
    g.add_argument("--lora-rank", type=int, required=True, metavar="R", help="adapter rank r")
    g.add_argument("--lora-alpha", type=float, default=1.0, metavar="ALPHA",
                   help="the paper's scalar alpha: the adapter adds alpha * x D U "
                        "(PEFT's lora_alpha / r; default 1)")
    g.add_argument("--lora-targets", nargs="+", default=["q", "v"], metavar="KIND",
                   help=f"layers that get adapters: {' '.join(LORA_LAYER_KINDS)}, all, or full names "
                        "like blocks.0.attn.q (default: q v)")
    g.add_argument("--lora-dropout", type=float, default=0.0, metavar="P",
                   help="dropout on the adapters' input while training (PEFT's lora_dropout; default 0)")
    o = parser.add_argument_group("optimisation")
    o.add_argument("--context-length", type=int, metavar="T",
                   help="training window (default: min(256, the model's context))")
    o.add_argument("--batch-size", type=int, default=8, metavar="B")
    o.add_argument("--grad-accum", type=int, default=1, metavar="K")
    o.add_argument("--max-steps", type=int, default=200, metavar="N")
    o.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    o.add_argument("--min-lr", type=float, default=1e-4, help="end of the cosine decay (default 1e-4)")
    o.add_argument("--warmup-steps", type=int, default=10, metavar="N")
    o.add_argument("--weight-decay", type=float, default=0.0, help="on the adapters (default 0)")
    o.add_argument("--beta1", type=float, default=0.9)
    o.add_argument("--beta2", type=float, default=0.999)
    o.add_argument("--grad-clip", type=float, default=1.0, metavar="NORM", help="0 = off")
    t = parser.add_argument_group("loop")
    t.add_argument("--val-fraction", type=float, default=0.1, metavar="F")
    t.add_argument("--eval-interval", type=int, default=50, metavar="N")
    t.add_argument("--eval-batches", type=int, default=10, metavar="N")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    t.add_argument("--backend", choices=["numpy", "torch"], default="numpy")
    t.add_argument("--out", default="runs/finetune", metavar="DIR", help="run folder (default runs/finetune)")
    t.add_argument("--overwrite", action="store_true", help="replace an existing run in --out")
    t.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    t.add_argument("--no-plot", dest="plot", action="store_false", help="no loss_curve.png")


def run(args: argparse.Namespace) -> int:
    from ..finetune import FinetuneSettings, finetune

    settings = FinetuneSettings(**{name: getattr(args, name) for name in _FIELDS})
    result = finetune(settings)
    print(f"validation loss {result.initial_val_loss:.4f} -> {result.val_loss:.4f} nats/token after "
          f"{result.step} steps ({result.trainable_params:,} trainable parameters); "
          f"adapters in {result.out / 'adapter'} and {result.out / 'peft'}")
    return 0

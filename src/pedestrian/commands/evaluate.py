"""Validation loss of a checkpoint over a whole split of its corpus, every target counted once.

The corpus, tokenizer and split come from the checkpoint (as trained); --data evaluates on
another text with the checkpoint's tokenizer.

Examples:
  pedestrian eval runs/shakespeare_char            # its latest/ checkpoint
  pedestrian eval runs/shakespeare_char/best --split train --max-batches 50
  pedestrian eval runs/shakespeare_char/best --data other_text.txt
"""

from __future__ import annotations

import argparse
import math


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint folder (…/latest, …/best) or run folder")
    parser.add_argument("--data", metavar="PATH", help="corpus to evaluate on (default: the training corpus)")
    parser.add_argument("--split", choices=["val", "train"], default="val",
                        help="which part of the corpus (default val: the held-out last fraction)")
    parser.add_argument("--val-fraction", type=float, metavar="F",
                        help="held-out fraction (default: the one used in training, else 0.1)")
    parser.add_argument("--batch-size", type=int, default=32, metavar="B", help="windows per forward pass")
    parser.add_argument("--max-batches", type=int, metavar="N", help="evaluate only the first N batches")
    parser.add_argument("--backend", choices=["numpy", "torch"], default="numpy")
    parser.add_argument("--dtype", choices=["float32", "float64"], help="default: the checkpoint's")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import load_checkpoint
    from ..train import TrainingError, TrainSettings, evaluate_tokens, prepare_data

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.max_batches is not None and args.max_batches < 1:
        raise ValueError(f"--max-batches must be a positive integer, got {args.max_batches}")
    ckpt = load_checkpoint(args.checkpoint, backend=args.backend, dtype=args.dtype)
    if ckpt.tokenizer is None:
        raise TrainingError(f"checkpoint {ckpt.path} has no tokenizer; it cannot be evaluated on text")
    saved = ckpt.meta.get("settings") or {}
    data = args.data if args.data is not None else saved.get("data")
    if data is None and not saved:
        raise TrainingError(f"checkpoint {ckpt.path} does not record its training corpus; pass --data PATH")
    val_fraction = args.val_fraction if args.val_fraction is not None else saved.get("val_fraction", 0.1)
    settings = TrainSettings(data=data, val_fraction=val_fraction,
                             model={k: v for k, v in ckpt.config.to_dict().items() if k != "vocab_size"})
    settings.validate()
    _, train_tokens, val_tokens = prepare_data(settings, ckpt.tokenizer)
    tokens = val_tokens if args.split == "val" else train_tokens
    loss, n = evaluate_tokens(ckpt.model, tokens, batch_size=args.batch_size, max_batches=args.max_batches,
                              progress=args.progress)
    unit = "character" if ckpt.tokenizer.to_dict().get("kind") == "char" else "token"
    print(f"checkpoint {ckpt.path} (step {ckpt.step}): {args.split} loss {loss:.4f} nats per {unit} "
          f"({loss / math.log(2):.4f} bits, perplexity {math.exp(loss):.2f}) over {n:,} targets")
    return 0

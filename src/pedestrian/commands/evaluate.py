"""Validation loss of a checkpoint over a whole split of its corpus, every target counted once.

The corpus, tokenizer and split come from the checkpoint (as trained); --data evaluates on
another text with the checkpoint's tokenizer (--split all: the whole of it). A `pedestrian
finetune` run folder (or its adapter/ checkpoint) is evaluated on its base model plus the
adapters: the base recorded in it, or --hf-dir BASE_DIR. --hf-dir alone evaluates a Hugging Face
model folder (with its tokenizer) on --data. A conversations file (*.jsonl: a chat fine-tune's
data, or --data) is rendered with the folder's chat template and the loss counted on the
assistant's tokens, as `pedestrian finetune` measures it (pedestrian.training.conversations).

Examples:
  pedestrian eval runs/shakespeare_char            # its latest/ checkpoint
  pedestrian eval runs/shakespeare_char/best --split train --max-batches 50
  pedestrian eval runs/shakespeare_char/best --data other_text.txt --split all
  pedestrian eval runs/finetune                    # LoRA fine-tune: base + adapters
  pedestrian eval --hf-dir SmolLM2-135M --data my_notes.txt --split all
  pedestrian eval --hf-dir SmolLM2-135M-Instruct --data chat.jsonl --split all
"""

from __future__ import annotations

import argparse
import math

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", nargs="?", help="checkpoint folder (…/latest, …/best) or run folder")
    parser.add_argument("--data", metavar="PATH", help="corpus to evaluate on (default: the training corpus)")
    parser.add_argument("--split", choices=["val", "train", "all"], default="val",
                        help="which part of the corpus (default val: the held-out last fraction; "
                             "all: the whole text)")
    parser.add_argument("--hf-dir", metavar="DIR",
                        help="base model of a fine-tune run (default: the one recorded in it); alone: the model")
    parser.add_argument("--val-fraction", type=float, metavar="F",
                        help="held-out fraction (default: the one used in training, else 0.1)")
    parser.add_argument("--batch-size", type=int, default=32, metavar="B", help="windows per forward pass")
    parser.add_argument("--max-batches", type=int, metavar="N", help="evaluate only the first N batches")
    parser.add_argument("--backend", choices=["numpy", "torch"], default="numpy")
    parser.add_argument("--dtype", choices=["float32", "float64"], help="default: the checkpoint's")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from ..training import TrainingError
    from ..load import load_model

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.max_batches is not None and args.max_batches < 1:
        raise ValueError(f"--max-batches must be a positive integer, got {args.max_batches}")
    if args.val_fraction is not None and not 0.0 < args.val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    loaded = load_model(args.checkpoint, args.hf_dir, dtype=args.dtype, backend=args.backend)
    model, tokenizer, path, step, saved = loaded.model, loaded.tokenizer, loaded.path, loaded.step, loaded.settings
    what = f"checkpoint {path} (step {step})" if path else f"the model in {loaded.base}"
    if tokenizer is None:
        raise TrainingError(f"{what} has no tokenizer; it cannot be evaluated on text")
    data = args.data if args.data is not None else saved.get("data")
    if data is None and not saved:
        raise TrainingError(f"{what} does not record a training corpus; pass --data PATH")
    if data is None and saved.get("dpo"):
        raise TrainingError(f"{what} was fine-tuned on preference pairs (--dpo {saved['dpo']}), not on a text; "
                            "pass --data PATH to evaluate it on one")
    val_fraction = args.val_fraction if args.val_fraction is not None else saved.get("val_fraction", 0.1)
    from ..training.conversations import evaluate_loaded

    with np.errstate(over="ignore", invalid="ignore"):   # an overflow is reported below, in one line
        loss, n, unit = evaluate_loaded(loaded, data, split=args.split, val_fraction=val_fraction,
                                        batch_size=args.batch_size, max_batches=args.max_batches,
                                        progress=args.progress)
    if not math.isfinite(loss):
        # finite weights (checkpoints refuse others) whose forward overflows: never print "nan"
        raise TrainingError(
            f"the {args.split} loss of {what} is {loss}: its forward pass "
            f"overflows in {model.dtype_name} (weights too large, a diverged run); try --dtype float64, "
            "or evaluate an earlier checkpoint")
    # e^loss overflows a float above 709.8 nats: a perplexity of inf, not an OverflowError
    perplexity = math.exp(loss) if loss < math.log(np.finfo(np.float64).max) else math.inf
    shown = f"{perplexity:.2f}" if perplexity < 1e6 else f"{perplexity:.3g}"
    print(f"{what}: {args.split} loss {loss:.4f} nats per {unit} "
          f"({loss / math.log(2):.4f} bits, perplexity {shown}) over {n:,} targets")
    return 0

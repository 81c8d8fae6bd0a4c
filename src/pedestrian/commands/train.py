"""Train a GPT on a text corpus with the hand-derived backward and a hand-written AdamW.

With no arguments: the bundled Shakespeare plays, a character tokenizer and a default model
that reaches a validation loss <= 1.75 nats per character within 10 minutes on two CPU cores.
Checkpoints, log.jsonl, loss_curve.png and gradients.png (the norms of every block's Δ2 … Δ10
and gradients) go to runs/<corpus>_<tokenizer> or --out (docs/guide.md: What pedestrian train writes).

Settings come from, in increasing priority: the defaults, a TOML file (--config), the flags.
TOML keys are the flag names with underscores (tables [data] [model] [optim] [train]), with the
flag's type (bias = false, not "no").

At the end: two samples of the best checkpoint (temperature 0.8, top-k 40; --no-sample to skip)
and where the files are. Ctrl-C (or SIGTERM) finishes the step, saves a checkpoint and says how
to resume (--resume continues exactly); a second Ctrl-C stops at once. A step whose loss or
gradient is not finite is skipped with a warning; --max-skipped-steps in a row stop the run.
--nproc N starts N ranks here (rank 0 writes the files); torchrun starts them on one or several
machines (docs/guide.md: Several processes).

Examples:
  pedestrian train
  pedestrian train --resume                                # continue runs/shakespeare_char
  pedestrian train --nproc 2                               # 2 ranks (needs pip install -e ".[torch]")
  torchrun --nproc-per-node 2 -m pedestrian train          # the same, started by torchrun
  pedestrian train --config configs/shakespeare_char.toml
  pedestrian train --data my_texts/ --tokenizer bpe --bpe-vocab-size 2048 --out runs/mine
  pedestrian train --preset char-small --max-steps 500 --lr 1e-3 --max-minutes 0
"""

from __future__ import annotations

import argparse
import sys

from ..training.specs import add_flags
from ..training import TrainSettings
from ..training.settings import add_model_flags, settings_from_args

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.toml", help="settings file (TOML; flags override it)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its latest checkpoint, exactly")
    parser.add_argument("--overwrite", action="store_true",
                        help="start a new run even if --out already holds a checkpoint")
    data = parser.add_argument_group("data")
    model = add_model_flags(parser, "dropout")
    groups = add_flags(parser, TrainSettings, groups={"data": data, "model": model})
    groups["loop"].add_argument("--no-sample", dest="sample", action="store_false", default=True,
                                help="do not print samples of the trained model at the end")


def run(args: argparse.Namespace) -> int:
    from ..training import train
    from ..training.distributed import LaunchFailure, reports_to_launcher
    from ..training.run import final_samples, launch_ranks

    settings, explicit = settings_from_args(args)
    no_sample = "" if args.sample else " --no-sample"         # a printed resume command repeats it
    try:
        if launch_ranks(settings, args.argv, no_sample):
            return 0
    except LaunchFailure as exc:                # the ranks stopped on Ctrl-C / SIGTERM and saved
        print(f"interrupted: {exc}", file=sys.stderr)
        return 130
    result = train(settings, resume=args.resume, explicit=explicit, overwrite=args.overwrite)
    out = result.out
    resume_command = result.resume_command + no_sample
    if result.stop_reason == "interrupted":
        if result.is_writer and not reports_to_launcher():      # else the launcher says it, once
            print(f"interrupted: a checkpoint of step {result.step} is saved in {out / 'latest'}; continue "
                  f"with: {resume_command}", file=sys.stderr)
        return 130
    if not result.is_writer:
        return 0
    print(f"final validation loss {result.val_loss:.4f} nats per token at step {result.step} "
          f"(on the {result.eval_batches} fixed validation batches; `pedestrian eval` takes the whole "
          f"split) ({result.seconds / 60:.1f} min); latest checkpoint {out / 'latest'}", file=sys.stdout)
    if args.sample:
        folder, texts = final_samples(out)
        print(f"samples from {folder} (temperature 0.8, top-k 40; --no-sample to skip):")
        for i, text in enumerate(texts):
            print(f"--- sample {i + 1} ---\n{text}")
    files = [f"checkpoints {out / 'latest'} and {out / 'best'}", f"log {out / 'log.jsonl'}"]
    if (out / "loss_curve.png").is_file() and settings.plot:
        files.append(f"loss curve {out / 'loss_curve.png'}")
    if (out / "gradients.png").is_file() and settings.plot:
        files.append(f"error signals and gradients {out / 'gradients.png'}")
    print("files: " + ", ".join(files))
    print(f"sample: pedestrian sample --checkpoint {out / 'best'} --prompt \"...\" --temperature 0.8 --top-k 40")
    if result.stop_reason == "max_steps":
        print(f"train on: {resume_command} --max-steps {2 * result.step}")
    else:
        print(f"resume: {resume_command}")
    return 0

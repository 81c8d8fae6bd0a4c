"""The paper's open question, run: does a causal GPT need explicit position encodings?

The seed paper (section 3, "permutation equivariance") notes that the causal mask already injects
positional information and asks "whether explicit positional encodings remain necessary in
architectures employing causal masking". This script trains the default character model of
``pedestrian train`` on the bundled Shakespeare plays three times -- learned positions (GPT-2),
RoPE, and none -- causal, with the same seed, data order, batch, schedule and number of steps
(nothing tuned per variant; models that differ only in their position encoding even start from
the same weights, the learned table aside), then evaluates each final checkpoint on the whole
held-out split. ``--seeds`` repeats the three runs with other seeds, to see the spread.

It runs the command line, so each run is exactly what a user gets from::

    pedestrian train --position-encoding ENC --max-steps N --max-minutes 0 --seed S \\
        --out OUT/seedS/ENC --no-sample --no-progress --overwrite
    pedestrian eval OUT/seedS/ENC/latest --no-progress

and writes ``docs/position_experiment.png`` (the three loss curves), ``docs/position_experiment.json``
(every number but the per-step training losses, which stay in the runs' ``log.jsonl``) and the results table inside ``docs/position_experiment.md`` (between its
``<!-- results:start -->`` / ``<!-- results:end -->`` markers; the discussion around them is
written by hand).

Usage::

    python3 benchmarks/position_experiment.py                      # the default budget, 3,000 steps each
    python3 benchmarks/position_experiment.py --max-steps 1500 --seeds 1337 1338   # what docs/ shows
    python3 benchmarks/position_experiment.py --max-steps 1500 --seeds 1337 1338 --plot-only   # redraw

``--max-minutes 0`` matters: with the default wall-clock guard a slower run (on a busy machine)
would stop after fewer steps than the others, and the budgets would no longer be equal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from experiments import (commands, curves, evaluate, pedestrian, plot, read_log, seeds_of,  # noqa: E402
                         write_results)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ENCODINGS = ("learned", "rope", "none")
COLORS = {"learned": "tab:blue", "rope": "tab:orange", "none": "tab:green"}


def run_one(encoding: str, seed: int, out: Path, args) -> dict:
    folder = out / f"seed{seed}" / encoding
    cmd = ["train", "--position-encoding", encoding, "--max-steps", str(args.max_steps), "--max-minutes", "0",
           "--seed", str(seed), "--out", str(folder), "--no-sample", "--no-progress", "--overwrite"]
    if not args.plot_only:
        pedestrian(*cmd)
    evaluated = evaluate(folder)
    log = read_log(folder / "log.jsonl")
    order = order_use(str(folder))
    params = re.search(r"total\s+([0-9,]+)", pedestrian("params", "--preset", "char-small", "--vocab-size",
                                                        str(args.vocab_size), "--position-encoding", encoding)[0])
    return {"encoding": encoding, "seed": seed, "folder": str(folder), "command": "pedestrian " + " ".join(cmd),
            **evaluated, **curves(log), "params": params.group(1) if params else None, "order": order}


def order_use(folder: str, n_windows: int = 2048, seed: int = 0) -> dict:
    """How much a trained model uses the order of its context: the loss of the last character of
    ``n_windows`` random validation windows of 64, with the window in order and with its first 63
    characters shuffled (the last input character, hence the bigram, kept). A model that ignored
    the order of earlier tokens would lose nothing by the shuffle."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "src"))
    from pedestrian.checkpoint import load_checkpoint
    from pedestrian.text.data import load_corpus
    from pedestrian.training import split_tokens

    ckpt = load_checkpoint(Path(folder) / "latest", dtype="float64")
    model, C = ckpt.model, ckpt.config.context_length
    model.training = False
    _, val = split_tokens(np.asarray(ckpt.tokenizer.encode(load_corpus(None)), dtype=np.int64), 0.1)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, val.shape[0] - C - 1, size=n_windows)
    x, y = val[starts[:, None] + np.arange(C)], val[starts + C]
    shuffled = x.copy()
    for row in shuffled:
        row[:C - 1] = rng.permutation(row[:C - 1])

    def last_loss(inputs) -> float:
        total = 0.0
        for lo in range(0, n_windows, 256):
            z = np.asarray(model.forward(inputs[lo:lo + 256]))[:, -1, :]
            z = z - z.max(axis=-1, keepdims=True)
            logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
            total -= float(logp[np.arange(z.shape[0]), y[lo:lo + 256]].sum())
        return total / n_windows

    return {"in_order": last_loss(x), "shuffled": last_loss(shuffled), "windows": n_windows}


def table(results: list[dict], max_steps: int, date: str) -> str:
    seeds = seeds_of(results)
    by = {(r["encoding"], r["seed"]): r for r in results}
    mean = {e: sum(by[e, s]["val_loss_full_split"] for s in seeds) / len(seeds) for e in ENCODINGS}
    lines = [f"Measured {date}: {max_steps:,} steps per run of 16 × 64 characters (batch × context), "
             "lr 2e-3 → 2e-4 (100 warm-up steps, cosine), float32, the bundled plays (char tokenizer, "
             "84 ids); every setting the same for the three, only `--position-encoding` and the seed change. "
             "Loss: `pedestrian eval` of the final checkpoint on the whole held-out split "
             f"({results[0]['val_targets']:,} characters, each predicted once, windows of 64), nats per character.",
             "",
             "| position encoding | parameters | " + " | ".join(f"seed {s}" for s in seeds)
             + " | mean | mean − learned | last char, in order | last char, 63 shuffled | cost of the shuffle "
             "| minutes per run |",
             "|---|---|" + "---|" * len(seeds) + "---|---|---|---|---|---|"]
    for e in ENCODINGS:
        runs = [by[e, s] for s in seeds]
        minutes = [r["minutes"] for r in runs]
        ordered = sum(r["order"]["in_order"] for r in runs) / len(runs)
        shuffled = sum(r["order"]["shuffled"] for r in runs) / len(runs)
        lines.append(f"| {e} | {runs[0]['params']} | " + " | ".join(f"{r['val_loss_full_split']:.4f}" for r in runs)
                     + f" | **{mean[e]:.4f}** | {mean[e] - mean['learned']:+.4f} | {ordered:.3f} | {shuffled:.3f} "
                     f"| {shuffled - ordered:+.3f} | "
                     + f"{sum(minutes) / len(minutes):.1f} |")
    windows = results[0]["order"]["windows"]
    lines += ["", f"Last char: the loss of the 65th character of {windows:,} random held-out windows (same windows "
              "for every model; mean over the seeds), predicted from its 64 predecessors in order, and with the "
              "first 63 of them shuffled (the last one, and so the bigram, kept): what the model gains from "
              "the order of its context. Minutes: wall clock on the shared 2-core machine (other jobs ran "
              "beside; not a speed comparison). Commands (each run, then its evaluation):", ""]
    lines += commands(results, "position_experiment.png")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=3000, help="optimizer steps per run (default 3000, "
                   "the default `pedestrian train` budget)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1337], help="one run per encoding and seed "
                   "(default 1337, the default of `pedestrian train`)")
    p.add_argument("--out", default="runs/position_experiment", help="run folders (default runs/position_experiment)")
    p.add_argument("--plot-only", action="store_true", help="no training: evaluate and plot existing runs")
    p.add_argument("--docs", default=str(DOCS), help="where the plot, JSON and table go (default docs/)")
    args = p.parse_args()
    args.vocab_size = 84                      # the bundled plays' characters (the default model's V)
    docs = Path(args.docs)
    out = Path(args.out)
    results = []
    for seed in args.seeds:
        for encoding in ENCODINGS:
            print(f"{encoding}, seed {seed}: {args.max_steps} steps ...", flush=True)
            results.append(run_one(encoding, seed, out, args))
            print(f"  val loss {results[-1]['val_loss_full_split']:.4f} (whole split)", flush=True)
    date = datetime.date.today().isoformat()
    plot(results, docs / "position_experiment.png", args.max_steps, "encoding", COLORS,
         lambda r, mean, seeds: f"{r['encoding']}: whole-split val {mean:.3f} (mean of {len(seeds)} seeds)",
         f"Default char model on the Shakespeare plays, causal, {args.max_steps:,} steps per run: "
         "learned positions / RoPE / no position encoding")
    kept = [{k: v for k, v in r.items() if k != "train_curve"} for r in results]   # per-step losses: the logs
    (docs / "position_experiment.json").write_text(json.dumps(
        {"date": date, "max_steps": args.max_steps, "seeds": args.seeds, "results": kept}, indent=1) + "\n")
    doc = docs / "position_experiment.md"
    write_results(doc, "Position encodings", table(results, args.max_steps, date))
    print(f"wrote {doc}, {docs / 'position_experiment.png'}, {docs / 'position_experiment.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The paper's open question, run: does a causal GPT need explicit position encodings?

The seed paper (section 3, "permutation equivariance") notes that the causal mask already injects
positional information and asks "whether explicit positional encodings remain necessary in
architectures employing causal masking". This script trains the default character model of
``pedestrian train`` on the bundled Shakespeare plays three times -- learned positions (GPT-2),
RoPE, and none -- causal, with the same seed, data order, batch, schedule and number of steps
(nothing tuned per variant), then evaluates each final checkpoint on the whole held-out split.

It runs the command line, so each run is exactly what a user gets from::

    pedestrian train --position-encoding ENC --max-steps N --max-minutes 0 --out OUT/ENC \\
        --no-sample --no-progress --overwrite
    pedestrian eval OUT/ENC/latest --no-progress

and writes ``docs/position_experiment.png`` (the three loss curves), ``docs/position_experiment.json``
(every number) and the results table inside ``docs/position_experiment.md`` (between its
``<!-- results:start -->`` / ``<!-- results:end -->`` markers; the discussion around them is
written by hand).

Usage::

    python3 benchmarks/position_experiment.py                      # the default budget, 3,000 steps each
    python3 benchmarks/position_experiment.py --max-steps 1500     # a reduced, equal budget
    python3 benchmarks/position_experiment.py --plot-only          # redraw from the runs' logs

``--max-minutes 0`` matters: with the default wall-clock guard a slower run (on a busy machine)
would stop after fewer steps than the others, and the budgets would no longer be equal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ENCODINGS = ("learned", "rope", "none")
COLORS = {"learned": "tab:blue", "rope": "tab:orange", "none": "tab:green"}
START, END = "<!-- results:start -->", "<!-- results:end -->"


def pedestrian(*args: str) -> str:
    """Run ``python -m pedestrian ARGS`` with this checkout's code; return its stdout."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "pedestrian", *args], env=env, text=True,
                          capture_output=True)
    if done.returncode != 0:
        raise SystemExit(f"pedestrian {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def run_one(encoding: str, out: Path, args) -> dict:
    folder = out / encoding
    cmd = ["train", "--position-encoding", encoding, "--max-steps", str(args.max_steps), "--max-minutes", "0",
           "--seed", str(args.seed), "--out", str(folder), "--no-sample", "--no-progress", "--overwrite"]
    if not args.plot_only:
        t0 = time.perf_counter()
        pedestrian(*cmd)
        minutes = (time.perf_counter() - t0) / 60
    else:
        minutes = None
    text = pedestrian("eval", str(folder / "latest"), "--no-progress")
    m = re.search(r"step (\d+)\): val loss ([0-9.]+) nats per character .* over ([0-9,]+) targets", text)
    if m is None:
        raise SystemExit(f"cannot read the eval output: {text!r}")
    log = read_log(folder / "log.jsonl")
    val = [(r["step"], r["val_loss"]) for r in log if "val_loss" in r]
    params = re.search(r"total\s+([0-9,]+)", pedestrian("params", "--preset", "char-small", "--vocab-size",
                                                        str(args.vocab_size), "--position-encoding", encoding))
    return {"encoding": encoding, "command": "pedestrian " + " ".join(cmd), "step": int(m.group(1)),
            "val_loss_full_split": float(m.group(2)), "val_targets": int(m.group(3).replace(",", "")),
            "val_curve": val, "train_curve": [(r["step"], r["loss"]) for r in log if "loss" in r],
            "minutes": minutes, "params_note": params.group(1) if params else None}


def plot(results: list[dict], path: Path, max_steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(11, 4.4), dpi=130, gridspec_kw={"width_ratios": [3, 2]})
    for r in results:
        color = COLORS[r["encoding"]]
        s, loss = np.array(r["train_curve"]).T
        w = max(1, min(50, len(loss) // 5))
        smooth = np.convolve(loss, np.ones(w) / w, mode="valid")
        for a in (ax, zoom):
            a.plot(s[w - 1:], smooth, color=color, lw=0.9, alpha=0.45)
            vs, vl = np.array(r["val_curve"]).T
            a.plot(vs, vl, "o-", color=color, ms=3.5, lw=1.6,
                   label=f"{r['encoding']}: val {r['val_loss_full_split']:.3f} (whole split)")
    for a in (ax, zoom):
        a.set_xlabel("optimizer step")
        a.set_ylabel("loss (nats per character)")
        a.grid(alpha=0.3)
    ax.set_title("validation (dots) and training (moving mean, faint)", fontsize=10)
    ax.legend(fontsize=9)
    zoom.set_xlim(max_steps * 0.5, max_steps * 1.02)
    tail = [v for r in results for st, v in r["val_curve"] if st >= max_steps * 0.5]
    zoom.set_ylim(min(tail) - 0.03, max(tail) + 0.05)
    zoom.set_title("second half, zoomed", fontsize=10)
    fig.suptitle(f"Default char model on Shakespeare, causal, seed 1337, {max_steps:,} steps each: "
                 "position encoding learned / RoPE / none", fontsize=10.5)
    fig.tight_layout()
    tmp = path.with_name(".tmp-" + path.name)
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)


def table(results: list[dict], max_steps: int, date: str) -> str:
    learned = next(r for r in results if r["encoding"] == "learned")["val_loss_full_split"]
    lines = [f"Measured {date}: {max_steps:,} steps each of 16 × 64 characters (batch, context), lr 2e-3 → 2e-4 "
             "(100 warm-up steps, cosine), seed 1337, float32, the bundled plays (char tokenizer, 84 ids).",
             "",
             "| position encoding | parameters | val loss, whole held-out split | vs learned | "
             "val loss, 20 fixed batches (last eval) | wall minutes |",
             "|---|---|---|---|---|---|"]
    for r in results:
        v = r["val_loss_full_split"]
        last = r["val_curve"][-1][1]
        minutes = "-" if r["minutes"] is None else f"{r['minutes']:.1f}"
        lines.append(f"| {r['encoding']} | {r['params_note']} | **{v:.4f}** | {v - learned:+.4f} | "
                     f"{last:.4f} | {minutes} |")
    lines += ["", f"Held-out split: {results[0]['val_targets']:,} characters (every one predicted once, "
              "windows of 64). Commands:", "", "```bash"]
    lines += [r["command"] + f"\npedestrian eval {r['command'].split('--out ')[1].split()[0]}/latest" for r in results]
    lines += ["```", "", "![loss curves](position_experiment.png)"]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=3000, help="optimizer steps per run (default 3000, "
                   "the default `pedestrian train` budget)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--out", default="runs/position_experiment", help="run folders (default runs/position_experiment)")
    p.add_argument("--plot-only", action="store_true", help="no training: evaluate and plot existing runs")
    p.add_argument("--docs", default=str(DOCS), help="where the plot, JSON and table go (default docs/)")
    args = p.parse_args()
    args.vocab_size = 84                      # the bundled plays' characters (the default model's V)
    docs = Path(args.docs)
    out = Path(args.out)
    results = []
    for encoding in ENCODINGS:
        print(f"{encoding}: training {args.max_steps} steps ...", flush=True)
        results.append(run_one(encoding, out, args))
        print(f"  val loss {results[-1]['val_loss_full_split']:.4f} (whole split)", flush=True)
    date = datetime.date.today().isoformat()
    plot(results, docs / "position_experiment.png", args.max_steps)
    (docs / "position_experiment.json").write_text(json.dumps(
        {"date": date, "max_steps": args.max_steps, "seed": args.seed, "results": results}, indent=1) + "\n")
    doc = docs / "position_experiment.md"
    text = doc.read_text(encoding="utf-8") if doc.exists() else f"# Position encodings\n\n{START}\n{END}\n"
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(head + START + "\n" + table(results, args.max_steps, date) + "\n" + END + tail, encoding="utf-8")
    print(f"wrote {doc}, {docs / 'position_experiment.png'}, {docs / 'position_experiment.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

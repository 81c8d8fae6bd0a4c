"""GPT-2 style against Llama style at the same parameter count and the same compute.

Trains the default character model of ``pedestrian train`` (GPT-2 style: layer norm, GELU MLP,
learned positions, biases, multi-head attention) and a Llama-style model of the same widths
(``--arch llama``: RMS norm, SwiGLU MLP, RoPE, no biases, grouped-query attention with 2 key/value
heads for 4 query heads) on the bundled Shakespeare plays, with the same seed, data order, batch,
schedule and number of steps. The Llama model's SwiGLU width ``--d-mlp`` is chosen so that its
parameter count is the closest to the GPT-2 model's (:func:`matched_d_mlp`; 393 for the bundled
plays' 84 characters: 812,160 against 812,288). Each final checkpoint is evaluated on the whole
held-out split.

The same number of optimizer steps of the same batch is the same compute here (both models do
about the same multiply-adds per token, see docs/arch_experiment.md); the machine this ran on is
shared, so a wall-clock budget would not be equal. Each run's wall-clock tokens/s (median over its
steps, from its ``log.jsonl``) and the CPU seconds of its process are reported beside the loss.

It runs the command line, so each run is exactly what a user gets from::

    pedestrian train --arch ARCH [--d-mlp M] --max-steps N --eval-interval E --max-minutes 0 --seed S \\
        --out OUT/seedS/ARCH --no-sample --no-progress --overwrite
    pedestrian eval OUT/seedS/ARCH/latest --no-progress

and writes ``docs/arch_experiment.png`` (the loss curves), ``docs/arch_experiment.json`` (every
number but the per-step training losses, which stay in the runs' ``log.jsonl``) and the results
table inside ``docs/arch_experiment.md`` (between its ``<!-- results:start -->`` /
``<!-- results:end -->`` markers; the discussion around them is written by hand). A finished run
(its ``result.json``, written after its evaluation) is not trained again, so more seeds can be
added by a later call; ``--fresh`` retrains all.

Usage::

    python3 benchmarks/arch_experiment.py                                     # 1,500 steps, seed 1337
    python3 benchmarks/arch_experiment.py --max-steps 600 --seeds 1337 1338   # what docs/ shows
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
ARCHS = ("gpt2", "llama")
COLORS = {"gpt2": "tab:blue", "llama": "tab:red"}
LABELS = {"gpt2": "GPT-2 style", "llama": "Llama style"}
VOCAB_SIZE = 84                              # the bundled plays' characters (the default model's V)


def matched_d_mlp(vocab_size: int = VOCAB_SIZE) -> tuple[int, int, int]:
    """``(d_mlp, llama_params, gpt2_params)``: the SwiGLU width whose ``--arch llama`` model (the
    default model's widths) has the parameter count closest to the default GPT-2-style model's
    (the smaller width on a tie)."""
    sys.path.insert(0, str(ROOT / "src"))
    from pedestrian.config import GPTConfig, with_arch
    from pedestrian.model.layout import count_params
    from pedestrian.training.settings import DEFAULT_MODEL

    def params(arch: str, **given) -> int:
        fields = with_arch({**DEFAULT_MODEL, **given}, arch, given)
        return count_params(GPTConfig(vocab_size=vocab_size, **fields))

    target = params("gpt2")
    best = min(range(1, 8 * DEFAULT_MODEL["d_model"]), key=lambda m: (abs(params("llama", d_mlp=m) - target), m))
    return best, params("llama", d_mlp=best), target


def run_one(arch: str, seed: int, out: Path, args) -> dict:
    folder = out / f"seed{seed}" / arch
    done = folder / "result.json"
    if done.is_file() and not args.fresh:
        result = json.loads(done.read_text(encoding="utf-8"))
        if result["max_steps"] == args.max_steps:
            return result
    width = ["--d-mlp", str(args.d_mlp)] if arch == "llama" else []
    cmd = ["train", "--arch", arch, *width, "--max-steps", str(args.max_steps), "--eval-interval",
           str(args.eval_interval), "--max-minutes", "0", "--seed", str(seed), "--out", str(folder),
           "--no-sample", "--no-progress", "--overwrite"]
    _, cpu_s = pedestrian(*cmd)
    evaluated = evaluate(folder)
    log = read_log(folder / "log.jsonl")
    rates = sorted(r["tokens_per_s"] for r in log if "tokens_per_s" in r)
    params, _ = pedestrian("params", "--preset", "char-small", "--vocab-size", str(VOCAB_SIZE), "--arch", arch, *width)
    total = re.search(r"total\s+([0-9,]+)", params)
    result = {"arch": arch, "seed": seed, "max_steps": args.max_steps, "folder": str(folder),
              "command": "pedestrian " + " ".join(cmd), **evaluated, **curves(log),
              "tokens_per_s_median": rates[len(rates) // 2], "cpu_s": cpu_s,
              "params": int(total.group(1).replace(",", "")) if total else None}
    done.write_text(json.dumps(result) + "\n", encoding="utf-8")
    return result


def table(results: list[dict], args, date: str) -> str:
    seeds = seeds_of(results)
    by = {(r["arch"], r["seed"]): r for r in results}
    mean = {a: sum(by[a, s]["val_loss_full_split"] for s in seeds) / len(seeds) for a in ARCHS}
    what = {"gpt2": "layer norm, GELU MLP 512 wide, learned positions, biases, 4 k/v heads",
            "llama": f"RMS norm, SwiGLU {args.d_mlp} wide, RoPE, no biases, 2 k/v heads (GQA)"}
    tokens = args.max_steps * 16 * 64
    lines = [f"Measured {date}: {args.max_steps:,} steps per run of 16 × 64 characters (batch × context; "
             f"{tokens:,} training characters), lr 2e-3 → 2e-4 (100 warm-up steps, cosine), float32, validation "
             f"every {args.eval_interval} steps, the bundled plays (char tokenizer, {VOCAB_SIZE} ids); every setting "
             "the same for the two, only `--arch` (and the Llama model's `--d-mlp`) and the seed change. Loss: "
             "`pedestrian eval` of the final checkpoint on the whole held-out split "
             f"({results[0]['val_targets']:,} characters, each predicted once, windows of 64), nats per character.",
             "",
             "| arch | model | parameters | " + " | ".join(f"seed {s}" for s in seeds)
             + " | mean | mean − GPT-2 | tokens/s (wall, median step) | CPU s per run | training chars per CPU s "
             "| minutes per run |",
             "|---|---|---|" + "---|" * len(seeds) + "---|---|---|---|---|---|"]
    for a in ARCHS:
        runs = [by[a, s] for s in seeds]
        avg = lambda k: sum(r[k] for r in runs) / len(runs)    # noqa: E731
        lines.append(f"| `{a}` | {what[a]} | {runs[0]['params']:,} | "
                     + " | ".join(f"{r['val_loss_full_split']:.4f}" for r in runs)
                     + f" | **{mean[a]:.4f}** | {mean[a] - mean['gpt2']:+.4f} | {avg('tokens_per_s_median'):,.0f} "
                     f"| {avg('cpu_s'):,.0f} | {tokens / avg('cpu_s'):,.0f} | {avg('minutes'):.1f} |")
    lines += ["", "Tokens/s, CPU seconds and minutes: means over the seeds, on a 2-core machine shared with other "
              "jobs (their load changed during the runs), so a rough speed comparison only; the CPU seconds are "
              "those of the `pedestrian train` process (both threads, numba's first compilation and the "
              "validations included). Commands (each run, then its evaluation):", ""]
    lines += commands(results, "arch_experiment.png")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=1500, help="optimizer steps per run (default 1500)")
    p.add_argument("--eval-interval", type=int, default=100, help="steps between validations (default 100)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1337], help="one run per architecture and seed "
                   "(default 1337, the default of `pedestrian train`)")
    p.add_argument("--out", default="runs/arch_experiment", help="run folders (default runs/arch_experiment)")
    p.add_argument("--fresh", action="store_true", help="train again runs that already have a result.json")
    p.add_argument("--docs", default=str(DOCS), help="where the plot, JSON and table go (default docs/)")
    args = p.parse_args()
    args.d_mlp, llama_params, gpt2_params = matched_d_mlp()
    print(f"Llama-style d_mlp {args.d_mlp}: {llama_params:,} parameters against GPT-2 style's {gpt2_params:,}",
          flush=True)
    docs, out = Path(args.docs), Path(args.out)
    results = []
    for seed in args.seeds:
        for arch in ARCHS:
            print(f"{arch}, seed {seed}: {args.max_steps} steps ...", flush=True)
            results.append(run_one(arch, seed, out, args))
            print(f"  val loss {results[-1]['val_loss_full_split']:.4f} (whole split), "
                  f"{results[-1]['minutes']:.1f} min, {results[-1]['cpu_s']:.0f} CPU s", flush=True)
    date = datetime.date.today().isoformat()
    plot(results, docs / "arch_experiment.png", args.max_steps, "arch", COLORS,
         lambda r, mean, seeds: (f"{LABELS[r['arch']]} ({r['params']:,} parameters): whole-split val {mean:.3f} "
                                 f"(mean of {len(seeds)} seed{'s' if len(seeds) > 1 else ''})"),
         f"Default char model size on the Shakespeare plays, {args.max_steps:,} steps per run: "
         "GPT-2 style against Llama style")
    kept = [{k: v for k, v in r.items() if k != "train_curve"} for r in results]   # per-step losses: the logs
    (docs / "arch_experiment.json").write_text(json.dumps(
        {"date": date, "max_steps": args.max_steps, "eval_interval": args.eval_interval, "seeds": args.seeds,
         "d_mlp": args.d_mlp, "results": kept}, indent=1) + "\n")
    doc = docs / "arch_experiment.md"
    write_results(doc, "GPT-2 against Llama", table(results, args, date))
    print(f"wrote {doc}, {docs / 'arch_experiment.png'}, {docs / 'arch_experiment.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

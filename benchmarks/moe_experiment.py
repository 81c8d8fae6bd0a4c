"""A dense Llama-style model against mixtures of experts, at the same steps on the bundled corpus.

Three models of the same widths as ``pedestrian train --arch llama`` (the default character model:
4 blocks, d_model 128, 4 heads, 2 key/value heads, RMS norm, RoPE, no biases), differing only in
the MLP of every block:

- ``dense``: one SwiGLU of width ``m`` (``--d-mlp``, 344 by default: 8/3 · d rounded up to 8);
- ``moe-active``: ``E = 4`` experts, ``k = 2`` per token, each of width ``m / 2``: the same
  parameters *per token* as the dense model (two half-width SwiGLUs), twice its MLP parameters
  in all;
- ``moe-total``: ``E = 4``, ``k = 2``, each of width ``m / 4``: the same parameters *in all*
  as the dense model (four quarter-width SwiGLUs), half its MLP parameters per token.

Both mixtures are trained as transformers trains Mixtral (``--output-router-logits``,
``router_aux_loss_coef`` 0.01: the load-balancing loss is in the training loss); every other
setting, the seed and the data order are the same for the three. Each final checkpoint is evaluated on
the whole held-out split (``pedestrian eval``: the cross-entropy alone, without the aux loss).
Tokens/s is wall clock, the median step: of the runs themselves, or with ``--speed-rounds`` of short
runs of each variant in turn on an idle machine.

It runs the command line, so each run is what a user gets from::

    pedestrian train --arch llama [--n-experts 4 --n-experts-per-token 2 --d-expert W \\
        --output-router-logits --router-aux-loss-coef 0.01] --max-steps N --eval-interval E \\
        --max-minutes 0 --seed S --out OUT/seedS/VARIANT --no-sample --no-progress --overwrite
    pedestrian eval OUT/seedS/VARIANT/latest --no-progress

and writes ``docs/moe_experiment.png``, ``docs/moe_experiment.json`` and the results table inside
``docs/moe_experiment.md`` (between its results markers). A finished run is not trained again
(``--fresh`` retrains).

Usage::

    python3 benchmarks/moe_experiment.py --speed-rounds 3     # what docs/ shows: 1,500 steps, 3 seeds
    python3 benchmarks/moe_experiment.py --max-steps 300 --seeds 1337   # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from experiments import (commands, curves, evaluate, pedestrian, plot, read_log, seeds_of,  # noqa: E402
                         write_results)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
VARIANTS = ("dense", "moe-active", "moe-total")
COLORS = {"dense": "tab:red", "moe-active": "tab:green", "moe-total": "tab:purple"}
VOCAB_SIZE = 84                              # the bundled plays' characters


def flags(variant: str, m: int) -> list[str]:
    """The model flags of ``variant`` beside ``--arch llama`` (module docstring)."""
    if variant == "dense":
        return ["--d-mlp", str(m)]
    width = m // 2 if variant == "moe-active" else m // 4
    return ["--n-experts", "4", "--n-experts-per-token", "2", "--d-expert", str(width), "--output-router-logits",
            "--router-aux-loss-coef", "0.01"]


def counts(variant: str, m: int) -> tuple[int, int]:
    """``(parameters, active parameters per token)`` of ``variant``'s model."""
    sys.path.insert(0, str(ROOT / "src"))
    from pedestrian.config import GPTConfig, with_arch
    from pedestrian.model.layout import count_active_params, count_params
    from pedestrian.training.settings import DEFAULT_MODEL

    given = {"d_mlp": m} if variant == "dense" else {
        "n_experts": 4, "n_experts_per_token": 2, "d_expert": m // 2 if variant == "moe-active" else m // 4}
    config = GPTConfig(vocab_size=VOCAB_SIZE, **with_arch({**DEFAULT_MODEL, **given}, "llama", given))
    return count_params(config), count_active_params(config)


def run_one(variant: str, seed: int, out: Path, args) -> dict:
    folder = out / f"seed{seed}" / variant
    done = folder / "result.json"
    if done.is_file() and not args.fresh:
        result = json.loads(done.read_text(encoding="utf-8"))
        if result["max_steps"] == args.max_steps:
            return result
    cmd = ["train", "--arch", "llama", *flags(variant, args.d_mlp), "--max-steps", str(args.max_steps),
           "--eval-interval", str(args.eval_interval), "--warmup-steps", str(min(100, args.max_steps // 5)),
           "--max-minutes", "0", "--seed", str(seed), "--out", str(folder), "--no-sample", "--no-progress",
           "--overwrite"]
    _, cpu_s = pedestrian(*cmd)
    log = read_log(folder / "log.jsonl")
    rates = sorted(r["tokens_per_s"] for r in log if "tokens_per_s" in r)
    params, active = counts(variant, args.d_mlp)
    result = {"variant": variant, "seed": seed, "max_steps": args.max_steps, "folder": str(folder),
              "command": "pedestrian " + " ".join(cmd), **evaluate(folder), **curves(log),
              "tokens_per_s_median": rates[len(rates) // 2], "cpu_s": cpu_s, "params": params,
              "active_params": active}
    done.write_text(json.dumps(result) + "\n", encoding="utf-8")
    return result


def speed(args, out: Path) -> dict:
    """``{variant: tokens/s}``: each variant trained ``--speed-steps`` steps in turn, ``--speed-rounds``
    times (the variants interleaved, so a change of the machine's load falls on all of them), the
    median over all its steps of every round. Run it on an idle machine."""
    rates = {v: [] for v in VARIANTS}
    for r in range(args.speed_rounds):
        for v in VARIANTS:
            folder = out / "speed" / v
            print(f"speed, round {r + 1} of {args.speed_rounds}: {v}, {args.speed_steps} steps ...", flush=True)
            pedestrian("train", "--arch", "llama", *flags(v, args.d_mlp), "--max-steps", str(args.speed_steps),
                       "--eval-interval", str(10 * args.speed_steps), "--warmup-steps", "10", "--max-minutes", "0",
                       "--seed", "1337", "--out", str(folder), "--no-sample", "--no-progress", "--overwrite")
            rates[v] += [r["tokens_per_s"] for r in read_log(folder / "log.jsonl") if "tokens_per_s" in r]
    return {v: sorted(x)[len(x) // 2] for v, x in rates.items()}


def table(results: list[dict], args, date: str, rates: dict | None = None) -> str:
    seeds = seeds_of(results)
    by = {(r["variant"], r["seed"]): r for r in results}
    mean = {v: sum(by[v, s]["val_loss_full_split"] for s in seeds) / len(seeds) for v in VARIANTS}
    m = args.d_mlp
    what = {"dense": f"one SwiGLU {m} wide", "moe-active": f"4 experts × {m // 2} wide, 2 per token",
            "moe-total": f"4 experts × {m // 4} wide, 2 per token"}
    tokens = args.max_steps * 16 * 64
    lines = [f"Measured {date}: {args.max_steps:,} steps per run of 16 × 64 characters ({tokens:,} training "
             "characters), lr 2e-3 → 2e-4 (cosine), float32, the bundled plays (char tokenizer, 84 ids); the widths of "
             "`--arch llama` (4 blocks, d_model 128, 4 heads, 2 k/v heads). Loss: `pedestrian eval` of the final "
             f"checkpoint on the whole held-out split ({results[0]['val_targets']:,} characters), nats per character, "
             "the cross-entropy alone.",
             "",
             "| variant | MLP per block | parameters | active per token | "
             + " | ".join(f"seed {s}" for s in seeds) + " | mean | mean − dense | tokens/s (wall, median step) |",
             "|---|---|---|---|" + "---|" * len(seeds) + "---|---|---|"]
    if rates:
        lines[-2] = lines[-2].replace("tokens/s (wall, median step)", "tokens/s (idle machine, median step)")
    for v in VARIANTS:
        runs = [by[v, s] for s in seeds]
        rate = rates[v] if rates else sum(r["tokens_per_s_median"] for r in runs) / len(runs)
        lines.append(f"| `{v}` | {what[v]} | {runs[0]['params']:,} | {runs[0]['active_params']:,} | "
                     + " | ".join(f"{r['val_loss_full_split']:.4f}" for r in runs)
                     + f" | **{mean[v]:.4f}** | {mean[v] - mean['dense']:+.4f} | {rate:,.0f} |")
    lines += ["", (f"Tokens/s: the median step of {args.speed_rounds} rounds of {args.speed_steps} steps per variant, "
                   "the variants in turn, on an idle machine (`--speed-rounds`); 2 threads." if rates else
                   "Tokens/s: the runs' median step, on a 2-core machine shared with other jobs: a rough comparison "
                   "only.") + " Commands:", ""]
    lines += commands(results, "moe_experiment.png")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=1500, help="optimizer steps per run (default 1500)")
    p.add_argument("--eval-interval", type=int, default=100, help="steps between validations (default 100)")
    p.add_argument("--d-mlp", type=int, default=344, help="the dense model's SwiGLU width (default 344)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339],
                   help="one run per variant and seed (default 1337 1338 1339)")
    p.add_argument("--out", default="runs/moe_experiment", help="run folders (default runs/moe_experiment)")
    p.add_argument("--fresh", action="store_true", help="train again runs that already have a result.json")
    p.add_argument("--docs", default=str(DOCS), help="where the plot, JSON and table go (default docs/)")
    p.add_argument("--speed-rounds", type=int, default=0,
                   help="then time each variant alone, in turn, this many rounds (an idle machine; default 0: "
                        "the table gives the runs' own rates)")
    p.add_argument("--speed-steps", type=int, default=200, help="steps per variant and round of --speed-rounds")
    args = p.parse_args()
    docs, out = Path(args.docs), Path(args.out)
    results = []
    for seed in args.seeds:
        for v in VARIANTS:
            print(f"{v}, seed {seed}: {args.max_steps} steps ...", flush=True)
            results.append(run_one(v, seed, out, args))
            r = results[-1]
            print(f"  val loss {r['val_loss_full_split']:.4f} (whole split), {r['params']:,} parameters "
                  f"({r['active_params']:,} per token), {r['tokens_per_s_median']:,.0f} tokens/s", flush=True)
    rates = speed(args, out) if args.speed_rounds > 0 else None
    date = datetime.date.today().isoformat()
    plot(results, docs / "moe_experiment.png", args.max_steps, "variant", COLORS,
         lambda r, mean, seeds: (f"{r['variant']} ({r['params']:,} parameters, {r['active_params']:,} per token): "
                                 f"whole-split val {mean:.3f}"),
         f"Llama-style char model on the plays, {args.max_steps:,} steps: dense against mixtures of experts")
    kept = [{k: v for k, v in r.items() if k != "train_curve"} for r in results]
    (docs / "moe_experiment.json").write_text(json.dumps(
        {"date": date, "max_steps": args.max_steps, "eval_interval": args.eval_interval, "seeds": args.seeds,
         "d_mlp": args.d_mlp, "results": kept, "tokens_per_s_idle": rates,
         "speed": {"rounds": args.speed_rounds, "steps": args.speed_steps} if rates else None}, indent=1) + "\n")
    doc = docs / "moe_experiment.md"
    write_results(doc, "Dense against mixtures of experts", table(results, args, date, rates))
    print(f"wrote {doc}, {docs / 'moe_experiment.png'}, {docs / 'moe_experiment.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The benchmark guard: a training step of this checkout against its parent commit, at 2 threads,
wall clock, on the machine as it is; prints the ratio (this ÷ parent, lower is faster).

A change to a hot path is checked with it before it is committed (docs/guide.md, "Measuring"),
never with a timed unit test. The parent's ``src/`` is taken with ``git archive`` into a
temporary folder (nothing in the checkout changes); the two sides run in fresh processes,
alternating (ABBA), each timing ``model.loss`` + ``model.backward`` + the AdamW update steps
back to back, as the training loop runs them. The first process of each side compiles (or
loads) its kernels and is not counted.

Run::

    python3 benchmarks/bench_parent.py                          # char-small 12 x 64, HEAD~1
    python3 benchmarks/bench_parent.py --vs 5fd4a41 --rounds 8  # against any commit
    python3 benchmarks/bench_parent.py --config llama-char --threads 1

The checkout's side is its working tree (uncommitted changes included): run it before the
commit, against ``HEAD``, or after, against ``HEAD~1`` (the default). It also prints the share
of the machine that other processes took during the run (``/proc/stat``): a ratio measured
beside other jobs is the ratio on a busy machine, not on an idle one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SHAPES = {"char-small": (12, 64), "llama-char": (12, 64), "gpt2": (4, 64)}


def child(config: str, steps: int, warmup: int) -> None:
    """One side's process: ``steps`` training steps back to back after ``warmup``; prints JSON."""
    import numpy as np

    from pedestrian import GPT
    from pedestrian.config import preset
    from pedestrian.training.optim import AdamW

    cfg = preset(config)
    B, T = SHAPES.get(config, (12, 64))
    model = GPT(cfg, dtype="float32", seed=0)
    optim = AdamW(model, lr=3e-4, weight_decay=0.1)
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (B, T))
    y = np.roll(x, -1, axis=1)
    times, cpus = [], []
    for i in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        model.loss(x, y)
        model.backward()
        optim.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    print(json.dumps({"step_ms": statistics.median(times) * 1e3, "cores_busy": sum(cpus) / sum(times),
                      "source": str(Path(__import__("pedestrian").__file__).parents[1])}))


def side(src: Path, args, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "PEDESTRIAN_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, __file__, "--child", "--config", args.config, "--steps",
                           str(args.steps), "--warmup", str(args.warmup)],
                          env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"the side at {src} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if Path(out["source"]) != src:
        raise SystemExit(f"the side at {src} imported pedestrian from {out['source']}")
    return out


def other_load(start, end, seconds: float) -> float | None:
    """Cores' worth of CPU that other processes used between two :func:`cpu_seconds` readings."""
    if start is None or end is None:
        return None
    return ((end[0] - start[0]) - (end[1] - start[1])) / seconds


def cpu_seconds():
    """``(busy, own)`` CPU seconds: every core's since boot (``/proc/stat``) and this process's
    with its waited-for children; ``None`` without ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), sum(os.times()[:4])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vs", default="HEAD~1", help="the commit to compare with (default: HEAD~1)")
    ap.add_argument("--config", default="char-small", help="a preset (default: char-small, 12 x 64)")
    ap.add_argument("--threads", type=int, default=2, help="PEDESTRIAN_NUM_THREADS of both sides (default 2)")
    ap.add_argument("--rounds", type=int, default=6, help="processes per side (default 6)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per process (default 30)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.config, args.steps, args.warmup)

    root = common.ROOT
    rev = subprocess.run(["git", "rev-parse", "--short", args.vs], cwd=root, capture_output=True, text=True)
    if rev.returncode != 0:
        raise SystemExit(f"error: {args.vs!r} is not a commit of {root}: {rev.stderr.strip()}")
    with tempfile.TemporaryDirectory(prefix="pedestrian-parent-") as tmp:
        archive = Path(tmp) / "src.tar"
        subprocess.run(["git", "archive", "-o", str(archive), rev.stdout.strip(), "src"], cwd=root, check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        sides = {"this": root / "src", "parent": Path(tmp) / "src"}
        for name, src in sides.items():                       # compile or load the kernels
            side(src, argparse.Namespace(config=args.config, steps=1, warmup=1), args.threads)
        runs: dict = {k: [] for k in sides}
        t0, c0 = time.perf_counter(), cpu_seconds()
        for r in range(args.rounds):
            for name in (("this", "parent") if r % 2 == 0 else ("parent", "this")):
                runs[name].append(side(sides[name], args, args.threads))
        load = other_load(c0, cpu_seconds(), time.perf_counter() - t0)
    ratios = [a["step_ms"] / b["step_ms"] for a, b in zip(runs["this"], runs["parent"])]
    print(f"{args.config}, {args.threads} thread(s), {args.rounds} processes per side x {args.steps} steps; "
          f"this = working tree, parent = {args.vs} ({rev.stdout.strip()})")
    for name in sides:
        ms = [round(x["step_ms"], 1) for x in runs[name]]
        busy = statistics.median(x["cores_busy"] for x in runs[name])
        print(f"  {name:6s} step ms {statistics.median(ms):7.1f}  (runs {ms}; cores busy {busy:.2f})")
    print(f"  ratio this / parent: {statistics.median(ratios):.3f}  (per round {min(ratios):.3f}-{max(ratios):.3f})")
    if load is not None:
        print(f"  other processes used {load:.2f} cores on average during the run"
              + ("  -- not an idle machine" if load > 0.1 else ""))


if __name__ == "__main__":
    main()

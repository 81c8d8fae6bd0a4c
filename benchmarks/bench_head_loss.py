"""The head fused with its loss at SmolLM2-135M's shape: peak memory and step time, one run.

Three sides, each step kind in a fresh process of its own (so each peak is its own): pedestrian
with the fused head (``model.fused_head = True``, the default), pedestrian with the logits kept
(``False``: pedestrian before the change), and transformers (+ PEFT for LoRA) as
benchmarks/bench_llama.py runs it (its sides are imported from there: the same model, optimizer,
LoRA targets r 8 on the seven projections). Step kinds: a full step (forward, backward, AdamW on
every weight) and a LoRA step (base frozen). Per process: one warm-up step, then ``--steps``
timed steps (wall clock, median); peak RSS is ``VmHWM`` at the end (imports, model, optimizer
and every step).

Run::

    python3 benchmarks/bench_head_loss.py --batch-size 1 --context-length 1024 --threads 2

Writes ``benchmarks/results/head_loss.json`` and prints a table (docs/kernels.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIDES = ("pedestrian-fused", "pedestrian-logits-kept", "transformers")


def child(side: str, mode: str, B: int, T: int, steps: int, threads: int) -> dict:
    """One side's steps of one kind in this process: ``{"peak_rss_mib", "step_s", "loss"}``."""
    sys.path.insert(0, str(HERE))
    import bench_llama as bl

    config = bl.make_config(T)
    if side == "transformers":
        s = bl.TransformersSide(config, None, threads)
    else:
        s = bl.PedestrianSide(config, None)
        s.model.fused_head = side == "pedestrian-fused"
    s.setup(mode)
    batches = bl.make_batches(config, B, T, n=steps + 1)
    times, loss = [], None
    for i, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        loss = s.step(x, y)
        if i:
            times.append(time.perf_counter() - t0)
    peak = next(int(line.split()[1]) / 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmHWM:"))
    return {"peak_rss_mib": round(peak, 1), "step_s": round(statistics.median(times), 3), "loss": loss}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--context-length", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", nargs=2, metavar=("SIDE", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    env = dict(os.environ, PEDESTRIAN_NUM_THREADS=str(a.threads), OMP_NUM_THREADS=str(a.threads))
    if a.child:
        print(json.dumps(child(*a.child, a.batch_size, a.context_length, a.steps, a.threads)))
        return 0
    load = os.getloadavg()
    results = {"batch_size": a.batch_size, "context_length": a.context_length, "threads": a.threads,
               "load_before": [round(x, 2) for x in load], "runs": {}}
    for mode in ("lora", "full"):
        for side in SIDES:
            proc = subprocess.run([sys.executable, __file__, "--child", side, mode, "--batch-size",
                                   str(a.batch_size), "--context-length", str(a.context_length),
                                   "--steps", str(a.steps), "--threads", str(a.threads)],
                                  env=env, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(proc.stderr[-3000:])
            results["runs"][f"{mode}/{side}"] = r = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"{mode:5} {side:24} peak {r['peak_rss_mib']:9.1f} MiB  step {r['step_s']:8.2f} s  "
                  f"loss {r['loss']:.4f}", flush=True)
    results["load_after"] = [round(x, 2) for x in os.getloadavg()]
    for mode in ("lora", "full"):
        peer = results["runs"][f"{mode}/transformers"]
        for side in SIDES[:2]:
            r = results["runs"][f"{mode}/{side}"]
            print(f"{mode:5} {side:24} memory {r['peak_rss_mib'] / peer['peak_rss_mib']:.2f}x the peer's, "
                  f"time {r['step_s'] / peer['step_s']:.2f}x")
    print(f"load average before {results['load_before']}, after {results['load_after']}")
    out = HERE / "results" / "head_loss.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Data parallel over ranks: tokens/s of 1 and 2 ranks on this machine, the bytes all-reduced per
step, and the step time projected to N ranks over a network.

Run (about 5 minutes on 2 cores)::

    python3 benchmarks/bench_ranks.py
    python3 benchmarks/bench_ranks.py --bandwidth-gbit 100 --latency-us 10 --no-save   # another network

Measures, alternating the configurations ``--reps`` times (medians):

- ``pedestrian train`` (the default model and data, ``--stop-step --steps``) in one process with
  its default threads (the fast kernels' numba threads), in one process on one thread
  (``PEDESTRIAN_NUM_THREADS=1``), and as 2 ranks (``--nproc 2``: gloo, one thread each); tokens/s of
  the steady part (log.jsonl, step 50 to the end);
- one ``all_reduce`` (SUM) of a float32 buffer the size of the gradients of char-small and of
  gpt2-124M between 2 gloo ranks on this machine (this script under ``torchrun``).

Projects the step of N ranks, each a machine like this one with the batch of one
(``benchmarks/results/train_numpy.json``: char-small 12×64, gpt2-124M 4×64), as compute +
all-reduce, the ring algorithm's time (gloo and NCCL both use rings or trees of the same order)::

    t_allreduce(N) = 2(N−1)/N · S / BW + 2(N−1) · α

``S`` the gradient bytes, ``BW`` the network bandwidth per rank, ``α`` the latency of one
message. pedestrian's all-reduce starts after the backward (no overlap with compute), so the step
is ``t_compute + t_allreduce``.

Writes ``benchmarks/results/ranks.json`` and ``.md`` and the ``ranks`` table of ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: trainable parameters (float32 gradients): the presets of benchmarks/bench_train.py
PARAMS = {"char-small": 809_856, "gpt2-124M": 124_439_808}
RANKS = (2, 4, 8, 16, 32, 64)
CONFIGS = {"1 rank, threads (default)": [], "1 rank, one thread": ["PEDESTRIAN_NUM_THREADS=1"],
           "2 ranks (--nproc 2)": ["--nproc", "2"]}


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))


def train_tokens_per_s(extra: list, steps: int, folder: Path) -> dict:
    """One short default run; steady tokens/s from its log."""
    out = folder / "run"
    shutil.rmtree(out, ignore_errors=True)
    env = _env()
    env.update(a.split("=", 1) for a in extra if "=" in a)                # NAME=value: the environment
    flags = [a for a in extra if "=" not in a]
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pedestrian", "train", "--out", str(out), "--stop-step", str(steps),
                           "--no-progress", "--no-sample", "--no-plot", "--max-minutes", "0", *flags],
                          env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps_done = [r for r in records if "loss" in r]
    a, b = steps_done[49], steps_done[-1]
    tokens = 16 * 64                                               # the default batch
    return {"tokens_per_s": (b["step"] - a["step"]) * tokens / (b["time_s"] - a["time_s"]), "wall_s": wall,
            "load_1m": os.getloadavg()[0]}


def allreduce_worker(out: str, repeats: int) -> None:
    """Under torchrun: time all_reduce of each buffer size; rank 0 writes the medians."""
    import numpy as np
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    times = {}
    for name, n in PARAMS.items():
        buf = torch.from_numpy(np.ones(n, dtype=np.float32))
        dist.all_reduce(buf)                                      # warm-up (connections, pages)
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            seconds.append(time.perf_counter() - t0)
        times[name] = statistics.median(seconds)
        del buf
    tiny = torch.zeros(1, dtype=torch.float64)
    seconds = []
    for _ in range(50):
        t0 = time.perf_counter()
        dist.all_reduce(tiny)
        seconds.append(time.perf_counter() - t0)
    times["8 bytes (loss, stop flag)"] = statistics.median(seconds)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def measure_allreduce(repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "allreduce.json"
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               __file__, "--allreduce-worker", str(out), "--repeats", str(repeats)],
                              env=_env(), capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        return json.loads(out.read_text())


def ring_seconds(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Ring all-reduce: a reduce-scatter and an all-gather, each N−1 messages of S/N bytes."""
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def markdown(result: dict) -> str:
    info, args = result["machine"], result["args"]
    lines = ["### Ranks: measured here, projected to N machines", "",
             f"Measured {info['date']} on {info['cpu']} ({info['logical_cores']} logical cores), gloo on one "
             f"machine; 1-minute load average at start {info['load_average_1m']}.", "",
             f"**Measured, the default `pedestrian train`** (812,288 parameters, batch 16×64, float32; steady "
             f"tokens/s of steps 50-{args['steps']}, median of {args['reps']} alternating runs):", "",
             "| configuration | tokens/s | runs |", "|---|---|---|"]
    for name, runs in result["train"].items():
        tps = [round(r["tokens_per_s"]) for r in runs]
        lines.append(f"| {name} | **{statistics.median(tps):,.0f}** | {', '.join(f'{t:,}' for t in tps)} |")
    ar = result["allreduce_s"]
    lines += ["", "**Bytes all-reduced per step** (the float32 gradient buffer, once per optimizer step; plus "
              "two 8-byte exchanges: the loss and the stop decision) and one all-reduce between 2 gloo ranks on "
              "this machine (median):", "", "| model | parameters | bytes per step | all-reduce here, 2 ranks |",
              "|---|---|---|---|"]
    for name, n in PARAMS.items():
        lines.append(f"| {name} | {n:,} | {4 * n / 1e6:,.1f} MB | {1e3 * ar[name]:,.1f} ms |")
    lines.append(f"| loss, stop flag | | 8 B each | {1e6 * ar['8 bytes (loss, stop flag)']:,.0f} µs |")
    bw, lat = args["bandwidth_gbit"], args["latency_us"]
    lines += ["", f"**Projected** step of N ranks, each a machine like this one computing the batch of one "
              f"(bench_train: char-small 12×64 in {result['compute_ms']['char-small']:.1f} ms, gpt2-124M 4×64 in "
              f"{result['compute_ms']['gpt2-124M']:,.0f} ms), over **{bw:g} Gbit/s** with **α = {lat:g} µs** per "
              "message: step = compute + 2(N−1)/N · S/BW + 2(N−1)·α (ring all-reduce, after the backward, no "
              "overlap). Efficiency = compute / step; tokens/s = N · batch · T / step.", "",
              "| N | char-small all-reduce ms | step ms | tokens/s | efficiency | gpt2-124M all-reduce ms | step ms "
              "| tokens/s | efficiency |", "|---|---|---|---|---|---|---|---|---|"]
    for row in result["projection"]:
        cells = [str(row["N"])]
        for name in PARAMS:
            p = row[name]
            cells += [f"{p['allreduce_ms']:,.1f}", f"{p['step_ms']:,.1f}", f"{p['tokens_per_s']:,.0f}",
                      f"{100 * p['efficiency']:.0f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="steps of each training run")
    ap.add_argument("--reps", type=int, default=3, help="alternating rounds of the three configurations")
    ap.add_argument("--repeats", type=int, default=5, help="timed all-reduces per buffer")
    ap.add_argument("--bandwidth-gbit", type=float, default=10.0, help="network bandwidth per rank, Gbit/s")
    ap.add_argument("--latency-us", type=float, default=50.0, help="latency of one message, µs")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--allreduce-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.allreduce_worker:
        allreduce_worker(args.allreduce_worker, args.repeats)
        return 0
    info = common.machine_info()
    train = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.reps):
            for name, extra in CONFIGS.items():
                train[name].append(train_tokens_per_s(extra, args.steps, Path(tmp)))
                print(name, round(train[name][-1]["tokens_per_s"]), file=sys.stderr)
    allreduce = measure_allreduce(args.repeats)
    bench = json.loads((ROOT / "benchmarks" / "results" / "train_numpy.json").read_text())
    compute = {r["config"]: r["pedestrian_ms"] for r in bench["results"]}
    tokens = {r["config"]: r["batch_size"] * r["seq_len"] for r in bench["results"]}
    bandwidth, latency = args.bandwidth_gbit * 1e9 / 8, args.latency_us * 1e-6
    projection = []
    for n in RANKS:
        row = {"N": n}
        for name, params in PARAMS.items():
            t_ar = ring_seconds(n, 4 * params, bandwidth, latency)
            step = compute[name] / 1e3 + t_ar
            row[name] = {"allreduce_ms": 1e3 * t_ar, "step_ms": 1e3 * step, "tokens_per_s": n * tokens[name] / step,
                         "efficiency": compute[name] / 1e3 / step}
        projection.append(row)
    result = {"machine": info, "args": vars(args), "train": train, "allreduce_s": allreduce,
              "compute_ms": compute, "bytes_per_step": {k: 4 * v for k, v in PARAMS.items()},
              "projection": projection}
    text = markdown(result)
    print(text)
    if not args.no_save:
        common.write_json("ranks", result)
        common.write_markdown("ranks", text)
        common.update_doc_section("ranks", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

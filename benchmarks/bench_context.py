"""Context-scaling benchmark: one training step as the context grows, pedestrian against PyTorch.

char-small widths (d_model 128, 4 heads, 4 blocks, vocab 65), float32, ``context_length = T``,
1,024 tokens per step (``B · T = 1024``: T = 64 … 2048, batch 16 … 1) and, with ``--long``,
T = 4096 at batch 1. Each T is measured as ``bench_train.py`` measures (its model, weights
copy, batches, fused AdamW and the faster of SDPA and manual attention for PyTorch): each
side in a process of its own, taking turns in rounds in ABBA order, a pause before each turn;
figures are medians. The ratio of each T is the median over rounds of (pedestrian ÷ PyTorch) within a
round, and its quartiles are reported: on a shared machine the absolute times drift, the
ratio of neighbouring turns much less. Peak memory (``VmHWM``) of each side alone is measured
in its own subprocess.

``--kernels`` measures the attention crossover instead: pedestrian with the full-matrix kernel
against pedestrian with the tiled one (:mod:`pedestrian.kernels.attention_tiled`), alternating
the same way; the first T where the tiled one is faster is the :data:`TILED_MIN_T` the fast
path uses.

Run (about 5 minutes on 2 cores)::

    python3 benchmarks/bench_context.py                 # T = 64 … 2048, NumPy backend
    python3 benchmarks/bench_context.py --long          # plus T = 4096, batch 1
    python3 benchmarks/bench_context.py --kernels       # full-matrix vs tiled attention
    python3 benchmarks/bench_context.py --backend torch
    python3 benchmarks/bench_context.py --threads 1     # one thread each (busy machine)

Writes ``benchmarks/results/context_<backend>.json`` / ``.md`` / ``.png`` (``context_kernels_…``
with ``--kernels``) and refreshes the matching section of ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train  # noqa: E402
import common  # noqa: E402
import numpy as np  # noqa: E402

#: (T, B) with B·T = 1024 tokens per step
SIZES = [(64, 16), (128, 8), (256, 4), (512, 2), (1024, 1), (2048, 1)]
LONG = (4096, 1)


def make_config(T: int):
    from pedestrian.config import preset

    return preset("char-small", context_length=T)


def plan(T: int) -> tuple[int, int, int]:
    """``(warm-up steps, rounds, timed steps per round)``: about the same seconds per T."""
    if T <= 512:
        return 2, 8, 3
    if T <= 2048:
        return 2, 8, 2
    return 1, 6, 1


def measure(T: int, B: int, backend: str, sides: list[str], rounds: int | None) -> dict:
    """Alternate the ``sides`` (``"torch"`` or a pedestrian attention kind: ``"auto"``, ``"full"``,
    ``"tiled"``) on one (T, B), each in a process of its own (``bench_train._Side``)."""
    from pedestrian.kernels.attention_tiled import use_tiled

    config = make_config(T)
    procs = {s: bench_train._Side("torch" if s == "torch" else "pedestrian", config, B, T, backend, reps=1,
                                  attention="auto" if s == "torch" else s) for s in sides}
    result: dict = {"T": T, "B": B, "threads": bench_train._threads(),
                    "pedestrian_attention": "tiled" if use_tiled(T, np.zeros(1, np.float32)) else "full"}
    if "torch" in procs:
        info = procs["torch"].info
        result.update(torch_optimizer=info["optimizer"], torch_attention=info["attention"],
                      torch_attention_fwd_bwd_ms=info["attention_ms"])
    warmup, n_rounds, per_round = plan(T)
    n_rounds = rounds or n_rounds
    for side in sides:
        procs[side].ask("steps", warmup, 0)
    times: dict = {s: [] for s in sides}
    per_round_ms: dict = {s: [] for s in sides}
    for r in range(n_rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):    # ABBA
            time.sleep(bench_train.SETTLE_S)                   # the other side's threads go idle
            mine = [t for t, _ in procs[side].ask("steps", per_round, 1)]   # after an untimed lead-in
            times[side] += mine
            per_round_ms[side].append(common.median_ms(mine))
    for proc in procs.values():
        proc.close()
    a, b = sides[0], sides[1]
    ratios = [x / y for x, y in zip(per_round_ms[a], per_round_ms[b])]
    quart = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    result.update({f"{s}_ms": round(common.median_ms(t), 2) for s, t in times.items()})
    result.update(ratio=round(statistics.median(ratios), 3),
                  ratio_quartiles=[round(quart[0], 3), round(quart[2], 3)],
                  ratio_range=[round(min(ratios), 3), round(max(ratios), 3)], rounds=n_rounds,
                  steps_per_round=per_round)
    return result


def child_memory(side: str, T: int, B: int, backend: str, attention: str) -> dict:
    """Peak RSS of 3 training steps of one side alone (runs in its own process)."""
    base = common.peak_rss_mib()
    config = make_config(T)
    batches = bench_train.make_batches(config, B, T, n=3)
    if side == "torch":
        import torch

        tmodel = bench_train.build_torch_model(config, attention)
        topt, _ = bench_train.make_torch_optimizer(tmodel)
        for x, y in batches:
            bench_train.torch_step(tmodel, topt, torch.from_numpy(x), torch.from_numpy(y))
    else:
        from pedestrian.model import GPT

        bench_train.force_attention(side)
        model = GPT(config, seed=0, backend=backend)
        opt, _ = bench_train.make_optimizer(model)
        if backend == "torch":
            import torch

            batches = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]
        for x, y in batches:
            bench_train.pedestrian_step(model, opt, x, y)
    return {"peak_rss_mib": round(common.peak_rss_mib(), 1), "rss_before_model_mib": round(base, 1)}


def markdown(results: list[dict], info: dict, backend: str, kernels: bool, threads: int | None) -> str:
    title = ("Attention kernels: full-matrix against tiled" if kernels
             else f"Long context: training step against T, `backend=\"{backend}\"`")
    title += "" if threads is None else f", {threads} thread{'s' if threads > 1 else ''} each"
    lines = [f"### {title}", "", common.machine_line(info), "",
             "char-small widths (d_model 128, 4 heads, 4 blocks), float32, 1,024 tokens per step "
             "(B·T = 1024; batch 1 from T = 1024 on). Ratio: median over rounds of the two sides' "
             "times in the same round; quartiles and range over the rounds.", ""]
    if kernels:
        lines += ["| T | B | full-matrix ms | tiled ms | tiled ÷ full | quartiles | range |",
                  "|---|---|---|---|---|---|---|"]
        for r in results:
            lines.append(f"| {r['T']} | {r['B']} | {r['full_ms']:.1f} | {r['tiled_ms']:.1f} | **{r['ratio']:.2f}** "
                         f"| {r['ratio_quartiles'][0]:.2f}–{r['ratio_quartiles'][1]:.2f} "
                         f"| {r['ratio_range'][0]:.2f}–{r['ratio_range'][1]:.2f} |")
        return "\n".join(lines) + "\n"
    lines += ["| T | B | pedestrian ms | PyTorch ms | ratio | quartiles | range | attention (ped / torch) "
              "| peak RSS MiB (ped / torch) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        mem = (f"{r['pedestrian_peak_rss_mib']['peak_rss_mib']:.0f} / {r['torch_peak_rss_mib']['peak_rss_mib']:.0f}"
               if "torch_peak_rss_mib" in r else "not measured")
        lines.append(f"| {r['T']} | {r['B']} | {r['auto_ms']:.1f} | {r['torch_ms']:.1f} | **{r['ratio']:.2f}** "
                     f"| {r['ratio_quartiles'][0]:.2f}–{r['ratio_quartiles'][1]:.2f} "
                     f"| {r['ratio_range'][0]:.2f}–{r['ratio_range'][1]:.2f} "
                     f"| {r['pedestrian_attention']} / {r['torch_attention']} | {mem} |")
    lines += ["", f"pedestrian: `pedestrian.training.optim.AdamW`, the fast kernels on {results[0]['threads']} "
              "numba thread(s). PyTorch: fused AdamW and the faster of SDPA and manual attention, measured at "
              "each T. Each side runs in a process of its own."]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path, backend: str, threads: int | None) -> None:
    """Step time against T, both sides (log-log), written atomically as a PNG."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ts = [r["T"] for r in results]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(Ts, [r["auto_ms"] for r in results], "o-", label=f"pedestrian ({backend} backend)")
    ax.plot(Ts, [r["torch_ms"] for r in results], "s--", label="PyTorch eager")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(Ts, [str(t) for t in Ts])
    ax.set_xlabel("context T (B·T = 1024; batch 1 from T = 1024)")
    ax.set_ylabel("training step, ms (median)")
    ax.set_title("char-small widths, float32, " + ("2 cores" if threads is None else f"{threads} thread(s) each"))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="numpy", choices=["numpy", "torch"])
    ap.add_argument("--long", action="store_true", help="also T = 4096 at batch 1")
    ap.add_argument("--only", type=int, nargs="*", help="only these T (batch max(1, 1024 // T))")
    ap.add_argument("--kernels", action="store_true", help="full-matrix vs tiled attention (the crossover)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per T (default by T)")
    ap.add_argument("--threads", type=int, default=None,
                    help="run both sides with this many threads (as bench_train.py --threads; the "
                         "robust comparison on a busy machine, not the target setting)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--no-save", action="store_true", help="print only; write no result files")
    ap.add_argument("--child-memory", help=argparse.SUPPRESS)
    ap.add_argument("--child-T", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--torch-attention", default="sdpa", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads is not None:
        common.reexec_with_threads(args.threads)
    sizes = SIZES + ([LONG] if args.long else [])
    if args.child_memory:
        B = max(1, 1024 // args.child_T)
        print(json.dumps(child_memory(args.child_memory, args.child_T, B, args.backend, args.torch_attention)))
        return 0
    if args.only:
        sizes = [(T, max(1, 1024 // T)) for T in args.only]
    info = common.machine_info()
    print(json.dumps({"machine": info}), file=sys.stderr)
    sides = ["tiled", "full"] if args.kernels else ["auto", "torch"]
    results = []
    for T, B in sizes:
        r = measure(T, B, args.backend, sides, args.rounds)
        if not args.kernels and not args.no_memory:
            for side, name in (("auto", "pedestrian"), ("torch", "torch")):
                r[f"{name}_peak_rss_mib"] = common.child_json(
                    [__file__, "--child-memory", side, "--child-T", str(T), "--backend", args.backend,
                     "--torch-attention", r["torch_attention"]])
        results.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
    text = markdown(results, info, args.backend, args.kernels, args.threads)
    print(text)
    if args.no_save:
        return 0
    tag = (f"context_kernels_{args.backend}" if args.kernels else f"context_{args.backend}") \
        + ("" if args.threads is None else f"_{args.threads}thread")
    common.write_json(tag, {"machine": info, "results": results})
    common.write_markdown(tag, text)
    if not args.kernels:
        png = common.RESULTS / f"{tag}.png"
        plot(results, png, args.backend, args.threads)
        text += f"\n![step time against T]({Path('..') / png.relative_to(common.ROOT)})\n"
    if not args.only:
        common.update_doc_section(tag, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

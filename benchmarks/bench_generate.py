"""Generation benchmark: time per new token against position, KV cache vs full recomputation.

For each position ``L`` (the number of tokens the model conditions on) it measures the time
``pedestrian.generation.generate`` spends producing one new token: the forward (one cached step, or a full
``GPT.forward`` over all ``L`` tokens when uncached) plus greedy sampling. The timestamps come
from the ``on_token`` callback, so what is timed is exactly the generation loop users run.
Cached and uncached repetitions alternate in one process so that machine load hits both alike;
every figure is a median over repetitions (then a rolling median over 9 neighbouring positions
for the table).

Expected shape: the cached per-token time is flat to linear in ``L`` (one attention row over
``L`` cached keys), the uncached one grows at least linearly (the whole prefix every token, with
an ``L²`` attention term). A few tokens past the context show the sliding window (default
``window_shift=1``: one rebuild of the cache over ``context_length`` tokens per token).

Run (about 1-2 minutes on 2 cores)::

    python3 benchmarks/bench_generate.py                              # char-small widths, context 512
    python3 benchmarks/bench_generate.py --context-length 256 --reps 2 --uncached-reps 1   # quick
    python3 benchmarks/bench_generate.py --threads 1                  # single-threaded BLAS

Writes ``benchmarks/results/generate_<tag>.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if "--threads" in sys.argv[:-1]:          # BLAS thread count must be set before NumPy loads
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_var] = sys.argv[sys.argv.index("--threads") + 1]

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def per_token_seconds(model, n_new: int, use_cache: bool, batch: int = 1) -> np.ndarray:
    """Seconds between consecutive new tokens; entry ``j`` is the step whose window held
    ``1 + j`` tokens (prompt of one token). Entry 0 also holds the cache allocation."""
    from pedestrian.generation.generate import Sampling, generate

    prompt = np.zeros((batch, 1), dtype=np.int64)
    stamps = [time.perf_counter()]
    generate(model, prompt, n_new, Sampling(temperature=0), use_cache=use_cache, on_token=lambda ids: stamps.append(time.perf_counter()))
    return np.diff(np.asarray(stamps))


def rolling_median(x: np.ndarray, width: int = 9) -> np.ndarray:
    half = width // 2
    return np.array([np.nanmedian(x[max(0, i - half):i + half + 1]) for i in range(len(x))])


def end_to_end(model, n_new: int, use_cache: bool, reps: int) -> float:
    """tokens/s of ``generate`` for ``n_new`` greedy tokens from a one-token prompt (median)."""
    from pedestrian.generation.generate import Sampling, generate

    prompt = np.zeros((1, 1), dtype=np.int64)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        generate(model, prompt, n_new, Sampling(temperature=0), use_cache=use_cache)
        times.append(time.perf_counter() - t0)
    return n_new / statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="char-small")
    parser.add_argument("--context-length", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--backend", default="numpy", choices=["numpy", "torch"])
    parser.add_argument("--reps", type=int, default=5, help="cached repetitions")
    parser.add_argument("--uncached-reps", type=int, default=3, help="uncached repetitions")
    parser.add_argument("--past", type=int, default=24, help="tokens generated past the context")
    parser.add_argument("--threads", default=None,
                        help="BLAS threads (sets OPENBLAS/OMP/MKL_NUM_THREADS; default: as set)")
    parser.add_argument("--tag", default=None, help="result file name part (default from the config)")
    args = parser.parse_args(argv)

    from pedestrian.config import preset
    from pedestrian.model import GPT

    overrides = {"context_length": args.context_length}
    if args.vocab_size:
        overrides["vocab_size"] = args.vocab_size
    config = preset(args.preset, **overrides)
    model = GPT(config, seed=0, dtype=args.dtype, backend=args.backend)
    model.training = False
    C = config.context_length
    tag = args.tag or f"{args.preset}_c{C}_{args.backend}_{args.dtype}"
    info = common.machine_info()
    print(f"config {config}  params {model.num_params():,}  load {info['load_average_1m']}", flush=True)

    # warm-up (BLAS threads, allocator, caches)
    per_token_seconds(model, 64, True)
    per_token_seconds(model, 32, False)

    n_new = C + args.past
    cached, uncached = [], []
    for r in range(max(args.reps, args.uncached_reps)):             # alternate the two sides
        if r < args.reps:
            cached.append(per_token_seconds(model, n_new, True))
        if r < args.uncached_reps:
            t0 = time.perf_counter()
            uncached.append(per_token_seconds(model, C, False))     # up to the context only
            print(f"  rep {r}: uncached pass {time.perf_counter() - t0:.1f} s", flush=True)
    cached_med = np.median(np.stack(cached), axis=0)              # (n_new,)
    uncached_med = np.median(np.stack(uncached), axis=0)          # (C,)
    lengths = np.arange(n_new) + 1                                   # window length of step j
    cached_s = rolling_median(cached_med[:C])
    uncached_s = rolling_median(uncached_med)

    def at(series, L):
        return float(series[L - 1])

    rows = []
    for L in sorted({16, 64, 128, 256, 384, C // 2, C} & set(range(2, C + 1))):
        c_ms, u_ms = 1e3 * at(cached_s, L), 1e3 * at(uncached_s, L)
        rows.append({"length": L, "cached_ms": c_ms, "uncached_ms": u_ms,
                     "cached_tok_s": 1e3 / c_ms, "uncached_tok_s": 1e3 / u_ms, "speedup": u_ms / c_ms})
    # flat-to-linear: least-squares line through the cached per-token times (positions 2..C)
    ok = np.isfinite(cached_med[1:C])
    slope, intercept = np.polyfit(lengths[1:C][ok], cached_med[1:C][ok], 1)
    past = cached_med[C:] if args.past else np.array([])
    e2e_200 = {"cached": end_to_end(model, 200, True, 5), "uncached": end_to_end(model, 200, False, 1)}

    result = {
        "config": config.to_dict(), "params": model.num_params(), "dtype": args.dtype,
        "backend": args.backend, "machine": info,
        "reps": {"cached": args.reps, "uncached": args.uncached_reps},
        "table": rows,
        "cached_linear_fit": {"intercept_ms": 1e3 * intercept, "slope_us_per_token": 1e6 * slope},
        "past_context_ms_median": float(1e3 * np.median(past)) if past.size else None,
        "end_to_end_200_greedy_tok_s": e2e_200,
        "per_position_ms": {"cached": (1e3 * cached_med).tolist(), "uncached": (1e3 * uncached_med).tolist()},
        "load_average_1m_end": round(os.getloadavg()[0], 2),
    }
    common.write_json(f"generate_{tag}", result)

    threads = os.environ.get("OPENBLAS_NUM_THREADS") or "library default"
    lines = [
        f"# Generation: time per new token vs position ({args.preset} widths, context {C}, "
        f"{args.backend} {args.dtype}, {model.num_params():,} parameters)",
        "",
        f"Machine: {info['cpu']}, {info['logical_cores']} logical cores, load average "
        f"{info['load_average_1m']} at start / {result['load_average_1m_end']} at end (shared with "
        "other jobs: absolute numbers are noisy, the shapes and ratios are the point).",
        f"Medians over {args.reps} cached / {args.uncached_reps} uncached alternating runs, then a rolling "
        "median over 9 positions. Batch 1, greedy; a step = forward + sampling. "
        f"BLAS threads: {threads}.",
        "",
        "| length L | cached ms/token | uncached ms/token | cached tokens/s | uncached tokens/s | speed-up |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['length']} | {r['cached_ms']:.3f} | {r['uncached_ms']:.3f} | "
                     f"{r['cached_tok_s']:.0f} | {r['uncached_tok_s']:.0f} | {r['speedup']:.1f}x |")
    lines += [
        "",
        f"Cached per-token time, least-squares line over L = 2..{C}: "
        f"{1e3 * intercept:.3f} ms + {1e6 * slope:.3f} µs × L (flat to linear).",
    ]
    if past.size:
        lines.append(f"Past the context (window_shift=1: the cache is rebuilt over {C} tokens for each "
                     f"token): median {1e3 * np.median(past):.2f} ms/token.")
    lines.append(f"End to end, 200 greedy tokens from a one-token prompt: {e2e_200['cached']:.0f} tokens/s "
                 f"cached, {e2e_200['uncached']:.0f} tokens/s uncached.")
    lines.append("")
    lines.append(f"![per-token time](generate_{tag}.png)")
    md = "\n".join(lines) + "\n"
    common.write_markdown(f"generate_{tag}", md)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.plot(lengths[1:C], 1e3 * uncached_med[1:], color="tab:red", alpha=0.25, lw=0.8)
    ax.plot(lengths[1:C], 1e3 * uncached_s[1:], color="tab:red", label="uncached (full forward)")
    ax.plot(lengths[1:C], 1e3 * cached_med[1:C], color="tab:blue", alpha=0.25, lw=0.8)
    ax.plot(lengths[1:C], 1e3 * cached_s[1:], color="tab:blue", label="KV cache")
    if past.size:
        ax.plot(lengths[C:], 1e3 * past, ".", color="tab:orange", ms=4,
                label="KV cache past the context (rebuilt every token, window_shift=1)")
    ax.axvline(C, color="gray", ls="--", lw=0.8)
    ax.text(C, ax.get_ylim()[1] * 0.5, " context length\n (window slides)", fontsize=8, color="gray")
    ax.set_yscale("log")
    ax.set_xlabel("tokens in the window L")
    ax.set_ylabel("ms per new token (log scale)")
    ax.set_title(f"pedestrian generate: {args.preset} widths, context {C}, {args.backend} {args.dtype}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(common.RESULTS / f"generate_{tag}.png", dpi=120)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

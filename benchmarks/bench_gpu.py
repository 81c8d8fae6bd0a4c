"""GPU training-step benchmark: pedestrian's hand-derived backward (the GPU kernel table) against
PyTorch eager and ``torch.compile`` of the same module, all three in one run on one card.

Sides (each from the same weights, on the same batches, with the same AdamW hyper-parameters):

- ``pedestrian``: ``GPT(..., backend="torch", device="cuda")`` -- the kernel table a GPU gets
  (:func:`pedestrian.gpu.kernels_for`: Triton kernels, products on cuBLAS, the rest the reference
  layers) -- stepped by :func:`pedestrian.training.step.train_step` as ``pedestrian train`` runs it
  (one read of the device per step, no clipping);
- ``torch-eager``: the PyTorch side of ``bench_train.py`` (a nanoGPT-style module with
  ``scaled_dot_product_attention``; transformers' ``LlamaForCausalLM`` with SDPA for Llama shapes),
  fused AdamW, the loss read once per step;
- ``torch-compile``: the same module through ``torch.compile`` (default inductor backend), the
  same fused AdamW.

Configs (float32): char-small at 12 x 64, gpt2-124M at 8 x 1024, SmolLM2-135M's shape
(``preset("smollm2-135m")``, bench_llama.py's) at 4 x 2048. Per side: step time paused (a
synchronised pause before each timed step, the median) and back to back (steps in a row, one
synchronisation at the end), peak GPU memory (``torch.cuda.max_memory_allocated`` from before the
model is built to the last step), and the largest |loss difference| from pedestrian's on the same
step. The sides run one after the other in this process (each freed before the next).

Run::

    python3 benchmarks/bench_gpu.py                       # on a GPU: all configs (a few minutes)
    python3 benchmarks/bench_gpu.py --configs char-small  # one
    python3 benchmarks/bench_gpu.py --dry-run             # no GPU: tiny shapes on the CPU, the
                                                          # Triton kernels under the interpreter

Writes ``gpu_<card>.json`` and ``.md`` (``gpu_dryrun`` for a dry run) to ``--out`` (default
``benchmarks/results``) and, on a GPU, refreshes the ``bench:gpu`` table in
docs/performance.md. ``benchmarks/device_check.sh``
runs it after the GPU tests.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

#: name -> (preset, overrides, batch, context)
CONFIGS = {
    "char-small": ("char-small", {}, 12, 64),
    "gpt2-124M": ("gpt2", {}, 8, 1024),
    "smollm2-135M": ("smollm2-135m", dict(context_length=2048), 4, 2048),
}
#: --dry-run: the same kinds of model at sizes the Triton interpreter runs in seconds
TINY = {
    "char-small": ("char-small", dict(d_model=32, n_heads=2, n_blocks=1, context_length=16), 2, 16),
    "gpt2-124M": ("gpt2", dict(vocab_size=97, d_model=32, n_heads=2, n_blocks=1, context_length=16), 2, 16),
    "smollm2-135M": ("smollm2-135m", dict(vocab_size=97, d_model=36, n_heads=3, n_kv_heads=1, d_mlp=64,
                                          n_blocks=1, context_length=16), 2, 16),
}
#: (warm-up, paused, back to back) steps per side; --dry-run: (1, 2, 2)
STEPS = (3, 5, 10)
PAUSE_S = 0.05
SIDES = ("pedestrian", "torch-eager", "torch-compile")


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batches(config, B: int, T: int, device, n: int = 4) -> list:
    import torch

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        s = rng.integers(0, config.vocab_size, size=(B, T + 1))
        out.append(tuple(torch.as_tensor(np.ascontiguousarray(a), device=device) for a in (s[:, :-1], s[:, 1:])))
    return out


# ---------------------------------------------------------------------------------- the sides
def pedestrian_side(config, device, dry_run: bool):
    """``(step, info, model)``: a step function of pedestrian's model on ``device``, what it ran."""
    import torch

    from bench_train import HPARAMS
    from pedestrian import GPT
    from pedestrian.training.optim import AdamW
    from pedestrian.training.step import train_step

    if device.type == "cuda":
        model = GPT(config, seed=0, dtype="float32", backend="torch", device=device)
    else:                                         # the table a GPU gets, its Triton kernels interpreted
        model = GPT(config, seed=0, dtype="float32", backend="torch", kernels="reference")
        from pedestrian.kernels import kernels_for

        table = kernels_for("fast", "cuda", "float32")
        try:
            import pedestrian.gpu as gpu

            table = gpu.table(table, interpret_ok=True)
        except (ImportError, ModuleNotFoundError, RuntimeError, AttributeError) as exc:
            print(f"  (no interpreted GPU table: {exc}; the reference table)", flush=True)
        for name, f in vars(table).items():       # in place: the model's slots hold the table
            setattr(model.kernels, name, f)
    triton = sorted(n for n, f in vars(model.kernels).items()
                    if callable(f) and getattr(f, "__module__", "").startswith("pedestrian.gpu"))
    opt = AdamW(model, **HPARAMS)

    def step(x, y) -> float:
        loss, _ = train_step(model, opt, [(x, y)], HPARAMS["lr"], grad_clip=0.0)
        return loss

    return step, {"triton_kernels": triton, "params": model.num_params(), "torch": torch.__version__}, model


def torch_side(config, device, params: dict, compiled: bool, compile_backend: str):
    """``(step, info, module)``: bench_train.py's PyTorch module (weights copied from ``params``),
    eager or through ``torch.compile``, with fused AdamW."""
    import torch

    from bench_train import build_torch_model, copy_weights_to_torch, make_torch_optimizer

    tmodel = build_torch_model(config, "sdpa")
    copy_weights_to_torch(params, tmodel, config)
    tmodel = tmodel.to(device)
    tmodel.train()
    topt, kind = make_torch_optimizer(tmodel)
    forward = torch.compile(tmodel, backend=compile_backend) if compiled else tmodel

    def step(x, y) -> float:
        topt.zero_grad(set_to_none=True)
        loss = forward(x, y)
        loss.backward()
        topt.step()
        return float(loss.detach())

    return step, {"adamw": kind, "attention": "sdpa",
                  "compile": compile_backend if compiled else None}, tmodel


def run_side(side: str, config, B: int, T: int, device, steps, dry_run: bool, compile_backend: str,
             params: dict | None) -> dict:
    """Build one side, time it, and free it; returns its record (``losses`` step by step)."""
    import torch

    on_cuda = device.type == "cuda"
    if on_cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t_build = time.perf_counter()
    if side == "pedestrian":
        step, info, model = pedestrian_side(config, device, dry_run)
    else:
        step, info, model = torch_side(config, device, params, side == "torch-compile", compile_backend)
    if side == "pedestrian":                                # the peers start from these weights
        from pedestrian.backend import to_numpy

        initial = {n: np.array(to_numpy(p.detach().cpu())) for n, p in model.params.items()}
    batches = make_batches(config, B, T, device)
    warm, paused_n, b2b_n = steps
    losses, k = [], 0
    for _ in range(warm):                                   # (compiles: Triton, inductor)
        losses.append(step(*batches[k % len(batches)]))
        k += 1
    sync(device)
    info["build_and_warm_s"] = round(time.perf_counter() - t_build, 2)
    paused = []
    for _ in range(paused_n):
        sync(device)
        time.sleep(PAUSE_S)
        t0 = time.perf_counter()
        losses.append(step(*batches[k % len(batches)]))
        sync(device)
        paused.append(time.perf_counter() - t0)
        k += 1
    sync(device)
    t0 = time.perf_counter()
    for _ in range(b2b_n):
        losses.append(step(*batches[k % len(batches)]))
        k += 1
    sync(device)
    b2b = (time.perf_counter() - t0) / max(b2b_n, 1)
    record = dict(info, side=side, paused_ms=round(statistics.median(paused) * 1e3, 3),
                  back_to_back_ms=round(b2b * 1e3, 3), losses=losses,
                  peak_mib=round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if on_cuda else None)
    if side == "pedestrian":
        record["_initial"] = initial
    del step, model
    return record


def run_config(name: str, device, dry_run: bool, compile_backend: str, sides) -> dict:
    from pedestrian.config import preset

    preset_name, overrides, B, T = (TINY if dry_run else CONFIGS)[name]
    config = preset(preset_name, **overrides)
    steps = (1, 2, 2) if dry_run else STEPS
    out = {"config": name, "B": B, "T": T, "sides": {}}
    initial = None
    for side in sides:
        print(f"{name}: {side} ...", flush=True)
        try:
            if side != "pedestrian" and initial is None:
                raise RuntimeError("the peers start from pedestrian's weights: run the pedestrian side too")
            record = run_side(side, config, B, T, device, steps, dry_run, compile_backend, initial)
            initial = record.pop("_initial", initial)
        except Exception as exc:                            # a side that cannot run is reported, not fatal
            record = {"side": side, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
        out["sides"][side] = record
        print(f"  {_summary(record)}", flush=True)
    ped = out["sides"].get("pedestrian", {}).get("losses")
    for side, r in out["sides"].items():
        if side != "pedestrian" and ped and r.get("losses"):
            r["max_loss_diff"] = float(max(abs(a - b) for a, b in zip(ped, r["losses"])))
    return out


def _summary(r: dict) -> str:
    if "error" in r:
        return f"error: {r['error']}"
    return (f"paused {r['paused_ms']:.2f} ms, back to back {r['back_to_back_ms']:.2f} ms, "
            f"peak {r['peak_mib']} MiB, first loss {r['losses'][0]:.5f}")


# ---------------------------------------------------------------------------------- report
def versions(device) -> dict:
    import torch

    info = {"torch": torch.__version__, "device": str(device), "date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["card"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU, dry run)"
    info["interpreter"] = os.environ.get("TRITON_INTERPRET", "0")
    return info


def markdown(results: list[dict], info: dict, dry_run: bool) -> str:
    lines = [f"{'Dry run (tiny shapes, CPU, Triton interpreter): checks the benchmark runs, not speed. ' if dry_run else ''}"
             f"{info['date']}, card: {info['card']}, torch {info['torch']}, triton {info['triton']}; float32; "
             f"ratios are pedestrian ÷ the peer (below 1: pedestrian faster / smaller).", "",
             "| config | B×T | side | paused ms | back to back ms | peak GPU MiB | ratio paused / b2b / memory | max abs loss diff |",
             "|---|---|---|---|---|---|---|---|"]
    for res in results:
        ped = res["sides"].get("pedestrian", {})
        for side, r in res["sides"].items():
            if "error" in r:
                lines.append(f"| {res['config']} | {res['B']}×{res['T']} | {side} | error: {r['error'][:80]} | | | | |")
                continue
            ratio = "-"
            if side != "pedestrian" and "paused_ms" in ped:
                mem = (f"{ped['peak_mib'] / r['peak_mib']:.2f}" if ped.get("peak_mib") and r.get("peak_mib") else "-")
                ratio = (f"{ped['paused_ms'] / r['paused_ms']:.2f} / {ped['back_to_back_ms'] / r['back_to_back_ms']:.2f}"
                         f" / {mem}")
            diff = f"{r['max_loss_diff']:.2g}" if "max_loss_diff" in r else "-"
            lines.append(f"| {res['config']} | {res['B']}×{res['T']} | {side} | {r['paused_ms']:.2f} | "
                         f"{r['back_to_back_ms']:.2f} | {r['peak_mib'] if r['peak_mib'] is not None else '-'} | "
                         f"{ratio} | {diff} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on the CPU, the Triton kernels under the interpreter (no GPU needed)")
    ap.add_argument("--out", type=Path, default=common.RESULTS,
                    help="folder for the JSON and Markdown files (default benchmarks/results)")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend (default: inductor on a GPU, aot_eager in a dry run)")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")       # before any Triton kernel is defined
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("bench_gpu.py: no CUDA device visible to torch; run it on a GPU, or pass --dry-run", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    backend = args.compile_backend or ("aot_eager" if args.dry_run else "inductor")
    info = versions(device)
    print(f"bench_gpu: {info}", flush=True)
    t0 = time.perf_counter()
    results = [run_config(name, device, args.dry_run, backend, args.sides) for name in args.configs]
    name = "gpu_dryrun" if args.dry_run else f"gpu_{torch.cuda.get_device_name(device).split()[-1].lower()}"
    text = markdown(results, info, args.dry_run)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps({"info": info, "compile_backend": backend, "results": results,
                                                       "seconds": round(time.perf_counter() - t0, 1)}, indent=1))
    (args.out / f"{name}.md").write_text(text)
    print(f"bench_gpu: wrote {args.out / name}.json and .md", flush=True)
    if not args.dry_run:
        common.update_doc_section("gpu", text)
    print(text)
    failed = [f"{res['config']}/{s}" for res in results for s, r in res["sides"].items() if "error" in r]
    if failed:
        print(f"bench_gpu: sides that did not run: {', '.join(failed)}", file=sys.stderr)
    return 1 if any("pedestrian" in f for f in failed) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Host synchronisations of a training step on a device, counted where they happen.

On a GPU: ``torch.cuda.set_sync_debug_mode("warn")`` around ``train_step`` (the GPU kernel table,
gradient clipping on, so that the clipping scale computed on the device is part of it): torch
warns at every operation that makes the host wait for the device (``item``, ``tolist``, a copy to
the host, ``nonzero``, ...); each warning is counted with the Python line that caused it. The
step is built to read the device once (``training/step.py``: the loss, the sums of squares and
the checks' flag as one tensor), so one synchronisation a step is the expected count; anything
more is listed by place. This is the number a CUDA graph of the step needs to be zero inside the
captured part (docs/performance.md, "GPU kernels against PyTorch eager").

``--dry-run`` (no GPU): the same step on CPU tensors (the Triton kernels under the interpreter
where the GPU table applies), every read of a tensor's values on the host counted by wrapping
torch's readers (as tests/gpu/test_sync.py does): it checks that the script runs, and counts
what a GPU would wait for.

Run::

    python3 benchmarks/count_syncs.py --out benchmarks/results     # on a GPU
    python3 benchmarks/count_syncs.py --dry-run                     # anywhere

Writes ``syncs_<card>.json`` (``syncs_dryrun.json``) to ``--out`` and prints a summary.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

#: name -> (preset, overrides, batch, context); --dry-run: TINY
CONFIGS = {
    "char-small": ("char-small", {}, 12, 64),
    "gpt2-124M": ("gpt2", {}, 8, 1024),
}
TINY = {
    "char-small": ("char-small", dict(d_model=32, n_heads=2, n_blocks=1, context_length=16), 2, 16),
    "gpt2-124M": ("gpt2", dict(vocab_size=97, d_model=32, n_heads=2, n_blocks=1, context_length=16), 2, 16),
}
STEPS = 3
_READERS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "numpy", "__array__", "nonzero")


def _caller() -> str:
    """``file:line`` of the innermost frame of the package (or the script) in the current stack."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/pedestrian/" in frame.filename or frame.filename.endswith("count_syncs.py"):
            return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


@contextlib.contextmanager
def cuda_syncs():
    """Every synchronisation torch reports in sync debug mode "warn", as ``file:line`` places."""
    import torch

    places = []
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield places
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    places += [f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}" for w in caught
               if "synchroniz" in str(w.message).lower()]


@contextlib.contextmanager
def host_reads():
    """Every read of a torch tensor's values on the host (the CPU's stand-in for a synchronisation)."""
    import torch

    places, saved, saved_nonzero = [], {n: getattr(torch.Tensor, n) for n in _READERS}, torch.nonzero

    def wrap(f):
        def read(*args, **kwargs):
            places.append(_caller())
            return f(*args, **kwargs)
        return read

    for name, f in saved.items():
        setattr(torch.Tensor, name, wrap(f))
    torch.nonzero = wrap(saved_nonzero)
    try:
        yield places
    finally:
        for name, f in saved.items():
            setattr(torch.Tensor, name, f)
        torch.nonzero = saved_nonzero


def count(name: str, device, dry_run: bool) -> dict:
    import torch

    from pedestrian import GPT
    from pedestrian.config import preset
    from pedestrian.training.optim import AdamW
    from pedestrian.training.step import train_step

    preset_name, overrides, B, T = (TINY if dry_run else CONFIGS)[name]
    config = preset(preset_name, **overrides)
    if device.type == "cuda":
        model = GPT(config, seed=0, dtype="float32", backend="torch", device=device)
    else:                                                # the GPU's table, its Triton kernels interpreted
        from pedestrian.gpu import table
        from pedestrian.kernels import kernels_for

        model = GPT(config, seed=0, dtype="float32", backend="torch", kernels="reference")
        for fname, f in vars(table(kernels_for("fast", "cuda", "float32"), interpret_ok=True)).items():
            setattr(model.kernels, fname, f)             # in place: the model's slots hold the table
    optimizer = AdamW(model, lr=1e-3, weight_decay=0.1)
    rng = np.random.default_rng(0)

    def batch():
        x, y = rng.integers(0, config.vocab_size, (2, B, T))
        return torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)

    train_step(model, optimizer, [batch()], 1e-3, grad_clip=1.0)     # warm: compiles
    batches = [batch() for _ in range(STEPS)]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    counter = host_reads if dry_run else cuda_syncs
    per_step = []
    for x, y in batches:
        with counter() as places:
            train_step(model, optimizer, [(x, y)], 1e-3, grad_clip=1.0)
        per_step.append(places)
    where = collections.Counter(p for places in per_step for p in places)
    return {"config": name, "B": B, "T": T, "steps": STEPS, "grad_clip": 1.0,
            "adamw_kernel": optimizer.kernel_pass(),
            "syncs_per_step": [len(p) for p in per_step], "places": dict(where.most_common())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--dry-run", action="store_true", help="CPU tensors, Triton's interpreter, tiny shapes")
    ap.add_argument("--out", type=Path, default=common.RESULTS)
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")       # before any Triton kernel is defined
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("count_syncs.py: no CUDA device visible to torch; run it on a GPU, or pass --dry-run", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    card = "dryrun" if args.dry_run else torch.cuda.get_device_name(device).split()[-1].lower()
    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
               "card": "none (CPU, dry run: host reads counted)" if args.dry_run else torch.cuda.get_device_name(device),
               "configs": [count(name, device, args.dry_run) for name in args.configs]}
    for r in results["configs"]:
        print(f"count_syncs: {r['config']} {r['B']}x{r['T']}: synchronisations per step {r['syncs_per_step']} "
              f"(AdamW kernel: {r['adamw_kernel']}); where: {r['places']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"syncs_{card}.json"
    path.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"count_syncs: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

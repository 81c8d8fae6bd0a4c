"""End to end against nanoGPT: its README's CPU recipe, and ``pedestrian train`` with the same settings.

Takes a checkout of nanoGPT (github.com/karpathy/nanoGPT) and the tiny Shakespeare text its
``data/shakespeare_char/prepare.py`` would download (github.com/karpathy/char-rnn,
``data/tinyshakespeare/input.txt``); runs nothing of nanoGPT's but its own scripts, in a copy:

1. ``prepare.py`` (untimed), then nanoGPT's README CPU recipe, timed as a whole process::

       python train.py config/train_shakespeare_char.py --device=cpu --compile=False \\
           --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 \\
           --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0

   plus ``--always_save_checkpoint=True --out_dir=…`` so that its final model is on disk;
2. ``pedestrian train`` with the same model (4 blocks of 128, 4 heads, context 64, exact GELU, no
   biases, tied embedding, layer-norm eps 1e-5), data (the same text, character tokenizer, last
   10 % held out), batches (12), schedule (2,000 steps, lr 1e-3 → 1e-4 cosine, 100 warm-up
   steps, AdamW β = (0.9, 0.99), weight decay 0.1 on matrices, clipping at 1.0) and evaluation
   (every 250 steps on 20 batches), timed as a whole process;
3. both final models on the whole validation split, every target counted once (consecutive
   non-overlapping windows of the context length: ``pedestrian eval``'s convention; nanoGPT's
   model through its own ``model.py``).

Needs torch and requests (nanoGPT's ``prepare.py`` imports it; nothing is downloaded: the text is
put where it looks first).

``--long``: the same at context 1024, batch 1, 200 steps (``--block_size=1024 --batch_size=1
--max_iters=200 --lr_decay_iters=200``; 20 warm-up steps, evaluation every 50 on 5 batches).

Both runs use every core (PyTorch's threads; pedestrian's own rule); they alternate when
``--rounds`` > 1. Prints one table and writes ``benchmarks/results/nanogpt[_long].json`` / ``.md``.

    python3 benchmarks/bench_nanogpt.py --nanogpt ~/src/nanoGPT --text ~/src/char-rnn/data/tinyshakespeare/input.txt
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]

RECIPES = {
    # name: nanoGPT overrides of the README CPU recipe, and pedestrian's matching settings
    "readme": (dict(block_size=64, batch_size=12, max_iters=2000, lr_decay_iters=2000, eval_iters=20),
               dict(context_length=64, batch_size=12, max_steps=2000, warmup_steps=100, eval_interval=250,
                    eval_batches=20)),
    "long": (dict(block_size=1024, batch_size=1, max_iters=200, lr_decay_iters=200, eval_iters=5,
                  warmup_iters=20, eval_interval=50),
             dict(context_length=1024, batch_size=1, max_steps=200, warmup_steps=20, eval_interval=50,
                  eval_batches=5)),
}

#: nanoGPT's whole-validation loss of its checkpoint, run inside the nanoGPT copy with its model.py
_NANOGPT_EVAL = r"""
import sys, numpy as np, torch
from model import GPTConfig, GPT
ckpt = torch.load(sys.argv[1], map_location="cpu")
model = GPT(GPTConfig(**ckpt["model_args"]))
state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
model.load_state_dict(state); model.eval()
val = np.fromfile(sys.argv[2], dtype=np.uint16).astype(np.int64)
T = ckpt["model_args"]["block_size"]
total, count = 0.0, 0
with torch.no_grad():
    starts = list(range(0, (len(val) - 1) // T * T, T))
    if (len(val) - 1) % T:
        starts.append((len(val) - 1) // T * T)
    for s in starts:
        x = torch.from_numpy(val[s:min(s + T, len(val) - 1)])[None]
        y = torch.from_numpy(val[s + 1:min(s + T, len(val) - 1) + 1])[None]
        logits, loss = model(x, y)
        total += float(loss) * y.numel(); count += y.numel()
print(total / count, count)
"""


def run_nanogpt(checkout: Path, text: Path, work: Path, recipe: str) -> dict:
    """nanoGPT's README CPU recipe in a copy of ``checkout``; wall seconds and whole-val loss."""
    copy = work / "nanoGPT"
    if not copy.exists():
        shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git"))
        shutil.copy(text, copy / "data" / "shakespeare_char" / "input.txt")
        subprocess.run([sys.executable, "data/shakespeare_char/prepare.py"], cwd=copy, check=True,
                       capture_output=True)
    out = work / f"nanogpt-out-{recipe}"
    shutil.rmtree(out, ignore_errors=True)
    overrides = dict(RECIPES[recipe][0])
    args = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--log_interval=1",
            "--n_layer=4", "--n_head=4", "--n_embd=128", "--dropout=0.0",
            "--always_save_checkpoint=True", f"--out_dir={out}"]
    args += [f"--{k}={v}" for k, v in overrides.items()]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=copy, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"nanoGPT failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    last_val = re.findall(r"val loss ([0-9.]+)", proc.stdout)
    ev = subprocess.run([sys.executable, "-c", _NANOGPT_EVAL, str(out / "ckpt.pt"),
                         str(copy / "data" / "shakespeare_char" / "val.bin")],
                        cwd=copy, capture_output=True, text=True, check=True)
    loss, count = ev.stdout.split()[-2:]                      # (its model prints its size first)
    return dict(seconds=seconds, val_loss=float(loss), targets=int(count),
                logged_val_loss=float(last_val[-1]) if last_val else None)


def run_pedestrian(text: Path, work: Path, recipe: str) -> dict:
    """``pedestrian train`` with the recipe's settings; wall seconds and whole-val loss."""
    out = work / f"pedestrian-out-{recipe}"
    shutil.rmtree(out, ignore_errors=True)
    s = RECIPES[recipe][1]
    args = ["--data", text, "--tokenizer", "char", "--n-blocks", 4, "--n-heads", 4, "--d-model", 128,
            "--context-length", s["context_length"], "--activation", "gelu", "--no-bias", "--ln-eps", 1e-5,
            "--dropout", 0, "--batch-size", s["batch_size"], "--max-steps", s["max_steps"], "--lr", 1e-3,
            "--min-lr", 1e-4, "--warmup-steps", s["warmup_steps"], "--beta1", 0.9, "--beta2", 0.99,
            "--weight-decay", 0.1, "--grad-clip", 1.0, "--eval-interval", s["eval_interval"],
            "--eval-batches", s["eval_batches"], "--max-minutes", 0, "--out", out,
            "--no-progress", "--no-plot", "--no-sample"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pedestrian", "train", *map(str, args)], env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"pedestrian failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    ev = subprocess.run([sys.executable, "-m", "pedestrian", "eval", str(out / "latest"), "--no-progress"],
                        env=env, capture_output=True, text=True, check=True)
    loss = float(re.search(r"([0-9]+\.[0-9]+) nats", ev.stdout + ev.stderr).group(1))
    return dict(seconds=seconds, val_loss=loss)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--text", type=Path, help="tiny Shakespeare (char-rnn's input.txt); default: the one "
                                                    "in the checkout's data/shakespeare_char/, if present")
    parser.add_argument("--long", action="store_true", help="context 1024, batch 1, 200 steps")
    parser.add_argument("--rounds", type=int, default=1, help="alternating runs of each side")
    args = parser.parse_args(argv)
    text = args.text or args.nanogpt / "data" / "shakespeare_char" / "input.txt"
    if not text.is_file():
        parser.error(f"no tiny Shakespeare text at {text}; pass --text (char-rnn's data/tinyshakespeare/input.txt)")
    if not (args.nanogpt / "train.py").is_file():
        parser.error(f"{args.nanogpt} is not a nanoGPT checkout (no train.py)")
    recipe = "long" if args.long else "readme"
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_nanogpt_") as tmp:
        work = Path(tmp)
        for r in range(args.rounds):
            sides = [("nanoGPT", lambda: run_nanogpt(args.nanogpt, text, work, recipe)),
                     ("pedestrian", lambda: run_pedestrian(text, work, recipe))]
            for name, job in (sides if r % 2 == 0 else sides[::-1]):
                result = job()
                rows.append(dict(side=name, round=r, **result))
                print(f"round {r} {name}: {result['seconds']:.1f} s, whole-validation loss {result['val_loss']:.4f}",
                      flush=True)
    import statistics

    def med(side, key):
        return statistics.median(x[key] for x in rows if x["side"] == side)

    ratio = med("pedestrian", "seconds") / med("nanoGPT", "seconds")
    table = ["| side | wall s (median) | whole-validation loss |", "|---|---|---|"]
    table += [f"| {s} | {med(s, 'seconds'):.1f} | {med(s, 'val_loss'):.4f} |" for s in ("nanoGPT", "pedestrian")]
    table.append(f"\npedestrian ÷ nanoGPT wall time: **{ratio:.2f}** ({recipe} recipe, {args.rounds} round(s))")
    print("\n".join(table))
    RESULTS.mkdir(exist_ok=True)
    stem = "nanogpt" + ("_long" if args.long else "")
    (RESULTS / f"{stem}.json").write_text(json.dumps(dict(recipe=recipe, rows=rows, ratio=ratio), indent=1))
    (RESULTS / f"{stem}.md").write_text("\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

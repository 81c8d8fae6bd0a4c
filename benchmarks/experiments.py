"""Shared by the training experiments (arch_experiment.py, position_experiment.py): running the
command line, reading a run's log and whole-split evaluation, the loss-curve picture and the
results section of a docs page.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- results:start -->", "<!-- results:end -->"


def pedestrian(*args: str) -> tuple[str, float]:
    """Run ``python -m pedestrian ARGS`` with this checkout's code; return its stdout and the CPU
    seconds (user + system) it used."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-m", "pedestrian", *args], env=env, text=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"pedestrian {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def evaluate(folder: Path) -> dict:
    """``pedestrian eval`` of ``folder``'s latest checkpoint on the whole held-out split: its
    ``step``, ``val_loss_full_split`` (nats per character) and ``val_targets``."""
    text, _ = pedestrian("eval", str(folder / "latest"), "--no-progress")
    m = re.search(r"step (\d+)\): val loss ([0-9.]+) nats per character .* over ([0-9,]+) targets", text)
    if m is None:
        raise SystemExit(f"cannot read the eval output: {text!r}")
    return {"step": int(m.group(1)), "val_loss_full_split": float(m.group(2)),
            "val_targets": int(m.group(3).replace(",", ""))}


def curves(log: list[dict]) -> dict:
    """A run's ``val_curve`` and ``train_curve`` (``(step, loss)`` pairs) and its ``minutes`` (the
    run's own clock), from its ``log.jsonl`` records."""
    return {"val_curve": [(r["step"], r["val_loss"]) for r in log if "val_loss" in r],
            "train_curve": [(r["step"], r["loss"]) for r in log if "loss" in r],
            "minutes": max(r["time_s"] for r in log if "time_s" in r) / 60}


def seeds_of(results: list[dict]) -> list[int]:
    """The seeds of ``results``, in their first order."""
    return sorted({r["seed"] for r in results}, key=[r["seed"] for r in results].index)


def plot(results: list[dict], path: Path, max_steps: int, key: str, colors: dict, label, title: str) -> None:
    """Validation (dots) and smoothed training loss of every run; the first seed solid, the
    others dashed; the right panel zooms into the second half. Runs are told apart by
    ``r[key]`` (colour ``colors[r[key]]``); ``label(r, mean, seeds)`` names a variant in the legend
    (``mean``: its whole-split validation loss over the seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    seeds = seeds_of(results)
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(11.5, 4.6), dpi=130, gridspec_kw={"width_ratios": [3, 2]})
    tail = []
    for r in results:
        color, first = colors[r[key]], r["seed"] == seeds[0]
        s, loss = np.array(r["train_curve"]).T
        w = max(1, min(50, len(loss) // 5))
        smooth = np.convolve(loss, np.ones(w) / w, mode="valid")
        vs, vl = np.array(r["val_curve"]).T
        mean = np.mean([q["val_loss_full_split"] for q in results if q[key] == r[key]])
        for a in (ax, zoom):
            if first:
                a.plot(s[w - 1:], smooth, color=color, lw=0.8, alpha=0.4)
            a.plot(vs, vl, "o-" if first else "s--", color=color, ms=3.5 if first else 2.5, lw=1.6 if first else 1.0,
                   label=label(r, mean, seeds) if first else None)
        tail += [v for st, v in zip(vs, vl) if st >= max_steps * 0.5]
        tail += [v for st, v in zip(s[w - 1:], smooth) if st >= max_steps * 0.5 and first]
    for a in (ax, zoom):
        a.set_xlabel("optimizer step")
        a.set_ylabel("loss (nats per character)")
        a.grid(alpha=0.3)
    others = ", ".join(str(x) for x in seeds[1:])
    ax.set_title(f"validation, 20 fixed batches (dots: seed {seeds[0]}"
                 + (f"; dashed: seed {others}" if others else "") + "); training, 50-step mean (faint)", fontsize=9)
    ax.legend(fontsize=8.5)
    zoom.set_xlim(max_steps * 0.5, max_steps * 1.02)
    zoom.set_ylim(min(tail) - 0.02, max(tail) + 0.02)
    zoom.set_title("second half, zoomed", fontsize=9)
    fig.suptitle(title, fontsize=10.5)
    fig.tight_layout()
    tmp = path.with_name(".tmp-" + path.name)
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)


def commands(results: list[dict], picture: str) -> list[str]:
    """The end of a results section: every run's command and its evaluation in a bash block, then
    the picture ``picture`` (a path relative to the page)."""
    lines = ["```bash"]
    for r in results:
        lines += [r["command"], f"pedestrian eval {r['folder']}/latest"]
    return lines + ["```", "", f"![loss curves]({picture})"]


def write_results(doc: Path, heading: str, table: str) -> None:
    """Put ``table`` between ``doc``'s results markers (a new page titled ``heading`` if ``doc``
    does not exist); the text around the markers is kept."""
    text = doc.read_text(encoding="utf-8") if doc.exists() else f"# {heading}\n\n{START}\n{END}\n"
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(head + START + "\n" + table + "\n" + END + tail, encoding="utf-8")

"""Training runs that one process and each rank of a ``torchrun`` job compute the same way.

:func:`run` trains a tiny GPT for :data:`STEPS` AdamW steps per scenario (dtype, dropout,
gradient accumulation) with :class:`pedestrian.loop.Trainer` in the given process group: every
rank draws the same global batches and computes its rows. ``tests/system/test_distributed.py``
runs it in one process and as two ranks (this file is the ranks' script:
``torchrun --nproc-per-node 2 dist_scenarios.py OUT``, each rank writing ``OUT.rank<r>``).
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

CFG = dict(vocab_size=13, context_length=8, d_model=12, n_heads=2, n_blocks=2)
#: (dtype, dropout, micro-batches per step)
SCENARIOS = [(dtype, dropout, k) for dtype in ("float64", "float32") for dropout, k in ((0.0, 1), (0.2, 1), (0.2, 3))]
STEPS = 20
BATCH = 5                 # odd: ranks of 2 and 3 rows


def _batches(rng: np.random.Generator, k: int) -> list:
    out = []
    for _ in range(k):
        x = rng.integers(0, CFG["vocab_size"], (BATCH, CFG["context_length"]))
        y = rng.integers(0, CFG["vocab_size"], (BATCH, CFG["context_length"]))
        y[0, :5] = -100                        # rank 0 counts fewer targets: n_total matters
        out.append((x, y))
    return out


def run(group) -> dict:
    """``{"dtype dropout k": {"losses": [...], "params_sha256": ...}}`` for every scenario."""
    from pedestrian.config import GPTConfig
    from pedestrian.loop import Trainer
    from pedestrian.model import GPT
    from pedestrian.optim import AdamW, CosineSchedule

    results = {}
    for dtype, dropout, k in SCENARIOS:
        model = GPT(GPTConfig(**CFG, dropout=dropout), seed=5, dtype=dtype)
        optimizer = AdamW(model, lr=1e-2, weight_decay=0.1)
        data_rng = np.random.default_rng(7)
        trainer = Trainer(model, optimizer, CosineSchedule(1e-2, 2, STEPS, 1e-3), lambda: _batches(data_rng, k),
                          step=0, end=STEPS, grad_clip=1.0, group=group, dropout_seed=11)
        losses = []
        trainer.on("step_end", lambda t: losses.append(t.loss))
        assert trainer.run() == "max_steps"
        flat = np.ascontiguousarray(model.flat)
        results[f"{dtype} {dropout} {k}"] = {"losses": losses,
                                             "params_sha256": hashlib.sha256(flat.tobytes()).hexdigest()}
    return results


if __name__ == "__main__":
    from pedestrian.distributed import process_group

    group = process_group("cpu", timeout=60)
    try:
        with open(f"{sys.argv[1]}.rank{group.rank}", "w", encoding="utf-8") as fh:
            json.dump({"world_size": group.world_size, "results": run(group)}, fh)
    finally:
        group.close()

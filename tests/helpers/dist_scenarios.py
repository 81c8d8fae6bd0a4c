"""Training runs that one process and each rank of a ``torchrun`` job compute the same way.

:func:`run` trains a tiny GPT for :data:`STEPS` AdamW steps per scenario (dtype, dropout,
gradient accumulation) with :class:`pedestrian.training.loop.Trainer` in the given process group: every
rank draws the same global batches and computes its rows. :func:`accumulation` takes one step of
micro-batches whose ignored targets differ per micro-batch and per rank, and one of their
concatenation. ``tests/system/test_distributed.py`` runs both in one process and as two ranks
(this file is the ranks' script:
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
    from pedestrian.training.loop import Batches, Optimization, StopRules, Trainer
    from pedestrian.model import GPT
    from pedestrian.training.optim import AdamW, CosineSchedule

    results = {}
    for dtype, dropout, k in SCENARIOS:
        model = GPT(GPTConfig(**CFG, dropout=dropout), seed=5, dtype=dtype)
        optimizer = AdamW(model, lr=1e-2, weight_decay=0.1)
        data_rng = np.random.default_rng(7)
        trainer = Trainer(model, Optimization(optimizer, CosineSchedule(1e-2, 2, STEPS, 1e-3), grad_clip=1.0),
                          Batches(lambda: _batches(data_rng, k), dropout_seed=11), StopRules(end=STEPS), group=group)
        losses = []
        trainer.on("step_end", lambda t: losses.append(t.loss))
        assert trainer.run() == "max_steps"
        flat = np.ascontiguousarray(model.flat)
        results[f"{dtype} {dropout} {k}"] = {"losses": losses,
                                             "params_sha256": hashlib.sha256(flat.tobytes()).hexdigest()}
    return results


#: :func:`accumulation`'s micro-batches: targets ignored in rows ``0:2`` (rank 0's of 2) and
#: ``2:5`` (rank 1's) of each; micro-batch 1 counts nothing, rank 0 nothing in micro-batch 0
ACCUM_IGNORED = [(16, 3), (16, 24), (5, 20)]


def accumulation(group) -> dict:
    """One float64 AdamW step (clipped) of 3 micro-batches of :data:`BATCH` rows whose ignored
    targets differ per micro-batch and per rank (:data:`ACCUM_IGNORED`), and the step of their
    concatenation (15 rows, split over the ranks differently), from the same warm state.

    Returns ``{"micro": [loss, norm], "one": [loss, norm], "weights_rel": r}``, ``r`` the largest
    per-tensor ``max|Δθ| / max|θ|`` between the two results.
    """
    from pedestrian.config import GPTConfig
    from pedestrian.training.loop import train_step
    from pedestrian.model import GPT
    from pedestrian.training.optim import AdamW

    rng = np.random.default_rng(3)
    T = CFG["context_length"]
    micro = []
    for ignored in ACCUM_IGNORED:
        x = rng.integers(0, CFG["vocab_size"], (BATCH, T))
        y = rng.integers(0, CFG["vocab_size"], (BATCH, T))
        for (lo, hi), n in zip(((0, 2), (2, BATCH)), ignored):
            part = y[lo:hi].reshape(-1)
            part[rng.choice(part.size, size=n, replace=False)] = -100
        micro.append((x, y))
    one = [(np.concatenate([x for x, _ in micro]), np.concatenate([y for _, y in micro]))]
    warm = [[(rng.integers(0, 13, (BATCH, T)), rng.integers(0, 13, (BATCH, T)))] for _ in range(2)]
    out, weights = {}, []
    for name, batches in (("micro", micro), ("one", one)):
        # no q/k/v biases: the key bias's gradient is 0 in exact arithmetic, rounding noise only
        model = GPT(GPTConfig(**CFG, qkv_bias=False), seed=5, dtype="float64")
        optimizer = AdamW(model, lr=1e-2, weight_decay=0.1)
        for w in warm:                             # non-zero moments: the update depends on |g|
            train_step(model, optimizer, w, 1e-2, grad_clip=1.0, group=group)
        out[name] = list(train_step(model, optimizer, batches, 1e-2, grad_clip=0.1, group=group))
        weights.append({k: np.array(v) for k, v in model.params.items()})
    out["weights_rel"] = max(float(np.max(np.abs(weights[0][k] - w)) / np.max(np.abs(w)))
                             for k, w in weights[1].items())
    return out


if __name__ == "__main__":
    from pedestrian.training.distributed import process_group

    group = process_group("cpu", timeout=60)
    try:
        with open(f"{sys.argv[1]}.rank{group.rank}", "w", encoding="utf-8") as fh:
            json.dump({"world_size": group.world_size, "results": run(group),
                       "accumulation": accumulation(group)}, fh)
    finally:
        group.close()

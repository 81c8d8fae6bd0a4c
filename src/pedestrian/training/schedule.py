"""The learning-rate schedule of a training run: linear warm-up, then cosine decay (re-exported by
:mod:`pedestrian.training.optim`, which steps AdamW with it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CosineSchedule"]


@dataclass(frozen=True)
class CosineSchedule:
    """Linear warm-up, then cosine decay to ``min_lr`` (GPT-2 / nanoGPT style).

    For update index ``it = 0, 1, …`` (the ``it``-th call of :meth:`AdamW.step`)::

        it < warmup_steps:         lr = max_lr · (it + 1) / warmup_steps    (never 0)
        warmup_steps <= it < max:  p = (it − warmup_steps) / (max_steps − warmup_steps)
                                   lr = min_lr + ½ (max_lr − min_lr) (1 + cos(π p))
        it >= max_steps:           lr = min_lr

    So the first update already uses ``max_lr / warmup_steps`` and the last warm-up update
    ``max_lr`` itself.

    The values are taken as given: a run's come from its settings, where each is declared and
    validated once (``--lr``, ``--min-lr``, ``--warmup-steps``, ``--max-steps``:
    :mod:`pedestrian.training.specs`); meaningful ones are ``max_lr > 0``, ``0 <= min_lr <= max_lr``,
    ``warmup_steps >= 0``, ``max_steps >= 1``.
    """

    max_lr: float
    warmup_steps: int
    max_steps: int
    min_lr: float = 0.0

    def __call__(self, it: int) -> float:
        if it < self.warmup_steps:
            return self.max_lr * (it + 1) / self.warmup_steps
        if it >= self.max_steps:
            return self.min_lr
        span = max(self.max_steps - self.warmup_steps, 1)
        progress = (it - self.warmup_steps) / span
        return self.min_lr + 0.5 * (self.max_lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))

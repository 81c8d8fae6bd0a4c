"""Numbers that are not finite: one counter, one report, one JSON rule.

Every place that refuses or reports a NaN or an infinity -- loading weights, saving a
checkpoint, the training loop's state check, the optimizer's loader -- names the tensors the
same way, ``blocks.0.ln1.weight (1 NaN, 0 inf of 768 values)``, through :func:`non_finite_report`.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from ..backend import to_numpy

__all__ = ["non_finite_counts", "non_finite_report", "finite_or_none"]


def non_finite_counts(tensors: Mapping[str, object]) -> dict[str, tuple[int, int]]:
    """``{name: (n_nan, n_inf)}`` of the floating-point tensors that hold a NaN or ±inf.

    Args:
        tensors: name -> array (NumPy, torch, or anything :func:`~pedestrian.backend.to_numpy`
            takes); integer arrays are skipped.
    """
    bad = {}
    for name, a in tensors.items():
        a = np.asarray(to_numpy(a))
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            n_nan = int(np.count_nonzero(np.isnan(a)))
            bad[name] = (n_nan, int(a.size - n_nan - np.count_nonzero(np.isfinite(a))))
    return bad


def non_finite_report(counts: Mapping[str, tuple[int, int]], tensors: Mapping[str, object],
                      limit: int | None = 5) -> str:
    """``"ln_final.bias (1 NaN, 0 inf of 8 values), …"`` for :func:`non_finite_counts`' result
    (``tensors``: the arrays counted, for their sizes): the first ``limit`` tensors (``None``:
    all), then how many more."""
    items = list(counts.items())
    shown = items if limit is None else items[:limit]
    text = ", ".join(f"{name} ({n_nan} NaN, {n_inf} inf of {math.prod(np.shape(tensors[name]))} values)"
                     for name, (n_nan, n_inf) in shown)
    return text + (f" and {len(items) - len(shown)} more tensor(s)" if len(shown) < len(items) else "")


def finite_or_none(x: float) -> float | None:
    """``x`` as a float, or ``None`` when it is NaN or ±inf (the JSON logs are strict JSON)."""
    return float(x) if math.isfinite(x) else None

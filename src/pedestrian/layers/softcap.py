"""Soft-capping, ``y = c · tanh(z / c)`` elementwise (Gemma 2's ``final_logit_softcapping`` on the
logits, after the head and before the loss; EQUATIONS.md "Gemma: soft-capping").

Every ``y`` lies in ``(−c, c)``; near 0 the cap is the identity (``tanh u ≈ u``), far out it
saturates. Backward: ``∂y/∂z = 1 − tanh²(z / c) = 1 − (y / c)²``, so ``Δ_in = Δ ∘ (1 − (y/c)²)``;
the cap ``c`` is a constant (no gradient). The cache keeps the input ``z`` (a loss may write its
``Δ`` over the output ``y``: :mod:`pedestrian.model.recompute`) and the backward forms ``tanh``
again.

Reference implementation: the paper's math only, written against the array API standard.
"""

from __future__ import annotations

import math

from ..backend import array_namespace
from .checks import check_float


def check_softcap(cap) -> None:
    """Raises ``ValueError`` unless ``cap`` is a finite number ``> 0``."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"the soft-cap c must be a finite number > 0 (Gemma 2: 30 on the logits), got {cap!r}")


def softcap_forward(z, cap: float):
    """``y = c · tanh(z / c)`` entry by entry.

    Args:
        z: float array of any shape (the head's logits ``(B, T, V)``).
        cap: ``c > 0``.

    Returns:
        ``(y, cache)``: ``y`` of ``z``'s shape, in ``(−c, c)``; ``cache = (z, c)``.

    Raises:
        ValueError: ``c`` not a finite number ``> 0``. TypeError: ``z`` not real floating point.
    """
    check_softcap(cap)
    check_float(z, "the soft-cap's input")
    xp = array_namespace(z)
    return cap * xp.tanh(z / cap), (z, cap)                                  # (..., V)


def softcap_backward(delta, cache):
    """``Δ_in = Δ ∘ (1 − tanh²(z / c))``.

    Args:
        delta: the signal at ``y``, ``z``'s shape; cache: from :func:`softcap_forward`.

    Returns:
        ``Δ_in``, ``z``'s shape.
    """
    xp = array_namespace(delta)
    z, cap = cache
    t = xp.tanh(z / cap)                                                     # (..., V) y / c
    return delta * (1.0 - t * t)                                             # (..., V)

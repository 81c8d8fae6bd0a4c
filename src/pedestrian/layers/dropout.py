"""Inverted dropout (not in the paper; nanoGPT / GPT-2 placement, off by default)."""

from __future__ import annotations

import numpy as np

from ..backend import array_namespace, asarray_like


def dropout_forward(x, p: float, rng: np.random.Generator):
    """Zero each entry with probability ``p`` and scale survivors by ``1/(1-p)``.

    Args:
        x: float array, any shape.
        p: drop probability in ``[0, 1)``; ``0`` returns ``x`` unchanged (``cache = None``).
        rng: seeded NumPy generator; the mask is drawn in NumPy (so both backends draw the
            same mask from the same seed) and moved to ``x``'s namespace.

    Returns:
        ``(y, mask)`` where ``mask`` already holds the ``1/(1-p)`` scale, or ``None``.

    Raises:
        ValueError: ``p`` outside ``[0, 1)``.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if p == 0.0:
        return x, None
    xp = array_namespace(x)
    keep = rng.random(tuple(x.shape)) >= p                                   # NumPy bools
    mask = xp.astype(asarray_like(keep, x), x.dtype) * (1.0 / (1.0 - p))    # kept / (1 - p)
    return x * mask, mask


def dropout_backward(delta, mask):
    """``Δ_in = Δ ∘ mask`` (the same scaled mask as the forward); identity when ``mask is None``."""
    return delta if mask is None else delta * mask

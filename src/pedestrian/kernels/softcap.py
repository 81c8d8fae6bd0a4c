"""Fast kernels for soft-capping (reference: :mod:`pedestrian.layers.softcap`).

NumPy arrays: one numba pass per direction, ``tanh`` formed in float64 (for float32 entries too,
rounded once when stored). :func:`cap_rows` caps a chunk of logits in place and writes the slope
``1 − tanh²`` beside it, for the fused head (:mod:`.head_loss`), whose ``Δ12`` is written over
the logits.
"""

from __future__ import annotations

import math

import numpy as np

from ..layers.checks import check_float
from ..layers.softcap import check_softcap
from .jit import kernel, prange
from .workspace import empty_array

__all__ = ["cap_in_place", "cap_rows", "softcap_backward", "softcap_forward"]


@kernel(parallel=True)
def _forward(z, cap, y):
    """``y = c · tanh(z / c)``."""
    for i in prange(z.shape[0]):
        y[i] = cap * math.tanh(z[i] / cap)


@kernel(parallel=True)
def _backward(delta, z, cap, out):
    """``Δ_in = Δ ∘ (1 − tanh²(z / c))``."""
    for i in prange(z.shape[0]):
        t = math.tanh(z[i] / cap)
        out[i] = delta[i] * (1.0 - t * t)


@kernel(parallel=True)
def cap_rows(z, cap, slope):
    """In place over ``z`` ``(n, V)``: ``z ← c · tanh(z / c)``, and ``slope ← 1 − tanh²(z / c)``."""
    for r in prange(z.shape[0]):
        for j in range(z.shape[1]):
            t = math.tanh(z[r, j] / cap)
            z[r, j] = cap * t
            slope[r, j] = 1.0 - t * t


@kernel(parallel=True)
def cap_in_place(z, cap):
    """``z ← c · tanh(z / c)`` in place over ``z`` ``(n, V)`` (an evaluation: no slope kept)."""
    for r in prange(z.shape[0]):
        for j in range(z.shape[1]):
            z[r, j] = cap * math.tanh(z[r, j] / cap)


def _flat(a):
    return np.ascontiguousarray(a).reshape(-1)


def softcap_forward(z, cap: float):
    """``y = c · tanh(z / c)`` (EQUATIONS.md, "Gemma: soft-capping").

    Fast :func:`pedestrian.layers.softcap.softcap_forward` (same arguments, results and errors)."""
    check_softcap(cap)
    check_float(z, "the soft-cap's input")
    y = empty_array(z.shape, z)
    _forward(_flat(z), float(cap), y.reshape(-1))
    return y, (z, cap)


def softcap_backward(delta, cache):
    """``Δ_in = Δ ∘ (1 − tanh²(z / c))`` (EQUATIONS.md, "Gemma: soft-capping").

    Fast :func:`pedestrian.layers.softcap.softcap_backward`."""
    z, cap = cache
    out = empty_array(z.shape, z)
    _backward(_flat(delta), _flat(z), float(cap), out.reshape(-1))
    return out

"""Fast kernels for RMS normalization (reference: :mod:`pedestrian.layers.rmsnorm`).

NumPy arrays: the layer norm's loops (:mod:`.layernorm`) without the mean -- the forward walks
each row once for ``Σ x²`` and once for ``x̂``, ``y``; the backward once for ``Σ g ∘ x̂`` and once
for ``Δ_in``, while ``dw`` accumulates per block of :data:`.schedule.NORM_BLOCK_ROWS` rows (the same
bits for any thread count). Sums in float64 (for float32 rows too); ``x̂`` is rounded to the
input dtype before ``∘ w``, Hugging Face's order. The cache holds ``1/r`` in float64.
"""

from __future__ import annotations

import math

import numpy as np

from ..layers.rmsnorm import check_rms_eps
from .jit import kernel, prange
from .schedule import NORM_BLOCK_ROWS
from .workspace import empty_array


@kernel(parallel=True)
def _forward(x, weight, eps, y, xhat, rrms):
    """Per row: ``1/r = 1/sqrt(Σx²/d + eps)``, ``x̂ = x/r``, ``y = x̂ ∘ w``."""
    n, d = x.shape
    T = x.dtype.type
    for r in prange(n):
        s = 0.0
        for j in range(d):
            v = np.float64(x[r, j])
            s += v * v
        inv = 1.0 / math.sqrt(s / d + eps)
        rrms[r] = inv
        for j in range(d):
            h = T(x[r, j] * inv)
            xhat[r, j] = h
            y[r, j] = h * weight[j]


#: :func:`_forward` on one thread, for a kernel that calls it (:mod:`pedestrian.kernels.decode`)
forward_rows = _forward.serial


@kernel(parallel=True)
def _backward(delta, xhat, rrms, weight, out, dw_part):
    """Per row: ``g = Δ ∘ w``, ``Δ_in = (g − x̂ ∘ mean(g ∘ x̂)) / r``; per block of rows
    ``Σ x̂ ∘ Δ`` into its row of ``dw_part``."""
    n, d = delta.shape
    for b in prange(dw_part.shape[0]):
        for j in range(d):
            dw_part[b, j] = 0.0
        for r in range(b * NORM_BLOCK_ROWS, min(n, (b + 1) * NORM_BLOCK_ROWS)):
            sgx = 0.0
            for j in range(d):
                dx = np.float64(delta[r, j]) * xhat[r, j]
                sgx += dx * weight[j]
                dw_part[b, j] += dx
            mean_gx = sgx / d
            inv = rrms[r]
            for j in range(d):
                out[r, j] = (np.float64(delta[r, j]) * weight[j] - xhat[r, j] * mean_gx) * inv


def rmsnorm_forward(x, weight, eps: float, *, offset: float = 0.0):
    """``y = x/r ∘ (offset + w)``, ``r = √(mean_f(x²) + ε)`` over the last axis (EQUATIONS.md, "RMS
    normalization"; ``offset = 1``: Gemma).

    Fast :func:`pedestrian.layers.rmsnorm.rmsnorm_forward` (same arguments and results; the
    cache holds ``1/r`` in float64; ``offset + w`` is formed once, ``(d,)``, in ``w``'s dtype)."""
    check_rms_eps(eps)
    if offset != 0:
        weight = offset + weight                                             # (d,) rounded once, as Gemma
    d = x.shape[-1]
    x2 = np.ascontiguousarray(x).reshape(-1, d)
    xhat, y = empty_array(x.shape, x), empty_array(x.shape, x)
    rrms = np.empty((*x.shape[:-1], 1), np.float64)
    _forward(x2, weight, float(eps), y.reshape(-1, d), xhat.reshape(-1, d), rrms.reshape(-1))
    return y, (xhat, rrms, weight)


def rmsnorm_backward(delta, cache, *, dweight=None):
    """``Δ_in = (1/r)(g − x̂ ∘ mean_f(g ∘ x̂))``, ``g = Δ ∘ w``; ``dw = Σ_tokens Δ ∘ x̂`` (EQUATIONS.md,
    "RMS normalization").

    Fast :func:`pedestrian.layers.rmsnorm.rmsnorm_backward` (same arguments and result):
    ``Δ_in = (g − x̂ ∘ mean_f(g ∘ x̂)) / r``, ``g = Δ ∘ w``; ``dw`` as a fixed-order sum of
    per-block partial sums (the same bits for any thread count)."""
    xhat, rrms, weight = cache
    d = delta.shape[-1]
    delta2 = np.ascontiguousarray(delta).reshape(-1, d)
    n = delta2.shape[0]
    delta_in = empty_array(delta.shape, delta)
    dw_part = np.empty((-(-n // NORM_BLOCK_ROWS), d))
    _backward(delta2, xhat.reshape(-1, d), rrms.reshape(-1), weight, delta_in.reshape(-1, d), dw_part)
    if dweight is not None:
        dweight[...] = dw_part.sum(axis=0)
    return delta_in

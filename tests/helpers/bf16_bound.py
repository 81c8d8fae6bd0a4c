"""The tolerance of a bf16 gradient against another bf16 computation of it (autocast's, or the
same chain on another kernel table): tests/system/test_bf16.py, tests/gpu/test_bf16_table.py.

Written out (bf16's ε = 2⁻⁸, unit roundoff u = ε/2 = 2⁻⁹). Both sides compute the same float32
formulas with some intermediates rounded to bfloat16; they differ in which intermediates are
rounded (autocast's hand-written attention rounds its scores ``S``, its probabilities ``P`` and
the RoPE'd ``q``, ``k``; pedestrian keeps those float32; pedestrian's product adds its bias after
rounding ``x W``, ``F.linear`` before), in float32 summation orders (2⁻²⁴-scale), and in the bf16
roundings that an ulp of float32 flips. Count the roundings on the path of any gradient, per
side: forward, per block, at most 9 (qkv, the RoPE'd q and k, S, P, a3, a4, a7 (gate and up: one
product), a8, a9), the head's a12: 1; backward, per block, at most 10 (the signals entering and
leaving each of the five products, ΔP and ΔS), the head's Δ12 and Δ11: 2; the weight gradient's
own rounding: 1. So R = 19·n_blocks + 4 roundings, each a relative perturbation of at most u of
one tensor, entering the gradient linearly to first order (through norms, which keep relative
errors, and weights of scale 0.02, which shrink the signals they multiply). Round-to-nearest
errors behave as independent and mean-zero (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019):
the norm of R such perturbations stays below λ·√R·u with probability at least 1 − 2·exp(−λ²/2)
(λ = 5: 1 − 7.5e-6). Each side carries its own, so

    ‖g − g'‖ ≤ 2·λ·√R·u·‖g‖        per parameter tensor, ‖g‖ the float32 gradient's norm,

where a tensor whose gradient cancels (an entry much smaller than the terms summed into it: the
biases, the embedding rows of rare tokens) is measured against a share (``TENSOR_FLOOR``) of the
whole gradient's norm instead, the scale of the terms its absolute error follows. For
n_blocks = 2: R = 42, bound 2·5·√42·2⁻⁹ = 0.127.
"""

from __future__ import annotations

import math

import numpy as np

U = 2.0 ** -9                      # bfloat16's unit roundoff, ε/2
LAMBDA = 5.0
TENSOR_FLOOR = 0.05                # a tensor's norm counts as at least this share of the whole gradient's


def gradient_bound(n_blocks: int) -> float:
    """``2·λ·√R·u`` with ``R = 19·n_blocks + 4`` (module docstring)."""
    return 2 * LAMBDA * math.sqrt(19 * n_blocks + 4) * U


def relative_errors(a: dict, b: dict, scale: dict) -> dict:
    """``‖a − b‖ / max(‖scale‖, TENSOR_FLOOR·‖scale, whole‖)`` per tensor (``name -> float64 array``)."""
    whole = math.sqrt(sum(float(np.sum(v * v)) for v in scale.values()))
    return {k: float(np.linalg.norm(a[k] - b[k])) / max(float(np.linalg.norm(scale[k])), TENSOR_FLOOR * whole)
            for k in scale}


def whole_error(a: dict, b: dict) -> float:
    """``‖a − b‖`` over every tensor of ``b``."""
    return math.sqrt(sum(float(np.sum((a[k] - b[k]) ** 2)) for k in b))

"""Fast kernels for a skip and the norm after it (reference: :mod:`pedestrian.layers.residual`).

On the CPU the two stay two kernels, the skip's pooled add (:func:`.linear.add`) and the norm's
row loops (:mod:`.layernorm`, :mod:`.rmsnorm`): the seam exists for the GPU, where one pass over
the rows does both (:mod:`pedestrian.gpu.norms`), and a fused numba loop has not been measured
faster here.
"""

from __future__ import annotations

from .layernorm import layernorm_backward, layernorm_forward
from .linear import add
from .rmsnorm import rmsnorm_backward, rmsnorm_forward


def add_layernorm_forward(x, r, weight, bias, eps: float):
    """``s = x + r``, ``y = LN(s)``: fast :func:`pedestrian.layers.residual.add_layernorm_forward`."""
    s = add(x, r)
    y, cache = layernorm_forward(s, weight, bias, eps)
    return (s, y), cache


def add_layernorm_backward(delta, cache, delta_skip, *, dweight=None, dbias=None):
    """``Δ_s = Δ_skip + LNᵀ(Δ)``: fast :func:`pedestrian.layers.residual.add_layernorm_backward`."""
    return add(delta_skip, layernorm_backward(delta, cache, dweight=dweight, dbias=dbias))


def add_rmsnorm_forward(x, r, weight, eps: float, *, offset: float = 0.0):
    """``s = x + r``, ``y = RMSNorm(s)``: fast :func:`pedestrian.layers.residual.add_rmsnorm_forward`."""
    s = add(x, r)
    y, cache = rmsnorm_forward(s, weight, eps, offset=offset)
    return (s, y), cache


def add_rmsnorm_backward(delta, cache, delta_skip, *, dweight=None):
    """``Δ_s = Δ_skip + RMSNormᵀ(Δ)``: fast :func:`pedestrian.layers.residual.add_rmsnorm_backward`."""
    return add(delta_skip, rmsnorm_backward(delta, cache, dweight=dweight))

"""Soft-capping on the GPU, ``y = c · tanh(z / c)`` (reference: :mod:`pedestrian.layers.softcap`;
EQUATIONS.md "Gemma: soft-capping").

One elementwise kernel per direction; :func:`cap_rows` caps a chunk of logits in place and
writes the slope ``1 − tanh²`` for the fused head (:mod:`.head_loss`). ``tanh`` is written out
(Triton's interpreter has none): ``tanh a = (1 − e)/(1 + e)``, ``e = e^{−2|a|}`` (no overflow), and
below ``|a| < 2⁻⁵``, where ``1 − e`` would cancel, its series to ``a⁹`` (the next term,
``1382/155925 a¹¹``, is below float64's ε relative there). ``c`` is read from a one-element
tensor of the data's dtype (a float argument would be float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layers.checks import check_float
from ..layers.softcap import check_softcap
from .common import ELEMENTS, flat, programs

__all__ = ["cap_rows", "softcap_backward", "softcap_forward"]


@triton.jit
def tanh(u):
    """``tanh u``: ``(1 − e)/(1 + e)`` with ``e = e^{−2|u|}``, the series below ``|u| < 2⁻⁵``, the sign of ``u``."""
    a = tl.abs(u)
    e = tl.exp(-2.0 * a)
    a2 = a * a
    series = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * (
        -0.05396825396825397 + a2 * 0.021869488536155203))))
    t = tl.where(a < 0.03125, series, (1.0 - e) / (1.0 + e))
    return tl.where(u < 0, -t, t)


@triton.jit
def _forward_kernel(Z, Y, CAP, n, BLOCK: tl.constexpr):
    """``y = c · tanh(z / c)`` over ``BLOCK`` elements."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = tl.load(CAP)
    z = tl.load(Z + offs, mask=mask, other=0.0)
    tl.store(Y + offs, c * tanh(z / c), mask=mask)


@triton.jit
def _backward_kernel(DY, Z, DZ, CAP, n, BLOCK: tl.constexpr):
    """``Δ_in = Δ ∘ (1 − tanh²(z / c))`` over ``BLOCK`` elements."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = tl.load(CAP)
    t = tanh(tl.load(Z + offs, mask=mask, other=0.0) / c)
    dy = tl.load(DY + offs, mask=mask, other=0.0)
    tl.store(DZ + offs, dy * (1.0 - t * t), mask=mask)


@triton.jit
def _cap_kernel(Z, SLOPE, CAP, n, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """In place: ``z ← c · tanh(z / c)``; with ``GRAD``, ``slope ← 1 − tanh²(z / c)``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = tl.load(CAP)
    t = tanh(tl.load(Z + offs, mask=mask, other=0.0) / c)
    tl.store(Z + offs, c * t, mask=mask)
    if GRAD:
        tl.store(SLOPE + offs, 1.0 - t * t, mask=mask)


def _cap_tensor(cap, like):
    return torch.full((1,), float(cap), dtype=like.dtype, device=like.device)


def softcap_forward(z, cap: float):
    """``y = c · tanh(z / c)`` elementwise.

    GPU :func:`pedestrian.layers.softcap.softcap_forward` (same arguments, result, cache ``(z, c)``)."""
    check_softcap(cap)
    check_float(z, "the soft-cap's input")
    z1 = flat(z)
    y = torch.empty_like(z1)
    _forward_kernel[(programs(z1.numel(), ELEMENTS),)](z1, y, _cap_tensor(cap, z1), z1.numel(), BLOCK=ELEMENTS)
    return y.reshape(z.shape), (z, cap)


def softcap_backward(delta, cache):
    """``Δ_in = Δ ∘ (1 − tanh²(z / c))``.

    GPU :func:`pedestrian.layers.softcap.softcap_backward` (same arguments and result)."""
    z, cap = cache
    z1, dy = flat(z), flat(delta)
    dz = torch.empty_like(dy)
    _backward_kernel[(programs(dy.numel(), ELEMENTS),)](dy, z1, dz, _cap_tensor(cap, z1), dy.numel(), BLOCK=ELEMENTS)
    return dz.reshape(delta.shape)


def cap_rows(z, cap: float, grad: bool):
    """``z ← c · tanh(z / c)`` in place over a contiguous ``z``; returns the slope ``1 − tanh²(z/c)``
    (``z``'s shape) when ``grad``, else ``None``."""
    slope = torch.empty_like(z) if grad else None
    n = z.numel()
    if n:
        _cap_kernel[(programs(n, ELEMENTS),)](z, z if slope is None else slope, _cap_tensor(cap, z), n,
                                              GRAD=grad, BLOCK=ELEMENTS)
    return slope

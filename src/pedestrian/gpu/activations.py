"""Pointwise non-linearities on the GPU: ReLU, exact GELU, GELU tanh, SiLU (reference:
:mod:`pedestrian.layers.activations`; EQUATIONS.md "Fully connected, activations, residual",
"SiLU and the SwiGLU MLP").

One elementwise kernel per direction, the activation a compile-time switch: the forward reads
``x`` once and writes ``g(x)``; the backward reads ``Δ`` and ``x`` once and writes ``Δ ∘ g'(x)``.
GELU tanh is written as ``½(1 + tanh u) = σ(2u)`` (Triton's interpreter has no ``tanh``, and ``σ``
from ``e^{−|z|}`` has no cancellation: :func:`sigmoid_pair`), with ``1 − tanh² u = 4 σ(2u) σ(−2u)``.
The tails follow the reference: ``g(−∞) = 0``, ``g'(−∞) = 0``, ``g'(∞) = 1``, NaN stays NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layers.activations import ACTIVATIONS, SILU_SATURATE, check_activation
from ..layers.checks import check_float
from .common import ELEMENTS, flat, programs

@triton.jit
def sigmoid_pair(z):
    """``(σ(z), 1 − σ(z))``, each to a few ulp relative, from ``e = e^{−|z|}``: ``σ(|z|) = 1/(1 + e)``,
    ``σ(−|z|) = e/(1 + e)``."""
    e = tl.exp(-tl.abs(z))
    p = 1.0 / (1.0 + e)
    q = e * p
    return tl.where(z >= 0, p, q), tl.where(z >= 0, q, p)


@triton.jit
def activation_value(x, KIND: tl.constexpr):
    """``g(x)``: 0 ReLU, 1 GELU (``x Φ(x)``), 2 GELU tanh (``x σ(2u)``), 3 SiLU (``x σ(x)``)."""
    if KIND == 0:
        y = tl.where(x <= 0, 0.0, x)
    elif KIND == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        y = tl.where(cdf == 0, 0.0, x * cdf)
    elif KIND == 2:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        s, _ = sigmoid_pair(2.0 * u)
        y = tl.where(s == 0, 0.0, x * s)
    else:
        s, _ = sigmoid_pair(x)
        y = tl.maximum(x, -1000.0) * s
    return y


@triton.jit
def activation_slope(x, KIND: tl.constexpr):
    """``g'(x)`` of :func:`activation_value` (ReLU: 1, 0, NaN at NaN)."""
    if KIND == 0:
        slope = tl.where(x > 0, 1.0, tl.where(x <= 0, 0.0, x))
    elif KIND == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
        slope = cdf + tl.where(pdf == 0, 0.0, x * pdf)
    elif KIND == 2:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        s, s_bar = sigmoid_pair(2.0 * u)                   # ½(1 + tanh u), ½(1 − tanh u)
        du_dx = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
        sech2 = 4.0 * s * s_bar                            # 1 − tanh² u
        slope = s + tl.where(sech2 == 0, 0.0, 0.5 * x * sech2 * du_dx)
    else:
        s, s_bar = sigmoid_pair(x)
        slope = s * (1.0 + tl.minimum(tl.maximum(x, -1000.0), 1000.0) * s_bar)
    return slope


@triton.jit
def _forward_kernel(X, Y, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """``y = g(x)`` over ``BLOCK`` elements."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0)
    tl.store(Y + offs, activation_value(x, KIND), mask=mask)


@triton.jit
def _backward_kernel(DY, X, DX, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """``Δ_in = Δ ∘ g'(x)`` over ``BLOCK`` elements."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0)
    dy = tl.load(DY + offs, mask=mask, other=0.0)
    tl.store(DX + offs, dy * activation_slope(x, KIND), mask=mask)


#: the kernels' ``KIND`` of each name, and the SiLU clip they write as a literal (tests/gpu check it)
KINDS = {name: k for k, name in enumerate(ACTIVATIONS)}
SATURATE = SILU_SATURATE


def activation_forward(x, name: str):
    """``a8 = g(a7)`` elementwise: ReLU, GELU ``x Φ(x)``, GELU tanh ``½x(1 + tanh(√(2/π)(x + 0.044715x³)))``,
    SiLU ``x σ(x)``.

    GPU :func:`pedestrian.layers.activations.activation_forward` (same arguments, result, cache ``x``)."""
    check_activation(name)
    check_float(x, "the activation's input")
    x1 = flat(x)
    y = torch.empty_like(x1)
    _forward_kernel[(programs(x1.numel(), ELEMENTS),)](x1, y, x1.numel(), KIND=KINDS[name],
                                                       BLOCK=ELEMENTS)
    return y.reshape(x.shape), x


def activation_backward(delta, cache, name: str):
    """``Δ_in = Δ ∘ g'(x)``: GELU ``Φ(x) + x φ(x)``, GELU tanh ``½(1 + tanh u) + ½x(1 − tanh² u) u'``, SiLU
    ``σ(x)(1 + x(1 − σ(x)))``, ReLU ``[x > 0]``.

    GPU :func:`pedestrian.layers.activations.activation_backward` (same arguments and result)."""
    check_activation(name)
    x1, dy = flat(cache), flat(delta)
    dx = torch.empty_like(dy)
    _backward_kernel[(programs(dy.numel(), ELEMENTS),)](dy, x1, dx, dy.numel(), KIND=KINDS[name],
                                                        BLOCK=ELEMENTS)
    return dx.reshape(delta.shape)

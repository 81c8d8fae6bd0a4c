"""Pointwise non-linearities on the GPU: ReLU, exact GELU, GELU tanh, SiLU (reference:
:mod:`pedestrian.layers.activations`; EQUATIONS.md "Fully connected, activations, residual",
"SiLU and the SwiGLU MLP").

One elementwise kernel per direction, the activation a compile-time switch: the forward reads
``x`` once and writes ``g(x)``; the backward reads ``Δ`` and ``x`` once and writes ``Δ ∘ g'(x)``.
GELU tanh is written as ``½(1 + tanh u) = σ(2u)`` (Triton's interpreter has no ``tanh``, and ``σ``
from ``e^{−|z|}`` has no cancellation: :func:`sigmoid_pair`), with ``1 − tanh² u = 4 σ(2u) σ(−2u)``.
The tails follow the reference: ``g(−∞) = 0``, ``g'(−∞) = 0``, ``g'(∞) = 1``, NaN stays NaN.

The MLP's expand layer and its activation (:func:`linear_activation_forward`): the product
without its bias on cuBLAS, then one pass that reads the product and the bias and writes
``a7 = x W + b`` (over the product) and ``a8 = g(a7)``; backward, one pass that reads ``Δ8`` and
``a7``, writes ``Δ7 = Δ8 ∘ g'(a7)`` and each program's column sums of ``Δ7`` over its
:data:`~.common.ROWS` rows (the bias gradient's partials, summed in a fixed order afterwards: no
atomics), then the two products ``dW = a6ᵀ Δ7`` and ``Δ6 = Δ7 Wᵀ`` on cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layers.activations import ACTIVATIONS, SILU_SATURATE, check_activation
from ..layers.checks import check_float
from .common import ELEMENTS, ROWS, flat, programs, rows, write_sum

#: columns one program of the bias backward covers (its partial column sums)
COLUMNS = 128

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


@triton.jit
def _bias_forward_kernel(P, B, A7, A8, n, d, HAS_B: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """``a7 = p + b`` (``b`` the row's bias, column ``i mod d``), ``a8 = g(a7)`` over ``BLOCK`` elements."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a7 = tl.load(P + offs, mask=mask, other=0.0)
    if HAS_B:
        a7 = a7 + tl.load(B + offs % d, mask=mask, other=0.0)
        tl.store(A7 + offs, a7, mask=mask)
    tl.store(A8 + offs, activation_value(a7, KIND), mask=mask)


@triton.jit
def _bias_backward_kernel(DY, A7, DX, DB, n_rows, d, HAS_DB: tl.constexpr, KIND: tl.constexpr,
                          ROWS_PER: tl.constexpr, BLOCK: tl.constexpr):
    """``Δ7 = Δ8 ∘ g'(a7)`` on ``ROWS_PER`` rows × ``BLOCK`` columns; their column sums into row
    ``program_id(0)`` of ``DB`` (in row order)."""
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < d
    db = tl.zeros([BLOCK], dtype=DY.dtype.element_ty)
    for i in range(ROWS_PER):
        row = tl.program_id(0) * ROWS_PER + i
        mask = in_row & (cols * 0 + row < n_rows)          # (a block: the interpreter refuses block & scalar)
        dy = tl.load(DY + row * d + cols, mask=mask, other=0.0)
        a7 = tl.load(A7 + row * d + cols, mask=mask, other=0.0)
        dx = dy * activation_slope(a7, KIND)
        tl.store(DX + row * d + cols, dx, mask=mask)
        db += tl.where(mask, dx, 0.0)
    if HAS_DB:
        tl.store(DB + tl.program_id(0) * d + cols, db, mask=in_row)


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


def linear_activation_forward(x, weight, bias, name: str):
    """``a7 = a6 W + b``, ``a8 = g(a7)``: the product ``a6 W`` on cuBLAS, then one pass for ``+ b`` and ``g``.

    GPU :func:`pedestrian.layers.activations.linear_activation_forward` (same arguments, results,
    cache ``(x, a7)``)."""
    check_activation(name)
    check_float(x, "the linear layer's input")
    a7 = rows(x) @ weight                                                   # (N, f_out), bias not yet added
    a8 = torch.empty_like(a7)
    _bias_forward_kernel[(programs(a7.numel(), ELEMENTS),)](
        a7, a7 if bias is None else bias, a7, a8, a7.numel(), a7.shape[1], HAS_B=bias is not None,
        KIND=KINDS[name], BLOCK=ELEMENTS)
    shape = (*x.shape[:-1], a7.shape[1])
    a7 = a7.reshape(shape)
    return (a7, a8.reshape(shape)), (x, a7)


def linear_activation_backward(delta, cache, weight, name: str, *, dweight=None, dbias=None):
    """``Δ7 = Δ8 ∘ g'(a7)`` and ``db = Σ_tokens Δ7`` in one pass, then ``dW = a6ᵀ Δ7``, ``Δ6 = Δ7 Wᵀ`` on cuBLAS.

    GPU :func:`pedestrian.layers.activations.linear_activation_backward` (same arguments, results)."""
    check_activation(name)
    x, a7 = cache
    dy = rows(delta)
    n, d = dy.shape
    d7 = torch.empty_like(dy)
    grid = (programs(n, ROWS), programs(d, COLUMNS))
    partials = None if dbias is None else torch.empty((grid[0], d), dtype=dy.dtype, device=dy.device)
    _bias_backward_kernel[grid](dy, rows(a7), d7, d7 if partials is None else partials, n, d,
                                HAS_DB=partials is not None, KIND=KINDS[name], ROWS_PER=ROWS, BLOCK=COLUMNS)
    write_sum(partials, dbias)
    x2 = rows(x)
    if dweight is not None:
        dweight[...] = x2.T @ d7                                            # (f_in, f_out)
    d6 = (d7 @ weight.T).reshape(*x.shape[:-1], weight.shape[0])            # (..., f_in)
    return d6, d7.reshape(delta.shape)

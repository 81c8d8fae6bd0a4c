"""Layer norm and RMS norm on the GPU, with the skip before them fused in (reference:
:mod:`pedestrian.layers.layernorm`, :mod:`pedestrian.layers.rmsnorm`,
:func:`pedestrian.layers.residual.add_layernorm_forward`; EQUATIONS.md "Layer normalization",
"RMS normalization").

One kernel per direction for both norms (``RMS`` a compile-time switch): a program takes
:data:`~.common.ROWS` rows, each whole in one block; the forward adds the skip ``s = x + r`` and
writes ``s``, ``x̂``, ``1/σ`` and ``y`` in one pass over the row (two reductions in registers: the
mean, then the centred variance, an exact two-pass); the backward writes ``Δ_in`` (plus the skip's
signal where one is given) and each program's partial ``Σ x̂ ∘ Δ``, ``Σ Δ`` over its rows, summed
in a fixed order afterwards (no atomics: the same bits every run). Arithmetic in the input's
dtype, as the reference; the cache holds ``1/σ`` in that dtype too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layers.checks import check_float
from ..layers.layernorm import check_eps
from ..layers.rmsnorm import check_rms_eps
from .common import ROWS, block_width, programs, rows, write_sum


@triton.jit
def _forward_kernel(X, R, W, B, S, Y, XHAT, RSTD, n_rows, d, EPS: tl.constexpr, HAS_R: tl.constexpr,
                    HAS_B: tl.constexpr, RMS: tl.constexpr, ROWS_PER: tl.constexpr, BLOCK: tl.constexpr):
    """Per row: ``s = x (+ r)``; layer norm ``x̂ = (s − μ)/σ``, ``σ = √(mean (s − μ)² + ε)``; RMS norm
    ``x̂ = s/r``, ``r = √(mean s² + ε)``; ``y = x̂ ∘ w (+ b)``."""
    cols = tl.arange(0, BLOCK)
    in_row = cols < d
    w = tl.load(W + cols, mask=in_row, other=0.0)
    if HAS_B:
        b = tl.load(B + cols, mask=in_row, other=0.0)
    for i in range(ROWS_PER):
        row = tl.program_id(0) * ROWS_PER + i
        mask = in_row & (cols * 0 + row < n_rows)          # (a block: the interpreter refuses block & scalar)
        x = tl.load(X + row * d + cols, mask=mask, other=0.0)
        if HAS_R:
            x = x + tl.load(R + row * d + cols, mask=mask, other=0.0)
            tl.store(S + row * d + cols, x, mask=mask)
        if RMS:
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + EPS)
            xhat = x * rstd
        else:
            mu = tl.sum(x, axis=0) / d
            c = tl.where(mask, x - mu, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(c * c, axis=0) / d + EPS)
            xhat = c * rstd
        y = xhat * w
        if HAS_B:
            y = y + b
        tl.store(XHAT + row * d + cols, xhat, mask=mask)
        tl.store(Y + row * d + cols, y, mask=mask)
        tl.store(RSTD + row, rstd, mask=row < n_rows)


@triton.jit
def _backward_kernel(DY, XHAT, RSTD, W, SKIP, DX, DW, DB, n_rows, d, HAS_SKIP: tl.constexpr,
                     RMS: tl.constexpr, ROWS_PER: tl.constexpr, BLOCK: tl.constexpr):
    """Per row: ``g = Δ ∘ w``, ``Δ_in = (1/σ)(g − mean g − x̂ ∘ mean(g ∘ x̂))`` (RMS: no ``mean g``)
    ``(+ Δ_skip)``; this program's ``Σ x̂ ∘ Δ`` and ``Σ Δ`` over its rows into row ``pid`` of ``DW``, ``DB``."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    in_row = cols < d
    w = tl.load(W + cols, mask=in_row, other=0.0)
    dw = tl.zeros([BLOCK], dtype=w.dtype)
    db = tl.zeros([BLOCK], dtype=w.dtype)
    for i in range(ROWS_PER):
        row = pid * ROWS_PER + i
        mask = in_row & (cols * 0 + row < n_rows)          # (a block: the interpreter refuses block & scalar)
        dy = tl.load(DY + row * d + cols, mask=mask, other=0.0)
        xhat = tl.load(XHAT + row * d + cols, mask=mask, other=0.0)
        rstd = tl.load(RSTD + row, mask=row < n_rows, other=0.0)
        g = dy * w
        mean_gx = tl.sum(g * xhat, axis=0) / d
        if RMS:
            dx = rstd * (g - xhat * mean_gx)
        else:
            mean_g = tl.sum(g, axis=0) / d
            dx = rstd * (g - mean_g - xhat * mean_gx)
        if HAS_SKIP:
            dx = tl.load(SKIP + row * d + cols, mask=mask, other=0.0) + dx
        tl.store(DX + row * d + cols, dx, mask=mask)
        dw += xhat * dy
        db += dy
    tl.store(DW + pid * d + cols, dw, mask=in_row)
    tl.store(DB + pid * d + cols, db, mask=in_row)


def _forward(x, r, weight, bias, eps: float, rms: bool):
    """``(s, y, cache)`` of either norm of ``x (+ r)`` (``s`` is ``None`` without ``r``)."""
    check_float(x, "the layer norm's input")
    x2 = rows(x)
    n, d = x2.shape
    s = None if r is None else torch.empty_like(x2)
    y, xhat = torch.empty_like(x2), torch.empty_like(x2)
    rstd = torch.empty((n,), dtype=x.dtype, device=x.device)
    _forward_kernel[(programs(n, ROWS),)](
        x2, x2 if r is None else rows(r), weight, weight if bias is None else bias, x2 if s is None else s,
        y, xhat, rstd, n, d, EPS=float(eps), HAS_R=r is not None, HAS_B=bias is not None, RMS=rms,
        ROWS_PER=ROWS, BLOCK=block_width(d))
    shape = x.shape
    cache = (xhat.reshape(shape), rstd.reshape(*shape[:-1], 1), weight)
    return None if s is None else s.reshape(shape), y.reshape(shape), cache


def _backward(delta, cache, skip, dweight, dbias, rms: bool):
    """``Δ_in (+ Δ_skip)`` of either norm; writes ``dweight``, ``dbias`` (``None``: not written)."""
    xhat, rstd, weight = cache
    dy = rows(delta)
    n, d = dy.shape
    dx = torch.empty_like(dy)
    grid = programs(n, ROWS)
    dw = torch.empty((grid, d), dtype=delta.dtype, device=delta.device)
    db = torch.empty((grid, d), dtype=delta.dtype, device=delta.device)
    _backward_kernel[(grid,)](dy, rows(xhat), rows(rstd), weight, dy if skip is None else rows(skip), dx, dw, db,
                              n, d, HAS_SKIP=skip is not None, RMS=rms, ROWS_PER=ROWS, BLOCK=block_width(d))
    write_sum(dw, dweight)
    write_sum(db, dbias)
    return dx.reshape(delta.shape)


def layernorm_forward(x, weight, bias, eps: float):
    """Per token: ``x̂ = (x − μ)/σ``, ``σ = sqrt(var_f(x) + eps)`` (biased variance), ``y = x̂ ∘ w + b``.

    GPU :func:`pedestrian.layers.layernorm.layernorm_forward` (same arguments, results and cache
    ``(x̂, 1/σ, weight)``)."""
    check_eps(eps)
    _, y, cache = _forward(x, None, weight, bias, eps, rms=False)
    return y, cache


def layernorm_backward(delta, cache, *, dweight=None, dbias=None):
    """``Δ_in = (1/σ)(g − mean_f(g) − x̂ ∘ mean_f(g ∘ x̂))`` with ``g = Δ ∘ w``; ``dw = Σ_tokens x̂ ∘ Δ``,
    ``db = Σ_tokens Δ``.

    GPU :func:`pedestrian.layers.layernorm.layernorm_backward` (the gradients as fixed-order sums of
    per-program partial sums)."""
    return _backward(delta, cache, None, dweight, dbias, rms=False)


def rmsnorm_forward(x, weight, eps: float, *, offset: float = 0.0):
    """Per token: ``r = sqrt(mean_f(x²) + eps)``, ``x̂ = x / r``, ``y = x̂ ∘ (offset + w)``.

    GPU :func:`pedestrian.layers.rmsnorm.rmsnorm_forward` (same arguments, results and cache
    ``(x̂, 1/r, offset + weight)``; ``offset + w`` formed once, ``(d,)``)."""
    check_rms_eps(eps)
    _, y, cache = _forward(x, None, weight if offset == 0 else offset + weight, None, eps, rms=True)
    return y, cache


def rmsnorm_backward(delta, cache, *, dweight=None):
    """``Δ_in = (1/r)(g − x̂ ∘ mean_f(g ∘ x̂))`` with ``g = Δ ∘ w``; ``dw = Σ_tokens x̂ ∘ Δ``.

    GPU :func:`pedestrian.layers.rmsnorm.rmsnorm_backward`."""
    return _backward(delta, cache, None, dweight, None, rms=True)


def add_layernorm_forward(x, r, weight, bias, eps: float):
    """``s = x + r``, ``y = LN(s)`` (``a5 = x + a4``, ``a6 = LN2(a5)``).

    GPU :func:`pedestrian.layers.residual.add_layernorm_forward`: one pass writes ``s``, ``x̂``,
    ``1/σ`` and ``y``."""
    check_eps(eps)
    s, y, cache = _forward(x, r, weight, bias, eps, rms=False)
    return (s, y), cache


def add_layernorm_backward(delta, cache, delta_skip, *, dweight=None, dbias=None):
    """``Δ_s = Δ_skip + (1/σ)(g − mean_f(g) − x̂ ∘ mean_f(g ∘ x̂))``, ``g = Δ ∘ w``; ``dw``, ``db`` as
    :func:`layernorm_backward`.

    GPU :func:`pedestrian.layers.residual.add_layernorm_backward`: the skip's signal added as
    ``Δ_in`` is written."""
    return _backward(delta, cache, delta_skip, dweight, dbias, rms=False)


def add_rmsnorm_forward(x, r, weight, eps: float, *, offset: float = 0.0):
    """``s = x + r``, ``y = RMSNorm(s)`` (``∘ (offset + w)``).

    GPU :func:`pedestrian.layers.residual.add_rmsnorm_forward`."""
    check_rms_eps(eps)
    s, y, cache = _forward(x, r, weight if offset == 0 else offset + weight, None, eps, rms=True)
    return (s, y), cache


def add_rmsnorm_backward(delta, cache, delta_skip, *, dweight=None):
    """``Δ_s = Δ_skip + (1/r)(g − x̂ ∘ mean_f(g ∘ x̂))``, ``g = Δ ∘ w``; ``dw = Σ_tokens x̂ ∘ Δ``.

    GPU :func:`pedestrian.layers.residual.add_rmsnorm_backward`."""
    return _backward(delta, cache, delta_skip, dweight, None, rms=True)

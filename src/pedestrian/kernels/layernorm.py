"""Fast kernels for layer normalization (reference: :mod:`pedestrian.layers.layernorm`, paper section 5)."""

from __future__ import annotations

import numpy as np

from ..backend import is_torch_array
from ..layers.layernorm import check_eps
from .blas import colsum, elementwise_lib, rowdot
from .threads import for_row_blocks
from .workspace import empty_array, scratch


#: at most this many elements (a few tokens: generation) go through :func:`_layernorm_few_rows`
SMALL_ELEMENTS = 1 << 12


_ONES: dict = {}


def _ones(d: int, dtype):
    """``(d,)`` of ones: a row sum as one product (as a ``(d, 1)`` column, BLAS: 8 against 39 µs
    for ``np.sum`` over (1024, 128) float32 rows), divided by ``d`` after (one
    rounding; a row of ``1/d`` would round ``1/d`` itself too, for every ``d`` not a power of 2)."""
    w = _ONES.get((d, dtype))
    if w is None:
        w = _ONES[(d, dtype)] = np.ones(d, dtype=dtype)
    return w


def _centre(x, ones, d: int, out) -> None:
    """``out = x − μ`` by the corrected two-pass mean: ``μ = Σx/d``, then the mean of the
    residuals ``x − μ`` (the rounding error of ``μ``, which cancellation would blow up to
    ``ε·|μ|/σ`` relative to ``x̂`` when ``|μ| ≫ σ``) subtracted too (Chan, Golub and LeVeque,
    "Algorithms for computing the sample variance", 1983). ``ones`` is a ``(d,)`` row of ones."""
    column = ones[:, None]                                 # row sums as BLAS products
    np.subtract(x, np.divide(x @ column, d), out=out)
    np.subtract(out, np.divide(out @ column, d), out=out)


def _layernorm_few_rows(x, weight, bias, eps: float):
    """The same formulas as the row-block kernel in a few NumPy calls (measured: the row-block
    machinery costs more than the arithmetic of one token's row)."""
    d = x.shape[-1]
    xhat = np.empty_like(x)
    _centre(x, _ones(d, x.dtype), d, xhat)                 # x − μ
    sigma = np.sqrt(np.vecdot(xhat, xhat)[..., None] / d + eps)   # σ
    xhat /= sigma                                          # x̂
    y = xhat * weight
    if bias is not None:
        y += bias
    return y, (xhat, sigma, weight)


def layernorm_forward(x, weight, bias, eps: float):
    """Fast :func:`pedestrian.layers.layernorm.layernorm_forward` (same arguments and results),
    written into pooled arrays in row blocks; the cache holds ``σ`` itself instead of ``1/σ``
    (one division instead of a reciprocal and a multiplication)."""
    check_eps(eps)
    if is_torch_array(x):
        # the same formulas in fewer operations (torch's per-operation cost dominates small
        # inputs). A few rows (one token while generating): torch.var_mean gives both
        # statistics in one call (1 row: 25 vs 38 µs). More rows: its last-axis reduction is
        # slow, mean + square + mean is faster ((12, 64, 128): 1005 vs 145 µs, one thread)
        import torch

        if x.numel() <= 8 * x.shape[-1]:                     # new arrays, not the pool's: a few
            var, mean = torch.var_mean(x, dim=-1, correction=0, keepdim=True)   # rows cost less
            sigma = torch.sqrt(var.add_(eps))                                   # than its lookup
            xhat = (x - mean).div_(sigma)
            y = xhat * weight if bias is None else torch.addcmul(bias, xhat, weight)
            return y, (xhat, sigma, weight)
        xhat, y = empty_array(x.shape, x), empty_array(x.shape, x)
        torch.sub(x, x.mean(-1, keepdim=True), out=xhat)                    # x − μ
        sq = scratch(x.shape, x, "layernorm.sq")
        torch.mul(xhat, xhat, out=sq)
        sigma = sq.mean(-1, keepdim=True).add_(eps).sqrt_()                 # σ
        xhat.div_(sigma)
        if bias is None:
            torch.mul(xhat, weight, out=y)
        else:
            torch.addcmul(bias, xhat, weight, out=y)
        return y, (xhat, sigma, weight)
    d = x.shape[-1]
    if x.size <= SMALL_ELEMENTS:
        return _layernorm_few_rows(x, weight, bias, eps)
    lib = elementwise_lib(x)
    x2 = x.reshape(-1, d)
    xhat, y = empty_array(x.shape, x), empty_array(x.shape, x)
    sigma = empty_array((*x.shape[:-1], 1), x)
    xhat2, y2, sigma2 = xhat.reshape(-1, d), y.reshape(-1, d), sigma.reshape(-1, 1)
    ones = _ones(d, x.dtype)

    def kernel(lo: int, hi: int) -> None:                  # rows lo:hi
        xb, hb, yb, rb = x2[lo:hi], xhat2[lo:hi], y2[lo:hi], sigma2[lo:hi]
        _centre(xb, ones, d, hb)                                           # x − μ
        lib.divide(rowdot(hb, hb), d, out=rb)                              # biased variance
        lib.add(rb, eps, out=rb)
        lib.sqrt(rb, out=rb)                                               # σ
        lib.divide(hb, rb, out=hb)                                         # x̂
        lib.multiply(hb, weight, out=yb)
        if bias is not None:
            lib.add(yb, bias, out=yb)

    for_row_blocks(x, kernel, x2.shape[0], d)
    return y, (xhat, sigma, weight)


def layernorm_backward(delta, cache, *, dweight=None, dbias=None):
    """Fast :func:`pedestrian.layers.layernorm.layernorm_backward` (same arguments and result):
    ``Δ_in = (g − mean_f(g) − x̂ ∘ mean_f(g ∘ x̂)) / σ``, ``g = Δ ∘ w``, in row blocks; ``dw`` as a
    fixed-order sum of per-block partial sums (the same bits for any thread count)."""
    xhat, sigma, weight = cache
    lib = elementwise_lib(delta)
    d = delta.shape[-1]
    delta2, xhat2, sigma2 = delta.reshape(-1, d), xhat.reshape(-1, d), sigma.reshape(-1, 1)
    delta_in = empty_array(delta.shape, delta)
    out2 = delta_in.reshape(-1, d)
    partial_w: dict = {}                                   # block start -> Σ_block x̂ ∘ Δ
    ones = None if is_torch_array(delta) else _ones(d, delta.dtype)

    def kernel(lo: int, hi: int) -> None:
        db, hb, rb, ob = delta2[lo:hi], xhat2[lo:hi], sigma2[lo:hi], out2[lo:hi]
        t = scratch(hb.shape, hb, "layernorm.t")
        if dweight is not None:
            lib.multiply(hb, db, out=t)
            partial_w[lo] = colsum(t)
        lib.multiply(db, weight, out=ob)                   # g = Δ ∘ w
        if ones is not None:                               # NumPy: one product, as in the forward
            mean_g = ob @ ones[:, None]
        else:
            mean_g = lib.sum(ob, axis=-1, keepdims=True)
        lib.divide(mean_g, d, out=mean_g)
        mean_gx = rowdot(ob, hb)
        lib.divide(mean_gx, d, out=mean_gx)
        lib.subtract(ob, mean_g, out=ob)
        lib.multiply(hb, mean_gx, out=t)
        lib.subtract(ob, t, out=ob)
        lib.divide(ob, rb, out=ob)

    for_row_blocks(delta, kernel, delta2.shape[0], d)
    if dweight is not None:
        dweight[...] = partial_w.pop(0)
        for lo in sorted(partial_w):                       # fixed order: same sum every run
            dweight += partial_w[lo]
    if dbias is not None:
        colsum(delta2, out=dbias)
    return delta_in

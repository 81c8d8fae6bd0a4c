"""Fast kernels for the fully connected layer and the skip addition (reference:
:mod:`pedestrian.layers.linear`, :mod:`pedestrian.layers.residual`).

Products go straight into preallocated arrays (the model's gradient buffer for ``dW``, ``db``;
pooled arrays for outputs), shared over numba's threads in row blocks
(:func:`pedestrian.kernels.blas.matmul_into`); the bias rides on the forward product's loop.
"""

from __future__ import annotations

import numpy as np

from ..layers.checks import check_float
from . import schedule
from .blas import colsum, few_rows_matmul, matmul_into
from .workspace import empty_array


def linear_forward(x, weight, bias=None):
    """``y = x W + b`` (EQUATIONS.md, "Fully connected (FC), activations, residual").

    Fast :func:`pedestrian.layers.linear.linear_forward` (bias added inside the product; a few
    tokens' input: :func:`pedestrian.kernels.blas.few_rows_matmul`, then the bias)."""
    check_float(x, "the linear layer's input")
    if x.size <= schedule.SMALL_ELEMENTS:   # a few tokens: one plain product is quickest
        y = few_rows_matmul(x, weight)
        if bias is not None:
            y += bias
        return y, x
    f_in, f_out = weight.shape
    x2 = x.reshape(-1, f_in)
    y = empty_array((x2.shape[0], f_out), x2)
    matmul_into(y, x2, weight, bias=bias)
    return y.reshape(*x.shape[:-1], f_out), x


def _transposed_contiguous(a) -> bool:
    """A 2-D view that is the transpose of a C-contiguous array (a tied weight's gradient)."""
    return not a.flags.c_contiguous and a.T.flags.c_contiguous


def linear_backward(delta, cache, weight, *, dweight=None, dbias=None, need_input=True):
    """``Δ_in = Δ Wᵀ``, ``dW = xᵀ Δ``, ``db = Σ_tokens Δ`` (EQUATIONS.md, "Fully connected (FC),
    activations, residual").

    Fast :func:`pedestrian.layers.linear.linear_backward`: ``dW`` and ``db`` are written
    straight into ``dweight`` / ``dbias`` (for a transposed ``dweight`` -- the tied logits'
    share of ``W_tok``'s gradient -- as ``Δᵀ x``, so BLAS writes rows)."""
    f_in, f_out = weight.shape
    d2 = delta.reshape(-1, f_out)
    x2 = cache.reshape(-1, f_in)
    delta_in = empty_array((d2.shape[0], f_in), d2) if need_input else None

    if dweight is not None:
        if _transposed_contiguous(dweight):
            matmul_into(dweight.T, d2.T, x2)
        else:
            matmul_into(dweight, x2.T, d2)                      # dW = xᵀ Δ
    if dbias is not None:
        colsum(d2, out=dbias)                                    # db = Σ_rows Δ
    if need_input:
        matmul_into(delta_in, d2, weight.T)                     # Δ_in = Δ Wᵀ
    return None if delta_in is None else delta_in.reshape(*delta.shape[:-1], f_in)


def add(a, b):
    """``y = x + f(x)`` (the skip) (EQUATIONS.md, "Fully connected (FC), activations, residual").

    Fast :func:`pedestrian.layers.residual.add`: the sum goes into a pooled array."""
    if a.size <= schedule.SMALL_ELEMENTS:
        return a + b
    out = empty_array(a.shape, a)
    np.add(a, b, out=out)
    return out


"""Fully connected layer ``y = x W + b`` (paper sections 1-2; EQUATIONS.md "Fully connected").

Reference implementation: the paper's math only, written against the array API standard.
"""

from __future__ import annotations

from ..backend import array_namespace
from .checks import check_float


def linear_forward(x, weight, bias=None):
    """Fully connected forward, the weight multiplied from the right.

    Args:
        x: ``(..., f_in)`` float array (typically ``(B, T, f_in)``).
        weight: ``(f_in, f_out)`` (HF GPT-2 ``Conv1D`` layout; the transpose of ``nn.Linear``'s).
        bias: ``(f_out,)`` or ``None``.

    Returns:
        ``(y, cache)``: ``y`` ``(..., f_out)``; ``cache = x`` (``dW = xᵀ Δ`` needs it).

    Raises:
        TypeError: ``x`` not real floating point.
    """
    check_float(x, "the linear layer's input")
    y = x @ weight                                         # (..., f_out)
    if bias is not None:
        y = y + bias
    return y, x


def linear_backward(delta, cache, weight, *, dweight=None, dbias=None, need_input=True):
    """``dW = xᵀ Δ`` (summed over batch and tokens), ``db = Σ_tokens Δ``, ``Δ_in = Δ Wᵀ``.

    Args:
        delta: ``(..., f_out)`` error signal at the output.
        cache: the forward input ``x`` ``(..., f_in)``.
        weight: ``(f_in, f_out)``.
        dweight, dbias: arrays the gradients are written into (views of the model's gradient
            buffer), or ``None`` for a parameter that gets no gradient (frozen, or no bias).
        need_input: compute ``Δ_in`` (the first layer of a chain needs none).

    Returns:
        ``Δ_in`` ``(..., f_in)``, or ``None`` when not asked for.
    """
    xp = array_namespace(delta)
    f_in, f_out = weight.shape
    x_rows = xp.reshape(cache, (-1, f_in))                 # (N, f_in), N = B·T
    delta_rows = xp.reshape(delta, (-1, f_out))            # (N, f_out)
    if dweight is not None:
        dweight[...] = xp.matrix_transpose(x_rows) @ delta_rows      # (f_in, f_out)
    if dbias is not None:
        dbias[...] = xp.sum(delta_rows, axis=0)                      # (f_out,)
    if not need_input:
        return None
    return delta @ xp.matrix_transpose(weight)                       # (..., f_in)

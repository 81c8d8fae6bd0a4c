"""Fully connected layer ``y = x W + b`` (paper sections 1-2; EQUATIONS.md "Fully connected")."""

from __future__ import annotations

from ..backend import colsum, empty_array, matmul_into


def linear_forward(x, weight, bias=None):
    """Fully connected forward, weight multiplied from the right.

    Args:
        x: ``(..., f_in)`` float array (any number of leading axes, typically ``(B, T)``).
        weight: ``(f_in, f_out)``, same dtype as ``x`` (HF GPT-2 ``Conv1D`` layout;
            the transpose of ``torch.nn.Linear.weight``).
        bias: ``(f_out,)`` or ``None``.

    Returns:
        ``(y, cache)``: ``y`` of shape ``(..., f_out)``; ``cache = x`` (the backward needs
        only the input, for ``dW = xᵀ Δ``).
    """
    f_in, f_out = weight.shape
    x2 = x.reshape(-1, f_in)
    y = empty_array((x2.shape[0], f_out), x2)
    matmul_into(y, x2, weight, bias=bias)
    return y.reshape(*x.shape[:-1], f_out), x


def linear_backward(delta, x, weight, *, need_input=True, need_weight=True, need_bias=True,
                    weight_out=None, bias_out=None):
    """Fully connected backward.

    Formulas (EQUATIONS.md): ``dW = xᵀ Δ`` summed over batch and tokens, ``db = Σ_tokens Δ``,
    ``Δ_in = Δ Wᵀ``.

    Args:
        delta: ``(..., f_out)`` error signal at the output.
        x: ``(..., f_in)`` the forward input (the cache).
        weight: ``(f_in, f_out)``.
        need_input / need_weight / need_bias: skip the work for what is not wanted (a frozen
            weight gets no gradient at all; the first layer needs no input signal).
        weight_out / bias_out: optional preallocated arrays to write ``dW`` / ``db`` into
            (views of a flat gradient buffer); when given, the return value is that array.

    Returns:
        ``(delta_in, d_weight, d_bias)``; entries not asked for are ``None``.
    """
    f_in, f_out = weight.shape
    d2 = delta.reshape(-1, f_out)
    d_weight = d_bias = delta_in = None
    if need_weight:
        x2 = x.reshape(-1, f_in)
        if weight_out is None:
            d_weight = x2.mT @ d2
        else:
            matmul_into(weight_out, x2.mT, d2)
            d_weight = weight_out
    if need_bias:
        d_bias = colsum(d2, out=bias_out)
    if need_input:
        delta_in = empty_array((d2.shape[0], f_in), d2)
        matmul_into(delta_in, d2, weight.mT)
        delta_in = delta_in.reshape(*delta.shape[:-1], f_in)
    return delta_in, d_weight, d_bias

"""Fully connected layer ``y = x W + b`` (paper sections 1-2; EQUATIONS.md "Fully connected")."""

from __future__ import annotations

from ..backend import array_namespace, matmul_into


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
    xp = array_namespace(x, weight)
    f_in = weight.shape[0]
    y = xp.reshape(xp.reshape(x, (-1, f_in)) @ weight, (*x.shape[:-1], weight.shape[1]))
    if bias is not None:
        y += bias
    return y, x


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
    xp = array_namespace(delta, weight)
    f_in, f_out = weight.shape
    d2 = xp.reshape(delta, (-1, f_out))
    d_weight = d_bias = delta_in = None
    if need_weight:
        x2 = xp.reshape(x, (-1, f_in))
        if weight_out is None:
            d_weight = xp.matrix_transpose(x2) @ d2
        else:
            matmul_into(weight_out, xp.matrix_transpose(x2), d2)
            d_weight = weight_out
    if need_bias:
        if bias_out is None:
            d_bias = xp.sum(d2, axis=0)
        else:
            bias_out[...] = xp.sum(d2, axis=0)
            d_bias = bias_out
    if need_input:
        delta_in = xp.reshape(d2 @ xp.matrix_transpose(weight), (*delta.shape[:-1], f_in))
    return delta_in, d_weight, d_bias

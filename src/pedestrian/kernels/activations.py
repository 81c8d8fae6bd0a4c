"""Fast kernels for the pointwise non-linearities (reference: :mod:`pedestrian.layers.activations`).

The GELU tanh approximation is evaluated through the identity ``½(1 + tanh u) = σ(2u) =
1/(1 + exp(−2u))``: the same function, but one ``exp`` costs about half a ``tanh`` in NumPy
and PyTorch. For very negative ``u`` the ``exp`` overflows to ``inf`` and ``σ`` correctly
becomes 0 (NumPy's overflow warning is silenced for that one operation). On PyTorch tensors
the same formulas run as fewer, multi-operand operations (``addcmul``, ``sigmoid``): at gpt2
sizes each operation is a full pass over a (B·T, 4d) array.
"""

from __future__ import annotations

import math

import numpy as np

from ..backend import array_namespace, erf, is_torch_array
from ..layers.activations import check_activation
from .blas import elementwise_lib
from .threads import for_row_blocks
from .workspace import empty_array, scratch

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_C = 0.044715
_MINUS_2K = -2.0 * _SQRT_2_OVER_PI                 # −2u = x(_MINUS_2K_C·x² + _MINUS_2K)
_MINUS_2K_C = -2.0 * _SQRT_2_OVER_PI * _GELU_C


#: at most this many elements (a few tokens: generation) skip the row-block machinery
SMALL_ELEMENTS = 1 << 13


def activation_forward(x, name: str):
    """Apply ``g`` elementwise.

    Args:
        x: float array of any shape (the paper's ``a7``, ``(B, T, d_mlp)``).
        name: ``"relu"``; ``"gelu"`` (exact, ``x Φ(x)``); ``"gelu_tanh"`` (GPT-2's
            ``½x(1 + tanh(√(2/π)(x + 0.044715x³)))``, HF ``gelu_new``).

    Returns:
        ``(y, cache)`` with ``cache = x``, except for ``"gelu_tanh"`` where ``cache = (x, s)``
        with ``s = ½(1 + tanh u)``, kept so that the backward needs no second ``exp``.
        :func:`activation_backward` accepts either form.

    Raises:
        ValueError: unknown activation name.
    """
    check_activation(name)
    if name == "relu":
        return x * (x > 0), x
    if name == "gelu":
        return 0.5 * x * (1.0 + erf(x * _INV_SQRT_2)), x
    if is_torch_array(x):                              # s = σ(2u), 2u = x(2k + 2k·c·x²): 4 operations
        import torch

        y, s = empty_array(x.shape, x), empty_array(x.shape, x)
        torch.addcmul(x.new_tensor(-_MINUS_2K), x, x, value=-_MINUS_2K_C, out=s)
        s.mul_(x).sigmoid_()
        torch.mul(x, s, out=y)
        return y, (x, s)
    if x.size <= SMALL_ELEMENTS:                       # a few tokens (generation): no row blocks
        s = x * x
        s *= _GELU_C * _SQRT_2_OVER_PI
        s += _SQRT_2_OVER_PI
        s *= x                                         # u = √(2/π)(x + 0.044715x³)
        np.tanh(s, out=s)
        s += 1.0
        s *= 0.5                                       # s = ½(1 + tanh u)
        return x * s, (x, s)
    lib = elementwise_lib(x)
    x2 = x.reshape(-1)
    y, s = empty_array(x.shape, x), empty_array(x.shape, x)
    y2, s2 = y.reshape(-1), s.reshape(-1)

    def kernel(lo: int, hi: int) -> None:                  # in place on s and y
        xb, sb = x2[lo:hi], s2[lo:hi]
        lib.multiply(xb, xb, out=sb)
        lib.multiply(sb, _MINUS_2K_C, out=sb)
        lib.add(sb, _MINUS_2K, out=sb)
        lib.multiply(sb, xb, out=sb)                       # −2u, u = √(2/π)(x + 0.044715x³)
        with np.errstate(over="ignore"):
            lib.exp(sb, out=sb)
        lib.add(sb, 1.0, out=sb)
        lib.divide(1.0, sb, out=sb)                        # s = σ(2u) = ½(1 + tanh u)
        lib.multiply(xb, sb, out=y2[lo:hi])                # g(x) = x s

    for_row_blocks(x, kernel, x2.shape[0], 1)
    return y, (x, s)


def activation_backward(delta, cache, name: str):
    """``Δ_in = Δ ∘ g'(x)``.

    - ReLU: ``g'(x) = [x > 0]``.
    - GELU exact: ``g'(x) = Φ(x) + x φ(x)``.
    - GELU tanh: ``g'(x) = ½(1 + tanh u) + ½x(1 − tanh² u)√(2/π)(1 + 3·0.044715x²)``.

    Args:
        delta: error signal, same shape as ``x``.
        cache: from :func:`activation_forward` (for ``"gelu_tanh"`` the pair ``(x, s)``, which
            saves recomputing ``tanh u``), or the forward input ``x``.
        name: as in :func:`activation_forward`.
    """
    check_activation(name)
    x, s = cache if isinstance(cache, tuple) else (cache, None)
    if name == "relu":
        return delta * (x > 0)
    if name == "gelu":
        xp = array_namespace(x)
        cdf = 0.5 * (1.0 + erf(x * _INV_SQRT_2))
        pdf = _INV_SQRT_2PI * xp.exp(-0.5 * x * x)
        return delta * (cdf + x * pdf)
    # with s = ½(1 + t) = σ(2u): 1 − t² = 4s(1 − s), so g'(x) = s (1 + 2(1 − s) A),
    # A = x√(2/π)(1 + 3·0.044715x²) -- the same formula, in fewer and cheaper passes
    if is_torch_array(x) and s is not None:            # 6 operations
        import torch

        a, b = empty_array(x.shape, x), scratch(x.shape, x, "gelu.1-s")
        torch.addcmul(x.new_tensor(2.0 * _SQRT_2_OVER_PI), x, x, value=6.0 * _GELU_C * _SQRT_2_OVER_PI, out=a)
        a.mul_(x)                                      # 2A
        one = x.new_tensor(1.0)
        torch.sub(one, s, out=b)
        torch.addcmul(one, a, b, out=a)                # 1 + 2A(1 − s)
        return a.mul_(s).mul_(delta)
    lib = elementwise_lib(x)
    x2, d2 = x.reshape(-1), delta.reshape(-1)
    s2 = None if s is None else s.reshape(-1)
    out = empty_array(x.shape, x)
    out2 = out.reshape(-1)

    def kernel(lo: int, hi: int) -> None:
        xb, db, a = x2[lo:hi], d2[lo:hi], out2[lo:hi]
        lib.multiply(xb, xb, out=a)                        # x²
        if s2 is None:
            sb = scratch(a.shape, a, "gelu.s")
            lib.multiply(a, _MINUS_2K_C, out=sb)
            lib.add(sb, _MINUS_2K, out=sb)
            lib.multiply(sb, xb, out=sb)                   # −2u
            with np.errstate(over="ignore"):
                lib.exp(sb, out=sb)
            lib.add(sb, 1.0, out=sb)
            lib.divide(1.0, sb, out=sb)                    # s = σ(2u)
        else:
            sb = s2[lo:hi]
        lib.multiply(a, 6.0 * _GELU_C * _SQRT_2_OVER_PI, out=a)
        lib.add(a, 2.0 * _SQRT_2_OVER_PI, out=a)
        lib.multiply(a, xb, out=a)                         # 2A
        one_minus_s = scratch(a.shape, a, "gelu.1-s")
        lib.subtract(1.0, sb, out=one_minus_s)
        lib.multiply(a, one_minus_s, out=a)
        lib.add(a, 1.0, out=a)
        lib.multiply(a, sb, out=a)                         # g'(x)
        lib.multiply(db, a, out=a)

    for_row_blocks(x, kernel, x2.shape[0], 1)
    return out

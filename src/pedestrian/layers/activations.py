"""Pointwise non-linearities: ReLU, exact GELU, GPT-2's GELU tanh approximation, and Llama's SiLU
(paper section 2; EQUATIONS.md "Fully connected, activations, residual" and "SiLU and the SwiGLU MLP").

Reference implementation: the paper's math only, written against the array API standard.
"""

from __future__ import annotations

import math

from ..backend import array_namespace, erf
from .checks import check_float
from .linear import linear_backward, linear_forward

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715
#: |x| from which σ(x) is exactly 0 or 1 in float32 and float64 (e^-1000 underflows to 0, below
#: float64's smallest subnormal e^-744.4): clipping x there changes no σ, and keeps ±inf out of x·σ
SILU_SATURATE = 1000.0


def check_activation(name: str) -> None:
    """Raises ``ValueError`` naming the choices when ``name`` is not one of :data:`ACTIVATIONS`."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose one of {ACTIVATIONS}")


def sigmoid_pair(x):
    """``(σ(x), 1 − σ(x))``, each to a few ulp relative (no ``1 − σ`` cancellation) and without
    overflow: ``e = exp(−|x|) ∈ [0, 1]``, ``σ(|x|) = 1/(1 + e)``, ``σ(−|x|) = e/(1 + e)``. NaN stays NaN."""
    xp = array_namespace(x)
    e = xp.exp(-xp.abs(x))                                                   # e^{−|x|} in [0, 1]
    p = 1.0 / (1.0 + e)                                                      # σ(|x|)
    q = e * p                                                                # σ(−|x|) = 1 − σ(|x|)
    return xp.where(x >= 0, p, q), xp.where(x >= 0, q, p)                   # σ(x), 1 − σ(x)


def activation_forward(x, name: str):
    """``a8 = g(a7)`` elementwise.

    Args:
        x: float array of any shape (the paper's ``a7``, ``(B, T, d_mlp)``).
        name: ``"relu"``; ``"gelu"`` (exact, ``x Φ(x)``); ``"gelu_tanh"`` (GPT-2's
            ``½x(1 + tanh(√(2/π)(x + 0.044715x³)))``, HF ``gelu_new``).

    Returns:
        ``(y, cache)``, ``y`` of ``x``'s shape; ``cache = x``.

    Raises:
        ValueError: unknown activation name.
        TypeError: ``x`` not real floating point (integers, complex).
    """
    check_activation(name)
    check_float(x, "the activation's input")
    xp = array_namespace(x)
    if name == "relu":
        return xp.where(x <= 0, xp.zeros_like(x), x), x                     # max(x, 0), NaN kept
    zero = xp.zeros_like(x)
    if name == "gelu":
        cdf = 0.5 * (1.0 + erf(x / math.sqrt(2.0)))                         # Φ(x)
        return xp.where(cdf == 0, zero, x * cdf), x                         # x Φ(x); 0 at −∞
    if name == "silu":
        return xp.clip(x, min=-SILU_SATURATE) * sigmoid_pair(x)[0], x       # x σ(x) (−inf -> −0)
    u = _SQRT_2_OVER_PI * (x + _GELU_C * x * x * x)                          # u = √(2/π)(x + 0.044715x³)
    s = 0.5 * (1.0 + xp.tanh(u))                                             # ½(1 + tanh u)
    return xp.where(s == 0, zero, x * s), x                                 # ½x(1 + tanh u); 0 at −∞


def activation_backward(delta, cache, name: str):
    """``Δ_in = Δ ∘ g'(x)``.

    - ReLU: ``g'(x) = [x > 0]`` (NaN at a NaN ``x``: the signal does not turn finite).
    - GELU exact: ``g'(x) = Φ(x) + x φ(x)``.
    - GELU tanh: ``g'(x) = ½(1 + tanh u) + ½x(1 − tanh² u)√(2/π)(1 + 3·0.044715x²)``.
    - SiLU: ``g'(x) = σ(x)(1 + x(1 − σ(x)))`` (``0`` at ``−inf``, ``1`` at ``+inf``, where PyTorch gives NaN).

    In the tails a product whose small factor (``Φ``, ``φ``, ``1 − tanh² u``) rounds to 0 is 0,
    not ``0 · ∞ = NaN`` where ``x`` or ``x²`` overflows: ``g(−∞) = 0``, ``g'(−∞) = 0``, ``g'(∞) = 1``.

    Args:
        delta: error signal, ``x``'s shape.
        cache: from :func:`activation_forward` (the input ``x``).
        name: as in :func:`activation_forward`.
    """
    check_activation(name)
    xp = array_namespace(delta)
    x = cache
    if name == "relu":
        step = xp.where(x > 0, xp.ones_like(x), xp.where(x <= 0, xp.zeros_like(x), x))  # 1, 0, NaN
        return delta * step
    zero = xp.zeros_like(x)
    if name == "gelu":
        cdf = 0.5 * (1.0 + erf(x / math.sqrt(2.0)))                         # Φ(x)
        pdf = xp.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)               # φ(x)
        return delta * (cdf + xp.where(pdf == 0, zero, x * pdf))
    if name == "silu":
        s, s_bar = sigmoid_pair(x)                                           # σ(x), 1 − σ(x)
        return delta * (s * (1.0 + xp.clip(x, min=-SILU_SATURATE, max=SILU_SATURATE) * s_bar))
    t = xp.tanh(_SQRT_2_OVER_PI * (x + _GELU_C * x * x * x))                 # tanh u
    du_dx = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * x * x)
    sech2 = 1.0 - t * t                                                      # 1 − tanh² u
    return delta * (0.5 * (1.0 + t) + xp.where(sech2 == 0, zero, 0.5 * x * sech2 * du_dx))


def linear_activation_forward(x, weight, bias, name: str):
    """``a7 = a6 W + b``, ``a8 = g(a7)``: the MLP's expand layer and its activation, one call so
    that a fast path may add the bias and apply ``g`` in one pass after the product.

    Args:
        x: ``(..., f_in)`` float array (``a6``); weight: ``(f_in, f_out)``; bias: ``(f_out,)`` or
            ``None`` (:func:`~pedestrian.layers.linear.linear_forward`).
        name: as in :func:`activation_forward`.

    Returns:
        ``((a7, a8), cache)``: both ``(..., f_out)``; ``cache = (x, the activation's cache)``.
    """
    a7, _ = linear_forward(x, weight, bias)                                  # (..., f_out) x W + b
    a8, act = activation_forward(a7, name)                                   # (..., f_out) g(a7)
    return (a7, a8), (x, act)


def linear_activation_backward(delta, cache, weight, name: str, *, dweight=None, dbias=None):
    """``Δ7 = Δ8 ∘ g'(a7)``, then the expand layer's ``dW = a6ᵀ Δ7``, ``db = Σ_tokens Δ7``, ``Δ6 = Δ7 Wᵀ``.

    Args:
        delta: ``(..., f_out)`` the signal at ``a8``; cache: from :func:`linear_activation_forward`.
        weight, dweight, dbias: as in :func:`~pedestrian.layers.linear.linear_backward` (written).
        name: as in :func:`activation_forward`.

    Returns:
        ``(Δ6, Δ7)``: ``(..., f_in)`` and ``(..., f_out)``.
    """
    x, act = cache
    d7 = activation_backward(delta, act, name)                               # (..., f_out) Δ8 ∘ g'(a7)
    d6 = linear_backward(d7, x, weight, dweight=dweight, dbias=dbias)        # (..., f_in) Δ7 Wᵀ
    return d6, d7

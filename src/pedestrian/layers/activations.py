"""Pointwise non-linearities: ReLU, exact GELU, GPT-2's GELU tanh approximation
(paper section 2; EQUATIONS.md "Fully connected, activations, residual").

Reference implementation: the paper's math only, written against the array API standard.
"""

from __future__ import annotations

import math

from ..backend import array_namespace, erf

ACTIVATIONS = ("relu", "gelu", "gelu_tanh")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


def check_activation(name: str) -> None:
    """Raises ``ValueError`` naming the choices when ``name`` is not one of :data:`ACTIVATIONS`."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose one of {ACTIVATIONS}")


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
    """
    check_activation(name)
    xp = array_namespace(x)
    if name == "relu":
        return xp.where(x > 0, x, xp.zeros_like(x)), x                      # max(x, 0)
    if name == "gelu":
        return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0))), x                 # x Φ(x)
    u = _SQRT_2_OVER_PI * (x + _GELU_C * x * x * x)                          # u = √(2/π)(x + 0.044715x³)
    return 0.5 * x * (1.0 + xp.tanh(u)), x                                  # ½x(1 + tanh u)


def activation_backward(delta, cache, name: str):
    """``Δ_in = Δ ∘ g'(x)``.

    - ReLU: ``g'(x) = [x > 0]``.
    - GELU exact: ``g'(x) = Φ(x) + x φ(x)``.
    - GELU tanh: ``g'(x) = ½(1 + tanh u) + ½x(1 − tanh² u)√(2/π)(1 + 3·0.044715x²)``.

    Args:
        delta: error signal, ``x``'s shape.
        cache: from :func:`activation_forward` (the input ``x``).
        name: as in :func:`activation_forward`.
    """
    check_activation(name)
    xp = array_namespace(delta)
    x = cache
    if name == "relu":
        return delta * xp.astype(x > 0, x.dtype)
    if name == "gelu":
        cdf = 0.5 * (1.0 + erf(x / math.sqrt(2.0)))                         # Φ(x)
        pdf = xp.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)               # φ(x)
        return delta * (cdf + x * pdf)
    t = xp.tanh(_SQRT_2_OVER_PI * (x + _GELU_C * x * x * x))                 # tanh u
    du_dx = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * x * x)
    return delta * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du_dx)

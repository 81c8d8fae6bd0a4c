"""Pointwise non-linearities: ReLU, exact GELU, GELU tanh approximation (EQUATIONS.md)."""

from __future__ import annotations

import math

from ..backend import array_namespace, erf

ACTIVATIONS = ("relu", "gelu", "gelu_tanh")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_C = 0.044715


def _check(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose one of {ACTIVATIONS}")


def activation_forward(x, name: str):
    """Apply ``g`` elementwise.

    Args:
        x: float array of any shape (the paper's ``a7``, ``(B, T, d_mlp)``).
        name: ``"relu"``; ``"gelu"`` (exact, ``x Φ(x)``); ``"gelu_tanh"`` (GPT-2's
            ``½x(1 + tanh(√(2/π)(x + 0.044715x³)))``, HF ``gelu_new``).

    Returns:
        ``(y, cache)`` with ``cache = x``.

    Raises:
        ValueError: unknown activation name.
    """
    _check(name)
    xp = array_namespace(x)
    if name == "relu":
        return x * (x > 0), x
    if name == "gelu":
        return 0.5 * x * (1.0 + erf(x * _INV_SQRT_2)), x
    u = _SQRT_2_OVER_PI * (x + _GELU_C * x * x * x)
    return 0.5 * x * (1.0 + xp.tanh(u)), x


def activation_backward(delta, x, name: str):
    """``Δ_in = Δ ∘ g'(x)``.

    - ReLU: ``g'(x) = [x > 0]``.
    - GELU exact: ``g'(x) = Φ(x) + x φ(x)``.
    - GELU tanh: ``g'(x) = ½(1 + tanh u) + ½x(1 − tanh² u)√(2/π)(1 + 3·0.044715x²)``.

    Args:
        delta: error signal, same shape as ``x``.
        x: the forward input (the cache).
        name: as in :func:`activation_forward`.
    """
    _check(name)
    xp = array_namespace(x)
    if name == "relu":
        return delta * (x > 0)
    if name == "gelu":
        cdf = 0.5 * (1.0 + erf(x * _INV_SQRT_2))
        pdf = _INV_SQRT_2PI * xp.exp(-0.5 * x * x)
        return delta * (cdf + x * pdf)
    x2 = x * x
    t = xp.tanh(_SQRT_2_OVER_PI * (x + _GELU_C * x2 * x))
    grad = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * x2)
    return delta * grad

"""Skip connection ``y = x + f(x)`` (paper conclusion; EQUATIONS.md "Skip/Add"), and the skip
with the norm that follows it (``a5 = x + a4``, ``a6 = LN2(a5)``).

Backward: the incoming ``Δ`` goes unchanged to both branches, so the signal at ``x`` is the
sum of the skip's ``Δ`` and the signal that comes back through ``f``: the same addition.

Reference implementation: the paper's math only, written against the array API standard.
"""

from __future__ import annotations

from .layernorm import layernorm_backward, layernorm_forward
from .rmsnorm import rmsnorm_backward, rmsnorm_forward


def add(a, b):
    """``a + b`` for two arrays of the same shape: a skip's output (``a5 = a1 + a4``) in the
    forward, and the meeting of two error signals at one activation (``Δ5 = Δ10 + LN2ᵀ(Δ6)``)
    in the backward."""
    return a + b


def add_layernorm_forward(x, r, weight, bias, eps: float):
    """``s = x + r``, ``y = LN(s)``: a skip and the layer norm after it (``a5 = x + a4``, ``a6 =
    LN2(a5)``), one call so that a fast path may do both in one pass.

    Args:
        x, r: ``(..., d)`` float arrays of one shape (the skip's two branches).
        weight, bias, eps: as in :func:`pedestrian.layers.layernorm.layernorm_forward`.

    Returns:
        ``((s, y), cache)``: both ``(..., d)``; ``cache`` the layer norm's (of ``s``).
    """
    s = add(x, r)                                                            # (..., d) the skip
    y, cache = layernorm_forward(s, weight, bias, eps)                       # (..., d)
    return (s, y), cache


def add_layernorm_backward(delta, cache, delta_skip, *, dweight=None, dbias=None):
    """``Δ_s = Δ_skip + LNᵀ(Δ)``: the signal at a skip's output ``s`` that also feeds a layer norm
    (``Δ5 = Δ10 + LN2ᵀ(Δ6)``, ``Δ_x = Δ5 + LN1ᵀ(Δ2)``).

    Args:
        delta: ``(..., d)`` the signal at the norm's output; cache: from
            :func:`add_layernorm_forward` or :func:`~pedestrian.layers.layernorm.layernorm_forward`.
        delta_skip: ``(..., d)`` the signal that reaches ``s`` along the skip.
        dweight, dbias: as in :func:`pedestrian.layers.layernorm.layernorm_backward` (written).

    Returns:
        ``Δ_s`` ``(..., d)``.
    """
    return add(delta_skip, layernorm_backward(delta, cache, dweight=dweight, dbias=dbias))   # (..., d)


def add_rmsnorm_forward(x, r, weight, eps: float, *, offset: float = 0.0):
    """``s = x + r``, ``y = RMSNorm(s)`` (:func:`add_layernorm_forward` with the RMS norm; ``offset``
    as :func:`~pedestrian.layers.rmsnorm.rmsnorm_forward`'s).

    Returns:
        ``((s, y), cache)``: both ``(..., d)``; ``cache`` the RMS norm's (of ``s``).
    """
    s = add(x, r)                                                            # (..., d) the skip
    y, cache = rmsnorm_forward(s, weight, eps, offset=offset)                # (..., d)
    return (s, y), cache


def add_rmsnorm_backward(delta, cache, delta_skip, *, dweight=None):
    """``Δ_s = Δ_skip + RMSNormᵀ(Δ)`` (:func:`add_layernorm_backward` with the RMS norm)."""
    return add(delta_skip, rmsnorm_backward(delta, cache, dweight=dweight))   # (..., d)

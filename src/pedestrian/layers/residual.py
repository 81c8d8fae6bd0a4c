"""Skip connection ``y = x + f(x)`` (paper conclusion; EQUATIONS.md "Skip/Add").

Backward: the incoming ``Δ`` goes unchanged to both branches, so the signal at ``x`` is the
sum of the skip's ``Δ`` and the signal that comes back through ``f``: the same addition.
"""

from __future__ import annotations


def add(a, b):
    """``a + b`` for two arrays of the same shape: a skip's output (``a5 = a1 + a4``) in the
    forward, and the meeting of two error signals at one activation (``Δ5 = Δ10 + LN2ᵀ(Δ6)``)
    in the backward."""
    return a + b

"""Layer normalization over the feature axis (paper section 5; EQUATIONS.md "Layer normalization").

Reference implementation: the paper's math only, written against the array API standard.
"""

from __future__ import annotations

from ..backend import array_namespace
from .checks import check_float


def check_eps(eps: float) -> None:
    """Raises ``ValueError`` for ``eps < 0``."""
    if not eps >= 0:
        raise ValueError(f"layer norm eps must be >= 0, got {eps}")


def layernorm_forward(x, weight, bias, eps: float):
    """Per token: ``x̂ = (x − μ)/σ``, ``σ = sqrt(var_f(x) + eps)`` (biased variance), ``y = x̂ ∘ w + b``.

    Args:
        x: ``(..., d)`` float array.
        weight: ``(d,)``; bias: ``(d,)`` or ``None``.
        eps: ``>= 0``. The paper uses 0 (a constant row then divides by zero: ``nan``);
            PyTorch and GPT-2 use ``1e-5``.

    Returns:
        ``(y, cache)`` with ``cache = (x̂, 1/σ, weight)``; ``x̂`` is ``(..., d)``, ``1/σ`` is ``(..., 1)``.

    Raises:
        ValueError: ``eps < 0``.
        TypeError: ``x`` not real floating point.
    """
    check_eps(eps)
    check_float(x, "the layer norm's input")
    xp = array_namespace(x)
    mu = xp.mean(x, axis=-1, keepdims=True)                                  # (..., 1)
    var = xp.mean((x - mu) ** 2, axis=-1, keepdims=True)                     # (..., 1) biased
    rstd = 1.0 / xp.sqrt(var + eps)                                          # 1/σ, (..., 1)
    xhat = (x - mu) * rstd                                                   # (..., d)
    y = xhat * weight if bias is None else xhat * weight + bias              # (..., d)
    return y, (xhat, rstd, weight)


def layernorm_backward(delta, cache, *, dweight=None, dbias=None):
    """``Δ_in = (1/σ)(g − mean_f(g) − x̂ ∘ mean_f(g ∘ x̂))`` with ``g = Δ ∘ w``; exact for any eps.

    Also ``dw = Σ_tokens x̂ ∘ Δ`` and ``db = Σ_tokens Δ``.

    Args:
        delta: ``(..., d)`` error signal at the output.
        cache: from :func:`layernorm_forward`.
        dweight, dbias: ``(d,)`` arrays the gradients are written into, or ``None`` (frozen).

    Returns:
        ``Δ_in`` ``(..., d)``.
    """
    xp = array_namespace(delta)
    xhat, rstd, weight = cache
    d = delta.shape[-1]
    if dweight is not None:
        dweight[...] = xp.sum(xp.reshape(xhat * delta, (-1, d)), axis=0)    # (d,)
    if dbias is not None:
        dbias[...] = xp.sum(xp.reshape(delta, (-1, d)), axis=0)             # (d,)
    g = delta * weight                                                       # (..., d)
    mean_g = xp.mean(g, axis=-1, keepdims=True)                              # (..., 1)
    mean_gx = xp.mean(g * xhat, axis=-1, keepdims=True)                      # (..., 1)
    return rstd * (g - mean_g - xhat * mean_gx)                              # (..., d)

"""Layer normalization over the feature axis (paper section 5; EQUATIONS.md)."""

from __future__ import annotations

from ..backend import array_namespace


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
    """
    if eps < 0:
        raise ValueError(f"layer norm eps must be >= 0, got {eps}")
    xp = array_namespace(x)
    mean = xp.mean(x, axis=-1, keepdims=True)
    xc = x - mean
    var = xp.mean(xc * xc, axis=-1, keepdims=True)
    rstd = 1.0 / xp.sqrt(var + eps)
    xhat = xc * rstd
    y = xhat * weight
    if bias is not None:
        y += bias
    return y, (xhat, rstd, weight)


def layernorm_backward(delta, cache, *, need_params=True):
    """``Δ_in = (1/σ)(g − mean_f(g) − x̂ ∘ mean_f(g ∘ x̂))`` with ``g = Δ ∘ w``.

    Also ``dw = Σ_tokens x̂ ∘ Δ`` and ``db = Σ_tokens Δ``. Exact for any ``eps``.

    Args:
        delta: ``(..., d)`` error signal at the output.
        cache: from :func:`layernorm_forward`.
        need_params: compute ``dw``, ``db`` (skip when the layer is frozen).

    Returns:
        ``(delta_in, d_weight, d_bias)`` (the last two ``None`` when not needed).
    """
    xp = array_namespace(delta)
    xhat, rstd, weight = cache
    g = delta * weight
    mean_g = xp.mean(g, axis=-1, keepdims=True)
    mean_gx = xp.mean(g * xhat, axis=-1, keepdims=True)
    delta_in = rstd * (g - mean_g - xhat * mean_gx)
    d_weight = d_bias = None
    if need_params:
        d = delta.shape[-1]
        d_weight = xp.sum(xp.reshape(xhat * delta, (-1, d)), axis=0)
        d_bias = xp.sum(xp.reshape(delta, (-1, d)), axis=0)
    return delta_in, d_weight, d_bias

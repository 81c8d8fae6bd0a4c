"""RMS normalization over the feature axis (Llama, Qwen2, Mistral; Zhang and Sennrich 2019;
EQUATIONS.md "RMS normalization").

Reference implementation: the paper's math only, written against the array API standard.
"""

from __future__ import annotations

from ..backend import array_namespace


def check_rms_eps(eps: float) -> None:
    """Raises ``ValueError`` for ``eps < 0``."""
    if not eps >= 0:
        raise ValueError(f"RMS norm eps must be >= 0, got {eps} (Llama uses 1e-5 or 1e-6)")


def rmsnorm_forward(x, weight, eps: float, *, offset: float = 0.0):
    """Per token: ``r = sqrt(mean_f(x²) + eps)``, ``x̂ = x / r``, ``y = x̂ ∘ (offset + w)`` (no mean,
    no bias; ``offset = 1`` is Gemma's ``x̂ ∘ (1 + w)``, weights stored around 0).

    Computed in ``x``'s own dtype (float32 or float64). Hugging Face's ``LlamaRMSNorm`` computes
    in float32 whatever the input (it upcasts float16 / bfloat16 so ``x²`` cannot overflow, and
    downcasts float64), then rounds ``x̂`` to the input dtype and multiplies by ``w``: the same
    order as here (``x̂`` first, then ``∘ w``), so float32 results agree to a few float32 roundings,
    and float64 ones keep float64 accuracy where HF's carry float32's error.

    Args:
        x: ``(..., d)`` float array.
        weight: ``(d,)`` (Llama's ``input_layernorm.weight``, initialised to ones).
        eps: ``>= 0`` (HF ``rms_norm_eps``: 1e-5 Llama 2 / SmolLM2, 1e-6 Llama 3 / Qwen2); 0 makes
            an all-zero row ``0/0 = nan``.
        offset: added to ``w`` before the product (``GPTConfig.norm_offset``; Gemma's
            ``GemmaRMSNorm`` rounds ``1 + w`` first as well). ``dw`` is unchanged by it.

    Returns:
        ``(y, cache)`` with ``cache = (x̂, 1/r, offset + weight)``; ``x̂`` is ``(..., d)``, ``1/r`` is ``(..., 1)``.

    Raises:
        ValueError: ``eps < 0``.
    """
    check_rms_eps(eps)
    xp = array_namespace(x)
    ms = xp.mean(x * x, axis=-1, keepdims=True)                              # mean_f x², (..., 1)
    rrms = 1.0 / xp.sqrt(ms + eps)                                           # 1/r, (..., 1)
    xhat = x * rrms                                                          # (..., d)
    scale = weight if offset == 0 else offset + weight                       # (d,) the scale w (+ 1)
    return xhat * scale, (xhat, rrms, scale)                                 # y (..., d)


def rmsnorm_backward(delta, cache, *, dweight=None):
    """``Δ_in = (1/r)(g − x̂ ∘ mean_f(g ∘ x̂))`` with ``g = Δ ∘ (offset + w)``; ``dw = Σ_tokens x̂ ∘ Δ``.

    Layer norm's backward without its ``− mean_f(g)`` term (no mean was subtracted); exact for any eps.
    The offset is a constant, so ``∂(offset + w)/∂w = 1``: ``dw`` has no term of it.

    Args:
        delta: ``(..., d)`` error signal at the output.
        cache: from :func:`rmsnorm_forward`.
        dweight: ``(d,)`` array the gradient is written into, or ``None`` (frozen).

    Returns:
        ``Δ_in`` ``(..., d)``.
    """
    xp = array_namespace(delta)
    xhat, rrms, weight = cache
    d = delta.shape[-1]
    if dweight is not None:
        dweight[...] = xp.sum(xp.reshape(xhat * delta, (-1, d)), axis=0)    # (d,)
    g = delta * weight                                                       # (..., d) (weight: offset + w)
    mean_gx = xp.mean(g * xhat, axis=-1, keepdims=True)                      # (..., 1)
    return rrms * (g - xhat * mean_gx)                                       # (..., d)

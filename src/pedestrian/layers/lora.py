"""LoRA adapter on a fully connected layer (paper section 6; EQUATIONS.md "LoRA").

Convention: the adapter adds ``α · x D U`` with a plain scalar ``α`` (the paper's). Hugging
Face PEFT writes the same thing as ``(lora_alpha / r) · x Aᵀ Bᵀ``; convert with
``α = lora_alpha / r``, ``D = Aᵀ``, ``U = Bᵀ``.
"""

from __future__ import annotations

from ..backend import array_namespace


def lora_forward(x, lora_D, lora_U, alpha: float):
    """The adapter's branch ``α · (x D) U``, added by the caller to the frozen ``x W + b``.

    Args:
        x: ``(..., f_in)``.
        lora_D: ``(f_in, r)``; lora_U: ``(r, f_out)``.
        alpha: scalar scale.

    Returns:
        ``(y_lora, cache)``: ``(..., f_out)``; ``cache = (x, x D)``. ``D U`` is never formed.
    """
    xp = array_namespace(x)
    f_in, r = lora_D.shape
    h = xp.reshape(x, (-1, f_in)) @ lora_D                       # (N, r)
    y = xp.reshape((alpha * h) @ lora_U, (*x.shape[:-1], lora_U.shape[1]))
    return y, (x, h)


def lora_backward(delta, cache, lora_D, lora_U, alpha: float, *, need_input=True):
    """``dD = α xᵀ (Δ Uᵀ)``, ``dU = α (x D)ᵀ Δ``, input signal ``α (Δ Uᵀ) Dᵀ``.

    ``Δ Uᵀ`` is computed once. The frozen base layer's ``Δ Wᵀ`` is added by the caller.

    Returns:
        ``(delta_in_lora, d_D, d_U)``; ``delta_in_lora`` is ``None`` when not needed.
    """
    xp = array_namespace(delta)
    x, h = cache
    f_in, r = lora_D.shape
    d2 = xp.reshape(delta, (-1, lora_U.shape[1]))
    g = d2 @ xp.matrix_transpose(lora_U)                        # (N, r) = Δ Uᵀ
    d_U = alpha * (xp.matrix_transpose(h) @ d2)
    d_D = alpha * (xp.matrix_transpose(xp.reshape(x, (-1, f_in))) @ g)
    delta_in = None
    if need_input:
        delta_in = xp.reshape(alpha * (g @ xp.matrix_transpose(lora_D)), (*delta.shape[:-1], f_in))
    return delta_in, d_D, d_U

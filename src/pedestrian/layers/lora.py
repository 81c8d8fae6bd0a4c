"""LoRA adapter on a fully connected layer (paper section 6; EQUATIONS.md "LoRA").

Convention: the adapter adds ``α · x D U`` with a plain scalar ``α`` (the paper's). Hugging
Face PEFT writes the same thing as ``(lora_alpha / r) · x Aᵀ Bᵀ``; convert with
``α = lora_alpha / r``, ``D = Aᵀ``, ``U = Bᵀ``.

Reference implementation: the paper's math only, written against the array API standard.
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
    h = x @ lora_D                                          # (..., r)
    return alpha * (h @ lora_U), (x, h)                     # (..., f_out)


def lora_backward(delta, cache, lora_D, lora_U, alpha: float, *, dD=None, dU=None, need_input=True):
    """``dD = α xᵀ (Δ Uᵀ)``, ``dU = α (x D)ᵀ Δ``, input signal ``α (Δ Uᵀ) Dᵀ``.

    ``Δ Uᵀ`` is computed once. The frozen base layer's ``Δ Wᵀ`` is added by the caller.

    Args:
        delta: ``(..., f_out)``; cache: from :func:`lora_forward`.
        dD, dU: ``(f_in, r)`` / ``(r, f_out)`` arrays the gradients are written into (or ``None``).
        need_input: compute the adapter's share of ``Δ_in``.

    Returns:
        the adapter's share of ``Δ_in`` ``(..., f_in)``, or ``None`` when not asked for.
    """
    xp = array_namespace(delta)
    x, h = cache
    f_in, r = lora_D.shape
    delta_rows = xp.reshape(delta, (-1, lora_U.shape[1]))                    # (N, f_out)
    g = delta_rows @ xp.matrix_transpose(lora_U)                             # (N, r) = Δ Uᵀ
    if dU is not None:
        dU[...] = alpha * (xp.matrix_transpose(xp.reshape(h, (-1, r))) @ delta_rows)     # (r, f_out)
    if dD is not None:
        dD[...] = alpha * (xp.matrix_transpose(xp.reshape(x, (-1, f_in))) @ g)          # (f_in, r)
    if not need_input:
        return None
    return xp.reshape(alpha * (g @ xp.matrix_transpose(lora_D)), (*delta.shape[:-1], f_in))

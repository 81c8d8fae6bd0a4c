"""LoRA adapter on a fully connected layer (paper section 6; EQUATIONS.md "LoRA").

Convention: the adapter adds ``α · dropout(x) D U`` with a plain scalar ``α`` (the paper's).
Hugging Face PEFT writes the same thing as ``(lora_alpha / r) · dropout(x) Aᵀ Bᵀ``; convert
with ``α = lora_alpha / r``, ``D = Aᵀ``, ``U = Bᵀ``. The dropout is PEFT's ``lora_dropout``: it
acts on the adapter's input only (the frozen ``x W + b`` sees ``x`` itself), and only in
training; the caller draws its mask.

Reference implementation: the paper's math only, written against the array API standard.
"""

from __future__ import annotations

from ..backend import array_namespace


def lora_forward(x, lora_D, lora_U, alpha: float, mask=None, *, add_to=None):
    """The adapter's branch ``α · ((x ∘ m) D) U``, added to the frozen ``x W + b`` (by the caller,
    or here into ``add_to``).

    Args:
        x: ``(..., f_in)`` float array.
        lora_D: ``(f_in, r)``; lora_U: ``(r, f_out)``, same dtype.
        alpha: scalar scale (PEFT's ``lora_alpha / r``).
        mask: the inverted-dropout mask ``m`` of the adapter's input, shaped like ``x`` and
            holding ``0`` or ``1/(1-p)`` (what :func:`pedestrian.layers.dropout.dropout_forward`
            returns), or ``None`` for no dropout (evaluation, or ``p = 0``).
        add_to: optional ``(..., f_out)`` array (a view may do: the frozen layer's output, or the
            adapter's columns of it) the branch is added into, in place.

    Returns:
        ``(y_lora, cache)``: ``(..., f_out)`` (``add_to`` itself when given, the branch added);
        ``cache = (x ∘ m, (x ∘ m) D, m)``. ``D U`` is never formed.
    """
    x_in = x if mask is None else x * mask                  # (..., f_in)  dropout(x)
    h = x_in @ lora_D                                       # (..., r)
    y = alpha * (h @ lora_U)                                # (..., f_out)
    if add_to is None:
        return y, (x_in, h, mask)
    add_to += y                                             # (..., f_out)  x W + α x D U
    return add_to, (x_in, h, mask)


def lora_backward(delta, cache, lora_D, lora_U, alpha: float, *, dD=None, dU=None, need_input=True,
                  add_to=None):
    """``dD = α (x∘m)ᵀ (Δ Uᵀ)``, ``dU = α ((x∘m) D)ᵀ Δ``, input signal ``(α (Δ Uᵀ) Dᵀ) ∘ m``.

    ``Δ Uᵀ`` is computed once. The dropout mask ``m`` (kept in the cache) enters twice: the
    gradients see the dropped input, and the input signal is masked like the forward input
    (inverted dropout's backward). The frozen base layer's ``Δ Wᵀ`` is added by the caller.

    Args:
        delta: ``(..., f_out)``; cache: from :func:`lora_forward`.
        dD, dU: ``(f_in, r)`` / ``(r, f_out)`` arrays the gradients are written into (or ``None``).
        need_input: compute the adapter's share of ``Δ_in``.
        add_to: optional ``(..., f_in)`` array (the frozen layer's ``Δ Wᵀ``) the share is
            added into, in place.

    Returns:
        the adapter's share of ``Δ_in`` ``(..., f_in)`` (``add_to`` itself when given, the
        share added), or ``None`` when not asked for.
    """
    xp = array_namespace(delta)
    x_in, h, mask = cache
    f_in, r = lora_D.shape
    delta_rows = xp.reshape(delta, (-1, lora_U.shape[1]))                    # (N, f_out)
    g = delta_rows @ xp.matrix_transpose(lora_U)                             # (N, r) = Δ Uᵀ
    if dU is not None:
        dU[...] = alpha * (xp.matrix_transpose(xp.reshape(h, (-1, r))) @ delta_rows)       # (r, f_out)
    if dD is not None:
        dD[...] = alpha * (xp.matrix_transpose(xp.reshape(x_in, (-1, f_in))) @ g)         # (f_in, r)
    if not need_input:
        return None
    share = xp.reshape(alpha * (g @ xp.matrix_transpose(lora_D)), (*delta.shape[:-1], f_in))  # (..., f_in)
    share = share if mask is None else share * mask                          # (..., f_in)
    if add_to is None:
        return share
    add_to += share                                                          # (..., f_in)  Δ Wᵀ + share
    return add_to

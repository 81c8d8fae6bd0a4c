"""LoRA's branch on the GPU, added into the frozen layer's product (reference:
:mod:`pedestrian.layers.lora`; EQUATIONS.md "LoRA").

Products only, so cuBLAS through torch, as the CPU path does with BLAS (:mod:`pedestrian.kernels.lora`):
the branch ``α (x D) U`` is added into the frozen layer's output by the last product itself
(``addmm_`` with ``β = 1``: no ``(N, f_out)`` temporary, no pass to scale or add it), the input
signal ``α (Δ Uᵀ) Dᵀ`` into the frozen layer's ``Δ Wᵀ`` the same way, and ``dD``, ``dU`` written
into the gradient buffer with the ``α`` in the product (``β = 0``: what the buffer held is ignored).
"""

from __future__ import annotations

import torch


def _rows(x, width: int):
    """``x`` ``(..., width)`` as a 2-D view ``(N, width)`` (``None`` where that needs a copy)."""
    try:
        return x.view(-1, width)
    except RuntimeError:
        return None


def lora_forward(x, lora_D, lora_U, alpha: float, mask=None, *, add_to=None):
    """The adapter's branch ``α · ((x ∘ m) D) U``, added to the frozen ``x W + b`` (here into ``add_to``).

    GPU :func:`pedestrian.layers.lora.lora_forward` (same arguments, results, cache ``(x ∘ m, (x ∘ m) D, m)``)."""
    x_in = x if mask is None else x * mask                                  # (..., f_in)
    f_in, r = lora_D.shape
    h = x_in.reshape(-1, f_in) @ lora_D                                     # (N, r)
    cache = (x_in, h.reshape(*x.shape[:-1], r), mask)
    out2 = None if add_to is None else _rows(add_to, lora_U.shape[1])
    if out2 is not None:
        out2.addmm_(h, lora_U, beta=1.0, alpha=float(alpha))                # x W + b + α h U, in place
        return add_to, cache
    y = (float(alpha) * (h @ lora_U)).reshape(*x.shape[:-1], lora_U.shape[1])
    if add_to is None:
        return y, cache
    add_to += y
    return add_to, cache


def lora_backward(delta, cache, lora_D, lora_U, alpha: float, *, dD=None, dU=None, need_input=True,
                  add_to=None):
    """``dD = α (x∘m)ᵀ (Δ Uᵀ)``, ``dU = α ((x∘m) D)ᵀ Δ``, input signal ``(α (Δ Uᵀ) Dᵀ) ∘ m``.

    GPU :func:`pedestrian.layers.lora.lora_backward` (same arguments and contract)."""
    x_in, h, mask = cache
    f_in, r = lora_D.shape
    f_out = lora_U.shape[1]
    a = float(alpha)
    delta_rows = delta.reshape(-1, f_out)                                   # (N, f_out)
    g = delta_rows @ lora_U.T                                               # (N, r) = Δ Uᵀ
    for grad, left, right in ((dU, h.reshape(-1, r).T, delta_rows), (dD, x_in.reshape(-1, f_in).T, g)):
        if grad is None:
            continue
        if grad.is_contiguous():
            grad.addmm_(left, right, beta=0.0, alpha=a)                     # written, α inside the product
        else:
            grad.copy_(a * (left @ right))
    if not need_input:
        return None
    din2 = None if add_to is None or mask is not None else _rows(add_to, f_in)
    if din2 is not None:
        din2.addmm_(g, lora_D.T, beta=1.0, alpha=a)                         # Δ Wᵀ + α g Dᵀ, in place
        return add_to
    share = (a * (g @ lora_D.T)).reshape(*delta.shape[:-1], f_in)
    share = share if mask is None else share * mask
    if add_to is None:
        return share
    add_to += share
    return add_to

"""Fast kernels for the LoRA adapter (reference: :mod:`pedestrian.layers.lora`; paper section 6,
EQUATIONS.md "LoRA").

The same five products as the reference, each through :func:`pedestrian.kernels.blas.matmul_into`:
numba's threads share them, each block one single-threaded BLAS call. The reference's ``a @ b``
calls NumPy's own BLAS, whose threads keep spinning after each of the adapter's small products
and then compete with numba's for the cores: on 2 cores that made a LoRA step of SmolLM2's shape
1.7x slower than with the adapters on numba's threads (docs/performance.md, "LoRA").
"""

from __future__ import annotations

from . import schedule
from .blas import few_rows_matmul, matmul_into
from .workspace import empty_array


def _product(a, b):
    """``a @ b`` of 2-D arrays on numba's threads; a few tokens' (both ``a`` and the product
    small) as the linear layer's, :func:`~pedestrian.kernels.blas.few_rows_matmul`. A product
    with the rank as its short side, ``(N, r) @ (r, f)``, is not small: it is the adapter's largest."""
    if a.shape[0] * max(a.shape[1], b.shape[1]) <= schedule.SMALL_ELEMENTS:
        return few_rows_matmul(a, b)
    out = empty_array((a.shape[0], b.shape[1]), a)
    matmul_into(out, a, b)
    return out


def lora_forward(x, lora_D, lora_U, alpha: float, mask=None):
    """``α · ((x ∘ m) D) U``: fast :func:`pedestrian.layers.lora.lora_forward` (same arguments,
    shapes, dtypes and cache ``(x ∘ m, (x ∘ m) D, m)``)."""
    x_in = x if mask is None else x * mask                         # (..., f_in)
    f_in, r = lora_D.shape
    h = _product(x_in.reshape(-1, f_in), lora_D)                    # (N, r)
    y = _product(h, lora_U)                                         # (N, f_out)
    y *= alpha
    lead = x.shape[:-1]
    return y.reshape(*lead, lora_U.shape[1]), (x_in, h.reshape(*lead, r), mask)


def lora_backward(delta, cache, lora_D, lora_U, alpha: float, *, dD=None, dU=None, need_input=True):
    """``dD = α (x∘m)ᵀ (Δ Uᵀ)``, ``dU = α ((x∘m) D)ᵀ Δ``, ``Δ_in = (α (Δ Uᵀ) Dᵀ) ∘ m``: fast
    :func:`pedestrian.layers.lora.lora_backward` (same arguments and contract; ``dD``, ``dU``
    written in place)."""
    x_in, h, mask = cache
    f_in, r = lora_D.shape
    delta_rows = delta.reshape(-1, lora_U.shape[1])                 # (N, f_out)
    g = _product(delta_rows, lora_U.T)                              # (N, r) = Δ Uᵀ
    if dU is not None:
        matmul_into(dU, h.reshape(-1, r).T, delta_rows)             # (r, f_out)
        dU *= alpha
    if dD is not None:
        matmul_into(dD, x_in.reshape(-1, f_in).T, g)                # (f_in, r)
        dD *= alpha
    if not need_input:
        return None
    delta_in = _product(g, lora_D.T)                                # (N, f_in)
    delta_in *= alpha
    if mask is not None:
        delta_in *= mask.reshape(-1, f_in)
    return delta_in.reshape(*delta.shape[:-1], f_in)

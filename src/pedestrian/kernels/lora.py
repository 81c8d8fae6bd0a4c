"""Fast kernels for the LoRA adapter (reference: :mod:`pedestrian.layers.lora`; paper section 6,
EQUATIONS.md "LoRA").

The same products as the reference. Where the caller hands over the base layer's output (or,
without a dropout mask, its input signal) to add into (``add_to``), each direction is one parallel region:
numba's threads take bands of the tokens, and a band runs its products as single-threaded BLAS
calls on views, the last one adding into the caller's array (``gemm`` with ``β = 1``), so the
branch is never a temporary of its own and no NumPy pass scales or adds it; the weight
gradients are summed from the bands' partials. Otherwise each product is one
:func:`pedestrian.kernels.blas.matmul_into`. The reference's ``a @ b`` would call NumPy's own
BLAS, whose threads keep spinning after each of the adapter's small products and then compete
with numba's for the cores (docs/performance.md, "LoRA").
"""

from __future__ import annotations

import numpy as np

from . import schedule
from .blas import few_rows_matmul, gemm_into, gemm_into_scaled, load_gemm, matmul_into
from .jit import AVAILABLE, blas_one_thread, kernel, prange, threads_used
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


def _rows(x, width: int):
    """``x`` ``(..., width)`` as a 2-D view ``(N, width)`` (``None`` where that needs a copy)."""
    rows = x.reshape(-1, width)
    return rows if rows.size == 0 or np.may_share_memory(rows, x) else None   # (a copy shares nothing)


def _fused(*arrays) -> int:
    """Bands of tokens (the first array's rows) for the one-region path (0: not applicable):
    NumPy arrays of one float dtype, each 2-D view with rows of unit stride, and more than a few
    tokens."""
    first = arrays[0]
    if not AVAILABLE or first.size <= schedule.SMALL_ELEMENTS or first.dtype.kind != "f":
        return 0
    for a in arrays:
        if a is None or type(a) is not np.ndarray or a.dtype != first.dtype \
                or a.strides[1] != a.itemsize or a.strides[0] < a.shape[1] * a.itemsize:
            return 0
    blas_one_thread()
    load_gemm()
    return max(1, min(threads_used(), first.shape[0] // schedule.MIN_PART_ROWS))


@kernel(parallel=True, size=lambda x, D, U, *rest:
        x.shape[0] * (x.shape[1] + U.shape[1]) * D.shape[1])                  # multiply-adds
def _forward_bands(x, D, U, alpha, h, out, parts):
    """``h = x D``, ``out += α h U``, in ``parts`` bands of rows (two BLAS calls each)."""
    n = x.shape[0]
    for part in prange(parts):
        lo, hi = n * part // parts, n * (part + 1) // parts
        gemm_into(x[lo:hi], D, h[lo:hi])
        gemm_into_scaled(h[lo:hi], U, out[lo:hi], alpha, 1.0)


@kernel(parallel=True, size=lambda delta, x, h, D, *rest:
        delta.shape[0] * 2 * (delta.shape[1] + x.shape[1]) * D.shape[1])   # multiply-adds
def _backward_bands(delta, x, h, D, U, alpha, g, dD_parts, dU_parts, delta_in, parts):
    """In ``parts`` bands of rows: ``g = Δ Uᵀ``, the band's ``hᵀ Δ`` and ``xᵀ g`` into
    ``dU_parts[p]``, ``dD_parts[p]`` (each skipped when that array is empty), ``Δ_in += α g Dᵀ``
    (skipped when ``delta_in`` has no rows)."""
    n = delta.shape[0]
    for part in prange(parts):
        lo, hi = n * part // parts, n * (part + 1) // parts
        gemm_into(delta[lo:hi], U.T, g[lo:hi])
        if dU_parts.shape[0]:
            gemm_into(h[lo:hi].T, delta[lo:hi], dU_parts[part])
        if dD_parts.shape[0]:
            gemm_into(x[lo:hi].T, g[lo:hi], dD_parts[part])
        if delta_in.shape[0]:
            gemm_into_scaled(g[lo:hi], D.T, delta_in[lo:hi], alpha, 1.0)


@kernel
def _sum_bands(parts, alpha, out):
    """``out = α Σ_p parts[p]``, the bands added in order."""
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            s = parts[0, i, j]
            for p in range(1, parts.shape[0]):
                s += parts[p, i, j]
            out[i, j] = alpha * s


def lora_forward(x, lora_D, lora_U, alpha: float, mask=None, *, add_to=None):
    """``α · ((x ∘ m) D) U``: fast :func:`pedestrian.layers.lora.lora_forward` (same arguments,
    shapes, dtypes, cache ``(x ∘ m, (x ∘ m) D, m)`` and ``add_to``). With ``add_to``: one
    parallel region, the branch added into it by the last product's BLAS call."""
    x_in = x if mask is None else x * mask                         # (..., f_in)
    f_in, r = lora_D.shape
    f_out = lora_U.shape[1]
    lead = x.shape[:-1]
    x2 = _rows(x_in, f_in)
    out2 = None if add_to is None else _rows(add_to, f_out)
    parts = 0 if out2 is None or x2 is None else _fused(x2, lora_D, lora_U, out2)
    if parts:
        h = empty_array((x2.shape[0], r), x2)                       # (N, r)
        (_forward_bands if parts > 1 else _forward_bands.serial)(x2, lora_D, lora_U, float(alpha), h, out2, parts)
        return add_to, (x_in, h.reshape(*lead, r), mask)
    h = _product(x_in.reshape(-1, f_in), lora_D)                    # (N, r)
    y = _product(h, lora_U)                                         # (N, f_out)
    y *= alpha
    y = y.reshape(*lead, f_out)
    cache = (x_in, h.reshape(*lead, r), mask)
    if add_to is None:
        return y, cache
    add_to += y
    return add_to, cache


def lora_backward(delta, cache, lora_D, lora_U, alpha: float, *, dD=None, dU=None, need_input=True,
                  add_to=None):
    """``dD = α (x∘m)ᵀ (Δ Uᵀ)``, ``dU = α ((x∘m) D)ᵀ Δ``, ``Δ_in = (α (Δ Uᵀ) Dᵀ) ∘ m``: fast
    :func:`pedestrian.layers.lora.lora_backward` (same arguments and contract; ``dD``, ``dU``
    written in place, ``Δ_in`` added into ``add_to`` when given). With ``add_to`` (or
    ``need_input=False``) and no mask: one parallel region over bands of tokens."""
    x_in, h, mask = cache
    f_in, r = lora_D.shape
    f_out = lora_U.shape[1]
    delta_rows = _rows(delta, f_out)                                # (N, f_out)
    din_rows = None if add_to is None else _rows(add_to, f_in)
    x_rows, h_rows = _rows(x_in, f_in), _rows(h, r)
    fusable = mask is None and delta_rows is not None and (din_rows is not None or not need_input)
    wanted = [a for a in (dD, dU, din_rows if need_input else None) if a is not None]
    parts = _fused(delta_rows, x_rows, h_rows, lora_D, lora_U, *wanted) if fusable else 0
    if parts:
        dtype = delta_rows.dtype
        g = empty_array((delta_rows.shape[0], r), delta_rows)      # (N, r) = Δ Uᵀ
        dU_parts = np.empty((parts if dU is not None else 0, r, f_out), dtype)
        dD_parts = np.empty((parts if dD is not None else 0, f_in, r), dtype)
        din = din_rows if need_input else np.empty((0, f_in), dtype)
        (_backward_bands if parts > 1 else _backward_bands.serial)(
            delta_rows, x_rows, h_rows, lora_D, lora_U, float(alpha), g, dD_parts, dU_parts, din, parts)
        if dU is not None:
            _sum_bands(dU_parts, float(alpha), dU)
        if dD is not None:
            _sum_bands(dD_parts, float(alpha), dD)
        return add_to if need_input else None
    delta_rows = delta.reshape(-1, f_out)
    g = _product(delta_rows, lora_U.T)                              # (N, r) = Δ Uᵀ
    if dU is not None:
        matmul_into(dU, h.reshape(-1, r).T, delta_rows)             # (r, f_out)
        dU *= alpha
    if dD is not None:
        matmul_into(dD, x_in.reshape(-1, f_in).T, g)                # (f_in, r)
        dD *= alpha
    if not need_input:
        return None
    lora_in = _product(g, lora_D.T)                                 # (N, f_in)
    lora_in *= alpha
    if mask is not None:
        lora_in *= mask.reshape(-1, f_in)
    lora_in = lora_in.reshape(*delta.shape[:-1], f_in)
    if add_to is None:
        return lora_in
    add_to += lora_in
    return add_to

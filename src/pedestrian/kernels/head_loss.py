"""Fast kernel of the output head fused with its loss (reference: :mod:`pedestrian.layers.head_loss`).

Per chunk of ``n`` rows (EQUATIONS.md, "The head fused with its loss")::

    z_c = h_c W + b    L += Σ_counted (logsumexp z_t − z_{t,y_t}) / C    Δ12_c = (softmax z_c − onehot y_c) / C
    Δ11_c = Δ12_c Wᵀ   dW += h_cᵀ Δ12_c   db += Σ_rows Δ12_c

One ``(n, V)`` array per thread's model step (from the memory pool) holds ``z_c`` and then
``Δ12_c`` written over it: the softmax rows are :mod:`.loss`'s two numba loops (each row's ``Σe``
and loss, then ``Δ12`` in place), the three products BLAS in bands over the threads
(:func:`.blas.matmul_into`; ``dW`` accumulated by ``gemm`` with ``β = 1``, no ``(d, V)`` partial).
"""

from __future__ import annotations

import numpy as np

from ..layers.checks import check_float, check_ids
from ..layers.head_loss import HeadLossCache, head_chunk_rows
from ..layers.loss import IGNORE_INDEX
from ..layers.softcap import check_softcap
from . import loss as _loss
from .blas import blas_view, colsum, gemm_into_scaled, load_gemm, matmul_into
from .jit import blas_one_thread, kernel, prange, threads_used
from .schedule import MIN_PART_ROWS
from .softcap import cap_in_place, cap_rows
from .workspace import empty_array

__all__ = ["head_loss_forward"]    # (the backward is the reference's: it hands over what the forward made)


@kernel(parallel=True, size=lambda a, b, *rest: a.shape[0] * a.shape[1] * b.shape[1])   # m·k·n
def _gemm_add(a, b, out, parts, beta):
    """``out = a b + β out``: ``out``'s columns in ``parts`` bands, one single-threaded BLAS call
    each (:func:`.blas.gemm_into_scaled` on views)."""
    n = out.shape[1]
    for part in prange(parts):
        lo, hi = n * part // parts, n * (part + 1) // parts
        gemm_into_scaled(a, b[:, lo:hi], out[:, lo:hi], 1.0, beta)


def _accumulate(out, a, b, first: bool) -> None:
    """``out = a b`` (``first``) else ``out += a b``, in place; ``out`` C- or F-contiguous (a tied
    head's ``dW`` is the transpose of the token table's layout: ``outᵀ += bᵀ aᵀ``)."""
    if not out.flags.c_contiguous:
        out, a, b = out.T, b.T, a.T
    a, b = blas_view(a), blas_view(b)
    blas_one_thread()
    load_gemm()
    parts = max(1, min(threads_used(), out.shape[1] // MIN_PART_ROWS))
    (_gemm_add if parts > 1 else _gemm_add.serial)(a, b, out, parts, 0.0 if first else 1.0)


def head_loss_forward(h, weight, bias, targets, ignore_index: int = IGNORE_INDEX, *, n_total=None,
                      grad: bool = True, grad_weight: bool = True, chunk_rows: int | None = None,
                      softcap: float | None = None):
    """``L = Σ_counted (logsumexp(h W + b) − (h W + b)[y]) / C``, and with ``grad``
    ``Δ11 = Δ12 Wᵀ``, ``dW = hᵀ Δ12``, ``db = Σ Δ12`` (``Δ12 = (softmax − onehot) / C``), a chunk
    of ``chunk_rows`` rows at a time: :func:`pedestrian.layers.head_loss.head_loss_forward`'s
    contract (same arguments, result, errors).

    NumPy arrays of float32 or float64. ``dW`` is made in ``weight``'s layout (C- or F-ordered),
    so that :func:`head_loss_backward` copies it into a view of the same layout in one pass.
    With ``softcap`` each chunk's logits are capped in place (:func:`.softcap.cap_rows`) and
    their slope ``1 − tanh²`` kept in a second chunk array, by which ``Δ12_c`` is multiplied.
    """
    if softcap is not None:
        check_softcap(softcap)
    d, V = weight.shape
    check_float(h, "the head's input")
    check_float(weight, "the head's weight")
    t = np.asarray(targets).reshape(-1)
    check_ids(t, V, "target", ignore_index=ignore_index)                     # (numba reads past a row)
    rows = head_chunk_rows(V, h.dtype.itemsize) if chunk_rows is None else int(chunk_rows)
    if rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    h_rows = np.ascontiguousarray(h).reshape(-1, d)                          # (N, d)
    N = h_rows.shape[0]
    counted = t != ignore_index
    C = max(int(counted.sum()) if n_total is None else int(n_total), 1)
    t = np.where(counted, t, -1).astype(np.int64)                            # −1: not counted
    scale = counted * (1.0 / C)                                              # (N,) counted / C
    dh = empty_array((N, d), h) if grad else None
    dW = db = None
    if grad and grad_weight:
        dW = empty_array((V, d), h).T if weight.flags.f_contiguous and not weight.flags.c_contiguous \
            else empty_array((d, V), h)                                      # (d, V), weight's layout
        if N == 0:
            dW[...] = 0
        if bias is not None:
            db = np.zeros(V, h.dtype)
    nll = np.empty(N)                                                        # float64
    sum_e = np.empty(min(rows, N))
    z_all = empty_array((min(rows, N), V), h)                                # one chunk's logits, then its Δ12
    slope_all = empty_array((min(rows, N), V), h) if softcap is not None and grad else None
    colsum_c = np.empty(V, h.dtype) if db is not None else None
    for lo in range(0, N, rows):
        hi = min(lo + rows, N)
        h_c, z = h_rows[lo:hi], z_all[:hi - lo]                              # (n, d), (n, V)
        matmul_into(z, h_c, weight, bias=bias)                               # z_c = h_c W + b
        if softcap is not None:                                              # z_c = c tanh(z_c / c)
            if grad:
                cap_rows(z, float(softcap), slope_all[:hi - lo])             # and its slope 1 − tanh²
            else:
                cap_in_place(z, float(softcap))
        z_max = np.max(z, axis=-1)                                           # (n,)
        _loss.nll_rows(z, z_max, t[lo:hi], sum_e[:hi - lo], nll[lo:hi])      # Σe, −log p[target]
        if not grad:
            continue
        _loss.delta_rows(z, z_max, t[lo:hi], sum_e[:hi - lo], scale[lo:hi], z)   # Δ12_c over z_c
        if softcap is not None:
            np.multiply(z, slope_all[:hi - lo], out=z)                       # Δ12_c ∘ (1 − tanh²)
        matmul_into(dh[lo:hi], z, weight.T)                                  # Δ11_c = Δ12_c Wᵀ
        if dW is not None:
            _accumulate(dW, h_c.T, z, first=lo == 0)                        # dW += h_cᵀ Δ12_c
        if db is not None:
            db += colsum(z, out=colsum_c)                                    # db += Σ_rows Δ12_c
    loss = h.dtype.type(nll.sum() / C)
    d11 = dh.reshape(h.shape) if grad else None
    return loss, HeadLossCache(d11, dW, db, C, (*h.shape[:-1], V))

"""Products and reductions of the fast path, written into preallocated arrays: :func:`matmul_into`
(2-D products shared over numba's threads as single-threaded BLAS calls) and :func:`colsum`.
"""

from __future__ import annotations

import numpy as np

from .jit import AVAILABLE, blas_one_thread, kernel, prange, threads_used
from .workspace import empty_array

__all__ = ["matmul_into", "colsum"]


#: a 2-D NumPy product is shared over numba's threads from this many multiply-adds, in row
#: blocks of at least :data:`MIN_PART_ROWS` rows
PARALLEL_MIN_MACS = 1 << 18
MIN_PART_ROWS = 16
#: rows of a transposed left operand copied at a time (:func:`_gemm`)
COPY_ROWS = 1024
#: numbers of the partial outputs of :func:`_gemm_split_k` at most (16 MiB of float32)
SPLIT_K_MAX_PARTIAL = 1 << 22


@kernel(parallel=True)
def _gemm(a, b, bias, out, parts):
    """``out = a @ b (+ bias)``, 2-D: ``out``'s rows in ``parts`` blocks, one single-threaded BLAS
    call each (a transposed ``a`` is copied first, :data:`COPY_ROWS` rows at a time: ``k × rows``
    numbers against ``k × rows × n`` multiply-adds, and no copy of the whole operand -- the tied
    logits' ``(V, B·T)``)."""
    m, n = out.shape
    for part in prange(parts):
        lo, hi = m * part // parts, m * (part + 1) // parts
        step = hi - lo if a.flags.c_contiguous else COPY_ROWS
        for i in range(lo, hi, max(step, 1)):
            j = min(i + step, hi)
            np.dot(np.ascontiguousarray(a[i:j]), b, out[i:j])
        if bias.shape[0]:
            for i in range(lo, hi):
                for j in range(n):
                    out[i, j] += bias[j]


@kernel(parallel=True)
def _gemm_split_k(at, b, out, partial):
    """``out = atᵀ b`` (``at`` ``(k, m)``, ``b`` ``(k, n)``, both C-contiguous: a weight gradient
    ``xᵀ Δ``): the shared axis in ``len(partial) + 1`` blocks of rows, one single-threaded BLAS
    call each (``atᵀ`` is a transposed view, no copy), block 0 into ``out`` and block ``p`` into
    ``partial[p − 1]``, then added in block order."""
    k, parts = at.shape[0], partial.shape[0] + 1
    for part in prange(parts):
        lo, hi = k * part // parts, k * (part + 1) // parts
        np.dot(at[lo:hi].T, b[lo:hi], out if part == 0 else partial[part - 1])
    for i in prange(out.shape[0]):
        for p in range(parts - 1):
            for j in range(out.shape[1]):
                out[i, j] += partial[p, i, j]


_NO_BIAS: dict = {}


def _numba_matmul(out, a, b, bias) -> bool:
    """:func:`matmul_into` of 2-D NumPy arrays on numba's threads; False where it does not apply
    (batched operands, mixed dtypes, a strided ``out``)."""
    if not (AVAILABLE and out.ndim == 2 and a.ndim == 2 and b.ndim == 2 and type(a) is np.ndarray
            and type(b) is np.ndarray and a.dtype == b.dtype == out.dtype and out.dtype.kind == "f"):
        return False
    if not out.flags.c_contiguous:
        if not out.flags.f_contiguous:
            return False
        if bias is not None:
            return False
        out, a, b = out.T, b.T, a.T                        # outᵀ = bᵀ aᵀ, rows of outᵀ
    if not (b.flags.c_contiguous or b.flags.f_contiguous):
        b = np.ascontiguousarray(b)
    blas_one_thread()
    (m, k), n = a.shape, out.shape[1]
    threads = threads_used() if m * k * n >= PARALLEL_MIN_MACS else 1
    if bias is None and a.T.flags.c_contiguous and b.flags.c_contiguous:
        # aᵀ stored (a weight gradient xᵀ Δ): no copy of a; in parts, where the partial outputs
        # (m·n numbers each) cost less to add than a's copy (m·k) and fit SPLIT_K_MAX_PARTIAL
        # (not the tied logits' (V, d) at large batches) -- char-small's: 0.89 against 1.44 ms
        parts = min(threads, k // MIN_PART_ROWS)
        if threads == 1:                                                  # one BLAS call
            _gemm_split_k.serial(a.T, b, out, np.empty((0, m, n), out.dtype))
            return True
        if parts > 1 and n < k and (parts - 1) * m * n <= SPLIT_K_MAX_PARTIAL:
            _gemm_split_k(a.T, b, out, empty_array((parts - 1, m, n), out))      # (pooled in a step)
            return True
    parts = max(1, min(threads, m // MIN_PART_ROWS))
    if bias is None:
        bias = _NO_BIAS.setdefault(out.dtype, np.zeros(0, out.dtype))
    (_gemm if parts > 1 else _gemm.serial)(a, b, bias, out, parts)
    return True


def matmul_into(out, a, b, *, bias=None) -> None:
    """``out[...] = a @ b (+ bias)`` without an intermediate when the backend allows it.

    NumPy, 2-D: numba's threads share the product out in row blocks, each one single-threaded
    BLAS call (:func:`pedestrian.kernels.jit.blas_one_thread`), the bias added in the same loop;
    a product ``xᵀ Δ`` of a transposed C-contiguous ``x`` (a weight gradient) narrower than the
    shared axis is cut along that axis instead (:func:`_gemm_split_k`). The bits depend on the
    shapes and the thread count only.

    Args:
        out: preallocated array of the product's shape (may be a strided view into a flat
            gradient buffer, or a head-interleaved view such as ``(B, T, H, w)`` permuted to
            ``(B, H, T, w)``: NumPy's BLAS path writes any view whose rows have unit stride).
        a, b: operands (2-D, or batched with matching leading axes).
        bias: optional ``(n,)`` row added to every row of the 2-D product.
    """
    if _numba_matmul(out, a, b, bias):
        return
    if out.strides[-1] == out.itemsize or out.flags.c_contiguous:
        np.matmul(a, b, out=out)
    else:
        out[...] = a @ b
    if bias is not None:
        out += bias


@kernel(parallel=True)
def _colsum(a, out, parts):
    """``out = Σ_rows a``: the columns in ``parts`` blocks, each summed row after row in float64."""
    m, n = a.shape
    for part in prange(parts):
        lo, hi = n * part // parts, n * (part + 1) // parts
        acc = np.zeros(hi - lo, np.float64)
        for i in range(m):
            row = a[i, lo:hi]
            for j in range(hi - lo):
                acc[j] += row[j]
        for j in range(hi - lo):
            out[lo + j] = acc[j]


def colsum(a, *, out=None):
    """``Σ_rows a`` of a 2-D ``(n, f)`` array: ``(f,)`` (bias and layer-norm gradients).

    A numba loop, columns in blocks over the threads (else NumPy's ``sum``).
    """
    if out is None:
        out = np.empty(a.shape[1], dtype=a.dtype)
    if AVAILABLE and a.flags.c_contiguous and out.flags.c_contiguous and a.dtype == out.dtype:
        parts = max(1, min(threads_used(), a.shape[1] // 64)) if a.size >= 1 << 15 else 1
        (_colsum if parts > 1 else _colsum.serial)(a, out, parts)
        return out
    return np.sum(a, axis=0, out=out)

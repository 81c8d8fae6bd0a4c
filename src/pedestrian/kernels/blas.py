"""Products and reductions of the fast path: :func:`matmul_into` (2-D products written into
preallocated arrays, shared over numba's threads as single-threaded BLAS calls),
:func:`few_rows_matmul` (a generated token's products) and :func:`colsum`.
"""

from __future__ import annotations

import numpy as np

from . import schedule
from .jit import AVAILABLE, blas_one_thread, kernel, prange, threads_used
from .schedule import COPY_ROWS
from .workspace import active_workspace, empty_array

__all__ = ["matmul_into", "few_rows_matmul", "colsum"]


@kernel(parallel=True, size=lambda a, b, *rest: a.shape[0] * b.shape[0] * b.shape[1])  # m·k·n
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


@kernel(parallel=True, size=lambda at, b, *rest: at.shape[0] * at.shape[1] * b.shape[1])
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
    route, parts = _route(*a.shape, out.shape[1], bias is None and a.T.flags.c_contiguous and b.flags.c_contiguous)
    if route == "split":
        m, n = out.shape
        partial = empty_array((parts - 1, m, n), out) if parts > 1 else np.empty((0, m, n), out.dtype)
        (_gemm_split_k if parts > 1 else _gemm_split_k.serial)(a.T, b, out, partial)   # (pooled in a step)
    else:
        bias = _NO_BIAS.setdefault(out.dtype, np.zeros(0, out.dtype)) if bias is None else bias
        (_gemm if parts > 1 else _gemm.serial)(a, b, bias, out, parts)
    return True


def _route(m: int, k: int, n: int, at_stored: bool) -> tuple[str, int]:
    """How ``(m, k) @ (k, n)`` runs, and in how many parts (:mod:`.schedule`'s thresholds):

    - ``"split"`` -- ``a`` is a transposed C-contiguous ``at`` (a weight gradient ``xᵀ Δ``),
      no bias: on one thread (a small product, or one thread) one BLAS call on the transposed
      view, no copy; on several, the shared axis cut in blocks when the output is narrower than
      it (``n < k``: the partial outputs, ``m·n`` each, cost less to add than ``a``'s copy,
      ``m·k``) and the partials fit :data:`.schedule.SPLIT_K_MAX_PARTIAL` (char-small's four
      weight gradients of a layer 3.8 → 2.9 ms: docs/kernels.md, "linear");
    - ``"rows"`` -- otherwise ``out``'s rows in blocks of at least
      :data:`.schedule.MIN_PART_ROWS`, one single-threaded BLAS call each (as fast as
      OpenBLAS's own threads: docs/kernels.md, "One pool of threads"); one block below
      :data:`.schedule.PARALLEL_MIN_MACS` multiply-adds.
    """
    threads = threads_used() if m * k * n >= schedule.PARALLEL_MIN_MACS else 1
    if at_stored:
        parts = min(threads, k // schedule.MIN_PART_ROWS)
        if threads == 1:
            return "split", 1
        if parts > 1 and n < k and (parts - 1) * m * n <= schedule.SPLIT_K_MAX_PARTIAL:
            return "split", parts
    return "rows", max(1, min(threads, m // schedule.MIN_PART_ROWS))


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


def few_rows_matmul(a, b):
    """``a @ b`` for an ``a`` ``(..., k)`` of a few rows (a generated token's input) and a 2-D
    weight ``b`` ``(k, n)``: a new ``(..., n)`` array.

    On several threads, NumPy's ``a @ b`` on its BLAS's own threads (their workers stay awake
    between products; numba's, which wait passively, would have to be woken for each one:
    docs/kernels.md, "One generated token at SmolLM2-135M's shape"). When the fast kernels run
    one thread (:func:`pedestrian.kernels.jit.threads_used`), one call of the BLAS numba holds to
    one thread, ``gemv`` for one row (NumPy arrays of one float dtype, ``b`` C- or F-contiguous;
    else ``a @ b``), so that ``PEDESTRIAN_NUM_THREADS=1`` holds for generation too. Inside a
    model step (an active :class:`~pedestrian.kernels.workspace.Workspace`) the thread count is
    read at the step's first such product and kept for the step (not read from the environment
    for every product of a token).
    """
    workspace = active_workspace()
    if workspace is None:
        threads = threads_used()
    elif workspace.threads is None:
        threads = workspace.threads = threads_used()
    else:
        threads = workspace.threads
    if threads > 1 or not (AVAILABLE and type(a) is np.ndarray and type(b) is np.ndarray and a.size
                           and b.ndim == 2 and a.dtype == b.dtype and a.dtype.kind == "f"
                           and (b.flags.c_contiguous or b.flags.f_contiguous)):
        return a @ b
    blas_one_thread()
    a2 = np.ascontiguousarray(a).reshape(-1, b.shape[0])
    out = np.empty((a2.shape[0], b.shape[1]), a.dtype)
    _one_thread_product(a2, b, out)
    return out.reshape(*a.shape[:-1], b.shape[1])


@kernel
def _one_thread_product(a, b, out):
    """``out = a b`` in one BLAS call: a matrix-vector product (``gemv``) for one row, else ``gemm``."""
    if a.shape[0] == 1:
        np.dot(b.T, a[0], out[0])
    else:
        np.dot(a, b, out)


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
        parts = max(1, min(threads_used(), a.shape[1] // schedule.COLSUM_MIN_COLUMNS)) \
            if a.size >= schedule.COLSUM_PARALLEL_MIN else 1
        (_colsum if parts > 1 else _colsum.serial)(a, out, parts)
        return out
    return np.sum(a, axis=0, out=out)

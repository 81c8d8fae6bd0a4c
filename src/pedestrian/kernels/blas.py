"""Products and reductions of the fast path: :func:`matmul_into` (2-D products written into
preallocated arrays, shared over numba's threads as single-threaded BLAS calls),
:func:`few_rows_matmul` (a generated token's products) and :func:`colsum`.
"""

from __future__ import annotations

import numpy as np

from . import schedule
from .jit import AVAILABLE, blas_one_thread, kernel, prange, threads_used
from .schedule import COPY_ROWS, PARALLEL_MIN_ELEMENTS
from .workspace import active_workspace, empty_array

__all__ = ["matmul_into", "few_rows_matmul", "colsum"]


#: numba's own entry to SciPy's BLAS ``?gemm`` (``numba_xxgemm``, what its ``np.dot`` calls), with
#: the strides (``lda``, ``ldb``, ``ldc``) of views: made when numba is loaded (:func:`load_gemm`)
_xxgemm = None


def load_gemm() -> None:
    """Make :data:`_xxgemm` (imports numba; call before the first kernel that uses
    :func:`gemm_into` is compiled). Idempotent."""
    global _xxgemm
    if _xxgemm is None:
        from numba import types

        p = types.voidptr
        _xxgemm = types.ExternalFunction("numba_xxgemm", types.intc(
            types.char, types.char, types.char, types.intp, types.intp, types.intp,   # kind, transa, transb, m, n, k
            p, p, types.intp, p, types.intp, p, p, types.intp))                        # α, a, lda, b, ldb, β, c, ldc


@kernel
def gemm_into(a, b, out):
    """``out = a @ b``: :func:`gemm_into_scaled` with ``α = 1``, ``β = 0``."""
    gemm_into_scaled(a, b, out, 1.0, 0.0)


@kernel
def gemm_into_scaled(a, b, out, alpha, beta):
    """``out = α (a @ b) + β out`` in one BLAS ``gemm`` call on views: ``a`` ``(m, k)`` and ``b``
    ``(k, n)`` each with one axis of unit stride (a band of rows or columns of a C- or F-ordered
    array, a transposed array), ``out`` ``(m, n)`` with rows of unit stride (a band of columns
    too); no copy. Row-major views are the column-major ``outᵀ = bᵀ aᵀ`` BLAS computes, as
    numba's ``np.dot``. ``β = 1`` adds the product into ``out`` (a LoRA branch into its base
    layer's output: :mod:`pedestrian.kernels.lora`)."""
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:
        return
    if k == 0:
        for i in range(m):
            for j in range(n):
                out[i, j] = 0.0 if beta == 0.0 else beta * out[i, j]
        return
    size = out.itemsize                                 # (an axis of length 1 may have any stride)
    if a.strides[1] == size and a.strides[0] >= k * size:
        ta, lda = 110, a.strides[0] // size            # 'n': a row-major, aᵀ as stored
    else:
        ta, lda = 116, a.strides[1] // size            # 't': a column-major
    if b.strides[1] == size and b.strides[0] >= n * size:
        tb, ldb = 110, b.strides[0] // size
    else:
        tb, ldb = 116, b.strides[1] // size
    scale, keep = np.full(1, alpha, out.dtype), np.full(1, beta, out.dtype)
    status = _xxgemm(np.int8(115 if size == 4 else 100), np.int8(tb), np.int8(ta), n, m, k, scale.ctypes, b.ctypes,
                     max(ldb, 1), a.ctypes, max(lda, 1), keep.ctypes, out.ctypes, max(out.strides[0] // size, 1))
    if status != 0:
        raise RuntimeError("numba found no BLAS gemm (SciPy's scipy.linalg.cython_blas): reinstall scipy")


@kernel(parallel=True, size=lambda a, b, *rest: a.shape[0] * b.shape[0] * b.shape[1])  # m·k·n
def _gemm(a, b, bias, out, parts, by_columns, copy_rows):
    """``out = a @ b (+ bias)``, 2-D: ``out``'s rows, or its columns (``by_columns``), in ``parts``
    bands, one single-threaded BLAS call each (:func:`gemm_into`, on views). A band of rows
    multiplies by all of ``b``, a band of columns by all of ``a``: each thread packs the whole
    operand it shares, so the longer side of ``out`` is the one cut. ``copy_rows``: a transposed
    ``a`` whose rows lie far apart in memory (the tied logits' ``Δ12ᵀ``) is copied first,
    :data:`COPY_ROWS` rows at a time (``k × rows`` numbers against ``k × rows × n``
    multiply-adds; no copy of the whole operand)."""
    m, n = out.shape
    for part in prange(parts):
        if by_columns:
            lo, hi = n * part // parts, n * (part + 1) // parts
            gemm_into(a, b[:, lo:hi], out[:, lo:hi])
            if bias.shape[0]:
                for i in range(m):
                    for j in range(lo, hi):
                        out[i, j] += bias[j]
        else:
            lo, hi = m * part // parts, m * (part + 1) // parts
            if copy_rows:
                for i in range(lo, hi, COPY_ROWS):
                    j = min(i + COPY_ROWS, hi)
                    gemm_into(np.ascontiguousarray(a[i:j]), b, out[i:j])
            else:
                gemm_into(a[lo:hi], b, out[lo:hi])
            if bias.shape[0]:
                for i in range(lo, hi):
                    for j in range(n):
                        out[i, j] += bias[j]


@kernel(parallel=True, size=lambda a, b, *rest: a.shape[0] * a.shape[1] * b.shape[1])
def _gemm_split_k(a, b, out, partial):
    """``out = a b`` with the shared axis (``a`` ``(m, k)``, ``b`` ``(k, n)``) in
    ``len(partial) + 1`` bands, one single-threaded BLAS call each on views (:func:`gemm_into`),
    band 0 into ``out`` and band ``p`` into ``partial[p − 1]``, then added in band order: a
    weight gradient ``xᵀ Δ`` over many tokens, the tied logits' ``Δ12 W_tok``."""
    k, parts = a.shape[1], partial.shape[0] + 1
    for part in prange(parts):
        lo, hi = k * part // parts, k * (part + 1) // parts
        gemm_into(a[:, lo:hi], b[lo:hi], out if part == 0 else partial[part - 1])
    if out.size >= PARALLEL_MIN_ELEMENTS:        # (a second parallel region wakes the threads again)
        for i in prange(out.shape[0]):
            _add_partials(out, partial, i)
    else:
        for i in range(out.shape[0]):
            _add_partials(out, partial, i)


@kernel
def _add_partials(out, partial, i):
    """``out[i] += partial[0, i] + partial[1, i] + …``, in band order."""
    for p in range(partial.shape[0]):
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
    a, b = blas_view(a), blas_view(b)
    blas_one_thread()
    load_gemm()
    (m, k), n = a.shape, out.shape[1]
    route, parts = _route(m, k, n, bias is None)
    if route == "split":
        partial = empty_array((parts - 1, m, n), out)                                  # (pooled in a step)
        _gemm_split_k(a, b, out, partial)
    else:
        bias = _NO_BIAS.setdefault(out.dtype, np.zeros(0, out.dtype)) if bias is None else bias
        far = a.strides[1] != a.itemsize and a.strides[1] >= schedule.COPY_MIN_STRIDE   # (a transposed a)
        (_gemm if parts > 1 else _gemm.serial)(a, b, bias, out, parts, route == "columns", far and route == "rows")
    return True


def blas_view(x):
    """``x`` where BLAS reads it in place (:func:`gemm_into`: one axis of unit stride, the other's
    stride at least the rows it spans), else a C-contiguous copy."""
    size = x.itemsize
    if (x.strides[1] == size and x.strides[0] >= x.shape[1] * size) or \
            (x.strides[0] == size and x.strides[1] >= x.shape[0] * size):
        return x
    return np.ascontiguousarray(x)


def _route(m: int, k: int, n: int, no_bias: bool) -> tuple[str, int]:
    """How ``(m, k) @ (k, n)`` runs, and in how many bands (:mod:`.schedule`'s thresholds). Each
    band is one single-threaded BLAS call on views (no copy), and each call packs the whole of the
    operand its band does not cut, so the longest of the three sides is the one cut:

    - one call below :data:`.schedule.PARALLEL_MIN_MACS` multiply-adds or on one thread;
    - ``"split"`` -- the shared axis ``k`` the longest (a weight gradient ``xᵀ Δ`` over many
      tokens, the tied logits' ``Δ12 W_tok``), no bias, and the partial outputs (``m·n`` each)
      within :data:`.schedule.SPLIT_K_MAX_PARTIAL`: bands of ``k``, the partials added (char-small's
      four weight gradients of a layer 3.8 → 2.9 ms: docs/kernels.md, "linear");
    - ``"columns"`` -- ``out`` wider than tall (``n > m``: few tokens times a wide weight);
    - ``"rows"`` -- otherwise; bands of at least :data:`.schedule.MIN_PART_ROWS` rows or columns
      (docs/kernels.md, "One pool of threads", "Bands of the longer side").
    """
    threads = threads_used() if m * k * n >= schedule.PARALLEL_MIN_MACS else 1
    if threads == 1:
        return "rows", 1
    if no_bias and k > max(m, n):
        parts = min(threads, k // schedule.MIN_PART_ROWS)
        if parts > 1 and (parts - 1) * m * n <= schedule.SPLIT_K_MAX_PARTIAL:
            return "split", parts
    if n > m:
        return "columns", max(1, min(threads, n // schedule.MIN_PART_ROWS))
    return "rows", max(1, min(threads, m // schedule.MIN_PART_ROWS))


def matmul_into(out, a, b, *, bias=None) -> None:
    """``out[...] = a @ b (+ bias)`` without an intermediate when the backend allows it.

    NumPy, 2-D: numba's threads share the product out in bands of its longest side (rows or
    columns of ``out``, or the shared axis: :func:`_route`), each one single-threaded BLAS call on
    views (:func:`pedestrian.kernels.jit.blas_one_thread`, :func:`gemm_into`), the bias added in
    the same loop. The bits depend on the shapes and the thread count only.

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

    On several threads, NumPy's ``a @ b`` on its BLAS's own threads (bands over numba's threads,
    one parallel region per product, measured slower with the threads sleeping between regions
    and within 5-8 % spinning: docs/kernels.md, "One generated token at SmolLM2-135M's shape"). When the fast kernels run
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

"""The few array operations the array API standard lacks, in one place.

Every formula in :mod:`pedestrian.layers` is written against the array namespace of its
inputs (``xp = array_namespace(x)``, from ``array-api-compat``), so the same lines run on
NumPy arrays and on PyTorch tensors used as plain arrays (no autograd). What the standard
does not offer lives here:

- :func:`scatter_add_rows` -- the embedding backward needs an *accumulating* scatter
  (``np.add.at`` / ``torch.index_add_``); a plain fancy-index ``+=`` drops repeated ids.
- :func:`erf` -- the exact GELU needs the error function (NumPy has none; SciPy does).
- :func:`matmul_into` -- writes a matrix product straight into a preallocated gradient
  buffer (``out=``), which the standard does not have.
- :func:`elementwise_lib` -- NumPy or ``torch`` itself, for elementwise functions with an
  ``out=`` argument (``lib.multiply(a, b, out=c)``, ``lib.exp(a, out=a)``): both libraries share
  those names and signatures, and writing into a preallocated or reused array saves a pass
  over memory and an allocation per operation.
- :func:`for_row_blocks` -- runs a row-wise kernel over cache-sized blocks of rows, split
  across a small thread pool for NumPy (whose elementwise functions are single-threaded but
  release the GIL); PyTorch threads its own operations, so there it is one call.
- :func:`single_threaded_blas` -- one BLAS thread (``threadpoolctl``) while
  :class:`pedestrian.parallel.DataParallel` runs its own threads; :func:`colsum` -- column
  sums as one BLAS product.
- :class:`Workspace` -- arrays of the previous training step kept for reuse: freeing and
  re-allocating tens of megabytes every step makes the C library hand the memory back to the
  operating system and fault it in again, page by page, which can cost as much as the
  arithmetic.
- dtype / namespace resolution for the ``backend=`` and ``dtype=`` arguments.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import numpy as np
from array_api_compat import array_namespace as _compat_array_namespace
from array_api_compat import is_numpy_array as _compat_is_numpy_array
from array_api_compat import is_torch_array as _compat_is_torch_array

__all__ = [
    "array_namespace",
    "namespace_for",
    "resolve_dtype",
    "scatter_add_rows",
    "take_rows",
    "erf",
    "matmul_into",
    "to_numpy",
    "asarray_like",
    "is_numpy_array",
    "is_torch_array",
    "elementwise_lib",
    "empty_array",
    "Workspace",
    "scratch",
    "rowdot",
    "colsum",
    "for_row_blocks",
    "num_threads",
    "single_threaded_blas",
    "in_worker_thread",
    "get_pool",
]

BACKENDS = ("numpy", "torch")


_NUMPY_NAMESPACE = None                            # array_api_compat.numpy, on first use


def array_namespace(*xs, **kwargs):
    """``array_api_compat.array_namespace``, answered at once for one plain ``np.ndarray``
    (every layer function asks, hundreds of times per training step)."""
    global _NUMPY_NAMESPACE
    if len(xs) == 1 and not kwargs and type(xs[0]) is np.ndarray:
        if _NUMPY_NAMESPACE is None:
            _NUMPY_NAMESPACE = _compat_array_namespace(xs[0])
        return _NUMPY_NAMESPACE
    return _compat_array_namespace(*xs, **kwargs)


def is_numpy_array(x) -> bool:
    """``array_api_compat.is_numpy_array``, answered at once for a plain ``np.ndarray``
    (called several hundred times per training step)."""
    return type(x) is np.ndarray or _compat_is_numpy_array(x)


def is_torch_array(x) -> bool:
    """``array_api_compat.is_torch_array``, answered at once for a plain ``np.ndarray``."""
    return type(x) is not np.ndarray and _compat_is_torch_array(x)


DTYPES = ("float32", "float64")


def namespace_for(backend: str):
    """Return the array namespace for a backend name.

    Args:
        backend: ``"numpy"`` (default everywhere) or ``"torch"`` (CPU tensors used as
            plain arrays; requires PyTorch to be installed).

    Raises:
        ValueError: unknown backend name.
        ImportError: ``"torch"`` asked for but PyTorch is not installed.
    """
    if backend == "numpy":
        import array_api_compat.numpy as xp

        return xp
    if backend == "torch":
        try:
            import torch  # noqa: F401
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "backend='torch' needs PyTorch: pip install torch==2.13.0 "
                "(or use the default backend='numpy')"
            ) from exc
        import array_api_compat.torch as xp

        return xp
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")


def resolve_dtype(xp, dtype: str | Any):
    """Map ``"float32"`` / ``"float64"`` (or a dtype object) to ``xp``'s dtype.

    Raises:
        ValueError: any dtype other than float32 / float64.
    """
    name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose 'float32' or 'float64'")
    return getattr(xp, name)


def scatter_add_rows(target, index, rows) -> None:
    """In place: ``target[index[n], :] += rows[n, :]`` for every n, repeats accumulating.

    Args:
        target: ``(V, d)`` float array, modified in place.
        index: ``(N,)`` integer array of row ids in ``[0, V)``.
        rows: ``(N, d)`` array, same dtype as ``target``.

    Source: EQUATIONS.md, embedding backward (``dW_tok = ohe(a0)^T @ Δ1``); a plain
    ``target[index] += rows`` silently drops duplicates in NumPy. NumPy: a sort and a
    segment sum (``np.add.reduceat``); PyTorch: ``index_add_``.
    """
    if is_numpy_array(target):
        # sort the ids, sum each run of equal ids (add.reduceat), then add once per distinct
        # id: the same result as np.add.at(target, index, rows), several times faster
        index = np.asarray(index).reshape(-1)
        if index.shape[0] == 0:
            return
        order = np.argsort(index, kind="stable")
        ids = index[order]
        starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
        target[ids[starts]] += np.add.reduceat(rows[order], starts, axis=0)
    elif is_torch_array(target):
        target.index_add_(0, index, rows)
    else:  # pragma: no cover - only the two backends are supported
        raise TypeError(f"unsupported array type {type(target).__name__}")


def take_rows(table, index, *, out) -> None:
    """``out[n, :] = table[index[n], :]`` (the embedding gather), written into ``out``.

    Args:
        table: ``(V, d)``; index: ``(N,)`` integer ids in ``[0, V)``; out: ``(N, d)``.
    """
    if is_torch_array(table):
        import torch

        torch.index_select(table, 0, index, out=out)
    else:
        np.take(table, index, axis=0, out=out)


def erf(x):
    """Elementwise error function on NumPy arrays (SciPy) or torch tensors (torch.special)."""
    if is_torch_array(x):
        import torch

        return torch.special.erf(x)
    from scipy.special import erf as _erf

    return _erf(x)


def matmul_into(out, a, b, *, bias=None) -> None:
    """``out[...] = a @ b (+ bias)`` without an intermediate when the backend allows it.

    Args:
        out: preallocated array of the product's shape (may be a strided view into a flat
            gradient buffer, or a head-interleaved view such as ``(B, T, H, w)`` permuted to
            ``(B, H, T, w)``: NumPy's BLAS path writes any view whose rows have unit stride).
        a, b: operands (2-D, or batched with matching leading axes).
        bias: optional ``(n,)`` row added to every row of the 2-D product (PyTorch: one
            ``addmm``; NumPy: an in-place add after the product).
    """
    if is_numpy_array(out):
        if out.strides[-1] == out.itemsize or out.flags.c_contiguous:
            np.matmul(a, b, out=out)
        else:
            out[...] = a @ b
        if bias is not None:
            out += bias
    elif is_torch_array(out):
        import torch

        if (bias is None and out.ndim == 2 and out.is_contiguous() and b.ndim == 2
                and b.stride(0) == 1 and b.stride(1) != 1 and out.numel() >= 1 << 22):
            # a large product with a transposed right operand (the tied logits a11 W_tokᵀ):
            # MKL computes (W a.mT), W = b.mT, plus a transposing copy faster, best in blocks
            # of 2048 rows of W (measured on (256, 768) @ (768, 50257): 64-69 GFLOP/s as
            # a @ b, 76-91 in one piece, 105-114 in blocks); the block goes into a reused array
            w, at = b.mT, a.mT
            n = w.shape[0]
            block = min(n, 2048)
            tmp = empty_array((block, out.shape[0]), out)
            for lo in range(0, n, block):
                hi = min(lo + block, n)
                torch.matmul(w[lo:hi], at, out=tmp[:hi - lo])
                out[:, lo:hi].copy_(tmp[:hi - lo].mT)
            done = [tmp]
            del tmp
            release(done)
            return
        if bias is not None and out.ndim == 2 and out.is_contiguous():
            torch.addmm(bias, a, b, out=out)
            return
        if out.is_contiguous():
            torch.matmul(a, b, out=out)
        else:
            out.copy_(a @ b)
        if bias is not None:
            out += bias
    else:  # pragma: no cover - only the two backends are supported
        out[...] = a @ b if bias is None else a @ b + bias


def empty_array(shape, like):
    """A C-contiguous array of ``shape`` with ``like``'s dtype, backend and device; contents
    undefined (the caller overwrites every entry).

    Inside :meth:`Workspace.active` (the model's forward and backward) an array (or tensor) of
    the same shape and dtype kept from an earlier step is returned when there is one. (Unlike
    ``empty_like``, the result is always C-contiguous, so its reshapes are views.)
    """
    workspace = _ACTIVE_WORKSPACE.get()
    if type(like) is not np.ndarray and is_torch_array(like):
        import torch

        if workspace is not None:
            reused = workspace.take(shape, like.dtype, like.device)
            if reused is not None:
                return reused
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if workspace is not None:
        reused = workspace.take(shape, like.dtype)
        if reused is not None:
            return reused
    return np.empty(shape, dtype=like.dtype)


def release(temporaries: list) -> None:
    """Hand finished temporaries (from :func:`empty_array`) back to the active workspace.

    ``temporaries`` is emptied; the caller must hold no other reference to them. Without an
    active workspace this only drops the references.
    """
    workspace = _ACTIVE_WORKSPACE.get()
    if workspace is None:
        temporaries.clear()
    else:
        workspace.recycle(temporaries)


_scratch_local = threading.local()


def scratch(shape, like, slot: str):
    """A temporary for a row-block kernel, reused by later calls from the same thread.

    Kernels run on the thread pool and need block-sized temporaries; allocating and freeing
    them each time makes the C library trim and re-fault its heap. NumPy: a view of a
    per-thread buffer kept under ``slot`` (two live temporaries need two slots); contents
    undefined, valid until the next call with the same slot on the same thread. The same for
    PyTorch tensors (whose CPU allocator keeps nothing either).
    """
    store = getattr(_scratch_local, "arrays", None)
    if store is None:
        store = _scratch_local.arrays = {}
    n = 1
    for s in shape:
        n *= s
    torch_like = type(like) is not np.ndarray and is_torch_array(like)
    key = (slot, like.dtype, str(like.device)) if torch_like else (slot, like.dtype)
    buf = store.get(key)
    if buf is None or buf.shape[0] < n:
        if torch_like:
            import torch

            buf = store[key] = torch.empty(n, dtype=like.dtype, device=like.device)
        else:
            buf = store[key] = np.empty(n, dtype=like.dtype)
    return buf[:n].reshape(shape)


_ONES: dict = {}                                   # (n, dtype) -> a (1, n) row of ones


def colsum(a, *, out=None):
    """``Σ_rows a`` of a 2-D ``(n, f)`` array: ``(f,)`` (bias and layer-norm gradients).

    NumPy: as the product ``1ᵀ a`` (``(1, n) @ (n, f)``), one BLAS call: measured 19 µs
    against 42 µs for ``np.sum(a, axis=0)`` on a (384, 512) float32 array, and it releases
    the GIL for the whole computation. PyTorch: ``torch.sum(a, 0)``.
    """
    if is_torch_array(a):
        import torch

        return torch.sum(a, 0) if out is None else torch.sum(a, 0, out=out)
    n = a.shape[0]
    key = (n, a.dtype)
    ones = _ONES.get(key)
    if ones is None:
        ones = _ONES[key] = np.ones((1, n), dtype=a.dtype)
    if out is None:
        out = np.empty(a.shape[1], dtype=a.dtype)
    np.matmul(ones, a, out=out[None, :])
    return out


def rowdot(a, b):
    """``Σ_last a ∘ b`` with the last axis kept (size 1), without an ``a ∘ b`` temporary."""
    if is_torch_array(a):
        import torch

        return torch.linalg.vecdot(a, b).unsqueeze(-1)
    return np.vecdot(a, b)[..., None]


_ACTIVE_WORKSPACE: contextvars.ContextVar = contextvars.ContextVar("pedestrian_workspace",
                                                                    default=None)


class Workspace:
    """NumPy float arrays no longer in use, kept by ``(shape, dtype)`` for :func:`empty_array`.

    A training step allocates the same arrays every time. :meth:`recycle` receives the arrays
    of a finished step (the model's cache of activations, the error signals of a finished
    block) and keeps those that *nothing else refers to* -- no variable, no view, no dict the
    caller kept, checked with the reference count -- so an activation or a logits array the
    user still holds is never overwritten; it is simply not reused. While :meth:`active`,
    :func:`empty_array` hands the kept arrays out again. Arrays of a shape not asked for during
    a whole step are dropped (:meth:`new_step`), so the workspace does not grow when shapes
    change.

    PyTorch tensors are kept the same way: a tensor is reused only when its Python object is
    referenced nowhere else and no other tensor (a view) shares its storage
    (``torch._C._storage_Use_Count``). PyTorch's CPU allocator has no cache, so without this
    every step's fresh tensors are page-faulted in again (measured on gpt2-124M: 50,000 minor
    faults per step). Nothing is kept when ``sys.getrefcount`` is not available (not CPython).
    """

    def __init__(self) -> None:
        self._free: dict[tuple, list] = {}
        self._asked: dict[tuple, int] = {}                 # key -> arrays asked for this step
        self._wanted: dict[tuple, int] = {}                # key -> arrays asked for last step

    def __len__(self) -> int:
        return sum(len(v) for v in self._free.values())

    def nbytes(self) -> int:
        """Bytes held for reuse."""
        return sum(a.nbytes for v in self._free.values() for a in v)

    def take(self, shape, dtype, device=None):
        """A kept array of this shape and dtype (and device, for tensors), or ``None``."""
        key = (tuple(shape), dtype) if device is None else (tuple(shape), dtype, str(device))
        asked = self._asked
        asked[key] = asked.get(key, 0) + 1
        arrays = self._free.get(key)
        if not arrays:
            return None
        return arrays.pop()

    def new_step(self) -> None:
        """Start a step: keep at most as many arrays of each shape as the last step asked for.

        Shapes not asked for during the last step are dropped, so the workspace does not grow
        when shapes change, nor when other code hands back more arrays of a shape than
        :func:`empty_array` asks for (PyTorch operations allocate many of their results).
        """
        self._wanted, self._asked = self._asked, {}
        for key in list(self._free):
            keep = self._wanted.get(key, 0)
            if keep == 0:
                del self._free[key]
            else:
                del self._free[key][keep:]

    def clear(self) -> None:
        self._free.clear()
        self._asked.clear()
        self._wanted.clear()

    @contextlib.contextmanager
    def active(self) -> Iterator["Workspace"]:
        """Make :func:`empty_array` reuse this workspace's arrays (in this thread only)."""
        token = _ACTIVE_WORKSPACE.set(self)
        try:
            yield self
        finally:
            _ACTIVE_WORKSPACE.reset(token)

    def recycle(self, holder: list) -> None:
        """Keep the unreferenced float arrays found in ``holder``; ``holder`` is emptied.

        Args:
            holder: a list of arrays, dicts, lists and tuples (nested). The caller must
                hold no other reference to the containers or arrays it wants recycled
                (``del`` its variables first): anything referenced elsewhere is left alone.
        """
        if not hasattr(sys, "getrefcount"):  # pragma: no cover - not CPython
            holder.clear()
            return
        found: list = []
        _collect_arrays(holder, found, depth=0)
        holder.clear()                                     # the containers go
        owners = _owners(found)                            # views count through their base
        found.clear()                                      # drop our references to views
        free, wanted, asked = self._free, self._wanted, self._asked
        for key in list(owners):
            a = owners.pop(key)
            if sys.getrefcount(a) == 2:                    # `a` and getrefcount's argument
                if type(a) is np.ndarray:
                    k = (a.shape, a.dtype)
                elif _sole_storage_owner(a):
                    k = (tuple(a.shape), a.dtype, str(a.device))
                else:
                    k = None
                if k is not None:
                    cap = wanted.get(k, 0)                 # no more than a step asks for
                    now = asked.get(k, 0)
                    kept = free.get(k)
                    if kept is None:
                        kept = free[k] = []
                    if len(kept) < max(cap, now):
                        kept.append(a)
            del a


def _owners(arrays: list) -> dict:
    """``id -> array`` of the float arrays owning the memory of ``arrays`` (views' bases)."""
    owners = {}
    for a in arrays:
        if type(a) is np.ndarray:
            while isinstance(a.base, np.ndarray):
                a = a.base
            if a.base is None and a.dtype.kind == "f":
                owners[id(a)] = a
        else:                                              # a torch tensor
            while a._base is not None:
                a = a._base
            if a.is_floating_point() and a.is_contiguous() and a.storage_offset() == 0:
                owners[id(a)] = a
    return owners


def _sole_storage_owner(t) -> bool:
    """Whether no tensor but ``t`` uses ``t``'s storage (the temporary storage object counts 1)."""
    import torch

    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:                                  # a PyTorch without it: never reuse
        return False
    return use_count(t.untyped_storage()._cdata) == 2 and t.untyped_storage().nbytes() == t.nbytes


def _collect_arrays(obj, out: list, depth: int = 0) -> None:
    """Append every array / tensor found in ``obj`` (nested dicts, lists, tuples) to ``out``."""
    stack = [(obj, depth)]
    while stack:
        o, d = stack.pop()
        t = type(o)
        if t is np.ndarray:
            out.append(o)
        elif t is dict or t is list or t is tuple:
            if d < 6:
                stack.extend((item, d + 1) for item in (o.values() if t is dict else o))
        elif t.__module__ == "torch" and is_torch_array(o):
            out.append(o)


class _NumpyElementwise:
    """NumPy's functions, with ``sum`` / ``amax`` bound straight to the ufunc reductions
    (``np.add.reduce``, ``np.maximum.reduce``: the same results, without ``np.sum``'s Python
    wrapper -- a few microseconds that every one of a step's hundreds of calls would pay).

    Kernels always pass ``axis`` (the ufunc reductions default to ``axis=0``, not ``None``)."""

    sum = staticmethod(np.add.reduce)
    amax = staticmethod(np.maximum.reduce)
    add, subtract, multiply, divide = np.add, np.subtract, np.multiply, np.divide
    exp, log, sqrt, reciprocal, tanh = np.exp, np.log, np.sqrt, np.reciprocal, np.tanh

    def __getattr__(self, name):
        return getattr(np, name)


_NUMPY_LIB = _NumpyElementwise()


def elementwise_lib(x):
    """``numpy`` or ``torch``: the library whose elementwise functions take ``out=`` for ``x``.

    ``multiply, add, subtract, divide, exp, log, tanh, sqrt, sum, amax`` have the same names
    and ``out=`` / ``axis=`` / ``keepdims=`` arguments in both, so a kernel written as
    ``lib.tanh(u, out=u)`` runs in place on either. (For NumPy a thin stand-in for the module,
    :class:`_NumpyElementwise`, whose reductions skip NumPy's Python wrappers; kernels pass
    ``axis`` explicitly.)
    """
    if type(x) is np.ndarray:
        return _NUMPY_LIB
    if is_torch_array(x):
        import torch

        return torch
    return _NUMPY_LIB


# ------------------------------------------------------------------ row blocks and threads
#: elements per block. Measured (2-core AMD EPYC, NumPy 2.4): 2^15 (L2-sized blocks) is 10-25%
#: slower than 2^17 - 2^19 for GELU and layer norm -- per-call overhead outweighs L2 misses
#: (the 32 MiB L3 holds the blocks); still small enough to bound the kernels' temporaries.
BLOCK_ELEMENTS = 1 << 18
#: below this many elements a job runs on the calling thread only. Measured on 2 cores: right
#: after a matrix product, OpenBLAS's worker thread busy-waits for ~0.1 s (2^28 cycles,
#: OPENBLAS_THREAD_TIMEOUT), so a second Python thread waits ~1 ms (median; 4 ms p90) before it
#: gets a core -- longer than a GELU or a layer norm of a small model takes on one thread. Only
#: jobs of several milliseconds (the optimizer, gpt2's logits) gain from the second thread.
PARALLEL_MIN_ELEMENTS = 1 << 22
#: the same threshold while :func:`single_threaded_blas` is active: no BLAS worker is spinning,
#: so a second thread starts at once and jobs from a fraction of a millisecond gain from it
QUIET_PARALLEL_MIN_ELEMENTS = 1 << 17

_pool: ThreadPoolExecutor | None = None
_pool_owner: tuple[int, int] | None = None        # (pid, threads): a forked child makes its own
_in_worker = threading.local()
_quiet_blas = 0                                    # depth of active single_threaded_blas() contexts
_blas_controller = None                            # threadpoolctl controller, made on first use


def num_threads() -> int:
    """Threads for NumPy elementwise work: ``PEDESTRIAN_NUM_THREADS`` or the usable cores.

    (Matrix products are threaded by the BLAS library itself, e.g. ``OPENBLAS_NUM_THREADS``.)

    Raises:
        ValueError: ``PEDESTRIAN_NUM_THREADS`` is not a positive integer.
    """
    value = os.environ.get("PEDESTRIAN_NUM_THREADS")
    if value is None:
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # pragma: no cover - not Linux
            return max(1, os.cpu_count() or 1)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"PEDESTRIAN_NUM_THREADS must be a positive integer, got {value!r}; "
                         "unset it to use every available core")
    return int(value)


def _get_pool(threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_owner
    owner = (os.getpid(), threads)
    if _pool is None or _pool_owner != owner:
        _pool = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="pedestrian")
        _pool_owner = owner
    return _pool


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Hold the BLAS library and PyTorch's intra-op pool to one thread inside the block.

    For code that runs its own threads (:class:`pedestrian.parallel.DataParallel`: one
    thread per slice of the batch, each calling single-threaded BLAS), so that no BLAS worker
    competes with them for the cores. Inside the block :func:`for_row_blocks` also shares
    smaller jobs (:data:`QUIET_PARALLEL_MIN_ELEMENTS`) over its threads, since no BLAS worker
    is left spinning after a product. Nested blocks are free; the previous thread counts
    come back on exit. Process-wide, like the libraries' own settings: enter it from one
    thread at a time.

    Uses ``threadpoolctl`` (``openblas_set_num_threads`` and friends) and
    ``torch.set_num_threads`` (only if torch is already imported).
    """
    global _quiet_blas, _blas_controller
    if _quiet_blas:
        _quiet_blas += 1
        try:
            yield
        finally:
            _quiet_blas -= 1
        return
    from threadpoolctl import ThreadpoolController

    if _blas_controller is None:
        _blas_controller = ThreadpoolController().select(user_api="blas")
    torch = sys.modules.get("torch")
    torch_threads = torch.get_num_threads() if torch is not None else None
    with _blas_controller.limit(limits=1):
        if torch is not None:
            torch.set_num_threads(1)
        _quiet_blas = 1
        try:
            yield
        finally:
            _quiet_blas = 0
            if torch is not None:
                torch.set_num_threads(torch_threads)


def in_worker_thread() -> contextlib.AbstractContextManager:
    """Mark the calling thread as one of a parallel team: :func:`for_row_blocks` runs serially."""
    return _WorkerMark()


class _WorkerMark:
    def __enter__(self):
        self._before = getattr(_in_worker, "active", False)
        _in_worker.active = True

    def __exit__(self, *exc):
        _in_worker.active = self._before


def get_pool() -> ThreadPoolExecutor:
    """The shared thread pool: ``num_threads() - 1`` workers (the caller is the first thread)."""
    return _get_pool(num_threads())


def for_row_blocks(like, kernel: Callable[[int, int], None], n_rows: int, row_len: int, *,
                   parallel_min: int | None = None, block: int = BLOCK_ELEMENTS) -> None:
    """Call ``kernel(lo, hi)`` on consecutive blocks of rows that together cover ``0 … n_rows``.

    The kernel must only touch rows ``lo:hi`` of its arrays (so blocks are independent).

    - PyTorch (``like`` a tensor): one call ``kernel(0, n_rows)``; torch threads each operation.
    - NumPy: blocks of about ``block`` elements (few, large calls: NumPy's per-call overhead;
      bounded temporaries); with at least ``parallel_min`` elements the blocks are shared out
      in contiguous runs over :func:`num_threads` threads (NumPy releases the GIL inside each
      elementwise loop), the calling thread taking the first run. The blocks do not depend on
      the number of threads, so neither do the results (e.g. per-block partial sums).

    Args:
        like: an array of the job (picks the backend).
        kernel: ``kernel(lo, hi) -> None``.
        n_rows, row_len: the job is ``n_rows`` rows of ``row_len`` elements.
        parallel_min: smallest job worth a second thread (a kernel of many cheap passes hands
            the GIL back and forth once per pass, so it needs a larger job to gain); default
            :data:`PARALLEL_MIN_ELEMENTS`, or :data:`QUIET_PARALLEL_MIN_ELEMENTS` inside
            :func:`single_threaded_blas`.
        block: elements per block (a kernel of small matrix products wants larger blocks).
    """
    if not is_numpy_array(like):
        kernel(0, n_rows)
        return
    step = max(1, block // max(row_len, 1))
    if step >= n_rows:                                     # one block: no pool, no bookkeeping
        kernel(0, n_rows)
        return
    if parallel_min is None:
        parallel_min = QUIET_PARALLEL_MIN_ELEMENTS if _quiet_blas else PARALLEL_MIN_ELEMENTS
    starts = range(0, n_rows, step)                        # the same blocks for any thread count
    threads = 1
    if n_rows * row_len >= parallel_min and not getattr(_in_worker, "active", False):
        threads = min(num_threads(), len(starts))

    def part(first: int, last: int) -> None:               # blocks first .. last-1
        for start in starts[first:last]:
            kernel(start, min(start + step, n_rows))

    if threads == 1:
        part(0, len(starts))
        return

    def worker(first: int, last: int) -> None:             # a kernel's own blocks run serially
        with in_worker_thread():
            part(first, last)

    bounds = [len(starts) * i // threads for i in range(threads + 1)]
    pool = get_pool()                                      # one pool, whatever this job's share
    futures = [pool.submit(worker, bounds[i], bounds[i + 1]) for i in range(1, threads)]
    try:
        worker(bounds[0], bounds[1])
    finally:
        for f in futures:
            f.result()


def to_numpy(x) -> np.ndarray:
    """Copy / view any supported array as a NumPy array (for saving and testing)."""
    if is_torch_array(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def asarray_like(x, like):
    """Convert ``x`` (NumPy or list) to the namespace and dtype-family of ``like``."""
    xp = array_namespace(like)
    if is_torch_array(like):
        import torch

        return torch.as_tensor(np.asarray(x), device=like.device)
    return xp.asarray(x)

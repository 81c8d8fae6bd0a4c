"""numba, the compiler of the fast kernels' loops: one decorator, IEEE semantics kept.

Every compiled kernel is ``@kernel`` (a serial loop nest) or ``@kernel(parallel=True)`` (rows
shared over numba's threads with ``prange``). Both are compiled on first use, cached on disk
(``cache=True``: numba's ``__pycache__`` beside this package, or its user-wide cache folder
when the package folder is read-only; ``NUMBA_CACHE_DIR`` overrides), and release the GIL.

Floating point: only the fastmath flags that keep NaN and infinity meaningful -- reassociation,
contraction into fused multiply-adds, reciprocals (:data:`FASTMATH`). Never ``nnan`` / ``ninf``:
a NaN or an inf must propagate to where the training loop catches it. Sums may therefore be
taken in another order than NumPy's; the tests' tolerances follow from that (n·ε bounds).

:data:`AVAILABLE` is False where numba cannot be imported; the model then runs the reference
kernels (:mod:`pedestrian.kernels`).
"""

from __future__ import annotations

try:
    import numba
except ImportError:  # pragma: no cover - exercised by a test that hides numba
    numba = None

__all__ = ["AVAILABLE", "FASTMATH", "kernel", "prange"]

#: numba can be imported
AVAILABLE = numba is not None
#: LLVM fast-math flags of every kernel: reassociate, contract (FMA), reciprocal -- no nnan/ninf
FASTMATH = frozenset({"reassoc", "contract", "arcp"})

prange = numba.prange if AVAILABLE else range


def kernel(func=None, *, parallel: bool = False):
    """``@kernel`` / ``@kernel(parallel=True)``: ``numba.njit`` with :data:`FASTMATH`, the disk
    cache and no GIL. Without numba the function is returned as it is (plain Python)."""
    def wrap(f):
        if not AVAILABLE:
            return f
        return numba.njit(cache=True, nogil=True, fastmath=set(FASTMATH), parallel=parallel)(f)

    return wrap if func is None else wrap(func)

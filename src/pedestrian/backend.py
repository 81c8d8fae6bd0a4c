"""The few array operations the array API standard lacks, in one place.

Every formula in :mod:`pedestrian.layers` is written against the array namespace of its
inputs (``xp = array_namespace(x)``, from ``array-api-compat``), so the same lines run on
NumPy arrays and on PyTorch tensors used as plain arrays (no autograd). What the standard
does not offer lives here:

- :func:`scatter_add_rows` -- the embedding backward needs an *accumulating* scatter
  (``np.add.at`` / ``torch.index_add_``); a plain fancy-index ``+=`` drops repeated ids.
- :func:`erf` -- the exact GELU needs the error function (NumPy has none; SciPy does).
- dtype / namespace resolution for the ``backend=`` and ``dtype=`` arguments, and
  conversions to and from NumPy.

The fast path's machinery (memory pool, threads, numba kernels) lives in
:mod:`pedestrian.kernels`, not here.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
from array_api_compat import array_namespace as _compat_array_namespace
from array_api_compat import is_numpy_array as _compat_is_numpy_array
from array_api_compat import is_torch_array as _compat_is_torch_array
from array_api_compat import is_torch_namespace

__all__ = [
    "array_namespace",
    "namespace_for",
    "resolve_dtype",
    "scatter_add_rows",
    "erf",
    "to_numpy",
    "persistent",
    "asarray_like",
    "is_numpy_array",
    "is_torch_array",
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
            __import__("torch")               # only to say what is missing, before array_api_compat does
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


def erf(x):
    """Elementwise error function on NumPy arrays (SciPy) or torch tensors (torch.special)."""
    if is_torch_array(x):
        import torch

        return torch.special.erf(x)
    from scipy.special import erf as _erf

    return _erf(x)


def persistent(xp):
    """A context in which ``xp`` makes arrays that outlive it: for torch, tensors made outside
    ``torch.inference_mode`` even inside one (a model's buffers first made during an inference-mode
    call stay usable after it); for NumPy nothing."""
    if is_torch_namespace(xp):
        import torch

        return torch.inference_mode(False)
    return contextlib.nullcontext()


def to_numpy(x) -> np.ndarray:
    """Copy / view any supported array as a NumPy array (for saving and testing); a bfloat16
    tensor (NumPy has no bfloat16) comes as float32, widened exactly."""
    if is_torch_array(x):
        import torch

        x = x.detach()
        return (x.float() if x.dtype == torch.bfloat16 else x).cpu().numpy()
    return np.asarray(x)


def asarray_like(x, like):
    """Convert ``x`` (NumPy or list) to the namespace and dtype-family of ``like``."""
    xp = array_namespace(like)
    if is_torch_array(like):
        import torch

        return torch.as_tensor(np.asarray(x), device=like.device)
    return xp.asarray(x)

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
- dtype / namespace resolution for the ``backend=`` and ``dtype=`` arguments.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from array_api_compat import array_namespace, is_numpy_array, is_torch_array

__all__ = [
    "array_namespace",
    "namespace_for",
    "resolve_dtype",
    "scatter_add_rows",
    "erf",
    "matmul_into",
    "to_numpy",
    "asarray_like",
    "is_numpy_array",
    "is_torch_array",
]

BACKENDS = ("numpy", "torch")
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
    ``target[index] += rows`` silently drops duplicates in NumPy.
    """
    if is_numpy_array(target):
        np.add.at(target, index, rows)
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


def matmul_into(out, a, b) -> None:
    """``out[...] = a @ b`` without an intermediate when the backend allows it.

    Args:
        out: preallocated array of the product's shape (may be a strided view into a flat
            gradient buffer).
        a, b: 2-D operands.
    """
    if is_numpy_array(out) and out.flags.c_contiguous:
        np.matmul(a, b, out=out)
    elif is_torch_array(out) and out.is_contiguous():
        import torch

        torch.matmul(a, b, out=out)
    else:
        out[...] = a @ b


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

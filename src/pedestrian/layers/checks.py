"""Argument checks of the layer functions, shared by the reference layers and the fast kernels.

NumPy's fancy indexing wraps a negative id around and numba's loops check no bounds at all (a
target equal to the vocabulary size read and wrote past its row), so every layer that indexes an
array by the caller's integers checks them first, explicitly: one pass over the ids (their
minimum and maximum), the place of the first bad one looked up only when there is one. Dtypes the
kernels cannot run (integers, complex numbers) are refused by name. NumPy arrays skip the array
API's namespace lookup (microseconds a call, which a KV-cache step of generation notices).

A caller may take over the range check for its thread (:func:`set_id_check`): a training step on
a device records each verdict as a flag instead of reading the ids on the host
(:mod:`pedestrian.model.device_checks`); the checks here know nothing of devices.
"""

from __future__ import annotations

import threading

import numpy as np

from ..backend import array_namespace

__all__ = ["check_float", "check_ids", "set_id_check"]

_taken_over = threading.local()


def set_id_check(check):
    """Let ``check(ids, n, what, ignore_index) -> bool`` see :func:`check_ids`' integer ids first
    on the calling thread (``None``: nobody); when it returns ``True`` the range check is its
    job and :func:`check_ids` returns. Returns the one set before (to restore it)."""
    before, _taken_over.check = getattr(_taken_over, "check", None), check
    return before


def check_ids(ids, n: int, what: str, *, ignore_index: int | None = None) -> None:
    """Raises ``ValueError`` naming the first id of ``ids`` outside ``[0, n)`` (and not
    ``ignore_index``), its position and the valid range; ``TypeError`` for ids that are not
    integers. NumPy arrays or torch tensors (any device). The range check may be taken over
    (:func:`set_id_check`)."""
    numpy = type(ids) is np.ndarray
    xp = np if numpy else array_namespace(ids)
    if not (ids.dtype.kind in "iu" if numpy else xp.isdtype(ids.dtype, "integral")):
        raise TypeError(f"{what} must be integers, got dtype {ids.dtype}")
    if 0 in tuple(ids.shape):
        return
    taker = getattr(_taken_over, "check", None)
    if taker is not None and taker(ids, n, what, ignore_index):
        return                                                               # its job now
    if numpy and 0 <= ids.min() and ids.max() < n:
        return                                                               # (the one pass)
    bad = (ids < 0) | (ids >= n)
    if not numpy and not bool(xp.any(bad)):                                  # (one host read)
        return
    if ignore_index is not None:
        bad = bad & (ids != ignore_index)
    where = xp.nonzero(bad)
    if where[0].shape[0] == 0:                                               # only ignore_index
        return
    position = tuple(int(w[0]) for w in where)
    allowed = f"[0, {n})" + ("" if ignore_index is None else f" or the ignore index {ignore_index}")
    raise ValueError(f"{what} {int(ids[position])} at position {position} is outside {allowed}")


def check_float(x, what: str) -> None:
    """Raises ``TypeError`` naming the dtype when ``x`` is not a real floating-point array."""
    if type(x) is np.ndarray:
        if x.dtype.kind == "f":
            return
    elif array_namespace(x).isdtype(x.dtype, "real floating"):
        return
    raise TypeError(f"{what} must be a real floating-point array, got dtype {x.dtype}; "
                    "convert it first (float32 or float64)")

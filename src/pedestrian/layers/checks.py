"""Argument checks of the layer functions, shared by the reference layers and the fast kernels.

NumPy's fancy indexing wraps a negative id around and numba's loops check no bounds at all (a
target equal to the vocabulary size read and wrote past its row), so every layer that indexes an
array by the caller's integers checks them first, explicitly: one pass over the ids (their
minimum and maximum), the place of the first bad one looked up only when there is one. Dtypes the
kernels cannot run (integers, complex numbers) are refused by name. NumPy arrays skip the array
API's namespace lookup (microseconds a call, which a KV-cache step of generation notices).

On a device (a GPU), looking at the ids' minimum and maximum is a host synchronisation: the host
waits for every queued kernel before it can compare. Inside :func:`deferred_checks` (a training
step on torch tensors, :func:`pedestrian.training.step.train_step`) the checks of torch tensors
therefore only *record* their verdict as a flag on the device (a 0-d bool tensor, nothing read);
the step reads every flag at once, with its loss, at the one point where it needs numbers on the
host (:class:`DeviceFlags`), and when one is set it runs the checks again on the host,
in the order they were made, so that the first failing one raises the error it raises today
(the same text, value and position). NumPy arrays are checked at once, as ever.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from ..backend import array_namespace

__all__ = ["check_float", "check_ids", "deferred_checks", "deferring", "DeviceFlags"]


class DeviceFlags:
    """The checks made inside one :func:`deferred_checks`: each a 0-d bool tensor on the device
    (``True``: something is wrong) and the host check that names it (a callable that raises).

    Attributes:
        flags: the recorded flags, in the order the checks were made.
        checks: their host checks, in the same order.
    """

    def __init__(self):
        self.flags: list = []
        self.checks: list = []

    def add(self, flag, check) -> None:
        """Record ``flag`` (0-d bool tensor, not read) and ``check`` (raises when it is ``True``)."""
        self.flags.append(flag)
        self.checks.append(check)

    def any(self):
        """One 0-d bool tensor on the device: whether some flag is set (``None``: no flags)."""
        if not self.flags:
            return None
        import torch

        return torch.stack(self.flags).any() if len(self.flags) > 1 else self.flags[0]

    def raise_first(self) -> None:
        """Run the recorded checks on the host, in their order, outside the deferral: the first
        that fails raises its error (a host synchronisation, on the error path only).

        Raises:
            whatever the first failing check raises; ``AssertionError`` if a flag was set but
            no check fails on the host (the device and the host disagree: a bug).
        """
        with _deferral(None):
            for check in self.checks:
                check()
        raise AssertionError(f"a check flagged on the device passed on the host ({len(self.checks)} checks)")


_state = threading.local()


def deferring() -> DeviceFlags | None:
    """The calling thread's :class:`DeviceFlags` inside :func:`deferred_checks`, else ``None``."""
    return getattr(_state, "flags", None)


@contextlib.contextmanager
def _deferral(flags):
    before, _state.flags = deferring(), flags
    try:
        yield flags
    finally:
        _state.flags = before


def deferred_checks():
    """``with deferred_checks() as flags:`` the calling thread's checks of torch tensors record a
    flag in ``flags`` (a :class:`DeviceFlags`) instead of reading the tensors on the host; the
    caller reads ``flags.any()`` once and calls ``flags.raise_first()`` when it is set. Nested,
    the inner block gets its own flags."""
    return _deferral(DeviceFlags())


def check_ids(ids, n: int, what: str, *, ignore_index: int | None = None) -> None:
    """Raises ``ValueError`` naming the first id of ``ids`` outside ``[0, n)`` (and not
    ``ignore_index``), its position and the valid range; ``TypeError`` for ids that are not
    integers. NumPy arrays or torch tensors (any device); inside :func:`deferred_checks` a torch
    tensor's range is a flag, its ``ValueError`` raised when the flags are read."""
    numpy = type(ids) is np.ndarray
    xp = np if numpy else array_namespace(ids)
    if not (ids.dtype.kind in "iu" if numpy else xp.isdtype(ids.dtype, "integral")):
        raise TypeError(f"{what} must be integers, got dtype {ids.dtype}")
    if 0 in tuple(ids.shape):
        return
    flags = None if numpy else deferring()
    if flags is not None:                                                    # a flag, not a read
        bad = (ids < 0) | (ids >= n)
        if ignore_index is not None:
            bad = bad & (ids != ignore_index)
        flags.add(xp.any(bad), lambda: check_ids(ids, n, what, ignore_index=ignore_index))
        return
    if numpy and 0 <= ids.min() and ids.max() < n or not numpy and 0 <= int(xp.min(ids)) and int(xp.max(ids)) < n:
        return                                                               # (the one pass)
    bad = (ids < 0) | (ids >= n)
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

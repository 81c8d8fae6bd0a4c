"""Input checks as flags on a device: a training step on a GPU reads the device once.

On a device (a GPU), looking at ids' minimum and maximum is a host synchronisation: the host
waits for every queued kernel before it can compare. Inside :func:`deferred_checks` (a training
step on torch tensors, :func:`pedestrian.training.step.train_step`) the id checks of torch
tensors -- the model's own (:mod:`pedestrian.model.inputs`) and the layers'
(:func:`pedestrian.layers.checks.check_ids`, taken over through
:func:`~pedestrian.layers.checks.set_id_check`) -- only *record* their verdict as a flag on the
device (a 0-d bool tensor, nothing read). The step reads every flag at once, with its loss, at
the one point where it needs numbers on the host (:class:`DeviceFlags`), and when one is set it
runs the checks again on the host, in the order they were made, so that the first failing one
raises the error it raises at once elsewhere (the same text, value and position). NumPy arrays
are checked at once, as ever.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from ..backend import array_namespace
from ..layers.checks import check_ids, set_id_check

__all__ = ["DeviceFlags", "deferred_checks", "deferring", "read_checked", "checked_after"]


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


def _flag_ids(ids, n: int, what: str, ignore_index) -> bool:
    """:func:`~pedestrian.layers.checks.check_ids`' range check taken over inside a deferral: a
    torch tensor's verdict becomes a flag (``True``: recorded); NumPy ids are checked at once."""
    flags = deferring()
    if flags is None or type(ids) is np.ndarray:
        return False
    bad = (ids < 0) | (ids >= n)
    if ignore_index is not None:
        bad = bad & (ids != ignore_index)
    flags.add(array_namespace(ids).any(bad), lambda: check_ids(ids, n, what, ignore_index=ignore_index))
    return True


@contextlib.contextmanager
def _deferral(flags):
    before, _state.flags = deferring(), flags
    taker = set_id_check(None if flags is None else _flag_ids)
    try:
        yield flags
    finally:
        _state.flags = before
        set_id_check(taker)


def deferred_checks():
    """``with deferred_checks() as flags:`` the calling thread's id checks of torch tensors record
    a flag in ``flags`` (a :class:`DeviceFlags`) instead of reading the tensors on the host; the
    caller reads ``flags.any()`` once and calls ``flags.raise_first()`` when it is set. Nested,
    the inner block gets its own flags."""
    return _deferral(DeviceFlags())


def read_checked(run, tensors: bool) -> float:
    """The float of ``run()`` (a 0-d loss). With ``tensors`` (torch tensors, and no deferral
    already around this call) the id checks made inside ``run`` are deferred and their flags come
    to the host with the loss in one transfer -- a :meth:`GPT.loss <pedestrian.model.GPT.loss>`
    on a device waits for it once, not once per check; a set flag raises the first failing
    check's own error (:meth:`DeviceFlags.raise_first`). Otherwise the checks run as made."""
    if not tensors or deferring() is not None:
        return float(run())
    with deferred_checks() as flags:
        loss = run()
    flag = flags.any()
    if flag is None:
        return float(loss)
    import torch

    loss = torch.as_tensor(loss, dtype=torch.float64, device=flag.device)  # (a torch-CPU model's is NumPy)
    loss, bad = torch.stack([loss, flag.double()]).tolist()                  # the one read
    if bad:
        flags.raise_first()
    return loss


def checked_after(run, tensors: bool):
    """``run()``'s result. With ``tensors`` (torch tensors, no deferral already around this call) the
    id checks made inside ``run`` are deferred and their flags read once, after ``run`` -- a
    :meth:`GPT.forward <pedestrian.model.GPT.forward>` on a device is queued whole before the host
    waits, once, instead of a read per check before its first kernel; a set flag raises the first
    failing check's own error (:meth:`DeviceFlags.raise_first`). Otherwise the checks run as made."""
    if not tensors or deferring() is not None:
        return run()
    with deferred_checks() as flags:
        out = run()
    flag = flags.any()
    if flag is not None and bool(flag):                                      # the one read
        flags.raise_first()
    return out

"""Memory reuse for the fast kernels: a pool of arrays handed out again once nothing uses them.

A training step allocates the same arrays every time. Freeing and re-allocating tens of
megabytes per step makes the C library hand the memory back to the operating system and fault
it in again, page by page, which can cost as much as the arithmetic (docs/kernels.md). A :class:`Workspace` keeps every array it
has handed out; :func:`empty_array` returns one of them again as soon as nothing outside the pool
refers to it (no variable, no view, no dict -- checked with the reference count), so no kernel
and no model code ever has to say when an array is finished: an array the caller still holds is
never overwritten.

This module is bookkeeping only; no formula lives here.
"""

from __future__ import annotations

import contextvars
import math
import sys

import numpy as np

from . import schedule

__all__ = ["Workspace", "empty_array", "active_workspace"]

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("pedestrian_workspace", default=None)
#: sys.getrefcount of a pooled array nobody else holds: the pool's list and getrefcount's own
#: argument (the loop variable adds one more while searching)
_FREE_REFCOUNT = 2


class Workspace:
    """Arrays handed out by :func:`empty_array` while this workspace is :meth:`active`.

    An array is handed out again only when nothing outside the pool refers to it or to a view
    of it (``sys.getrefcount``; views count through their ``base``). NumPy only. Shapes not asked for
    during a whole step are dropped at :meth:`new_step`, so the pool does not grow when shapes
    change. Without ``sys.getrefcount`` (not CPython) nothing is pooled.

    One thread at a time: the reference counts it reads and its bookkeeping are not shared
    safely between threads, so a model keeps one workspace per thread (:class:`pedestrian.GPT`).
    """

    def __init__(self) -> None:
        self._pool: dict[tuple, list] = {}
        self._next: dict[tuple, int] = {}                  # where the next search starts
        self._asked: set = set()
        self._tokens: list = []                            # contextvar tokens of nested `with`
        #: the fast kernels' thread count as read once in this step (``None``: not yet; set by
        #: :func:`pedestrian.kernels.blas.few_rows_matmul`, dropped by :meth:`new_step`); ``1`` for
        #: a training step's few-row products (:meth:`new_step`)
        self.threads: int | None = None

    def __len__(self) -> int:
        return sum(len(v) for v in self._pool.values())

    def nbytes(self) -> int:
        """Bytes of every array the pool holds (in use or free)."""
        return sum(a.nbytes for v in self._pool.values() for a in v)

    def take(self, shape, like):
        """A free pooled NumPy array of ``shape`` with ``like``'s dtype, else a new one that joins
        the pool."""
        key = (shape, like.dtype)
        self._asked.add(key)
        arrays = self._pool.get(key)
        if arrays is None:
            arrays = self._pool[key] = []
        n = len(arrays)
        start = self._next.get(key, 0)
        for i in range(n):                                 # a step takes them in the same order
            j = (start + i) % n                            # as the last: start after the last one
            a = arrays[j]
            if sys.getrefcount(a) == _FREE_REFCOUNT + 1:
                self._next[key] = j + 1
                return a
            del a
        a = np.empty(shape, dtype=like.dtype)
        if _POOLING and n < schedule.MAX_PER_SHAPE:
            arrays.append(a)
            self._next[key] = n + 1
        return a

    def new_step(self, training: bool = False) -> None:
        """Drop the shapes nobody asked for since the last call (and the step's thread count).

        ``training``: a step that keeps its activations (a forward for a backward) runs its
        few-row products (a mixture's experts with a handful of tokens, a tiny model's layers) on
        one thread, numba's BLAS: on BLAS's own thread pool they left its threads spinning beside
        numba's regions (a small Qwen3-MoE's forward 0.74-0.88 s against 0.39-0.44 s one-threaded,
        docs/kernels.md). A generated token (``False``) keeps BLAS's threads, measured faster there."""
        self.threads = 1 if training else None
        for key in [k for k in self._pool if k not in self._asked]:
            del self._pool[key]
        self._next = {}
        self._asked = set()

    def active(self) -> "Workspace":
        """``with workspace.active():`` (or ``with workspace:``) makes :func:`empty_array` use this
        workspace, in this thread / context only; the blocks may nest."""
        return self

    def __enter__(self) -> "Workspace":
        self._tokens.append(_ACTIVE.set(self))
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._tokens.pop())


_POOLING = hasattr(sys, "getrefcount")


def active_workspace() -> Workspace | None:
    """The workspace made active in this thread / context (``None``: none)."""
    return _ACTIVE.get()


def empty_array(shape, like):
    """A C-contiguous NumPy array of ``shape`` with ``like``'s dtype; contents undefined (the
    caller overwrites every entry).

    Inside :meth:`Workspace.active` a pooled array nobody uses any more is returned when there is
    one (a torch tensor made from it by :mod:`pedestrian.kernels` keeps a reference to it, so
    it counts as in use). (Unlike ``empty_like``, the result is always C-contiguous, so its reshapes
    are views.)
    """
    shape = tuple(shape)
    workspace = _ACTIVE.get()
    if workspace is not None and math.prod(shape) * like.dtype.itemsize >= schedule.MIN_POOLED_BYTES:
        return workspace.take(shape, like)
    return np.empty(shape, dtype=like.dtype)

"""Argument checks shared by the reference layers and the fast kernels (not in the paper).

NumPy's fancy indexing wraps a negative id around, torch's and numba's loops do not check at all
(numba reads and writes past a row), so every layer that indexes an array by the caller's
integers checks them first, explicitly: one pass over the ids (their minimum and maximum), the
position of the first bad one looked up only when there is one. Dtypes the kernels cannot run
(integers, complex) are refused by name.
"""

from __future__ import annotations

from ..backend import array_namespace


def check_ids(ids, n: int, what: str, *, ignore_index: int | None = None) -> None:
    """Raises ``ValueError`` naming the first id of ``ids`` outside ``[0, n)`` (other than
    ``ignore_index``), its position and the valid range; ``TypeError`` for ids that are not
    integers."""
    xp = array_namespace(ids)
    if not xp.isdtype(ids.dtype, "integral"):
        raise TypeError(f"{what} must be integers, got dtype {ids.dtype}")
    if 0 in tuple(ids.shape):
        return
    lo, hi = int(xp.min(ids)), int(xp.max(ids))                              # the one pass
    if 0 <= lo and hi < n:
        return
    bad = (ids < 0) | (ids >= n)
    if ignore_index is not None:
        bad = bad & (ids != ignore_index)
    where = xp.nonzero(bad)
    if where[0].shape[0] == 0:                                               # only ignore_index
        return
    position = tuple(int(w[0]) for w in where)
    value = int(ids[position])
    allowed = f"[0, {n})" + ("" if ignore_index is None else f" or the ignore index {ignore_index}")
    raise ValueError(f"{what} {value} at position {position} is outside {allowed}")


def check_float(x, what: str) -> None:
    """Raises ``TypeError`` naming the dtype when ``x`` is not a real floating array."""
    xp = array_namespace(x)
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"{what} must be a real floating array (float32 or float64), got dtype {x.dtype}")

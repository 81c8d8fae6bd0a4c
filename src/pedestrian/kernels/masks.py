"""The attention's masks as loop bounds (EQUATIONS.md, "Masks as key ranges: window, packed
segments, exact zeros"): every mask keeps, per query row, one contiguous range of keys.

The reference builds the same masks as boolean matrices
(:func:`pedestrian.layers.attention.attention_mask`); the fast kernels
(:mod:`.attention_loops`, :mod:`.attention_tiled`) loop over ``lo … hi − 1`` only.
"""

from __future__ import annotations

import numpy as np

__all__ = ["key_bounds"]

_BOUNDS: dict = {}


def key_bounds(B: int, T: int, causal: bool, window: int | None = None, segments=None):
    """``bounds`` ``(3, B | 1, T)`` int64, ``lo, hi, seg = bounds``: query ``t`` of batch row ``b``
    sees keys ``lo[b', t] <= j < hi[b', t]``, ``seg[b', t]`` its segment (``b' = b``; ``b' = 0``
    when the arrays have one row, no ``segments``; one array: one argument of a compiled kernel to
    unbox, not three) -- the masks of :func:`pedestrian.layers.attention.attention_mask` as
    loop bounds: causal ``j <= t``, a window ``t − w < j``, a segment ``start(t) <= j < end(t)``.

    Raises:
        ValueError: ``segments`` not ``(B, T)`` integers nondecreasing along ``T``.
    """
    if segments is None:
        key = (T, causal, window)
        got = _BOUNDS.get(key)
        if got is None:
            t = np.arange(T, dtype=np.int64)
            lo = np.zeros(T, np.int64) if window is None else np.maximum(t - window + 1, 0)
            hi = t + 1 if causal else np.full(T, T, np.int64)
            got = np.stack([lo, hi, np.zeros(T, np.int64)])[:, None]         # (3, 1, T)
            if len(_BOUNDS) > 256:
                _BOUNDS.clear()
            _BOUNDS[key] = got
        return got
    seg = np.asarray(segments)
    if seg.shape != (B, T) or seg.dtype.kind not in "iu":
        raise ValueError(f"segments must be ({B}, {T}) integers (a segment id per token), got "
                         f"{seg.dtype} {seg.shape}")
    seg = seg.astype(np.int64)
    if T > 1 and np.any(seg[:, 1:] < seg[:, :-1]):
        raise ValueError("segments must be nondecreasing along each row (one id per packed sequence, "
                         "in order); renumber them")
    t = np.broadcast_to(np.arange(T, dtype=np.int64), (B, T))
    change = np.ones((B, T), bool)
    change[:, 1:] = seg[:, 1:] != seg[:, :-1]
    start = np.maximum.accumulate(np.where(change, t, 0), axis=1)            # first index of its segment
    last = np.ones((B, T), bool)
    last[:, :-1] = change[:, 1:]
    end = T - np.maximum.accumulate(np.where(last, T - 1 - t, 0)[:, ::-1], axis=1)[:, ::-1]   # one past its last
    lo = start if window is None else np.maximum(start, t - window + 1)
    hi = t + 1 if causal else end
    return np.ascontiguousarray(np.stack([lo, hi, seg]))                     # (3, B, T)

"""The attention's masks as loop bounds (EQUATIONS.md, "Masks as key ranges: window, packed
segments, exact zeros"): every mask keeps, per query row, one contiguous range of keys.

The reference builds the same masks as boolean matrices
(:func:`pedestrian.layers.attention.attention_mask`); the fast kernels
(:mod:`.attention_loops`, :mod:`.attention_tiled`) loop over ``lo … hi − 1`` only.
"""

from __future__ import annotations

import numpy as np

from .jit import kernel

__all__ = ["block_bounds", "key_bounds", "key_range", "row_range", "tile_allowed", "torch_bounds"]

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


@kernel
def row_range(i, i0, j0, c, lo, hi):
    """``(a, n)``: the keys ``j0 + a … j0 + n − 1`` of a tile (first key ``j0``, ``c`` of them) that
    query ``i0 + i`` may see (``lo``, ``hi``: its batch row's bounds); ``a >= n``: none."""
    return min(c, max(0, lo[i0 + i] - j0)), min(c, max(0, hi[i0 + i] - j0))


@kernel
def block_bounds(lo, hi, bq, b_lo, b_hi):
    """Per query block of ``bq`` rows: the smallest ``lo`` and largest ``hi`` of its rows."""
    T = lo.shape[0]
    for n in range(b_lo.shape[0]):
        i0 = n * bq
        b_lo[n], b_hi[n] = lo[i0], hi[i0]
        for i in range(i0, min(i0 + bq, T)):
            b_lo[n] = min(b_lo[n], lo[i])
            b_hi[n] = max(b_hi[n], hi[i])


def torch_bounds(bounds, cap: float, like) -> dict:
    """The mask of a tile loop on torch tensors: ``lo``, ``hi`` ``(B | 1, T)`` on ``like``'s device, the
    bounds on the host (to skip tiles) and the soft-cap."""
    import torch

    lo, hi, _ = bounds
    return dict(lo=torch.from_numpy(lo).to(like.device), hi=torch.from_numpy(hi).to(like.device),
                lo_host=lo, hi_host=hi, cap=cap)


def tile_allowed(mask, i0: int, i1: int, j0: int, j1: int, s):
    """Boolean ``(B | 1, 1, …, r, c)`` of the tile's visible scores, shaped to broadcast over ``s``
    ``(G, r, c)`` or ``(G_kv, g, r, c)`` viewed as ``(B, heads…, r, c)``."""
    import torch

    j = torch.arange(j0, j1, device=s.device)
    ok = (j >= mask["lo"][:, i0:i1, None]) & (j < mask["hi"][:, i0:i1, None])   # (B | 1, r, c)
    return ok.reshape(ok.shape[0], *(1,) * (s.dim() - 3), *ok.shape[1:])


def key_range(mask, causal: bool, i0: int, i1: int, T: int) -> tuple:
    """The keys a query block ``i0 … i1 − 1`` may see: ``(start, end)``."""
    if mask is None:
        return 0, i1 if causal else T
    return int(mask["lo_host"][:, i0:i1].min()), int(mask["hi_host"][:, i0:i1].max())

"""Tiled (flash-style) multi-head attention: the section-3 head in blocks, O(T) memory.

The same function as :func:`pedestrian.layers.attention.multi_head_attention_forward` and its
backward, computed in a different order (docs/EQUATIONS.md, "Tiled attention"):

- **Forward.** Queries are taken ``block_q`` rows at a time and keys ``block_k`` at a time. For a
  block of queries the softmax is built up over the key blocks as a row sum ``l`` and output
  ``u`` relative to a reference ``m`` per row: first ``m = S_α0``, each row's score of key 0
  (fixed: no row maximum, no rescaling, ``S − m`` inside the product); if some row's ``l``
  exceeds :data:`FIXED_REFERENCE_MAX_SUM`, the row block again with a running maximum (the
  online softmax: each new block rescales the sums by ``exp(m_old − m_new)``). Per query row
  only the output and the log-sum-exp ``ℓ = m + log l`` are kept; the ``T × T`` matrix ``P`` is
  never stored. With the causal mask, key blocks wholly above the diagonal are skipped.
- **Backward.** Each block's ``P = exp(S − ℓ)`` is recomputed from ``q``, ``k`` and the stored
  ``ℓ``; ``dv``, ``dP``, ``Δcausal``, ``dq`` and ``dk`` are accumulated block by block. The row
  sums of the softmax backward come from ``rowsum(dP ∘ P) = rowsum(Δ ∘ out)`` (EQUATIONS.md),
  ``T × d_head`` numbers computed before the first block.
- **Threads.** The work is cut into units -- a run of heads (of the ``B · n_heads``) times a
  block of queries (forward) or a run of query blocks (backward) -- that NumPy shares over
  :func:`pedestrian.kernels.threads.num_threads` threads, each calling a single-threaded BLAS
  (NumPy and the BLAS release the GIL), so both cores are busy at batch 1. Each thread takes
  the next unit left, largest first. Every unit writes its own outputs (the backward's ``dk``,
  ``dv`` per run of query blocks, added in a fixed order at the end), so the result is the same
  bits for any number of threads. PyTorch threads each operation itself; there the units run
  one after the other.

- **Powers of 2.** On PyTorch's CPU the tiles take ``2^x`` instead of ``e^x``
  (:func:`pedestrian.kernels.blas.uses_exp2`): ``q`` carries ``log₂e`` besides ``1/√d_qk``, so
  ``S``, ``m`` and ``ℓ`` are in units of ``ln 2`` and ``P = 2^(S·log₂e − ℓ·log₂e)`` is the same
  number; ``dk``, a product with that ``q``, is divided by ``log₂e`` at the end.
- **numba.** On NumPy arrays a tile's causal mask and ``exp`` are one loop
  (:func:`pedestrian.kernels.attention_loops.exp_tile`: masked entries written 0, not computed).

``Δcausal`` (``backward(keep_delta_causal=True)``) and ``P`` (:func:`tiled_attention_weights`)
are computed on request only, as full ``(B, n_heads, T, T)`` arrays.

:func:`pedestrian.kernels.attention.multi_head_attention_forward` picks this kernel from
:data:`TILED_MIN_T` on (docs/performance.md, "Long context").
"""

from __future__ import annotations

import contextlib
import math

from ..backend import is_numpy_array, is_torch_array
from . import attention_loops, blas
from .blas import copy_into, elementwise_lib, matmul_into, rowdot
from .threads import is_worker_thread, num_threads, run_units
from .workspace import empty_array, scratch

__all__ = ["BLOCKS", "TILED_MIN_T", "TILE_ELEMENTS", "BACKWARD_RUNS", "OWN_THREADS", "FIXED_REFERENCE_MAX_SUM",
           "use_tiled", "tiled_attention_forward", "tiled_attention_backward", "tiled_attention_weights"]

#: ``(block_q, block_k)`` per backend: query rows and key columns of one tile (several heads'
#: tiles go through each call). Measured at T = 2048, 4 heads of 32 (docs/performance.md, "Long
#: context"): on NumPy, one core, every size from 64 × 128 to 256 × 512 was within 10%, 128 × 256
#: among the best both ways; torch tensors pay more per call (~5-10 µs) and thread each one:
#: 256 × 512 was as fast as 128 × 256 on one thread and faster on two.
BLOCKS = {"numpy": (128, 256), "torch": (256, 512)}
#: the shortest sequence for which the fast path uses this kernel (below it, the full-matrix
#: kernel of :mod:`pedestrian.kernels.attention` is faster). Measured, docs/performance.md.
TILED_MIN_T = {"numpy": 256, "torch": 512}
#: NumPy: the heads of one call share tiles of at most this many scores in all (8 heads of
#: 128 × 256; measured on T = 256 … 512: 3-5% faster than all of a slice's 16-32 heads at once)
TILE_ELEMENTS = 1 << 18
#: the backward cuts the query blocks into this many runs (units of work for the threads). Each
#: run sums its ``dk``, ``dv`` into an array of its own, added in a fixed order at the end, so the
#: result is the same whichever thread ran which run and however many threads there are.
BACKWARD_RUNS = 4
#: the forward takes each row's score of key 0, ``m = S_α0``, as the reference of all its key
#: blocks (no row maximum, no rescaling; EQUATIONS.md, "A fixed reference") when every row's
#: sum ``l = Σ_β exp(S − m)`` (``>= 1``: key 0's own term) stays at most this: ``e^20``, far from
#: float32's overflow, and ``ℓ = m + log l`` then keeps nearly the bits the running maximum's
#: does. A row block over it (a key scoring far above key 0, or a NaN) is computed again with the
#: running maximum
FIXED_REFERENCE_MAX_SUM = math.exp(20.0)
#: share the units of work over our own threads (NumPy and the BLAS release the GIL; each thread
#: calls a single-threaded BLAS), or leave the threading to the library (PyTorch threads each
#: operation; on a busy machine neither measured better for torch tensors)
OWN_THREADS = {"numpy": True, "torch": False}


def _backend(x) -> str:
    return "torch" if is_torch_array(x) else "numpy"


def use_tiled(T: int, like) -> bool:
    """Whether the fast path runs tiled attention for a sequence of ``T`` tokens (no KV cache)
    on ``like``'s backend: ``T >= TILED_MIN_T[backend]``."""
    return T >= TILED_MIN_T[_backend(like)]


_MASKS: dict = {}


def _tile_mask(rows: int, cols: int, offset: int, like):
    """Additive ``(rows, cols)`` causal mask of a tile whose first query sits ``offset`` positions
    after its first key: ``−∞`` where key ``c`` comes after query ``r`` (``c > r + offset``)."""
    key = (rows, cols, offset, like.dtype, like.device)                  # dtypes differ by backend
    mask = _MASKS.get(key)
    if mask is None:
        if is_torch_array(like):
            import torch

            pos_r = torch.arange(rows, device=like.device)[:, None]
            pos_c = torch.arange(cols, device=like.device)[None, :]
            mask = torch.zeros((rows, cols), dtype=like.dtype, device=like.device)
            mask.masked_fill_(pos_c > pos_r + offset, -math.inf)
        else:
            import numpy as np

            mask = np.zeros((rows, cols), dtype=like.dtype)
            mask[np.arange(cols)[None, :] > np.arange(rows)[:, None] + offset] = -math.inf
        if len(_MASKS) > 256:                              # many sequence lengths: start again
            _MASKS.clear()
        _MASKS[key] = mask
    return mask


def _carve(flat, *shape):
    """A C-contiguous ``shape`` view at the start of the 1-D scratch array ``flat`` (one
    :func:`scratch` call per unit of work instead of one per tile: ~6 µs each)."""
    n = 1
    for size in shape:
        n *= size
    return flat[:n].reshape(shape)


def _zeros(shape, like):
    if is_numpy_array(like):
        import numpy as np

        return np.zeros(shape, dtype=like.dtype)
    import torch

    return torch.zeros(shape, dtype=like.dtype, device=like.device)


def _split_heads_into(dst, src, B: int, n_heads: int) -> None:
    """``src`` ``(B, T, n_heads·w)`` (a column block of ``qkv``) into ``dst`` ``(B·n_heads, T, w)``."""
    T, w = src.shape[1], src.shape[2] // n_heads
    copy_into(dst.reshape(B, n_heads, T, w), src.reshape(B, T, n_heads, w).swapaxes(1, 2))


def _merge_heads_into(dst, src, B: int, n_heads: int) -> None:
    """``src`` ``(B·n_heads, T, w)`` into ``dst`` ``(B, T, n_heads·w)`` (head ``h``: columns ``h·w …``)."""
    T, w = src.shape[1], src.shape[2]
    copy_into(dst.reshape(B, T, n_heads, w).swapaxes(1, 2), src.reshape(B, n_heads, T, w))


def _threads(like) -> int:
    """Threads this call may use: 1 inside a worker thread (DataParallel's slices are already one
    per core) or where :data:`OWN_THREADS` leaves the threading to the library."""
    if is_worker_thread() or not OWN_THREADS[_backend(like)]:
        return 1
    return num_threads()


def _head_runs(like, G: int, tile: int, threads: int, blocks: int) -> list:
    """``(lo, hi)`` runs of the ``G`` heads computed together and, on NumPy, tiles of at most
    :data:`TILE_ELEMENTS` scores (``tile`` per head). All heads in one run when the ``blocks``
    (query blocks or runs of them) alone give each thread two units of work, else at least
    one run per thread. Fewer, larger calls: each NumPy call hands the GIL to the other thread
    and back (T = 1024, batch 1, 2 threads: forward 4.2 against 4.9 ms with two runs of 2 heads)."""
    run = G if blocks >= 2 * threads else -(-G // threads)
    if is_numpy_array(like):
        run = max(1, min(run, TILE_ELEMENTS // tile))
    return [(lo, min(lo + run, G)) for lo in range(0, G, run)]


def _query_runs(T: int, bq: int, causal: bool, n_runs: int) -> list:
    """``n_runs`` ``(first, last)`` ranges of query blocks covering ``0 … ceil(T/bq)``, most work
    first (with the causal mask, block ``i`` has ``i + 1`` key blocks to visit)."""
    n_blocks = -(-T // bq)
    n_runs = max(1, min(n_runs, n_blocks))
    bounds = [n_blocks * i // n_runs for i in range(n_runs + 1)]
    runs = [(bounds[i], bounds[i + 1]) for i in range(n_runs)]
    return runs[::-1] if causal else runs


def _overflow_allowed(like):
    """NumPy's floating-point warnings off for overflow and ``inf − inf`` (a context manager;
    per thread): the fixed-reference pass overflows when a key scores far above key 0, and that
    pass is then discarded and done again with the running maximum, so a warning would report
    a result nobody gets."""
    if is_numpy_array(like):
        import numpy as np

        return np.errstate(over="ignore", invalid="ignore")
    return contextlib.nullcontext()


def _rowmax_into(s, out) -> None:
    """``out = max_β s[..., β]`` (kept as a size-1 axis)."""
    if is_numpy_array(s):
        import numpy as np

        np.fmax.reduce(s, axis=-1, keepdims=True, out=out)   # 1.5x np.max here (no NaN checks)
    else:
        import torch

        torch.amax(s, dim=-1, keepdim=True, out=out)


def tiled_attention_forward(qkv, n_heads: int, d_qk: int, d_head: int, *, causal: bool = True,
                            block_q: int | None = None, block_k: int | None = None):
    """Multi-head attention of the fused ``qkv`` by tiles (module docstring; EQUATIONS.md).

    Args:
        qkv: ``(B, T, n_heads·(2·d_qk + d_head))`` float array (NumPy or torch), as
            :func:`pedestrian.layers.attention.multi_head_attention_forward` takes it.
        n_heads, d_qk, d_head: the head layout.
        causal: mask future keys (their blocks are skipped).
        block_q, block_k: tile size (default :data:`BLOCKS` of the backend).

    Returns:
        ``(a3, cache)``: ``a3`` ``(B, T, n_heads·d_head)``, the heads' ``P v`` side by side. The
        cache holds, per head (``B·n_heads`` of them), ``q_aug = [q/√d_qk | −ℓ]`` (both times
        ``unit = log₂e`` where the tiles take powers of 2, the module docstring; else 1),
        ``k_aug = [k | 1]``, ``v_aug = [v | 1]`` ``(B·n_heads, T, · + 1)`` and the heads' outputs
        ``(B·n_heads, T, d_head)``: ``O(T)`` memory. (An extra column turns a subtraction into
        part of a product: ``q_aug k_augᵀ = S − ℓ``, ``P v_aug = [P v | rowsum P]``.)

    Raises:
        ValueError: a block size below 1.
    """
    B, T, _ = qkv.shape
    G, hq = B * n_heads, n_heads * d_qk
    bq, bk = BLOCKS[_backend(qkv)]
    bq, bk = bq if block_q is None else block_q, bk if block_k is None else block_k
    if bq < 1 or bk < 1:
        raise ValueError(f"block sizes must be >= 1, got block_q={bq}, block_k={bk}")
    unit, exp, log = blas.softmax_exp(qkv)                                   # scores in units of ln 2, or 1
    loops = attention_loops.USE and is_numpy_array(qkv) and unit == 1.0      # numba: mask and exp fused
    q_aug = empty_array((G, T, d_qk + 1), qkv)                               # [q/√d_qk | −ℓ] (× unit)
    k_aug = empty_array((G, T, d_qk + 1), qkv)                               # [k | 1]
    v_aug = empty_array((G, T, d_head + 1), qkv)                             # [v | 1]
    o = empty_array((G, T, d_head), qkv)                                     # each head's P v
    _split_heads_into(q_aug[..., :d_qk], qkv[..., :hq], B, n_heads)
    _split_heads_into(k_aug[..., :d_qk], qkv[..., hq:2 * hq], B, n_heads)
    _split_heads_into(v_aug[..., :d_head], qkv[..., 2 * hq:], B, n_heads)
    q_aug[..., d_qk:] = 0                                                    # (−ℓ, written per block)
    k_aug[..., d_qk:] = 1
    v_aug[..., d_head:] = 1
    lib = elementwise_lib(qkv)
    lib.multiply(q_aug, unit / math.sqrt(d_qk), out=q_aug)                   # the whole array: no
                                                                             # loop over a column

    def kernel(lo: int, hi: int, block: int) -> None:                       # heads lo:hi, query block
        g, i0, i1 = hi - lo, block * bq, min(block * bq + bq, T)
        r, end = i1 - i0, (i1 if causal else T)                              # keys seen: 0 … end-1
        qa = q_aug[lo:hi, i0:i1]                                             # [q/√d_qk | spare column]
        acc = scratch((g, r, d_head + 1), qkv, "tiled.acc")                  # [Σ_β e v_β | Σ_β e]
        m = scratch((g, r, 1), qkv, "tiled.m")                               # the rows' reference
        m_new = scratch((g, r, 1), qkv, "tiled.m_new")
        col = scratch((g, r, 1), qkv, "tiled.col")                          # a column, contiguous
        t = scratch((g, r, d_head + 1), qkv, "tiled.t")
        s_flat = scratch((g * r * bk,), qkv, "tiled.s")

        def scores(j0: int, j1: int, minus_m: bool, mask: bool = True):     # keys j0:j1, masked
            s = _carve(s_flat, g, r, j1 - j0)
            if minus_m:                                                      # [q | −m] [k | 1]ᵀ = S − m
                matmul_into(s, qa, k_aug[lo:hi, j0:j1].mT)
            else:                                                            # S = q kᵀ/√d_qk
                matmul_into(s, qa[..., :d_qk], k_aug[lo:hi, j0:j1, :d_qk].mT)
            if mask and causal and j1 - 1 > i0:                              # the tile crosses the diagonal
                lib.add(s, _tile_mask(r, j1 - j0, i0 - j0, s), out=s)
            return s

        def first_block() -> None:                                           # key 0 is always allowed
            j1 = min(bk, end)
            s = scores(0, j1, False)
            _rowmax_into(s, m)
            lib.subtract(s, m, out=s)
            exp(s, out=s)                                                    # e = exp(S − m)
            matmul_into(acc, s, v_aug[lo:hi, :j1])

        # the reference m = S_α0, each row's score of key 0 (always allowed): no running maximum
        matmul_into(m, qa[..., :d_qk], k_aug[lo:hi, :1, :d_qk].mT)           # (EQUATIONS.md, "a
        lib.multiply(m, -1.0, out=col)                                       # fixed reference")
        copy_into(qa[..., d_qk:], col)
        with _overflow_allowed(qkv):                                         # checked below and
            for j0 in range(0, end, bk):                                     # then done again
                j1 = min(j0 + bk, end)
                if loops:                                                    # e = exp(S − m), masked
                    attention_loops.exp_tile(scores(j0, j1, True, False), i0 - j0, causal)
                    s = _carve(s_flat, g, r, j1 - j0)
                else:
                    s = scores(j0, j1, True)
                    exp(s, out=s)
                if j0 == 0:
                    matmul_into(acc, s, v_aug[lo:hi, j0:j1])
                else:
                    matmul_into(t, s, v_aug[lo:hi, j0:j1])
                    lib.add(acc, t, out=acc)
        copy_into(col, acc[..., d_head:])                                    # l = Σ_β exp(S − m)
        if not float(col.max()) <= FIXED_REFERENCE_MAX_SUM:                  # a key far above key 0
            first_block()                                                    # (or a NaN): again, with
            for j0 in range(bk, end, bk):                                    # the running maximum
                j1 = min(j0 + bk, end)
                s = scores(j0, j1, False)
                _rowmax_into(s, m_new)
                lib.maximum(m_new, m, out=m_new)
                lib.subtract(s, m_new, out=s)
                exp(s, out=s)                                                # e = exp(S − m_new)
                lib.subtract(m, m_new, out=m)
                exp(m, out=m)                                                # exp(m_old − m_new) <= 1
                lib.multiply(acc, m, out=acc)                                # rescale the sums so far
                matmul_into(t, s, v_aug[lo:hi, j0:j1])
                lib.add(acc, t, out=acc)
                m, m_new = m_new, m                                          # the new max is the old one now
            copy_into(col, acc[..., d_head:])
        lib.divide(acc, col, out=acc)                                        # [P v | 1]
        copy_into(o[lo:hi, i0:i1], acc[..., :d_head])                        # out = P v
        log(col, out=col)
        lib.add(col, m, out=col)                                             # ℓ = m + log l
        lib.multiply(col, -1.0, out=col)
        copy_into(qa[..., d_qk:], col)

    threads = _threads(qkv)
    blocks = range(-(-T // bq))
    units = [(lo, hi, b) for b in (reversed(blocks) if causal else blocks)  # most work first
             for lo, hi in _head_runs(qkv, G, bq * bk, threads, len(blocks))]
    run_units(qkv, units, kernel, threads)
    out = empty_array((B, T, n_heads * d_head), qkv)
    _merge_heads_into(out, o, B, n_heads)
    return out, dict(tiled=True, q_aug=q_aug, k_aug=k_aug, v_aug=v_aug, o=o, d_qk=d_qk,
                     n_heads=n_heads, causal=causal, blocks=(bq, bk), unit=unit)


def tiled_attention_backward(delta, cache, *, keep_delta_causal: bool = False):
    """Backward of :func:`tiled_attention_forward` down to the fused ``qkv`` (EQUATIONS.md).

    Per tile: ``P = exp(S − ℓ)`` (recomputed), ``dv += Pᵀ Δ``, ``dP = Δ vᵀ``,
    ``Δcausal = P ∘ (dP − D)`` with ``D = rowsum(Δ ∘ out)`` (= ``rowsum(dP ∘ P)``),
    ``dq += Δcausal k / √d_qk``, ``dk += Δcausalᵀ q / √d_qk``. ``S − ℓ`` and ``dP − D`` come
    out of one product each (``[q | −ℓ] [k | 1]ᵀ``, ``[Δ | −D] [v | 1]ᵀ``).

    Args:
        delta: ``Δ3`` ``(B, T, n_heads·d_head)``.
        cache: from :func:`tiled_attention_forward`.
        keep_delta_causal: also return ``Δcausal`` ``(B, n_heads, T, T)`` (zeros on the skipped
            blocks above the diagonal; ``O(T²)`` memory, on request only).

    Returns:
        ``(delta_qkv, delta_causal)``: ``(B, T, n_heads·(2·d_qk + d_head))`` and ``Δcausal`` or ``None``.
    """
    q_aug, k_aug, v_aug, o = cache["q_aug"], cache["k_aug"], cache["v_aug"], cache["o"]
    G, T, d_head = o.shape
    d_qk, n_heads, causal = cache["d_qk"], cache["n_heads"], cache["causal"]
    bq, bk = cache["blocks"]
    B = G // n_heads
    hq = n_heads * d_qk
    d_aug = empty_array((G, T, d_head + 1), o)                                # [Δ | −D]
    d_heads = empty_array((G, T, d_head), o)                                 # Δ per head, contiguous
    _split_heads_into(d_heads, delta, B, n_heads)
    lib = elementwise_lib(o)
    # D = rowsum(dP ∘ P) = rowsum(Δ ∘ out) (EQUATIONS.md, "Tiled attention"): no T × T sum
    minus_d = rowdot(d_heads, o)
    lib.multiply(minus_d, -1.0, out=minus_d)
    copy_into(d_aug[..., :d_head], d_heads)
    copy_into(d_aug[..., d_head:], minus_d)
    runs = _query_runs(T, bq, causal, BACKWARD_RUNS)
    key_end = [min(last * bq, T) if causal else T for _, last in runs]       # keys each run reaches
    dq = empty_array((G, T, d_qk), o)
    dk_runs = empty_array((len(runs), G, T, d_qk), o)                        # each run's share of dk, dv
    dv_runs = empty_array((len(runs), G, T, d_head), o)
    kept = _zeros((B, n_heads, T, T), o) if keep_delta_causal else None
    kept3 = None if kept is None else kept.reshape(G, T, T)
    inv_scale = 1.0 / math.sqrt(d_qk)
    unit, exp, _ = blas.softmax_exp(o, cache["unit"])
    loops = attention_loops.USE and is_numpy_array(o) and unit == 1.0

    def kernel(lo: int, hi: int, n: int) -> None:                           # heads lo:hi, query run n
        g = hi - lo
        dk_h, dv_h = dk_runs[n, lo:hi], dv_runs[n, lo:hi]
        dk_h[:, :key_end[n]] = 0                                             # key blocks are summed into
        dv_h[:, :key_end[n]] = 0
        p_flat, dp_flat = scratch((g * bq * bk,), o, "tiled.s"), scratch((g * bq * bk,), o, "tiled.dp")
        t_v_flat, t_k_flat = scratch((g * bk * d_head,), o, "tiled.t_v"), scratch((g * bk * d_qk,), o, "tiled.t_k")
        t_q_flat = scratch((g * bq * d_qk,), o, "tiled.t_q")
        for i0 in range(runs[n][0] * bq, min(runs[n][1] * bq, T), bq):
            i1 = min(i0 + bq, T)
            r = i1 - i0
            qa, da, dqi = q_aug[lo:hi, i0:i1], d_aug[lo:hi, i0:i1], dq[lo:hi, i0:i1]
            for j0 in range(0, i1 if causal else T, bk):
                j1 = min(j0 + bk, i1 if causal else T)
                c = j1 - j0
                p = _carve(p_flat, g, r, c)
                matmul_into(p, qa, k_aug[lo:hi, j0:j1].mT)                   # S − ℓ
                if loops:                                                    # P = exp(S − ℓ), masked
                    attention_loops.exp_tile(p, i0 - j0, causal)
                else:
                    if causal and j1 - 1 > i0:
                        lib.add(p, _tile_mask(r, c, i0 - j0, p), out=p)
                    exp(p, out=p)
                t_v = _carve(t_v_flat, g, c, d_head)
                matmul_into(t_v, p.mT, da[..., :d_head])                     # dv += Pᵀ Δ
                lib.add(dv_h[:, j0:j1], t_v, out=dv_h[:, j0:j1])
                dp = _carve(dp_flat, g, r, c)
                matmul_into(dp, da, v_aug[lo:hi, j0:j1].mT)                  # dP − D
                lib.multiply(dp, p, out=dp)                                  # Δcausal = P ∘ (dP − D)
                if kept3 is not None:
                    kept3[lo:hi, i0:i1, j0:j1] = dp
                kj = k_aug[lo:hi, j0:j1, :d_qk]
                if j0 == 0:
                    matmul_into(dqi, dp, kj)                                 # dq = Δcausal k (÷ √d_qk below)
                else:
                    t_q = _carve(t_q_flat, g, r, d_qk)
                    matmul_into(t_q, dp, kj)
                    lib.add(dqi, t_q, out=dqi)
                t_k = _carve(t_k_flat, g, c, d_qk)
                matmul_into(t_k, dp.mT, qa[..., :d_qk])                      # dk += Δcausalᵀ q/√d_qk (× unit)
                lib.add(dk_h[:, j0:j1], t_k, out=dk_h[:, j0:j1])
            lib.multiply(dqi, inv_scale, out=dqi)

    threads = _threads(o)
    heads = _head_runs(o, G, bq * bk, threads, len(runs))
    run_units(o, [(lo, hi, n) for n in range(len(runs)) for lo, hi in heads], kernel, threads)
    delta_qkv = empty_array((B, T, 2 * hq + n_heads * d_head), o)
    widest = max(range(len(runs)), key=key_end.__getitem__)                 # a run that reaches every key
    for parts, lo_col, width in ((dk_runs, hq, d_qk), (dv_runs, 2 * hq, d_head)):
        total = parts[widest]
        for n in range(len(runs)):                                           # the others, in a fixed order
            if n != widest:
                lib.add(total[:, :key_end[n]], parts[n][:, :key_end[n]], out=total[:, :key_end[n]])
        if unit != 1.0 and parts is dk_runs:                                 # q carried log₂e: take it out
            lib.multiply(total, 1.0 / unit, out=total)
        _merge_heads_into(delta_qkv[..., lo_col:lo_col + n_heads * width], total, B, n_heads)
    _merge_heads_into(delta_qkv[..., :hq], dq, B, n_heads)
    return delta_qkv, kept


def tiled_attention_weights(cache):
    """``P`` ``(B, n_heads, T, T)`` of a :func:`tiled_attention_forward` cache, recomputed from
    ``q``, ``k`` and the log-sum-exp ``ℓ``: ``P = exp(q kᵀ/√d_qk − ℓ)``, ``0`` above the diagonal
    when causal (``O(T²)`` memory, on request only)."""
    q_aug, k_aug = cache["q_aug"], cache["k_aug"]
    G, T, _ = q_aug.shape
    lib = elementwise_lib(q_aug)
    p = empty_array((G, T, T), q_aug)
    matmul_into(p, q_aug, k_aug.mT)                                          # S − ℓ (G, T, T)
    if cache["causal"]:
        lib.add(p, _tile_mask(T, T, 0, p), out=p)
    _, exp, _ = blas.softmax_exp(p, cache["unit"])
    exp(p, out=p)                                                            # P
    return p.reshape(G // cache["n_heads"], cache["n_heads"], T, T)

"""The embedding's backward on the GPU, deterministic (reference:
:func:`pedestrian.layers.embedding.embedding_backward`; EQUATIONS.md "Embedding").

``dW_tok = ohe(a0)ᵀ Δ1``: each table row gets the sum of the rows of ``Δ1`` whose token it is.
A scatter-add with atomics would add them in whatever order the threads arrive (other bits on
each run, in float32); here the ids are sorted first (a stable sort: equal ids keep their token
order) and one program per run of equal ids sums that run's rows in token order and writes its
table row: the same bits every run, no atomics. The rows of tokens not in the batch are 0 (or,
with ``accumulate_tok``, keep what they hold). The position table's gradient is the same with
the positions as ids (default positions: ``Σ_b Δ1[b, t]``, a plain reduction over the batch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layers.checks import check_ids
from ..layers.embedding import split_cache

#: feature columns one program sums
COLUMNS = 256


@triton.jit
def _runs_kernel(IDS, ORDER, DELTA, OUT, SCALE, n, d, ACCUMULATE: tl.constexpr, SCALED: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Program ``(i, c)``: if sorted position ``i`` starts a run of one id, ``OUT[id, c-block] (+)= Σ``
    of the run's rows of ``DELTA`` (each times ``SCALE[0]`` when ``SCALED``), in token order."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < d
    tok = tl.load(IDS + i)
    prev = tl.load(IDS + i - 1, mask=i > 0, other=-1)
    if (i == 0) | (tok != prev):
        acc = tl.zeros([BLOCK], dtype=DELTA.dtype.element_ty)
        j = i
        t = tok
        while t == tok:
            row = tl.load(ORDER + j)
            if SCALED:
                acc += tl.load(DELTA + row * d + cols, mask=in_row, other=0.0) * tl.load(SCALE)
            else:
                acc += tl.load(DELTA + row * d + cols, mask=in_row, other=0.0)
            j += 1
            t = tl.load(IDS + j, mask=j < n, other=-1)
        if ACCUMULATE:
            acc = tl.load(OUT + tok * d + cols, mask=in_row, other=0.0) + acc
        tl.store(OUT + tok * d + cols, acc, mask=in_row)


def _sum_rows_by_id(ids, rows, out, accumulate: bool, scale=None) -> None:
    """``out[id] (+)= Σ rows[k]`` (``Σ s · rows[k]`` with ``scale``) over the ``k`` holding ``id``, in ``k``
    order, by runs of sorted ids."""
    n, d = rows.shape
    if not accumulate:
        out.zero_()
    if n == 0:
        return
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    block = min(COLUMNS, max(16, triton.next_power_of_2(d)))
    target = out if out.is_contiguous() else torch.empty_like(out).copy_(out)
    s = rows if scale is None else torch.as_tensor(scale, dtype=rows.dtype, device=rows.device).reshape(1)
    _runs_kernel[(n, triton.cdiv(d, block))](sorted_ids, order, rows, target, s, n, d, ACCUMULATE=accumulate,
                                             SCALED=scale is not None, BLOCK=block)
    if target is not out:
        out.copy_(target)


def embedding_backward(delta, cache, *, dtok=None, dpos=None, accumulate_tok: bool = False) -> None:
    """``dW_tok = ohe(a0)ᵀ (s Δ1)`` (repeated ids accumulate; ``s`` the forward's scale, else 1), ``dW_pos[p] = Σ Δ1`` over the tokens at
    position ``p``; written into ``dtok``, ``dpos`` (``accumulate_tok``: added into ``dtok``).

    GPU :func:`pedestrian.layers.embedding.embedding_backward` (same arguments and contract; the sums
    in token order, the same bits every run).

    Raises:
        ValueError: a token id or position outside the gradient's rows (as the reference).
    """
    tokens, positions, scale = split_cache(cache)
    B, T, d = delta.shape
    rows = delta.contiguous().reshape(B * T, d)
    if dtok is not None:
        check_ids(tokens, dtok.shape[0], "token id")
        _sum_rows_by_id(tokens, rows, dtok, accumulate_tok, scale)
    if dpos is not None:
        if positions is None:
            dpos.zero_()
            dpos[:T] = delta.sum(dim=0)                                       # Σ_b Δ1[b, t]
            return
        pos = torch.broadcast_to(positions, (B, T))
        check_ids(pos, dpos.shape[0], "position")
        _sum_rows_by_id(pos, rows, dpos, False)

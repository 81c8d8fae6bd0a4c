"""Fast kernels for the embedding (reference: :mod:`pedestrian.layers.embedding`, section 2).

NumPy arrays: the forward gathers both tables' rows and adds them in one pass; the backward zeroes
both tables' gradients and adds each row of ``Δ1`` into them in one serial pass (in token order:
the same bits every run).
"""

from __future__ import annotations

import numpy as np

from ..layers import embedding as reference
from ..layers.checks import check_float, check_ids
from ..layers.embedding import split_cache
from .jit import kernel


@kernel
def _forward(tokens, positions, tok_weight, pos_weight, scale, out):
    """``a1[n] = s · W_tok[token n] + W_pos[position n]`` (``s`` in the tables' dtype; 1: exact)."""
    for n in range(tokens.shape[0]):
        t, p = tokens[n], positions[n]
        for j in range(out.shape[1]):
            out[n, j] = tok_weight[t, j] * scale + pos_weight[p, j]


@kernel
def _scatter_add(index, rows, target):
    """``target[index[n]] += rows[n]`` for every ``n`` in order (repeats accumulate)."""
    for n in range(index.shape[0]):
        i = index[n]
        for j in range(rows.shape[1]):
            target[i, j] += rows[n, j]


@kernel
def _scatter_add_scaled(index, rows, scale, target):
    """``target[index[n]] += s · rows[n]`` for every ``n`` in order (each row scaled, then added)."""
    for n in range(index.shape[0]):
        i = index[n]
        for j in range(rows.shape[1]):
            target[i, j] += rows[n, j] * scale


def _ids(ids, n: int, what: str):
    """``ids`` as a flat int64 array, each in ``[0, n)`` (numba does not check indices).

    Raises:
        ValueError: an id outside ``[0, n)`` (:func:`pedestrian.checks.check_ids`).
    """
    ids = np.asarray(ids)
    check_ids(ids, n, what)
    return np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)


def _positions(positions, B: int, T: int, n: int):
    pos = np.arange(T) if positions is None else np.asarray(positions)
    if positions is not None or T > n:                     # (0 … T-1 fit a table of T rows)
        check_ids(pos, n, "position")
    return np.ascontiguousarray(np.broadcast_to(pos, (B, T)), dtype=np.int64).reshape(-1)


def embedding_forward(tokens, tok_weight, pos_weight, positions=None, *, scale=None):
    """``a1 = s · W_tok[a0] + W_pos[positions]`` (EQUATIONS.md, "Embedding"; ``s``: Gemma's ``√d``).

    Fast :func:`pedestrian.layers.embedding.embedding_forward` (same arguments and results)."""
    check_float(tok_weight, "the token table")
    if pos_weight is None:
        return reference.embedding_forward(tokens, tok_weight, pos_weight, positions, scale=scale)
    B, T = tokens.shape
    d = tok_weight.shape[1]
    out = np.empty((B * T, d), tok_weight.dtype)
    s = tok_weight.dtype.type(1.0 if scale is None else scale)              # rounded to the table's dtype
    _forward(_ids(tokens, tok_weight.shape[0], "token id"), _positions(positions, B, T, pos_weight.shape[0]),
             tok_weight, pos_weight, s, out)
    return out.reshape(B, T, d), (tokens, positions, None if scale is None else np.asarray(s))


def embedding_backward(delta, cache, *, dtok=None, dpos=None, accumulate_tok: bool = False) -> None:
    """``dW_tok[t] = Σ_{a0 = t} Δ1``, ``dW_pos[p] = Σ_batch Δ1[:, p]`` (EQUATIONS.md, "Embedding").

    Fast :func:`pedestrian.layers.embedding.embedding_backward` (writes ``dtok``, ``dpos``)."""
    tokens, positions, scale = split_cache(cache)
    B, T, d = delta.shape
    rows = np.ascontiguousarray(delta).reshape(B * T, d)
    if dtok is not None:
        if not accumulate_tok:
            dtok[...] = 0
        ids = _ids(tokens, dtok.shape[0], "token id")
        if scale is None:
            _scatter_add(ids, rows, dtok)
        else:
            _scatter_add_scaled(ids, rows, rows.dtype.type(scale), dtok)
    if dpos is not None:
        dpos[...] = 0
        _scatter_add(_positions(positions, B, T, dpos.shape[0]), rows, dpos)

"""Fast kernels for the embedding (reference: :mod:`pedestrian.layers.embedding`, section 2).

NumPy arrays: the forward gathers both tables' rows and adds them in one pass; the backward zeroes
both tables' gradients and adds each row of ``Δ1`` into them in one serial pass (in token order:
the same bits every run).
"""

from __future__ import annotations

import numpy as np

from ..layers import embedding as reference
from ..layers.checks import check_float, check_ids
from .jit import kernel


@kernel
def _forward(tokens, positions, tok_weight, pos_weight, out):
    """``a1[n] = W_tok[token n] + W_pos[position n]``."""
    for n in range(tokens.shape[0]):
        t, p = tokens[n], positions[n]
        for j in range(out.shape[1]):
            out[n, j] = tok_weight[t, j] + pos_weight[p, j]


@kernel
def _scatter_add(index, rows, target):
    """``target[index[n]] += rows[n]`` for every ``n`` in order (repeats accumulate)."""
    for n in range(index.shape[0]):
        i = index[n]
        for j in range(rows.shape[1]):
            target[i, j] += rows[n, j]


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


def embedding_forward(tokens, tok_weight, pos_weight, positions=None):
    """``a1 = W_tok[a0] + W_pos[positions]`` (EQUATIONS.md, "Embedding").

    Fast :func:`pedestrian.layers.embedding.embedding_forward` (same arguments and results)."""
    check_float(tok_weight, "the token table")
    if pos_weight is None:
        return reference.embedding_forward(tokens, tok_weight, pos_weight, positions)
    B, T = tokens.shape
    d = tok_weight.shape[1]
    out = np.empty((B * T, d), tok_weight.dtype)
    _forward(_ids(tokens, tok_weight.shape[0], "token id"), _positions(positions, B, T, pos_weight.shape[0]),
             tok_weight, pos_weight, out)
    return out.reshape(B, T, d), (tokens, positions)


def embedding_backward(delta, cache, *, dtok=None, dpos=None, accumulate_tok: bool = False) -> None:
    """``dW_tok[t] = Σ_{a0 = t} Δ1``, ``dW_pos[p] = Σ_batch Δ1[:, p]`` (EQUATIONS.md, "Embedding").

    Fast :func:`pedestrian.layers.embedding.embedding_backward` (writes ``dtok``, ``dpos``)."""
    tokens, positions = cache
    B, T, d = delta.shape
    rows = np.ascontiguousarray(delta).reshape(B * T, d)
    if dtok is not None:
        if not accumulate_tok:
            dtok[...] = 0
        _scatter_add(_ids(tokens, dtok.shape[0], "token id"), rows, dtok)
    if dpos is not None:
        dpos[...] = 0
        _scatter_add(_positions(positions, B, T, dpos.shape[0]), rows, dpos)

"""Token + learned position embedding (paper section 2; EQUATIONS.md "Embedding").

Reference implementation: the paper's math only, written against the array API standard.
"""

from __future__ import annotations

from ..backend import array_namespace, scatter_add_rows
from .checks import check_float, check_ids


def embedding_forward(tokens, tok_weight, pos_weight, positions=None, *, scale=None):
    """``a1 = W_tok[a0] + W_pos[positions]`` (the paper's ``ohe(a0) @ W_tok`` done as a gather), or
    with ``scale`` ``s``, ``a1 = s · W_tok[a0] (+ W_pos[positions])`` (Gemma's ``√d``).

    Args:
        tokens: ``(B, T)`` integer ids ``a0`` in ``[0, V)``.
        tok_weight: ``(V, d)`` token table ``W_tok``.
        pos_weight: ``(context_length, d)`` position table ``W_pos``, or ``None`` (no learned
            positions).
        positions: position index of every token: ``None`` for ``0 … T-1``, or an integer array
            ``(T,)`` or ``(B, T)`` (a KV-cache step continues at the cached length; a left-padded
            row starts at its first real token).
        scale: ``None`` or a number ``s`` the token rows are multiplied by, rounded to the table's
            dtype first (Gemma's ``normalizer``: ``√3072 = 55.43`` is 55.5 in bfloat16).

    Returns:
        ``(a1, cache)``: ``a1`` ``(B, T, d)`` in the tables' dtype; ``cache = (tokens, positions, s)``
        (``s`` the rounded scale as a 0-d array, or ``None``).

    Raises:
        ValueError: a token id outside ``[0, V)`` or a position outside the position table
            (named, with its place in the batch).
        TypeError: ids that are not integers, tables that are not real floating point.
    """
    xp = array_namespace(tok_weight)
    B, T = tokens.shape
    check_float(tok_weight, "the token table")
    check_ids(tokens, tok_weight.shape[0], "token id")
    d = tok_weight.shape[1]
    a1 = xp.reshape(xp.take(tok_weight, xp.reshape(tokens, (-1,)), axis=0), (B, T, d))  # (B, T, d)
    if scale is not None:
        scale = xp.asarray(scale, dtype=tok_weight.dtype, device=tok_weight.device)      # 0-d s, rounded
        a1 = a1 * scale                                                                   # (B, T, d)
    if pos_weight is not None:
        pos = xp.arange(T, device=tokens.device) if positions is None else positions      # (T,) or (B, T)
        check_ids(pos, pos_weight.shape[0], "position")
        a1 = a1 + xp.reshape(xp.take(pos_weight, xp.reshape(pos, (-1,)), axis=0), (*pos.shape, d))
    return a1, (tokens, positions, scale)


def split_cache(cache) -> tuple:
    """``(tokens, positions, scale)`` of an :func:`embedding_forward` cache (a pair: no scale)."""
    return (*cache, None) if len(cache) == 2 else tuple(cache)


def embedding_backward(delta, cache, *, dtok=None, dpos=None, accumulate_tok: bool = False) -> None:
    """Gradients of both tables, *written* into ``dtok`` and ``dpos`` (every layer backward writes;
    a tied token table is the one exception, ``accumulate_tok``).

    ``dW_tok = ohe(a0)ᵀ Δ1``: row ``t`` gets the sum of the rows of ``Δ1`` at every position
    holding token ``t`` -- repeated ids accumulate (a scatter-add into zeros; a plain fancy-index
    ``+=`` would drop repeats), rows of tokens not in the batch are 0. With a ``scale`` ``s`` the
    rows summed are ``s · Δ1`` (each row scaled, then summed: autograd's order).
    ``dW_pos[p] = Σ Δ1`` over every token at position ``p``.

    Args:
        delta: ``(B, T, d)`` error signal ``Δ1``.
        cache: from :func:`embedding_forward`.
        dtok: ``(V, d)`` array the token-table gradient is written to, or ``None`` (frozen).
        accumulate_tok: add the lookup's part into ``dtok`` instead of writing it: with tied
            weights ``dtok`` already holds the logits' part (``dW_tok = (Δ12ᵀ a11) + ohe(a0)ᵀ Δ1``),
            and no second ``(V, d)`` buffer is needed.
        dpos: ``(context_length, d)`` array the position-table gradient is written to, or ``None``.

    Raises:
        ValueError: a token id or position outside the gradient's rows (as the forward).
    """
    xp = array_namespace(delta)
    tokens, positions, scale = split_cache(cache)
    B, T, d = delta.shape
    delta_rows = xp.reshape(delta, (B * T, d))                                    # (B·T, d)
    if dtok is not None:
        check_ids(tokens, dtok.shape[0], "token id")
        if not accumulate_tok:
            dtok[...] = 0
        scatter_add_rows(dtok, xp.reshape(tokens, (-1,)), delta_rows if scale is None else delta_rows * scale)
    if dpos is not None:
        dpos[...] = 0
        pos = xp.arange(T, device=tokens.device) if positions is None else positions
        check_ids(pos, dpos.shape[0], "position")
        scatter_add_rows(dpos, xp.reshape(xp.broadcast_to(pos, (B, T)), (-1,)), delta_rows)

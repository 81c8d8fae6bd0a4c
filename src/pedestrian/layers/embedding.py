"""Token + learned position embedding (paper section 2; EQUATIONS.md "Embedding")."""

from __future__ import annotations

from ..backend import array_namespace, empty_array, scatter_add_rows, take_rows


def check_tokens(tokens, vocab_size: int, context_length: int, what: str = "token ids") -> None:
    """Validate a ``(B, T)`` integer token batch.

    Raises:
        TypeError: not an integer array.
        ValueError: not 2-D, empty, ``T > context_length``, or an id outside ``[0, vocab_size)``.
    """
    xp = array_namespace(tokens)
    if not xp.isdtype(tokens.dtype, "integral"):
        raise TypeError(
            f"{what} must be an integer array, got dtype {tokens.dtype}; "
            "encode text with the tokenizer first (e.g. np.asarray(ids, dtype=np.int64))"
        )
    if tokens.ndim != 2:
        raise ValueError(f"{what} must have shape (B, T), got shape {tuple(tokens.shape)}; "
                         "add a batch axis with tokens[None, :]")
    B, T = tokens.shape
    if B == 0 or T == 0:
        raise ValueError(f"{what} must not be empty, got shape {(B, T)}")
    if T > context_length:
        raise ValueError(
            f"sequence length T={T} exceeds the model's context_length={context_length}; "
            f"feed at most the last {context_length} tokens"
        )
    lo, hi = int(xp.min(tokens)), int(xp.max(tokens))
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"{what} contain {bad}, outside [0, vocab_size={vocab_size}); "
            "the tokenizer and the model config do not match"
        )


def embedding_forward(tokens, tok_weight, pos_weight):
    """``a1 = W_tok[a0] + W_pos[0:T]`` (the paper's ``ohe(a0) @ W_tok`` done as a gather).

    Args:
        tokens: ``(B, T)`` integer ids ``a0``, already validated (see :func:`check_tokens`).
        tok_weight: ``(V, d)`` token table.
        pos_weight: ``(context_length, d)`` position table; rows ``0..T-1`` are used.

    Returns:
        ``(a1, cache)``: ``a1`` of shape ``(B, T, d)``; ``cache = tokens``.
    """
    B, T = tokens.shape
    d = tok_weight.shape[1]
    a1 = empty_array((B, T, d), tok_weight)
    take_rows(tok_weight, tokens.reshape(-1), out=a1.reshape(B * T, d))
    a1 += pos_weight[:T, :]
    return a1, tokens


def embedding_backward(delta, tokens, tok_grad, pos_grad, *, need_tok=True, need_pos=True,
                       accumulate_tok=False):
    """Gradients of both tables, written into preallocated arrays.

    ``dW_tok = ohe(a0)ᵀ Δ1``: row ``t`` is the sum of the rows of ``Δ1`` at every position
    holding token ``t`` -- repeated ids accumulate (an unbuffered scatter-add).
    ``dW_pos[p] = Σ_batch Δ1[:, p, :]`` for ``p < T``; rows ``p >= T`` get zero.

    Args:
        delta: ``(B, T, d)`` error signal ``Δ1``.
        tokens: ``(B, T)`` the forward ids (the cache).
        tok_grad: ``(V, d)`` array to fill (overwritten unless ``accumulate_tok``, used when
            the logits layer is tied and has already written its part).
        pos_grad: ``(context_length, d)`` array to fill.
    """
    xp = array_namespace(delta)
    B, T, d = delta.shape
    if need_tok:
        if not accumulate_tok:
            tok_grad[...] = 0
        scatter_add_rows(tok_grad, xp.reshape(tokens, (-1,)), xp.reshape(delta, (-1, d)))
    if need_pos:
        pos_grad[...] = 0
        pos_grad[:T, :] = xp.sum(delta, axis=0)

"""Fast kernels for the embedding (reference: :mod:`pedestrian.layers.embedding`, section 2):
the gather goes straight into a pooled array; the position table's gradient for ``0 … T-1`` is a
sum over the batch instead of a scatter."""

from __future__ import annotations

from ..backend import array_namespace, scatter_add_rows
from .blas import elementwise_lib, take_rows
from .workspace import empty_array


#: at most this many tokens (generation) are gathered with plain indexing, not into a pooled array
SMALL_TOKENS = 16


def embedding_forward(tokens, tok_weight, pos_weight, positions=None):
    """Fast :func:`pedestrian.layers.embedding.embedding_forward`."""
    B, T = tokens.shape
    if B * T <= SMALL_TOKENS and pos_weight is not None and positions is not None:
        return tok_weight[tokens] + pos_weight[positions], (tokens, positions)     # one generated token
    d = tok_weight.shape[1]
    a1 = empty_array((B, T, d), tok_weight)
    take_rows(tok_weight, tokens.reshape(-1), out=a1.reshape(B * T, d))
    if pos_weight is not None:
        a1 += pos_weight[:T, :] if positions is None else pos_weight[positions]
    return a1, (tokens, positions)


def embedding_backward(delta, cache, *, dtok=None, dpos=None) -> None:
    """Fast :func:`pedestrian.layers.embedding.embedding_backward` (adds into ``dtok``, ``dpos``)."""
    tokens, positions = cache
    B, T, d = delta.shape
    rows = delta.reshape(B * T, d)
    if dtok is not None:
        scatter_add_rows(dtok, tokens.reshape(-1), rows)
    if dpos is not None:
        if positions is None:
            lib = elementwise_lib(delta)
            lib.add(dpos[:T], lib.sum(delta, axis=0), out=dpos[:T])
        else:
            index = array_namespace(positions).broadcast_to(positions, (B, T))
            scatter_add_rows(dpos, index.reshape(-1), rows)

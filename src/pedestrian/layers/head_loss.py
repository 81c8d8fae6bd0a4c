"""The output head fused with its loss (EQUATIONS.md, "The head fused with its loss"; paper
section 1 and the conclusion's ``FC_logits``).

The logits ``a12 = a11 W + b`` feed one number, the loss, and their gradient ``Δ12`` feeds only
``Δ11`` and ``dW``. At today's vocabularies they are the largest arrays of a step (SmolLM2-135M,
V = 49,152: 403 MB of float32 logits per 2,048 tokens, the same again for ``Δ12``), so this layer
forms them a chunk of rows at a time and keeps none: for the rows ``c`` of a chunk::

    z_c   = h_c W + b                  p_c = softmax(z_c)
    L    += Σ_{t∈c, counted} (logsumexp(z_t) − z_{t, y_t}) / C
    Δ12_c = (p_c − onehot(y_c)) / C    (ignored rows: 0)
    Δ11_c = Δ12_c Wᵀ      dW += h_cᵀ Δ12_c      db += Σ_rows Δ12_c

With a soft-cap ``c`` (Gemma 2's final logits, :mod:`.softcap`) the logits are
``z_c = c · tanh((h_c W + b) / c)`` and the signal of the product's output is
``Δ12_c ∘ (1 − (z_c / c)²)``, which ``Δ11_c``, ``dW``, ``db`` take in place of ``Δ12_c``.

``C`` is the number of counted targets (``n_total`` for one slice of a larger batch). The
gradients are made in the forward's one pass over the chunks (a chunk's logits are gone after
it); :func:`head_loss_backward` hands them over, writing the parameters' into the arrays it is
given, as every layer backward does. Reference implementation, array API.
"""

from __future__ import annotations

from typing import NamedTuple

from ..backend import array_namespace
from .checks import check_float, check_ids
from .loss import IGNORE_INDEX, count_divisor
from .softcap import check_softcap

__all__ = ["HEAD_CHUNK_BYTES", "HeadLossCache", "head_chunk_rows", "head_loss_backward", "head_loss_forward"]

#: the memory budget of one chunk's logits (and their ``Δ12``, written over them by the fast
#: kernel): rows per chunk = this over ``V · itemsize``, at least 1. 32 MiB: 170 rows of
#: SmolLM2-135M's float32 logits (docs/kernels.md, "The head fused with its loss": the budget
#: measured against time)
HEAD_CHUNK_BYTES = 32 << 20


class HeadLossCache(NamedTuple):
    """What :func:`head_loss_forward` made for the backward: ``Δ11`` ``(B, T, d)`` (``None``
    without ``grad``), ``dW`` ``(d, V)`` and ``db`` ``(V,)`` (``None`` where not asked for), the
    count ``C`` and the logits' shape ``(B, T, V)`` (never made)."""

    dh: object
    dweight: object
    dbias: object
    n_counted: object
    logits_shape: tuple


def head_chunk_rows(vocab_size: int, itemsize: int, budget: int | None = None) -> int:
    """Rows per chunk: ``budget`` (default :data:`HEAD_CHUNK_BYTES`) over one row of logits."""
    budget = HEAD_CHUNK_BYTES if budget is None else budget
    return max(1, budget // max(1, vocab_size * itemsize))


def head_loss_forward(h, weight, bias, targets, ignore_index: int = IGNORE_INDEX, *, n_total=None,
                      grad: bool = True, grad_weight: bool = True, chunk_rows: int | None = None,
                      softcap: float | None = None):
    """Mean cross-entropy of the logits ``h W + b`` (or ``c · tanh((h W + b) / c)`` with ``softcap``)
    over the counted targets, chunk by chunk, and (``grad``) its gradients, never holding more
    than ``chunk_rows`` rows of logits.

    Args:
        h: ``(B, T, d)`` float array ``a11`` (the final norm's output).
        weight: ``(d, V)`` ``W_logits`` (tied: ``W_tokᵀ``, a view); ``bias``: ``(V,)`` or ``None``.
        targets: ``(B, T)`` ids in ``[0, V)`` or ``ignore_index`` (not counted).
        n_total: divide by this many counted targets (an int or a 0-d integer array on the
            device) instead of the number counted here, as :func:`~.loss.cross_entropy_forward`.
        grad: also make ``Δ11`` (and with ``grad_weight`` ``dW``, ``db``); ``False``: the loss
            only (an evaluation).
        chunk_rows: rows per chunk (default :func:`head_chunk_rows`, from :data:`HEAD_CHUNK_BYTES`).
        softcap: ``c > 0``, the logits' soft-cap (``GPTConfig.logit_softcap``), or ``None``.

    Returns:
        ``(loss, cache)``: ``loss`` 0-d in ``h``'s dtype, nats per counted target (``0`` when none
        counts); ``cache`` a :class:`HeadLossCache`.

    Raises:
        ValueError: a target outside ``[0, V)`` that is not ``ignore_index``; ``chunk_rows < 1``;
            a ``softcap`` that is not a finite number ``> 0``.
        TypeError: ``h`` or ``weight`` not real floating point, targets not integers.
    """
    xp = array_namespace(h)
    if softcap is not None:
        check_softcap(softcap)
    d, V = weight.shape
    check_float(h, "the head's input")
    check_float(weight, "the head's weight")
    check_ids(targets, V, "target", ignore_index=ignore_index)
    rows = head_chunk_rows(V, h.dtype.itemsize) if chunk_rows is None else int(chunk_rows)
    if rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    h_rows = xp.reshape(h, (-1, d))                                          # (N, d)
    t = xp.reshape(targets, (-1,))                                           # (N,)
    N = h_rows.shape[0]
    counted = t != ignore_index                                              # (N,) bool
    n_counted = xp.sum(xp.astype(counted, xp.int64)) if n_total is None else n_total  # int or 0-d
    C = count_divisor(xp, n_counted, h_rows)                                 # 0-d max(n, 1), unread
    vocab = xp.arange(V, device=t.device)                                    # (V,)
    loss, dh, dW, db = xp.zeros((), dtype=h.dtype, device=h.device), [], None, None
    for lo in range(0, N, rows):
        h_c, t_c, k_c = h_rows[lo:lo + rows], t[lo:lo + rows], counted[lo:lo + rows]   # (n, d), (n,), (n,)
        z = h_c @ weight if bias is None else h_c @ weight + bias            # (n, V) logits of the chunk
        if softcap is not None:
            tanh_c = xp.tanh(z / softcap)                                    # (n, V)
            z = softcap * tanh_c                                             # (n, V) capped logits
        z_max = xp.max(z, axis=-1, keepdims=True)                            # (n, 1)
        e = xp.exp(z - z_max)                                                # (n, V), max entry 1
        sum_e = xp.sum(e, axis=-1, keepdims=True)                            # (n, 1)
        y_gt = xp.astype((vocab[None, :] == xp.where(k_c, t_c, xp.zeros_like(t_c))[:, None])
                         & k_c[:, None], z.dtype)                            # (n, V) one-hot, 0 rows ignored
        log_sum_exp = xp.log(sum_e) + z_max                                  # (n, 1)
        nll = xp.where(y_gt > 0, log_sum_exp - z, xp.zeros_like(z))          # (n, V): −log p at the target
        loss = loss + xp.sum(nll) / C                                        # 0-d
        if not grad:
            continue
        delta = (e / sum_e * xp.astype(k_c, z.dtype)[:, None] - y_gt) / C    # (n, V) Δ12_c
        if softcap is not None:
            delta = delta * (1.0 - tanh_c * tanh_c)                          # (n, V) through the cap
        dh.append(delta @ xp.matrix_transpose(weight))                       # (n, d) Δ11_c = Δ12_c Wᵀ
        if grad_weight:
            dW_c = xp.matrix_transpose(h_c) @ delta                          # (d, V) h_cᵀ Δ12_c
            dW = dW_c if dW is None else dW + dW_c                           # (d, V)
            if bias is not None:
                db_c = xp.sum(delta, axis=0)                                 # (V,)
                db = db_c if db is None else db + db_c                       # (V,)
    if grad and N == 0:                                                      # (no rows: zero gradients)
        dW = xp.zeros_like(weight) if grad_weight else None
        db = xp.zeros_like(bias) if grad_weight and bias is not None else None
    d11 = xp.reshape(xp.concat(dh, axis=0), h.shape) if grad and dh else (xp.zeros_like(h) if grad else None)
    return loss, HeadLossCache(d11, dW, db, C, (*h.shape[:-1], V))


def head_loss_backward(cache: HeadLossCache, *, dweight=None, dbias=None):
    """``Δ11`` of the fused head; writes ``dW`` into ``dweight`` and ``db`` into ``dbias``
    (``None``: no gradient for that parameter), as made by :func:`head_loss_forward`.

    Raises:
        ValueError: the forward made no gradients (``grad=False``), or not the weight's that
            ``dweight`` / ``dbias`` ask for.
    """
    if cache.dh is None:
        raise ValueError("the fused head's forward ran with grad=False (an evaluation): it made no gradients")
    for given, made, name in ((dweight, cache.dweight, "dweight"), (dbias, cache.dbias, "dbias")):
        if given is not None and made is None:
            raise ValueError(f"{name} given, but the fused head's forward made none: pass grad_weight=True")
        if given is not None:
            given[...] = made                                                # (d, V) / (V,)
    return cache.dh                                                          # (B, T, d)

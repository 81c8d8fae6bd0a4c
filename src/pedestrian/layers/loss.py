"""Softmax cross-entropy for next-token prediction (paper section 1; EQUATIONS.md "Next-token loss").

Reference implementation: the paper's math only, written against the array API standard.
"""

from __future__ import annotations

from ..backend import array_namespace
from .checks import check_float, check_ids

IGNORE_INDEX = -100  # PyTorch's default ignore_index


def cross_entropy_forward(logits, targets, ignore_index: int = IGNORE_INDEX, *, n_total: int | None = None):
    """Mean of ``−log softmax(logits)[target]`` over the targets that count.

    Computed with log-sum-exp (max subtracted first), so logits of magnitude ``1e4`` stay
    finite. A target equal to ``ignore_index`` does not count. If *no* target counts the loss
    is defined as ``0.0`` and the backward gives zero gradients (no ``0/0`` NaN).

    Args:
        logits: ``(B, T, V)`` float array (``a12``).
        targets: ``(B, T)`` integer ids in ``[0, V)`` or ``ignore_index``.
        n_total: divide by this many counted targets instead of the number counted here: for one
            slice of a larger batch (one rank of a distributed batch) the loss and gradient are then this slice's share of the whole
            batch's mean, and the slices' losses and gradients simply add up. An int, or a 0-d
            integer array on the logits' device (never read: on a device, nothing waits for it).

    Returns:
        ``(loss, cache)``: ``loss`` a 0-d array of ``logits``' dtype (nats per counted token);
        ``cache`` holds ``y_pred`` (the softmax), the one-hot targets and the divisor (a 0-d
        array of the logits' dtype on their device, never read on the host).

    Raises:
        ValueError: a target outside ``[0, V)`` that is not ``ignore_index`` (named, with its position).
        TypeError: logits that are not real floating point, targets that are not integers.
    """
    xp = array_namespace(logits)
    V = logits.shape[-1]
    check_float(logits, "logits")
    check_ids(targets, V, "target", ignore_index=ignore_index)
    z = xp.reshape(logits, (-1, V))                                          # (N, V)
    t = xp.reshape(targets, (-1,))                                           # (N,)
    counted = t != ignore_index                                              # (N,) bool
    n_counted = xp.sum(xp.astype(counted, xp.int64)) if n_total is None else n_total  # int or 0-d
    divisor = count_divisor(xp, n_counted, z)                                # 0-d max(n, 1), unread
    y_gt = xp.astype(xp.arange(V, device=t.device)[None, :] == xp.where(counted, t, xp.zeros_like(t))[:, None],
                     z.dtype)
    y_gt = y_gt * xp.astype(counted, z.dtype)[:, None]                       # one-hot, 0 rows ignored
    z_max = xp.max(z, axis=-1, keepdims=True)                                # (N, 1)
    e = xp.exp(z - z_max)                                                    # (N, V), max entry 1
    sum_e = xp.sum(e, axis=-1, keepdims=True)                                # (N, 1)
    y_pred = e / sum_e                                                       # softmax (N, V)
    log_sum_exp = xp.log(sum_e) + z_max                                      # (N, 1)
    nll = xp.sum(xp.where(y_gt > 0, log_sum_exp - z, xp.zeros_like(z)), axis=-1)  # −log y_pred[target]
    # (a where, not y_gt · (…): a −∞ logit off the target is 0 · ∞ = NaN in a product)
    loss = xp.sum(nll) / divisor
    return loss, (y_pred, y_gt, counted, divisor, logits.shape)


def count_divisor(xp, n, like):
    """``max(n, 1)`` of a count (an int, or a 0-d integer array left unread) as a 0-d array of
    ``like``'s dtype on its device (exact up to 2^24 counted targets in float32, as an int
    divisor is rounded)."""
    n = xp.asarray(n, device=like.device)                                    # 0-d integer
    return xp.astype(xp.where(n > 0, n, xp.ones_like(n)), like.dtype)         # 0-d, like's dtype


def cross_entropy_backward(cache, *, over_logits: bool = False):
    """``Δ12 = (y_pred − onehot(target)) / N_counted`` on counted rows, ``0`` on ignored rows.

    ``over_logits``: the fast kernel's switch (write ``Δ12`` over the logits); this layer keeps
    ``y_pred``, not the logits, so it makes a new array either way.

    Returns:
        ``(B, T, V)`` error signal at the logits.
    """
    xp = array_namespace(cache[0])
    y_pred, y_gt, counted, divisor, shape = cache
    delta = (y_pred * xp.astype(counted, y_pred.dtype)[:, None] - y_gt) / divisor
    return xp.reshape(delta, shape)

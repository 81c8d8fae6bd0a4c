"""Softmax cross-entropy for next-token prediction (paper section 1; EQUATIONS.md "Next-token loss").

Reference implementation: the paper's math only, written against the array API standard.
"""

from __future__ import annotations

import numpy as np

from ..backend import array_namespace, is_torch_array
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
            integer array on the logits' device (a count never read on the host).

    Returns:
        ``(loss, cache)``: ``loss`` a 0-d array of ``logits``' dtype (nats per counted token);
        ``cache`` holds ``y_pred`` (the softmax), the one-hot targets and the count (an int for
        NumPy arrays; for other arrays a 0-d integer array on their device, so that no host
        synchronisation waits for it).

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
    n_counted = _count(xp, counted, n_total)                                 # int, or 0-d on the device
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
    loss = xp.sum(nll) / _at_least_one(xp, n_counted)
    return loss, (y_pred, y_gt, counted, n_counted, logits.shape)


def _count(xp, counted, n_total):
    """The divisor: ``n_total``, else the number of counted targets -- a Python int for NumPy
    arrays, a 0-d array left on the device for others (reading it would wait for the device)."""
    if isinstance(counted, np.ndarray) or n_total is not None and not is_torch_array(n_total):
        return int(xp.sum(xp.astype(counted, xp.int64))) if n_total is None else int(n_total)
    return xp.sum(xp.astype(counted, xp.int64)) if n_total is None else n_total


def _at_least_one(xp, n):
    """``max(n, 1)`` of a count, a Python int or a 0-d integer array (no read)."""
    return max(n, 1) if isinstance(n, int) else xp.where(n > 0, n, 1)


def cross_entropy_backward(cache, *, over_logits: bool = False):
    """``Δ12 = (y_pred − onehot(target)) / N_counted`` on counted rows, ``0`` on ignored rows.

    ``over_logits``: the fast kernel's switch (write ``Δ12`` over the logits); this layer keeps
    ``y_pred``, not the logits, so it makes a new array either way.

    Returns:
        ``(B, T, V)`` error signal at the logits.
    """
    xp = array_namespace(cache[0])
    y_pred, y_gt, counted, n_counted, shape = cache
    delta = (y_pred * xp.astype(counted, y_pred.dtype)[:, None] - y_gt) / _at_least_one(xp, n_counted)
    return xp.reshape(delta, shape)

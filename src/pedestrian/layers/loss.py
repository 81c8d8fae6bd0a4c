"""Softmax cross-entropy for next-token prediction (paper section 1; EQUATIONS.md "Next-token loss")."""

from __future__ import annotations

from array_api_compat import device

from ..backend import array_namespace

IGNORE_INDEX = -100  # PyTorch's default ignore_index


def cross_entropy_forward(logits, targets, ignore_index: int = IGNORE_INDEX):
    """Mean of ``−log softmax(logits)[target]`` over the targets that count.

    Computed with log-sum-exp (max subtracted first), so logits of magnitude ``1e4`` stay
    finite. A target equal to ``ignore_index`` does not count. If *no* target counts the
    loss is defined as ``0.0`` and the backward gives zero gradients (no ``0/0`` NaN).

    Args:
        logits: ``(B, T, V)`` float array (``a12``).
        targets: ``(B, T)`` integer ids in ``[0, V)`` or ``ignore_index`` (validated by the
            caller, see ``GPT.forward``).

    Returns:
        ``(loss, cache)``: ``loss`` a 0-d array of ``logits``' dtype (nats per counted
        token); ``cache`` holds the probabilities ``y_pred`` and the targets for the backward.
    """
    xp = array_namespace(logits)
    V = logits.shape[-1]
    z = xp.reshape(logits, (-1, V))
    t = xp.reshape(targets, (-1,))
    counted = t != ignore_index
    n_counted = int(xp.sum(xp.astype(counted, xp.int64)))
    safe_t = xp.where(counted, t, xp.zeros_like(t))
    shifted = z - xp.max(z, axis=-1, keepdims=True)
    e = xp.exp(shifted)
    sum_e = xp.sum(e, axis=-1, keepdims=True)
    log_z = xp.log(sum_e)
    target_shifted = xp.take_along_axis(shifted, safe_t[:, None], axis=-1)[:, 0]
    nll = (log_z[:, 0] - target_shifted) * xp.astype(counted, z.dtype)
    loss = xp.sum(nll) / max(n_counted, 1)
    e /= sum_e  # e now holds y_pred
    return loss, (e, safe_t, counted, n_counted, logits.shape)


def cross_entropy_backward(cache):
    """``Δ12 = (y_pred − onehot(target)) / N_counted`` on counted rows, ``0`` on ignored rows.

    Returns:
        ``(B, T, V)`` error signal at the logits. The one-hot matrix is never built: one
        entry per row is decremented.
    """
    y_pred, safe_t, counted, n_counted, shape = cache
    xp = array_namespace(y_pred)
    scale = xp.astype(counted, y_pred.dtype) * (1.0 / max(n_counted, 1))
    delta = y_pred * scale[:, None]
    rows = xp.arange(delta.shape[0], device=device(delta))
    delta[rows, safe_t] -= scale
    return xp.reshape(delta, shape)

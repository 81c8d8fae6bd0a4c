"""Fast kernels for the softmax cross-entropy (reference: :mod:`pedestrian.layers.loss`, paper section 1).

The forward keeps ``exp(z − max)`` and its row sums instead of the softmax and a one-hot
matrix; the backward folds the softmax division into its per-row scale and decrements one
entry per row (one pass over the ``(B·T, V)`` logits instead of three)."""

from __future__ import annotations

from array_api_compat import device

from ..backend import array_namespace
from ..layers.loss import IGNORE_INDEX
from . import blas
from .blas import elementwise_lib
from .threads import for_row_blocks
from .workspace import empty_array


def cross_entropy_forward(logits, targets, ignore_index: int = IGNORE_INDEX, *, n_total: int | None = None):
    """Mean of ``−log softmax(logits)[target]`` over the targets that count.

    Computed with log-sum-exp (max subtracted first), so logits of magnitude ``1e4`` stay
    finite. A target equal to ``ignore_index`` does not count. If *no* target counts the
    loss is defined as ``0.0`` and the backward gives zero gradients (no ``0/0`` NaN).

    Args:
        logits: ``(B, T, V)`` float array (``a12``).
        targets: ``(B, T)`` integer ids in ``[0, V)`` or ``ignore_index`` (validated by the
            caller, see ``GPT.forward``).
        n_total: divide by this many counted targets instead of the number counted here: for
            one slice of a larger batch (:class:`pedestrian.parallel.DataParallel`) the loss
            and its gradient are then this slice's share of the whole batch's mean, and the
            slices' losses and gradients simply add up.

    Returns:
        ``(loss, cache)``: ``loss`` a 0-d array of ``logits``' dtype (nats per counted
        token); ``cache`` holds ``exp(z − max)``, its row sums and the targets for the backward.
    """
    xp = array_namespace(logits)
    lib = elementwise_lib(logits)
    V = logits.shape[-1]
    z = logits.reshape(-1, V)
    t = targets.reshape(-1)
    counted = t != ignore_index
    n_counted = int(counted.sum()) if n_total is None else int(n_total)
    safe_t = xp.where(counted, t, xp.zeros_like(t))
    e = empty_array(z.shape, z)                            # exp(z − max): softmax before its division
    sum_e = empty_array((z.shape[0], 1), z)                # Σ exp(z − max), per row
    log_z = empty_array((z.shape[0],), z)                  # log Σ exp(z − max), per row
    target_shifted = empty_array((z.shape[0],), z)         # z[target] − max, per row
    unit, exp, _ = blas.softmax_exp(z)                     # 2^(x·log₂e) for e^x: one more pass,
                                                           # still faster on PyTorch's CPU

    def kernel(lo: int, hi: int) -> None:                  # rows lo:hi
        eb = e[lo:hi]
        lib.subtract(z[lo:hi], lib.amax(z[lo:hi], axis=-1, keepdims=True), out=eb)
        target_shifted[lo:hi] = xp.take_along_axis(eb, safe_t[lo:hi, None], axis=-1)[:, 0]
        if unit != 1.0:
            lib.multiply(eb, unit, out=eb)
        exp(eb, out=eb)
        lib.sum(eb, axis=-1, keepdims=True, out=sum_e[lo:hi])
        lib.log(sum_e[lo:hi, 0], out=log_z[lo:hi])

    for_row_blocks(z, kernel, z.shape[0], V)
    nll = (log_z - target_shifted) * xp.astype(counted, z.dtype)
    loss = xp.sum(nll) / max(n_counted, 1)
    return loss, (e, sum_e, safe_t, counted, n_counted, logits.shape)


def cross_entropy_backward(cache):
    """``Δ12 = (y_pred − onehot(target)) / N_counted`` on counted rows, ``0`` on ignored rows.

    ``y_pred = e / Σe`` (softmax) is never stored: the forward keeps ``e = exp(z − max)`` and
    ``Σe``, and the division is folded into the per-row scale here (one pass over the
    ``(B·T, V)`` logits instead of two).

    Returns:
        ``(B, T, V)`` error signal at the logits. The one-hot matrix is never built: one
        entry per row is decremented.
    """
    e, sum_e, safe_t, counted, n_counted, shape = cache
    xp = array_namespace(e)
    lib = elementwise_lib(e)
    scale = xp.astype(counted, e.dtype) * (1.0 / max(n_counted, 1))
    row_scale = scale[:, None] / sum_e                     # counted / (N Σe), per row
    delta = empty_array(e.shape, e)
    V = e.shape[-1]

    def kernel(lo: int, hi: int) -> None:
        lib.multiply(e[lo:hi], row_scale[lo:hi], out=delta[lo:hi])

    for_row_blocks(e, kernel, e.shape[0], V)
    rows = xp.arange(delta.shape[0], device=device(delta))
    delta[rows, safe_t] -= scale
    return xp.reshape(delta, shape)

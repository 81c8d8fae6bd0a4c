"""Fast kernels for the softmax cross-entropy (reference: :mod:`pedestrian.layers.loss`, paper section 1).

NumPy arrays: the forward keeps only each row's maximum and ``Σe = Σ e^{z − max}`` (two passes
over the row), not the softmax; the backward makes ``Δ12 = (e^{z − max}/Σe − onehot) / N`` in one
pass from the logits (which the model keeps anyway). No ``(B·T, V)`` array is stored between the two: 51 MB less at gpt2's
vocabulary. ``exp`` is :mod:`.vecmath`'s polynomial (vectorised in the loop).
"""

from __future__ import annotations

import numpy as np

from ..layers.checks import check_float, check_ids
from ..layers.loss import IGNORE_INDEX
from .jit import kernel, prange
from .schedule import LOSS_SUM_BLOCK
from .vecmath import exp
from .workspace import empty_array



@kernel(parallel=True)
def nll_rows(z, z_max, targets, sum_e, nll):
    """Per row: ``Σe = Σ e^{z − max z}``, ``nll = max z + log Σe − z[target]`` (target < 0: 0)."""
    n, V = z.shape
    zero = z.dtype.type(0.0)
    for r in prange(n):
        m = z_max[r]
        s = 0.0
        for j0 in range(0, V, LOSS_SUM_BLOCK):
            block = zero
            for j in range(j0, min(j0 + LOSS_SUM_BLOCK, V)):
                block += exp(z[r, j] - m)
            s += block
        sum_e[r] = s
        t = targets[r]
        nll[r] = (m - np.float64(z[r, t])) + np.log(s) if t >= 0 else 0.0


@kernel(parallel=True)
def delta_rows(z, z_max, targets, sum_e, scale, delta):
    """Per row: ``Δ = (scale/Σe) · e^{z − max z}``, ``Δ[target] −= scale`` (``scale = counted / N``;
    ``e^{z − ℓ}`` would lose the digits of a large ``ℓ``)."""
    n, V = z.shape
    for r in prange(n):
        m = z_max[r]
        c = z.dtype.type(scale[r] / sum_e[r])
        for j in range(V):
            delta[r, j] = c * exp(z[r, j] - m)
        t = targets[r]
        if t >= 0:
            delta[r, t] -= z.dtype.type(scale[r])


def cross_entropy_forward(logits, targets, ignore_index: int = IGNORE_INDEX, *, n_total: int | None = None):
    """``L = mean −log softmax(logits)[target]`` over the targets that count (EQUATIONS.md,
    "Next-token loss").

    Computed with log-sum-exp (max subtracted first), so logits of magnitude ``1e4`` stay
    finite. A target equal to ``ignore_index`` does not count. If *no* target counts the
    loss is defined as ``0.0`` and the backward gives zero gradients (no ``0/0`` NaN).

    Args:
        logits: ``(B, T, V)`` float array (``a12``).
        targets: ``(B, T)`` integer ids in ``[0, V)`` or ``ignore_index`` (validated by the
            caller, see ``GPT.forward``).
        n_total: divide by this many counted targets instead of the number counted here: for
            one slice of a larger batch (a rank's rows, :mod:`pedestrian.training.distributed`) the loss
            and its gradient are then this slice's share of the whole batch's mean, and the
            slices' losses and gradients simply add up.

    Raises:
        ValueError: a target outside ``[0, V)`` that is not ``ignore_index``.

    Returns:
        ``(loss, cache)``: ``loss`` a scalar of ``logits``' dtype (nats per counted token).
        The cache holds the logits, each row's maximum and Σe, and the targets.
    """
    V = logits.shape[-1]
    z = np.ascontiguousarray(logits).reshape(-1, V)
    check_float(logits, "logits")
    check_ids(np.asarray(targets), V, "target", ignore_index=ignore_index)   # (numba reads past a row)
    t = np.asarray(targets).reshape(-1)
    counted = t != ignore_index
    n_counted = int(counted.sum()) if n_total is None else int(n_total)
    t = np.where(counted, t, -1)                           # −1: not counted
    sum_e, nll = np.empty(z.shape[0]), np.empty(z.shape[0])
    z_max = np.max(z, axis=-1)                             # NumPy's SIMD loop: 5.2 against 6.7 ms
    nll_rows(z, z_max, t, sum_e, nll)        # (gpt2's logits, one thread)
    loss = z.dtype.type(nll.sum() / max(n_counted, 1))
    return loss, (z, z_max, sum_e, t, n_counted, logits.shape)


def cross_entropy_backward(cache, *, over_logits: bool = False):
    """``Δ12 = (y_pred − onehot(target)) / N_counted`` on counted rows, ``0`` on ignored rows
    (EQUATIONS.md, "Next-token loss").

    Args:
        cache: the forward's.
        over_logits: write ``Δ12`` over the forward's logits (one ``(B, T, V)`` array less; the
            logits are gone after, so the caller must hold no other use for them).

    Returns:
        ``(B, T, V)`` error signal at the logits. The one-hot matrix is never built: one
        entry per row is decremented.
    """
    z, z_max, sum_e, t, n_counted, shape = cache
    scale = (t >= 0) * (1.0 / max(n_counted, 1))           # counted / N, per row
    delta = z if over_logits else empty_array(z.shape, z)  # (each entry read before it is written)
    delta_rows(z, z_max, t, sum_e, scale, delta)
    return delta.reshape(shape)

"""Paper section 1 (and EQUATIONS.md "Next-token loss"): softmax cross-entropy over the counted
targets, ``Δ12 = (y_pred − onehot(target)) / N_counted``, for both kernel modules.

Autograd of ``torch.nn.functional.cross_entropy`` (an implementation independent of ours) is the
oracle; finite differences check the same gradient a second way; the properties are the ignore
index, the all-ignored batch (loss 0, zero gradients, no NaN), ``n_total`` (slices of a batch
add up) and logits of magnitude 1e4. Tolerances: tests/oracles/gradcheck.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradcheck import (
    assert_autograd_close,
    assert_fd_close,
    assert_rounding_close,
    autograd,
    kernels_name,
    kernels_param,
    numerical_grad,
    sum_rounding_bound,
)

IGNORE = -100


def torch_loss(logits, targets):
    V = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, V), torch.as_tensor(targets).reshape(-1), ignore_index=IGNORE)


def case(seed=0, B=2, T=4, V=5):
    rng = np.random.default_rng(seed)
    logits = 2.0 * rng.standard_normal((B, T, V))
    targets = rng.integers(0, V, (B, T))
    targets[0, 2] = targets[1, 0] = IGNORE
    return logits, targets


@kernels_param()
def test_loss_and_delta12_match_autograd(K):
    logits, targets = case()
    loss, cache = K.cross_entropy_forward(logits, targets)
    delta = K.cross_entropy_backward(cache)
    ref_loss, grads = autograd(lambda z: torch_loss(z, targets), {"z": logits})
    assert_autograd_close(loss, ref_loss, "loss")
    assert_autograd_close(delta, grads["z"], "Δ12")
    assert delta.shape == logits.shape and delta.dtype == logits.dtype


@kernels_param()
def test_delta12_matches_finite_differences(K):
    rng = np.random.default_rng(1)
    logits = 2.0 * rng.standard_normal((1, 3, 5))
    targets = np.array([[2, IGNORE, 4]])         # N = 2: entries of Δ12 up to 1/2

    def f():
        return float(K.cross_entropy_forward(logits, targets)[0])

    delta = K.cross_entropy_backward(K.cross_entropy_forward(logits, targets)[1])
    assert_fd_close(delta, numerical_grad(f, logits), "cross_entropy.logits")


@kernels_param()
def test_ignored_targets_get_exactly_zero_signal_and_do_not_count(K):
    logits, targets = case(seed=2)
    loss, cache = K.cross_entropy_forward(logits, targets)
    delta = K.cross_entropy_backward(cache)
    ignored = targets == IGNORE
    assert np.all(delta[ignored] == 0.0)                       # 0 · anything, exactly
    assert np.all(delta[~ignored].any(axis=-1))
    # the loss is the mean over the counted targets only: changing an ignored row changes nothing
    changed = logits.copy()
    changed[ignored] += 7.0
    assert float(K.cross_entropy_forward(changed, targets)[0]) == float(loss)   # the same operations on the same counted rows
    # each counted row of Δ12 sums to zero (softmax sums to 1, minus the one-hot's 1), up to
    # the rounding of V + 2 terms of magnitude <= 1/N
    rows = delta[~ignored].sum(axis=-1)
    assert np.max(np.abs(rows)) <= float(sum_rounding_bound(logits.shape[-1] + 2, 2.0 / (~ignored).sum()))


@kernels_param()
def test_all_ignored_batch_has_loss_zero_and_zero_gradients(K):
    logits, _ = case(seed=3)
    targets = np.full(logits.shape[:2], IGNORE)
    loss, cache = K.cross_entropy_forward(logits, targets)
    delta = K.cross_entropy_backward(cache)
    assert float(loss) == 0.0
    assert np.all(delta == 0.0) and not np.any(np.isnan(delta))
    ref_loss, grads = autograd(lambda z: (z * 0.0).sum(), {"z": logits})   # the oracle's convention
    assert float(ref_loss) == 0.0 and np.all(grads["z"] == 0.0)


@kernels_param()
def test_slices_with_n_total_add_up_to_the_whole_batch(K):
    """``n_total``: one slice's loss and gradient are its share of the whole batch's mean."""
    logits, targets = case(seed=4, B=4)
    n_total = int((targets != IGNORE).sum())
    loss, cache = K.cross_entropy_forward(logits, targets)
    delta = K.cross_entropy_backward(cache)
    parts = [K.cross_entropy_forward(logits[s], targets[s], n_total=n_total) for s in (slice(0, 1), slice(1, 4))]
    total = sum(float(p[0]) for p in parts)
    # the same per-row terms summed in two groupings: B·T terms of magnitude <= |nll|
    nll_abs = float(loss) * n_total
    assert abs(total - float(loss)) <= float(sum_rounding_bound(logits.shape[0] * logits.shape[1], nll_abs)) / n_total
    delta_parts = np.concatenate([K.cross_entropy_backward(p[1]) for p in parts])
    # every row of Δ12 is computed by the same formula in both: only the division by N may be
    # ordered differently (one rounding per entry)
    assert_rounding_close(delta_parts, delta, np.abs(delta) + 1.0 / n_total, "Δ12 of the slices")


def reference_log_softmax_loss(logits: np.ndarray, targets: np.ndarray):
    """float64 log-sum-exp, computed here independently of the library."""
    z = logits.astype(np.float64).reshape(-1, logits.shape[-1])
    t = targets.reshape(-1)
    m = z.max(axis=-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=-1))
    counted = t != IGNORE
    nll = lse[counted] - z[counted, t[counted]]
    y = np.exp(z - lse[:, None])
    delta = y.copy()
    delta[np.arange(len(t))[counted], t[counted]] -= 1.0
    delta *= counted[:, None] / counted.sum()
    return nll.mean(), delta.reshape(logits.shape)


@kernels_param()
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_logits_of_magnitude_1e4_give_a_finite_loss_and_gradient(K, dtype):
    rng = np.random.default_rng(7)
    logits = 1e4 * rng.choice([-1.0, 1.0], size=(2, 3, 6)) * rng.uniform(0.5, 1.0, size=(2, 3, 6))
    logits[0, 0, :] = 1e4          # a row of ties at the extreme
    logits = logits.astype(dtype)
    targets = np.array([[1, 4, IGNORE], [0, 5, 2]])
    loss, cache = K.cross_entropy_forward(logits, targets)
    delta = K.cross_entropy_backward(cache)
    expected_loss, expected_delta = reference_log_softmax_loss(logits, targets)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(delta))
    assert float(loss) > 1e3                                   # the check is at the extreme
    eps = float(np.finfo(dtype).eps)
    # a handful of rounded operations per row (max, subtract, exp, sum, log, add, subtract) and a
    # mean over 5 rows, each rounding relative to the loss's own magnitude: 64 ulps holds on any
    # IEEE-754 machine (for float64 this is 1.4e-14, tighter than 1e-12 for that reason)
    assert abs(float(loss) - expected_loss) <= 64 * eps * abs(expected_loss)
    # every row is either six exact ties (softmax 1/6) or one entry ~1e4 above the rest (whose
    # exp underflows to exactly 0). Both paths form y_pred = e / Σe with e = exp(z − max): exact
    # to a few ulps of its <= 1 entries, whatever the size of z
    bound = 4 * eps
    assert np.max(np.abs(delta - expected_delta)) <= bound

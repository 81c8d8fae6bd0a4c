"""Gradient accumulation equals one batch, whatever the ignored targets (issue 22).

One step of ``k`` micro-batches must be the step of their concatenation: the loss is the token
mean over every counted target of the step, the gradient that of that mean, and so the gradient
norm, the clipping and the AdamW update are the one-batch ones -- also when the micro-batches
count different numbers of targets (ignore index ``-100``), one of them none at all. Over ranks:
``tests/helpers/dist_scenarios.py`` (``ACCUM_*``), run by ``tests/system/test_distributed.py``.

Tolerance: ``RTOL = 1e-12`` (float64), relative to each compared quantity's magnitude (per tensor
for the weights). Both sides evaluate the same formulas on the same rows and divide by the same
count; the only difference is the order of the float sums (per micro-batch / per slice partial
sums of the loss and of each gradient entry, added afterwards), over at most the batch's 48
positions: Higham's bound for two orders of one sum, ``2·γ_n·Σ|x|`` with ``n`` = 48, is 2e-14 of
``Σ|x|``, and the AdamW step from warm moments passes a relative gradient error on with a factor
below 1 (``m̂/(√v̂ + ε)``); the gradient entries here have little cancellation. Measured: at most
2e-16 (loss, norm, weights); the old mean-of-the-micro-batch-means was off by 1.79x in the
gradient norm ("2 uneven"), 0.5x in the loss and the norm ("2 one empty"), 0.43 relative in the
weights ("3 uneven").
"""

from __future__ import annotations

import numpy as np
import pytest

from pedestrian.config import GPTConfig
from pedestrian.training.step import TrainingError, count_targets, estimate_loss, train_step
from pedestrian.model import GPT
from pedestrian.training.optim import AdamW

RTOL = 1e-12
#: no q/k/v biases: the key bias's gradient is 0 in exact arithmetic (paper section 3), pure
#: rounding noise on both sides, which a relative comparison cannot bound
CFG = GPTConfig(vocab_size=13, context_length=8, d_model=12, n_heads=2, n_blocks=2, qkv_bias=False)
B, T = 6, 8

#: (name, row bounds of the micro-batches, targets ignored in each micro-batch)
SPLITS = [
    ("2 uneven", (0, 2, 6), (14, 3)),                 # 2 of 16 counted, then 29 of 32
    ("2 one empty", (0, 3, 6), (24, 0)),              # the first counts nothing
    ("3 one empty", (0, 2, 4, 6), (8, 16, 0)),        # 8, 0 and 16 counted
    ("3 uneven", (0, 1, 3, 6), (0, 11, 20)),          # 8, 5 and 4 counted
]


def _concatenated(bounds: tuple, ignored: tuple, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The one batch ``(x, y)``, ``(B, T)``; rows ``bounds[i]:bounds[i+1]`` (micro-batch ``i``)
    have ``ignored[i]`` targets set to ``-100``."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, CFG.vocab_size, (B, T))
    y = rng.integers(0, CFG.vocab_size, (B, T))
    for lo, hi, n in zip(bounds, bounds[1:], ignored):
        part = y[lo:hi].reshape(-1)                     # a view: writes reach y
        part[rng.choice(part.size, size=n, replace=False)] = -100
        assert count_targets(y[lo:hi]) == (hi - lo) * T - n
    return x, y


def _warm_state() -> tuple[np.ndarray, dict]:
    """Weights and AdamW state after two steps on other data: the compared step starts from
    non-zero moments, so its update depends on the gradient's size, not only on its signs."""
    model = GPT(CFG, seed=3, dtype="float64")
    opt = AdamW(model, lr=1e-2, weight_decay=0.1)
    rng = np.random.default_rng(99)
    for _ in range(2):
        train_step(model, opt, [(rng.integers(0, 13, (B, T)), rng.integers(0, 13, (B, T)))], 1e-2)
    return model.flat.copy(), opt.state_dict()


def _step(batches: list, clip: float) -> tuple[float, float, dict]:
    """``(loss, grad_norm, weights)`` after one :func:`train_step` from the warm state."""
    flat, state = _warm_state()
    model = GPT(CFG, seed=3, dtype="float64")
    model.flat[...] = flat
    opt = AdamW(model, lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(state)
    loss, norm = train_step(model, opt, batches, 1e-2, grad_clip=clip)
    assert opt.step_count == state["step"] + 1                    # an update was made
    return loss, norm, {k: v.copy() for k, v in model.params.items()}


def _assert_same_step(got, want) -> None:
    (loss, norm, weights), (loss1, norm1, weights1) = got, want
    assert abs(loss - loss1) <= RTOL * loss1, (loss, loss1)
    assert abs(norm - norm1) <= RTOL * norm1, (norm, norm1, norm / norm1)
    for name, w in weights1.items():
        err = float(np.max(np.abs(weights[name] - w)))
        assert err <= RTOL * float(np.max(np.abs(w))), (name, err)


@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["no-clip", "clip"])
@pytest.mark.parametrize("name,bounds,ignored", SPLITS, ids=[s[0] for s in SPLITS])
def test_micro_batches_with_different_ignored_counts_equal_one_batch(name, bounds, ignored, clip):
    """Loss, gradient norm and weights after one AdamW step (clipped or not) of ``k`` micro-batches
    equal those of their concatenation (module docstring: RTOL)."""
    x, y = _concatenated(bounds, ignored)
    want = _step([(x, y)], clip)
    got = _step([(x[lo:hi], y[lo:hi]) for lo, hi in zip(bounds, bounds[1:])], clip)
    if clip:
        assert want[1] > 2 * clip                                 # the clipping is exercised
    _assert_same_step(got, want)


def test_a_step_whose_every_target_is_ignored_is_refused_and_changes_nothing():
    """No target counts in any micro-batch: there is no loss to train on. A clear error, before any
    forward (every rank counts the same global batches, so every rank raises), and the weights,
    the moments and the step count are untouched (an AdamW step on a zero gradient would still
    move the weights by momentum and weight decay)."""
    flat, state = _warm_state()
    model = GPT(CFG, seed=3, dtype="float64")
    model.flat[...] = flat
    opt = AdamW(model, lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(state)
    x = np.zeros((B, T), dtype=np.int64)
    y = np.full((B, T), -100)
    with pytest.raises(TrainingError, match=r"every target of the step's 2 micro-batch\(es\) is the ignore "
                                            r"index -100"):
        train_step(model, opt, [(x[:3], y[:3]), (x[3:], y[3:])], 1e-2)
    np.testing.assert_array_equal(model.flat, flat)
    after = opt.state_dict()
    assert after["step"] == state["step"]
    np.testing.assert_array_equal(after["base.m"], state["base.m"])


def test_validation_loss_is_the_token_mean_over_its_batches():
    """estimate_loss over batches that count different numbers of targets is the loss of their
    concatenation (the same rule as a training step), not the mean of the batches' means."""
    bounds, ignored = (0, 2, 6), (14, 3)
    x, y = _concatenated(bounds, ignored)
    model = GPT(CFG, seed=3, dtype="float64")
    want = model.loss(x, y)
    got = estimate_loss(model, [(x[lo:hi], y[lo:hi]) for lo, hi in zip(bounds, bounds[1:])])
    assert abs(got - want) <= RTOL * want, (got, want)
    with pytest.raises(TrainingError, match="every target of the 2 validation batch"):
        estimate_loss(model, [(x[:2], np.full((2, T), -100)), (x[2:], np.full((4, T), -100))])


def test_eval_mode_turns_dropout_off_in_its_body_and_leaves_the_flag_even_on_error():
    """``eval_mode(model)``: no dropout inside (two losses equal), dropout again afterwards (also
    after an exception), ``model.training`` untouched: the one way evaluation, the gradient record
    and generation switch dropout off."""
    from pedestrian.model import eval_mode

    model = GPT(GPTConfig(vocab_size=11, context_length=4, d_model=8, n_heads=2, n_blocks=1, dropout=0.5),
                seed=0, dtype="float64")
    x = np.array([[1, 2, 3, 4]])
    y = np.array([[2, 3, 4, 5]])
    with eval_mode(model) as m:
        assert m is model and model.training is True
        assert model.loss(x, y) == model.loss(x, y)
        clean = model.loss(x, y)
    assert model.loss(x, y) != clean                      # dropout 0.5 is back
    with pytest.raises(RuntimeError), eval_mode(model):
        raise RuntimeError("inside")
    assert model.training is True and model.loss(x, y) != clean

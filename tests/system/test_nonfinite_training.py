"""No silent numbers during training (issue 13, part 1): the whole path a number takes -- the
loss, the gradient norm and clipping, the AdamW update, validation, checkpoints -- under NaN, inf
and gradients too large for float32, and the one rule the loop follows (pedestrian.training.loop):
skip the update, warn with the step, stop after --max-skipped-steps in a row naming the last
good checkpoint."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

import pedestrian.training.loop as loop_module
from pedestrian.checkpoint import load_checkpoint
from pedestrian.cli import main
from pedestrian.config import GPTConfig
from pedestrian.model import GPT
from pedestrian.training.optim import AdamW, ParamGroup, clip_grad_norm, global_grad_norm
from pedestrian.training import TrainingError, TrainSettings, read_log, train, train_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = dict(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_blocks=2)


def _exact_norm(arrays) -> float:
    """The reference: Σ g² in float64 after an exact power-of-two scaling, summed by math.fsum
    (correctly rounded), so it holds for any float32 input."""
    top = max(float(np.max(np.abs(a))) for a in arrays)
    scale = 2.0 ** -math.frexp(top)[1]
    return math.sqrt(math.fsum(float(x) ** 2 for a in arrays for x in np.asarray(a, np.float64) * scale)) / scale


# ------------------------------------------------------------------------ gradient norm, clipping
@pytest.mark.parametrize("magnitude", [1e20, 3e38, 1e-25, 1e-40])
def test_gradient_norm_is_finite_whenever_the_true_norm_is(magnitude):
    """float32 gradients whose squares overflow (1e20, 3e38) or underflow (1e-25, subnormal
    1e-40): the norm is the float64 norm of the same numbers (the one-pass float32 dot gives inf
    or 0). Bound: the scaled float64 sum has relative error <= n·2⁻⁵³ against the correctly
    rounded reference, n = 300 terms -> 1e-12 is loose."""
    rng = np.random.default_rng(0)
    grads = [(rng.uniform(-1, 1, 200) * magnitude).astype(np.float32),
             (rng.uniform(-1, 1, 100) * magnitude).astype(np.float32)]
    assert grads[0].dtype == np.float32 and np.all(np.isfinite(grads[0]))
    with np.errstate(over="ignore"):
        naive = math.sqrt(sum(float(np.dot(g, g)) for g in grads))  # one float32 dot per buffer
    assert naive in (math.inf, 0.0)                                   # overflows / underflows
    norm = global_grad_norm(grads)
    assert math.isfinite(norm) and norm > 0
    assert norm == pytest.approx(_exact_norm(grads), rel=1e-12)
    torch_grads = [torch.tensor(g) for g in grads]
    assert global_grad_norm(torch_grads) == pytest.approx(norm, rel=1e-12)


def test_gradient_norm_reports_nan_and_inf():
    g = np.ones(10, np.float32)
    for bad, expect in ((np.nan, math.isnan), (np.inf, math.isinf), (-np.inf, math.isinf)):
        h = g.copy()
        h[3] = bad
        assert expect(global_grad_norm([g, h]))
    both = g.copy()
    both[[1, 2]] = [np.inf, np.nan]
    assert math.isnan(global_grad_norm(both))
    assert global_grad_norm(np.zeros(5, np.float32)) == 0.0


@pytest.mark.parametrize("magnitude", [1e20, 3e38])
def test_clipping_huge_float32_gradients_keeps_their_direction(magnitude):
    """Clipped to norm 1, not to inf or 0: torch's clip_grad_norm_ takes the float32 norm, which
    is inf here, and scales every gradient to 0 (its coefficient 1/inf)."""
    rng = np.random.default_rng(1)
    grads = [(rng.uniform(-1, 1, 300) * magnitude).astype(np.float32)]
    exact = _exact_norm(grads)
    direction = grads[0].astype(np.float64) / exact
    t = torch.tensor(grads[0].copy()).requires_grad_()
    t.grad = torch.tensor(grads[0].copy())
    assert math.isinf(float(torch.nn.utils.clip_grad_norm_([t], 1.0)))       # the oracle's failure
    norm = clip_grad_norm(grads, 1.0)
    assert norm == pytest.approx(exact, rel=1e-12)                    # the norm before clipping
    assert np.all(np.isfinite(grads[0]))
    # float32 result: each entry rounded once or twice (the factors), relative 2⁻²³ each
    assert global_grad_norm(grads) == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_allclose(grads[0], direction, rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------------------------------ AdamW
def _group(values, dtype=np.float32):
    params = np.linspace(-1, 1, len(values)).astype(dtype)
    return ParamGroup("base", params, np.asarray(values, dtype=dtype), n_decay=len(values) // 2)


def _state(opt):
    return ([g.params.copy() for g in opt.groups], [m.copy() for m in opt.m], [v.copy() for v in opt.v],
            opt.step_count)


def _same_state(a, b):
    for x, y in zip(a[0] + a[1] + a[2], b[0] + b[1] + b[2]):
        np.testing.assert_array_equal(x, y)
    assert a[3] == b[3]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_adamw_refuses_a_non_finite_gradient_and_changes_nothing(bad):
    group = _group([0.5, -1.0, 2.0, 0.0, 1e-3, 4.0])
    opt = AdamW([group], lr=0.1, weight_decay=0.1)
    opt.step()
    before = _state(opt)
    group.grads[2] = bad
    with pytest.raises(FloatingPointError, match="parameters and moments are unchanged"):
        opt.step()
    _same_state(_state(opt), before)


def test_adamw_refuses_a_gradient_whose_square_overflows_the_dtype():
    """1e19 is finite in float32 but its square is not: v would become inf and the entry would
    never move again. Refused (clip first); just below the limit the step is finite."""
    group = _group([1e19, 1.0, -2.0, 0.0])
    opt = AdamW([group], lr=0.1)
    assert opt.max_grad_norm == pytest.approx(math.sqrt(float(np.finfo(np.float32).max)) / 2)
    before = _state(opt)
    with pytest.raises(FloatingPointError, match="gradient norm is 1e"):
        opt.step()
    _same_state(_state(opt), before)
    group.grads[0] = 0.99 * opt.max_grad_norm
    group.grads[1:] = 0
    opt.step()
    assert all(np.all(np.isfinite(a)) for a in (group.params, opt.m[0], opt.v[0]))


def test_adamw_eps_must_be_positive_because_zero_makes_nan():
    """torch.optim.AdamW with eps=0: an entry whose gradient has always been 0 (a token no batch
    held) gets 0/0 = NaN. Ours refuses eps <= 0 (and an infinite lr) where they are declared, the
    settings of a run (AdamW takes its hyper-parameters as given)."""
    from pedestrian.training import TrainSettings
    from pedestrian.training.specs import check

    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.tensor([1.0, 0.0, 2.0])
    torch.optim.AdamW([p], lr=0.1, eps=0.0, foreach=False).step()
    assert math.isnan(float(p.detach()[1]))                               # the oracle's NaN
    with pytest.raises(ValueError, match="--eps must be a finite number > 0"):
        check(TrainSettings(eps=0.0))
    with pytest.raises(ValueError, match="--lr must be a finite number > 0, got inf"):
        check(TrainSettings(lr=math.inf))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_adamw_never_makes_a_weight_non_finite(dtype, clip):
    """Gradients from exactly 0 through 1e-30 to 1e18 (and 1e30 in float32 when clipped), mixed
    in one buffer and changing every step, lr up to 1: every weight and moment stays finite and
    an entry whose gradient is always 0 moves only by weight decay."""
    rng = np.random.default_rng(2)
    n = 64
    params = rng.standard_normal(n).astype(dtype)
    untouched = params[n - 1]                                          # not decayed: n_decay = n // 2
    grads = np.zeros(n, dtype)
    opt = AdamW([ParamGroup("base", params, grads, n_decay=n // 2)], lr=1.0, betas=(0.9, 0.99), weight_decay=0.1)
    largest = 1e18 if clip == 0 else 1e30
    for step in range(30):
        exponents = rng.uniform(-30, math.log10(largest), n)
        grads[:] = (rng.choice([-1.0, 1.0], n) * 10.0 ** exponents).astype(dtype)
        grads[[0, n - 1]] = 0.0                                         # never any gradient
        norm = global_grad_norm(grads)
        assert loop_module.skip_reason(1.0, norm, clip, opt) is None
        after = norm
        if clip:
            clip_grad_norm([grads], clip, norm=norm)
            after = norm * min(1.0, clip / (norm + 1e-6))
        opt.step(lr=1.0 / (1 + step), grad_norm=after)
        for a in (params, opt.m[0], opt.v[0]):
            assert np.all(np.isfinite(a)), step
    assert opt.m[0][n - 1] == 0 and opt.v[0][n - 1] == 0 and params[n - 1] == untouched
    # Adam moves a parameter by at most about 10.5 lr per update (optim docstring): 30 updates
    assert np.max(np.abs(params)) < 10.5 * sum(1.0 / (1 + s) for s in range(30)) + 10


# --------------------------------------------------------------------------------------- one step
def _model_and_optimizer():
    model = GPT(GPTConfig(**TINY), seed=0, dtype="float32")
    return model, AdamW(model, lr=1e-2, weight_decay=0.1)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 11, (2, 8)), rng.integers(0, 11, (2, 8))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
def test_train_step_skips_an_overflowing_forward():
    """Token embeddings of ±3e38 (finite float32, tied to the logits) overflow the forward: the
    loss is NaN, so the step makes no update -- weights, moments and AdamW's step count are bit
    for bit as before."""
    model, opt = _model_and_optimizer()
    train_step(model, opt, [_batch(0)], 1e-2, grad_clip=1.0)
    w = model.params["tok_emb.weight"]
    w[...] = np.sign(w) * np.float32(3e38)
    before = _state(opt)
    loss, norm = train_step(model, opt, [_batch(1)], 1e-2, grad_clip=1.0)
    assert not math.isfinite(loss)
    assert loop_module.skip_reason(loss, norm, 1.0, opt) is not None
    _same_state(_state(opt), before)


def test_train_step_skips_a_nan_gradient_with_a_finite_loss():
    model, opt = _model_and_optimizer()

    class NaNGradient:                       # a backward that leaves one NaN in the gradient
        training = True

        def loss(self, x, y, **kw):
            return model.loss(x, y, **kw)

        def backward(self):
            out = model.backward()
            opt.groups[0].grads[7] = np.nan
            return out

    before = _state(opt)
    loss, norm = train_step(NaNGradient(), opt, [_batch(0), _batch(1)], 1e-2, grad_clip=1.0)
    assert math.isfinite(loss) and math.isnan(norm)
    assert loop_module.skip_reason(loss, norm, 1.0, opt) == "the gradient norm is nan"
    _same_state(_state(opt), before)


def test_train_step_skips_an_overflowing_gradient_without_clipping_and_clips_it_with():
    model, opt = _model_and_optimizer()

    class Huge:
        training = True

        def loss(self, x, y, **kw):
            return model.loss(x, y, **kw)

        def backward(self):
            out = model.backward()
            opt.groups[0].grads[...] *= np.float32(1e20)            # finite, square overflows
            return out

    before = _state(opt)
    loss, norm = train_step(Huge(), opt, [_batch(0)], 1e-2, grad_clip=0.0)
    assert math.isfinite(norm) and norm > opt.max_grad_norm
    assert "too large for AdamW" in loop_module.skip_reason(loss, norm, 0.0, opt)
    _same_state(_state(opt), before)
    loss, norm = train_step(Huge(), opt, [_batch(0)], 1e-2, grad_clip=1.0)
    assert loop_module.skip_reason(loss, norm, 1.0, opt) is None and opt.step_count == 1
    assert np.all(np.isfinite(opt.groups[0].params))


# ---------------------------------------------------------------------------------------- the run
@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question"]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(words, 9)) for _ in range(200)), encoding="utf-8")
    return path


def _settings(corpus, out, **kw):
    base = dict(data=str(corpus), out=str(out), model=dict(context_length=16, d_model=16, n_heads=2, n_blocks=2),
                batch_size=4, max_steps=8, warmup_steps=2, lr=1e-2, min_lr=1e-3, eval_interval=2,
                eval_batches=2, max_minutes=None, progress=False, plot=False)
    base.update(kw)
    return TrainSettings(**base)


def _nan_at(monkeypatch, calls_with_nan):
    """train_step returns a NaN loss (and makes no update) at these calls (1-based) of this run."""
    real, calls = loop_module.train_step, [0]

    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] in calls_with_nan:
            return math.nan, math.nan
        return real(*args, **kwargs)

    monkeypatch.setattr(loop_module, "train_step", step)
    return calls


def test_isolated_nan_steps_are_skipped_and_the_run_goes_on(corpus, tmp_path, monkeypatch, caplog):
    """NaN at steps 3 and 4 (2 in a row < 5): warned with the step, logged as skipped with nulls,
    the run finishes, AdamW made 6 updates in 8 steps, and the checkpoint records the 2 skips so
    that resuming checks step - skipped = AdamW's step. Stopped at 6 and resumed, the run gives
    the uninterrupted run's losses bit for bit."""
    caplog.set_level(logging.WARNING, logger="pedestrian")
    _nan_at(monkeypatch, {3, 4})
    r = train(_settings(corpus, tmp_path / "one", plot=True))
    assert r.stop_reason == "max_steps" and r.step == 8
    warnings = [x.getMessage() for x in caplog.records if x.levelno == logging.WARNING]
    assert [w.split(":")[0] for w in warnings] == ["step 3", "step 4"]
    assert "the training loss is nan; the update is skipped (weights and AdamW moments unchanged), 2 in a row" \
        in warnings[1]
    records = [x for x in read_log(tmp_path / "one" / "log.jsonl") if "loss" in x]
    assert [x["step"] for x in records] == list(range(1, 9))
    assert [x["step"] for x in records if x.get("skipped")] == [3, 4]
    assert records[2]["loss"] is None and records[2]["grad_norm"] is None
    assert (tmp_path / "one" / "loss_curve.png").is_file()                # nulls left out of the plot
    ckpt = load_checkpoint(tmp_path / "one")
    assert ckpt.meta["skipped_steps"] == 2 and ckpt.optimizer_state()["step"] == 6

    _nan_at(monkeypatch, {3, 4})
    train(_settings(corpus, tmp_path / "two", stop_step=6))
    monkeypatch.setattr(loop_module, "train_step", train_step)
    train(_settings(corpus, tmp_path / "two"), resume=True, explicit={"out"})
    a = {x["step"]: x["loss"] for x in read_log(tmp_path / "one" / "log.jsonl") if "loss" in x}
    b = {x["step"]: x["loss"] for x in read_log(tmp_path / "two" / "log.jsonl") if "loss" in x}
    assert a == b
    np.testing.assert_array_equal(load_checkpoint(tmp_path / "two").model.flat, ckpt.model.flat)


def test_nan_from_step_k_stops_the_run_naming_the_last_good_checkpoint(corpus, tmp_path, monkeypatch, capsys):
    """The loss becomes NaN at step 5 and stays so: steps 5, 6, 7 are skipped with a warning
    each, then (--max-skipped-steps 3) one error line names the checkpoint of step 4, which is
    left as it was; nothing is saved after it and the exit status is 2."""
    _nan_at(monkeypatch, set(range(5, 100)))
    out = tmp_path / "run"
    argv = ["train", "--data", str(corpus), "--out", str(out), "--context-length", "16", "--d-model", "16",
            "--n-heads", "2", "--n-blocks", "2", "--batch-size", "4", "--max-steps", "20", "--eval-interval", "4",
            "--eval-batches", "1", "--warmup-steps", "2", "--max-minutes", "0", "--max-skipped-steps", "3",
            "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(":")[:2] for line in err[:3]] == [["warning", f" step {s}"] for s in (5, 6, 7)]
    assert len(err) == 4 and err[3].startswith("error: the training loss is nan and 3 step(s) in a row were "
                                               "skipped (steps 5-7), so the run stopped; ")
    assert f"the checkpoint of step 4 in {out / 'latest'} is kept (the last good one)" in err[3]
    assert "Lower --lr or --grad-clip" in err[3]
    ckpt = load_checkpoint(out / "latest")
    assert ckpt.step == 4 and np.all(np.isfinite(ckpt.model.flat))
    assert max(x["step"] for x in read_log(out / "log.jsonl")) == 7
    assert not (out / "loss_curve.png").exists()


def test_a_non_finite_validation_loss_never_becomes_the_best(corpus, tmp_path, monkeypatch, caplog):
    """Validation at steps 2 and 4; the one at step 4 is made NaN: warned, logged as null, its
    checkpoint records val_loss null and best/ stays the finite one of step 2 (the run's end
    validates step 4 again, as it does whenever the last validation is not finite)."""
    caplog.set_level(logging.WARNING, logger="pedestrian")
    real, calls = loop_module.estimate_loss, [0]

    def estimate(*args):
        calls[0] += 1
        return math.nan if calls[0] == 2 else real(*args)

    monkeypatch.setattr(loop_module, "estimate_loss", estimate)
    out = tmp_path / "run"
    r = train(_settings(corpus, out, checkpoint_interval=1, max_steps=4))
    vals = [x["val_loss"] for x in read_log(out / "log.jsonl") if "val_loss" in x]
    assert vals[1] is None and all(v is not None for v in vals[:1] + vals[2:])
    assert any("step 4: the validation loss is nan" in x.getMessage() for x in caplog.records)
    assert load_checkpoint(out / "best").step == 2 and r.best_val_loss == vals[0]
    assert r.step == 4 and load_checkpoint(out / "latest").meta["val_loss"] is None


def test_no_checkpoint_is_written_with_a_non_finite_weight(corpus, tmp_path, monkeypatch):
    """A weight that turns NaN after step 3 (as an update out of range would make it): the
    checkpoint due at step 4 is not written; the error names the checkpoint of step 2."""
    real = loop_module.train_step

    def step(model, optimizer, *args, **kwargs):
        out = real(model, optimizer, *args, **kwargs)
        if optimizer.step_count == 3:
            optimizer.groups[0].params[5] = np.nan
        return out

    monkeypatch.setattr(loop_module, "train_step", step)
    out = tmp_path / "run"
    with pytest.raises(TrainingError) as info:
        train(_settings(corpus, out))
    assert str(info.value).startswith("refusing to save a checkpoint after step 4, a weight or an AdamW moment "
                                      "is not finite: tok_emb.weight (1 NaN, 0 inf of ")
    assert f"the checkpoint of step 2 in {out / 'latest'} is kept (the last good one)" in str(info.value)
    ckpt = load_checkpoint(out / "latest")
    assert ckpt.step == 2 and np.all(np.isfinite(ckpt.model.flat))


def test_interrupt_after_skipped_steps_saves_a_finite_checkpoint(corpus, tmp_path, monkeypatch):
    """A stop request during a streak of skipped steps: the state is the last good update's,
    finite, and it is saved."""
    real, calls = loop_module.train_step, [0]

    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 4:
            loop_module.request_stop("test")
        if calls[0] >= 3:
            return math.nan, math.nan
        return real(*args, **kwargs)

    monkeypatch.setattr(loop_module, "train_step", step)
    r = train(_settings(corpus, tmp_path / "run", eval_interval=100))
    assert r.stop_reason == "interrupted" and r.step == 4
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt.step == 4 and ckpt.meta["skipped_steps"] == 2 and ckpt.optimizer_state()["step"] == 2

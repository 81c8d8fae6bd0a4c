"""The training loop: end to end against torch autograd + torch.optim.AdamW, gradient
accumulation, evaluation, exact resume, the wall-clock budget, logs and the plot."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

from pedestrian.checkpoint import load_checkpoint
from pedestrian.config import GPTConfig
from pedestrian.model.layout import param_specs
from pedestrian.model import GPT
from pedestrian.training.optim import AdamW, CosineSchedule
from pedestrian.training import (TrainingError, TrainSettings, estimate_loss, evaluate_tokens, read_log, train,
                              train_step)
from gradcheck import (EPS64, RTOL_ROUNDING, adamw_rounding_bounds, flat_layout, gradient_rounding_err,
                       model_key_bias_bounds, norm_rounding_rel)
from torch_reference import reference_forward, reference_loss

TINY = dict(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_blocks=2)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_fifty_steps_match_torch_adamw_end_to_end():
    """50 float64 steps on fixed batches, warm-up + cosine, clipping and weight decay on: at
    every step, from the same state, the loss, the gradient norm and the update equal those of an
    identical PyTorch model trained with autograd, torch.optim.AdamW (decay only on the 2-D
    weights), clip_grad_norm_ and LambdaLR, to the rounding bounds of one step."""
    cfg = GPTConfig(**TINY, tie_weights=True)
    model = GPT(cfg, seed=3, dtype="float64")
    lr, wd, betas, eps, clip, steps = 3e-2, 0.1, (0.9, 0.95), 1e-8, 1.0, 50
    schedule = CosineSchedule(lr, warmup_steps=5, max_steps=steps, min_lr=3e-3)
    opt = AdamW(model, lr=lr, betas=betas, eps=eps, weight_decay=wd)

    ref_cfg = dict(cfg.to_dict())
    for k in ("dropout", "logits_bias"):
        ref_cfg.pop(k, None)
    tparams = {k: torch.tensor(v, dtype=torch.float64).requires_grad_() for k, v in model.state_dict().items()}
    decay = {s.name for s in param_specs(cfg) if s.decay}
    topt = torch.optim.AdamW([{"params": [p for k, p in tparams.items() if k in decay], "weight_decay": wd},
                              {"params": [p for k, p in tparams.items() if k not in decay], "weight_decay": 0.0}],
                             lr=lr, betas=betas, eps=eps, foreach=False)
    tsched = torch.optim.lr_scheduler.LambdaLR(topt, lambda it: schedule(it) / lr)

    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 11, (3, 8)), rng.integers(0, 11, (3, 8))) for _ in range(4)]
    names, n = list(tparams), model.flat.size
    theirs, clipped = [], 0
    for it in range(steps):
        x, y = batches[it % len(batches)]
        # every step starts both sides from one state (torch's, written into ours), so the bounds
        # follow from one step's arithmetic rather than from how 50 steps amplify rounding
        for k, p in tparams.items():
            model.params[k][...] = p.detach().numpy()
        st = [topt.state.get(p, {}) for p in tparams.values()]
        t0 = int(st[0]["step"]) if st[0] else 0
        m0, v0 = (flat_layout(model, {k: s[key].numpy() if s else 0.0 for k, s in zip(names, st)})[0]
                  for key in ("exp_avg", "exp_avg_sq"))
        opt.load_state_dict({"step": t0, "base.m": m0, "base.v": v0})
        start = model.flat.copy()
        model.loss(x, y)                        # this step's gradient, to bound autograd's
        model.backward(keep_deltas=True)
        delta = flat_layout(model, gradient_rounding_err(model, model_key_bias_bounds(model)))[0]

        loss, norm = train_step(model, opt, [(x, y)], schedule(it), grad_clip=clip)
        clipped += norm > clip
        applied = opt.groups[0].grads.copy()
        topt.zero_grad()
        tloss = reference_loss(reference_forward(tparams, ref_cfg, x), y)
        tloss.backward()
        tnorm = float(torch.nn.utils.clip_grad_norm_(list(tparams.values()), clip))
        topt.step()
        tsched.step()
        theirs.append(float(tloss.detach()))

        # the same mathematics in other orders (gradcheck: RTOL_ROUNDING); the loss is a mean of
        # positive terms; torch's norm is the norm of per-tensor norms (2 more operations each)
        assert abs(loss - theirs[-1]) <= RTOL_ROUNDING * theirs[-1]
        norm_rel = norm_rounding_rel(n + 2 * len(names))
        assert abs(norm - tnorm) <= np.linalg.norm(delta) + norm_rel * tnorm
        coef = min(1.0, clip / (norm + 1e-6))
        bound = adamw_rounding_bounds(start, [applied], [schedule(it)], betas=betas, eps=eps, weight_decay=wd,
                                      n_decay=opt.groups[0].n_decay, m0=m0, v0=v0, t0=t0,
                                      g_rel=np.linalg.norm(delta) / norm + norm_rel + 3 * EPS64,
                                      g_err=[delta * coef])["params"]
        after = flat_layout(model, {k: p.detach().numpy() for k, p in tparams.items()})[0]
        assert np.all(np.abs(model.flat - after) <= bound), (it, np.max(np.abs(model.flat - after) / bound))
    assert 0 < clipped < steps                   # both branches of the clipping were exercised
    assert theirs[-1] < theirs[0] - 0.3          # it actually trained


def test_gradient_accumulation_equals_one_big_batch():
    """k micro-batches of B windows give the same update as one batch of k·B windows.

    Each step starts both sides from the same state (parameters, moments, step count), so the
    bounds follow from one step's arithmetic: the same gradient summed in other orders
    (``gradcheck.gradient_rounding_err``, the key bias's noise by its own bound), then AdamW's
    sensitivity to that difference (``gradcheck.adamw_rounding_bounds``). Three steps: moments
    and bias corrections away from their start, and every micro-batch seeing the new weights."""
    cfg = GPTConfig(**TINY)
    rng = np.random.default_rng(1)
    x = rng.integers(0, 11, (6, 8))
    y = rng.integers(0, 11, (6, 8))
    big, small = GPT(cfg, seed=0, dtype="float64"), GPT(cfg, seed=0, dtype="float64")
    ob, os_ = AdamW(big, lr=1e-2, weight_decay=0.1), AdamW(small, lr=1e-2, weight_decay=0.1)
    clip, n = 0.3, big.flat.size
    for _step in range(3):
        small.flat[...] = big.flat                             # the same state on both sides
        os_.load_state_dict(ob.state_dict())
        state, start = ob.state_dict(), big.flat.copy()
        big.loss(x, y)                                         # this step's gradient, to bound the other's
        big.backward(keep_deltas=True)
        delta = flat_layout(big, gradient_rounding_err(big, model_key_bias_bounds(big)))[0]
        lb, nb = train_step(big, ob, [(x, y)], 1e-2, grad_clip=clip)
        ls, ns = train_step(small, os_, [(x[:2], y[:2]), (x[2:4], y[2:4]), (x[4:], y[4:])], 1e-2, grad_clip=clip)
        # the mean of the same 48 positive token losses, computed and summed in other orders
        assert abs(ls - lb) <= RTOL_ROUNDING * lb
        assert abs(ns - nb) <= np.linalg.norm(delta) + norm_rounding_rel(n) * nb
        coef = clip / (nb + 1e-6)
        assert coef < 1.0                                      # clipped: its rounding reaches the update
        g_rel = np.linalg.norm(delta) / nb + norm_rounding_rel(n) + 3 * EPS64   # each side's clip factor
        bound = adamw_rounding_bounds(start, [ob.groups[0].grads], [1e-2], betas=ob.betas, eps=ob.eps,
                                      weight_decay=0.1, n_decay=ob.groups[0].n_decay, g_rel=g_rel,
                                      g_err=[delta * coef], m0=state["base.m"], v0=state["base.v"],
                                      t0=state["step"])["params"]
        assert np.all(np.abs(small.flat - big.flat) <= bound), np.max(np.abs(small.flat - big.flat) / bound)
    assert not np.array_equal(big.flat, GPT(cfg, seed=0, dtype="float64").flat)


def test_evaluate_tokens_counts_every_target_once():
    cfg = GPTConfig(**TINY)
    model = GPT(cfg, seed=0, dtype="float64")
    tokens = np.random.default_rng(2).integers(0, 11, 8 * 5 + 4).astype(np.uint16)  # 44 tokens
    loss, n = evaluate_tokens(model, tokens, batch_size=2)
    assert n == len(tokens) - 1
    # the same windows one by one, summed by hand
    total = 0.0
    for s in range(0, 40, 8):
        w = tokens[s:s + 9].astype(np.int64)
        total += model.loss(w[None, :-1], w[None, 1:]) * 8
    w = tokens[40:].astype(np.int64)
    total += model.loss(w[None, :-1], w[None, 1:]) * 3
    assert loss == pytest.approx(total / 43, rel=1e-12)
    assert model.training  # restored


def test_evaluate_tokens_keeps_no_activations_and_bounds_each_forwards_logits(monkeypatch):
    """``pedestrian eval`` of a SmolLM2-shaped folder (context 2,048, vocabulary 49,152) was
    killed for memory at the default 32 windows: every activation kept as for a backward, and
    32 windows of logits (13 GB) in one forward. The forward now keeps nothing, and a batch
    whose logits pass ``EVAL_LOGITS_BYTES`` runs as several forwards -- the same loss (the same
    windows; the sum of per-forward means times their counts, float64 rounding apart)."""
    from pedestrian.training import corpus

    cfg = GPTConfig(**TINY)
    model = GPT(cfg, seed=0, dtype="float64")
    tokens = np.random.default_rng(2).integers(0, 11, 8 * 5 + 4).astype(np.uint16)
    whole, n = evaluate_tokens(model, tokens, batch_size=4)
    with pytest.raises(ValueError, match="keep_activations=False"):
        model.activations()                                  # nothing was kept
    sizes = []
    real = model.loss
    monkeypatch.setattr(model, "loss", lambda x, y, **kw: sizes.append(x.shape[0]) or real(x, y, **kw))
    monkeypatch.setattr(corpus, "EVAL_LOGITS_BYTES", 2 * 8 * 11 * 8)     # two windows' float64 logits
    split, n2 = evaluate_tokens(model, tokens, batch_size=4)
    assert sizes == [2, 2, 1, 1] and n2 == n == 43               # 5 windows in batches of 4, then the rest
    assert split == pytest.approx(whole, rel=1e-12)


def test_estimate_loss_turns_dropout_off():
    model = GPT(GPTConfig(**TINY, dropout=0.5), seed=0, dtype="float64")
    x = np.zeros((2, 8), dtype=np.int64)
    a = estimate_loss(model, [(x, x)])
    b = estimate_loss(model, [(x, x)])
    assert a == b and model.training


# ------------------------------------------------------------------------------------ train()
@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler"]
    text = "\n".join(" ".join(rng.choice(words, 9)) for _ in range(300))
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return path


def _settings(corpus, out, **kw):
    base = dict(data=str(corpus), out=str(out), model=dict(context_length=16, d_model=16, n_heads=2, n_blocks=2),
                batch_size=4, max_steps=6, warmup_steps=2, lr=1e-2, min_lr=1e-3, eval_interval=2,
                eval_batches=2, max_minutes=None, progress=False, plot=False)
    base.update(kw)
    return TrainSettings(**base)


def _train_losses(out):
    return {r["step"]: r["loss"] for r in read_log(out / "log.jsonl") if "loss" in r}


@pytest.mark.parametrize("dtype, old_layout", [("float64", False), ("float32", False), ("float32", True)])
def test_resume_is_exact(corpus, tmp_path, dtype, old_layout):
    """2N steps in one run == N steps, stop, resume, N steps: the same loss at every step, bit
    for bit, with dropout and gradient accumulation on (data RNG, dropout RNG, moments restored).
    ``old_layout``: the checkpoint resumed from repeats AdamW's hyper-parameters in state.json's
    "optimizer", as checkpoints did before the settings held them alone: it resumes the same."""
    model = dict(context_length=16, d_model=16, n_heads=2, n_blocks=2, dropout=0.1)
    common = dict(dtype=dtype, grad_accum=2, model=model, checkpoint_interval=4)
    one = _settings(corpus, tmp_path / "one", **common)
    train(one)
    two = _settings(corpus, tmp_path / "two", stop_step=3, **common)
    r = train(two)
    assert r.step == 3 and r.stop_reason == "stop_step"
    state_file = tmp_path / "two" / "latest" / "state.json"
    state = json.loads(state_file.read_text())
    assert set(state["optimizer"]) == {"step", "groups", "layout"}          # each value stored once
    if old_layout:
        state["optimizer"].update(lr=1e-2, betas=[0.9, 0.99], eps=1e-8, weight_decay=0.1)
        state_file.write_text(json.dumps(state))
    resumed = _settings(corpus, tmp_path / "two", **common)
    r = train(resumed, resume=True, explicit={"out"})
    assert r.step == 6
    a, b = _train_losses(tmp_path / "one"), _train_losses(tmp_path / "two")
    assert list(a) == list(b) == [1, 2, 3, 4, 5, 6]
    assert a == b                                     # exact float equality (JSON round-trips floats)
    ca, cb = load_checkpoint(tmp_path / "one"), load_checkpoint(tmp_path / "two")
    for k, v in ca.model.params.items():
        np.testing.assert_array_equal(v, cb.model.params[k])
    oa, ob = ca.optimizer_state(), cb.optimizer_state()
    assert oa["step"] == ob["step"] == 6
    np.testing.assert_array_equal(oa["base.v"], ob["base.v"])
    assert ca.model.dropout_rng.bit_generator.state == cb.model.dropout_rng.bit_generator.state


def test_resume_with_another_thread_count(corpus, tmp_path, monkeypatch, caplog):
    """N + N steps equal 2N bit for bit at one thread count; resumed with another the run goes on
    (same batches, same dropout masks) equal up to the order of float additions; the plan says
    how many threads run."""
    caplog.set_level(logging.INFO, logger="pedestrian")
    monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", "2")
    model = dict(context_length=16, d_model=16, n_heads=2, n_blocks=2, dropout=0.1)
    common = dict(model=model, checkpoint_interval=3)
    train(_settings(corpus, tmp_path / "one", **common))
    assert any("threads: 2 (the fast kernels' numba threads" in r.getMessage() for r in caplog.records)
    train(_settings(corpus, tmp_path / "two", stop_step=3, **common))
    train(_settings(corpus, tmp_path / "two", **common), resume=True, explicit={"out"})
    assert _train_losses(tmp_path / "one") == _train_losses(tmp_path / "two")
    monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", "1")
    train(_settings(corpus, tmp_path / "three", stop_step=3, **common))
    monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", "2")
    r = train(_settings(corpus, tmp_path / "three", **common), resume=True, explicit={"out"})
    assert r.step == 6
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # float32 sums in another order: ~1e-7 relative per step, over 6 AdamW steps of a 3-nat loss
    a, c = _train_losses(tmp_path / "one"), _train_losses(tmp_path / "three")
    assert a.keys() == c.keys()
    assert max(abs(a[s] - c[s]) / a[s] for s in a) <= 1e-5


def test_a_checkpoint_of_an_earlier_version_with_data_parallel_still_loads(corpus, tmp_path):
    """``data_parallel`` (the batch split over threads, retired) in a checkpoint's settings is read
    and ignored; any other unknown setting is still refused."""
    s = _settings(corpus, tmp_path / "a").to_dict()
    assert TrainSettings.from_dict({**s, "data_parallel": "auto"}) == TrainSettings.from_dict(s)
    with pytest.raises(TrainingError, match="unknown training setting"):
        TrainSettings.from_dict({**s, "data_paralel": "auto"})


def test_a_closed_stdout_stops_the_run_like_ctrl_c(corpus, tmp_path, monkeypatch):
    """`pedestrian train | head`: the first message that cannot be written (the CLI's console
    handler gets BrokenPipeError) stops the run between steps, with a checkpoint, as an
    interrupt would; stdout is pointed at /dev/null for the rest."""
    import io

    from pedestrian import cli

    silenced = []
    monkeypatch.setattr(cli, "silence_stdout", lambda: silenced.append(True))

    class ClosingPipe(io.StringIO):          # a reader that has gone away when "step 2: ..." comes
        def write(self, text):
            if text.startswith("step 2:"):
                raise BrokenPipeError(32, "Broken pipe")
            return super().write(text)

    pipe = ClosingPipe()
    monkeypatch.setattr("sys.stdout", pipe)
    with cli.console_logging():
        r = train(_settings(corpus, tmp_path / "a"))
    assert r.stop_reason == "interrupted" and r.step == 2
    assert load_checkpoint(tmp_path / "a" / "latest").step == 2
    lines = pipe.getvalue().splitlines()               # (the fake pipe still takes later lines)
    assert silenced == [True] and lines[-2].startswith("threads: ")
    assert lines[-1].startswith("interrupted (stdout closed) after step 2: checkpoint saved")
    r = train(_settings(corpus, tmp_path / "b"))          # the request ended with that run
    assert r.stop_reason == "max_steps"


def _signal_at(monkeypatch, n: int, sig):
    """Make the n-th call of train_step deliver ``sig`` to this process while it runs (a real
    Ctrl-C / SIGTERM arriving mid-step)."""
    import os

    import pedestrian.training.loop as loop_module

    real, calls = loop_module.train_step, [0]

    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), sig)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop_module, "train_step", step)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_interrupt_saves_a_checkpoint_and_resume_is_exact(corpus, tmp_path, monkeypatch, sig):
    """A signal in the middle of step 5 lets step 5 finish, saves a checkpoint of step 5 (not on
    the eval/checkpoint grid) and stops; resuming gives the uninterrupted run's losses bit for bit."""
    import signal

    common = dict(max_steps=8, grad_accum=2, eval_interval=3,
                  model=dict(context_length=16, d_model=16, n_heads=2, n_blocks=2, dropout=0.1))
    train(_settings(corpus, tmp_path / "one", **common))
    before = signal.getsignal(signal.SIGINT)
    with monkeypatch.context() as m:
        _signal_at(m, 5, getattr(signal, sig))
        r = train(_settings(corpus, tmp_path / "two", **common))
    assert r.stop_reason == "interrupted" and r.step == 5
    assert signal.getsignal(signal.SIGINT) is before                 # handlers restored
    assert load_checkpoint(tmp_path / "two").step == 5
    r = train(_settings(corpus, tmp_path / "two", **common), resume=True, explicit={"out"})
    assert r.step == 8
    a, b = _train_losses(tmp_path / "one"), _train_losses(tmp_path / "two")
    assert list(a) == list(b) == list(range(1, 9)) and a == b
    ca, cb = load_checkpoint(tmp_path / "one"), load_checkpoint(tmp_path / "two")
    for k, v in ca.model.params.items():
        np.testing.assert_array_equal(v, cb.model.params[k])


def test_non_finite_loss_without_a_checkpoint_says_so(corpus, tmp_path, monkeypatch):
    import pedestrian.training.loop as loop_module

    monkeypatch.setattr(loop_module, "train_step", lambda *a, **k: (float("nan"), 0.0))
    with pytest.raises(TrainingError, match=r"the training loss is nan and 5 step\(s\) in a row were skipped "
                                            r"\(steps 1-5\), so the run stopped; no checkpoint was written"):
        train(_settings(corpus, tmp_path / "run", max_steps=20, eval_interval=10))
    assert not (tmp_path / "run" / "latest").exists()


def test_run_writes_log_checkpoints_and_plot(corpus, tmp_path):
    s = _settings(corpus, tmp_path / "run", max_steps=40, plot=True, eval_interval=10, lr=3e-2)
    r = train(s)
    out = tmp_path / "run"
    records = read_log(out / "log.jsonl")
    steps = [x for x in records if "loss" in x]
    vals = [x for x in records if "val_loss" in x]
    assert [x["step"] for x in steps] == list(range(1, 41))
    assert [x["step"] for x in vals] == [10, 20, 30, 40]
    assert {"lr", "grad_norm", "tokens_per_s", "time_s"} <= set(steps[0])
    assert steps[0]["lr"] == pytest.approx(3e-2 / 2)       # first warm-up step: non-zero
    assert r.val_loss == vals[-1]["val_loss"] and r.val_loss < vals[0]["val_loss"] < math.log(len(set(corpus.read_text())))
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    best = load_checkpoint(out / "best")
    assert best.meta["val_loss"] == min(v["val_loss"] for v in vals)
    latest = load_checkpoint(out)
    assert latest.step == 40 and latest.meta["settings"]["max_steps"] == 40


def test_throughput_leaves_out_the_first_step(corpus, tmp_path, monkeypatch):
    """The reported tokens/s is that of the steps after the first, whose time on a first run holds
    the kernels' compile: a first step made 2 s slower leaves it above 3× the all-steps mean
    (6 steps of 64 tokens; the mean over the whole run would be below 192 tokens/s)."""
    import time

    import pedestrian.training.loop as loop_module

    real, calls = loop_module.train_step, [0]

    def slow_first(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            time.sleep(2.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop_module, "train_step", slow_first)
    t0 = time.perf_counter()
    r = train(_settings(corpus, tmp_path / "run", eval_interval=100))
    whole = 6 * 4 * 16 / (time.perf_counter() - t0)
    assert r.step == 6 and r.tokens_per_second > 3 * whole, (r.tokens_per_second, whole)


def test_max_minutes_stops_gracefully(corpus, tmp_path):
    s = _settings(corpus, tmp_path / "run", max_steps=10_000, max_minutes=0.02, plot=True, eval_interval=5)
    r = train(s)
    assert r.stop_reason == "max_minutes"
    assert 0 < r.step < 10_000
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt.step == r.step and math.isfinite(ckpt.meta["val_loss"])
    assert (tmp_path / "run" / "loss_curve.png").is_file()
    assert r.seconds < 0.02 * 60 + 10


def test_torch_backend_trains(corpus, tmp_path):
    s = _settings(corpus, tmp_path / "t", backend="torch", dtype="float64", max_steps=4)
    n = _settings(corpus, tmp_path / "n", dtype="float64", max_steps=4)
    train(s)
    train(n)
    a, b = _train_losses(tmp_path / "t"), _train_losses(tmp_path / "n")
    np.testing.assert_allclose(list(a.values()), list(b.values()), rtol=1e-10)
    assert json.loads((tmp_path / "t" / "latest" / "state.json").read_text())["step"] == 4

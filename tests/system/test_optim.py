"""The hand-written AdamW, schedule and clipping against torch.optim / torch.nn.utils (the oracle)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from gradcheck import EPS64, adamw_rounding_bounds, norm_rounding_rel
from pedestrian.config import GPTConfig
from pedestrian.model import GPT
from pedestrian.training.optim import AdamW, CosineSchedule, ParamGroup, clip_grad_norm, global_grad_norm, param_groups


pytestmark = pytest.mark.usefixtures("one_torch_thread")



def _groups(rng, sizes=((37, 20), (11, 0)), dtype=np.float64):
    """Flat groups ``(n, n_decay)`` with random parameters (gradients filled per step)."""
    return [ParamGroup(f"g{i}", rng.standard_normal(n).astype(dtype), np.zeros(n, dtype), n_decay)
            for i, (n, n_decay) in enumerate(sizes)]


def test_adamw_matches_torch_adamw_every_step():
    """Several steps, varying lr, decay on the first n_decay entries only: torch.optim.AdamW
    with two parameter groups (weight_decay wd / 0) gives the same parameters."""
    rng = np.random.default_rng(0)
    groups = _groups(rng)
    wd, betas, eps = 0.3, (0.8, 0.95), 1e-6
    ours = AdamW(groups, lr=0.1, betas=betas, eps=eps, weight_decay=wd, chunk_size=8)
    tparams = []
    for g in groups:
        tparams += [torch.tensor(g.params[:g.n_decay]).requires_grad_(), torch.tensor(g.params[g.n_decay:]).requires_grad_()]
    ref = torch.optim.AdamW([{"params": tparams[0::2], "weight_decay": wd},
                             {"params": tparams[1::2], "weight_decay": 0.0}],
                            lr=0.1, betas=betas, eps=eps, foreach=False)
    start = [g.params.copy() for g in groups]
    history = [[] for _ in groups]                 # the gradients of every step, per group
    lrs = []
    for step in range(6):
        lr = 0.1 * (0.5 + step / 7)
        lrs.append(lr)
        for g, (td, tn), h in zip(groups, zip(tparams[0::2], tparams[1::2]), history):
            g.grads[...] = rng.standard_normal(g.grads.shape) * (10.0 ** (step % 3 - 1))
            h.append(g.grads.copy())
            td.grad = torch.tensor(g.grads[:g.n_decay])
            tn.grad = torch.tensor(g.grads[g.n_decay:])
        for pg in ref.param_groups:
            pg["lr"] = lr
        ref.step()
        ours.step(lr)
        # the same update, rounded differently (torch: lerp_, addcmul_, addcdiv_, its own
        # order of the bias corrections): a few ε of each entry's absolute terms per step
        for g, (td, tn), p0, h in zip(groups, zip(tparams[0::2], tparams[1::2]), start, history):
            expect = np.concatenate([td.detach().numpy(), tn.detach().numpy()])
            bound = adamw_rounding_bounds(p0, h, lrs, betas=betas, eps=eps, weight_decay=wd,
                                          n_decay=g.n_decay)["params"]
            assert np.all(np.abs(g.params - expect) <= bound), np.max(np.abs(g.params - expect) / bound)
            assert np.max(bound) < 1e-12             # tight: a wrong ε or bias correction errs by > 1e-9
    assert ours.step_count == 6


def test_weight_decay_only_on_the_decayed_region():
    """With zero gradients the Adam term is exactly 0: decayed entries shrink by (1 - lr·wd),
    the others (biases, layer norms) do not move at all."""
    model = GPT(GPTConfig(vocab_size=7, context_length=4, d_model=8, n_heads=2, n_blocks=1), dtype="float64")
    opt = AdamW(model, lr=0.01, weight_decay=0.5)
    before = model.flat.copy()
    base = model.trainable_buffers()[0]
    base.grads[...] = 0.0
    opt.step()
    n = base.n_decay
    np.testing.assert_array_equal(model.flat[:n], before[:n] * (1 - 0.01 * 0.5))
    np.testing.assert_array_equal(model.flat[n:], before[n:])
    # the decayed region is exactly the 2-D weights of param_specs (embeddings included)
    decayed = {name for name, view in model.params.items() if view.ndim == 2}
    assert sum(model.params[k].size for k in decayed) == n


def test_chunk_size_does_not_change_the_result():
    rng = np.random.default_rng(1)
    a, b = _groups(rng), None
    b = [ParamGroup(g.name, g.params.copy(), g.grads, g.n_decay) for g in a]
    oa = AdamW(a, lr=0.05, weight_decay=0.1, chunk_size=3)
    ob = AdamW(b, lr=0.05, weight_decay=0.1, chunk_size=1 << 16)
    for _ in range(3):
        for g in a:
            g.grads[...] = rng.standard_normal(g.grads.shape)
        oa.step()
        ob.step()
    for ga, gb in zip(a, b):
        np.testing.assert_array_equal(ga.params, gb.params)


def test_torch_backend_matches_numpy_backend():
    """The two backends run the same update with different operations (NumPy: 14 separate
    passes; torch: lerp_, addcmul_, addcdiv_, fused with FMA on some CPUs) and compute the
    clipping norm with different dot products: they agree to the rounding bound of
    :func:`gradcheck.adamw_rounding_bounds` per entry (an AVX-512 machine once showed a moment
    1.4e-14 apart relative to itself, where ``m`` had nearly cancelled: a bound relative to ``m``
    alone is not one that holds on every CPU)."""
    rng = np.random.default_rng(2)
    np_groups = _groups(rng)
    t_groups = [ParamGroup(g.name, torch.tensor(g.params), torch.zeros(len(g.params), dtype=torch.float64),
                           g.n_decay) for g in np_groups]
    start = [g.params.copy() for g in np_groups]
    history = [[] for _ in np_groups]
    on = AdamW(np_groups, lr=0.02, weight_decay=0.2, chunk_size=16)
    ot = AdamW(t_groups, lr=0.02, weight_decay=0.2, chunk_size=16)
    n = sum(len(g.params) for g in np_groups)
    norm_rel = norm_rounding_rel(n)                   # the two dot products' orders
    for _ in range(4):
        for gn, gt in zip(np_groups, t_groups):
            gn.grads[...] = rng.standard_normal(gn.grads.shape)
            gt.grads.copy_(torch.tensor(gn.grads))
        norm_np, norm_t = clip_grad_norm(np_groups, 1.5), clip_grad_norm(t_groups, 1.5)
        assert norm_np > 1.5                          # clipped: the norm's rounding reaches g
        assert abs(norm_np - norm_t) <= norm_rel * norm_t
        for gn, h in zip(np_groups, history):
            h.append(gn.grads.copy())
        on.step()
        ot.step()
    # each side's clipped gradient: its norm's rounding, then + 1e-6, ÷ and × (3 operations)
    g_rel = norm_rel + 3 * EPS64
    sn, st = on.state_dict(), ot.state_dict()
    for gn, gt, p0, h in zip(np_groups, t_groups, start, history):
        bounds = adamw_rounding_bounds(p0, h, [0.02] * 4, betas=on.betas, eps=on.eps, weight_decay=0.2,
                                       n_decay=gn.n_decay, g_rel=g_rel)
        assert np.max(bounds["params"]) < 1e-12        # tight: any real difference is far larger
        assert np.all(np.abs(gn.params - gt.params.numpy()) <= bounds["params"]), gn.name
        for k in "mv":
            diff = np.abs(sn[f"{gn.name}.{k}"] - st[f"{gn.name}.{k}"])
            assert np.all(diff <= bounds[k]), (gn.name, k, np.max(diff / bounds[k]))


def test_clip_grad_norm_matches_torch():
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(13) * 3, rng.standard_normal(5)]
    tensors = [torch.tensor(a.copy()).requires_grad_() for a in arrays]
    for t, a in zip(tensors, arrays):
        t.grad = torch.tensor(a.copy())
    expect = float(torch.nn.utils.clip_grad_norm_(tensors, 2.0))
    norm = clip_grad_norm(arrays, 2.0)
    # torch: a norm per tensor, then the norm of the norms (2 more operations per tensor); ours:
    # one dot per array, then one sum -- the same 18 squares summed in other orders
    norm_rel = norm_rounding_rel(18 + 2 * 2)
    assert norm == pytest.approx(expect, rel=norm_rel, abs=0)
    assert norm > 2.0  # the clipping branch ran
    for t, a in zip(tensors, arrays):
        # coef = 2 / (norm + 1e-6), then g·coef: 3 operations on each side
        np.testing.assert_allclose(a, t.grad.numpy(), rtol=norm_rel + 6 * EPS64, atol=0)
    assert global_grad_norm(arrays) == pytest.approx(2.0, rel=1e-6)
    # below the threshold nothing changes, bit for bit
    small = [a * 0.1 for a in arrays]
    copies = [s.copy() for s in small]
    clip_grad_norm(small, 2.0)
    for s, c in zip(small, copies):
        np.testing.assert_array_equal(s, c)
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm(arrays, 0.0)


def test_schedule_warmup_then_cosine():
    s = CosineSchedule(max_lr=1e-3, warmup_steps=10, max_steps=110, min_lr=1e-4)
    assert s(0) == pytest.approx(1e-4)                  # the first update already moves
    assert s(0) > 0
    assert s(9) == pytest.approx(1e-3)                  # end of warm-up reaches the peak
    assert [s(i) for i in range(10)] == sorted(s(i) for i in range(10))
    assert s(10) == pytest.approx(1e-3)
    assert s(60) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))  # half-way down the cosine
    assert s(110) == s(500) == 1e-4
    cos_part = [s(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(cos_part, cos_part[1:]))
    assert CosineSchedule(1.0, 0, 5)(0) == 1.0          # no warm-up


def test_schedule_matches_torch_lambdalr():
    """The same schedule driven through torch's LambdaLR (update index = scheduler epoch)."""
    s = CosineSchedule(max_lr=0.5, warmup_steps=3, max_steps=12, min_lr=0.05)
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: s(it) / 0.5)
    for it in range(15):
        # LambdaLR: 0.5 · (s(it) / 0.5) -- dividing and multiplying by a power of two is exact
        assert opt.param_groups[0]["lr"] == s(it)
        opt.step()
        sched.step()


def test_state_dict_round_trip_and_mismatch():
    rng = np.random.default_rng(4)
    groups = _groups(rng)
    opt = AdamW(groups, lr=0.01)
    for g in groups:
        g.grads[...] = 1.0
    opt.step()
    state = opt.state_dict()
    fresh = AdamW(_groups(rng), lr=0.01)
    fresh.load_state_dict(state)
    assert fresh.step_count == 1
    for k in ("g0.m", "g0.v", "g1.m", "g1.v"):
        np.testing.assert_array_equal(fresh.state_dict()[k], state[k])
    other = AdamW(_groups(rng, sizes=((30, 10), (11, 0))), lr=0.01)
    with pytest.raises(ValueError, match="does not match"):
        other.load_state_dict(state)
    assert other.step_count == 0


def test_state_dict_with_a_non_finite_moment_is_refused_and_loads_nothing():
    """A NaN or inf moment would make every later update NaN: refused, named as the other loaders
    name it (pedestrian.model.finite), the optimizer unchanged."""
    rng = np.random.default_rng(6)
    opt = AdamW(_groups(rng), lr=0.01)
    for g in opt.groups:
        g.grads[...] = 1.0
    opt.step()
    state = opt.state_dict()
    state["g1.v"] = state["g1.v"].copy()
    state["g1.v"].reshape(-1)[:2] = [np.nan, np.inf]
    fresh = AdamW(_groups(rng), lr=0.01)
    with pytest.raises(ValueError, match=r"g1\.v \(1 NaN, 1 inf of \d+ values\); nothing was loaded"):
        fresh.load_state_dict(state)
    assert fresh.step_count == 0 and all(not np.any(m) for m in fresh.m)


def test_param_groups_follow_lora_freezing():
    model = GPT(GPTConfig(vocab_size=7, context_length=4, d_model=8, n_heads=2, n_blocks=1))
    assert [g.name for g in param_groups(model)] == ["base"]
    model.add_lora("all", rank=2, freeze_base=True)
    assert [g.name for g in param_groups(model)] == ["lora"]
    model.freeze_base = False
    assert [g.name for g in param_groups(model)] == ["base", "lora"]


@pytest.mark.parametrize("cls", ["train", "finetune"])
def test_bad_hyper_parameters_are_refused_where_they_are_declared(cls):
    """AdamW's and the schedule's values are checked once, by the settings that declare them
    (pedestrian.training.specs), with the flag's name; AdamW and CosineSchedule take them as given."""
    from pedestrian.training import TrainSettings
    from pedestrian.training.finetune import FinetuneSettings
    from pedestrian.training.specs import check

    make = TrainSettings if cls == "train" else lambda **kw: FinetuneSettings(hf_dir="h", data="d", **kw)
    for kw, message in ((dict(lr=0), "--lr must be a finite number > 0, got 0"),
                        (dict(lr=math.inf), "--lr must be a finite number > 0, got inf"),
                        (dict(beta1=1.0), "--beta1 must be in [0, 1), got 1.0"),
                        (dict(beta2=-0.1), "--beta2 must be in [0, 1), got -0.1"),
                        (dict(weight_decay=-0.1), "--weight-decay must be a finite number >= 0, got -0.1"),
                        (dict(lr=1e-3, min_lr=2e-3), "--min-lr must be in [0, lr=0.001], got 0.002"),
                        (dict(warmup_steps=-1), "--warmup-steps must be an integer >= 0, got -1"),
                        (dict(max_steps=0), "--max-steps must be a positive integer, got 0")):
        with pytest.raises(ValueError, match=re.escape(message)):
            check(make(**kw))
    if cls == "train":
        with pytest.raises(ValueError, match=re.escape("--eps must be a finite number > 0, got 0")):
            check(make(eps=0))
    assert math.isclose(AdamW(_groups(np.random.default_rng(5))).lr, 1e-3)

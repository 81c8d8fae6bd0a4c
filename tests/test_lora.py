"""LoRA (paper section 6): adapter gradients vs autograd, frozen base, merge / unmerge,
parameter counts, adapter-only checkpoints, and the cost of a frozen-base step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_reference import default_cfg, fc_layer_names, random_params, reference_loss_and_grads

from pedestrian.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from pedestrian.config import GPTConfig, count_params, fc_layers, lora_specs, preset
from pedestrian.layers.linear import linear_backward, linear_forward
from pedestrian.layers.lora import lora_backward, lora_forward
from pedestrian.model import GPT
from pedestrian.optim import AdamW
from pedestrian.train import train_step

ALPHA = 0.75                      # not 1, so a missing α factor shows


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


# ------------------------------------------------------------------------------------ gradients
def test_lora_layer_gradients_and_input_signal_match_autograd():
    """One FC layer with an adapter, y = x W + b + α x D U: dD, dU and Δ_in vs autograd."""
    rng = np.random.default_rng(0)
    B, T, f_in, f_out, r = 3, 5, 7, 6, 2
    x, W, b = rng.normal(size=(B, T, f_in)), rng.normal(size=(f_in, f_out)), rng.normal(size=f_out)
    D, U = rng.normal(size=(f_in, r)), rng.normal(size=(r, f_out))
    delta = rng.normal(size=(B, T, f_out))
    y_base, _ = linear_forward(x, W, b)
    y_lora, cache = lora_forward(x, D, U, ALPHA)
    d_in_base = linear_backward(delta, x, W)
    dD, dU = np.empty_like(D), np.empty_like(U)
    d_in_lora = lora_backward(delta, cache, D, U, ALPHA, dD=dD, dU=dU)

    xt, Dt, Ut = (torch.tensor(a, requires_grad=True) for a in (x, D, U))
    yt = xt @ torch.tensor(W) + torch.tensor(b) + ALPHA * (xt @ Dt) @ Ut
    (yt * torch.tensor(delta)).sum().backward()
    assert rel(y_base + y_lora, yt.detach().numpy()) <= 1e-12
    assert rel(dD, Dt.grad.numpy()) <= 1e-9
    assert rel(dU, Ut.grad.numpy()) <= 1e-9
    assert rel(d_in_base + d_in_lora, xt.grad.numpy()) <= 1e-9


@pytest.mark.parametrize("tie", [True, False])
def test_model_adapter_gradients_and_input_signals_match_autograd(build_model, token_batch, tie):
    """Adapters on every kind of FC layer, base frozen: every dD, dU and every error signal
    Δ1 … Δ12 of the whole GPT vs autograd of the PyTorch reference (float64)."""
    cfg = default_cfg(tie_weights=tie)
    lora = {"targets": fc_layer_names(cfg), "rank": 3}
    params = random_params(cfg, seed=4, lora=lora)
    model = build_model(cfg, params, lora=lora, lora_alpha=ALPHA, freeze_base=True)
    x, y = token_batch(cfg, 3, cfg["context_length"], n_ignored=2)
    loss = model.loss(x, y)
    grads = model.backward(keep_deltas=True)
    ref_loss, _, ref_grads, ref_deltas = reference_loss_and_grads(params, cfg, x, y, lora_alpha=ALPHA)
    assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
    assert set(grads) == {k for k in params if ".lora_" in k}
    for k, g in grads.items():
        assert rel(g, ref_grads[k]) <= 1e-9, k
    deltas = model.deltas()
    for k, d in ref_deltas.items():
        assert rel(deltas[k], d) <= 1e-9, k


def test_frozen_base_gets_no_gradient_and_does_not_move():
    cfg = GPTConfig(vocab_size=50, context_length=16, d_model=16, n_heads=2, n_blocks=2)
    model = GPT(cfg, seed=1)
    model.add_lora(["q", "v", "mlp_expand", "logits"], rank=4, alpha=2.0)
    base_before = {k: v.copy() for k, v in model.params.items() if ".lora_" not in k}
    lora_before = {k: v.copy() for k, v in model.lora_state_dict().items()}
    opt = AdamW(model, lr=1e-2)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.integers(0, 50, (2, 17))
        train_step(model, opt, [(x[:, :-1], x[:, 1:])], lr=1e-2)
    assert model._grad_base is None                       # base gradients never even allocated
    assert [g.name for g in opt.groups] == ["lora"]
    assert set(model.grads) == set(lora_before)
    for k, v in base_before.items():
        np.testing.assert_array_equal(model.params[k], v)
    moved = [k for k, v in lora_before.items() if not np.array_equal(model.params[k], v)]
    assert sorted(moved) == sorted(lora_before)             # D and U both train (U starts at 0)
    assert model.num_params(trainable_only=True) == sum(s.size for s in lora_specs(cfg, model.lora_targets, 4))


def test_new_adapter_is_a_no_op():
    cfg = GPTConfig(vocab_size=40, context_length=8, d_model=12, n_heads=3, n_blocks=1)
    model = GPT(cfg, dtype="float64")
    x = np.arange(16).reshape(2, 8) % 40
    before = model.forward(x).copy()
    model.add_lora("all", rank=2, alpha=4.0)
    np.testing.assert_array_equal(model.forward(x), before)


# ------------------------------------------------------------------------------------ merge
def _random_adapters(model, seed=0):
    rng = np.random.default_rng(seed)
    for k in model.lora_state_dict():
        model.params[k][...] = rng.normal(0, 0.3, model.params[k].shape)


@pytest.mark.parametrize("targets", ["all", ["k", "attn_proj", "mlp_contract"]])
def test_merge_and_unmerge_give_the_same_outputs(targets):
    cfg = GPTConfig(vocab_size=40, context_length=8, d_model=12, n_heads=3, n_blocks=2,
                    tie_weights=False, logits_bias=False)
    model = GPT(cfg, dtype="float64", seed=2)
    base = {k: v.copy() for k, v in model.params.items()}
    model.add_lora(targets, rank=3, alpha=ALPHA)
    _random_adapters(model)
    adapters = {k: v.copy() for k, v in model.lora_state_dict().items()}
    x = np.random.default_rng(1).integers(0, 40, (2, 8))
    unmerged = model.forward(x).copy()
    assert rel(unmerged, GPT(cfg, dtype="float64", seed=2).forward(x)) > 1e-3   # adapters matter
    model.merge_lora()
    assert not model.lora_targets and not any(".lora_" in k for k in model.params)
    assert rel(model.forward(x), unmerged) <= 1e-12
    model.unmerge_lora(adapters, ALPHA)
    assert model.lora_alpha == ALPHA and sorted(model.lora_state_dict()) == sorted(adapters)
    for k, v in base.items():
        np.testing.assert_allclose(model.params[k], v, rtol=0, atol=1e-14)
    assert rel(model.forward(x), unmerged) <= 1e-12


def test_merging_tied_logits_is_refused():
    cfg = GPTConfig(vocab_size=40, context_length=8, d_model=12, n_heads=3, n_blocks=1)
    model = GPT(cfg)
    model.add_lora("logits", rank=2)
    with pytest.raises(ValueError, match="tied logits"):
        model.merge_lora()


# ------------------------------------------------------------------------------------ counts
def test_parameter_counts_gpt2_small_widths():
    """EQUATIONS.md table: r = 16, GPT-2 small widths; each adapter has r · (f_in + f_out)."""
    cfg = preset("gpt2")
    r, d, V = 16, 768, 50257
    assert count_params(cfg, "logits", r) == r * (d + V) == 816_400
    per_block = 4 * r * (d + d) + 2 * r * (d + 4 * d)
    assert count_params(cfg, "all", r) == 12 * per_block + r * (d + V) == 3_470_608
    assert count_params(cfg, ["q", "k", "v", "attn_proj", "mlp_expand", "mlp_contract", "logits"], r) == 3_470_608


def test_allocated_adapter_sizes_match_the_count():
    cfg = GPTConfig(vocab_size=101, context_length=8, d_model=24, n_heads=4, n_blocks=3)
    model = GPT(cfg)
    model.add_lora("all", rank=5)
    expected = sum(5 * (f_in + f_out) for _, f_in, f_out in fc_layers(cfg))
    assert model.num_params(trainable_only=True) == count_params(cfg, "all", 5) == expected
    assert model.num_params() == count_params(cfg) + expected


# ------------------------------------------------------------------------------------ checkpoints
def test_adapter_only_checkpoint_is_small_and_reloads(tmp_path):
    cfg = GPTConfig(vocab_size=500, context_length=32, d_model=64, n_heads=4, n_blocks=2)
    model = GPT(cfg, seed=3)
    model.add_lora(["q", "v"], rank=2, alpha=ALPHA)
    _random_adapters(model)
    opt = AdamW(model)
    full = save_checkpoint(tmp_path / "full", model, opt, params="all")
    small = save_checkpoint(tmp_path / "adapter", model, opt, params="lora")
    full_bytes = sum(f.stat().st_size for f in full.iterdir())
    small_bytes = sum(f.stat().st_size for f in small.iterdir())
    assert small_bytes < 0.1 * full_bytes
    x = np.random.default_rng(0).integers(0, 500, (2, 32))
    base = GPT(cfg, seed=3)
    ckpt = load_checkpoint(small, base_model=base)
    np.testing.assert_array_equal(ckpt.model.forward(x), model.forward(x))
    assert ckpt.model.freeze_base and ckpt.model.lora_alpha == ALPHA
    with pytest.raises(CheckpointError, match="base_model"):
        load_checkpoint(small)
    other = GPT(GPTConfig(vocab_size=500, context_length=32, d_model=64, n_heads=4, n_blocks=3))
    with pytest.raises(CheckpointError, match="different|belong"):
        load_checkpoint(small, base_model=other)


# ------------------------------------------------------------------------------------ cost
def test_frozen_base_skips_every_base_gradient(monkeypatch):
    """With a frozen base, no base weight or bias gradient is computed at all: the base gradient
    buffer is never allocated and every base fully connected backward is asked for its input
    signal only. (What that saves in time is measured by benchmarks/bench_lora.py, not here.)"""
    import pedestrian.kernels as kernels_module

    calls = []
    real = kernels_module.linear_backward

    def spy(*args, **kwargs):
        calls.append((kwargs.get("dweight") is not None, kwargs.get("dbias") is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels_module, "linear_backward", spy)
    cfg = GPTConfig(vocab_size=50, context_length=8, d_model=16, n_heads=2, n_blocks=2)
    x = np.random.default_rng(0).integers(0, 50, (2, 9))
    full, lora = GPT(cfg, kernels="fast"), GPT(cfg, kernels="fast")
    lora.add_lora("all", rank=2)
    full.loss(x[:, :-1], x[:, 1:])
    full.backward()
    assert any(w for w, _ in calls)                    # the spy sees the full model's weight grads
    calls.clear()
    lora.loss(x[:, :-1], x[:, 1:])
    grads = lora.backward()
    assert calls and not any(w or b for w, b in calls)
    assert lora._grad_base is None
    assert set(grads) == {k for k in lora.params if ".lora_" in k}

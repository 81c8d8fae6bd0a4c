"""Paper section 6 (EQUATIONS.md "LoRA"): an adapter ``α · x D U`` beside a frozen FC layer,
``dD = α xᵀ (Δ Uᵀ)``, ``dU = α (x D)ᵀ Δ``, ``Δ_in = Δ Wᵀ + α (Δ Uᵀ) Dᵀ``; for both kernel modules:
the layer's gradients against torch autograd (float64) and finite differences, the whole model's
adapter gradients against the PyTorch reference, merged equals unmerged, the frozen base gets no
gradient (not even computed), parameter counts, adapter-only checkpoints.
Tolerances: tests/oracles/gradcheck.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_reference import default_cfg, fc_layer_names, random_params, reference_loss_and_grads

from gradcheck import (
    assert_autograd_close,
    assert_fd_close,
    autograd,
    kernels_name,
    kernels_param,
    max_rel_err,
    numerical_grad,
    projection,
)
from pedestrian.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from pedestrian.config import GPTConfig, preset
from pedestrian.model.layout import count_params, fc_layers, lora_specs
from pedestrian.model import GPT
from pedestrian.training.optim import AdamW

ALPHA = 0.75                      # not 1, so a missing α factor shows


def lora_case(seed=0):
    rng = np.random.default_rng(seed)
    B, T, f_in, f_out, r = 3, 5, 7, 6, 2
    x, W, b = rng.normal(size=(B, T, f_in)), 0.4 * rng.normal(size=(f_in, f_out)), rng.normal(size=f_out)
    D, U = 0.4 * rng.normal(size=(f_in, r)), 0.4 * rng.normal(size=(r, f_out))   # U nonzero: every path matters
    return x, W, b, D, U, 0.3 * rng.normal(size=(B, T, f_out))


def adapted_layer(K, x, W, b, D, U):
    """``y = x W + b + α x D U`` through ``K`` (the model's ``_fc_forward``, one layer)."""
    y, _ = K.linear_forward(x, W, b)
    y_lora, cache = K.lora_forward(x, D, U, ALPHA)
    return y + y_lora, cache


def adapted_layer_backward(K, delta, x, W, D, U, cache):
    """Frozen base: only ``Δ_in`` from ``W``; the adapter's ``dD``, ``dU`` and its share of ``Δ_in``."""
    dD, dU = np.full_like(D, np.nan), np.full_like(U, np.nan)
    d_in = K.linear_backward(delta, x, W) + K.lora_backward(delta, cache, D, U, ALPHA, dD=dD, dU=dU)
    return d_in, dD, dU


# ------------------------------------------------------------------------------------ gradients
@kernels_param()
def test_lora_layer_gradients_and_input_signal_match_autograd(K):
    """One FC layer with an adapter, y = x W + b + α x D U: dD, dU and Δ_in vs autograd."""
    x, W, b, D, U, delta = lora_case()
    y, cache = adapted_layer(K, x, W, b, D, U)
    d_in, dD, dU = adapted_layer_backward(K, delta, x, W, D, U, cache)
    W_t, b_t = torch.tensor(W), torch.tensor(b)
    out, grads = autograd(lambda x, D, U: x @ W_t + b_t + ALPHA * (x @ D) @ U, {"x": x, "D": D, "U": U},
                          upstream=delta)
    assert_autograd_close(y, out, "x W + b + α x D U")
    assert_autograd_close(dD, grads["D"], "∂L/∂D")
    assert_autograd_close(dU, grads["U"], "∂L/∂U")
    assert_autograd_close(d_in, grads["x"], "Δ_in")


@kernels_param()
def test_lora_layer_matches_finite_differences(K):
    x, W, b, D, U, R = lora_case(1)

    def f():
        return projection(adapted_layer(K, x, W, b, D, U)[0], R)

    d_in, dD, dU = adapted_layer_backward(K, R, x, W, D, U, adapted_layer(K, x, W, b, D, U)[1])
    for name, analytic, arr in (("D", dD, D), ("U", dU, U), ("x", d_in, x)):
        assert_fd_close(analytic, numerical_grad(f, arr), f"lora.{name}")


@kernels_param()
def test_lora_backward_writes_only_what_is_asked_for(K):
    x, W, b, D, U, R = lora_case(2)
    _, cache = K.lora_forward(x, D, U, ALPHA)
    assert K.lora_backward(R, cache, D, U, ALPHA, need_input=False) is None
    dU = np.full_like(U, np.nan)
    K.lora_backward(R, cache, D, U, ALPHA, dU=dU, need_input=False)
    assert np.all(np.isfinite(dU))


@kernels_param()
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_model_adapter_gradients_and_input_signals_match_autograd(K, build_model, token_batch, tie):
    """Adapters on every kind of FC layer, base frozen: every dD, dU and every error signal
    Δ1 … Δ12 of the whole GPT vs autograd of the PyTorch reference (float64)."""
    cfg = default_cfg(tie_weights=tie)
    lora = {"targets": fc_layer_names(cfg), "rank": 3}
    params = random_params(cfg, seed=4, lora=lora)
    model = build_model(cfg, params, lora=lora, lora_alpha=ALPHA, freeze_base=True, kernels=kernels_name(K))
    x, y = token_batch(cfg, 3, cfg["context_length"], n_ignored=2)
    loss = model.loss(x, y)
    grads = model.backward(keep_deltas=True)
    ref_loss, _, ref_grads, ref_deltas = reference_loss_and_grads(params, cfg, x, y, lora_alpha=ALPHA)
    assert abs(loss - ref_loss) <= 1e-9 * abs(ref_loss)
    assert set(grads) == {k for k in params if ".lora_" in k}
    for k, g in grads.items():
        assert_autograd_close(g, ref_grads[k], k)
    deltas = model.deltas()
    for k, d in ref_deltas.items():
        assert_autograd_close(deltas[k], d, k)


@kernels_param()
def test_frozen_base_gets_no_gradient_and_does_not_move(K):
    cfg = GPTConfig(vocab_size=50, context_length=16, d_model=16, n_heads=2, n_blocks=2)
    model = GPT(cfg, seed=1, kernels=kernels_name(K))
    model.add_lora(["q", "v", "mlp_expand", "logits"], rank=4, alpha=2.0)
    base_before = {k: v.copy() for k, v in model.params.items() if ".lora_" not in k}
    lora_before = {k: v.copy() for k, v in model.lora_state_dict().items()}
    opt = AdamW(model, lr=1e-2)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.integers(0, 50, (2, 17))
        model.loss(x[:, :-1], x[:, 1:])
        model.backward()
        opt.step()
    assert [b.name for b in model.trainable_buffers()] == ["lora"]   # no base gradient buffer
    assert [g.name for g in opt.groups] == ["lora"]
    assert set(model.grads) == set(lora_before)
    for k, v in base_before.items():
        np.testing.assert_array_equal(model.params[k], v)
    moved = [k for k, v in lora_before.items() if not np.array_equal(model.params[k], v)]
    assert sorted(moved) == sorted(lora_before)             # D and U both train (U starts at 0)
    assert model.num_params(trainable_only=True) == sum(s.size for s in lora_specs(cfg, model.lora_targets, 4))


@kernels_param()
def test_new_adapter_is_a_no_op(K):
    cfg = GPTConfig(vocab_size=40, context_length=8, d_model=12, n_heads=3, n_blocks=1)
    model = GPT(cfg, dtype="float64", kernels=kernels_name(K))
    x = np.arange(16).reshape(2, 8) % 40
    before = model.forward(x).copy()
    model.add_lora("all", rank=2, alpha=4.0)
    # U = 0: the adapter adds α (x D) 0 = exact zeros, so the logits are the same numbers
    np.testing.assert_array_equal(model.forward(x), before)


# ------------------------------------------------------------------------------------ merge
def _random_adapters(model, seed=0):
    rng = np.random.default_rng(seed)
    for k in model.lora_state_dict():
        model.params[k][...] = rng.normal(0, 0.3, model.params[k].shape)


# Merged and unmerged compute the same logits in a different order (x (W + αDU) against
# x W + α (x D) U, and W + αDU rounded once per entry): each FC output differs by a few
# (d + r)·ε of its absolute terms, which the two blocks amplify by O(10-100) at most, so a
# relative 1e-10 per tensor holds on any IEEE-754 machine with a margin of 100 or more.
RTOL_MERGE = 1e-10


@kernels_param()
@pytest.mark.parametrize("targets", ["all", ["k", "attn_proj", "mlp_contract"]])
def test_merge_and_unmerge_give_the_same_outputs(K, targets):
    cfg = GPTConfig(vocab_size=40, context_length=8, d_model=12, n_heads=3, n_blocks=2,
                    tie_weights=False, logits_bias=False)
    model = GPT(cfg, dtype="float64", seed=2, kernels=kernels_name(K))
    base = {k: v.copy() for k, v in model.params.items()}
    model.add_lora(targets, rank=3, alpha=ALPHA)
    _random_adapters(model)
    adapters = {k: v.copy() for k, v in model.lora_state_dict().items()}
    x = np.random.default_rng(1).integers(0, 40, (2, 8))
    unmerged = model.forward(x).copy()
    assert max_rel_err(unmerged, GPT(cfg, dtype="float64", seed=2).forward(x)) > 1e-3   # adapters matter
    model.merge_lora()
    assert not model.lora_targets and not any(".lora_" in k for k in model.params)
    assert max_rel_err(model.forward(x), unmerged) <= RTOL_MERGE
    model.unmerge_lora(adapters, ALPHA)
    assert model.lora_alpha == ALPHA and sorted(model.lora_state_dict()) == sorted(adapters)
    for k, v in base.items():
        # (W + αDU) − αDU with the same αDU both times: two roundings, each <= ε of |W| + |αDU|
        fc = k.rsplit(".", 1)[0]
        delta_w = ALPHA * adapters[f"{fc}.lora_D"] @ adapters[f"{fc}.lora_U"] if f"{fc}.lora_D" in adapters else 0.0
        bound = 2 * np.finfo(np.float64).eps * (np.abs(v) + np.abs(delta_w))
        assert np.all(np.abs(model.params[k] - v) <= bound), k
    assert max_rel_err(model.forward(x), unmerged) <= RTOL_MERGE


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
@kernels_param()
def test_frozen_base_skips_every_base_gradient(K, monkeypatch):
    """With a frozen base, no base weight or bias gradient is computed at all: every base fully
    connected backward is asked for its input signal only (``dweight=None, dbias=None``), and no
    base gradient buffer exists. (What that saves in time is measured by
    benchmarks/bench_lora.py, not here.)"""
    calls = []
    real = K.linear_backward

    def spy(*args, **kwargs):
        calls.append((kwargs.get("dweight") is not None, kwargs.get("dbias") is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(K, "linear_backward", spy)       # the model calls model.kernels.linear_backward
    cfg = GPTConfig(vocab_size=50, context_length=8, d_model=16, n_heads=2, n_blocks=2)
    x = np.random.default_rng(0).integers(0, 50, (2, 9))
    full, lora = GPT(cfg, kernels=kernels_name(K)), GPT(cfg, kernels=kernels_name(K))
    lora.add_lora("all", rank=2)
    full.loss(x[:, :-1], x[:, 1:])
    full.backward()
    assert any(w for w, _ in calls) and any(b for _, b in calls)   # the spy sees the full model's
    calls.clear()
    lora.loss(x[:, :-1], x[:, 1:])
    grads = lora.backward()
    assert calls and not any(w or b for w, b in calls)
    assert [b.name for b in lora.trainable_buffers()] == ["lora"]
    assert set(grads) == {k for k in lora.params if ".lora_" in k}

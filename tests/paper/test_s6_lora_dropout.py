"""LoRA as PEFT has it: dropout on the adapter's input (training only) and a rank and an α per
layer. Gradients against PyTorch autograd with the same fixed masks (float64), the masks' place
and draw order, evaluation mode, merging, checkpoints (old records included) and bad input."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from gradcheck import EPS64, RTOL_ROUNDING, gradient_rounding_err, model_key_bias_bounds
from lora_masks import replay_masks
from torch_reference import default_cfg, fc_layer_names, random_params, reference_loss_and_grads

from pedestrian.checkpoint import load_checkpoint, save_checkpoint
from pedestrian.config import GPTConfig
from pedestrian.model.layout import count_params, lora_specs
from pedestrian.layers.dropout import dropout_forward
from pedestrian.layers.linear import linear_backward, linear_forward
from pedestrian.layers.lora import lora_backward, lora_forward
from pedestrian.model import GPT

P = 0.3                                   # the LoRA dropout probability of these tests


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


# ------------------------------------------------------------------------------------ one layer
def test_layer_with_dropout_matches_autograd_with_the_same_mask():
    """y = x W + b + α ((x∘m) D) U with a fixed inverted-dropout mask m: the output, dD, dU and
    Δ_in (base share + adapter share) vs autograd, float64."""
    rng = np.random.default_rng(0)
    B, T, f_in, f_out, r, alpha = 3, 5, 7, 6, 2, 0.75
    x, W, b = rng.normal(size=(B, T, f_in)), rng.normal(size=(f_in, f_out)), rng.normal(size=f_out)
    D, U = rng.normal(size=(f_in, r)), rng.normal(size=(r, f_out))
    delta = rng.normal(size=(B, T, f_out))
    _, mask = dropout_forward(x, P, np.random.default_rng(1))
    assert 0 < np.count_nonzero(mask == 0) < mask.size            # some dropped, some kept
    assert set(np.unique(mask)) == {0.0, 1 / (1 - P)}
    y_base, _ = linear_forward(x, W, b)
    y_lora, cache = lora_forward(x, D, U, alpha, mask)
    dD, dU = np.empty_like(D), np.empty_like(U)
    d_in = linear_backward(delta, x, W) + lora_backward(delta, cache, D, U, alpha, dD=dD, dU=dU)

    xt, Dt, Ut = (torch.tensor(a, requires_grad=True) for a in (x, D, U))
    yt = xt @ torch.tensor(W) + torch.tensor(b) + alpha * ((xt * torch.tensor(mask)) @ Dt) @ Ut
    (yt * torch.tensor(delta)).sum().backward()
    # a handful of rounded products and sums of O(1) numbers: a few ulps of 1 on any machine
    assert rel(y_base + y_lora, yt.detach().numpy()) <= 1e-12
    assert rel(dD, Dt.grad.numpy()) <= 1e-9
    assert rel(dU, Ut.grad.numpy()) <= 1e-9
    assert rel(d_in, xt.grad.numpy()) <= 1e-9
    # the mask does matter: without it the adapter's gradients differ
    dD0 = np.empty_like(D)
    lora_backward(delta, lora_forward(x, D, U, alpha)[1], D, U, alpha, dD=dD0)
    assert rel(dD0, dD) > 1e-3


def test_layer_with_dropout_matches_finite_differences():
    """The same gradients by central differences of L = Σ (y ∘ R) (float64, step 1e-6: truncation
    ~1e-12 and cancellation ~1e-10 relative, far inside 1e-7)."""
    rng = np.random.default_rng(3)
    x, D, U = rng.normal(size=(2, 3, 4)), rng.normal(size=(4, 2)), rng.normal(size=(2, 5))
    R, alpha = rng.normal(size=(2, 3, 5)), 0.7
    _, mask = dropout_forward(x, 0.5, np.random.default_rng(4))
    y, cache = lora_forward(x, D, U, alpha, mask)
    dD, dU = np.empty_like(D), np.empty_like(U)
    d_x = lora_backward(R, cache, D, U, alpha, dD=dD, dU=dU)
    for analytic, arr in ((dD, D), (dU, U), (d_x, x)):
        numeric = np.empty_like(arr)
        for i in np.ndindex(arr.shape):
            old, h = arr[i], 1e-6
            arr[i] = old + h
            up = np.sum(lora_forward(x, D, U, alpha, mask)[0] * R)
            arr[i] = old - h
            down = np.sum(lora_forward(x, D, U, alpha, mask)[0] * R)
            arr[i] = old
            numeric[i] = (up - down) / (2 * h)
        assert rel(analytic, numeric) <= 1e-7
    assert np.all(d_x[mask == 0] == 0)                      # dropped inputs get no signal


def test_layer_without_mask_is_the_plain_adapter():
    rng = np.random.default_rng(2)
    x, D, U = rng.normal(size=(2, 3, 4)), rng.normal(size=(4, 2)), rng.normal(size=(2, 5))
    y, (x_in, h, mask) = lora_forward(x, D, U, 0.5)
    assert x_in is x and mask is None
    np.testing.assert_array_equal(y, 0.5 * ((x @ D) @ U))


# ------------------------------------------------------------------------------------ the model
RANKS = {"q": 1, "blocks.1.attn.v": 3, "mlp_contract": 4, "logits": 2}      # default rank 2
ALPHAS = {"k": 0.5, "blocks.0.mlp_expand": 1.25, "logits": -0.8}           # default α 0.75


def expanded(cfg, pattern, default):
    """``{layer: value}`` from a pattern of kinds and full names (a full name wins)."""
    out = {}
    for name in fc_layer_names(cfg):
        kind = name.rsplit(".", 1)[-1]
        out[name] = pattern.get(name, pattern.get(kind, default))
    return out


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen", "full"])
@pytest.mark.parametrize("kernels,backend,tie", [("fast", "numpy", False), ("reference", "numpy", True),
                                                 ("fast", "torch", True)])
def test_model_with_dropout_and_per_layer_settings_matches_autograd(token_batch, one_torch_thread, kernels, backend,
                                                                   tie, freeze):
    """Adapters on every FC layer with their own ranks and α, dropout 0.3 on their inputs:
    the loss, every gradient (adapters, and the base when it trains) and every error signal
    Δ1 … Δ12 vs autograd of the PyTorch reference given the same masks (float64)."""
    cfg = default_cfg(tie_weights=tie)
    ranks, alphas = expanded(cfg, RANKS, 2), expanded(cfg, ALPHAS, 0.75)
    lora = {"targets": fc_layer_names(cfg), "rank": 2, "ranks": ranks}
    params = random_params(cfg, seed=5, lora=lora)
    model = GPT(GPTConfig(**cfg), dtype="float64", backend=backend, kernels=kernels, seed=3)
    model.add_lora("all", rank=2, alpha=0.75, rank_pattern=RANKS, alpha_pattern=ALPHAS, dropout=P,
                   freeze_base=freeze)
    model.load_state_dict(params, strict=True)
    assert model.lora_ranks == ranks and model.lora_alphas == alphas
    x, y = token_batch(cfg, 3, cfg["context_length"], n_ignored=2)
    masks = replay_masks(model, copy.deepcopy(model.dropout_rng), *x.shape)
    loss = model.loss(x, y)
    grads = model.backward(keep_deltas=True)
    ref_loss, _, ref_grads, ref_deltas = reference_loss_and_grads(params, cfg, x, y, lora_alpha=alphas,
                                                                  lora_masks=masks)
    no_dropout_loss = reference_loss_and_grads(params, cfg, x, y, lora_alpha=alphas)[0]
    assert abs(ref_loss - no_dropout_loss) > 1e-6 * abs(ref_loss)         # the masks matter
    # the loss: a sum of a few thousand rounded O(1) terms, relative error a few 1e-16
    assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
    assert set(grads) == {k for k in params if ".lora_" in k or not freeze}
    for k, g in grads.items():
        g = g.numpy() if backend == "torch" else g
        if k.endswith(".attn.k.bias"):     # identically 0 (paper section 3.1): rounding noise only,
            # <= (T + B·T)·ε·Σ|Δcausal||q| (gradcheck.key_bias_bound; the masked adapters change q,
            # so the bound is taken as its size here): observed 2.3e-17, 1e-12 is 40,000x above it
            assert np.max(np.abs(g)) <= 1e-12 and np.max(np.abs(ref_grads[k])) <= 1e-12, k
        else:
            assert rel(g, ref_grads[k]) <= 1e-9, k
    for k, d in ref_deltas.items():
        ours = model.deltas()[k]
        assert rel(ours.numpy() if backend == "torch" else ours, d) <= 1e-9, k


def test_dropout_only_touches_the_adapter_branch_and_only_in_training():
    """A new adapter (U = 0) adds nothing however its input is dropped, so a training forward with
    adapter dropout equals the base exactly; evaluation draws no mask at all; with trained
    adapters, training forwards differ from each other and evaluation is deterministic."""
    cfg = GPTConfig(vocab_size=40, context_length=8, d_model=12, n_heads=3, n_blocks=2)
    base = GPT(cfg, dtype="float64", seed=1)
    model = GPT(cfg, dtype="float64", seed=1)
    model.add_lora("all", rank=2, dropout=0.5)
    x = np.random.default_rng(0).integers(0, 40, (2, 8))
    np.testing.assert_array_equal(model.forward(x), base.forward(x))
    rng = np.random.default_rng(3)
    for k in model.lora_state_dict():
        model.params[k][...] = rng.normal(0, 0.3, model.params[k].shape)
    a, b = model.forward(x).copy(), model.forward(x).copy()
    assert rel(a, b) > 1e-6                                            # fresh masks each forward
    model.training = False
    state = model.dropout_rng.bit_generator.state
    e1, e2 = model.forward(x).copy(), model.forward(x).copy()
    np.testing.assert_array_equal(e1, e2)
    assert model.dropout_rng.bit_generator.state == state              # nothing drawn
    plain = GPT(cfg, dtype="float64", seed=1)
    plain.add_lora("all", rank=2)
    plain.load_state_dict(model.state_dict())
    np.testing.assert_array_equal(e1, plain.forward(x))


def test_slices_of_a_batch_draw_the_masks_of_their_rows():
    """With adapter dropout on, a slice of a batch (a rank's rows) draws its rows' masks from a
    generator keyed by the row (pedestrian.training.distributed.RowKeyedRNG, ``rows_from`` its first row):
    the slices' losses and gradients, each divided by the whole batch's count, add up to those of
    the unsplit batch with the same keyed generator."""
    from pedestrian.training.distributed import RowKeyedRNG

    cfg = GPTConfig(vocab_size=40, context_length=8, d_model=12, n_heads=3, n_blocks=2)
    x = np.random.default_rng(0).integers(0, 40, (4, 9))
    tokens, targets = x[:, :-1], x[:, 1:]

    def adapted():
        model = GPT(cfg, dtype="float64", seed=1)
        model.add_lora(["q", "mlp_expand"], rank=2, dropout=0.4, seed=2)
        rng = np.random.default_rng(4)
        for k in model.lora_state_dict():
            model.params[k][...] = rng.normal(0, 0.3, model.params[k].shape)
        return model

    model = adapted()
    key = int(copy.deepcopy(model.dropout_rng).integers(0, 2**63 - 1))
    loss, grads = 0.0, {}
    for lo, hi in ((0, 2), (2, 4)):                                    # two slices of 2 rows
        model.dropout_rng = RowKeyedRNG((key,)).rows_from(lo)
        loss += model.loss(tokens[lo:hi], targets[lo:hi], n_total=targets.size)
        for k, g in model.backward().items():
            grads[k] = grads.get(k, 0) + g
    whole = adapted()
    whole.dropout_rng = RowKeyedRNG((key,))
    want_loss = whole.loss(tokens, targets)
    want = whole.backward(keep_deltas=True)
    # the same masks; the batch's sums taken as two halves instead of one: rounding only, bounded
    # per entry by gradcheck's rule (the key bias, ≡ 0, by its own rounding bound)
    err = gradient_rounding_err(whole, model_key_bias_bounds(whole))
    assert abs(loss - want_loss) <= RTOL_ROUNDING * abs(want_loss)
    for k, g in want.items():
        assert np.all(np.abs(grads[k] - g) <= err[k]), k
    model.training = False
    assert abs(model.loss(tokens, targets) - want_loss) > 1e-6        # the masks really matter


# ------------------------------------------------------------------------------------ per-layer settings
def test_per_layer_ranks_shape_the_buffers_and_the_counts():
    cfg = GPTConfig(vocab_size=50, context_length=8, d_model=16, n_heads=2, n_blocks=2)
    model = GPT(cfg)
    model.add_lora(["q", "v", "mlp_expand"], rank=4, rank_pattern={"v": 2, "blocks.1.attn.v": 6})
    assert model.lora_ranks == {"blocks.0.attn.q": 4, "blocks.0.attn.v": 2, "blocks.0.mlp_expand": 4,
                                "blocks.1.attn.q": 4, "blocks.1.attn.v": 6, "blocks.1.mlp_expand": 4}
    assert model.params["blocks.1.attn.v.lora_D"].shape == (16, 6)
    assert model.params["blocks.0.attn.v.lora_U"].shape == (2, 16)
    expected = sum(r * (16 + (64 if k.endswith("mlp_expand") else 16)) for k, r in model.lora_ranks.items())
    assert model.num_params(trainable_only=True) == expected
    assert count_params(cfg, ["q", "v", "mlp_expand"], 4, lora_rank_pattern={"v": 2, "blocks.1.attn.v": 6}) \
        == expected
    assert [b.name for b in model.trainable_buffers()] == ["lora"]
    assert model.trainable_buffers()[0].params.shape == (expected,)
    x = np.random.default_rng(0).integers(0, 50, (2, 8))
    model.loss(x, x)
    grads = model.backward()
    assert {k: g.shape for k, g in grads.items()} == {k: v.shape for k, v in model.lora_state_dict().items()}


@pytest.mark.parametrize("kwargs,match", [
    (dict(rank_pattern={"qq": 2}), "neither a layer kind"),
    (dict(rank_pattern={"logits": 2}), r"names \['logits'\], which carry no adapter"),
    (dict(alpha_pattern={"blocks.1.attn.k": 2.0}), "which carry no adapter"),
    (dict(rank_pattern={"q": 0}), "positive integer, got 0 .rank_pattern, layer blocks.0.attn.q"),
    (dict(rank=2.5), "positive integer, got 2.5"),
    (dict(alpha_pattern={"q": float("nan")}), "finite number, got nan"),
    (dict(dropout=1.0), r"dropout must be a probability in \[0, 1\), got 1.0"),
    (dict(dropout=-0.1), "dropout must be a probability"),
])
def test_bad_lora_settings_are_refused_and_change_nothing(kwargs, match):
    cfg = GPTConfig(vocab_size=50, context_length=8, d_model=16, n_heads=2, n_blocks=2)
    model = GPT(cfg)
    before = set(model.params)
    with pytest.raises(ValueError, match=match):
        model.add_lora(["q", "v"], **kwargs)
    assert set(model.params) == before and not model.lora_targets and model.lora_ranks == {}


def test_merge_and_unmerge_with_per_layer_alphas():
    cfg = GPTConfig(vocab_size=40, context_length=8, d_model=12, n_heads=3, n_blocks=2,
                    tie_weights=False, logits_bias=False)
    model = GPT(cfg, dtype="float64", seed=2)
    base = {k: v.copy() for k, v in model.params.items()}
    model.add_lora("all", rank=3, alpha=0.75, rank_pattern={"k": 1, "logits": 5},
                   alpha_pattern={"v": -2.0, "blocks.1.mlp_contract": 4.0}, dropout=0.2)
    rng = np.random.default_rng(0)
    for k in model.lora_state_dict():
        model.params[k][...] = rng.normal(0, 0.3, model.params[k].shape)
    adapters, alphas = model.lora_state_dict(), dict(model.lora_alphas)
    model.training = False
    x = rng.integers(0, 40, (2, 8))
    unmerged = model.forward(x).copy()
    model.merge_lora()
    assert model.lora_ranks == {} and model.lora_dropout == 0.0
    # merged weights W + α D U: the same products in another order, relative error a few ulps
    assert rel(model.forward(x), unmerged) <= 1e-12
    model.unmerge_lora(adapters, alphas)
    assert model.lora_alphas == alphas and model.lora_ranks["blocks.0.attn.k"] == 1
    for k, v in base.items():
        layer = k.removesuffix(".weight")
        if layer in alphas:
            # fl(fl(W + P) − P) with the same P = α·(D U) both times: two roundings, <= ε·(|W| + |P|)
            P = alphas[layer] * (adapters[f"{layer}.lora_D"] @ adapters[f"{layer}.lora_U"])
            assert np.all(np.abs(model.params[k] - v) <= EPS64 * (np.abs(v) + np.abs(P))), k
        else:
            np.testing.assert_array_equal(model.params[k], v, err_msg=k)    # never touched
    assert rel(model.forward(x), unmerged) <= 1e-12
    with pytest.raises(ValueError, match="exactly the adapted layers"):
        GPT(cfg).unmerge_lora(adapters, {"logits": 1.0})


def test_export_merge_uses_each_layers_alpha():
    """``merged_for_export`` (what ``pedestrian export-hf`` writes) folds each layer's own α in,
    tied-logits adapter included (the copy is untied)."""
    from pedestrian.interop.hf import merged_for_export

    cfg = GPTConfig(vocab_size=40, context_length=8, d_model=12, n_heads=3, n_blocks=2)
    model = GPT(cfg, dtype="float64", seed=2)
    model.add_lora("all", rank=2, alpha=0.5, rank_pattern={"mlp_contract": 3},
                   alpha_pattern={"q": 2.0, "logits": -1.5, "blocks.1.attn_proj": 0.125}, dropout=0.3)
    rng = np.random.default_rng(0)
    for k in model.lora_state_dict():
        model.params[k][...] = rng.normal(0, 0.3, model.params[k].shape)
    model.training = False
    x = rng.integers(0, 40, (2, 8))
    merged = merged_for_export(model)
    assert not merged.lora_targets and merged.config.tie_weights is False
    # W + α D U formed first: the same products in another order, a few ulps
    assert rel(merged.forward(x), model.forward(x)) <= 1e-12


# ------------------------------------------------------------------------------------ checkpoints
def test_checkpoint_keeps_per_layer_settings_and_old_records_still_load(tmp_path):
    cfg = GPTConfig(vocab_size=40, context_length=8, d_model=12, n_heads=3, n_blocks=2)
    model = GPT(cfg, dtype="float64", seed=4)
    model.add_lora(["q", "v", "logits"], rank=2, alpha=1.5, rank_pattern={"logits": 4},
                   alpha_pattern={"blocks.1.attn.v": 0.25}, dropout=0.1)
    rng = np.random.default_rng(1)
    for k in model.lora_state_dict():
        model.params[k][...] = rng.normal(0, 0.3, model.params[k].shape)
    folder = save_checkpoint(tmp_path / "c", model, None, params="lora")
    back = load_checkpoint(folder, base_model=GPT(cfg, dtype="float64", seed=4)).model
    assert (back.lora_targets, back.lora_ranks, back.lora_alphas, back.lora_dropout) == \
        (model.lora_targets, model.lora_ranks, model.lora_alphas, 0.1)
    assert (back.lora_rank, back.lora_alpha) == (2, 1.5)
    model.training = back.training = False
    x = rng.integers(0, 40, (2, 8))
    np.testing.assert_array_equal(back.forward(x), model.forward(x))
    # a checkpoint written before per-layer settings: one rank, one alpha, no dropout
    old = GPT(cfg, dtype="float64", seed=4)
    old.add_lora(["q", "v"], rank=2, alpha=1.5)
    folder = save_checkpoint(tmp_path / "old", old, None, params="lora")
    state = json.loads((folder / "state.json").read_text())
    for key in ("ranks", "alphas", "dropout"):
        del state["lora"][key]
    state["config"] = {k: v for k, v in state["config"].items() if k not in ("qkv_bias", "d_mlp")}
    (folder / "state.json").write_text(json.dumps(state))
    back = load_checkpoint(folder, base_model=GPT(cfg, dtype="float64", seed=4)).model
    assert back.lora_ranks == {k: 2 for k in old.lora_targets} and back.lora_dropout == 0.0
    assert back.lora_alphas == {k: 1.5 for k in old.lora_targets}
    assert lora_specs(cfg, ["q", "v"], 2) == lora_specs(cfg, back.lora_targets, 2, back.lora_ranks)

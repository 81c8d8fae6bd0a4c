"""The whole GPT (paper conclusion, "minimalistic transformer"): the hand-derived backward of the
reference path (``GPT(kernels="reference")``, the paper's layers) and of the fast path
(``kernels="fast"``), each against PyTorch autograd of an independent model
(tests/oracles/torch_reference.py, which imports nothing from `pedestrian`), and against each
other; finite differences of every parameter tensor; the backward from a given ``Δ12`` (a custom
loss); the attention weights of a full forward and of a KV-cache step.

Compared on every case: the loss, the logits, every activation a1 … a12, every parameter
gradient, every error signal Δ1 … Δ12 and every block's Δcausal.

Tolerances (relative per tensor, ``max|a−b| / max|b|``; tests/oracles/gradcheck.py):
- against autograd, float64: <= 1e-9 (the project's bound; the two differ by rounding only).
  The key bias, whose true gradient is 0 (paper section 3), is checked against the rounding
  bound ``gradcheck.key_bias_bound`` on both sides instead.
- fast against reference, float64: <= 1e-12. Both evaluate the same formulas on the same
  inputs; they differ only in the order of rounded operations (fused q/k/v, 1/√d_qk folded into
  q, in-place softmax, sums as BLAS products). Along the longest chain of this grid (2 blocks,
  sums of <= 48 terms) that is at most a few hundred operations, each off by <= ε = 2.2e-16
  relative to the tensor's scale: <= ~1e-13, so 1e-12 holds on any IEEE-754 machine, with any
  BLAS and thread count (measured worst case on this grid: 6.6e-15; autograd vs either: 7.6e-15;
  key-bias gradients: <= 1.1% of their bound).
- float32 model against float64 autograd: <= 1e-5 (the paper's tolerance), with the reference's
  O(1)-scale random weights so the bound is meaningful.

The grid is a covering set, not a cartesian product: every value of every axis below appears
at least once (B ∈ {1, 3}; T ∈ {1, 5, context_length}; n_blocks ∈ {1, 2}; n_heads ∈ {1, 3};
d_qk ≠ d_head; causal and not; relu / gelu / gelu_tanh; ln_eps 0 and 1e-5; tied and untied;
bias on/off; ignored targets, all ignored; repeated token ids; LoRA on several layers, base
frozen or not; dropout off).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from gradcheck import (
    KERNEL_IDS,
    as_np,
    assert_autograd_close,
    build_model,
    max_rel_err,
    model_key_bias_bounds,
    token_batch,
)
from pedestrian.model.kv_cache import KVCache
from torch_reference import (
    default_cfg,
    delta_names,
    derived_dims,
    expand_lora_targets,
    fc_layer_names,
    random_params,
    reference_forward,
    reference_loss_and_grads,
)

CTX = default_cfg()["context_length"]  # 8
LORA_ALPHA = 0.7                        # not 1, so a missing α factor would show
RTOL_PATHS = 1e-12                      # fast vs reference: see the module docstring
KERNELS = pytest.mark.parametrize("kernels", KERNEL_IDS)


def lora_spec(cfg: dict, targets, rank: int = 2) -> dict:
    """Reference LoRA spec with full FC names (both libraries accept those)."""
    full = fc_layer_names(cfg) if targets == "all" else expand_lora_targets(cfg, targets)
    return {"targets": full, "rank": rank}


# id -> (B, T, cfg overrides, n_ignored, LoRA (targets, freeze_base) or None)
CASES = {
    "B1-T1-1blk-1head-relu-causal": (1, 1, dict(n_blocks=1, n_heads=1, activation="relu"), 0, None),
    "B3-T1-noncausal-gelu-tied": (3, 1, dict(causal=False, activation="gelu", tie_weights=True), 1, None),
    "B1-T5-eps0-gelu_tanh": (1, 5, dict(ln_eps=0.0), 1, None),
    "B3-T5-relu-eps0-tied": (3, 5, dict(activation="relu", ln_eps=0.0, tie_weights=True), 3, None),
    "B3-Tctx-gelu-dqk5-dhead3": (3, CTX, dict(activation="gelu", d_qk=5, d_head=3), 2, None),
    "B1-Tctx-noncausal-relu-dqk5-dhead3-nobias":
        (1, CTX, dict(causal=False, activation="relu", d_qk=5, d_head=3, bias=False), 2, None),
    "B3-Tctx-tied-nobias": (3, CTX, dict(tie_weights=True, bias=False), 2, None),
    "B3-T5-1blk-dqk2-dhead6-noncausal-eps0":
        (3, 5, dict(n_blocks=1, d_qk=2, d_head=6, causal=False, activation="gelu", ln_eps=0.0), 2, None),
    "B3-Tctx-1head-dqk7": (3, CTX, dict(n_heads=1, d_qk=7), 4, None),
    "B3-Tctx-1blk-1head-dqk3-dhead5-noncausal-tied":
        (3, CTX, dict(n_blocks=1, n_heads=1, d_qk=3, d_head=5, causal=False, tie_weights=True,
                      activation="relu"), 1, None),
    "B3-T1-tied-relu-nobias": (3, 1, dict(tie_weights=True, activation="relu", bias=False), 0, None),
    "B3-Tctx-half-ignored": (3, CTX, dict(activation="gelu"), 12, None),
    "B1-T5-all-ignored": (1, 5, dict(), 5, None),
    "B3-Tctx-all-ignored-lora": (3, CTX, dict(), 3 * CTX, (["attn.q", "logits"], False)),
    # LoRA: several layers, base frozen (only adapters get gradients) or trained together
    "lora-frozen-block0-all-kinds-untied":
        (3, CTX, dict(), 2, (["blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v", "blocks.0.attn_proj",
                              "blocks.0.mlp_expand", "blocks.0.mlp_contract", "logits"], True)),
    "lora-trained-qv-logits-tied": (3, CTX, dict(tie_weights=True), 2, (["attn.q", "attn.v", "logits"], False)),
    "lora-frozen-tied-logits-contract-noncausal-relu-eps0":
        (3, 5, dict(tie_weights=True, causal=False, activation="relu", ln_eps=0.0), 2,
         (["logits", "mlp_contract"], True)),
    "lora-trained-nobias-dqk5-dhead3":
        (1, CTX, dict(bias=False, d_qk=5, d_head=3), 1, (["attn.k", "attn_proj", "mlp_expand"], False)),
    "lora-frozen-all-1head-B1-T1": (1, 1, dict(n_heads=1), 0, ("all", True)),
    "lora-trained-all-gelu-eps0-T5": (3, 5, dict(activation="gelu", ln_eps=0.0), 2, ("all", False)),
    "lora-trained-noncausal-tied-v-contract":
        (1, CTX, dict(causal=False, tie_weights=True, activation="gelu"), 2,
         (["attn.v", "mlp_contract"], False)),
}


def reference_attention(params: dict, cfg: dict, a2: np.ndarray, delta3: np.ndarray | None,
                        block: int, alpha: float):
    """The oracle's attention weights ``P`` and Δcausal (autograd's dL/dS of the scaled, masked
    scores ``S = q kᵀ/√d_qk``) of every head of a block, ``(B, n_heads, T, T)`` each.

    Built from the reference's own ``a2`` (block input after LN1) and ``Δ3`` (signal at the
    concatenated heads), so nothing here comes from `pedestrian`. ``delta3=None``: ``P`` only.
    """
    dd = derived_dims(cfg)
    H, d_qk, d_head = dd["n_heads"], dd["d_qk"], dd["d_head"]
    x = torch.tensor(a2)

    def fc(name):
        y = x @ torch.tensor(params[f"{name}.weight"])
        if f"{name}.bias" in params:
            y = y + torch.tensor(params[f"{name}.bias"])
        if f"{name}.lora_D" in params:
            y = y + alpha * ((x @ torch.tensor(params[f"{name}.lora_D"])) @ torch.tensor(params[f"{name}.lora_U"]))
        return y

    p = f"blocks.{block}.attn"
    q, k, v = fc(f"{p}.q"), fc(f"{p}.k"), fc(f"{p}.v")
    T = x.shape[1]
    future = torch.arange(T)[None, :] > torch.arange(T)[:, None]
    scores, probs, outs = [], [], []
    for h in range(H):
        s = (q[..., h * d_qk:(h + 1) * d_qk] @ k[..., h * d_qk:(h + 1) * d_qk].transpose(-1, -2)) / math.sqrt(d_qk)
        if cfg["causal"]:
            s = s.masked_fill(future, float("-inf"))
        s = s.detach().requires_grad_(True)          # leaf: its .grad is exactly Δcausal
        scores.append(s)
        probs.append(torch.softmax(s, dim=-1))
        outs.append(probs[-1] @ v[..., h * d_head:(h + 1) * d_head])
    P = np.stack([pr.detach().numpy() for pr in probs], axis=1)
    if delta3 is None:
        return P, None
    torch.cat(outs, dim=-1).backward(torch.tensor(delta3))
    return P, np.stack([s.grad.numpy() for s in scores], axis=1)


def case_setup(case_id: str):
    B, T, overrides, n_ignored, lora_case = CASES[case_id]
    cfg = default_cfg(**overrides)
    lora = None if lora_case is None else lora_spec(cfg, lora_case[0])
    freeze = bool(lora_case and lora_case[1])
    params = random_params(cfg, seed=len(case_id), lora=lora)
    # every case sees repeated token ids (token_batch: repeats=True)
    tokens, targets = token_batch(cfg, B, T, seed=len(case_id), n_ignored=n_ignored)
    return cfg, lora, freeze, params, tokens, targets


@functools.lru_cache(maxsize=None)
def oracle(case_id: str) -> dict:
    """Everything autograd of the independent PyTorch model gives for one case (computed once)."""
    cfg, lora, _, params, tokens, targets = case_setup(case_id)
    loss, logits, grads, deltas = reference_loss_and_grads(params, cfg, tokens, targets,
                                                           lora_alpha=LORA_ALPHA, dtype=torch.float64)
    with torch.no_grad():
        _, acts = reference_forward({k: torch.tensor(v) for k, v in params.items()}, cfg, tokens,
                                    lora_alpha=LORA_ALPHA, return_activations=True)
    acts = {k: v.numpy() for k, v in acts.items()}
    P, causal = {}, {}
    for i in range(cfg["n_blocks"]):
        P[i], causal[i] = reference_attention(params, cfg, acts[f"blocks.{i}.a2"], deltas[f"blocks.{i}.Δ3"],
                                              i, LORA_ALPHA)
    return dict(loss=loss, logits=logits, grads=grads, deltas=deltas, acts=acts, P=P, delta_causal=causal)


@functools.lru_cache(maxsize=None)
def ours(case_id: str, kernels: str) -> dict:
    """One forward + backward of the GPT on one case, as NumPy copies (computed once)."""
    cfg, lora, freeze, params, tokens, targets = case_setup(case_id)
    model = build_model(cfg, params, dtype="float64", lora=lora, lora_alpha=LORA_ALPHA, freeze_base=freeze,
                         kernels=kernels)
    assert model.kernels_name == kernels
    fused_loss = model.loss(tokens, targets)              # the head fused with its loss (model/head.py)
    fused_grads = {k: as_np(v) for k, v in model.backward().items()}
    model.fused_head = False                              # the chain of record: a12 and Δ12 kept
    loss = model.loss(tokens, targets)
    grads = {k: as_np(v) for k, v in model.backward(keep_deltas=True).items()}
    return dict(loss=loss, grads=grads, deltas={k: as_np(v) for k, v in model.deltas().items()},
                acts={k: as_np(v) for k, v in model.activations().items()},
                P=[as_np(p) for p in model.attention_weights()], key_bias_bounds=model_key_bias_bounds(model),
                all_ignored=bool(np.all(targets == -100)), freeze=freeze, params=set(params),
                fused_loss=fused_loss, fused_grads=fused_grads)


# =========================================================================== the grid
@KERNELS
@pytest.mark.parametrize("case_id", list(CASES))
def test_gradient_grid_matches_autograd(case_id, kernels):
    ref, got = oracle(case_id), ours(case_id, kernels)
    cfg = case_setup(case_id)[0]

    # forward: loss, logits, every activation a1 … a12, every block's P
    assert abs(got["loss"] - ref["loss"]) <= 1e-9 * max(abs(ref["loss"]), 1.0)
    assert_autograd_close(got["acts"]["a12"], ref["logits"], "logits")
    for name, a in ref["acts"].items():
        assert_autograd_close(got["acts"][name], a, name)
    for i in range(cfg["n_blocks"]):
        assert_autograd_close(got["P"][i], ref["P"][i], f"blocks.{i}.P")

    # parameter gradients: all of them, or only the adapters when the base is frozen
    lora_names = {k for k in got["params"] if ".lora_" in k}
    assert set(got["grads"]) == (lora_names if got["freeze"] else got["params"])
    for name, g in got["grads"].items():
        if got["all_ignored"]:
            assert np.all(g == 0.0), name                          # the loss is the constant 0
        elif name.endswith(".attn.k.bias"):                        # ≡ 0: rounding noise on both sides
            bound = got["key_bias_bounds"][int(name.split(".")[1])]
            assert np.all(np.abs(g) <= bound) and np.all(np.abs(ref["grads"][name]) <= bound), name
        else:
            assert_autograd_close(g, ref["grads"][name], name)

    # the same loss and gradients from the head fused with its loss (model.loss's default path)
    assert abs(got["fused_loss"] - ref["loss"]) <= 1e-9 * max(abs(ref["loss"]), 1.0)
    assert set(got["fused_grads"]) == set(got["grads"])
    for name, g in got["fused_grads"].items():
        if got["all_ignored"]:
            assert np.all(g == 0.0), name
        elif name.endswith(".attn.k.bias"):
            assert np.all(np.abs(g) <= got["key_bias_bounds"][int(name.split(".")[1])]), name
        else:
            assert_autograd_close(g, ref["grads"][name], f"fused head: {name}")

    # error signals Δ1 … Δ12 (same names as the reference) plus Δcausal per block
    block_names = [f"blocks.{i}.Δcausal" for i in range(cfg["n_blocks"])]
    assert set(got["deltas"]) == set(delta_names(cfg)) | set(block_names)
    for name in delta_names(cfg):
        assert got["deltas"][name].shape == ref["deltas"][name].shape, name
        assert_autograd_close(got["deltas"][name], ref["deltas"][name], name)
    for i, name in enumerate(block_names):
        assert got["deltas"][name].shape == ref["delta_causal"][i].shape
        assert_autograd_close(got["deltas"][name], ref["delta_causal"][i], name)

    if not got["all_ignored"]:  # a comparison of all-zero tensors would prove nothing
        assert np.max(np.abs(ref["deltas"]["Δ1"])) > 1e-4
        assert max(float(np.max(np.abs(g))) for g in got["grads"].values()) > 1e-4


@pytest.mark.parametrize("case_id", list(CASES))
def test_fast_and_reference_paths_agree(case_id):
    """The two kernel modules on the same grid: <= 1e-12 relative per tensor in float64 (module
    docstring); the key bias, ≡ 0, within its rounding bound on both; all-zero stays all-zero."""
    fast, ref = ours(case_id, "fast"), ours(case_id, "reference")
    assert abs(fast["loss"] - ref["loss"]) <= RTOL_PATHS * max(abs(ref["loss"]), 1.0)
    pairs = [(f"act {k}", fast["acts"][k], v) for k, v in ref["acts"].items() if k != "a0"]
    pairs += [(f"P {i}", fast["P"][i], p) for i, p in enumerate(ref["P"])]
    pairs += [(f"Δ {k}", fast["deltas"][k], v) for k, v in ref["deltas"].items()]
    assert set(fast["grads"]) == set(ref["grads"])
    for name, g in ref["grads"].items():
        if name.endswith(".attn.k.bias") and not ref["all_ignored"]:
            i = int(name.split(".")[1])
            assert np.all(np.abs(fast["grads"][name]) <= fast["key_bias_bounds"][i]), name
            assert np.all(np.abs(g) <= ref["key_bias_bounds"][i]), name
        else:
            pairs.append((f"grad {name}", fast["grads"][name], g))
    for what, a, b in pairs:
        if np.all(b == 0.0):                                       # all-ignored: exact zeros on both
            assert np.all(a == 0.0), what
            continue
        err = max_rel_err(a, b)
        assert err <= RTOL_PATHS, f"{what}: fast vs reference {err:.2e} > {RTOL_PATHS:.0e}"


FLOAT32_CASES = {
    "untied-gelu_tanh-causal": (3, CTX, dict(), None),
    "tied-relu-eps0-dqk5-dhead3": (3, CTX, dict(tie_weights=True, activation="relu", ln_eps=0.0,
                                                d_qk=5, d_head=3), None),
    "noncausal-gelu-1head-lora-trained": (2, 5, dict(causal=False, activation="gelu", n_heads=1),
                                          (["attn.q", "attn.v", "mlp_expand", "logits"], False)),
}
RTOL_FLOAT32 = 1e-5


@KERNELS
@pytest.mark.parametrize("case_id", list(FLOAT32_CASES))
def test_float32_model_matches_float64_autograd(case_id, kernels, build_model, token_batch):
    B, T, overrides, lora_case = FLOAT32_CASES[case_id]
    cfg = default_cfg(**overrides)
    lora = None if lora_case is None else lora_spec(cfg, lora_case[0])
    params = random_params(cfg, seed=7, lora=lora)
    tokens, targets = token_batch(cfg, B, T, seed=7, n_ignored=2)

    model = build_model(cfg, params, dtype="float32", lora=lora, lora_alpha=LORA_ALPHA,
                        freeze_base=bool(lora_case and lora_case[1]), kernels=kernels)
    model.fused_head = False                              # a12, Δ12 kept (the fused head: the grid above)
    loss = model.loss(tokens, targets)
    grads = model.backward(keep_deltas=True)
    deltas = model.deltas()
    assert model.activations()["a12"].dtype == np.float32
    assert all(np.asarray(g).dtype == np.float32 for g in grads.values())
    bounds = model_key_bias_bounds(model)        # float32 ε: the key bias is rounding noise

    ref_loss, ref_logits, ref_grads, ref_deltas = reference_loss_and_grads(
        params, cfg, tokens, targets, lora_alpha=LORA_ALPHA, dtype=torch.float64)

    assert abs(loss - ref_loss) <= RTOL_FLOAT32 * max(abs(ref_loss), 1.0)
    assert max_rel_err(model.activations()["a12"], ref_logits) <= RTOL_FLOAT32
    for name, g in grads.items():
        if name.endswith(".attn.k.bias"):
            assert np.all(np.abs(as_np(g)) <= bounds[int(name.split(".")[1])]), name
        else:
            assert max_rel_err(g, ref_grads[name]) <= RTOL_FLOAT32, name
    for name in delta_names(cfg):
        assert max_rel_err(deltas[name], ref_deltas[name]) <= RTOL_FLOAT32, name


# =========================================================================== finite differences
def spot_check(model, tokens, targets, n_per_tensor: int = 3, h: float = 1e-5, dropout_seed=None) -> None:
    """FD on ``n_per_tensor`` random entries of every parameter tensor of ``model``.

    An entry passes when ``|analytic − fd| <= 1e-8 + 1e-6·|fd|``: with ``h = 1e-5`` the
    truncation error is ``h²/6·|L'''| ~ 1e-10`` and the rounding ``~ε·|L|/h ~ 1e-10`` (|L| ~ 3).
    With ``dropout_seed`` the dropout generator is reset before every loss, so every
    evaluation draws the same masks (a fixed mask, as in test_s2_mlp's dropout test).
    """
    def loss():
        if dropout_seed is not None:
            model.dropout_rng = np.random.default_rng(dropout_seed)
        return model.loss(tokens, targets)

    loss()
    grads = {k: as_np(v) for k, v in model.backward().items()}
    assert set(grads) == set(model.params)
    assert max(float(np.max(np.abs(g))) for g in grads.values()) > 1e-2
    pick = np.random.default_rng(0)
    for name, value in model.params.items():
        for _ in range(n_per_tensor):
            idx = tuple(int(pick.integers(0, n)) for n in value.shape)
            old = value[idx]
            value[idx] = old + h
            f_plus = loss()
            value[idx] = old - h
            f_minus = loss()
            value[idx] = old
            fd = (f_plus - f_minus) / (2 * h)
            assert abs(grads[name][idx] - fd) <= 1e-8 + 1e-6 * abs(fd), (name, idx, grads[name][idx], fd)


SMALL = dict(vocab_size=7, context_length=5, d_model=6, n_heads=2, n_blocks=2, d_qk=2, d_head=3)


@KERNELS
def test_finite_differences_of_every_parameter_tensor(kernels, build_model, token_batch):
    """FD on a few entries of every parameter tensor (LoRA adapters included) of a 2-block GPT."""
    cfg = default_cfg(**SMALL)
    lora = {"targets": expand_lora_targets(cfg, ["blocks.1.attn.q", "mlp_expand", "logits"]), "rank": 2}
    params = random_params(cfg, seed=3, lora=lora)
    model = build_model(cfg, params, dtype="float64", lora=lora, lora_alpha=0.7, kernels=kernels)
    tokens, targets = token_batch(cfg, 2, 5, seed=3, n_ignored=2)
    spot_check(model, tokens, targets)


@KERNELS
def test_finite_differences_with_dropout(kernels, build_model, token_batch):
    """Dropout after the embedding, the attention projection and the MLP, with fixed masks."""
    cfg = default_cfg(**SMALL, tie_weights=True, activation="gelu")
    model = build_model(cfg, random_params(cfg, seed=4), dtype="float64", dropout=0.3, kernels=kernels)
    assert model.training
    tokens, targets = token_batch(cfg, 2, 5, seed=4, n_ignored=1)
    model.dropout_rng = np.random.default_rng(9)
    masked = model.loss(tokens, targets)
    model.training = False
    assert abs(model.loss(tokens, targets) - masked) > 1e-6  # dropout really is on in training
    model.training = True
    spot_check(model, tokens, targets, dropout_seed=9)


# =========================================================================== Δ12 of a custom loss
@KERNELS
def test_backward_from_a_given_delta12_matches_autograd_of_a_custom_loss(kernels, build_model, token_batch):
    """``backward(delta_logits=Δ12)``: the gradient of any loss of the logits, here
    ``L = Σ w ∘ logits² / 2`` (``Δ12 = w ∘ logits``), after a forward without targets."""
    cfg = default_cfg(tie_weights=True, d_qk=5, d_head=3)
    params = random_params(cfg, seed=8)
    tokens, _ = token_batch(cfg, 2, CTX, seed=8)
    w = np.random.default_rng(8).standard_normal((2, CTX, cfg["vocab_size"]))
    model = build_model(cfg, params, dtype="float64", kernels=kernels)
    logits = as_np(model.forward(tokens))
    grads = model.backward(delta_logits=w * logits, keep_deltas=True)

    tparams = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    ref_logits = reference_forward(tparams, cfg, tokens)
    (torch.tensor(w) * ref_logits ** 2 / 2).sum().backward()
    assert_autograd_close(logits, ref_logits.detach().numpy(), "logits")
    for name, g in grads.items():
        if not name.endswith(".attn.k.bias"):
            assert_autograd_close(g, tparams[name].grad.numpy(), name)
    bounds = model_key_bias_bounds(model)
    for i in range(cfg["n_blocks"]):
        assert np.all(np.abs(as_np(grads[f"blocks.{i}.attn.k.bias"])) <= bounds[i])
    np.testing.assert_array_equal(as_np(model.deltas()["Δ12"]), w * logits)   # taken as given
    with pytest.raises(ValueError, match="delta_logits must have the logits' shape"):
        model.backward(delta_logits=np.zeros((2, CTX, 3)))


@KERNELS
def test_cross_entropy_delta12_given_explicitly_equals_the_default(kernels, build_model, token_batch):
    """``backward()`` after ``loss`` and ``backward(delta_logits=its Δ12)`` run the same
    operations on the same numbers: the same gradients, bit for bit."""
    cfg = default_cfg()
    model = build_model(cfg, random_params(cfg, seed=9), dtype="float64", kernels=kernels)
    tokens, targets = token_batch(cfg, 2, CTX, seed=9, n_ignored=2)
    model.fused_head = False                              # Δ12 kept (model/head.py)
    model.loss(tokens, targets)
    grads = {k: as_np(v) for k, v in model.backward(keep_deltas=True).items()}
    d12 = as_np(model.deltas()["Δ12"])
    model.forward(tokens)
    again = model.backward(delta_logits=d12)
    for k, g in grads.items():
        np.testing.assert_array_equal(as_np(again[k]), g, err_msg=k)


# =========================================================================== attention weights
@KERNELS
def test_attention_weights_of_a_full_forward_and_of_kv_cache_steps(kernels, build_model, token_batch):
    """``attention_weights()``: ``P`` of every block, ``(B, n_heads, T, L)``, equal to the softmax
    rows the oracle computes -- for a full forward, for a prefix fed into a KV cache, and for
    each single-token step after it (row ``L−1`` of the oracle's full-sequence ``P``)."""
    cfg = default_cfg(d_qk=5, d_head=3)
    params = random_params(cfg, seed=10)
    tokens, _ = token_batch(cfg, 2, CTX, seed=10)
    model = build_model(cfg, params, dtype="float64", kernels=kernels)
    with torch.no_grad():
        _, acts = reference_forward({k: torch.tensor(v) for k, v in params.items()}, cfg, tokens,
                                    return_activations=True)
    ref_P = [reference_attention(params, cfg, acts[f"blocks.{i}.a2"].numpy(), None, i, 1.0)[0]
             for i in range(cfg["n_blocks"])]

    model.forward(tokens)
    P = model.attention_weights()
    assert len(P) == cfg["n_blocks"]
    for i in range(cfg["n_blocks"]):
        assert P[i].shape == (2, cfg["n_heads"], CTX, CTX)
        assert_autograd_close(P[i], ref_P[i], f"P of block {i}, full forward")

    cache = KVCache(model, 2)
    prefix = 5
    model.forward(tokens[:, :prefix], kv_cache=cache)
    for i, p in enumerate(model.attention_weights()):
        assert_autograd_close(p, ref_P[i][:, :, :prefix, :prefix], f"P of block {i}, cached prefix")
    for L in range(prefix + 1, CTX + 1):                    # one new token per step
        model.forward(tokens[:, L - 1:L], kv_cache=cache)
        for i, p in enumerate(model.attention_weights()):
            assert p.shape == (2, cfg["n_heads"], 1, L)
            assert_autograd_close(p, ref_P[i][:, :, L - 1:L, :L], f"P of block {i}, step to {L}")
    # the oracle's rows are the causal softmax rows: future weights exactly 0, rows sum to 1
    future = np.triu(np.ones((CTX, CTX), dtype=bool), 1)
    assert all(np.all(p[..., future] == 0.0) for p in ref_P)


"""Sanity checks of the torch autograd oracle (tests/oracles/torch_reference.py) against a second,
independently written model built from torch.nn.functional building blocks
(F.embedding, F.linear, F.layer_norm, F.scaled_dot_product_attention, F.gelu, F.cross_entropy),
plus finite differences. Nothing here imports `pedestrian`."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torch_reference import (
    check_params,
    default_cfg,
    delta_names,
    derived_dims,
    fc_layer_names,
    param_shapes,
    random_params,
    reference_forward,
    reference_loss,
    reference_loss_and_grads,
)


# ------------------------------------------------------------------------------------------
# the second, independent model
# ------------------------------------------------------------------------------------------

def _lin(P, name, x, alpha, W=None, use_bias=True):
    W = P[f"{name}.weight"] if W is None else W
    b = P.get(f"{name}.bias") if use_bias else None
    y = F.linear(x, W.t(), b)  # nn.Linear stores (f_out, f_in)
    if f"{name}.lora_D" in P:
        y = y + alpha * F.linear(F.linear(x, P[f"{name}.lora_D"].t()), P[f"{name}.lora_U"].t())
    return y


def nn_functional_forward(P, cfg, tokens, alpha=1.0):
    dd = derived_dims(cfg)
    B, T = tokens.shape
    H, dqk, dh, d = dd["n_heads"], dd["d_qk"], dd["d_head"], dd["d_model"]
    eps = cfg["ln_eps"]
    x = F.embedding(tokens, P["tok_emb.weight"]) + F.embedding(torch.arange(T), P["pos_emb.weight"])
    act = {
        "relu": F.relu,
        "gelu": lambda t: F.gelu(t, approximate="none"),
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    }[cfg["activation"]]
    for i in range(dd["n_blocks"]):
        p = f"blocks.{i}"
        h = F.layer_norm(x, (d,), P[f"{p}.ln1.weight"], P.get(f"{p}.ln1.bias"), eps)
        q = _lin(P, f"{p}.attn.q", h, alpha).view(B, T, H, dqk).transpose(1, 2)
        k = _lin(P, f"{p}.attn.k", h, alpha).view(B, T, H, dqk).transpose(1, 2)
        v = _lin(P, f"{p}.attn.v", h, alpha).view(B, T, H, dh).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=bool(cfg["causal"]))  # scale 1/sqrt(dqk)
        o = o.transpose(1, 2).reshape(B, T, H * dh)
        x = x + _lin(P, f"{p}.attn_proj", o, alpha)
        h = F.layer_norm(x, (d,), P[f"{p}.ln2.weight"], P.get(f"{p}.ln2.bias"), eps)
        x = x + _lin(P, f"{p}.mlp_contract", act(_lin(P, f"{p}.mlp_expand", h, alpha)), alpha)
    x = F.layer_norm(x, (d,), P["ln_final.weight"], P.get("ln_final.bias"), eps)
    if cfg["tie_weights"]:
        return _lin(P, "logits", x, alpha, W=P["tok_emb.weight"].t(), use_bias=False)
    return _lin(P, "logits", x, alpha)


def _torch_params(pnp, requires_grad=False):
    return {k: torch.tensor(v, dtype=torch.float64, requires_grad=requires_grad) for k, v in pnp.items()}


def _data(cfg, B=2, T=None, seed=0, n_ignored=2):
    rng = np.random.default_rng(1000 + seed)
    T = cfg["context_length"] if T is None else T
    toks = rng.integers(0, cfg["vocab_size"], size=(B, T))
    toks[0, :3] = toks[0, 0]  # repeated tokens
    tg = rng.integers(0, cfg["vocab_size"], size=(B, T))
    flat = tg.reshape(-1)
    flat[rng.choice(flat.size, size=n_ignored, replace=False)] = -100
    return toks, tg


CASES = [
    # tie, activation, n_heads, causal, bias, d_qk, d_head, eps, lora
    dict(tie_weights=False, activation="relu", n_heads=1, causal=True, bias=True),
    dict(tie_weights=True, activation="gelu", n_heads=3, causal=True, bias=True),
    dict(tie_weights=False, activation="gelu_tanh", n_heads=3, causal=False, bias=False),
    dict(tie_weights=True, activation="gelu_tanh", n_heads=3, causal=True, bias=False, d_qk=5, d_head=3),
    dict(tie_weights=False, activation="gelu", n_heads=2, causal=True, bias=True, ln_eps=0.0),
]
LORA_CASES = [None, {"targets": ["attn.q", "attn.v", "attn_proj", "mlp_expand", "mlp_contract",
                                 "blocks.1.attn.k", "logits"], "rank": 2}]


@pytest.mark.parametrize("case,lora", list(itertools.product(CASES, LORA_CASES)))
def test_logits_loss_grads_match_nn_functional_model(case, lora):
    cfg = default_cfg(**case)
    pnp = random_params(cfg, seed=3, lora=lora)
    toks, tg = _data(cfg)
    alpha = 0.7

    loss, logits, grads, deltas = reference_loss_and_grads(pnp, cfg, toks, tg, lora_alpha=alpha)

    P = _torch_params(pnp, requires_grad=True)
    z = nn_functional_forward(P, cfg, torch.as_tensor(toks), alpha)
    L = F.cross_entropy(z.reshape(-1, z.shape[-1]), torch.as_tensor(tg).reshape(-1), ignore_index=-100)
    L.backward()

    np.testing.assert_allclose(logits, z.detach().numpy(), rtol=1e-11, atol=1e-11)
    assert abs(loss - L.item()) < 1e-11
    assert set(grads) == set(pnp)
    for k in pnp:
        np.testing.assert_allclose(grads[k], P[k].grad.numpy(), rtol=1e-9, atol=1e-11, err_msg=k)
    assert list(deltas) == delta_names(cfg)
    # logits are non-trivial (not all ~0) and the loss is sane
    assert np.std(logits) > 0.3 and np.isfinite(loss)


def test_activation_names_shapes_and_delta_identities():
    cfg = default_cfg(tie_weights=False, n_blocks=2)
    pnp = random_params(cfg, seed=1)
    toks, tg = _data(cfg, n_ignored=3)
    loss, logits, grads, deltas = reference_loss_and_grads(pnp, cfg, toks, tg)
    dd = derived_dims(cfg)
    B, T = toks.shape
    d = dd["d_model"]
    shapes = {"Δ1": (B, T, d), "Δ11": (B, T, d), "Δ12": (B, T, cfg["vocab_size"])}
    for i in range(2):
        for j, w in zip(range(2, 11), [d, dd["n_heads"] * dd["d_head"], d, d, d, dd["d_mlp"], dd["d_mlp"], d, d]):
            shapes[f"blocks.{i}.Δ{j}"] = (B, T, w)
    assert {k: v.shape for k, v in deltas.items()} == shapes

    # Δ12 = (softmax - onehot) / N on counted rows, 0 on ignored rows
    counted = tg != -100
    y = np.exp(logits - logits.max(-1, keepdims=True))
    y /= y.sum(-1, keepdims=True)
    onehot = np.zeros_like(y)
    bi, ti = np.nonzero(counted)
    onehot[bi, ti, tg[bi, ti]] = 1
    # entries <= 1/N; two softmax evaluations (max, exp, a sum of V = 11, a division) differ by
    # <= (V + 4)·ε/N ~ 1e-16 on any IEEE-754 machine, 100× under this bound
    np.testing.assert_allclose(deltas["Δ12"], (y - onehot) * counted[..., None] / counted.sum(), atol=1e-14)
    acts = _acts(pnp, cfg, toks)
    # FC_logits backward, embeddings backward (repeated tokens accumulate)
    np.testing.assert_allclose(grads["logits.weight"], np.einsum("btd,btv->dv", acts["a11"], deltas["Δ12"]),
                               atol=1e-12)
    # sums of B = 2 (and, for repeated ids, a few more) entries of Δ1 (|Δ1| < 0.1) in two orders:
    # <= a few ε·0.1 ~ 1e-16 on any IEEE-754 machine
    np.testing.assert_allclose(grads["pos_emb.weight"][:T], deltas["Δ1"].sum(0), atol=1e-13)
    dtok = np.zeros_like(pnp["tok_emb.weight"])
    np.add.at(dtok, toks, deltas["Δ1"])
    np.testing.assert_allclose(grads["tok_emb.weight"], dtok, atol=1e-13)   # as above: a few ε·0.1
    # residual + LN backward (sheet formula): Δ4 = Δ5, Δ5 = Δ10 + LN2-backward(Δ6), Δ8 = Δ9 Wcᵀ
    for i in range(2):
        p = f"blocks.{i}"
        # autograd hands the skip's Δ5 unchanged to a4 (a5 = x + a4): the same numbers
        np.testing.assert_array_equal(deltas[f"{p}.Δ4"], deltas[f"{p}.Δ5"])
        x = acts[f"{p}.a5"]
        xh = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + cfg["ln_eps"])
        sig = np.sqrt(x.var(-1, keepdims=True) + cfg["ln_eps"])
        g = deltas[f"{p}.Δ6"] * pnp[f"{p}.ln2.weight"]
        ln_back = (g - g.mean(-1, keepdims=True) - xh * (g * xh).mean(-1, keepdims=True)) / sig
        np.testing.assert_allclose(deltas[f"{p}.Δ5"], deltas[f"{p}.Δ10"] + ln_back, atol=1e-12)
        # the same 12-term dot products (|terms| < 0.03) in NumPy and torch: <= 2·12·ε·0.4 ~ 2e-15
        # on any IEEE-754 machine, any BLAS
        np.testing.assert_allclose(deltas[f"{p}.Δ8"], deltas[f"{p}.Δ9"] @ pnp[f"{p}.mlp_contract.weight"].T,
                                   atol=1e-13)   # see the line above
    # key bias gradient is identically zero (paper section 3)
    for i in range(2):
        # ≡ 0; computed, the rounding of sums of B·T·T = 128 products of |Δcausal| < 0.1 and
        # |q| < 4: <= (T + B·T)·ε·Σ|terms| <= 24·ε·51 = 2.7e-13 (observed 1e-17)
        assert np.abs(grads[f"blocks.{i}.attn.k.bias"]).max() < 1e-12


def _acts(pnp, cfg, toks):
    P = _torch_params(pnp)
    _, acts = reference_forward(P, cfg, torch.as_tensor(toks), return_activations=True)
    return {k: v.detach().numpy() for k, v in acts.items()}


def test_loss_matches_cross_entropy_and_all_ignored_is_zero():
    cfg = default_cfg()
    pnp = random_params(cfg, seed=2, lora={"targets": ["logits"], "rank": 3})
    toks, tg = _data(cfg, n_ignored=5)
    z = torch.randn(2, cfg["context_length"], cfg["vocab_size"], dtype=torch.float64) * 30  # large logits
    ref = reference_loss(z, tg)
    exp = F.cross_entropy(z.reshape(-1, z.shape[-1]), torch.as_tensor(tg).reshape(-1), ignore_index=-100)
    assert abs(ref.item() - exp.item()) < 1e-10

    all_ignored = np.full_like(tg, -100)
    loss, logits, grads, deltas = reference_loss_and_grads(pnp, cfg, toks, all_ignored)
    assert loss == 0.0
    assert all(np.all(g == 0) for g in grads.values())
    assert all(np.all(d == 0) for d in deltas.values())
    assert np.all(np.isfinite(logits))


def test_finite_difference_spot_check():
    cfg = default_cfg(tie_weights=True, activation="gelu", n_blocks=1, ln_eps=0.0)
    lora = {"targets": ["attn.q", "logits"], "rank": 2}
    pnp = random_params(cfg, seed=7, lora=lora)
    toks, tg = _data(cfg, T=6)
    alpha = 1.3
    _, _, grads, _ = reference_loss_and_grads(pnp, cfg, toks, tg, lora_alpha=alpha)

    def loss_at(p):
        P = _torch_params(p)
        with torch.no_grad():
            return reference_loss(reference_forward(P, cfg, torch.as_tensor(toks), lora_alpha=alpha), tg).item()

    h = 1e-6
    entries = [("tok_emb.weight", (int(toks[0, 0]), 2)),  # tied: embedding + logits use
               ("blocks.0.attn.q.weight", (1, 2)),
               ("blocks.0.ln1.weight", (4,)),
               ("blocks.0.attn.q.lora_D", (3, 1)),
               ("logits.lora_U", (0, 5))]
    for name, idx in entries:
        plus = {k: v.copy() for k, v in pnp.items()}
        minus = {k: v.copy() for k, v in pnp.items()}
        plus[name][idx] += h
        minus[name][idx] -= h
        fd = (loss_at(plus) - loss_at(minus)) / (2 * h)
        assert abs(fd - grads[name][idx]) < 1e-7 * max(1.0, abs(fd)), (name, fd, grads[name][idx])
        assert abs(grads[name][idx]) > 1e-6, name  # the check is not vacuous


def test_causal_mask_and_bk_invariance():
    cfg = default_cfg(n_blocks=1)
    pnp = random_params(cfg, seed=4)
    toks, _ = _data(cfg)
    base = reference_forward(_torch_params(pnp), cfg, torch.as_tensor(toks)).numpy()
    # changing a future token does not change earlier logits
    t2 = toks.copy()
    t2[:, -1] = (t2[:, -1] + 1) % cfg["vocab_size"]
    out = reference_forward(_torch_params(pnp), cfg, torch.as_tensor(t2)).numpy()
    # earlier rows run the same operations on the same numbers (the changed token is masked out):
    # at most a few ulps of O(5) logits, ~1e-15, apart on any IEEE-754 machine
    np.testing.assert_allclose(out[:, :-1], base[:, :-1], atol=1e-13)
    assert np.abs(out[:, -1] - base[:, -1]).max() > 1e-6
    # changing the key bias changes nothing
    p2 = {k: v.copy() for k, v in pnp.items()}
    p2["blocks.0.attn.k.bias"] += 3.0
    np.testing.assert_allclose(reference_forward(_torch_params(p2), cfg, torch.as_tensor(toks)).numpy(), base,
                               atol=1e-12)


def test_param_helpers():
    cfg = default_cfg(tie_weights=True, bias=False, d_qk=5, d_head=3)
    shapes = param_shapes(cfg)
    assert "logits.weight" not in shapes and "logits.bias" not in shapes
    assert not any(k.endswith(".bias") for k in shapes)
    assert shapes["blocks.0.attn.q.weight"] == (12, 15) and shapes["blocks.0.attn.v.weight"] == (12, 9)
    assert shapes["blocks.0.attn_proj.weight"] == (9, 12)
    assert shapes["blocks.1.mlp_expand.weight"] == (12, 48)
    lora = {"targets": ["attn.q", "logits"], "rank": 2}
    p = random_params(cfg, seed=0, lora=lora)
    assert p["logits.lora_D"].shape == (12, 2) and p["logits.lora_U"].shape == (2, cfg["vocab_size"])
    assert {k for k in p if "lora" in k} == {"blocks.0.attn.q.lora_D", "blocks.0.attn.q.lora_U",
                                             "blocks.1.attn.q.lora_D", "blocks.1.attn.q.lora_U",
                                             "logits.lora_D", "logits.lora_U"}
    assert all(np.abs(v).max() > 0 for v in p.values())
    q = random_params(cfg, seed=0, lora=lora)
    assert all(np.array_equal(p[k], q[k]) for k in p)
    assert random_params(cfg, seed=0, dtype=np.float32)["tok_emb.weight"].dtype == np.float32
    check_params(p, cfg)
    with pytest.raises(ValueError):
        check_params({**p, "logits.weight": np.zeros((12, cfg["vocab_size"]))}, cfg)
    with pytest.raises(ValueError):
        check_params({k: v for k, v in p.items() if k != "logits.lora_U"}, cfg)
    with pytest.raises(KeyError):
        random_params(cfg, lora={"targets": ["blocks.0.ln1"], "rank": 1})
    assert fc_layer_names(default_cfg(n_blocks=1)) == [
        "blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v", "blocks.0.attn_proj",
        "blocks.0.mlp_expand", "blocks.0.mlp_contract", "logits"]
    # paper's parameter counts (GPT-2 small widths)
    g2 = dict(vocab_size=50257, context_length=1024, d_model=768, n_heads=12, mlp_ratio=4, bias=True,
              causal=True, activation="gelu_tanh", ln_eps=1e-5)
    n = lambda c, lo=None: sum(int(np.prod(s)) for s in param_shapes(default_cfg(**c), lo).values())
    assert n({**g2, "n_blocks": 12, "tie_weights": True}) == 124_439_808
    assert n({**g2, "n_blocks": 12, "tie_weights": False}) == 163_087_441
    assert n({**g2, "n_blocks": 1, "tie_weights": False}) == 85_120_849
    base = n({**g2, "n_blocks": 12, "tie_weights": True})
    all7 = {"targets": ["attn.q", "attn.k", "attn.v", "attn_proj", "mlp_expand", "mlp_contract", "logits"],
            "rank": 16}
    assert n({**g2, "n_blocks": 12, "tie_weights": True}, all7) - base == 3_470_608
    assert n({**g2, "n_blocks": 12, "tie_weights": True}, {"targets": ["logits"], "rank": 16}) - base == 816_400


def test_rejects_bad_tokens():
    cfg = default_cfg()
    P = _torch_params(random_params(cfg, seed=0))
    with pytest.raises(ValueError):
        reference_forward(P, cfg, torch.zeros(1, cfg["context_length"] + 1, dtype=torch.long))
    with pytest.raises(ValueError):
        reference_forward(P, cfg, torch.full((1, 3), cfg["vocab_size"], dtype=torch.long))

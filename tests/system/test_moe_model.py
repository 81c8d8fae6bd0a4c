"""A GPT whose MLPs are mixtures of experts (model/moe.py): the whole model's loss -- the
cross-entropy plus ``router_aux_loss_coef`` times the load-balancing loss -- and every gradient
against finite differences, the fast kernels against the reference, LoRA on every expert, the
KV-cache path, checkpoints, parameter names and counts, and the config's refusals. (Against
transformers' Mixtral, Qwen3-MoE and OLMoE: tests/system/test_hf_moe.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import numerical_grad

from pedestrian import GPT, GPTConfig
from pedestrian.checkpoint import load_checkpoint, save_checkpoint
from pedestrian.generation.generate import generate
from pedestrian.generation.sampling import Sampling
from pedestrian.model.layout import count_active_params, count_params, fc_layers, param_specs

BASE = dict(vocab_size=20, context_length=16, d_model=12, n_heads=2, n_blocks=3, norm="rmsnorm", mlp="swiglu",
            bias=False, position_encoding="rope", n_kv_heads=1, n_experts=4, n_experts_per_token=2, d_expert=6,
            router_aux_loss_coef=0.3, output_router_logits=True)


def model(kernels="reference", seed=1, **over):
    m = GPT(GPTConfig(**{**BASE, **over}), dtype="float64", kernels=kernels, seed=seed)
    rng = np.random.default_rng(seed)
    for name, v in m.params.items():                   # weights of order 0.3: routers far from uniform
        v[...] = rng.normal(size=v.shape) * 0.3 + (1.0 if ".ln" in name or name.startswith("ln") else 0.0)
    return m


def batch(seed=0, B=2, T=7):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 20, (B, T))
    y[0, 1] = -100                                      # an ignored target: the aux loss still counts its row
    return rng.integers(0, 20, (B, T)), y


def test_names_counts_and_layers():
    c = GPTConfig(**BASE, moe_layers=[0, 2])
    names = [s.name for s in param_specs(c)]
    assert "blocks.0.router.weight" in names and "blocks.1.router.weight" not in names
    assert "blocks.2.experts.3.mlp_contract.weight" in names and "blocks.1.mlp_gate.weight" in names
    spec = {s.name: s.shape for s in param_specs(c)}
    assert spec["blocks.0.router.weight"] == (12, 4) and spec["blocks.0.experts.1.mlp_gate.weight"] == (12, 6)
    assert spec["blocks.0.experts.1.mlp_contract.weight"] == (6, 12) and spec["blocks.1.mlp_gate.weight"] == (12, c.d_mlp)
    assert count_params(c) == sum(int(np.prod(s)) for s in spec.values()) == GPT(c).num_params()
    assert count_params(c) - count_active_params(c) == 2 * (4 - 2) * 3 * 12 * 6
    assert "blocks.0.experts.3.mlp_expand" in [n for n, _, _ in fc_layers(c)]


@pytest.mark.parametrize("renorm", [False, True])
def test_loss_and_gradients_by_finite_differences(renorm):
    """Central differences (h = 1e-6) of the whole loss, the aux part included, on entries of every
    kind of parameter: truncation ~h², cancellation ~u·L/h ~ 1e-10; 1e-7 absolute is far above
    both, far below any wrong term (gradients here are ~1e-2 … 1)."""
    m = model(norm_topk_prob=renorm, moe_layers=[0, 2])
    x, y = batch()
    loss = m.loss(x, y)
    parts = m.loss_parts
    # the model adds ce + (coef · share) · aux with share = 1: two float64 roundings on each side
    assert loss == pytest.approx(parts["ce"] + 0.3 * parts["aux"], rel=1e-13)
    g = {k: v.copy() for k, v in m.backward().items()}
    rng = np.random.default_rng(0)
    for name in ("blocks.0.router.weight", "blocks.2.router.weight", "blocks.0.experts.2.mlp_gate.weight",
                 "blocks.2.experts.1.mlp_expand.weight", "blocks.0.experts.0.mlp_contract.weight",
                 "blocks.1.mlp_gate.weight", "blocks.1.attn.q.weight", "blocks.0.ln2.weight", "tok_emb.weight"):
        p = m.params[name]
        entries = [np.ravel_multi_index(tuple(int(rng.integers(s)) for s in p.shape), p.shape) for _ in range(3)]
        fd = numerical_grad(lambda: m.loss(x, y), p, 1e-6, entries)
        for idx in (np.unravel_index(e, p.shape) for e in entries):
            assert abs(fd[idx] - g[name][idx]) <= 1e-7, (name, idx)


def test_aux_only_when_asked():
    on, off = model(), model(output_router_logits=False)
    x, y = batch()
    l_on, l_off = on.loss(x, y), off.loss(x, y)
    assert off.loss_parts["aux"] == on.loss_parts["aux"] and l_off == off.loss_parts["ce"]
    # the same weights give the same ce bits; + coef · aux is two float64 roundings (≤ 2.2e-16 rel.)
    assert l_on == pytest.approx(l_off + 0.3 * on.loss_parts["aux"], rel=1e-13)
    g_on, g_off = on.backward()["blocks.0.router.weight"].copy(), off.backward()["blocks.0.router.weight"].copy()
    assert np.max(np.abs(g_on - g_off)) > 1e-6                    # the aux gradient reaches the router


def test_fast_equals_reference_and_recompute():
    """float64, 1e-12 of each gradient's scale (other summation orders; EQUATIONS.md rounding)."""
    x, y = batch(B=3, T=9)
    ref, fst = model("reference"), model("fast")
    assert fst.loss(x, y) == pytest.approx(ref.loss(x, y), rel=1e-13)
    g_r, g_f = ref.backward(), {k: v.copy() for k, v in fst.backward().items()}
    for k in g_r:
        assert np.max(np.abs(g_r[k] - g_f[k])) <= 1e-12 * max(np.max(np.abs(g_r[k])), 1e-12), k
    fst.recompute = True                                            # the same bits, blocks run again
    assert fst.loss(x, y) == pytest.approx(ref.loss(x, y), rel=1e-13)
    g_re = fst.backward()
    for k in g_r:
        assert np.array_equal(g_re[k], g_f[k]), k


def test_lora_on_every_expert_router_frozen():
    m = model("fast")
    m.add_lora(["mlp_gate", "mlp_expand", "mlp_contract", "q"], rank=2, alpha=1.5)
    assert "blocks.1.experts.3.mlp_contract" in m.lora_targets and not any("router" in t for t in m.lora_targets)
    rng = np.random.default_rng(3)
    for name in m.lora_state_dict():
        m.params[name][...] = rng.normal(size=m.params[name].shape) * 0.2
    x, y = batch()
    m.loss(x, y)
    g = {k: v.copy() for k, v in m.backward().items()}
    assert all(".lora_" in k for k in g)                            # the base, the router too: frozen
    for name in ("blocks.0.experts.1.mlp_gate.lora_D", "blocks.2.experts.3.mlp_contract.lora_U"):
        p = m.params[name]
        idx = (0, 1)
        fd = numerical_grad(lambda: m.loss(x, y), p, 1e-6, [np.ravel_multi_index(idx, p.shape)])
        assert abs(fd[idx] - g[name][idx]) <= 1e-7
    before = m.forward(x)
    m.merge_lora()
    assert np.max(np.abs(m.forward(x) - before)) <= 1e-12


@pytest.mark.parametrize("kernels", ["reference", "fast"])
def test_kv_cache_greedy_equals_full_forward(kernels):
    m = model(kernels)
    prompt = np.array([[3, 5, 7, 1]])
    out = generate(m, prompt, 6, Sampling(temperature=0))
    ids = prompt
    for _ in range(6):                                               # no cache: the whole sequence again
        nxt = np.argmax(m.forward(ids)[:, -1], axis=-1)
        ids = np.concatenate([ids, nxt[:, None]], axis=1)
    assert np.array_equal(out, ids)


def test_checkpoint_round_trip(tmp_path):
    m = model("fast", moe_layers=[1])
    save_checkpoint(tmp_path / "ck", m)
    back = load_checkpoint(tmp_path / "ck")
    back = back[0] if isinstance(back, tuple) else back
    back = getattr(back, "model", back)
    assert back.config == m.config
    x, _ = batch()
    assert np.array_equal(np.asarray(back.forward(x), np.float64), np.asarray(m.forward(x), np.float64))


@pytest.mark.parametrize("over, words", [
    (dict(n_experts=-1), "n_experts"), (dict(n_experts_per_token=5), "n_experts_per_token"),
    (dict(d_expert=0), "d_expert"), (dict(router_aux_loss_coef=float("nan")), "router_aux_loss_coef"),
    (dict(moe_layers=[2, 0]), "moe_layers"), (dict(moe_layers=[3]), "moe_layers"),
    (dict(mlp="standard", activation="gelu_tanh"), "mlp='swiglu'"), (dict(bias=True), "bias=False"),
    (dict(norm_topk_prob=1), "norm_topk_prob"),
])
def test_config_refusals(over, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")) as err:
        GPTConfig(**{**BASE, **over})
    assert "\n" not in str(err.value)


def test_config_serialises():
    c = GPTConfig(**BASE, moe_layers=[0, 2])
    assert GPTConfig.from_dict(c.to_dict()) == c and GPTConfig.from_dict({**c.to_dict(), "moe_layers": [0, 2]}) == c


def test_update_in_backward():
    """AdamW inside the backward (training/blockwise.py) on a model whose every block has experts:
    the aux loss's signal on π was made by the forward, so each block's update is the plain step's
    (float64, 1e-13: the same numbers in the same order, but AdamW's per-block reductions). Blocks
    of two kinds share no one-block buffer: refused by name."""
    from pedestrian.training.blockwise import blockwise_step, check_blockwise
    from pedestrian.training.optim import AdamW
    from pedestrian.training.step import TrainingError

    x, y = batch()
    plain, inside = model("fast"), model("fast")
    opt = AdamW(plain, lr=1e-2, weight_decay=0.0)
    plain.loss(x, y)
    plain.backward()
    opt.step()
    opt2 = AdamW(inside, lr=1e-2, weight_decay=0.0)
    check_blockwise(inside, opt2)
    blockwise_step(inside, opt2, [(x, y)], 1e-2)
    for k, v in plain.params.items():
        assert np.allclose(inside.params[k], v, rtol=0, atol=1e-13), k
    mixed = model("fast", moe_layers=[0])
    with pytest.raises(TrainingError, match="moe_layers"):
        check_blockwise(mixed, AdamW(mixed, lr=1e-2))


def test_params_command_counts_active(capsys):
    from pedestrian.cli import main

    assert main(["params", "--preset", "char-small", "--arch", "llama", "--n-experts", "4", "--n-experts-per-token",
                 "2", "--d-expert", "172"]) in (0, None)
    out = capsys.readouterr().out
    c = GPTConfig(**{**dict(vocab_size=65, context_length=64, d_model=128, n_heads=4, n_blocks=4), "norm": "rmsnorm",
                     "mlp": "swiglu", "bias": False, "position_encoding": "rope", "n_kv_heads": 2, "d_mlp": 344,
                     "n_experts": 4, "n_experts_per_token": 2, "d_expert": 172})
    assert f"{count_active_params(c):,}" in out and f"{count_params(c):,}" in out and "blocks.3.router.weight" not in out


def test_bf16_mixed_precision_runs_the_experts():
    """precision="bf16" (torch backend): the routing in float32, the experts' products in bfloat16.
    The loss within 2 % of the float32 model's (bfloat16 keeps 8 bits: ~0.4 % per rounding, a few
    roundings deep), gradients finite."""
    torch = pytest.importorskip("torch")
    x, y = batch()
    full = GPT(GPTConfig(**BASE), backend="torch", seed=3)
    mixed = GPT(GPTConfig(**BASE), backend="torch", precision="bf16", seed=3)
    l32, l16 = full.loss(torch.as_tensor(x), torch.as_tensor(y)), mixed.loss(torch.as_tensor(x), torch.as_tensor(y))
    assert abs(l16 - l32) <= 0.02 * l32
    assert all(bool(torch.isfinite(g).all()) for g in mixed.backward().values())

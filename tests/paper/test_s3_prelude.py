"""The attention's prelude (docs/EQUATIONS.md "The attention's prelude": q/k RMS norms per head or
over the whole projection, then RoPE or none per block) and the norms after the sublayers
("Norms after the sublayers": post, sandwich) -- for both kernel modules, against PyTorch autograd
(float64) and finite differences; the whole chain with every combination by finite differences.
Tolerances: tests/oracles/gradcheck.py (1e-9 against autograd: two float64 computations of the
same formula differ by a few dozen roundings; 1e-7 against central differences with h = 1e-6:
truncation O(h²), rounding O(ε/h) of an objective of order 1).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gradcheck import assert_autograd_close, assert_fd_close, autograd, kernels_param, numerical_grad

from pedestrian import GPT
from pedestrian.config import GPTConfig
from pedestrian.model import prelude
from pedestrian.model.params import Norm

H, H_KV, D_QK, D_HEAD, EPS = 4, 2, 6, 5, 1e-5
MODES = pytest.mark.parametrize("mode", ["head", "proj"])


def config(mode, rope_layers=(True, False), **kw):
    return GPTConfig(vocab_size=13, context_length=16, d_model=8, n_heads=H, n_kv_heads=H_KV, d_qk=D_QK,
                     d_head=D_HEAD, n_blocks=2, norm="rmsnorm", mlp="swiglu", position_encoding="rope",
                     bias=False, qk_norm=mode, rope_layers=rope_layers, ln_eps=EPS, **kw)


def case(c, B=2, T=5, seed=0):
    rng = np.random.default_rng(seed)
    width = H * D_QK + H_KV * (D_QK + D_HEAD)
    q_width, k_width = (D_QK, D_QK) if c.qk_norm == "head" else (H * D_QK, H_KV * D_QK)
    qkv = 1.5 * rng.standard_normal((B, T, width)) + 0.2
    return (qkv, 1 + 0.3 * rng.standard_normal(q_width), 1 + 0.3 * rng.standard_normal(k_width),
            0.5 * rng.standard_normal(qkv.shape))


def torch_prelude(qkv, wq, wk, mode: str, turn: bool):
    """The prelude in plain torch: RMS norm of q and k (each head's features or the whole
    projection), then Hugging Face's rotate-half RoPE at positions 0 … T−1."""
    B, T, _ = qkv.shape
    hq, hk = H * D_QK, H_KV * D_QK
    q, k, v = qkv[..., :hq], qkv[..., hq:hq + hk], qkv[..., hq + hk:]

    def rms(x, w, heads):
        x = x.reshape(B, T, heads, D_QK) if mode == "head" else x
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w
        return y.reshape(B, T, heads * D_QK)

    q, k = rms(q, wq, H), rms(k, wk, H_KV)
    if turn:
        theta = 10_000.0 ** (-torch.arange(0, D_QK, 2, dtype=torch.float64) / D_QK)
        angle = torch.arange(T, dtype=torch.float64)[:, None] * theta              # (T, D_QK/2)
        cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()

        def rope(x, heads):
            x = x.reshape(B, T, heads, D_QK)
            half = torch.cat((-x[..., D_QK // 2:], x[..., :D_QK // 2]), -1)
            return (x * cos[:, None] + half * sin[:, None]).reshape(B, T, heads * D_QK)

        q, k = rope(q, H), rope(k, H_KV)
    return torch.cat((q, k, v), -1)


def run(K, c, i, qkv, wq, wk, R):
    w = SimpleNamespace(q_norm=Norm(wq, None), k_norm=Norm(wk, None))
    g = SimpleNamespace(q_norm=Norm(np.full(wq.shape, np.nan), None), k_norm=Norm(np.full(wk.shape, np.nan), None))
    y, cache = prelude.forward(K, c, i, qkv.copy(), w, None)
    y = np.array(y)
    d_in = prelude.backward(K, c, np.array(R), cache, g)
    return y, np.array(d_in), g.q_norm.weight, g.k_norm.weight


@kernels_param()
@MODES
@pytest.mark.parametrize("block", [0, 1], ids=["rope", "no-rope"])
@pytest.mark.parametrize("B", [1, 3])
def test_prelude_matches_autograd(K, mode, block, B):
    c = config(mode)
    qkv, wq, wk, R = case(c, B=B, seed=B)
    y, d_in, dwq, dwk = run(K, c, block, qkv, wq, wk, R)
    out, grads = autograd(lambda qkv, wq, wk: torch_prelude(qkv, wq, wk, mode, c.uses_rope(block)),
                          {"qkv": qkv, "wq": wq, "wk": wk}, upstream=R)
    assert_autograd_close(y, out, "y")
    assert_autograd_close(d_in, grads["qkv"], "Δ_qkv")
    assert_autograd_close(dwq, grads["wq"], "∂L/∂w_q")
    assert_autograd_close(dwk, grads["wk"], "∂L/∂w_k")


@kernels_param()
@MODES
def test_prelude_by_finite_differences(K, mode):
    c = config(mode)
    qkv, wq, wk, R = case(c, B=2, T=3, seed=7)
    R = R / 4                                              # |f| below gradcheck.F_MAX
    _, d_in, dwq, dwk = run(K, c, 0, qkv, wq, wk, R)
    w = SimpleNamespace(q_norm=Norm(wq, None), k_norm=Norm(wk, None))

    def f():
        return float(np.sum(np.array(prelude.forward(K, c, 0, qkv.copy(), w, None)[0]) * R))

    assert_fd_close(d_in, numerical_grad(f, qkv), "Δ_qkv")
    assert_fd_close(dwq, numerical_grad(f, wq), "∂L/∂w_q")
    assert_fd_close(dwk, numerical_grad(f, wk), "∂L/∂w_k")


def test_no_norm_no_rope_is_the_identity():
    c = GPTConfig(vocab_size=13, context_length=16, d_model=8, n_heads=H, n_kv_heads=H_KV, d_qk=D_QK, d_head=D_HEAD,
                  n_blocks=2, position_encoding="rope", rope_layers=(False, True))
    import pedestrian.kernels as K

    qkv = np.random.default_rng(0).standard_normal((2, 3, H * D_QK + H_KV * (D_QK + D_HEAD)))
    y, cache = prelude.forward(K, c, 0, qkv.copy(), None, None)
    assert np.array_equal(y, qkv) and cache.rope is None and cache.norms is None


# ------------------------------------------------------------------------------------ the chain
PLACEMENTS = [("post", "proj", None), ("sandwich", "head", (True, False)), ("pre", "head", (False, True)),
              ("sandwich", None, None)]


@pytest.mark.parametrize("kernels", ["reference", "fast"])
@pytest.mark.parametrize("placement, qk_norm, rope_layers", PLACEMENTS)
def test_chain_by_finite_differences(kernels, placement, qk_norm, rope_layers):
    """Every parameter of a two-block model with norms after the sublayers, q/k norms and RoPE on
    some blocks, by central differences on three entries each (the chain itself, both kernel
    sets); the two kernel sets give the same gradients (1e-12: the same float64 formulas)."""
    c = GPTConfig(vocab_size=11, context_length=8, d_model=8, n_heads=4, n_blocks=2, n_kv_heads=2, d_head=3,
                  d_qk=4, norm="rmsnorm", mlp="swiglu", d_mlp=6, position_encoding="rope", bias=False,
                  tie_weights=False, qk_norm=qk_norm, rope_layers=rope_layers, norm_placement=placement)
    rng = np.random.default_rng(0)
    model = GPT(c, dtype="float64", kernels=kernels, seed=3)
    for name, p in model.params.items():
        p[...] = rng.normal(0.0, 0.5, size=p.shape) + (1.0 if p.ndim == 1 else 0.0)
    assert (("blocks.0.ln1_post.weight" in model.params) == (placement != "pre")
            and ("blocks.0.ln1.weight" in model.params) == (placement != "post"))
    tokens, targets = rng.integers(0, 11, (2, 6)), rng.integers(0, 11, (2, 6))
    model.loss(tokens, targets)
    grads = {k: np.array(v) for k, v in model.backward().items()}
    other = GPT(c, dtype="float64", kernels="fast" if kernels == "reference" else "reference")
    other.load_state_dict(model.state_dict())
    other.loss(tokens, targets)
    for k, v in other.backward().items():
        np.testing.assert_allclose(v, grads[k], rtol=0, atol=1e-12 * max(1.0, np.max(np.abs(grads[k]))), err_msg=k)
    h = 1e-6
    for name, p in model.params.items():
        entries = rng.choice(p.size, size=min(3, p.size), replace=False)
        fd = numerical_grad(lambda: model.loss(tokens, targets), p, h, entries)
        for idx in (np.unravel_index(e, p.shape) for e in entries):
            assert abs(fd[idx] - grads[name][idx]) < 1e-7, name


def test_post_norm_activation_and_delta_names():
    c = GPTConfig(vocab_size=11, context_length=8, d_model=8, n_heads=2, n_blocks=1, norm="rmsnorm",
                  mlp="swiglu", position_encoding="rope", bias=False, norm_placement="sandwich")
    model = GPT(c, dtype="float64", kernels="reference")
    tokens = np.arange(6)[None] % 11
    model.loss(tokens, tokens)
    model.backward(keep_deltas=True)
    acts, deltas = model.activations(), model.deltas()
    for n in ("4_post", "9_post"):
        assert acts[f"blocks.0.a{n}"].shape == (1, 6, 8) and deltas[f"blocks.0.Δ{n}"].shape == (1, 6, 8)
    w = model.params["blocks.0.ln2_post.weight"]
    a9 = acts["blocks.0.a9"]
    np.testing.assert_allclose(acts["blocks.0.a9_post"], a9 / np.sqrt(np.mean(a9 ** 2, -1, keepdims=True) + c.ln_eps) * w,
                               rtol=1e-13)
    # a10 = a5 + a9_post is one IEEE addition per entry on both sides (no dropout): the same bits
    np.testing.assert_array_equal(acts["blocks.0.a10"], acts["blocks.0.a5"] + acts["blocks.0.a9_post"])


@pytest.mark.parametrize("field, value, message", [
    ("qk_norm", "rms", "unknown qk_norm 'rms'"),
    ("norm_placement", "after", "unknown norm_placement 'after'"),
    ("rope_layers", (True,), "rope_layers must hold one bool per block (2"),
])
def test_config_refusals(field, value, message):
    fields = dict(config("head").to_dict(), **{field: value})
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        GPTConfig(**fields)


def test_rope_layers_need_rope_and_serialise():
    with pytest.raises(ValueError, match="rope_layers chooses the blocks RoPE turns, but position_encoding='none'"):
        GPTConfig(vocab_size=5, context_length=4, d_model=4, n_heads=1, n_blocks=2, position_encoding="none",
                  rope_layers=(True, False))
    import json

    c = config("proj", norm_placement="post")
    assert GPTConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert [c.uses_rope(i) for i in range(2)] == [True, False]


@pytest.mark.parametrize("placement, qk_norm", [("post", "proj"), ("sandwich", "head")])
def test_recompute_gives_the_same_bits(placement, qk_norm):
    """model.recompute (each block run again in the backward) keeps the norms' caches: the
    losses and gradients are the bits of a plain backward."""
    c = config(qk_norm, norm_placement=placement)
    tokens = np.random.default_rng(2).integers(0, 13, (2, 6))
    runs = []
    for recompute in (False, True):
        model = GPT(c, dtype="float64", seed=4)
        model.recompute = recompute
        loss = model.loss(tokens, np.roll(tokens, -1, 1))
        runs.append((loss, {k: np.array(v) for k, v in model.backward().items()}))
    assert runs[0][0] == runs[1][0]
    for k, g in runs[0][1].items():
        assert np.array_equal(g, runs[1][1][k]), k


def test_explain_rows_of_the_prelude_and_the_norms_after():
    """`pedestrian explain`: q/k norms as one row (N·(H + H_kv)·d_qk elements, 4 operations each
    forward and 8 backward, per row 4), the norms after the sublayers as a4_post and a9_post, and
    no norm at a2, a6 for "post"."""
    from pedestrian.paper.explain import explain_rows

    c = config("head", norm_placement="post")
    rows = {r.name: r for r in explain_rows(c, 2, 3)}
    assert rows["qk_norm"].fwd_flops == 6 * (H + H_KV) * D_QK * 4 + 6 * (H + H_KV) * 4
    assert rows["qk_norm"].bwd_flops == 6 * (H + H_KV) * D_QK * 8
    assert rows["a2"].fwd_flops == rows["a6"].fwd_flops == 0
    assert rows["a4_post"].fwd_flops == rows["a9_post"].fwd_flops == 6 * 8 * 4 + 6 * 4
    assert "blocks 1 of 2" in rows["rope"].forward

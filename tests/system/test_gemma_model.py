"""A GPT with Gemma's pieces switched on (``norm_offset``, ``embedding_scale``, GeGLU,
``logit_softcap``): the chain's forward and backward against finite differences, the fast
kernels against the reference layers, the fused head against the unfused one, the fused decode
step against the chain, the tied head reading the unscaled table; the config's checks.
(Against transformers' own Gemma models: tests/system/test_hf_gemma.py.)

Tolerances: float64 throughout. Fast against reference, fused against unfused: the same formulas
in another order, a few thousand roundings along a 2-block chain: ``1e-10`` of each tensor's
largest entry (tests/system/test_fast_path_property.py's argument). Finite differences:
tests/oracles/gradcheck.py (``RTOL_FD``). The decode step runs the chain's own kernels in the
chain's order: the same bits.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradcheck import H_STEP, numerical_grad
from pedestrian.config import GPTConfig
from pedestrian.model import GPT
from pedestrian.model.kv_cache import KVCache

GEMMA = dict(vocab_size=37, context_length=32, d_model=12, n_heads=3, n_blocks=2, n_kv_heads=1, d_head=5,
             d_qk=5, d_mlp=14, norm="rmsnorm", mlp="swiglu", activation="gelu_tanh", position_encoding="rope",
             bias=False, ln_eps=1e-6, norm_offset=1.0, embedding_scale=math.sqrt(12), logit_softcap=2.5)


def model(kernels="fast", seed=0, **kw):
    m = GPT(GPTConfig(**{**GEMMA, **kw}), dtype="float64", kernels=kernels, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for name, p in m.params.items():          # weights of order 1 (norms around 0), so every piece shows
        p[...] = (0.3 if p.ndim == 1 else 0.5) * rng.standard_normal(p.shape)
    return m


def batch(seed=2, B=2, T=9):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, GEMMA["vocab_size"], (B, T + 1))
    y = x[:, 1:].copy()
    y[0, -2:] = -100
    return x[:, :-1], y


def loss_and_grads(m, fused=True):
    m.fused_head = fused
    x, y = batch()
    loss = m.loss(x, y)
    return loss, {k: np.array(v) for k, v in m.backward().items()}


def close(a, b, what):
    scale = max(float(np.max(np.abs(b))), 1e-300)
    assert float(np.max(np.abs(np.asarray(a) - b))) <= 1e-10 * scale, what


@pytest.mark.parametrize("tied", [True, False])
def test_fast_reference_fused_and_unfused_agree(tied):
    runs = {}
    for kernels in ("fast", "reference"):
        for fused in (True, False):
            runs[kernels, fused] = loss_and_grads(model(kernels, tie_weights=tied), fused)
    want_loss, want = runs["reference", False]
    for key, (loss, grads) in runs.items():
        assert abs(loss - want_loss) <= 1e-12 * abs(want_loss), key
        assert set(grads) == set(want)
        for name in want:
            close(grads[name], want[name], f"{key} {name}")


@pytest.mark.parametrize("kernels", ["fast", "reference"])
def test_every_gemma_parameter_matches_finite_differences(kernels):
    """A few entries of every parameter kind: the norms' ``w`` (scaled by ``1 + w``), the token
    table (looked up times ``√d`` and read unscaled by the tied head), the GeGLU gate, the head's
    cap in between."""
    m = model(kernels)
    x, y = batch()
    m.fused_head = True
    m.loss(x, y)
    grads = {k: np.array(v) for k, v in m.backward().items()}
    rng = np.random.default_rng(9)
    for name in ("blocks.0.ln1.weight", "blocks.1.ln2.weight", "ln_final.weight", "tok_emb.weight",
                 "blocks.0.mlp_gate.weight", "blocks.1.mlp_expand.weight", "blocks.0.attn.q.weight"):
        p = m.params[name]
        entries = [np.ravel_multi_index(tuple(int(rng.integers(0, n)) for n in p.shape), p.shape) for _ in range(3)]
        fd = numerical_grad(lambda: m.loss(x, y), p, H_STEP, entries)
        for idx in (np.unravel_index(e, p.shape) for e in entries):
            assert abs(grads[name][idx] - fd[idx]) <= 1e-7 * max(1.0, abs(fd[idx])), (name, idx, grads[name][idx])


def test_the_tied_head_reads_the_unscaled_table_and_caps():
    """``a12 = c tanh(a11 W_tokᵀ / c)``: the head's product has no ``√d``; ``a1 = √d W_tok[a0]``."""
    m = model("reference")
    m.fused_head = False
    x, _ = batch()
    logits = np.asarray(m.forward(x))
    acts = m.activations()
    W = np.asarray(m.params["tok_emb.weight"])
    c = GEMMA["logit_softcap"]
    np.testing.assert_allclose(logits, c * np.tanh(np.asarray(acts["a11"]) @ W.T / c), rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(np.asarray(acts["a1"]), W[x] * math.sqrt(12))
    assert np.max(np.abs(logits)) < c


def test_the_fused_decode_step_is_the_chain_bit_for_bit():
    m = model("fast")
    prompt = batch(B=2, T=5)[0]
    steps = [np.array([[3], [4]]), np.array([[5, 6], [7, 8]])]
    out = {}
    for keep in (False, True):                               # False: the fused step; True: the chain
        cache = KVCache(m, 2)
        out[keep] = [np.array(m.forward(prompt, kv_cache=cache, keep_activations=keep))]
        out[keep] += [np.array(m.forward(s, kv_cache=cache, keep_activations=keep)) for s in steps]
    for a, b in zip(out[False], out[True]):
        np.testing.assert_array_equal(a, b)
    full = np.array(m.forward(np.concatenate([prompt, *steps], axis=1)))
    np.testing.assert_allclose(out[False][-1], full[:, -2:], rtol=0, atol=1e-12)


def test_the_norms_start_at_zero_and_the_config_round_trips():
    m = GPT(GPTConfig(**GEMMA), dtype="float64")
    assert np.all(np.asarray(m.params["blocks.0.ln1.weight"]) == 0.0)       # 1 + w = 1: a new model starts at x̂
    c = GPTConfig(**GEMMA, rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert GPTConfig.from_dict(c.to_dict()) == c
    assert c.rope_scaling.to_hf() == {"rope_type": "linear", "factor": 8.0}


@pytest.mark.parametrize("field,value,message", [
    ("norm_offset", float("nan"), "norm_offset must be a finite number"),
    ("embedding_scale", 0.0, "embedding_scale must be > 0"),
    ("logit_softcap", -1.0, "logit_softcap must be > 0"),
    ("logit_softcap", "30", "logit_softcap must be a finite number or None"),
    ("rope_local_base", 1.0, "rope_local_base must be > 1"),
    ("activation", "relu", "mlp='swiglu' gates with one of"),
])
def test_bad_gemma_fields_are_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{**GEMMA, field: value})


def test_offset_needs_rms_norm_and_local_base_needs_rope():
    with pytest.raises(ValueError, match="norm_offset=1.0 scales RMS norms"):
        GPTConfig(**{**GEMMA, "norm": "layernorm"})
    with pytest.raises(ValueError, match="rope_local_base is RoPE's base on the windowed layers"):
        GPTConfig(**{**GEMMA, "position_encoding": "none", "rope_local_base": 10_000.0})
    with pytest.raises(ValueError, match="rope_local_base is RoPE's base on the sliding-window layers"):
        GPTConfig(**{**GEMMA, "rope_local_base": 10_000.0})                     # (no window: no such layer)


def test_explain_names_the_gemma_pieces_and_counts_them():
    """``pedestrian explain``'s rows: the scaled lookup, the (1 + γ) norms, the GeGLU gate, the
    capped logits -- each with its elementwise FLOPs beyond the plain Llama row (explain's table)."""
    from pedestrian.paper.explain import ELEMENTWISE, explain_rows

    gemma, plain = GPTConfig(**GEMMA), GPTConfig(**{**GEMMA, "norm_offset": 0.0, "embedding_scale": None,
                                                     "logit_softcap": None, "activation": "silu"})
    rows = {r.name: r for r in explain_rows(gemma, 2, 8)}
    base = {r.name: r for r in explain_rows(plain, 2, 8)}
    N, V, m = 16, GEMMA["vocab_size"], GEMMA["d_mlp"]
    assert rows["a1"].forward.startswith("s·W_tok[a0]") and "(s Δ1)" in rows["a1"].backward
    assert rows["a8"].forward == "gelu(a7_gate) ∘ a7_up" and "1 + γ" in rows["a11"].params
    assert rows["a12"].forward.startswith("c·tanh(a11 W_tokᵀ/c)")
    assert rows["a12"].fwd_flops - base["a12"].fwd_flops == N * V * ELEMENTWISE["softcap"]["fwd"]
    assert rows["a8"].fwd_flops == N * m * ELEMENTWISE["geglu"]["fwd"]


def test_bf16_rounds_the_embedding_scale_to_bfloat16():
    """In a bf16 model the scale is bfloat16's (transformers' ``embed_scale`` buffer in the model's
    dtype): √3072 = 55.4256 is 55.5 there; float32 models keep float32(√d)."""
    torch = pytest.importorskip("torch")
    c = GPTConfig(**{**GEMMA, "d_model": 3072 // 256, "embedding_scale": math.sqrt(3072)})
    m = GPT(c, backend="torch", precision="bf16", seed=0)
    m.fused_head = False
    x, _ = batch()
    m.forward(torch.as_tensor(x))
    W = m.params["tok_emb.weight"].float()
    np.testing.assert_array_equal(m.activations()["a1"].float().numpy(), (W[torch.as_tensor(x)] * 55.5).numpy())
    assert float(torch.tensor(math.sqrt(3072), dtype=torch.bfloat16)) == 55.5

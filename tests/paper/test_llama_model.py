"""The whole Llama-style model (issue 33 item 2): RMS norm, the SwiGLU MLP, grouped-query
attention, RoPE with its base and Llama 3's frequency scaling, no biases or q/k/v biases
(Qwen2), tied or untied logits -- logits, loss and every parameter gradient against
transformers' own ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (float64, autograd), on both
kernel sets; the KV cache against full recompute; finite differences on one small config.

Hugging Face computes three things in float32 whatever the model's dtype: ``LlamaRMSNorm``
(upcast, then cast back), the rotary table (``inv_freq`` and the angles ``t·θ``) and, in its
eager attention, the softmax. :func:`hf_model` makes the float64 oracle float64 throughout: SDPA
attention (float64 in torch), the RMS norm's own formula without the casts, and the angles
formed in float64 from a float64 frequency table that is first checked against Hugging Face's own
float32 table (to float32 rounding; Llama 3's scaling included) -- so every case also tests
:func:`pedestrian.layers.rope.llama3_theta` against ``_compute_llama3_parameters``.
"""

from __future__ import annotations

import numpy as np
import pytest

from pedestrian import GPT
from pedestrian.config import GPTConfig
from pedestrian.model.kv_cache import KVCache

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pedestrian.interop.hf_llama_config import config_from_hf  # noqa: E402
from pedestrian.interop.hf_llama_tensors import llama_state_from_hf  # noqa: E402
from pedestrian.layers.rope import llama3_theta  # noqa: E402

TINY = dict(vocab_size=37, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
            max_position_embeddings=32, rms_norm_eps=1e-5)

#: name -> (family, HF config keywords)
CASES = {
    "gqa-4:2-untied": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "multi-query-tied": ("llama", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    "multi-head": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)),
    "head-dim-10": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=10,
                                  tie_word_embeddings=True)),
    "qwen2-biases": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama3-scaling": ("llama", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=24,
                                     tie_word_embeddings=True, rope_theta=500_000.0,
                                     rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                       high_freq_factor=4.0,
                                                       original_max_position_embeddings=8))),
}


def _hf_config(family, kw):
    kw = dict(kw)
    if "rope_theta" in kw or "rope_scaling" in kw:            # transformers 5: one rope_parameters dict
        params = dict(kw.pop("rope_scaling", None) or {"rope_type": "default"})
        params["rope_theta"] = kw.pop("rope_theta", 10_000.0)
        kw["rope_parameters"] = params
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    return cls(**TINY, **kw, attn_implementation="sdpa")


def _float64_rms_forward(self, x):
    """``LlamaRMSNorm.forward`` without its float32 casts (the same formula)."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def hf_model(family, kw, seed=0):
    """transformers' model of a case in float64 throughout (module docstring), its random weights
    (norm weights drawn away from 1, Qwen2's biases away from 0) and the pedestrian config."""
    hf_cfg = _hf_config(family, kw)
    torch.manual_seed(seed)
    hf = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[family](hf_cfg)
    hf = hf.double().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.2)
    config = config_from_hf(hf_cfg.to_dict())
    rotary = hf.model.rotary_emb
    j = np.arange(config.d_qk // 2, dtype=np.float64)
    theta = config.rope_base ** (-2.0 * j / config.d_qk)
    if config.rope_scaling is not None:
        theta = llama3_theta(theta, config.rope_scaling)
    np.testing.assert_allclose(theta, rotary.inv_freq.double().numpy(), rtol=4e-7, atol=0)  # HF's float32 table
    inv_freq = torch.as_tensor(theta)

    def rotary_forward(x, position_ids):
        angle = position_ids[..., None].double() * inv_freq                 # (B, T, d_qk/2) in float64
        emb = torch.cat((angle, angle), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    rotary.forward = rotary_forward
    for module in hf.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = _float64_rms_forward.__get__(module)
    return hf, config


def pedestrian_model(hf, config, kernels):
    model = GPT(config, dtype="float64", kernels=kernels)
    tensors = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    model.load_state_dict(llama_state_from_hf(tensors, config))
    return model


def _hf_grads(hf, config):
    """HF's gradients by pedestrian name (the same table as the weights, applied to ``.grad``)."""
    grads = {k: p.grad.numpy() for k, p in hf.named_parameters()}
    if config.tie_weights:
        grads.setdefault("model.embed_tokens.weight", grads.get("lm_head.weight"))
    return llama_state_from_hf({k: v for k, v in grads.items()
                                if not (config.tie_weights and k == "lm_head.weight")}, config)


def _batch(config, B=2, T=9, seed=1):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, size=(B, T))
    targets = rng.integers(0, config.vocab_size, size=(B, T))
    return tokens, targets


@pytest.mark.parametrize("kernels", ["reference", "fast"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_and_every_gradient_equal_transformers(case, kernels):
    family, kw = CASES[case]
    hf, config = hf_model(family, kw)
    model = pedestrian_model(hf, config, kernels)
    tokens, targets = _batch(config)
    out = hf(input_ids=torch.as_tensor(tokens), labels=None)
    logits_hf = out.logits
    loss_hf = torch.nn.functional.cross_entropy(logits_hf.reshape(-1, config.vocab_size),
                                                torch.as_tensor(targets).reshape(-1))
    loss_hf.backward()
    logits = np.array(model.forward(tokens))
    loss = model.loss(tokens, targets)
    grads = model.backward()
    # float64 chains of a few hundred operations on O(1) values: errors ~1e-14, bound 1e-10
    np.testing.assert_allclose(logits, logits_hf.detach().numpy(), rtol=0, atol=1e-10)
    assert abs(loss - loss_hf.item()) < 1e-11
    expected = _hf_grads(hf, config)
    assert set(expected) == set(grads)
    for name, g in grads.items():
        scale = max(1.0, float(np.max(np.abs(expected[name]))))
        np.testing.assert_allclose(g, expected[name], rtol=0, atol=1e-10 * scale, err_msg=name)


def test_qwen2_has_biases_on_q_k_v_only():
    hf, config = hf_model(*CASES["qwen2-biases"])
    biases = {n for n in GPT(config).params if n.endswith("bias")}
    assert biases == {f"blocks.{i}.attn.{h}.bias" for i in range(2) for h in "qkv"}


def test_llama3_scaling_changes_the_logits():
    """The scaling reaches the model: dropping it changes the logits (the case's wavelengths
    straddle all three bands at L = 8)."""
    family, kw = CASES["llama3-scaling"]
    hf, config = hf_model(family, kw)
    tokens, _ = _batch(config)
    a = pedestrian_model(hf, config, "reference").forward(tokens)
    import dataclasses

    plain = dataclasses.replace(config, rope_scaling=None)
    b = pedestrian_model(hf, plain, "reference").forward(tokens)
    assert np.max(np.abs(a - b)) > 1e-3


@pytest.mark.parametrize("kernels", ["reference", "fast"])
def test_kv_cache_generation_equals_full_recompute_with_gqa(kernels):
    hf, config = hf_model(*CASES["gqa-4:2-untied"])
    model = pedestrian_model(hf, config, kernels)
    tokens, _ = _batch(config, B=2, T=12)
    full = model.forward(tokens)
    cache = KVCache(model, batch_size=2)
    assert cache.keys[0].shape[1] == config.n_kv_heads == 2
    steps = [model.forward(tokens[:, :5], kv_cache=cache)]
    for t in range(5, 12):
        steps.append(model.forward(tokens[:, t:t + 1], kv_cache=cache))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kernels", ["reference", "fast"])
def test_swiglu_activation_and_delta_names(kernels):
    hf, config = hf_model(*CASES["gqa-4:2-untied"])
    model = pedestrian_model(hf, config, kernels)
    tokens, targets = _batch(config)
    model.loss(tokens, targets)
    model.backward(keep_deltas=True)
    acts, deltas = model.activations(), model.deltas()
    for i in range(config.n_blocks):
        assert f"blocks.{i}.a7" not in acts and f"blocks.{i}.Δ7" not in deltas
        for n in ("7_gate", "7_up"):
            assert acts[f"blocks.{i}.a{n}"].shape == (2, 9, config.d_mlp)
            assert deltas[f"blocks.{i}.Δ{n}"].shape == (2, 9, config.d_mlp)
        assert acts[f"blocks.{i}.P"].shape == (2, config.n_heads, 9, 9)
    a = acts["blocks.0.a7_gate"]
    np.testing.assert_allclose(acts["blocks.0.a8"], a / (1 + np.exp(-a)) * acts["blocks.0.a7_up"], rtol=1e-13)


def _central_differences(model, tokens, targets, grads, rng, h=1e-6):
    """Central differences of the float64 loss on three entries of every parameter against
    ``grads``: truncation O(h²) and rounding O(ε·loss/h) ~ 1e-10, bound 1e-7."""
    for name, p in model.params.items():
        if name not in grads:
            continue
        for flat_idx in rng.choice(p.size, size=min(3, p.size), replace=False):
            idx = np.unravel_index(flat_idx, p.shape)         # (views of the fused qkv: not reshaped)
            old = float(p[idx])
            p[idx] = old + h
            up = model.loss(tokens, targets)
            p[idx] = old - h
            down = model.loss(tokens, targets)
            p[idx] = old
            assert abs((up - down) / (2 * h) - grads[name][idx]) < 1e-7, name


def _small_config():
    return GPTConfig(vocab_size=11, context_length=8, d_model=8, n_heads=4, n_blocks=1, n_kv_heads=2,
                     d_head=3, d_qk=4, norm="rmsnorm", mlp="swiglu", d_mlp=6, position_encoding="rope",
                     bias=False, qkv_bias=True, tie_weights=True,
                     rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0,
                                       high_freq_factor=2.0, original_max_position_embeddings=4))


def test_finite_differences_on_a_small_llama():
    """Every parameter of a GQA 4:2, SwiGLU, RMS-norm, q/k/v-bias, Llama-3-scaled model with
    d_qk != d_head, by central differences (the chain itself, not the oracle)."""
    config = _small_config()
    model = GPT(config, dtype="float64", kernels="reference", seed=3)
    rng = np.random.default_rng(0)
    for name, p in model.params.items():
        p[...] = rng.normal(0.0, 0.5, size=p.shape) + (1.0 if "ln" in name else 0.0)
    tokens, targets = _batch(config, B=2, T=6, seed=4)
    model.loss(tokens, targets)
    grads = {k: np.array(v) for k, v in model.backward().items()}
    _central_differences(model, tokens, targets, grads, rng)


@pytest.mark.parametrize("kernels", ["reference", "fast"])
def test_lora_on_the_seven_projections_by_finite_differences(kernels):
    """LoRA on q, k, v (k and v adapters n_kv_heads·d_qk wide), attn_proj, the gate, up and
    down projections (Hugging Face's names): every adapter's gradient by central differences."""
    config = _small_config()
    model = GPT(config, dtype="float64", kernels=kernels, seed=3)
    rng = np.random.default_rng(1)
    for name, p in model.params.items():
        p[...] = rng.normal(0.0, 0.5, size=p.shape) + (1.0 if "ln" in name else 0.0)
    model.add_lora(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], rank=2,
                   alpha=1.5)
    for name, p in model.params.items():
        if "lora" in name:
            p[...] = rng.normal(0.0, 0.5, size=p.shape)
    assert model.params["blocks.0.attn.k.lora_U"].shape == (2, config.n_kv_heads * config.d_qk)
    tokens, targets = _batch(config, B=2, T=6, seed=4)
    model.loss(tokens, targets)
    grads = {k: np.array(v) for k, v in model.backward().items()}
    assert sorted({k.rsplit(".", 1)[0].split(".", 2)[-1] for k in grads}) == [
        "attn.k", "attn.q", "attn.v", "attn_proj", "mlp_contract", "mlp_expand", "mlp_gate"]
    _central_differences(model, tokens, targets, grads, rng)

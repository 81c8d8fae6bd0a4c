"""The Llama family as configuration: GPTConfig's norm / mlp / n_kv_heads / rope_scaling fields,
their validation, the parameter layout and counts (EQUATIONS.md's SmolLM2-135M figure, and
transformers' own LlamaForCausalLM / Qwen2ForCausalLM counts on tiny configs), the presets and
arch_fields, and flat.py's region table over the new layouts."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pedestrian.config import CONFIG_FIELDS, PRESETS, GPTConfig, RopeScaling, arch_fields, preset, swiglu_width
from pedestrian.model.layout import (LORA_LAYER_KINDS, count_params, fc_layers, lora_ranks, lora_specs, param_specs,
                                     resolve_lora_targets)

TINY = dict(vocab_size=50, context_length=16, d_model=24, n_heads=4, n_blocks=2)
LLAMA = dict(norm="rmsnorm", mlp="swiglu", position_encoding="rope", bias=False, d_mlp=40)
L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8}


def test_defaults_are_gpt2():
    c = GPTConfig(**TINY)
    assert (c.norm, c.mlp, c.n_kv_heads, c.rope_scaling, c.activation) == ("layernorm", "standard", 4, None,
                                                                             "gelu_tanh")


def test_swiglu_defaults_to_silu_and_refuses_other_activations():
    """The gated MLP gates with silu (SwiGLU) or gelu_tanh (Gemma's GeGLU), nothing else."""
    assert GPTConfig(**TINY, mlp="swiglu").activation == "silu"
    assert GPTConfig(**TINY, mlp="swiglu", activation="gelu_tanh").activation == "gelu_tanh"
    with pytest.raises(ValueError, match=r"mlp='swiglu' gates with one of \('silu', 'gelu_tanh'\).*got activation='gelu'"):
        GPTConfig(**TINY, mlp="swiglu", activation="gelu")


@pytest.mark.parametrize("field, value, message", [
    ("norm", "batchnorm", "unknown norm 'batchnorm'; choose one of"),
    ("mlp", "geglu", "unknown mlp 'geglu'; choose one of"),
    ("n_kv_heads", 3, "n_kv_heads must be a positive integer dividing n_heads=4"),
    ("n_kv_heads", 0, "n_kv_heads must be a positive integer dividing n_heads=4"),
    ("n_kv_heads", True, "n_kv_heads must be a positive integer dividing n_heads=4"),
    ("rope_scaling", L3, "rope_scaling scales RoPE's frequencies but position_encoding='learned'"),
    ("rope_scaling", 8.0, "rope_scaling must be None or a dict like"),
])
def test_bad_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message) as err:
        GPTConfig(**TINY, **{field: value})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change, message", [
    (dict(rope_type="yarn"), "rope_type='yarn' is not implemented"),
    (dict(factor=0.5), "factor must be >= 1"),
    (dict(low_freq_factor=4.0, high_freq_factor=1.0), "0 < low_freq_factor < high_freq_factor"),
    (dict(original_max_position_embeddings=0), "original_max_position_embeddings must be a positive integer"),
    (dict(beta=1.0), r"unknown \['beta'\]"),
    (dict(factor=None), "factor must be a finite number"),
])
def test_rope_scaling_validation(change, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**TINY, position_encoding="rope", rope_scaling={**L3, **change})
    with pytest.raises(ValueError, match=r"missing \['factor'\]"):
        RopeScaling.from_value({k: v for k, v in L3.items() if k != "factor"})


def test_rope_scaling_is_frozen_hashable_and_round_trips_through_json():
    c = GPTConfig(**TINY, **LLAMA, rope_scaling=L3)
    assert isinstance(c.rope_scaling, RopeScaling) and c.rope_scaling.factor == 8.0
    assert c == GPTConfig(**TINY, **LLAMA, rope_scaling=RopeScaling(8, 1, 4, 8)) and hash(c) == hash(
        GPTConfig(**TINY, **LLAMA, rope_scaling=dict(L3, type="llama3")))
    back = GPTConfig.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back == c
    assert c.rope_scaling.to_hf() == L3


def test_old_checkpoint_dicts_still_load():
    d = GPTConfig(**TINY).to_dict()
    for k in ("norm", "mlp", "n_kv_heads", "rope_scaling"):
        d.pop(k)
    assert GPTConfig.from_dict(d) == GPTConfig(**TINY)


def test_new_fields_are_user_settable():
    assert {"norm", "mlp", "n_kv_heads"} <= set(CONFIG_FIELDS)
    assert "mlp_gate" in LORA_LAYER_KINDS


def test_smollm2_135m_count():
    """EQUATIONS.md: SmolLM2-135M's shape has 134,515,008 parameters."""
    assert count_params(preset("smollm2-135m")) == 134_515_008


def test_gpt2_counts_unchanged():
    assert [count_params(preset(n)) for n in ("gpt2", "gpt2-untied", "paper-minimal")] == [
        124_439_808, 163_087_441, 85_120_849]


def test_llama_layout_names_and_shapes():
    c = GPTConfig(**TINY, **LLAMA, n_kv_heads=2, d_head=8)
    specs = {s.name: (s.shape, s.kind) for s in param_specs(c)}
    block0 = [n for n in specs if n.startswith("blocks.0.")]
    assert block0 == ["blocks.0.ln1.weight", "blocks.0.attn.q.weight", "blocks.0.attn.k.weight",
                      "blocks.0.attn.v.weight", "blocks.0.attn_proj.weight", "blocks.0.ln2.weight",
                      "blocks.0.mlp_gate.weight", "blocks.0.mlp_expand.weight", "blocks.0.mlp_contract.weight"]
    assert specs["blocks.0.attn.q.weight"][0] == (24, 32) and specs["blocks.0.attn.k.weight"][0] == (24, 16)
    assert specs["blocks.0.attn.v.weight"][0] == (24, 16) and specs["blocks.0.attn_proj.weight"][0] == (32, 24)
    assert specs["blocks.0.mlp_gate.weight"] == ((24, 40), "mlp")
    assert specs["blocks.0.mlp_contract.weight"][0] == (40, 24)
    assert specs["ln_final.weight"] == ((24,), "rmsnorm") and "ln_final.bias" not in specs
    assert "pos_emb.weight" not in specs and "logits.weight" not in specs


def test_rmsnorm_has_no_bias_even_with_bias():
    names = [s.name for s in param_specs(GPTConfig(**TINY, norm="rmsnorm"))]
    assert "blocks.0.mlp_expand.bias" in names and not any(n.endswith("ln1.bias") or n == "ln_final.bias"
                                                           for n in names)


def test_lora_kinds_cover_the_gate():
    c = GPTConfig(**TINY, **LLAMA, n_kv_heads=1)
    layers = [n for n, _, _ in fc_layers(c)]
    assert len(layers) == 7 * c.n_blocks + 1
    assert resolve_lora_targets(c, "mlp_gate") == ["blocks.0.mlp_gate", "blocks.1.mlp_gate"]
    k = {s.name: s.shape for s in lora_specs(c, ["k"], 2)}
    assert k["blocks.0.attn.k.lora_U"] == (2, 6)                # one key head of width 6
    hf_names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert resolve_lora_targets(c, hf_names) == layers[:-1]     # PEFT's Llama target_modules
    ranks = lora_ranks(c, hf_names, 2, {"gate_proj": 4})
    assert ranks["blocks.1.mlp_gate"] == 4 and ranks["blocks.1.mlp_expand"] == 2
    with pytest.raises(ValueError, match="unknown LoRA target 'c_attn'.*'q_proj'"):
        resolve_lora_targets(c, "c_attn")
    assert resolve_lora_targets(GPTConfig(**TINY), "mlp_gate") == []   # a standard MLP has none


def test_swiglu_width_and_arch_fields():
    assert swiglu_width(576) == 1536 and swiglu_width(128) == 344 and swiglu_width(4096, 256) == 11008
    f = arch_fields("llama", 128, 4)
    assert f["n_kv_heads"] == 2 and f["d_mlp"] == 344 and f["norm"] == "rmsnorm" and not f["bias"]
    assert arch_fields("llama", 96, 3)["n_kv_heads"] == 3 and arch_fields("gpt2", 128, 4) == {}
    with pytest.raises(ValueError, match="unknown arch 'mamba'"):
        arch_fields("mamba", 128, 4)
    c = preset("llama-char")
    assert dataclasses.replace(c, **arch_fields("llama", 128, 4)) == c
    assert {k: v for k, v in PRESETS["llama-char"].items() if k in TINY} == {
        k: v for k, v in PRESETS["char-small"].items() if k in TINY}


# --------------------------------------------------------------------- against transformers' counts
HF_TINY = dict(vocab_size=50, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
               max_position_embeddings=16)
COUNT_CASES = {
    "gqa-4:2-tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True), dict(n_kv_heads=2)),
    "mqa-untied": ("llama", dict(num_key_value_heads=1), dict(n_kv_heads=1, tie_weights=False)),
    "mha-untied": ("llama", dict(num_key_value_heads=4), dict(tie_weights=False)),
    "head_dim-10": ("llama", dict(num_key_value_heads=2, head_dim=10, tie_word_embeddings=True),
                    dict(n_kv_heads=2, d_head=10)),
    "llama-all-biases": ("llama", dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True),
                         dict(n_kv_heads=2, bias=True, tie_weights=False, logits_bias=False)),
    "qwen2-qkv-bias-tied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True),
                            dict(n_kv_heads=2, qkv_bias=True)),
    "mistral-untied": ("mistral", dict(num_key_value_heads=2, sliding_window=None),
                       dict(n_kv_heads=2, tie_weights=False)),
}


@pytest.mark.parametrize("case", list(COUNT_CASES))
def test_counts_equal_transformers(case):
    transformers = pytest.importorskip("transformers")
    family, hf_kw, ped_kw = COUNT_CASES[case]
    cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM")}[family]
    cfg = getattr(transformers, cls[0])(**HF_TINY, **hf_kw)
    hf = getattr(transformers, cls[1])(cfg)
    c = GPTConfig(**TINY, **{**LLAMA, **ped_kw})
    assert count_params(c) == hf.num_parameters()
    assert sorted(s.size for s in param_specs(c)) == sorted(
        p.numel() for p in hf.parameters())                      # tied: one embedding in both


# --------------------------------------------------------------------- flat.py's region table
def _regions_cover(c):
    from pedestrian.model.params import base_regions

    specs = {s.name: s.shape for s in param_specs(c)}
    seen = {}
    for shape, _, members in base_regions(c):
        for name, cols in members:
            seen[name] = shape if cols is None else ((shape[0], cols[1] - cols[0]) if len(shape) == 2
                                                     else (cols[1] - cols[0],))
    return seen == specs


def test_base_regions_cover_llama_layout_with_all_heads():
    """RMS norm (no bias), the SwiGLU gate and q, k, v biases alone fit flat.py's table as it is."""
    assert _regions_cover(GPTConfig(**TINY, **LLAMA, qkv_bias=True))
    assert _regions_cover(GPTConfig(**TINY, **LLAMA, d_head=10, tie_weights=False))


def test_base_regions_cover_grouped_query_attention():
    assert _regions_cover(GPTConfig(**TINY, **LLAMA, n_kv_heads=2))

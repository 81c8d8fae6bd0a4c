"""Hugging Face Llama / Qwen2 / Mistral configs and tensors <-> pedestrian, at the dict level
(the model chain does not run these yet): transformers builds every config, model and file."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from pedestrian.config import GPTConfig  # noqa: E402
from pedestrian.model.layout import param_specs  # noqa: E402
from pedestrian.interop.hf import open_hf_weights  # noqa: E402
from pedestrian.interop.hf_llama_config import (HF_DEFAULTS, config_from_hf, config_to_hf,  # noqa: E402
                                                export_family, hf_family)
from pedestrian.interop.hf_llama_tensors import llama_state_from_hf, llama_state_to_hf  # noqa: E402

TINY = dict(vocab_size=50, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
            max_position_embeddings=32)
L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16}
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM")}
# id -> (family, HF config overrides)
CASES = {
    "llama-gqa-4:2-tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5)),
    "llama-mqa-untied": ("llama", dict(num_key_value_heads=1)),
    "llama-mha-theta5e5": ("llama", dict(num_key_value_heads=4, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 500000.0})),
    "llama-head_dim10": ("llama", dict(num_key_value_heads=2, head_dim=10, tie_word_embeddings=True)),
    "llama-llama3-scaling": ("llama", dict(num_key_value_heads=2, rope_parameters={**L3, "rope_theta": 5e5})),
    "llama-all-biases": ("llama", dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True)),
    "qwen2-biases-tied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-untied": ("qwen2", dict(num_key_value_heads=1)),
    "qwen2-head_dim10": ("qwen2", dict(num_key_value_heads=2, head_dim=10)),   # Qwen2 reads head_dim if present
    "mistral-no-window": ("mistral", dict(num_key_value_heads=2, sliding_window=None, head_dim=8)),
}


def hf_model(case, seed=0):
    family, kw = CASES[case]
    torch.manual_seed(seed)
    cfg = getattr(transformers, CLASSES[family][0])(**TINY, **kw)
    model = getattr(transformers, CLASSES[family][1])(cfg).eval()
    with torch.no_grad():                      # norms away from 1 so a swapped norm would show
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p))
    return model


def hf_dict(model) -> dict:
    return json.loads(model.config.to_json_string())


def np_state(model) -> dict:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("case", list(CASES))
def test_config_from_hf(case):
    family, kw = CASES[case]
    model = hf_model(case)
    c = config_from_hf(hf_dict(model))
    hc = model.config
    assert hf_family(hf_dict(model)) == family
    assert (c.vocab_size, c.d_model, c.n_blocks, c.n_heads, c.n_kv_heads, c.d_head, c.d_qk, c.d_mlp,
            c.context_length) == (hc.vocab_size, hc.hidden_size, hc.num_hidden_layers, hc.num_attention_heads,
                                  hc.num_key_value_heads, hc.head_dim if getattr(hc, "head_dim", None) else 6,
                                  hc.head_dim if getattr(hc, "head_dim", None) else 6, hc.intermediate_size,
                                  hc.max_position_embeddings)
    assert (c.norm, c.mlp, c.activation, c.position_encoding) == ("rmsnorm", "swiglu", "silu", "rope")
    assert c.ln_eps == hc.rms_norm_eps and c.tie_weights == hc.tie_word_embeddings
    assert c.rope_base == hc.rope_parameters["rope_theta"]
    assert (c.rope_scaling is None) == (hc.rope_parameters["rope_type"] == "default")
    if c.rope_scaling is not None:
        assert c.rope_scaling.to_hf() == {k: hc.rope_parameters[k] for k in L3}
    assert c.qkv_bias == (family == "qwen2" or kw.get("attention_bias", False))
    assert c.bias == kw.get("mlp_bias", False) and not c.logits_bias


@pytest.mark.parametrize("case", list(CASES))
def test_state_from_hf_and_back(case):
    model = hf_model(case, seed=1)
    c = config_from_hf(hf_dict(model))
    hf = np_state(model)
    state = llama_state_from_hf(hf, c)
    specs = {s.name: s.shape for s in param_specs(c)}
    assert {k: v.shape for k, v in state.items()} == specs
    i = c.n_blocks - 1
    w = model.model.layers[i]
    pairs = {f"blocks.{i}.attn.k.weight": w.self_attn.k_proj.weight.T,
             f"blocks.{i}.attn_proj.weight": w.self_attn.o_proj.weight.T,
             f"blocks.{i}.mlp_gate.weight": w.mlp.gate_proj.weight.T,
             f"blocks.{i}.mlp_expand.weight": w.mlp.up_proj.weight.T,
             f"blocks.{i}.mlp_contract.weight": w.mlp.down_proj.weight.T,
             f"blocks.{i}.ln2.weight": w.post_attention_layernorm.weight, "ln_final.weight": model.model.norm.weight,
             "tok_emb.weight": model.model.embed_tokens.weight}
    if c.qkv_bias:
        pairs[f"blocks.{i}.attn.v.bias"] = w.self_attn.v_proj.bias
    if not c.tie_weights:
        pairs["logits.weight"] = model.lm_head.weight.T
    for name, t in pairs.items():
        np.testing.assert_array_equal(state[name], t.detach().numpy(), err_msg=name)
    back = llama_state_to_hf(state, c)
    expected = {k: v for k, v in hf.items() if not (c.tie_weights and k == "lm_head.weight")}
    assert back.keys() == expected.keys()
    for k in back:
        np.testing.assert_array_equal(back[k], expected[k], err_msg=k)
        assert back[k].flags.c_contiguous


@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_in_transformers_with_the_same_logits(case, tmp_path):
    """pedestrian's config.json + tensors -> transformers.from_pretrained: the same model (every
    tensor and the logits equal), so rope, eps, head widths and biases are read as written."""
    from safetensors.numpy import save_file

    model = hf_model(case, seed=2)
    c = config_from_hf(hf_dict(model))
    state = llama_state_from_hf(np_state(model), c)
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(c)))
    save_file(llama_state_to_hf(state, c), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    # a Mistral without a sliding window is a Llama: it is written as one (same logits)
    expected = transformers.LlamaForCausalLM if CASES[case][0] == "mistral" else type(model)
    assert type(back) is expected
    assert config_from_hf(hf_dict(back)) == c
    assert back.state_dict().keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, rtol=0, atol=0, msg=k)
    ids = torch.tensor([[1, 5, 7, 5, 2, 9, 30, 31, 1, 1, 40, 2]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("dtype, code", [(torch.bfloat16, "BF16"), (torch.float16, "F16")])
@pytest.mark.parametrize("shard", [None, "20KB"])
def test_half_precision_files_load_exactly(dtype, code, shard, tmp_path):
    """A file transformers writes in bfloat16 / float16 (one file or shards) reads back as the
    float32 widening of exactly the values torch holds (bfloat16 = the upper 16 bits)."""
    model = hf_model("llama-gqa-4:2-tied", seed=3).to(dtype)
    kw = {} if shard is None else {"max_shard_size": shard}
    model.save_pretrained(tmp_path, **kw)
    assert (tmp_path / ("model.safetensors" if shard is None else "model.safetensors.index.json")).is_file()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) == (0 if shard is None else 2)
    weights = open_hf_weights(tmp_path)
    c = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert set(weights.dtypes.values()) == {code}
    tensors = {k: weights[k] for k in weights.shapes}
    for k, v in model.state_dict().items():
        if k in tensors:
            assert tensors[k].dtype in (np.float32, np.float16)
            np.testing.assert_array_equal(tensors[k].astype(np.float32), v.detach().float().numpy(), err_msg=k)
    state = llama_state_from_hf(tensors, c)
    np.testing.assert_array_equal(state["blocks.1.mlp_gate.weight"].astype(np.float32),
                                  model.model.layers[1].mlp.gate_proj.weight.detach().float().numpy().T)


def test_rope_layout_matches_hf_rotate_half():
    """HF's q after apply_rotary_pos_emb equals pedestrian's rope_forward on the mapped weights:
    both pair feature j with j + head_dim/2, so no permutation. The angles differ only by HF's
    float32 arithmetic: |Δangle| <= T·2^-24 rad on unit-size features (T = 12)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from pedestrian.layers.rope import rope_forward

    model = hf_model("llama-mha-theta5e5", seed=4).double()
    c = config_from_hf(hf_dict(model))
    state = llama_state_from_hf({k: v.detach().numpy() for k, v in model.state_dict().items()}, c)
    x = np.random.default_rng(0).standard_normal((1, 12, c.d_model))
    H, dh = c.n_heads, c.d_head
    q = x @ state["blocks.0.attn.q.weight"]
    k = x @ state["blocks.0.attn.k.weight"]
    v = x @ state["blocks.0.attn.v.weight"]
    ours, _ = rope_forward(np.concatenate([q, k, v], axis=-1), H, dh, base=c.rope_base)
    pos = torch.arange(12)[None]
    cos, sin = LlamaRotaryEmbedding(model.config)(torch.zeros(1, dtype=torch.float64), pos)
    split = lambda a: torch.from_numpy(a).view(1, 12, H, dh).transpose(1, 2)   # (B, H, T, dh)
    hq, hk = apply_rotary_pos_emb(split(q), split(k), cos.double(), sin.double())
    back = lambda t: t.transpose(1, 2).reshape(1, 12, H * dh).numpy()
    scale = np.abs(np.concatenate([q, k], -1)).max()
    assert np.abs(ours[..., :H * dh] - back(hq)).max() <= 12 * 2.0**-24 * 4 * scale
    assert np.abs(ours[..., H * dh:2 * H * dh] - back(hk)).max() <= 12 * 2.0**-24 * 4 * scale
    # an interleaved (GPT-J) pairing would be far off: the test can tell the two apart
    perm = np.arange(dh).reshape(2, dh // 2).T.reshape(-1)
    q_perm = q.reshape(1, 12, H, dh)[..., perm].reshape(1, 12, H * dh)
    wrong, _ = rope_forward(np.concatenate([q_perm, k, v], -1), H, dh, base=c.rope_base)
    assert np.abs(wrong[..., :H * dh].reshape(1, 12, H, dh)[..., np.argsort(perm)].reshape(1, 12, -1)
                  - back(hq)).max() > 1e-3 * scale


# ------------------------------------------------------------------------------ older config.json files
def test_legacy_rope_keys_and_nanotron_extras():
    """SmolLM2's config.json (transformers 4.x): rope_theta and rope_scaling at the top, and the
    nanotron keys rope_interleaved / is_llama_config, which transformers ignores."""
    smol = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
            "intermediate_size": 1536, "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
            "head_dim": 64, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 100000,
            "rope_scaling": None, "rope_interleaved": False, "is_llama_config": True, "pretraining_tp": 1,
            "tie_word_embeddings": True, "vocab_size": 49152, "torch_dtype": "bfloat16", "hidden_act": "silu"}
    c = config_from_hf(smol)
    assert (c.rope_base, c.rope_scaling, c.n_kv_heads, c.d_head) == (100000.0, None, 3, 64)
    from pedestrian.config import preset
    from pedestrian.model.layout import count_params

    assert count_params(c) == count_params(preset("smollm2-135m")) == 134_515_008
    llama32 = dict(smol, rope_theta=500000.0, rope_scaling={"factor": 32.0, "high_freq_factor": 4.0,
                                                             "low_freq_factor": 1.0, "rope_type": "llama3",
                                                             "original_max_position_embeddings": 8192})
    assert config_from_hf(llama32).rope_scaling.factor == 32.0
    assert config_from_hf(dict(llama32, rope_scaling=dict(llama32["rope_scaling"], type="llama3"))) == \
        config_from_hf(llama32)
    no_type = {k: v for k, v in smol.items() if k != "model_type"}
    assert config_from_hf(no_type) == c
    with pytest.raises(ValueError, match=r"no model_type and architectures=\['Qwen2MoeForCausalLM'\]"):
        config_from_hf(dict(no_type, architectures=["Qwen2MoeForCausalLM"]))


def test_defaults_match_transformers():
    """Keys a config.json leaves out take the values transformers' classes give them."""
    for family, (cls, _) in CLASSES.items():
        hf = getattr(transformers, cls)()
        for key, value in HF_DEFAULTS[family].items():
            if key in ("rope_theta", "layer_types") or (family, key) == ("qwen2", "sliding_window"):
                continue                  # Qwen2Config nulls sliding_window without use_sliding_window
            got = getattr(hf, key, None)
            if value is None and key == "num_key_value_heads":
                assert got == hf.num_attention_heads
            elif value is None and key == "head_dim":
                assert got in (None, hf.hidden_size // hf.num_attention_heads)
            else:
                assert got == value, (family, key)
        assert hf.rope_parameters["rope_theta"] == 10000.0


# ------------------------------------------------------------------------------ refused settings
REFUSED = [
    ("llama", dict(hidden_act="gelu"), "hidden_act='gelu' is not implemented"),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}),
     "rope_type='yarn' is not implemented"),
    ("llama", dict(rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}),
     "rope_type='linear' is not implemented"),
    ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5 is not implemented"),
    ("llama", dict(attention_bias=True), "attention_bias=true without mlp_bias=true"),
    ("llama", dict(mlp_bias=True), "mlp_bias=true without attention_bias=true"),
    ("llama", dict(num_local_experts=8), "num_local_experts=8 is not implemented"),
    ("llama", dict(is_encoder_decoder=True), "is_encoder_decoder=True is not implemented"),
    ("llama", dict(num_key_value_heads=3), "n_kv_heads must be a positive integer dividing n_heads=4"),
    ("mistral", dict(sliding_window=0), "sliding_window=0 must be a positive integer or null"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=0), "sliding_window=0 must be a positive integer or null"),
    ("qwen2", dict(use_sliding_window=True, max_window_layers="1"), "max_window_layers='1' must be a layer index"),
    ("qwen2", dict(layer_types=["full_attention", "sliding_attention"]),
     "layer_types names 'sliding_attention' layers with use_sliding_window=False"),
    ("llama", dict(layer_types=["full_attention", "sliding_attention"]), "layer_types contains 'sliding_attention'"),
    ("deepseek_v3", dict(), "model_type='deepseek_v3' is not implemented"),
    ("llama", dict(rope_parameters={"rope_type": "llama3", "factor": 0.5, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "rope_theta": 1e4}), "factor must be >= 1"),
]


@pytest.mark.parametrize("family, change, message", REFUSED, ids=[m[:40] for _, _, m in REFUSED])
def test_refused_with_one_line(family, change, message):
    d = dict(TINY, model_type=family, **change)
    if family == "mistral" and "sliding_window" not in change:
        d.pop("sliding_window", None)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        config_from_hf(d, source="x/config.json")
    assert "\n" not in str(err.value) and str(err.value).startswith("x/config.json: ")


def test_qwen2_sliding_window_is_irrelevant_without_use_sliding_window():
    assert config_from_hf(dict(TINY, model_type="qwen2", num_key_value_heads=2, sliding_window=4096,
                                max_window_layers=1)).qkv_bias
    # switched on, but from layer 28 on (Qwen2Config's default max_window_layers) of 2: no layer slides
    kw = dict(num_key_value_heads=2, use_sliding_window=True)
    assert config_from_hf(dict(TINY, model_type="qwen2", **kw)).qkv_bias
    layers = transformers.Qwen2Config(**{k: v for k, v in TINY.items() if k != "model_type"}, **kw).layer_types
    assert set(layers) == {"full_attention"}


def test_export_refuses_what_no_llama_has_and_gpt2_refuses_llama():
    from pedestrian.interop.hf_config import export_problems

    base = config_from_hf(dict(TINY, model_type="llama", num_key_value_heads=2))
    import dataclasses

    for change, message in [(dict(norm="layernorm"), "norm='layernorm'"), (dict(mlp="standard", activation=None),
                            "mlp='standard'"), (dict(position_encoding="learned"), "position_encoding='learned'"),
                            (dict(d_qk=4), "d_qk=4 differs from d_head=6"),
                            (dict(bias=True, qkv_bias=False), "bias=True with qkv_bias=False")]:
        with pytest.raises(ValueError, match=message):
            export_family(dataclasses.replace(base, **change))
        with pytest.raises(ValueError, match=message):
            llama_state_to_hf({}, dataclasses.replace(base, **change))
    assert export_family(base) == "llama" and export_family(dataclasses.replace(base, qkv_bias=True)) == "qwen2"
    problems = " ".join(export_problems(base))
    assert "norm='rmsnorm'" in problems and "mlp='swiglu'" in problems and "n_kv_heads=2" in problems


def test_tensor_problems_listed_at_once():
    model = hf_model("llama-gqa-4:2-tied", seed=5)
    c = config_from_hf(hf_dict(model))
    hf = np_state(model)
    hf.pop("model.norm.weight")
    hf["model.layers.0.self_attn.k_proj.weight"] = np.zeros((24, 24), np.float32)
    hf["model.layers.0.self_attn.o_proj.bias"] = np.zeros(24, np.float32)
    with pytest.raises(ValueError) as err:
        llama_state_from_hf(hf, c, source="w.safetensors")
    msg = str(err.value)
    assert "1 missing: model.norm.weight" in msg and "1 unexpected: model.layers.0.self_attn.o_proj.bias" in msg
    assert "model.layers.0.self_attn.k_proj.weight (24, 24) (config.json implies (12, 24))" in msg
    good = np_state(model)
    good["lm_head.weight"] = good["model.embed_tokens.weight"] + 1
    with pytest.raises(ValueError, match="tie_word_embeddings=true but lm_head.weight differs"):
        llama_state_from_hf(good, c)

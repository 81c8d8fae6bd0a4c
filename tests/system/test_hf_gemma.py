"""Gemma 2 and Gemma 3 (text) folders in and out, whole models (issue 48): transformers writes every
folder and is the float64 oracle (tests/oracles/gemma_oracles.py) for the logits, the loss and
every gradient, greedy generation past the window, the export read back and PEFT adapters; the
family entries (interop/family_gemma.py) against transformers' config classes; each refusal.

The tiny configs switch every Gemma piece on where it shows: three layers (window, global,
window), a window of 5 tokens in sequences of 24, ``query_pre_attn_scalar`` other than
``head_dim``, Gemma 2's soft-caps small enough to bend the scores (5) and the logits (3), Gemma
3's q/k norms and its global layers' linear RoPE scaling (factor 8) beside a local base.

Tolerances: float64 compares the same sums in another order: 1e-10 of each tensor's scale
(tests/system/test_hf_families.py's argument); float32 exports: 2e-5 of the logits' scale.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from family_oracles import SEVEN, check_export_round_trip, check_peft_both_ways, rel_err
from gemma_oracles import CLASSES, as_float64, hf_logits, hf_model
from hf_fixtures import TEXT, tiny_tokenizer, torch, transformers

from pedestrian import GPT, cli
from pedestrian.generation.generate import generate
from pedestrian.generation.sampling import Sampling
from pedestrian.interop.families import FAMILIES, export_family, hf_family
from pedestrian.interop.hf import load_hf_model
from pedestrian.interop.hf_llama_config import config_from_hf
from pedestrian.interop.hf_llama_tensors import llama_state_from_hf

peft = pytest.importorskip("peft")
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

V = 300
TINY = dict(hidden_size=24, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
            max_position_embeddings=64, rms_norm_eps=1e-5, sliding_window=5, tie_word_embeddings=True)
CASES = {
    "gemma2": dict(head_dim=6, query_pre_attn_scalar=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3_text": dict(head_dim=8, query_pre_attn_scalar=6, sliding_window_pattern=2,
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e4},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}}),
}
X = np.random.default_rng(5).integers(1, V, size=(2, 24))          # (no id 0: the pad row gets no gradient in HF)
REL64, REL32 = 1e-10, 2e-5


def save_dir(model, d):
    model.save_pretrained(str(d))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer().hf, eos_token="<|endoftext|>")
    fast.save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma_dirs")
    return {f: (save_dir(hf_model(f, {**TINY, **kw}, vocab_size=V), tmp / f), {**TINY, **kw}) for f, kw in CASES.items()}


def oracle(folders, family):
    return hf_model(family, folders[family][1], vocab_size=V)


# ------------------------------------------------------------------------------------ the entries
@pytest.mark.parametrize("family", list(CLASSES))
def test_defaults_and_layer_types_match_transformers(family):
    """Keys a config.json leaves out take transformers' class defaults; the layer types and the
    RoPE bases it derives are the ones read."""
    hf = getattr(transformers, CLASSES[family][0])()
    skip = {"rope_theta", "rope_local_base_freq", "sliding_window_pattern", "layer_types", "hidden_act",
            "use_bidirectional_attention"}
    for key, value in FAMILIES[family].defaults.items():
        if key not in skip:
            assert getattr(hf, key, None) == value, (family, key)
    config = config_from_hf(hf.to_dict())
    assert list(config.layer_types) == hf.layer_types
    assert config.attn_scale == hf.query_pre_attn_scalar ** -0.5
    assert config.embedding_scale == math.sqrt(hf.hidden_size) and config.norm_offset == 1.0
    assert (config.logit_softcap, config.attn_softcap) == (hf.final_logit_softcapping, hf.attn_logit_softcapping)
    if family == "gemma3_text":
        assert (config.rope_base, config.rope_local_base) == (hf.rope_parameters["full_attention"]["rope_theta"],
                                                              hf.rope_parameters["sliding_attention"]["rope_theta"])
        assert config.qk_norm == "head"
    assert hf_family({"architectures": [CLASSES[family][1]]}) == family


def test_older_hub_keys_are_read_as_transformers_reads_them():
    """Gemma 3 configs on the Hub say rope_theta, rope_local_base_freq, rope_scaling and
    sliding_window_pattern (no layer_types): transformers' class turns them into per-type RoPE
    parameters and layer types; the same numbers here."""
    old = dict(TINY, model_type="gemma3_text", vocab_size=V, head_dim=8, query_pre_attn_scalar=8, rope_theta=1e6,
               rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
               sliding_window_pattern=3, num_hidden_layers=6, hidden_activation="gelu_pytorch_tanh")
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in old.items() if k != "model_type"})
    ours = config_from_hf(old)
    assert list(ours.layer_types) == hf.layer_types
    assert ours.rope_base == hf.rope_parameters["full_attention"]["rope_theta"]
    assert ours.rope_local_base == hf.rope_parameters["sliding_attention"]["rope_theta"]
    assert ours.rope_scaling.factor == hf.rope_parameters["full_attention"]["factor"]
    assert [ours.rope_of(i) for i in range(6)][:3] == [(1e4, None), (1e4, None), (1e6, ours.rope_scaling)]


# ------------------------------------------------------------------------------------ the model
@pytest.mark.parametrize("kernels", ["reference", "fast"])
@pytest.mark.parametrize("family", list(CASES))
def test_logits_loss_and_every_gradient_equal_transformers(folders, family, kernels):
    d, _ = folders[family]
    model = load_hf_model(d, dtype="float64")
    if kernels == "reference":
        ref = GPT(model.config, dtype="float64", kernels="reference")
        ref.load_state_dict(model.state_dict())
        model = ref
    c = model.config
    assert c.norm_placement == "sandwich" and c.window(0) == 5 and c.window(1) is None
    Y = np.roll(X, -1, axis=1)
    Y[0, -3:] = -100
    loss = model.loss(X, Y)
    grads = model.backward()
    hf = as_float64(oracle(folders, family))
    hf.zero_grad()
    logits = hf(torch.as_tensor(X)).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, V), torch.as_tensor(Y).reshape(-1), ignore_index=-100)
    want.backward()
    assert rel_err(model.forward(X), logits.detach().numpy()) <= REL64
    assert abs(loss - want.item()) <= 1e-12
    hf_grads = {k: p.grad.numpy() for k, p in hf.named_parameters() if not (c.tie_weights and k == "lm_head.weight")}
    if c.tie_weights and "model.embed_tokens.weight" not in hf_grads:
        hf_grads["model.embed_tokens.weight"] = hf.lm_head.weight.grad.numpy()
    expected = llama_state_from_hf(hf_grads, c, family=family)
    assert set(expected) == set(grads)
    for name, g in grads.items():
        scale = max(1e-3, float(np.max(np.abs(expected[name]))))
        assert np.max(np.abs(np.asarray(g) - expected[name])) <= REL64 * scale, name


@pytest.mark.parametrize("family", list(CASES))
def test_greedy_generation_past_the_window_equals_generate(folders, family):
    d, _ = folders[family]
    model = load_hf_model(d, dtype="float64")
    prompt = X[:1, :7]
    hf = as_float64(oracle(folders, family))
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        want = hf.generate(torch.as_tensor(prompt), max_new_tokens=14, do_sample=False, pad_token_id=0).numpy()
    np.testing.assert_array_equal(np.asarray(generate(model, prompt, 14, Sampling(temperature=0))), want)


# ------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("family", list(CASES))
def test_export_loads_in_transformers(folders, tmp_path, family):
    check_export_round_trip(folders[family][0], tmp_path / "out", X, CLASSES[family][1], family, hf_logits, REL32)


@pytest.mark.parametrize("family", list(CASES))
def test_peft_adapter_both_ways(folders, tmp_path, family):
    check_peft_both_ways(folders[family][0], tmp_path, X, hf_logits, REL64)


# ------------------------------------------------------------------------------------ the commands
def test_cli_finetune_eval_sample_and_export(folders, tmp_path, capsys):
    """A Gemma 3 folder as a new user takes it: ``finetune`` (LoRA on the seven projections),
    ``eval``, ``sample`` of the run, ``export-hf`` of the merged model (transformers reads it as
    Gemma3ForCausalLM with the fine-tune's logits)."""
    d, _ = folders["gemma3_text"]
    data = tmp_path / "data.txt"
    data.write_text(TEXT * 2, encoding="utf-8")
    run = tmp_path / "run"
    code = cli.main(["finetune", "--hf-dir", str(d), "--data", str(data), "--max-steps", "2",
                     "--context-length", "16", "--batch-size", "2", "--eval-interval", "2", "--eval-batches", "1",
                     "--lora-rank", "2", "--lora-targets", *SEVEN, "--out", str(run), "--no-progress", "--no-plot"])
    capsys.readouterr()
    assert code == 0
    assert cli.main(["eval", str(run), "--max-batches", "1", "--batch-size", "2", "--no-progress"]) == 0
    assert "loss" in capsys.readouterr()[0]
    assert cli.main(["sample", "--checkpoint", str(run), "--prompt", "the quick", "--max-new-tokens", "8",
                     "--temperature", "0"]) == 0
    assert "the quick" in capsys.readouterr()[0]
    from pedestrian.training.finetune import load_finetuned

    model, _ = load_finetuned(run)
    assert cli.main(["export-hf", "--adapter", str(run), "--out", str(tmp_path / "merged")]) == 0
    assert "Gemma3ForCausalLM" in capsys.readouterr()[0]
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    assert rel_err(model.forward(X), hf_logits(merged, X, torch.float32)) <= REL32


def test_cli_sample_greedy_equals_transformers(folders, capsys):
    d, _ = folders["gemma2"]
    prompt = "the quick brown"
    code = cli.main(["sample", "--hf-dir", str(d), "--prompt", prompt, "--max-new-tokens", "9",
                     "--temperature", "0", "--dtype", "float64", "--ignore-eot"])
    out, _ = capsys.readouterr()
    assert code == 0
    ids = tiny_tokenizer().encode(prompt)
    hf = as_float64(oracle(folders, "gemma2"))
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        want = hf.generate(torch.as_tensor([ids]), max_new_tokens=9, do_sample=False, pad_token_id=0)[0]
    assert tiny_tokenizer().decode(want.tolist()) in out


# ------------------------------------------------------------------------------------ refusals
REFUSED = [
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation='gelu' is not implemented"),
    ("gemma2", dict(attention_bias=True), "attention_bias=True is not implemented"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True is not implemented"),
    ("gemma3_text", dict(sliding_window=None), "sliding_window=None is not implemented for Gemma 3"),
    ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "rope_type='yarn' is not implemented"),
    ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                          "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 1e4}}),
     "rope_type='linear' is not implemented; Gemma 3's window layers"),
    ("gemma2", dict(num_local_experts=4), "num_local_experts=4 is not implemented"),
]


@pytest.mark.parametrize("family, change, message", REFUSED, ids=[m[:40] for _, _, m in REFUSED])
def test_refused_with_one_line(family, change, message):
    d = dict(TINY, vocab_size=50, head_dim=6, model_type=family, **change)
    with pytest.raises(ValueError) as err:
        config_from_hf(d, source="x/config.json")
    assert message in str(err.value) and "\n" not in str(err.value) and str(err.value).startswith("x/config.json: ")


def test_gemma_configs_are_written_only_by_gemma_and_llama_ones_never_by_it():
    import dataclasses

    g2 = config_from_hf(dict(TINY, vocab_size=50, head_dim=6, model_type="gemma2"))
    assert export_family(g2) == "gemma2"
    assert export_family(config_from_hf(dict(TINY, vocab_size=50, head_dim=6, model_type="gemma3_text"))) == "gemma3_text"
    with pytest.raises(ValueError, match="no Hugging Face family writes this model"):
        export_family(dataclasses.replace(g2, activation="silu"))             # a SiLU Gemma: no class has it
    llama = config_from_hf(dict(TINY, vocab_size=50, head_dim=6, model_type="llama", sliding_window=None))
    assert export_family(llama) == "llama"
    with pytest.raises(ValueError, match="logit_softcap"):
        export_family(dataclasses.replace(llama, logit_softcap=30.0))         # Llama has no cap: refused, not dropped

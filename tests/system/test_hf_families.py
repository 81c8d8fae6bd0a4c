"""Qwen3, OLMo 2 and SmolLM3 folders in and out, whole models (issue 48): transformers writes every
folder and is the float64 oracle (tests/oracles/family_oracles.py) for the logits, the loss and
every gradient, greedy generation, the export read back and PEFT adapters; the family table
(:mod:`pedestrian.interop.families`) against transformers' config classes; each refusal."""

from __future__ import annotations

import numpy as np
import pytest
from family_oracles import (CLASSES, SEVEN, check_export_round_trip, check_peft_both_ways, float64_throughout,
                            hf_logits, hf_model, rel_err)
from hf_fixtures import TEXT, tiny_tokenizer, torch, transformers

from pedestrian import cli
from pedestrian.generation.generate import generate
from pedestrian.generation.sampling import Sampling
from pedestrian.interop.families import FAMILIES, export_family, hf_family
from pedestrian.interop.hf import load_hf_model
from pedestrian.interop.hf_llama_config import config_from_hf
from pedestrian.interop.hf_llama_tensors import llama_state_from_hf
from pedestrian.model import decode

peft = pytest.importorskip("peft")
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

V = 300                                   # the tiny tokenizer's ids
TINY = dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
            max_position_embeddings=64, rms_norm_eps=1e-5, num_key_value_heads=2)
CASES = {   # family -> its config keywords beside TINY (what each family adds is switched on)
    "qwen3": dict(head_dim=8, tie_word_embeddings=True),
    "olmo2": dict(tie_word_embeddings=False),
    "smollm3": dict(no_rope_layers=[1, 0], tie_word_embeddings=True),
    "mistral": dict(sliding_window=5, tie_word_embeddings=False),      # X has 24 tokens: the window bites
    # Qwen3's window (as Qwen2's): the layers from max_window_layers on slide, here the second
    "qwen3-window": dict(head_dim=8, tie_word_embeddings=False, use_sliding_window=True, sliding_window=5,
                         max_window_layers=1),
}


def fam(case: str) -> str:
    """The family of a case of :data:`CASES` (``"qwen3-window"`` -> ``"qwen3"``)."""
    return case.split("-")[0]
# (no id 0: it is the folders' pad_token_id, whose embedding row transformers gives no gradient)
X = np.random.default_rng(5).integers(1, V, size=(2, 24))
# float64 compares the same sums in another order: relative 1e-10 of the logits' scale is ~5e5 ε64,
# far above the rounding of a 2-block model and far below any wrong formula
REL64 = 1e-10
# float32: a few hundred ε32 of the logits' scale covers reordered float32 sums
REL32 = 2e-5


def save_dir(model, d):
    model.save_pretrained(str(d))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer().hf, eos_token="<|endoftext|>")
    fast.save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("family_dirs")
    return {f: (save_dir(hf_model(fam(f), {**TINY, **kw}, vocab_size=V), tmp / f),
                hf_model(fam(f), {**TINY, **kw}, vocab_size=V)) for f, kw in CASES.items()}


# ------------------------------------------------------------------------------------ the table
def test_each_family_is_one_entry_that_reads_and_writes_itself():
    """Every Llama-layout entry: its model_type and architecture name it; a config it reads is
    written back by it (Mistral: by Llama, the same model); its names cover the parameters."""
    from pedestrian.model.layout import param_specs

    for name, fam in FAMILIES.items():
        assert hf_family({"model_type": name}) == name
        assert hf_family({"architectures": [fam.architecture]}) == name
        if fam.layout != "llama":
            continue
        d = dict(fam.defaults, vocab_size=50, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=6, intermediate_size=40, model_type=name)
        if name == "mistral":
            d["sliding_window"] = None
        if name == "smollm3":
            d["no_rope_layers"] = [1, 0]          # (every layer turning by RoPE is a Llama)
        config = config_from_hf(d)
        assert export_family(config) == ("llama" if name == "mistral" else name), name   # (no window: a Llama)
        blocks = {s.name.split(".", 2)[2].rsplit(".", 1)[0] for s in param_specs(config) if s.name.startswith("blocks.")}
        assert blocks <= set(fam.names), (name, blocks - set(fam.names))


@pytest.mark.parametrize("family", list(CLASSES))
def test_defaults_match_transformers(family):
    """Keys a config.json leaves out take the values transformers' own class gives them."""
    hf = getattr(transformers, CLASSES[family][0])()
    for key, value in FAMILIES[family].defaults.items():
        if key in ("rope_theta", "layer_types", "no_rope_layers") or (family, key) == ("qwen3", "sliding_window"):
            continue                       # (derived in __post_init__; Qwen3 nulls the window when off)
        got = getattr(hf, key, None)
        if value is None and key == "num_key_value_heads":
            assert got == hf.num_attention_heads
        elif value is None and key == "head_dim":
            assert got in (None, hf.hidden_size // hf.num_attention_heads)
        else:
            assert got == value, (family, key)
    if family == "smollm3":               # no_rope_layers made from no_rope_layer_interval, as here
        config = config_from_hf(dict(FAMILIES[family].defaults, model_type=family))
        assert [int(v) for v in config.rope_layers] == hf.no_rope_layers


# ------------------------------------------------------------------------------------ the model
@pytest.mark.parametrize("kernels", ["reference", "fast"])
@pytest.mark.parametrize("family", list(CASES))
def test_logits_loss_and_every_gradient_equal_transformers(folders, family, kernels):
    d, hf = folders[family]
    model = load_hf_model(d, dtype="float64")
    if kernels == "reference":
        from pedestrian import GPT

        ref = GPT(model.config, dtype="float64", kernels="reference")
        ref.load_state_dict(model.state_dict())
        model = ref
    c = model.config
    assert (c.qk_norm, c.norm_placement, c.rope_layers) == {
        "qwen3": ("head", "pre", None), "olmo2": ("proj", "post", None), "smollm3": (None, "pre", (True, False)),
        "mistral": (None, "pre", None)}[fam(family)]
    assert [c.window(i) for i in range(c.n_blocks)] == {"mistral": [5, 5], "qwen3-window": [None, 5]}.get(
        family, [None, None])
    Y = np.roll(X, -1, axis=1)
    Y[0, -3:] = -100                                                   # ignored targets too
    loss = model.loss(X, Y)
    grads = model.backward()
    hf = float64_throughout(hf).double()
    hf.zero_grad()
    logits = hf(torch.as_tensor(X)).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, V), torch.as_tensor(Y).reshape(-1), ignore_index=-100)
    want.backward()
    assert rel_err(model.forward(X), logits.detach().numpy()) <= REL64
    assert abs(loss - want.item()) <= 1e-12
    hf_grads = {k: p.grad.numpy() for k, p in hf.named_parameters() if not (c.tie_weights and k == "lm_head.weight")}
    if c.tie_weights and "model.embed_tokens.weight" not in hf_grads:
        hf_grads["model.embed_tokens.weight"] = hf.lm_head.weight.grad.numpy()
    expected = llama_state_from_hf(hf_grads, c, family=fam(family))
    assert set(expected) == set(grads)
    for name, g in grads.items():                  # the same float64 sums reordered: 1e-10 of the scale
        scale = max(1e-3, float(np.max(np.abs(expected[name]))))
        assert np.max(np.abs(np.asarray(g) - expected[name])) <= 1e-10 * scale, name


@pytest.mark.parametrize("family", list(CASES))
def test_greedy_generation_equals_generate(folders, family):
    """The KV-cache path (the fused decode step where it fits: Qwen3, SmolLM3; the chain for
    OLMo 2's norms after the sublayers) against transformers' generate."""
    d, hf = folders[family]
    model = load_hf_model(d, dtype="float64")
    prompt = X[:1, :7]
    hf = float64_throughout(hf).double()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        want = hf.generate(torch.as_tensor(prompt), max_new_tokens=20, do_sample=False, pad_token_id=0).numpy()
    np.testing.assert_array_equal(np.asarray(generate(model, prompt, 20, Sampling(temperature=0))), want)


@pytest.mark.parametrize("family", ["qwen3", "smollm3"])
def test_fused_decode_step_runs_the_prelude(folders, family):
    """The fused decode step takes these models (q/k norms and RoPE per block are the prelude's)
    and gives the chain's logits."""
    from pedestrian.model.kv_cache import KVCache

    d, _ = folders[family]
    model = load_hf_model(d, dtype="float64")
    full = np.asarray(model.forward(X))
    cache = KVCache(model, batch_size=2)
    model.forward(X[:, :5], kv_cache=cache)
    step = X[:, 5:6]
    assert decode.fits(model, step, None, cache, True)
    logits, _ = decode.forward(model, step, cache)
    np.testing.assert_allclose(logits[:, 0], full[:, 5], rtol=0, atol=1e-12 * np.max(np.abs(full)))


# ------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("family", list(CASES))
def test_export_loads_in_transformers(folders, tmp_path, family):
    back = check_export_round_trip(folders[family][0], tmp_path / "out", X, CLASSES[fam(family)][1], fam(family),
                                   hf_logits, REL32)
    assert getattr(back.config, "layer_types", None) == getattr(folders[family][1].config, "layer_types", None)


# ------------------------------------------------------------------------------------ PEFT
@pytest.mark.parametrize("family", list(CASES))
def test_peft_adapter_both_ways(folders, tmp_path, family):
    check_peft_both_ways(folders[family][0], tmp_path, X, hf_logits, REL64)


# ------------------------------------------------------------------------------------ the commands
def test_cli_sample_greedy_equals_transformers(folders, capsys):
    d, hf = folders["qwen3"]
    prompt = "the quick brown"
    code = cli.main(["sample", "--hf-dir", str(d), "--prompt", prompt, "--max-new-tokens", "5",
                     "--temperature", "0", "--dtype", "float64", "--ignore-eot"])
    out, _ = capsys.readouterr()
    assert code == 0
    ids = tiny_tokenizer().encode(prompt)
    hf = float64_throughout(hf).double()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        want = hf.generate(torch.as_tensor([ids]), max_new_tokens=5, do_sample=False, pad_token_id=0)[0]
    assert tiny_tokenizer().decode(want.tolist()) in out


@pytest.mark.parametrize("family", ["olmo2", "smollm3"])
def test_cli_finetune_eval_and_export(folders, tmp_path, capsys, family):
    """``finetune`` (LoRA on the seven projections), ``eval`` of the run, ``export-hf`` of the
    merged model: transformers reads it as the family's own class, with the fine-tune's logits."""
    d, _ = folders[family]
    data = tmp_path / "data.txt"
    data.write_text(TEXT * 2, encoding="utf-8")
    run = tmp_path / "run"
    code = cli.main(["finetune", "--hf-dir", str(d), "--data", str(data), "--max-steps", "2",
                     "--context-length", "16", "--batch-size", "2", "--eval-interval", "2", "--eval-batches", "1",
                     "--lora-rank", "2", "--lora-targets", *SEVEN, "--out", str(run), "--no-progress", "--no-plot"])
    capsys.readouterr()
    assert code == 0
    code = cli.main(["eval", str(run), "--max-batches", "1", "--batch-size", "2", "--no-progress"])
    out, _ = capsys.readouterr()
    assert code == 0 and "loss" in out
    from pedestrian.training.finetune import load_finetuned

    model, _ = load_finetuned(run)
    code = cli.main(["export-hf", "--adapter", str(run), "--out", str(tmp_path / "merged")])
    out, _ = capsys.readouterr()
    assert code == 0 and CLASSES[family][1] in out
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    assert type(merged).__name__ == CLASSES[family][1]
    assert rel_err(model.forward(X), hf_logits(merged, X, torch.float32)) <= REL32


# ------------------------------------------------------------------------------------ refusals
REFUSED = [
    ("qwen3", dict(attention_bias=True), "attention_bias=True is not implemented"),
    ("qwen3", dict(use_sliding_window=False, layer_types=["full_attention", "sliding_attention"]),
     "layer_types names 'sliding_attention' layers with use_sliding_window=False"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=-1),
     "max_window_layers=-1 must be a layer index"),
    ("olmo2", dict(attention_bias=True), "attention_bias=True is not implemented"),
    ("smollm3", dict(use_sliding_window=True, sliding_window=4), "use_sliding_window=True with sliding_window=4"),
    ("smollm3", dict(no_rope_layers=[1, 0, 1]), "no_rope_layers=[1, 0, 1] must hold a 0 or 1 for each"),
    ("smollm3", dict(attention_bias=True), "attention_bias=true without mlp_bias=true"),
    ("qwen3", dict(hidden_act="gelu"), "hidden_act='gelu' is not implemented"),
    ("olmo2", dict(num_local_experts=4), "num_local_experts=4 is not implemented"),
]


@pytest.mark.parametrize("family, change, message", REFUSED, ids=[m[:40] for _, _, m in REFUSED])
def test_refused_with_one_line(family, change, message):
    d = dict(TINY, vocab_size=50, model_type=family, **change)
    with pytest.raises(ValueError) as err:
        config_from_hf(d, source="x/config.json")
    assert message in str(err.value) and "\n" not in str(err.value) and str(err.value).startswith("x/config.json: ")


def test_a_config_no_family_writes_is_refused_naming_each_reason():
    import dataclasses

    base = config_from_hf(dict(TINY, vocab_size=50, model_type="qwen3", head_dim=6))
    odd = dataclasses.replace(base, norm_placement="post")            # q/k norm per head after the sublayers
    with pytest.raises(ValueError, match="no Hugging Face family writes this model") as err:
        export_family(odd)
    assert "not qwen3: norm_placement='post'" in str(err.value) and "not olmo2: qk_norm='head'" in str(err.value)
    assert export_family(dataclasses.replace(base, qk_norm=None)) == "llama"
    assert export_family(dataclasses.replace(base, qk_norm=None, rope_layers=(True, False))) == "smollm3"
    assert export_family(dataclasses.replace(base, qk_norm=None, rope_layers=(True, True))) == "llama"


def test_names_with_numbers_in_them():
    """A family's names may hold ``{}`` for a number (an expert's index), both ways."""
    from pedestrian.interop.families import block_layer, hf_block_name

    names = {"attn.q": "self_attn.q_proj", "experts.{}.mlp_gate": "mlp.experts.{}.gate_proj"}
    assert hf_block_name(names, "experts.12.mlp_gate") == "mlp.experts.12.gate_proj"
    assert block_layer(names, "mlp.experts.12.gate_proj") == "experts.12.mlp_gate"
    assert hf_block_name(names, "attn.q") == "self_attn.q_proj" and block_layer(names, "self_attn.q_proj") == "attn.q"
    assert hf_block_name(names, "mlp_gate") is None and block_layer(names, "mlp.gate_proj") is None

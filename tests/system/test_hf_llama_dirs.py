"""Hugging Face Llama / Qwen2 / Mistral folders in and out, whole models: transformers writes every
folder (config.json, one or sharded safetensors in F32/BF16/F16) and is the oracle for the logits,
greedy generation, the export read back, PEFT adapters and their gradients; the tokenizer is a tiny
byte-level BPE trained with ``tokenizers`` (tests/oracles/hf_fixtures.py), saved as tokenizer.json."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from family_oracles import float64_throughout, hf_logits, rel_err
from hf_fixtures import TEXT, tiny_tokenizer, torch, transformers

from pedestrian.generation.sampling import Sampling
from pedestrian import cli
from pedestrian.generation.generate import generate
from pedestrian.interop.hf import load_hf_model, load_pretrained, save_pretrained
from pedestrian.interop.peft import load_peft_adapter, save_peft_adapter

peft = pytest.importorskip("peft")
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

V = 300                                   # the tiny tokenizer's ids
TINY = dict(vocab_size=V, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
            max_position_embeddings=64, rms_norm_eps=1e-5)
L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16, "rope_theta": 500000.0}
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM")}
CASES = {
    "llama-gqa-4:2-tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-gqa-4:2-untied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-mqa-head_dim10": ("llama", dict(num_key_value_heads=1, head_dim=10)),
    "llama3-rope-scaling": ("llama", dict(num_key_value_heads=2, rope_parameters=L3)),
    "qwen2-qkv-biases": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "mistral-no-window": ("mistral", dict(num_key_value_heads=2, sliding_window=None, head_dim=6)),
    "mistral-window-5": ("mistral", dict(num_key_value_heads=2, sliding_window=5, head_dim=6)),   # X has 24 tokens
    # Qwen2's own window: use_sliding_window from layer max_window_layers on (the second of two)
    "qwen2-window-4-layer-1": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True, use_sliding_window=True,
                                             sliding_window=4, max_window_layers=1)),
}
X = np.random.default_rng(5).integers(0, V, size=(2, 24))
# float64 compares the same sums in another order: relative 1e-10 of the logits' scale is
# ~5e5 ε64, far above the rounding of a 2-block model and far below any wrong formula
REL64 = 1e-10
# float32: a few hundred ε32 (ε = 1.2e-7) of the logits' scale covers reordered float32 sums
REL32 = 2e-5


def hf_model(case: str, seed: int = 0):
    family, kw = CASES[case]
    torch.manual_seed(seed)
    cfg = getattr(transformers, CLASSES[family][0])(**TINY, **kw, bos_token_id=0, eos_token_id=0,
                                                     pad_token_id=0)
    model = getattr(transformers, CLASSES[family][1])(cfg).eval()
    with torch.no_grad():                      # norms away from 1 and non-zero biases: a swap would show
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p) if p.shape[0] == TINY["hidden_size"] else
                        0.3 * torch.randn_like(p))
            else:
                p.mul_(5.0)                    # std 0.1: logits of order 1, not 0.02
    return model


def save_dir(model, d, **kw):
    """``save_pretrained`` plus the tiny tokenizer as tokenizer.json (``PreTrainedTokenizerFast``)."""
    model.save_pretrained(str(d), **kw)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer().hf, eos_token="<|endoftext|>")
    fast.save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama_dirs")
    return {case: (save_dir(hf_model(case), tmp / case), hf_model(case)) for case in CASES}


# ------------------------------------------------------------------------------------ loading
@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(folders, case):
    d, hf = folders[case]
    model, tok = load_pretrained(d, dtype="float64")
    assert tok.vocab_size == V and model.config.n_kv_heads == hf.config.num_key_value_heads
    assert rel_err(model.forward(X), hf_logits(hf, X)) <= REL64
    model32 = load_hf_model(d, dtype="float32")
    assert rel_err(model32.forward(X), hf_logits(hf, X, torch.float32)) <= REL32


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_files_widen(tmp_path, dtype):
    hf = hf_model("llama-gqa-4:2-untied").to(getattr(torch, dtype))
    d = save_dir(hf, tmp_path / dtype)
    st = json.loads((d / "config.json").read_text())
    assert st.get("dtype", st.get("torch_dtype")) == dtype
    model = load_hf_model(d, dtype="float64")        # every half value is exact in float64
    assert rel_err(model.forward(X), hf_logits(hf, X)) <= REL64


def test_sharded_safetensors(tmp_path):
    hf = hf_model("llama-gqa-4:2-untied")
    d = save_dir(hf, tmp_path / "sharded", max_shard_size="30KB")
    assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("model-*.safetensors"))) > 1
    assert rel_err(load_hf_model(d, dtype="float64").forward(X), hf_logits(hf, X)) <= REL64


@pytest.mark.parametrize("case", ["llama-gqa-4:2-tied", "mistral-window-5",           # (27 tokens: past the window)
                                  "qwen2-window-4-layer-1"])
def test_greedy_generation_equals_generate(folders, case):
    d, hf = folders[case]
    model = load_hf_model(d, dtype="float64")
    prompt = X[:1, :7]
    hf = float64_throughout(hf).double()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        want = hf.generate(torch.as_tensor(prompt), max_new_tokens=20, do_sample=False,
                           pad_token_id=0).numpy()
    got = generate(model, prompt, 20, Sampling(temperature=0))
    np.testing.assert_array_equal(np.asarray(got), want)


# ------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("case", ["llama-gqa-4:2-tied", "llama-mqa-head_dim10", "llama3-rope-scaling",
                                  "qwen2-qkv-biases", "mistral-no-window", "mistral-window-5",
                                  "qwen2-window-4-layer-1"])
def test_export_loads_in_transformers(folders, tmp_path, case):
    d, _ = folders[case]
    model, tok = load_pretrained(d)
    out = save_pretrained(model, tmp_path / "out", tok)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM" if case.startswith("qwen2") else
                                    "MistralForCausalLM" if case == "mistral-window-5" else "LlamaForCausalLM"]
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(back).__name__ == cfg["architectures"][0]
    assert rel_err(model.forward(X), hf_logits(back, X, torch.float32)) <= REL32
    again, tok2 = load_pretrained(out)
    for k, v in model.params.items():                 # a round trip is exact
        np.testing.assert_array_equal(again.params[k], v)
    assert tok2.encode(TEXT) == tok.encode(TEXT)
    fast = transformers.AutoTokenizer.from_pretrained(str(out))
    assert fast(TEXT[:200], add_special_tokens=False)["input_ids"] == tok.encode(TEXT[:200])


# ------------------------------------------------------------------------------------ PEFT
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter(folders, tmp_path_factory):
    """A PEFT LoRA (r 4, all seven projections, random B) saved by peft on the GQA Llama."""
    d, _ = folders["llama-gqa-4:2-untied"]
    torch.manual_seed(1)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=SEVEN, init_lora_weights=False,
                          rank_pattern={"down_proj": 2}, lora_dropout=0.0)
    pm = peft.get_peft_model(base, cfg).eval()
    out = tmp_path_factory.mktemp("adapter") / "lora"
    pm.save_pretrained(str(out))
    return d, out, pm


def test_peft_adapter_loads_and_gives_peft_logits(adapter):
    d, adir, pm = adapter
    model = load_hf_model(d, dtype="float64")
    load_peft_adapter(model, adir)
    assert len(model.lora_targets) == 7 * 2
    assert model.params["blocks.0.attn.k.lora_U"].shape == (4, 2 * 6)        # n_kv_heads · head_dim
    assert model.lora_ranks["blocks.1.mlp_contract"] == 2
    assert rel_err(model.forward(X), hf_logits(pm, X)) <= REL64


def test_lora_gradients_equal_peft(adapter):
    d, adir, pm = adapter
    model = load_hf_model(d, dtype="float64")
    load_peft_adapter(model, adir)
    Y = np.roll(X, -1, axis=1)
    model.loss(X, Y)
    grads = model.backward()
    pm = float64_throughout(pm).double()
    pm.zero_grad()
    logits = pm(torch.as_tensor(X)).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, V), torch.as_tensor(Y).reshape(-1)).backward()
    names = {"self_attn.q_proj": "attn.q", "self_attn.k_proj": "attn.k", "self_attn.v_proj": "attn.v",
             "self_attn.o_proj": "attn_proj", "mlp.gate_proj": "mlp_gate", "mlp.up_proj": "mlp_expand",
             "mlp.down_proj": "mlp_contract"}
    seen = 0
    for name, p in pm.named_parameters():
        m = re.search(r"layers\.(\d+)\.(.+)\.lora_([AB])\.default\.weight$", name)
        if m is None:
            continue
        ours = grads[f"blocks.{m.group(1)}.{names[m.group(2)]}.lora_{'D' if m.group(3) == 'A' else 'U'}"]
        want = p.grad.numpy().T
        assert np.max(np.abs(ours - want)) <= 1e-9 * np.max(np.abs(want)), name
        seen += 1
    assert seen == 2 * 2 * 7


def test_pedestrian_adapter_loads_in_peft(adapter, tmp_path):
    d, adir, pm = adapter
    model = load_hf_model(d)
    load_peft_adapter(model, adir)
    out = save_peft_adapter(model, tmp_path / "ours")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == sorted(f"model.layers.{i}.{m}" for i in range(2)
                                                   for m in names_seven())
    assert cfg["fan_in_fan_out"] is False
    base = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval()
    back = peft.PeftModel.from_pretrained(base, str(out)).eval()
    assert rel_err(model.forward(X), hf_logits(back, X, torch.float32)) <= REL32


def names_seven():
    return [("self_attn." if m[0] in "qkvo" else "mlp.") + m for m in SEVEN]


# ------------------------------------------------------------------------------------ refusals
REFUSED = {   # case -> (config.json edit, the field and value the one line names)
    "yarn": ("llama-gqa-4:2-tied", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
             "rope_type='yarn'"),
    "yarn-beside-rope_parameters": ("llama-gqa-4:2-tied", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
                                    "rope_type='yarn'"),          # (transformers reads it first: it was ignored)
    "qwen2-sliding-layers-without-window": ("qwen2-qkv-biases", {"use_sliding_window": False, "layer_types": [
        "sliding_attention", "full_attention"]}, "layer_types names 'sliding_attention' layers"),
    "gelu": ("llama-gqa-4:2-tied", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    "experts": ("mistral-no-window", {"num_local_experts": 8}, "num_local_experts=8"),
    "o_proj-bias": ("llama-gqa-4:2-tied", {"attention_bias": True}, "attention_bias=true"),
    "partial-rope": ("llama-gqa-4:2-tied", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    "sinks": ("llama-gqa-4:2-tied", {"attention_sink": True}, "attention_sink=True"),
    "another-model": ("llama-gqa-4:2-tied", {"model_type": "gemma"}, "model_type='gemma'"),
}


def test_rope_scaling_beside_rope_parameters_is_read_first_as_transformers_does(folders, tmp_path):
    """A config.json with both keys (transformers 5 writes ``rope_parameters``; an older tool or a
    hand edit adds ``rope_scaling``): transformers takes ``rope_scaling``, its theta from
    ``rope_theta`` beside it, and so does pedestrian -- the same logits, Llama 3's scaling on."""
    d = edited_copy(folders, tmp_path, "llama-gqa-4:2-tied",
                    {"rope_scaling": {k: v for k, v in L3.items() if k != "rope_theta"}, "rope_theta": 5000.0})
    model = load_hf_model(d)
    assert model.config.rope_scaling is not None and model.config.rope_base == 5000.0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval()
    assert rel_err(model.forward(X), hf_logits(hf, X, torch.float32)) <= REL32


def test_qwen2_sliding_window_on_but_no_layer_sliding_loads_exact(folders, tmp_path):
    """``use_sliding_window`` true from layer ``max_window_layers`` (28 here) on, of 2 layers: no
    layer slides in transformers, so the folder loads, with transformers' logits."""
    d = edited_copy(folders, tmp_path, "qwen2-qkv-biases", {"use_sliding_window": True, "max_window_layers": 28})
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval()
    assert set(hf.config.layer_types) == {"full_attention"}
    assert rel_err(load_hf_model(d).forward(X), hf_logits(hf, X, torch.float32)) <= REL32


def edited_copy(folders, tmp_path, case, edit):
    import shutil

    d = shutil.copytree(folders[case][0], tmp_path / "edited")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(edit)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("what", list(REFUSED))
def test_refused_field_is_one_line(folders, tmp_path, capsys, what):
    case, edit, named = REFUSED[what]
    d = edited_copy(folders, tmp_path, case, edit)
    with pytest.raises(ValueError) as info:
        load_pretrained(d)
    msg = str(info.value)
    assert named in msg and "\n" not in msg
    code = cli.main(["sample", "--hf-dir", str(d), "--prompt", "the", "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and named in err


# ------------------------------------------------------------------------------------ tokenizers
def sentencepiece_tokenizer():
    """A Llama-2-style tokenizer.json built with ``tokenizers``: BPE with byte fallback (``<0xHH>``
    tokens), ``▁`` for a space, and a post-processor that puts ``<s>`` first (as Llama 2's)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=V, special_tokens=specials + [f"<0x{i:02X}>" for i in range(256)],
                                  show_progress=False)
    tok.train_from_iterator([TEXT], trainer=trainer)
    d = json.loads(tok.to_str())                 # byte tokens are ordinary vocabulary, as in Llama 2
    d["added_tokens"] = [t for t in d["added_tokens"] if t["content"] in specials]
    tok = Tokenizer.from_str(json.dumps(d))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def test_sentencepiece_style_tokenizer(folders, tmp_path, capsys):
    import shutil

    d = shutil.copytree(folders["llama-gqa-4:2-tied"][0], tmp_path / "sp")
    for f in d.glob("tokenizer*"):
        f.unlink()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=sentencepiece_tokenizer(), bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(d))
    model, tok = load_pretrained(d)
    assert tok.scheme == "metaspace" and tok.vocab_size == V
    text = "the quick fox, \u00e9 \u2603!\nok"          # é and ☃ are not in the vocabulary: byte fallback
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids == fast(text, add_special_tokens=False)["input_ids"]
    assert b"".join(tok.token_bytes(i) for i in ids) == (" " + text).encode()   # Strip's leading space aside
    from pedestrian.generation.prompts import encode_prompt

    assert encode_prompt(tok, text) == fast(text)["input_ids"] and encode_prompt(tok, text)[0] == 1  # <s>
    out = save_pretrained(model, tmp_path / "out", tok)
    assert transformers.AutoTokenizer.from_pretrained(str(out))(text)["input_ids"] == encode_prompt(tok, text)
    code = cli.main(["sample", "--hf-dir", str(d), "--prompt", "the quick", "--max-new-tokens", "5", "--seed", "0"])
    assert code == 0 and "the quick" in capsys.readouterr()[0]


# ------------------------------------------------------------------------------------ the CLI
def test_cli_sample_greedy_equals_transformers(folders, capsys):
    d, hf = folders["qwen2-qkv-biases"]
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


def test_cli_finetune_then_sample_and_peft(folders, tmp_path, capsys):
    d, _ = folders["llama-gqa-4:2-tied"]
    data = tmp_path / "data.txt"
    data.write_text(TEXT * 2, encoding="utf-8")
    run = tmp_path / "run"
    code = cli.main(["finetune", "--hf-dir", str(d), "--data", str(data), "--max-steps", "3",
                     "--context-length", "16", "--batch-size", "2", "--eval-interval", "3", "--eval-batches", "1",
                     "--lora-rank", "2", "--lora-targets", *SEVEN, "--out", str(run), "--no-progress", "--no-plot"])
    capsys.readouterr()
    assert code == 0
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert sum("loss" in r for r in records) == 3
    code = cli.main(["sample", "--checkpoint", str(run), "--prompt", "the", "--max-new-tokens", "5", "--seed", "0"])
    out, _ = capsys.readouterr()
    assert code == 0 and out.strip()
    code = cli.main(["eval", str(run), "--max-batches", "1", "--batch-size", "2", "--no-progress"])
    out, _ = capsys.readouterr()
    assert code == 0 and "loss" in out
    from pedestrian.training.finetune import load_finetuned

    model, _ = load_finetuned(run)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval()
    back = peft.PeftModel.from_pretrained(base, str(run / "peft")).eval()
    assert rel_err(model.forward(X), hf_logits(back, X, torch.float32)) <= REL32
    code = cli.main(["export-hf", "--adapter", str(run), "--out", str(tmp_path / "merged")])
    out, _ = capsys.readouterr()
    assert code == 0 and "LlamaForCausalLM" in out
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    assert rel_err(model.forward(X), hf_logits(merged, X, torch.float32)) <= REL32
    written = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"]) == (0, 0)      # the base folder's, kept


def test_cli_eval_of_a_folder_alone_is_transformers_loss(folders, tmp_path, capsys):
    """``pedestrian eval --hf-dir DIR --data TEXT --split all``: the mean next-token loss over the
    text's consecutive 64-token windows (the last one shorter), every target once, equal to
    transformers' cross-entropy of the same windows (float32 both; the printed 4 decimals)."""
    d, hf = folders["llama-gqa-4:2-tied"]
    data = tmp_path / "data.txt"
    data.write_text(TEXT, encoding="utf-8")
    assert cli.main(["eval", "--hf-dir", str(d), "--data", str(data), "--split", "all", "--no-progress"]) == 0
    said = capsys.readouterr().out
    loss = float(re.search(r"all loss ([0-9.]+) nats per token", said).group(1))
    ids = torch.tensor(tiny_tokenizer().encode(TEXT))
    T = TINY["max_position_embeddings"]
    windows = [ids[s:s + T + 1] for s in range(0, len(ids) - 1, T)]          # the last one shorter
    with torch.no_grad():
        nll = [torch.nn.functional.cross_entropy(hf(w[None, :-1]).logits[0].float(), w[1:], reduction="sum")
               for w in windows]
    assert f"the model in {d}" in said and loss == pytest.approx(float(sum(nll)) / (len(ids) - 1), abs=2e-4)

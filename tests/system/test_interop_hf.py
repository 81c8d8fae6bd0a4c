"""Hugging Face GPT-2 directories <-> pedestrian: logits, gradients, greedy generation, round
trips, tokenizers, and every kind of bad input (transformers is the oracle)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from hf_fixtures import (edit_config, hf_logits, hf_model, rel_err, save_hf_dir, save_tokenizer,
                         tiny_tokenizer, torch, transformers)

from pedestrian.generation.sampling import Sampling
from pedestrian.config import GPTConfig
from pedestrian.generation.generate import generate
from pedestrian.interop.hf import (config_from_hf, load_hf_model, load_hf_tokenizer, load_pretrained,
                                   save_pretrained, state_from_hf, state_to_hf)
from pedestrian.model import GPT

# id -> GPT2Config overrides (tiny: d=16, 2 heads, vocab 300, 64 positions)
CONFIGS = {
    "gelu_new-tied-2blocks": dict(),
    "relu-untied-1block": dict(activation_function="relu", tie_word_embeddings=False, n_layer=1),
    "gelu-3blocks-n_inner32-eps1e-3": dict(activation_function="gelu", n_layer=3, n_inner=32,
                                           layer_norm_epsilon=1e-3),
    "gelu_pytorch_tanh-untied-4heads": dict(activation_function="gelu_pytorch_tanh", n_head=4,
                                            tie_word_embeddings=False),
    # an MLP width that is no multiple of n_embd=16 (pedestrian's d_mlp)
    "gelu_new-untied-n_inner37": dict(n_inner=37, tie_word_embeddings=False),
}


def tokens(B=2, T=24, seed=0, V=300):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, V, size=(B, T))
    x[0, ::3] = x[0, 0]                         # repeated ids
    return x


@pytest.fixture(scope="module", params=list(CONFIGS))
def saved(request, tmp_path_factory):
    """(config id, HF model, directory written by save_pretrained)."""
    model = hf_model(seed=len(request.param), **CONFIGS[request.param])
    d = save_hf_dir(model, tmp_path_factory.mktemp(request.param))
    return request.param, model, d


def test_config_mapping(saved):
    name, hf, d = saved
    model, tok = load_pretrained(d)
    c, h = model.config, hf.config
    assert (c.vocab_size, c.context_length, c.d_model, c.n_heads, c.n_blocks) == \
        (h.vocab_size, h.n_positions, h.n_embd, h.n_head, h.n_layer)
    assert c.d_mlp == (h.n_inner or 4 * h.n_embd)
    assert c.ln_eps == h.layer_norm_epsilon
    assert c.tie_weights == h.tie_word_embeddings and c.logits_bias is False
    assert c.activation == {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                            "relu": "relu"}[h.activation_function]
    assert "logits.bias" not in model.params
    assert tok == load_hf_tokenizer(d) and tok.vocab_size == tiny_tokenizer().vocab_size


def test_logits_float32_and_float64(saved):
    _, hf, d = saved
    x = tokens()
    ref32 = hf_logits(hf, x)
    m32, _ = load_pretrained(d, dtype="float32")
    assert m32.dtype_name == "float32"
    # logits up to ~4: float32 rounding (ε = 1.2e-7) over chains of ~100 operations, <= ~3e-6 on
    # any machine (observed <= 1.7e-6); float64 the same with ε = 2.2e-16, <= ~1e-13
    assert np.max(np.abs(m32.forward(x) - ref32)) <= 1e-5
    m64, _ = load_pretrained(d, dtype="float64")
    ref64 = hf_logits(hf.double(), x)
    hf.float()
    assert np.max(np.abs(m64.forward(x) - ref64)) <= 1e-10


def test_torch_backend_logits(saved):
    _, hf, d = saved
    x = tokens(B=1, T=10)
    model, _ = load_pretrained(d, dtype="float64", backend="torch")
    ref = hf_logits(hf.double(), x)
    hf.float()
    assert np.max(np.abs(model.forward(x).numpy() - ref)) <= 1e-10


def test_loss_and_every_gradient_match_autograd(saved):
    """Our hand-derived gradients vs HF's autograd, float64, after mapping the names."""
    _, hf, d = saved
    model = load_hf_model(d, dtype="float64")
    x = tokens(B=3, T=20, seed=1)
    y = tokens(B=3, T=20, seed=2)
    y[1, :4] = -100                                     # ignored targets
    loss = model.loss(x, y)
    grads = model.backward()

    hf64 = hf.double()
    hf64.zero_grad()
    logits = hf64(torch.as_tensor(x)).logits
    ref_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.as_tensor(y).reshape(-1), ignore_index=-100)
    ref_loss.backward()
    ref = {k: p.grad.numpy() for k, p in hf64.named_parameters()}
    hf.float()
    assert abs(loss - ref_loss.item()) <= 1e-12 * abs(ref_loss.item())
    ours = state_to_hf(grads, model.config)
    if model.config.tie_weights:
        ref = {k: v for k, v in ref.items() if k != "lm_head.weight"}   # the same tensor as wte
    assert set(ours) == set(ref)
    for k in ref:
        assert rel_err(ours[k], ref[k]) <= 1e-9, k


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_greedy_generation_matches_transformers_generate(saved, dtype):
    _, hf, d = saved
    model, tok = load_pretrained(d, dtype=dtype)
    prompt = np.asarray([tok.encode("the quick brown")])
    torch_dtype = torch.float32 if dtype == "float32" else torch.float64
    with torch.no_grad():
        ref = hf.to(torch_dtype).generate(torch.as_tensor(prompt), max_new_tokens=40, do_sample=False,
                                          eos_token_id=None, pad_token_id=0).numpy()
    hf.float()
    assert ref.shape == (1, prompt.shape[1] + 40)
    # equal ids follow from equal logits only if no decision is within rounding of a tie: every
    # step's gap between the two largest float64 logits (teacher-forced on the ids) exceeds 4×
    # the logits' agreement of test_logits_float32_and_float64 (each side within it of the other
    # and of float64), so the same argmax on any machine
    tol = 1e-5 if dtype == "float32" else 1e-10
    m64, _ = load_pretrained(d, dtype="float64")
    top2 = np.sort(m64.forward(ref[:, :-1])[0, prompt.shape[1] - 1:], axis=-1)[:, -2:]
    assert np.min(top2[:, 1] - top2[:, 0]) > 4 * tol
    for use_cache in (True, False):
        ours = generate(model, prompt, 40, Sampling(temperature=0), use_cache=use_cache)
        np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("fmt", ["bin", "bin-legacy"])
def test_pytorch_bin_files(tmp_path, fmt):
    """pytorch_model.bin, with the current names and with the original GPT-2 release layout
    (no 'transformer.' prefix, causal-mask buffers); read through torch."""
    hf = hf_model(seed=5, n_layer=3)
    d = save_hf_dir(hf, tmp_path / fmt, fmt=fmt)
    assert not (d / "model.safetensors").exists()
    model, _ = load_pretrained(d, dtype="float64")
    x = tokens()
    assert np.max(np.abs(model.forward(x) - hf_logits(hf.double(), x))) <= 1e-10


def test_bin_without_torch_is_a_clear_error(tmp_path, monkeypatch):
    d = save_hf_dir(hf_model(), tmp_path / "bin", fmt="bin")
    monkeypatch.setitem(sys.modules, "torch", None)          # `import torch` now fails
    with pytest.raises(ValueError, match="only PyTorch can read.*safetensors"):
        load_hf_model(d)


@pytest.mark.parametrize("torch_dtype", ["float16", "bfloat16"])
def test_half_precision_files_are_widened_exactly(tmp_path, torch_dtype):
    hf = hf_model(seed=2).to(getattr(torch, torch_dtype))
    hf.save_pretrained(str(tmp_path))
    model = load_hf_model(tmp_path, dtype="float32")
    wanted = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    got = state_to_hf(model.params, model.config)
    for k, v in got.items():
        np.testing.assert_array_equal(v, wanted[k])


def test_sharded_safetensors(tmp_path):
    hf = hf_model(seed=3)
    hf.save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model = load_hf_model(tmp_path, dtype="float64")
    x = tokens()
    assert np.max(np.abs(model.forward(x) - hf_logits(hf.double(), x))) <= 1e-10


def test_vocab_merges_tokenizer(tmp_path):
    d = save_hf_dir(hf_model(), tmp_path, tokenizer="vocab")
    assert not (d / "tokenizer.json").exists() and (d / "merges.txt").is_file()
    _, tok = load_pretrained(d)
    text = "the lazy fox, with 5 jugs: é ü\n"
    assert tok.encode(text) == tiny_tokenizer().encode(text)


def test_tokenizer_agrees_with_transformers(saved):
    _, _, d = saved
    _, tok = load_pretrained(d)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(d))
    for text in ["the quick brown fox", "Sphinx of black quartz!\n\n  judge", "ünïcödé 🙂 <|endoftext|>x"]:
        assert tok.encode(text) == hf_tok(text)["input_ids"]
        assert tok.decode(tok.encode(text)) == text


# ------------------------------------------------------------------------------------ round trips
def random_pedestrian(tie: bool, seed: int = 0, dtype="float64", **kw) -> GPT:
    cfg = GPTConfig(vocab_size=tiny_tokenizer().vocab_size, context_length=40, d_model=12, n_heads=3,
                    n_blocks=2, tie_weights=tie, logits_bias=False if not tie else None, **kw)
    model = GPT(cfg, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed)
    for p in model.params.values():                      # non-trivial biases and LN weights too
        p[...] += rng.normal(0, 0.1, p.shape)
    return model


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_round_trip_pedestrian_hf_pedestrian_is_exact(tmp_path, tie, dtype):
    model = random_pedestrian(tie, dtype=dtype, activation="relu", mlp_ratio=2, ln_eps=1e-4)
    out = save_pretrained(model, tmp_path / "hf", tiny_tokenizer())
    back, tok = load_pretrained(out, dtype=dtype)
    assert back.config == model.config
    assert set(back.params) == set(model.params)
    for k, v in model.params.items():
        np.testing.assert_array_equal(back.params[k], v)
    assert tok == tiny_tokenizer()
    # and transformers reads the same model
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    assert hf.dtype == (torch.float32 if dtype == "float32" else torch.float64)
    x = tokens(T=30)
    tol = 1e-5 if dtype == "float32" else 1e-10
    assert np.max(np.abs(hf_logits(hf, x) - model.forward(x))) <= tol
    assert hf.config.eos_token_id == tiny_tokenizer().special_tokens["<|endoftext|>"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert hf_tok("the quick brown fox")["input_ids"] == tiny_tokenizer().encode("the quick brown fox")


def test_round_trip_hf_pedestrian_hf_tensors_identical(saved, tmp_path):
    _, hf, d = saved
    model, tok = load_pretrained(d)
    out = save_pretrained(model, tmp_path / "again", tok)
    again = transformers.GPT2LMHeadModel.from_pretrained(str(out))
    a, b = hf.state_dict(), again.state_dict()
    for k in a:
        if k.endswith(("attn.bias", "masked_bias")):
            continue
        assert torch.equal(a[k], b[k]), k


def test_character_tokenizer_travels_as_a_pedestrian_file(tmp_path):
    from pedestrian.text.tokenizer import CharTokenizer

    tok = CharTokenizer.from_text("hello world")
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=8, d_model=8, n_heads=2, n_blocks=1))
    out = save_pretrained(model, tmp_path / "hf", tok)
    assert (out / "pedestrian_tokenizer.json").is_file() and not (out / "tokenizer.json").exists()
    back, back_tok = load_pretrained(out)
    assert back_tok == tok and back.config == model.config


def test_state_from_hf_accepts_names_without_prefix():
    model = random_pedestrian(True)
    hf = {k[len("transformer."):]: v for k, v in state_to_hf(model.params, model.config).items()}
    state = state_from_hf(hf, model.config)
    for k, v in model.params.items():
        np.testing.assert_array_equal(state[k], v)


# ------------------------------------------------------------------------------------ bad input
def test_not_a_directory_or_no_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_pretrained(tmp_path / "nope")
    save_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_model(tmp_path)


def test_not_a_family_pedestrian_reads(tmp_path):
    d = save_hf_dir(hf_model(), tmp_path)
    edit_config(d, model_type="bert", architectures=["BertForMaskedLM"])
    with pytest.raises(ValueError, match="model_type='bert' is not implemented; pedestrian reads"):
        load_pretrained(d)


def test_unsupported_settings_are_all_listed():
    with pytest.raises(ValueError) as info:
        config_from_hf({"model_type": "gpt2", "n_embd": 16, "n_head": 2, "n_layer": 1, "vocab_size": 9,
                        "n_positions": 8, "activation_function": "silu", "scale_attn_weights": False,
                        "scale_attn_by_inverse_layer_idx": True, "n_inner": 0, "add_cross_attention": True})
    msg = str(info.value)
    for word in ("silu", "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "n_inner=0",
                 "add_cross_attention"):
        assert word in msg
    # reorder_and_upcast_attn only changes HF's precision: accepted
    cfg = config_from_hf({"model_type": "gpt2", "n_embd": 16, "n_head": 2, "n_layer": 1, "vocab_size": 9,
                          "n_positions": 8, "reorder_and_upcast_attn": True})
    assert cfg.d_model == 16


def _rewrite_safetensors(d, edit):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def test_missing_extra_and_misshaped_tensors_all_listed(tmp_path):
    d = save_hf_dir(hf_model(), tmp_path)

    def edit(t):
        del t["transformer.h.1.mlp.c_fc.bias"]
        t["transformer.h.7.attn.c_attn.weight"] = np.zeros((16, 48), np.float32)
        t["transformer.h.0.attn.c_proj.weight"] = np.zeros((16, 17), np.float32)

    _rewrite_safetensors(d, edit)
    with pytest.raises(ValueError) as info:
        load_pretrained(d)
    msg = str(info.value)
    assert "1 missing: transformer.h.1.mlp.c_fc.bias" in msg
    assert "1 unexpected: transformer.h.7.attn.c_attn.weight" in msg
    assert "transformer.h.0.attn.c_proj.weight (16, 17) (config.json implies (16, 16))" in msg
    assert "Nothing was loaded" in msg


def test_config_that_does_not_match_the_weights(tmp_path):
    d = save_hf_dir(hf_model(), tmp_path)
    edit_config(d, n_layer=3, n_positions=32)
    with pytest.raises(ValueError) as info:
        load_hf_model(d)
    msg = str(info.value)
    assert "transformer.wpe.weight (64, 16) (config.json implies (32, 16))" in msg
    assert "12 missing: transformer.h.2.ln_1.weight" in msg


def test_untied_config_on_tied_weights_and_differing_tied_head(tmp_path):
    d = save_hf_dir(hf_model(), tmp_path)
    edit_config(d, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="1 missing: lm_head.weight"):
        load_hf_model(d)
    edit_config(d, tie_word_embeddings=True)

    def add_head(t):
        t["lm_head.weight"] = t["transformer.wte.weight"] + 1
    _rewrite_safetensors(d, add_head)
    with pytest.raises(ValueError, match="lm_head.weight differs from transformer.wte.weight"):
        load_hf_model(d)


def test_no_weights_or_no_tokenizer(tmp_path):
    d = save_hf_dir(hf_model(), tmp_path)
    (d / "model.safetensors").rename(d / "weights.bak")
    with pytest.raises(FileNotFoundError, match="holds no model weights.*model.safetensors"):
        load_hf_model(d)
    (d / "weights.bak").rename(d / "model.safetensors")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink()
    with pytest.raises(FileNotFoundError, match="has no tokenizer: expected tokenizer.json"):
        load_pretrained(d)
    assert load_hf_model(d).config.n_blocks == 2              # the weights alone still load


def test_tokenizer_larger_than_vocab(tmp_path):
    d = save_hf_dir(hf_model(vocab_size=280), tmp_path)
    with pytest.raises(ValueError, match="tokenizer .* has 300 ids but the model's vocab_size is 280"):
        load_pretrained(d)


def test_corrupt_safetensors(tmp_path):
    d = save_hf_dir(hf_model(), tmp_path)
    (d / "model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_hf_model(d)


def test_export_refusals_name_the_problem(tmp_path):
    nobias = GPT(GPTConfig(vocab_size=10, context_length=8, d_model=8, n_heads=2, n_blocks=1, bias=False))
    with pytest.raises(ValueError, match="bias=False"):
        save_pretrained(nobias, tmp_path / "a")
    wide = GPT(GPTConfig(vocab_size=10, context_length=8, d_model=8, n_heads=2, n_blocks=1, d_qk=3,
                         tie_weights=False))
    with pytest.raises(ValueError) as info:
        save_pretrained(wide, tmp_path / "b")
    assert "d_qk=3" in str(info.value) and "lm_head has no bias" in str(info.value)
    with_lora = random_pedestrian(False)
    with_lora.add_lora("q", 2)
    with pytest.raises(ValueError, match="merge them first"):
        save_pretrained(with_lora, tmp_path / "c")
    assert not any(tmp_path.iterdir())                    # nothing written


def test_export_does_not_clobber(tmp_path):
    model = random_pedestrian(True)
    out = save_pretrained(model, tmp_path / "hf")
    before = (out / "model.safetensors").read_bytes()
    other = random_pedestrian(True, seed=1)
    with pytest.raises(ValueError, match="not empty.*overwrite"):
        save_pretrained(other, out)
    assert (out / "model.safetensors").read_bytes() == before
    (out / "pytorch_model.bin").write_bytes(b"old")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        save_pretrained(other, out, overwrite=True)
    (out / "pytorch_model.bin").unlink()
    save_pretrained(other, out, overwrite=True)
    back = load_hf_model(out, dtype="float64")
    np.testing.assert_array_equal(back.params["tok_emb.weight"], other.params["tok_emb.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]   # no temporary left behind
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"

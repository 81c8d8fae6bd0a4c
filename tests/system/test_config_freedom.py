"""The config freedom Hugging Face files need: q, k, v biases switched on their own
(``GPTConfig.qkv_bias``) and any MLP width (``GPTConfig.d_mlp``, HF's ``n_inner``). Gradients
against the PyTorch reference, parameter counts, ``pedestrian params``, checkpoints and the
Hugging Face round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gradcheck import model_key_bias_bounds
from torch_reference import default_cfg, param_shapes, random_params, reference_loss_and_grads

from pedestrian.checkpoint import load_checkpoint, save_checkpoint
from pedestrian.cli import main
from pedestrian.config import GPTConfig, preset
from pedestrian.model.layout import count_params, param_specs
from pedestrian.model import GPT


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


CASES = {
    # only the q, k, v biases off (the paper's "often dropped"; the key bias is useless)
    "qkv-bias-off": dict(bias=True, qkv_bias=False),
    # only the q, k, v biases on (as Qwen2 has them)
    "qkv-bias-only": dict(bias=False, qkv_bias=True),
    # an MLP width that is no multiple of d_model = 12
    "d_mlp-37": dict(d_mlp=37, tie_weights=True),
    "d_mlp-5-no-qkv-bias": dict(d_mlp=5, qkv_bias=False, activation="relu"),
}


@pytest.mark.parametrize("kernels", ["fast", "reference"])
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_and_error_signals_match_the_pytorch_reference(token_batch, one_torch_thread, case, kernels):
    """The loss, every parameter gradient and every Δ1 … Δ12 vs autograd (float64, <= 1e-9
    relative per tensor; a key bias, whose true gradient is 0, within its rounding bound)."""
    cfg = default_cfg(**CASES[case])
    params = random_params(cfg, seed=7)
    model = GPT(GPTConfig(**cfg), dtype="float64", kernels=kernels)
    model.fused_head = False                       # Δ12 kept whole, to compare it (the fused head: test_s1_head_loss.py)
    assert {s.name: s.shape for s in param_specs(model.config)} == param_shapes(cfg)
    model.load_state_dict(params, strict=True)
    x, y = token_batch(cfg, 3, cfg["context_length"], n_ignored=2)
    loss = model.loss(x, y)
    grads = model.backward(keep_deltas=True)
    ref_loss, _, ref_grads, ref_deltas = reference_loss_and_grads(params, cfg, x, y)
    # a sum of a few dozen rounded O(1) terms: relative error a few 1e-16
    assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
    assert set(grads) == set(params)
    bounds = model_key_bias_bounds(model)
    for k, g in grads.items():
        if k.endswith(".attn.k.bias"):      # identically 0 (paper section 3.1): rounding noise only,
            b = bounds[int(k.split(".")[1])]    # within its bound on either side (gradcheck.key_bias_bound)
            assert np.all(np.abs(g) <= b) and np.all(np.abs(ref_grads[k]) <= b), k
        else:
            assert rel(g, ref_grads[k]) <= 1e-9, k
    deltas = model.deltas()
    for k, d in ref_deltas.items():
        assert rel(deltas[k], d) <= 1e-9, k


def test_which_biases_exist():
    base = dict(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_blocks=1)
    names = {s.name for s in param_specs(GPTConfig(**base, qkv_bias=False))}
    assert not any(n.startswith("blocks.0.attn.") and n.endswith(".bias") for n in names)
    assert {"blocks.0.attn_proj.bias", "blocks.0.mlp_expand.bias", "blocks.0.ln1.bias"} <= names
    names = {s.name for s in param_specs(GPTConfig(**base, bias=False, qkv_bias=True))}
    assert {n for n in names if n.endswith(".bias")} == {f"blocks.0.attn.{p}.bias" for p in "qkv"}
    assert GPTConfig(**base).qkv_bias is True and GPTConfig(**base, bias=False).qkv_bias is False


def test_counts_follow_the_widths():
    """GPT-2 small: 124,439,808 parameters; without the q, k, v biases 12 · 3 · 768 fewer; with
    an MLP of width 3000 instead of 3072, 12 · (2 · 768 + 1) · 72 fewer still."""
    assert count_params(preset("gpt2")) == 124_439_808
    assert preset("gpt2").d_mlp == 3072
    assert count_params(preset("gpt2", qkv_bias=False)) == 124_439_808 - 12 * 3 * 768 == 124_412_160
    assert count_params(preset("gpt2", qkv_bias=False, d_mlp=3000)) \
        == 124_412_160 - 12 * (2 * 768 + 1) * 72 == 123_084_192
    model = GPT(GPTConfig(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_blocks=2, d_mlp=37,
                          qkv_bias=False))
    assert model.num_params() == count_params(model.config)
    assert model.params["blocks.1.mlp_contract.weight"].shape == (37, 12)


def test_params_command_takes_the_new_widths(capsys):
    assert main(["params", "--preset", "gpt2", "--d-mlp", "3000", "--no-qkv-bias"]) == 0
    out = capsys.readouterr().out
    assert "d_mlp=3000" in out and "qkv_bias=False" in out
    assert [line for line in out.splitlines() if line.startswith("total")][0].split()[-1] == "123,084,192"
    assert "blocks.0.attn.q.bias" not in out and "blocks.0.mlp_expand.weight" in out
    assert main(["params", "--preset", "gpt2", "--no-bias", "--qkv-bias"]) == 0
    out = capsys.readouterr().out
    assert "blocks.0.attn.q.bias" in out and "blocks.0.attn_proj.bias" not in out
    assert main(["params", "--preset", "gpt2", "--d-mlp", "0"]) == 2
    assert "error: d_mlp must be a positive integer, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("bad,match", [
    (dict(d_mlp=0), "d_mlp must be a positive integer, got 0"),
    (dict(d_mlp=True), "d_mlp must be a positive integer, got True"),
    (dict(d_mlp=12.5), "d_mlp must be a positive integer"),
    (dict(qkv_bias="no"), "qkv_bias must be True, False or None"),
])
def test_bad_values_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_blocks=1, **bad)


def test_checkpoint_round_trip_and_old_configs(tmp_path):
    cfg = GPTConfig(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_blocks=2, d_mlp=37,
                    qkv_bias=False)
    model = GPT(cfg, seed=3, dtype="float64")
    folder = save_checkpoint(tmp_path / "c", model)
    back = load_checkpoint(folder).model
    assert back.config == cfg
    for k, v in model.params.items():
        np.testing.assert_array_equal(back.params[k], v)
    # a config saved before these fields existed means d_mlp = mlp_ratio · d_model, qkv_bias = bias
    old = GPTConfig.from_dict({k: v for k, v in GPTConfig(vocab_size=11, context_length=8, d_model=12,
                                                          n_heads=3, n_blocks=1, mlp_ratio=2).to_dict().items()
                               if k not in ("d_mlp", "qkv_bias")})
    assert (old.d_mlp, old.qkv_bias) == (24, True)


# ------------------------------------------------------------------------------------ Hugging Face
def test_hf_export_writes_n_inner_and_refuses_missing_qkv_biases(tmp_path):
    transformers = pytest.importorskip("transformers")
    from hf_fixtures import hf_logits, tiny_tokenizer

    from pedestrian.interop.hf import config_to_hf, load_pretrained, save_pretrained

    V = tiny_tokenizer().vocab_size
    cfg = GPTConfig(vocab_size=V, context_length=32, d_model=16, n_heads=2, n_blocks=2, d_mlp=23)
    model = GPT(cfg, seed=1)
    rng = np.random.default_rng(0)
    for p in model.params.values():
        p[...] += rng.normal(0, 0.1, p.shape)
    out = save_pretrained(model, tmp_path / "hf", tiny_tokenizer())
    assert json.loads((out / "config.json").read_text())["n_inner"] == 23
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    assert hf.transformer.h[0].mlp.c_fc.weight.shape == (16, 23)
    x = rng.integers(0, V, (2, 20))
    # float32 logits of O(1): a few ulps of the largest, both libraries rounding their own way
    assert np.max(np.abs(hf_logits(hf, x) - model.forward(x))) <= 1e-5
    back, _ = load_pretrained(out)
    assert back.config == cfg
    assert config_to_hf(GPTConfig(vocab_size=V, context_length=32, d_model=16, n_heads=2,
                                  n_blocks=1))["n_inner"] is None
    no_qkv = GPT(GPTConfig(vocab_size=V, context_length=32, d_model=16, n_heads=2, n_blocks=1, qkv_bias=False))
    with pytest.raises(ValueError, match=r"qkv_bias=False \(GPT-2 has q, k, v biases"):
        save_pretrained(no_qkv, tmp_path / "no")
    assert not (tmp_path / "no").exists()


def test_train_takes_the_mlp_width_as_flag_and_config_key(tmp_path):
    """``pedestrian train --d-mlp`` and the TOML key ``d_mlp`` set the MLP width, explicitly over
    ``--arch llama``'s SwiGLU width (344 for d 128), and count as an explicit model setting (checked
    on resume). 393 gives the default model's widths as many parameters as the GPT-2-style default
    model, to 128 (benchmarks/arch_experiment.py): 4 blocks · 3 · 128 · (393 − 344) more than 736,896."""
    from pedestrian.cli import build_parser
    from pedestrian.training.settings import settings_from_args

    parser = build_parser()
    plain, _ = settings_from_args(parser.parse_args(["train", "--arch", "llama"]))
    flag, explicit = settings_from_args(parser.parse_args(["train", "--arch", "llama", "--d-mlp", "393"]))
    (tmp_path / "llama.toml").write_text('[model]\narch = "llama"\nd_mlp = 393\n', encoding="utf-8")
    toml, _ = settings_from_args(parser.parse_args(["train", "--config", str(tmp_path / "llama.toml")]))
    gpt2, _ = settings_from_args(parser.parse_args(["train"]))
    assert plain.model_config(84).d_mlp == 344 and count_params(plain.model_config(84)) == 736_896
    assert flag.model == toml.model and "model.d_mlp" in explicit
    assert flag.model_config(84).d_mlp == 393 and flag.model_config(84).mlp == "swiglu"
    assert count_params(flag.model_config(84)) == 736_896 + 4 * 3 * 128 * (393 - 344) == 812_160
    assert count_params(gpt2.model_config(84)) == 812_288


def test_arch_experiment_matches_the_parameter_count():
    """benchmarks/arch_experiment.py's Llama width is the one whose count is closest to the
    GPT-2-style default model's (812,288): 393 (812,160), not 392 (810,624) or 394 (813,696)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "arch_experiment.py"
    spec = importlib.util.spec_from_file_location("arch_experiment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.matched_d_mlp() == (393, 812_160, 812_288)
    for width, count in ((392, 810_624), (394, 813_696)):
        assert count_params(preset("llama-char", vocab_size=84, d_mlp=width)) == count

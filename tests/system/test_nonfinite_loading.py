"""Non-finite weights at the doors of a model (issue 13, part 1, swept): ``GPT.load_state_dict``
(what every loader goes through), a Hugging Face directory, a PEFT adapter, and merging LoRA
adapters. Each refuses with a message naming the tensors and their NaN / inf counts, and changes
nothing -- a NaN weight would otherwise surface only as NaN logits at the first sample."""

from __future__ import annotations

import numpy as np
import pytest
from hf_fixtures import hf_model, save_hf_dir, torch

from pedestrian.cli import main
from pedestrian.config import GPTConfig
from pedestrian.interop.hf import load_hf_model, load_pretrained
from pedestrian.interop.peft import load_peft_adapter, save_peft_adapter
from pedestrian.model import GPT

CFG = GPTConfig(vocab_size=20, context_length=8, d_model=8, n_heads=2, n_blocks=1, tie_weights=False)


def _state_copy(model) -> dict:
    return {k: np.array(v, copy=True) for k, v in model.params.items()}


def _unchanged(model, before) -> None:
    assert set(model.params) == set(before)
    for k, v in before.items():
        np.testing.assert_array_equal(model.params[k], v, err_msg=k)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_load_state_dict_refuses_non_finite_values_and_changes_nothing(bad):
    model = GPT(CFG, seed=0)
    before = _state_copy(model)
    state = {k: v + 1.0 for k, v in before.items()}
    state["blocks.0.ln1.weight"][2] = bad
    with pytest.raises(ValueError, match=r"blocks\.0\.ln1\.weight \((1 NaN, 0 inf|0 NaN, 1 inf) of 8 values\)"):
        model.load_state_dict(state)
    _unchanged(model, before)


def test_load_state_dict_refuses_values_that_overflow_the_dtype():
    """1e39 is a finite float64 but +inf as float32: refused, not loaded as inf."""
    model = GPT(CFG, seed=0, dtype="float32")
    before = _state_copy(model)
    state = {k: v.astype(np.float64) for k, v in before.items()}
    state["logits.weight"][0, 0] = 1e39
    with pytest.raises(ValueError, match=r"as float32: logits\.weight \(0 NaN, 1 inf of 160 values\)"):
        model.load_state_dict(state)
    _unchanged(model, before)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """A tiny HF GPT-2 directory, and a copy whose first block's ln_1 weight holds a NaN."""
    root = tmp_path_factory.mktemp("hf")
    good = save_hf_dir(hf_model(seed=3), root / "good")
    model = hf_model(seed=3)
    with torch.no_grad():
        model.transformer.h[0].ln_1.weight[5] = float("nan")
    return good, save_hf_dir(model, root / "nan")


def test_hf_directory_with_a_nan_weight_is_refused(hf_dirs):
    _, bad = hf_dirs
    with pytest.raises(ValueError, match=r"model\.safetensors.*non-finite.*blocks\.0\.ln1\.weight \(1 NaN"):
        load_hf_model(bad)


def test_sample_from_a_nan_hf_directory_is_one_line_before_any_output(hf_dirs, capsys):
    """The issue's example through a Hugging Face directory: no echoed prompt, no page of text,
    one error line."""
    _, bad = hf_dirs
    assert main(["sample", "--hf-dir", str(bad), "--prompt", "the quick", "--max-new-tokens", "5"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err.startswith("error: ") and "\n" not in err and "NaN" in err, err


def test_finetune_from_a_nan_base_is_refused_before_training(hf_dirs, tmp_path, capsys):
    _, bad = hf_dirs
    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 50, encoding="utf-8")
    out = tmp_path / "ft"
    assert main(["finetune", "--hf-dir", str(bad), "--data", str(corpus), "--out", str(out),
                 "--lora-rank", "2", "--max-steps", "2", "--no-progress", "--no-plot"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "NaN" in err, err
    assert not out.exists() or not any(out.iterdir())


def test_peft_adapter_with_a_nan_is_refused_and_the_model_keeps_no_adapter(hf_dirs, tmp_path):
    good, _ = hf_dirs
    model, _ = load_pretrained(good)
    model.add_lora(["q", "v"], rank=2, alpha=1.0)
    model.params["blocks.0.attn.q.lora_U"][...] = 0.5
    folder = save_peft_adapter(model, tmp_path / "adapter")
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    path = folder / "adapter_model.safetensors"
    with safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    name = next(k for k in tensors if "lora_B" in k)
    tensors[name][0, 0] = np.nan
    save_file(tensors, str(path), metadata=metadata)

    fresh, _ = load_pretrained(good)
    before = _state_copy(fresh)
    with pytest.raises(ValueError, match=r"non-finite.*lora_U \(1 NaN"):
        load_peft_adapter(fresh, folder)
    assert not fresh.lora_targets
    _unchanged(fresh, before)


@pytest.mark.parametrize("how", ["nan adapter", "float32 overflow"])
def test_merge_lora_that_would_make_a_non_finite_weight_is_refused(how):
    model = GPT(CFG, seed=0, dtype="float32")
    model.add_lora(["q", "mlp_expand"], rank=2, alpha=1.0)
    if how == "nan adapter":
        model.params["blocks.0.mlp_expand.lora_U"][0, 3] = np.nan
    else:                                            # each finite, their product beyond float32
        model.params["blocks.0.mlp_expand.lora_D"][...] = 1e20
        model.params["blocks.0.mlp_expand.lora_U"][...] = 1e20
    model.params["blocks.0.attn.q.lora_U"][...] = 0.1           # a healthy adapter, merged first
    before = _state_copy(model)
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp_expand.*non-finite.*nothing was changed"):
        model.merge_lora()
    _unchanged(model, before)
    assert model.lora_targets == ["blocks.0.attn.q", "blocks.0.mlp_expand"]


def test_adamw_load_state_dict_refuses_non_finite_moments_and_changes_nothing():
    """A NaN moment would turn every later update of its weight into NaN: refused like a NaN
    weight, the optimizer as it was."""
    from pedestrian.training.optim import AdamW

    model = GPT(CFG, seed=0, dtype="float64")
    opt = AdamW(model, lr=1e-2)
    model.loss(np.zeros((1, 4), np.int64), np.ones((1, 4), np.int64))
    model.backward()
    opt.step()
    state = opt.state_dict()
    state["base.v"] = state["base.v"].copy()
    state["base.v"][7] = np.inf
    before = opt.state_dict()
    with pytest.raises(ValueError, match=r"base\.v \(0 NaN, 1 inf of \d+ values\)"):
        opt.load_state_dict(state)
    after = opt.state_dict()
    assert after["step"] == before["step"] == 1
    for k in ("base.m", "base.v"):
        np.testing.assert_array_equal(after[k], before[k])

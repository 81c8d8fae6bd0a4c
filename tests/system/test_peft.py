"""PEFT LoRA adapters <-> pedestrian adapters, with ``peft`` itself as the oracle: the same
logits either way, α = lora_alpha / r, exact round trips, and adapters that do not fit."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hf_fixtures import hf_logits, hf_model, rel_err, save_hf_dir, torch, transformers

from pedestrian.interop.hf import load_hf_model
from pedestrian.interop.peft import (load_peft_adapter, lora_state_from_peft, peft_module, read_peft_adapter,
                                     save_peft_adapter)

peft = pytest.importorskip("peft")

# PEFT's own advice about its settings (fan_in_fan_out per module type, tied lm_head) is not
# about pedestrian; keep the test output readable.
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:peft"),
              pytest.mark.filterwarnings("ignore::FutureWarning:transformers")]

X = np.random.default_rng(7).integers(0, 300, size=(2, 20))


@pytest.fixture(scope="module", params=["tied", "untied"])
def base_dir(request, tmp_path_factory):
    hf = hf_model(seed=11, tie_word_embeddings=request.param == "tied")
    return save_hf_dir(hf, tmp_path_factory.mktemp(f"base-{request.param}"))


def hf_base(d, dtype=torch.float64):
    return transformers.GPT2LMHeadModel.from_pretrained(str(d), dtype=dtype).eval()


def peft_logits(base_dir, adapter_dir, dtype=torch.float64):
    model = peft.PeftModel.from_pretrained(hf_base(base_dir, dtype), str(adapter_dir)).eval()
    return hf_logits(model, X)


def with_random_adapters(model, targets, rank, alpha, seed=0):
    model.add_lora(targets, rank=rank, alpha=alpha, seed=seed)
    rng = np.random.default_rng(seed)
    for k in model.lora_state_dict():                 # U = 0 would hide every mistake
        model.params[k][...] = rng.normal(0, 0.3, model.params[k].shape)
    return model


TARGET_SETS = {
    "all": "all",
    "q-v": ["q", "v"],
    "mixed-per-block": ["blocks.0.attn.k", "blocks.1.attn.q", "blocks.1.attn.v", "blocks.0.mlp_contract",
                        "attn_proj", "logits"],
}


@pytest.mark.parametrize("targets", list(TARGET_SETS))
def test_pedestrian_adapter_applied_by_peft_gives_the_same_logits(base_dir, tmp_path, targets):
    model = with_random_adapters(load_hf_model(base_dir, dtype="float64"), TARGET_SETS[targets], 3, 0.6)
    out = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(base_dir))
    ref = peft_logits(base_dir, out)
    plain = hf_logits(hf_base(base_dir), X)
    assert rel_err(plain, ref) > 1e-3                 # the adapter changes the outputs
    assert rel_err(model.forward(X), ref) <= 1e-12
    # float32 too
    m32 = load_hf_model(base_dir, dtype="float32")
    m32.add_lora(model.lora_targets, 3, 0.6)
    m32.load_state_dict(model.lora_state_dict(), strict=False)
    assert np.max(np.abs(m32.forward(X) - peft_logits(base_dir, out, torch.float32))) <= 1e-5


def test_alpha_conversion_written_and_read(base_dir, tmp_path):
    model = with_random_adapters(load_hf_model(base_dir, dtype="float64"), ["q", "k", "mlp_expand"], 4, 0.5)
    out = save_peft_adapter(model, tmp_path / "a")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4
    assert cfg["lora_alpha"] / cfg["r"] == 0.5                      # PEFT scaling = paper α
    # q and k of a block share one c_attn adapter of rank 2r = 8, lora_alpha = α·8
    assert cfg["rank_pattern"]["transformer.h.0.attn.c_attn"] == 8
    assert cfg["alpha_pattern"]["transformer.h.0.attn.c_attn"] / 8 == 0.5
    assert set(cfg["target_modules"]) == {f"transformer.h.{i}.{m}" for i in range(2)
                                          for m in ("attn.c_attn", "mlp.c_fc")}
    assert (peft_module("blocks.1.attn.v"), peft_module("logits")) == \
        (("transformer.h.1.attn.c_attn", "v"), ("lm_head", None))


@pytest.mark.parametrize("targets", list(TARGET_SETS))
def test_round_trip_pedestrian_peft_pedestrian_is_exact(base_dir, tmp_path, targets):
    model = with_random_adapters(load_hf_model(base_dir, dtype="float64"), TARGET_SETS[targets], 2, 1.7)
    out = save_peft_adapter(model, tmp_path / "a")
    back = load_hf_model(base_dir, dtype="float64")
    load_peft_adapter(back, out)
    assert back.lora_targets == model.lora_targets
    assert (back.lora_rank, back.lora_alpha, back.freeze_base) == (2, 1.7, True)
    for k, v in model.lora_state_dict().items():
        np.testing.assert_array_equal(back.params[k], v)


def make_peft_adapter(base_dir, out, **lora_kw):
    """An adapter made by PEFT itself, with random (non-zero) B so it does something."""
    model = peft.get_peft_model(hf_base(base_dir), peft.LoraConfig(**lora_kw))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(str(out))
    return hf_logits(model.eval(), X)


PEFT_CONFIGS = {
    "c_attn-only": dict(r=4, lora_alpha=8, target_modules=["c_attn"]),
    "everything-patterns": dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc", "lm_head"],
                                rank_pattern={"transformer.h.1.mlp.c_fc": 2},
                                alpha_pattern={"c_proj": 3.0, "lm_head": 16}),
    "rslora": dict(r=4, lora_alpha=6, use_rslora=True, target_modules=["attn.c_proj", "mlp.c_proj"]),
}


@pytest.mark.parametrize("kind", list(PEFT_CONFIGS))
def test_adapter_made_by_peft_loads_with_the_same_logits(base_dir, tmp_path, kind):
    ref = make_peft_adapter(base_dir, tmp_path / "a", **PEFT_CONFIGS[kind])
    model = load_hf_model(base_dir, dtype="float64")
    load_peft_adapter(model, tmp_path / "a")
    assert rel_err(model.forward(X), ref) <= 1e-12
    cfg = PEFT_CONFIGS[kind]
    if kind == "c_attn-only":
        assert model.lora_alpha == cfg["lora_alpha"] / cfg["r"] == 2.0
        assert model.lora_targets == [f"blocks.{i}.attn.{p}" for i in range(2) for p in "qkv"]
    if kind == "rslora":
        assert model.lora_alpha == 6 / 2.0                           # lora_alpha / sqrt(r)
    # and the adapters train: gradients reach every D and U
    y = np.roll(X, -1, axis=1)
    model.loss(X, y)
    grads = model.backward()
    assert set(grads) == set(model.lora_state_dict())
    assert all(np.any(g != 0) for g in grads.values())


# ------------------------------------------------------------------------------------ bad input
def test_adapter_for_a_different_base_is_refused_and_nothing_changes(base_dir, tmp_path):
    other = save_hf_dir(hf_model(seed=3, n_embd=24, n_head=2, n_layer=3), tmp_path / "other", tokenizer=None)
    make_peft_adapter(other, tmp_path / "a", r=2, lora_alpha=2, target_modules=["c_attn", "c_fc"])
    model = load_hf_model(base_dir, dtype="float64")
    before = {k: v.copy() for k, v in model.params.items()}
    with pytest.raises(ValueError) as info:
        load_peft_adapter(model, tmp_path / "a")
    msg = str(info.value)
    assert "transformer.h.0.attn.c_attn: lora_A (2, 24), lora_B (72, 2) do not fit the base layer" in msg
    assert "transformer.h.2.attn.c_attn is not a module of this base" in msg
    assert "Nothing was loaded" in msg
    assert not model.lora_targets and set(model.params) == set(before)
    for k, v in before.items():
        np.testing.assert_array_equal(model.params[k], v)


def test_same_shapes_but_different_tied_head_is_detected(tmp_path):
    base = save_hf_dir(hf_model(seed=1), tmp_path / "b1", tokenizer=None)
    other = save_hf_dir(hf_model(seed=2), tmp_path / "b2", tokenizer=None)
    make_peft_adapter(other, tmp_path / "a", r=2, lora_alpha=2, target_modules=["lm_head"])
    assert "base_model.model.lm_head.base_layer.weight" in read_peft_adapter(tmp_path / "a")[1]
    model = load_hf_model(base, dtype="float64")
    with pytest.raises(ValueError, match="trained on a different base"):
        load_peft_adapter(model, tmp_path / "a")
    load_peft_adapter(load_hf_model(other, dtype="float64"), tmp_path / "a")      # its own base: fine


def test_unsupported_peft_options_are_listed(base_dir, tmp_path):
    model = with_random_adapters(load_hf_model(base_dir, dtype="float64"), ["q"], 2, 1.0)
    cfg, tensors, meta = read_peft_adapter(save_peft_adapter(model, tmp_path / "a"))
    base = load_hf_model(base_dir, dtype="float64")
    bad = dict(cfg, use_dora=True, bias="all", modules_to_save=["wte"])
    extra = dict(tensors, **{"base_model.model.transformer.h.0.attn.c_attn.bias": np.zeros(48)})
    with pytest.raises(ValueError) as info:
        lora_state_from_peft(bad, extra, base.config, metadata=meta, model=base)
    msg = str(info.value)
    for word in ("use_dora=True", "bias='all'", "modules_to_save=['wte']", "c_attn.bias"):
        assert word in msg
    half = {k: v for k, v in tensors.items() if "lora_B" not in k}
    with pytest.raises(ValueError, match=r"has only \['lora_A'\] \(needs lora_A and lora_B\)"):
        lora_state_from_peft(cfg, half, base.config)
    wrong_rank = dict(cfg, r=5, rank_pattern={})
    with pytest.raises(ValueError, match="tensors have rank 2 but adapter_config.json says 5"):
        lora_state_from_peft(wrong_rank, tensors, base.config)


def test_not_a_lora_adapter_and_missing_files(tmp_path, base_dir):
    model = load_hf_model(base_dir)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_peft_adapter(model, tmp_path / "none")
    (tmp_path / "ia3").mkdir()
    (tmp_path / "ia3" / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    with pytest.raises(ValueError, match="peft_type 'IA3'; pedestrian reads only LoRA"):
        load_peft_adapter(model, tmp_path / "ia3")
    (tmp_path / "ia3" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    with pytest.raises(FileNotFoundError, match="no adapter_model.safetensors"):
        load_peft_adapter(model, tmp_path / "ia3")


def test_model_with_adapters_already_or_none_to_write(base_dir, tmp_path):
    model = with_random_adapters(load_hf_model(base_dir, dtype="float64"), ["v"], 2, 1.0)
    out = save_peft_adapter(model, tmp_path / "a")
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        load_peft_adapter(model, out)
    with pytest.raises(ValueError, match="no LoRA adapters to write"):
        save_peft_adapter(load_hf_model(base_dir), tmp_path / "b")
    with pytest.raises(ValueError, match="not empty"):
        save_peft_adapter(model, out)

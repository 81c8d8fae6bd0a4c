"""PEFT LoRA adapters <-> pedestrian adapters, with ``peft`` itself as the oracle: the same
logits either way, α = lora_alpha / r, exact round trips, and adapters that do not fit."""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest
from hf_fixtures import hf_logits, hf_model, rel_err, save_hf_dir, torch, transformers

from pedestrian.interop.hf import load_hf_model
from pedestrian.interop.peft import load_peft_adapter, lora_state_from_peft, read_peft_adapter, save_peft_adapter
from pedestrian.interop.peft_modules import peft_module

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
    "rslora": dict(r=4, lora_alpha=6, use_rslora=True, target_modules=["attn.c_proj", "mlp.c_proj"],
                   lora_dropout=0.1),
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
        # loaded for inference, as PEFT's from_pretrained: the file's dropout kept, not applied
        assert model.lora_dropout == 0.1 and not model.training
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


# ------------------------------------------------------------------------------------ per-layer settings, dropout
PATTERNED = dict(targets=["q", "k", "v", "attn_proj", "mlp_expand", "logits"], rank=3, alpha=0.6,
                 rank_pattern={"k": 2, "blocks.1.attn.q": 5, "mlp_expand": 4, "logits": 1},
                 alpha_pattern={"v": 1.5, "blocks.0.attn_proj": -0.25, "logits": 2.0}, dropout=0.15)


def patterned(base_dir, dtype="float64", seed=0):
    """A pedestrian model with adapters of several ranks and α (the q, k, v of one block among
    them) and adapter dropout, with random non-zero D and U."""
    model = load_hf_model(base_dir, dtype=dtype)
    kw = dict(PATTERNED)
    model.add_lora(kw.pop("targets"), seed=seed, **kw)
    rng = np.random.default_rng(seed)
    for k in model.lora_state_dict():
        model.params[k][...] = rng.normal(0, 0.3, model.params[k].shape)
    return model


def test_patterns_and_dropout_written_applied_by_peft_and_read_back(base_dir, tmp_path):
    """rank_pattern, alpha_pattern and lora_dropout: PEFT applies the file with the logits of the
    pedestrian model (float32 within 1e-5, float64 within 1e-12), and reading it back gives the
    same ranks, α, dropout and adapters."""
    model = patterned(base_dir)
    model.training = False
    out = save_peft_adapter(model, tmp_path / "a", base_model_name_or_path=str(base_dir))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"]) == (3, 0.6 * 3, 0.15)
    # block 0's c_attn holds q (r 3, α 0.6), k (2, 0.6), v (3, 1.5): rank 8, scaling = q's α
    assert cfg["rank_pattern"]["transformer.h.0.attn.c_attn"] == 8
    assert cfg["alpha_pattern"]["transformer.h.0.attn.c_attn"] == 0.6 * 8
    assert cfg["rank_pattern"]["transformer.h.1.attn.c_attn"] == 10
    assert cfg["rank_pattern"]["transformer.h.0.mlp.c_fc"] == 4 and cfg["rank_pattern"]["lm_head"] == 1
    assert cfg["alpha_pattern"]["transformer.h.0.attn.c_proj"] == -0.25 * 3
    assert cfg["alpha_pattern"]["lm_head"] == 2.0
    assert "transformer.h.1.attn.c_proj" not in cfg["rank_pattern"] | cfg["alpha_pattern"]   # defaults

    peft_model = peft.PeftModel.from_pretrained(hf_base(base_dir), str(out)).eval()
    assert peft_model.peft_config["default"].lora_dropout == 0.15
    c_attn = peft_model.base_model.model.transformer.h[0].attn.c_attn
    # peft's scaling lora_alpha / r = (0.6·8) / 8: a product and a quotient by a power of two, exact
    assert c_attn.r["default"] == 8 and c_attn.scaling["default"] == 0.6
    assert rel_err(model.forward(X), hf_logits(peft_model, X)) <= 1e-12
    m32 = patterned(base_dir, dtype="float32")
    m32.training = False
    ref32 = peft_logits(base_dir, out, torch.float32)
    # float32 logits: the two libraries round chains of ~100 operations differently, each by up
    # to ε = 1.2e-7 of the scale -- observed 4.4e-7 (3.7 ε), so 1e-6 left a 2x margin where another
    # CPU's float32 kernels sum in other orders; 1e-5 (the paper's float32 bound, RTOL_FLOAT32)
    assert rel_err(m32.forward(X), ref32) <= 1e-5

    back = load_hf_model(base_dir, dtype="float64")
    load_peft_adapter(back, out)
    assert back.lora_targets == model.lora_targets
    assert (back.lora_ranks, back.lora_alphas, back.lora_dropout) == (model.lora_ranks, model.lora_alphas, 0.15)
    assert (back.lora_rank, back.lora_alpha) == (3, 0.6)
    for k, v in model.lora_state_dict().items():
        if k.endswith("attn.v.lora_U"):
            # written as U·(1.5/0.6) in the c_attn block whose scaling is q's 0.6, read as
            # ·(0.6/1.5): four roundings (two ratios, two products) of at most 2^-53 each
            np.testing.assert_allclose(back.params[k], v, rtol=4.5e-16, atol=0)
        else:
            np.testing.assert_array_equal(back.params[k], v)


PEFT_PATTERNED = dict(r=4, lora_alpha=8, lora_dropout=0.2, target_modules=["c_attn", "c_proj", "c_fc", "lm_head"],
                      rank_pattern={"h.1.attn.c_attn": 2, "mlp.c_proj": 6},
                      alpha_pattern={r"h\.0\.attn\.c_proj": 3.0, "lm_head": 1.0, "c_fc": 12})


def test_peft_file_with_patterns_and_dropout_loads_layer_by_layer(base_dir, tmp_path):
    """PEFT's own file: every module gets its own rank (no padding) and α = lora_alpha / r from
    the patterns, PEFT's key rule (regex, suffix); lora_dropout arrives; the logits equal PEFT's;
    written again and applied by PEFT, the logits are the same still."""
    ref = make_peft_adapter(base_dir, tmp_path / "a", **PEFT_PATTERNED)
    model = load_hf_model(base_dir, dtype="float64")
    load_peft_adapter(model, tmp_path / "a")
    assert model.lora_dropout == 0.2 and (model.lora_rank, model.lora_alpha) == (4, 2.0)
    assert model.lora_ranks["blocks.0.attn.q"] == 4 and model.lora_ranks["blocks.1.attn.k"] == 2
    assert model.lora_ranks["blocks.0.mlp_contract"] == 6 and model.lora_ranks["blocks.1.attn_proj"] == 4
    assert model.lora_alphas["blocks.1.attn.v"] == 8 / 2
    assert model.lora_alphas["blocks.0.attn_proj"] == 3.0 / 4 and model.lora_alphas["blocks.1.attn_proj"] == 2.0
    assert model.lora_alphas["blocks.1.mlp_contract"] == 8 / 6 and model.lora_alphas["logits"] == 1.0 / 4
    assert model.lora_alphas["blocks.0.mlp_expand"] == 12 / 4
    model.training = False
    assert rel_err(model.forward(X), ref) <= 1e-12
    again = save_peft_adapter(model, tmp_path / "again")
    assert json.loads((again / "adapter_config.json").read_text())["lora_dropout"] == 0.2
    assert rel_err(peft_logits(base_dir, again), ref) <= 1e-12


def test_training_gradients_with_dropout_equal_peft_with_the_same_masks(base_dir, tmp_path):
    """In training, with PEFT's dropout modules holding the masks pedestrian drew, the loss and
    the gradient of every lora_A and lora_B equal PEFT's autograd (float64): the dropout sits on
    the same input (one mask per module, c_attn's shared by q, k, v)."""
    from lora_masks import replay_masks

    make_peft_adapter(base_dir, tmp_path / "a", **PEFT_PATTERNED)
    model = load_hf_model(base_dir, dtype="float64")
    load_peft_adapter(model, tmp_path / "a")
    model.training = True                          # (loaded for inference, as PEFT's is_trainable=False)
    y = np.roll(X, -1, axis=1)
    masks = replay_masks(model, copy.deepcopy(model.dropout_rng), *X.shape)
    loss = model.loss(X, y)
    grads = model.backward()

    class FixedMask(torch.nn.Module):
        def __init__(self, mask):
            super().__init__()
            self.mask = torch.as_tensor(mask)

        def forward(self, x):
            return x * self.mask

    ref = peft.PeftModel.from_pretrained(hf_base(base_dir), str(tmp_path / "a"), is_trainable=True).train()
    replaced = 0
    for name, module in ref.named_modules():
        if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
            assert module.lora_dropout["default"].p == 0.2
            module.lora_dropout["default"] = FixedMask(masks[_module_fc(name)])
            replaced += 1
    assert replaced == 4 * 2 + 1
    logits = ref(torch.as_tensor(X)).logits
    ref_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.as_tensor(y).reshape(-1))
    ref_loss.backward()
    # a sum of a few hundred rounded O(1) terms: relative error a few 1e-16
    assert abs(loss - ref_loss.item()) <= 1e-12 * abs(ref_loss.item())
    checked = 0
    for name, p in ref.named_parameters():
        if "lora_" not in name:
            continue
        module = name[len("base_model.model."):].rsplit(".lora_", 1)[0]
        fc = _module_fc(module)
        if "lora_A" in name:
            ours = sum(grads[f"{fc[:-1]}{part}.lora_D"] for part in "qkv") if fc.endswith(".q") \
                else grads[f"{fc}.lora_D"]
            assert rel_err(ours.T, p.grad.numpy()) <= 1e-9, name
        else:
            ours = np.concatenate([grads[f"{fc[:-1]}{part}.lora_U"] for part in "qkv"], axis=1) \
                if fc.endswith(".q") else grads[f"{fc}.lora_U"]
            assert rel_err(ours.T, p.grad.numpy()) <= 1e-9, name
        checked += 1
    assert checked == 2 * (4 * 2 + 1)                       # A and B of 4 modules per block and lm_head


def _module_fc(module: str) -> str:
    """A PEFT module name (``base_model.model.transformer.h.0.attn.c_attn``) -> its pedestrian
    layer (``c_attn``: the q layer; k and v share its input's mask)."""
    module = module.removeprefix("base_model.model.")
    if module == "lm_head":
        return "logits"
    i, kind = re.fullmatch(r"transformer\.h\.(\d+)\.(.*)", module).groups()
    return {"attn.c_attn": f"blocks.{i}.attn.q", "attn.c_proj": f"blocks.{i}.attn_proj",
            "mlp.c_fc": f"blocks.{i}.mlp_expand", "mlp.c_proj": f"blocks.{i}.mlp_contract"}[kind]

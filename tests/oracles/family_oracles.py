"""transformers' models of the newer Llama-layout families (Qwen3, OLMo 2, SmolLM3) as float64
oracles: tiny random configs built with transformers itself, every float32 upcast replaced by
its formula in float64 (as tests/system/test_hf_llama_dirs.py does for Llama).

transformers computes the rotary table and every ``*RMSNorm`` (the q/k norms included) in
float32 whatever the model's dtype, and its eager attention's softmax too; :func:`float64_throughout`
forms the angles from a float64 frequency table, the norms by their formula without the casts,
and switches to SDPA attention (float64 in torch), so a float64 model is a float64 oracle.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

#: family -> (config class, model class)
CLASSES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
           "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM")}


def hf_model(family: str, kw: dict, *, vocab_size: int, seed: int = 0, classes=None, norm_center: float = 1.0):
    """transformers' model of ``family`` (``classes``: family -> (config class, model class), default
    :data:`CLASSES`) with config ``kw`` (ids 0 for bos/eos/pad), random weights of order 1: norm
    weights ``norm_center + 0.3 N(0, 1)`` (a norm swapped with another shows; Gemma's are stored
    around 0, ``1 + w``: ``norm_center=0``), matrices ×5 (std 0.1)."""
    config_class, model_class = (classes or CLASSES)[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_class)(vocab_size=vocab_size, **kw, bos_token_id=0, eos_token_id=0,
                                              pad_token_id=0)
    model = getattr(transformers, model_class)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(norm_center + 0.3 * torch.randn_like(p))
            else:
                p.mul_(5.0)
    return model


def float64_throughout(model):
    """``model`` (or a PEFT model over it) patched once: rotary angles from a float64 frequency table
    (pedestrian's ``llama3_theta`` for Llama 3's scaling, checked against transformers' in
    tests/paper/test_llama_model.py), RMS norms by the formula in the input's dtype, SDPA attention
    (eager attention's softmax is float32 too). Returns ``model``."""
    from pedestrian.interop.hf_llama_config import config_from_hf
    from pedestrian.layers.rope import llama3_theta

    if getattr(model, "_float64_throughout", False):
        return model
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = config_from_hf(inner.config.to_dict())
    theta = config.rope_base ** (-2.0 * np.arange(config.d_qk // 2) / config.d_qk)
    if config.rope_scaling is not None:
        theta = llama3_theta(theta, config.rope_scaling)
    inv_freq = torch.as_tensor(theta)

    def rotary(x, position_ids):
        angle = position_ids[..., None].double() * inv_freq
        emb = torch.cat((angle, angle), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def rms(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    patch_rotary_and_norms(model, rotary, rms)
    inner.config._attn_implementation = "sdpa"
    model._float64_throughout = True
    return model


def patch_rotary_and_norms(model, rotary, rms) -> None:
    """Every ``*RotaryEmbedding`` of ``model`` computes ``rotary(x, position_ids, ...)`` and every
    ``*RMSNorm`` ``rms(self, x)`` (the float64 formulas in place of transformers' float32 casts)."""
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RotaryEmbedding"):
            module.forward = rotary
        elif name.endswith("RMSNorm"):
            module.forward = rms.__get__(module)


def hf_logits(model, x, dtype=torch.float64) -> np.ndarray:
    with torch.no_grad():
        return float64_throughout(model).to(dtype)(torch.as_tensor(x)).logits.double().numpy()


#: LoRA on every projection of a Llama-layout block, PEFT's module names
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def rel_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def check_export_round_trip(d, out_dir, x, class_name: str, model_type: str, logits, rel32: float):
    """A folder loaded by pedestrian and written back (``save_pretrained``): ``config.json`` names
    ``class_name`` / ``model_type``, transformers reads it as that class with pedestrian's float32
    logits (``logits(model, x, dtype)``: the family's float64-throughout oracle) within ``rel32``,
    and pedestrian reads it back to the same config and the same bits. Returns transformers' model."""
    import json

    from pedestrian.interop.hf import load_pretrained, save_pretrained

    model, tok = load_pretrained(d)
    out = save_pretrained(model, out_dir, tok)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [class_name] and cfg["model_type"] == model_type
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(back).__name__ == class_name
    assert rel_err(model.forward(x), logits(back, x, torch.float32)) <= rel32
    again, _ = load_pretrained(out)
    assert again.config == model.config
    for k, v in model.params.items():                 # a round trip is exact
        np.testing.assert_array_equal(again.params[k], v)
    return back


def check_peft_both_ways(d, tmp, x, logits, rel64: float) -> None:
    """A PEFT LoRA (r 2, :data:`SEVEN`, random B) written by peft on the folder ``d`` loads into
    pedestrian with peft's float64 logits (``logits(model, x)``) within ``rel64``, on every block's
    seven projections; pedestrian's PEFT files of it give peft's logits again."""
    from pedestrian.interop.hf import load_hf_model
    from pedestrian.interop.peft import load_peft_adapter, save_peft_adapter

    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval()
    pm = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=SEVEN,
                                                   init_lora_weights=False)).eval()
    pm.save_pretrained(str(tmp / "theirs"))
    model = load_hf_model(d, dtype="float64")
    load_peft_adapter(model, tmp / "theirs")
    assert len(model.lora_targets) == 7 * model.config.n_blocks
    assert rel_err(model.forward(x), logits(pm, x)) <= rel64
    out = save_peft_adapter(model, tmp / "ours")
    back = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval(),
                                          str(out)).eval()
    assert rel_err(model.forward(x), logits(back, x)) <= rel64

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


def hf_model(family: str, kw: dict, *, vocab_size: int, seed: int = 0):
    """transformers' model of ``family`` with config ``kw`` (ids 0 for bos/eos/pad), random
    weights of order 1: norm weights ``1 + 0.3 N(0, 1)`` (a norm swapped with another shows),
    matrices ×5 (std 0.1)."""
    torch.manual_seed(seed)
    cfg = getattr(transformers, CLASSES[family][0])(vocab_size=vocab_size, **kw, bos_token_id=0, eos_token_id=0,
                                                    pad_token_id=0)
    model = getattr(transformers, CLASSES[family][1])(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.mul_(5.0)
    return model


def float64_throughout(model):
    """``model`` (or a PEFT model over it) patched once: rotary angles from a float64 table,
    RMS norms by the formula in the input's dtype, SDPA attention. Returns ``model``."""
    from pedestrian.interop.hf_llama_config import config_from_hf

    if getattr(model, "_float64_throughout", False):
        return model
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = config_from_hf(inner.config.to_dict())
    inv_freq = torch.as_tensor(config.rope_base ** (-2.0 * np.arange(config.d_qk // 2) / config.d_qk))

    def rotary(x, position_ids):
        angle = position_ids[..., None].double() * inv_freq
        emb = torch.cat((angle, angle), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def rms(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RotaryEmbedding"):
            module.forward = rotary
        elif name.endswith("RMSNorm"):
            module.forward = rms.__get__(module)
    inner.config._attn_implementation = "sdpa"
    model._float64_throughout = True
    return model


def hf_logits(model, x, dtype=torch.float64) -> np.ndarray:
    with torch.no_grad():
        return float64_throughout(model).to(dtype)(torch.as_tensor(x)).logits.double().numpy()

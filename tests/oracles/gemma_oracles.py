"""transformers' Gemma 2 and Gemma 3 (text) models as float64 oracles: tiny random configs built
with transformers itself, every float32 step of theirs replaced by its formula in float64 (as
tests/oracles/family_oracles.py does for the Llama-layout families).

Where transformers leaves float64: ``GemmaRMSNorm`` computes in float32 (``x.float()``, then
``1 + w.float()``); the rotary table is formed in float32 (per layer type in Gemma 3); the eager
attention's softmax is float32; the embedding's ``embed_scale`` buffer is ``torch.tensor(√d)``
made in float32 (so ``float32(√d)`` even after ``.double()``). :func:`float64_throughout` replaces
each by its formula in float64 -- the norm ``x̂ ∘ (1 + w)``, the angles from a float64 frequency
table (Gemma 3's global layers divided by the linear factor), the softmax in the scores' dtype
(the attention's soft-cap, scale and window kept as transformers writes them), ``embed_scale =
√d`` in float64 -- so a float64 model is a float64 oracle.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from family_oracles import hf_model as family_hf_model, patch_rotary_and_norms  # noqa: E402

#: family -> (config class, model class)
CLASSES = {"gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


def hf_model(family: str, kw: dict, *, vocab_size: int, seed: int = 0):
    """:func:`family_oracles.hf_model` of a Gemma family: norm weights ``0.3 N(0, 1)`` (Gemma's are
    stored around 0: ``1 + w``), matrices ×5 (std 0.1)."""
    return family_hf_model(family, kw, vocab_size=vocab_size, seed=seed, classes=CLASSES, norm_center=0.0)


def _eager64(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """transformers' Gemma eager attention with the softmax in the scores' dtype (not float32)."""
    n_rep = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(n_rep, dim=1)
    value = value.repeat_interleave(n_rep, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def float64_throughout(model):
    """``model`` (or a PEFT model over it) patched once (module docstring). Returns ``model``."""
    from pedestrian.interop.hf_llama_config import config_from_hf

    if getattr(model, "_float64_throughout", False):
        return model
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = config_from_hf(inner.config.to_dict())
    r = config.d_qk

    def inv_freq(base, scaling):
        f = torch.as_tensor(base ** (-2.0 * np.arange(r // 2) / r))
        return f / scaling.factor if scaling is not None else f

    tables = {"full_attention": inv_freq(config.rope_base, config.rope_scaling),
              "sliding_attention": inv_freq(config.rope_local_base or config.rope_base,
                                            None if config.rope_local_base else config.rope_scaling)}

    def rotary(x, position_ids, layer_type="full_attention"):
        angle = position_ids[..., None].double() * tables[layer_type]
        emb = torch.cat((angle, angle), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def rms(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    patch_rotary_and_norms(model, rotary, rms)
    import transformers.models.gemma2.modeling_gemma2 as g2
    import transformers.models.gemma3.modeling_gemma3 as g3

    g2.eager_attention_forward = g3.eager_attention_forward = _eager64
    inner.config._attn_implementation = "eager"
    model._float64_throughout = True
    return model


def as_float64(model):
    """``model`` in float64 with every float32 step replaced (:func:`float64_throughout`), its
    embedding scale ``√d`` in float64."""
    model = float64_throughout(model).double()
    for module in model.modules():
        if type(module).__name__.endswith("ScaledWordEmbedding"):
            module.embed_scale = torch.tensor(float(module.scalar_embed_scale), dtype=torch.float64)
    return model


def hf_logits(model, x, dtype=torch.float64) -> np.ndarray:
    with torch.no_grad():
        m = as_float64(model) if dtype == torch.float64 else float64_throughout(model).to(dtype)
        return m(torch.as_tensor(x)).logits.double().numpy()

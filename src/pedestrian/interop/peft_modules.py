"""PEFT's module names <-> pedestrian's FC layers, and PEFT's per-module rank and scaling rules
(what :mod:`pedestrian.interop.peft` reads and writes by).

Modules (HF GPT-2 -> pedestrian FC layer)::

    transformer.h.{i}.attn.c_attn  -> blocks.{i}.attn.q, .k, .v   (output columns [q | k | v])
    transformer.h.{i}.attn.c_proj  -> blocks.{i}.attn_proj
    transformer.h.{i}.mlp.c_fc     -> blocks.{i}.mlp_expand
    transformer.h.{i}.mlp.c_proj   -> blocks.{i}.mlp_contract
    lm_head                        -> logits

Modules (HF Llama / Qwen2 / Mistral -> pedestrian FC layer; one module per layer, ``nn.Linear``)::

    model.layers.{i}.self_attn.q_proj / k_proj / v_proj  -> blocks.{i}.attn.q / .k / .v
    model.layers.{i}.self_attn.o_proj                    -> blocks.{i}.attn_proj
    model.layers.{i}.mlp.gate_proj / up_proj / down_proj -> blocks.{i}.mlp_gate / mlp_expand / mlp_contract
    lm_head                                              -> logits

(with grouped-query attention the k and v adapters have ``n_kv_heads · head_dim`` output
columns, as the modules). The family is the base config's (:func:`is_gpt2`): GPT-2 when it is
GPT-2-shaped, else the Llama-layout family that writes it (:func:`~.families.family_names`).
"""

from __future__ import annotations

import math
import re
from typing import Mapping

from ..config import GPTConfig
from ..model.layout import fc_layers
from .families import block_layer, family_names, hf_block_name, layout_of

__all__ = ["is_gpt2", "peft_module", "fc_of_module", "pattern_value", "peft_scaling"]


_MODULE = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)$")
_HF_TO_FC = {"attn.c_proj": "attn_proj", "mlp.c_fc": "mlp_expand", "mlp.c_proj": "mlp_contract"}
_FC_TO_HF = {v: k for k, v in _HF_TO_FC.items()}
_LLAMA_MODULE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def is_gpt2(config: GPTConfig) -> bool:
    """Whether PEFT names ``config``'s modules as GPT-2's (else by its Llama-layout family's
    :attr:`~.families.Family.names`)."""
    return layout_of(config) == "gpt2"


def peft_module(fc: str, config: GPTConfig | None = None) -> tuple[str, str | None]:
    """pedestrian FC layer -> ``(PEFT module name, part of c_attn or None)``.

    GPT-2 (``config`` None or GPT-2-shaped): ``"blocks.0.attn.k"`` ->
    ``("transformer.h.0.attn.c_attn", "k")``; Llama family: ``"blocks.0.attn.k"`` ->
    ``("model.layers.0.self_attn.k_proj", None)``; ``"logits"`` -> ``("lm_head", None)``.
    """
    if fc == "logits":
        return "lm_head", None
    _, i, rest = fc.split(".", 2)
    if config is not None and not is_gpt2(config):
        return f"model.layers.{i}.{hf_block_name(family_names(config), rest)}", None
    if rest.startswith("attn."):
        return f"transformer.h.{i}.attn.c_attn", rest[len("attn."):]
    return f"transformer.h.{i}.{_FC_TO_HF[rest]}", None


def pattern_value(patterns: Mapping, module: str, default):
    """PEFT's rule (``peft.utils.other.get_pattern_key``): the first key ``k`` for which
    ``re.match(rf"(.*\\.)?({k})$", module)`` matches gives the value."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def peft_scaling(peft_config: Mapping, module: str, rank: int) -> float:
    """PEFT's ``scaling`` of one module: ``lora_alpha / r`` (``/ √r`` with ``use_rslora``),
    with ``alpha_pattern`` applied; this is pedestrian's ``α`` for that module."""
    alpha = pattern_value(peft_config.get("alpha_pattern"), module, peft_config.get("lora_alpha", 8))
    denom = math.sqrt(rank) if peft_config.get("use_rslora") else rank
    return float(alpha) / denom


def fc_of_module(module: str, config: GPTConfig) -> list[str] | None:
    """PEFT module name -> the pedestrian FC layers it adapts (three for GPT-2's ``c_attn``: q, k, v),
    or ``None`` for a name that is not a module of ``config``'s base (the inverse of :func:`peft_module`)."""
    if module in ("lm_head",):
        return ["logits"]
    if not is_gpt2(config):
        m = _LLAMA_MODULE.match(module)
        fc = block_layer(family_names(config), m.group(2)) if m else None
        name = f"blocks.{m.group(1)}.{fc}" if fc is not None else None
        return [name] if name is not None and name in {n for n, _, _ in fc_layers(config)} else None
    m = _MODULE.match(module)
    if m is None or int(m.group(1)) >= config.n_blocks:
        return None
    i, kind = int(m.group(1)), m.group(2)
    if kind == "attn.c_attn":
        return [f"blocks.{i}.attn.{p}" for p in "qkv"]
    return [f"blocks.{i}.{_HF_TO_FC[kind]}"]

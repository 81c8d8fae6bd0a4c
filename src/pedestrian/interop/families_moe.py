"""The mixture-of-experts families: Mixtral, Qwen3-MoE and OLMoE entries of :data:`.families.FAMILIES`
(EQUATIONS.md, "Mixture of experts").

transformers 5.25 keeps a block's experts as 3-D parameters in memory (``mlp.experts.gate_up_proj``
``(E, 2m, d)``, ``down_proj`` ``(E, d, m)``) but ``save_pretrained`` writes one tensor per expert and
matrix, which is what its folders hold and what pedestrian reads and writes::

    model.layers.{i}.mlp.gate.weight (E, d)                          blocks.{i}.router.weight (d, E)
    model.layers.{i}.mlp.experts.{e}.gate_proj.weight (m, d)         blocks.{i}.experts.{e}.mlp_gate.weight (d, m)
    model.layers.{i}.mlp.experts.{e}.up_proj.weight (m, d)           blocks.{i}.experts.{e}.mlp_expand.weight
    model.layers.{i}.mlp.experts.{e}.down_proj.weight (d, m)         blocks.{i}.experts.{e}.mlp_contract.weight

(Mixtral: ``block_sparse_moe.gate``, ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2``
(down)). Config keys: ``num_local_experts`` / ``num_experts`` -> ``n_experts``,
``num_experts_per_tok`` -> ``n_experts_per_token``, the expert width (Mixtral's and OLMoE's
``intermediate_size``, Qwen3-MoE's ``moe_intermediate_size``) -> ``d_expert``, ``norm_topk_prob``
(Mixtral: always renormalised), ``router_aux_loss_coef``, ``output_router_logits``; Qwen3-MoE's
``mlp_only_layers`` and ``decoder_sparse_step`` -> ``moe_layers`` (its dense blocks keep
``intermediate_size``). A window slides every layer, as Mistral's: Mixtral's ``sliding_window``,
Qwen3-MoE's with ``use_sliding_window`` (transformers masks every layer with
``create_sliding_window_causal_mask`` then). Refused in one line: Mixtral's ``router_jitter_noise``
(noise on the router's input while training), OLMoE's ``clip_qkv``, ``attention_bias``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from .families import (ANY, LLAMA_NAMES, QK_NORM_NAMES, REFUSED_KEYS, Family, attention_bias_refused, want_key,
                       register, window_value)

__all__ = ["ExpertNames", "MAX_EXPERTS"]

#: the most experts a block's names are listed for (:meth:`ExpertNames.__iter__`; Qwen3-MoE has 128)
MAX_EXPERTS = 1024
_EXPERT = re.compile(r"experts\.(\d+)\.(mlp_gate|mlp_expand|mlp_contract)")
#: the keys a mixture of experts sets: every dense family's features must leave them at the default
MOE_FEATURES = {"n_experts": ANY}
#: the refused keys of the other families but those these read (shared experts stay refused)
_REFUSED = tuple(k for k in REFUSED_KEYS if k not in ("num_experts", "num_local_experts", "num_experts_per_tok",
                                                      "moe_intermediate_size"))


class ExpertNames(Mapping):
    """A family's block names (:attr:`.families.Family.names`) with its router and experts:
    ``"router"`` -> the router's module, ``"experts.{e}.mlp_gate"`` -> ``template["mlp_gate"]``
    with ``{e}`` filled in, the dense layers as ``base`` (Qwen3-MoE's ``mlp_only_layers``)."""

    def __init__(self, base: Mapping, router: str, template: Mapping):
        self.base, self.router, self.template = dict(base), router, dict(template)

    def __getitem__(self, key: str) -> str:
        if key in self.base:
            return self.base[key]
        if key == "router":
            return self.router
        m = _EXPERT.fullmatch(key)
        if m is None:
            raise KeyError(key)
        return self.template[m.group(2)].format(e=m.group(1))

    def __iter__(self):
        yield from self.base
        yield "router"
        for e in range(MAX_EXPERTS):
            for layer in self.template:
                yield f"experts.{e}.{layer}"

    def __len__(self) -> int:
        return len(self.base) + 1 + MAX_EXPERTS * len(self.template)


def _int(c: Mapping, key: str, source: str) -> int:
    v = c.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{source}: {key}={v!r} is not a positive integer")
    return v


def _moe_fields(c: Mapping, source: str, experts_key: str, width_key: str, renorm, default_experts: int) -> dict:
    """The experts' :class:`GPTConfig` fields of a parsed config (``renorm``: a bool, or the key to read).
    The expert count is ``num_experts`` or ``num_local_experts``, whichever the file has (transformers
    writes Qwen3-MoE's as ``num_local_experts``, Hub folders ``num_experts``), else ``default_experts``."""
    E = c.get("num_experts", c.get("num_local_experts", default_experts))
    if not isinstance(E, int) or isinstance(E, bool) or E < 1:
        raise ValueError(f"{source}: {experts_key}={E!r} is not a positive integer (the experts per block)")
    k = _int(c, "num_experts_per_tok", source)
    if k > E:
        raise ValueError(f"{source}: num_experts_per_tok={k} exceeds {experts_key}={E}")
    coef = c.get("router_aux_loss_coef", 0.0)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        raise ValueError(f"{source}: router_aux_loss_coef={coef!r} is not a number >= 0")
    return dict(n_experts=E, n_experts_per_token=k, d_expert=_int(c, width_key, source),
                norm_topk_prob=renorm if isinstance(renorm, bool) else bool(c.get(renorm, False)),
                router_aux_loss_coef=float(coef), output_router_logits=bool(c.get("output_router_logits", False)),
                bias=False, qkv_bias=False)


def _moe_write(config, experts_key: str, width_key: str) -> dict:
    c = config
    return {experts_key: c.n_experts, "num_experts_per_tok": c.n_experts_per_token, width_key: c.d_expert,
            "norm_topk_prob": c.norm_topk_prob, "router_aux_loss_coef": c.router_aux_loss_coef,
            "output_router_logits": c.output_router_logits}


def _moe_problems(config, **allowed) -> list[str]:
    c = config
    out = [] if c.n_experts else ["n_experts=0 (a mixture of experts has experts)"]
    return out + want_key(c, bias=False, qkv_bias=False, **allowed)


# ------------------------------------------------------------------------------------------ Mixtral
def _mixtral_fields(c: Mapping, source: str) -> dict:
    if c.get("router_jitter_noise"):
        raise ValueError(f"{source}: router_jitter_noise={c['router_jitter_noise']!r} (random noise on the router's "
                         "input while training) is not implemented; only 0")
    return dict(_moe_fields(c, source, "num_local_experts", "intermediate_size", True, 8),
                sliding_window=window_value(c.get("sliding_window"), source))


register(Family(
    "mixtral", "MixtralForCausalLM",
    dict(hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False, num_key_value_heads=8, head_dim=None,
         rope_theta=1_000_000.0, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, vocab_size=32000,
         intermediate_size=14336, max_position_embeddings=4096 * 32, sliding_window=None, num_experts_per_tok=2,
         output_router_logits=False, router_aux_loss_coef=0.001, router_jitter_noise=0.0),
    names=ExpertNames({k: v for k, v in LLAMA_NAMES.items() if not k.startswith("mlp_")}, "block_sparse_moe.gate",
                      {"mlp_gate": "block_sparse_moe.experts.{e}.w1", "mlp_expand": "block_sparse_moe.experts.{e}.w3",
                       "mlp_contract": "block_sparse_moe.experts.{e}.w2"}),
    features={**MOE_FEATURES, "sliding_window": ANY}, fields=_mixtral_fields,
    problems=lambda c: _moe_problems(c, norm_topk_prob=True, moe_layers=None),
    write=lambda c: dict(_moe_write(c, "num_local_experts", "intermediate_size"), sliding_window=c.sliding_window,
                         router_jitter_noise=0.0),
    refused_keys=_REFUSED))

_EXPERT_NAMES = {"mlp_gate": "mlp.experts.{e}.gate_proj", "mlp_expand": "mlp.experts.{e}.up_proj",
                 "mlp_contract": "mlp.experts.{e}.down_proj"}


# ------------------------------------------------------------------------------------------ Qwen3-MoE
def _qwen3_moe_fields(c: Mapping, source: str) -> dict:
    attention_bias_refused(c, source)
    n, step = c["num_hidden_layers"], _int(c, "decoder_sparse_step", source)
    dense = c.get("mlp_only_layers") or []
    if not isinstance(dense, (list, tuple)) or any(not isinstance(i, int) or isinstance(i, bool) for i in dense):
        raise ValueError(f"{source}: mlp_only_layers={dense!r} must be a list of layer indices")
    sparse = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    fields = _moe_fields(c, source, "num_experts", "moe_intermediate_size", "norm_topk_prob", 128)
    fields["moe_layers"] = None if len(sparse) == n else sparse
    fields["sliding_window"] = window_value(c.get("sliding_window"), source) if c.get("use_sliding_window") else None
    if not sparse:
        raise ValueError(f"{source}: mlp_only_layers={list(dense)!r} with decoder_sparse_step={step} leaves no layer "
                         "with experts; load it as a Qwen3 model")
    return fields


def _qwen3_moe_write(c) -> dict:
    sparse = list(range(c.n_blocks)) if c.moe_layers is None else list(c.moe_layers)
    return dict(_moe_write(c, "num_experts", "moe_intermediate_size"), decoder_sparse_step=1,
                mlp_only_layers=[i for i in range(c.n_blocks) if i not in sparse], attention_bias=False,
                use_sliding_window=c.sliding_window is not None, sliding_window=c.sliding_window,
                max_window_layers=c.n_blocks)


register(Family(
    "qwen3_moe", "Qwen3MoeForCausalLM",
    dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, num_key_value_heads=4, head_dim=None,
         rope_theta=10_000.0, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, vocab_size=151936,
         intermediate_size=6144, max_position_embeddings=32768, attention_bias=False, use_sliding_window=False,
         sliding_window=4096, decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8,
         norm_topk_prob=False, output_router_logits=False, router_aux_loss_coef=0.001,
         mlp_only_layers=None),
    names=ExpertNames({**LLAMA_NAMES, **QK_NORM_NAMES}, "mlp.gate", _EXPERT_NAMES),
    features={**MOE_FEATURES, "qk_norm": "head", "sliding_window": ANY}, fields=_qwen3_moe_fields,
    problems=lambda c: _moe_problems(c), write=_qwen3_moe_write, refused_keys=_REFUSED))


# ------------------------------------------------------------------------------------------ OLMoE
def _olmoe_fields(c: Mapping, source: str) -> dict:
    attention_bias_refused(c, source)
    if c.get("clip_qkv") is not None:
        raise ValueError(f"{source}: clip_qkv={c['clip_qkv']!r} (q, k, v clamped to ±clip_qkv) is not implemented; "
                         "only null")
    return _moe_fields(c, source, "num_experts", "intermediate_size", "norm_topk_prob", 64)


register(Family(
    "olmoe", "OlmoeForCausalLM",
    dict(hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False, num_key_value_heads=None, head_dim=None,
         rope_theta=10_000.0, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, vocab_size=50304,
         intermediate_size=2048, max_position_embeddings=4096, attention_bias=False, clip_qkv=None,
         num_experts_per_tok=8, output_router_logits=False, router_aux_loss_coef=0.01,
         norm_topk_prob=False),
    names=ExpertNames({**{k: v for k, v in LLAMA_NAMES.items() if not k.startswith("mlp_")}, **QK_NORM_NAMES},
                      "mlp.gate", _EXPERT_NAMES),
    features={**MOE_FEATURES, "qk_norm": "proj"}, fields=_olmoe_fields,
    problems=lambda c: _moe_problems(c, moe_layers=None),
    write=lambda c: dict(_moe_write(c, "num_experts", "intermediate_size"), attention_bias=False, clip_qkv=None),
    refused_keys=_REFUSED))

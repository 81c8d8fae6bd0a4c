"""Hugging Face Llama-layout configs (``LlamaConfig``, ``Qwen2Config``, ``MistralConfig``, ...)
<-> :class:`~pedestrian.config.GPTConfig`: the keys every such family shares.

:func:`hf_family` tells the families apart (``model_type``, else ``architectures``;
:mod:`.families` holds one entry per family: its defaults, its own keys and refusals, its
names); :func:`config_from_hf` maps any of them (GPT-2 through :mod:`.hf_config`). Field by
field (transformers 5.25 names; older ``config.json`` files are read too)::

    vocab_size -> vocab_size        hidden_size -> d_model            num_hidden_layers -> n_blocks
    num_attention_heads -> n_heads  num_key_value_heads (null: n_heads) -> n_kv_heads
    head_dim (null: hidden_size / num_attention_heads) -> d_head = d_qk
    intermediate_size -> d_mlp      max_position_embeddings -> context_length
    rms_norm_eps -> ln_eps (norm="rmsnorm")                tie_word_embeddings -> tie_weights
    rope_parameters {rope_theta, rope_type, ...}, or the older rope_theta + rope_scaling
        -> rope_base, rope_scaling (rope_type "default" or "llama3"; position_encoding="rope")
    hidden_act "silu" (or "swish", the same nn.SiLU) -> mlp="swiglu", activation="silu"
    the family's own keys (:attr:`.families.Family.fields`), e.g. Qwen2's q, k, v biases ->
        qkv_bias=True (bias=False), Llama attention_bias and mlp_bias both true -> bias=True

Refused, each with one line naming the field and its value: another ``hidden_act``, another
``rope_type`` (linear, dynamic, yarn, longrope, ...), ``partial_rotary_factor`` other than 1
(Llama's rotate_half turns the whole head), ``layer_types`` other than ``full_attention`` in a
family without windows (Qwen2's and Qwen3's: ``use_sliding_window`` from layer
``max_window_layers`` on, read by :mod:`.families`), Llama ``attention_bias`` or ``mlp_bias`` true alone, per-layer
``rope_parameters`` that differ, ``is_encoder_decoder`` or ``add_cross_attention`` true, and the
keys of features the Llama code does not have (:data:`REFUSED_KEYS`: experts, q/k norms,
attention sinks) when set.

Irrelevant (read, not carried): ``attention_dropout`` (training-time dropout on the attention
probabilities; the loaded model has dropout 0, as for GPT-2's ``attn_pdrop``),
``initializer_range`` (initialisation only), ``use_cache``, ``pad/bos/eos_token_id`` (token ids:
the tokenizer's business), ``pretraining_tp`` (transformers 5 ignores it; before, it split the
same products into slices), Qwen2 ``sliding_window`` / ``max_window_layers`` when
``use_sliding_window`` is false (transformers then ignores them), ``dtype`` / ``torch_dtype``
(the storage dtype; weights are widened on load), SmolLM2's ``rope_interleaved`` /
``is_llama_config`` (nanotron keys transformers ignores: HF folders hold rotate-half weights),
and the bookkeeping keys of every ``PretrainedConfig`` (``transformers_version``,
``_name_or_path``, ``id2label``, ``output_attentions``, ...).

RoPE layout: Hugging Face's ``rotate_half`` pairs feature ``j`` with ``j + head_dim/2``, as
:mod:`pedestrian.layers.rope` does, so q and k weights load without a permutation.
"""

from __future__ import annotations

from typing import Mapping

from ..config import GPTConfig, RopeScaling
from . import families
from .families import FAMILIES, REFUSED_KEYS, hf_family
from .families import llama_export_problems as export_problems
from .hf_config import config_from_hf as gpt2_config_from_hf

__all__ = ["ARCHITECTURES", "HF_DEFAULTS", "REFUSED_KEYS", "hf_family", "config_from_hf", "config_to_hf",
           "export_family", "export_problems"]

#: ``model_type`` -> the ``architectures`` entry ``save_pretrained`` writes (from :data:`.families.FAMILIES`)
ARCHITECTURES = {name: f.architecture for name, f in FAMILIES.items()}
#: each Llama-layout class's defaults (transformers 5.25), for keys a ``config.json`` leaves out
HF_DEFAULTS = {name: f.defaults for name, f in FAMILIES.items() if f.layout == "llama"}
_ACTIVATIONS = ("silu", "swish")


def _rope(c: Mapping, source: str) -> tuple[float, RopeScaling | None]:
    """``(rope_base, rope_scaling)`` from ``rope_scaling`` or else ``rope_parameters``, the theta
    from that object or else ``rope_theta`` beside it (transformers' order when a config.json has
    both: ``PreTrainedConfig.convert_rope_params_to_dict``, ``rope_scaling or rope_parameters``)."""
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"{source}: rope_parameters={params!r} is not an object")
    if params and all(isinstance(v, Mapping) or v is None for v in params.values()):   # per layer type
        kinds = {k: v for k, v in params.items() if v is not None}
        if len({repr(sorted(v.items())) for v in kinds.values()}) != 1:
            raise ValueError(f"{source}: rope_parameters differ per layer type ({sorted(kinds)}); "
                             "pedestrian turns every layer alike")
        params = next(iter(kinds.values()))
    theta = params.get("rope_theta", c.get("rope_theta", 10_000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1:
        raise ValueError(f"{source}: rope_theta={theta!r} must be a number > 1 (RoPE's base)")
    partial = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{source}: partial_rotary_factor={partial!r} is not implemented for this model "
                         "(its rotate_half turns the whole head); only 1.0")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ValueError(f"{source}: rope_type={kind!r} is not implemented; pedestrian implements "
                         "'default' and 'llama3'")
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor", "type")}
    scaling["rope_type"] = "llama3"
    scaling.setdefault("original_max_position_embeddings", c.get("max_position_embeddings"))
    try:
        return float(theta), RopeScaling.from_value(scaling)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def config_from_hf(hf_config: Mapping, *, source: str = "config.json", family: str | None = None) -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face ``config.json`` of any family of
    :data:`.families.FAMILIES` (GPT-2 through :mod:`.hf_config`): the keys every Llama-layout
    family shares (the module table; missing keys take the class's defaults), then the
    family's own (:attr:`.families.Family.fields`).

    Raises:
        ValueError: another model, or a setting pedestrian does not implement -- one line naming
            the field and its value (the first one found).
    """
    family = family or hf_family(hf_config, source=source)       # (given: decided by the caller already)
    entry = FAMILIES[family]
    if entry.layout == "gpt2":
        return gpt2_config_from_hf(hf_config, source=source)
    c = {**entry.defaults, **hf_config}
    for key in entry.refused_keys:
        if c.get(key) not in (None, False, 0, [], {}):
            raise ValueError(f"{source}: {key}={c[key]!r} is not implemented in pedestrian's {family} model")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings"):
        v = c[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{source}: {key}={v!r} is not a positive integer")
    extra = {k: v for k, v in entry.features.items() if v is not families.ANY}    # the family's blocks
    extra.update(entry.fields(c, source))                        # the family's own keys (and refusals)
    if "activation" not in extra and c["hidden_act"] not in _ACTIVATIONS:                # (Gemma: its own gate)
        raise ValueError(f"{source}: hidden_act={c['hidden_act']!r} is not implemented; the SwiGLU gate "
                         "is 'silu' only")
    other = [t for t in c.get("layer_types") or [] if t != "full_attention"]
    if other and "layer_types" not in extra:
        raise ValueError(f"{source}: layer_types contains {other[0]!r}; pedestrian implements only "
                         "'full_attention' layers")
    rope_base, rope_scaling = (None, None) if "rope_base" in extra else _rope(c, source)   # (Gemma 3: per layer)
    d, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c["head_dim"] if c.get("head_dim") is not None else d // heads
    m = c["intermediate_size"]
    fields = dict(vocab_size=c["vocab_size"], context_length=c["max_position_embeddings"], d_model=d,
                  n_heads=heads, n_blocks=c["num_hidden_layers"], d_head=head_dim, d_qk=head_dim,
                  n_kv_heads=c["num_key_value_heads"], mlp_ratio=m // d if m % d == 0 else 4, d_mlp=m,
                  norm="rmsnorm", mlp="swiglu", activation="silu", ln_eps=float(c["rms_norm_eps"]),
                  bias=False, qkv_bias=False, logits_bias=False, tie_weights=bool(c["tie_word_embeddings"]),
                  position_encoding="rope", rope_base=rope_base, rope_scaling=rope_scaling, dropout=0.0)
    try:
        return GPTConfig(**{**fields, **extra})
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def export_family(config: GPTConfig) -> str:
    """The Llama-layout family that writes ``config`` (:func:`.families.export_family`):
    ``"qwen2"`` with q, k, v biases only, ``"llama"`` for the plain one, ...

    Raises:
        ValueError: one line naming each setting no Llama-layout family expresses
            (:func:`export_problems`: a layer norm, the standard MLP, learned positions, ...),
            or why each family cannot write it.
    """
    problems = export_problems(config)
    if problems:
        raise ValueError("this model cannot be written as a Hugging Face Llama/Qwen2: " + "; ".join(problems))
    return families.export_family(config)


def config_to_hf(config: GPTConfig, *, dtype: str = "float32", bos_token_id: int | None = None,
                 eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict:
    """The ``config.json`` dict of the Llama-layout model equal to ``config``, of the family
    :func:`export_family` picks (the keys every such family shares, then the family's own,
    :attr:`.families.Family.write`). RoPE is written both as transformers 5's
    ``rope_parameters`` and as the older ``rope_theta`` + ``rope_scaling`` other readers use.

    Raises:
        ValueError: ``config`` is not expressible (:func:`export_family`).
    """
    family, c = export_family(config), config
    rope = {"rope_theta": c.rope_base, "rope_type": "default"}
    if c.rope_scaling is not None:
        rope.update(c.rope_scaling.to_hf())
    out = {"architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": c.vocab_size,
           "hidden_size": c.d_model, "intermediate_size": c.d_mlp, "num_hidden_layers": c.n_blocks,
           "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.d_head,
           "hidden_act": "silu", "max_position_embeddings": c.context_length, "rms_norm_eps": c.ln_eps,
           "tie_word_embeddings": c.tie_weights, "rope_parameters": rope, "rope_theta": c.rope_base,
           "rope_scaling": None if c.rope_scaling is None else c.rope_scaling.to_hf(),
           "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
           "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
           "dtype": dtype}
    out.update(FAMILIES[family].write(c))
    return out

"""The Gemma 2 and Gemma 3 (text) entries of :data:`.families.FAMILIES` (issue 48).

Gemma keeps the Llama layout and names (``model.layers.{i}.self_attn.q_proj``, ...) and adds, as
``transformers`` 5.25 computes them (docs/EQUATIONS.md "Gemma 2 and 3"; every key read is mapped
or refused in one line naming it)::

    norms x̂ ∘ (1 + w) (GemmaRMSNorm)        -> norm_offset = 1 (q/k norms too)
    input_layernorm, post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm
                                              -> ln1, ln1_post, ln2, ln2_post (norm_placement="sandwich")
    the embedding times √hidden_size         -> embedding_scale (rounded to the model's dtype)
    hidden_activation gelu_pytorch_tanh      -> the GeGLU MLP (activation="gelu_tanh")
    query_pre_attn_scalar q                  -> attn_scale = q^(−1/2) (transformers' own number)
    attn_logit_softcapping (Gemma 2: 50)     -> attn_softcap
    final_logit_softcapping (Gemma 2: 30)    -> logit_softcap
    sliding_window, layer_types              -> sliding_window, layer_types (Gemma 2: every other
                                                layer from the first; Gemma 3: all but every
                                                sliding_window_pattern-th, 6)
    Gemma 3: self_attn.q_norm, k_norm        -> qk_norm="head"
    Gemma 3: rope_parameters per layer type (or the older rope_theta, rope_local_base_freq,
             rope_scaling)                   -> rope_base, rope_scaling (global layers: default,
                                                linear or llama3), rope_local_base (window layers)

Refused: another ``hidden_activation``, ``attention_bias`` true, ``use_bidirectional_attention``
true, a window layer's RoPE with a scaling, a rope type other than default / linear / llama3.
Irrelevant (read, not carried): ``attention_dropout``, ``initializer_range``, token ids,
``cache_implementation``, ``final_logit_softcapping`` of null (no cap).
"""

from __future__ import annotations

import math
from typing import Mapping

from ..config import GPTConfig, RopeScaling

__all__ = ["GEMMA_NAMES", "GEMMA3_NAMES", "entries", "gemma2_fields", "gemma3_fields", "layer_types_of"]

#: a Gemma block: pedestrian layer -> HF module (the Llama names, with the four norms of the sandwich)
GEMMA_NAMES = {"ln1": "input_layernorm", "ln1_post": "post_attention_layernorm",
               "ln2": "pre_feedforward_layernorm", "ln2_post": "post_feedforward_layernorm",
               "attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
               "attn_proj": "self_attn.o_proj", "mlp_gate": "mlp.gate_proj", "mlp_expand": "mlp.up_proj",
               "mlp_contract": "mlp.down_proj"}
GEMMA3_NAMES = {**GEMMA_NAMES, "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}

#: ``hidden_activation`` values that are the tanh GELU (transformers' ``ACT2FN``: ``gelu_pytorch_tanh``,
#: ``gelu_new`` -- the same formula)
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new")

_COMMON = dict(hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh", num_key_value_heads=4,
               head_dim=256, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
               num_attention_heads=8, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
               query_pre_attn_scalar=256, sliding_window=4096, layer_types=None,
               use_bidirectional_attention=None)
GEMMA2_DEFAULTS = dict(_COMMON, vocab_size=256000, max_position_embeddings=8192, rope_theta=10_000.0,
                       final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
GEMMA3_DEFAULTS = dict(_COMMON, vocab_size=262_208, max_position_embeddings=131_072, rope_theta=1_000_000.0,
                       rope_local_base_freq=10_000.0, sliding_window_pattern=6, final_logit_softcapping=None,
                       attn_logit_softcapping=None, use_bidirectional_attention=False)


def _number(c: Mapping, key: str, source: str, *, positive: bool = True):
    v = c.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and not v > 0):
        raise ValueError(f"{source}: {key}={v!r} must be a number > 0 (or null)")
    return float(v)


def layer_types_of(c: Mapping, source: str, pattern) -> tuple | None:
    """``layer_types`` as the config says, or the family's default pattern (``pattern(i)``: the
    layer slides); ``None`` when there is no window (``sliding_window`` null: every layer full).
    (Gemma's, and Qwen2's and Qwen3's in :mod:`.families`.)"""
    n = c["num_hidden_layers"]
    if c.get("sliding_window") is None:
        return None
    types = c.get("layer_types")
    if types is None:
        return tuple("sliding_attention" if pattern(i) else "full_attention" for i in range(n))
    kinds = ("full_attention", "sliding_attention")
    if not isinstance(types, (list, tuple)) or len(types) != n or any(t not in kinds for t in types):
        raise ValueError(f"{source}: layer_types={types!r} must hold one of {list(kinds)} for each of the "
                         f"num_hidden_layers={n} layers")
    return tuple(types)


def _shared(c: Mapping, source: str) -> dict:
    """The keys Gemma 2 and Gemma 3 read alike."""
    act = c.get("hidden_activation") or c.get("hidden_act")
    if act not in _TANH_GELU:
        raise ValueError(f"{source}: hidden_activation={act!r} is not implemented; Gemma's GeGLU gate is the tanh "
                         f"GELU ({' or '.join(_TANH_GELU)})")
    if c.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias={c['attention_bias']!r} is not implemented (biases on q, k, v "
                         "and o but not on the MLP); only false")
    if c.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention={c['use_bidirectional_attention']!r} is not "
                         "implemented (pedestrian's models are causal); only false")
    window = c.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"{source}: sliding_window={window!r} must be a positive integer or null")
    q = _number(c, "query_pre_attn_scalar", source)
    if q is None:
        raise ValueError(f"{source}: query_pre_attn_scalar=None: Gemma scales the scores by its −1/2 power; give it")
    return dict(bias=False, qkv_bias=False, activation="gelu_tanh", norm_offset=1.0,
                embedding_scale=math.sqrt(c["hidden_size"]), attn_scale=c["query_pre_attn_scalar"] ** -0.5,
                attn_softcap=_number(c, "attn_logit_softcapping", source),
                logit_softcap=_number(c, "final_logit_softcapping", source), sliding_window=window)


def gemma2_fields(c: Mapping, source: str) -> dict:
    """Gemma 2's keys: :func:`_shared`, its layers alternating window / global from the first, one RoPE."""
    return dict(_shared(c, source), layer_types=layer_types_of(c, source, lambda i: (i + 1) % 2 != 0))


def _rope_of(params: Mapping, source: str, what: str) -> tuple[float, RopeScaling | None]:
    theta = params.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1:
        raise ValueError(f"{source}: rope_parameters[{what!r}] rope_theta={theta!r} must be a number > 1")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"{source}: rope_parameters[{what!r}] rope_type={kind!r} is not implemented; pedestrian "
                         "implements 'default', 'linear' and 'llama3'")
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    scaling["rope_type"] = kind
    try:
        return float(theta), RopeScaling.from_value(scaling)
    except ValueError as exc:
        raise ValueError(f"{source}: rope_parameters[{what!r}]: {exc}") from None


def gemma3_fields(c: Mapping, source: str) -> dict:
    """Gemma 3's keys: :func:`_shared`, every ``sliding_window_pattern``-th layer global, a RoPE
    per layer type (transformers 5's ``rope_parameters`` by type, or the older ``rope_theta`` with
    ``rope_scaling`` for the global layers and ``rope_local_base_freq`` for the window ones)."""
    if c.get("sliding_window") is None:
        raise ValueError(f"{source}: sliding_window=None is not implemented for Gemma 3 (its window layers keep "
                         "their own RoPE base); give the window")
    pattern = c.get("sliding_window_pattern", 6)
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise ValueError(f"{source}: sliding_window_pattern={pattern!r} must be a positive integer")
    out = dict(_shared(c, source), qk_norm="head",
               layer_types=layer_types_of(c, source, lambda i: (i + 1) % pattern != 0))
    params = c.get("rope_parameters")
    if isinstance(params, Mapping) and ("full_attention" in params or "sliding_attention" in params):
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        full.setdefault("rope_theta", c.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", c.get("rope_local_base_freq", 10_000.0))
    else:
        full = dict(params or {}, **dict(c.get("rope_scaling") or {}))
        full.setdefault("rope_theta", c.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": c.get("rope_local_base_freq", 10_000.0)}
    base, scaling = _rope_of(full, source, "full_attention")
    local_base, local_scaling = _rope_of(local, source, "sliding_attention")
    if local_scaling is not None:
        raise ValueError(f"{source}: rope_parameters['sliding_attention'] rope_type="
                         f"{local_scaling.rope_type!r} is not implemented; Gemma 3's window layers turn by "
                         "their base alone ('default')")
    out.update(rope_base=base, rope_scaling=scaling)
    if out["layer_types"] is not None and "sliding_attention" in out["layer_types"]:
        out["rope_local_base"] = local_base
    return out


def _problems(config: GPTConfig, gemma3: bool) -> list[str]:
    c, out = config, []
    want = dict(norm_offset=1.0, activation="gelu_tanh", norm_placement="sandwich", bias=False, qkv_bias=False,
                qk_norm="head" if gemma3 else None, embedding_scale=math.sqrt(c.d_model))
    if not gemma3:
        want.update(rope_local_base=None, rope_scaling=None)
    out += [f"{k}={getattr(c, k)!r} (needs {v!r})" for k, v in want.items() if getattr(c, k) != v]
    if c.layer_types is None and c.sliding_window is not None:
        out.append(f"sliding_window={c.sliding_window} on every layer (Gemma names each layer's type: set layer_types)")
    return out


def _rope_write(base: float, scaling) -> dict:
    out = {"rope_type": "default", "rope_theta": base}
    if scaling is not None:
        out.update(scaling.to_hf())
    return out


def _write(config: GPTConfig, gemma3: bool) -> dict:
    c = config
    scale = c.attn_scale if c.attn_scale is not None else c.score_scale
    q = 1.0 / (scale * scale)
    q = int(round(q)) if abs(q - round(q)) < 1e-9 * q and round(q) ** -0.5 == scale else q
    types = list(c.layer_types) if c.layer_types is not None else ["full_attention"] * c.n_blocks
    out = dict(hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=q,
               attn_logit_softcapping=c.attn_softcap, final_logit_softcapping=c.logit_softcap,
               sliding_window=c.sliding_window, layer_types=types, attention_bias=False,
               use_bidirectional_attention=False)
    if gemma3:
        local = c.rope_local_base if c.rope_local_base is not None else c.rope_base
        out.update(rope_parameters={"full_attention": _rope_write(c.rope_base, c.rope_scaling),
                                    "sliding_attention": _rope_write(local, None)},
                   rope_theta=c.rope_base, rope_local_base_freq=local,
                   rope_scaling=None if c.rope_scaling is None else c.rope_scaling.to_hf())
    return out


def entries(Family, ANY) -> list:
    """The two :class:`~.families.Family` entries, made with the table's own ``Family`` and ``ANY``
    (:mod:`.families` registers them: this module imports nothing of it, no import cycle)."""
    features = {"norm_placement": "sandwich", "norm_offset": 1.0, "activation": "gelu_tanh",
                "embedding_scale": ANY, "logit_softcap": ANY, "attn_softcap": ANY, "attn_scale": ANY,
                "sliding_window": ANY, "layer_types": ANY}
    return [
        Family("gemma2", "Gemma2ForCausalLM", GEMMA2_DEFAULTS, names=GEMMA_NAMES, features=features,
               fields=gemma2_fields, problems=lambda c: _problems(c, False), write=lambda c: _write(c, False)),
        Family("gemma3_text", "Gemma3ForCausalLM", GEMMA3_DEFAULTS, names=GEMMA3_NAMES,
               features={**features, "qk_norm": "head", "rope_local_base": ANY},
               fields=gemma3_fields, problems=lambda c: _problems(c, True), write=lambda c: _write(c, True)),
    ]

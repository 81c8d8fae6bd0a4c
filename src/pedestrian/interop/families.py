"""The Hugging Face model families pedestrian reads and writes, one :class:`Family` entry each.

An entry holds everything that is particular to a family: its ``model_type`` and architecture
class, the defaults of its ``transformers`` config class (for keys a ``config.json`` leaves out),
the keys it refuses, the names of its tensors (and so of its PEFT modules), and three small
functions: the :class:`~pedestrian.config.GPTConfig` fields its config keys set (refusing, in one
line naming the field and its value, what pedestrian does not implement), the ``config.json`` keys
it writes, and why it cannot write a given config. The code that reads and writes configs
(:mod:`.hf_llama_config`, :mod:`.hf_config` for GPT-2), tensors (:mod:`.hf_llama_tensors`,
:mod:`.hf_tensors`) and PEFT files (:mod:`.peft_modules`) looks families up here and has no
per-family branch: adding a family is adding its entry (and the layers it needs).

Every Llama-layout family shares the reading of :mod:`.hf_llama_config` (widths, heads, RoPE,
``hidden_act``, ``layer_types``) and the tensor layout ``model.layers.{i}.<module>`` of
:mod:`.hf_llama_tensors`; GPT-2 (``layout="gpt2"``) has its own modules, named by its entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..config import GPTConfig
from . import families_gemma

__all__ = ["Family", "FAMILIES", "hf_family", "export_family", "layout_of", "family_names",
           "llama_export_problems", "feature_problems", "register", "hf_block_name", "block_layer", "window_value",
           "FEATURES", "ANY",
           "LLAMA_NAMES", "TOP_NAMES", "REFUSED_KEYS"]

#: keys of features no entry implements; set (not null, false, 0 or empty) they are refused
REFUSED_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "n_routed_experts", "n_shared_experts",
                "moe_intermediate_size", "shared_expert_intermediate_size", "use_qk_norm", "qk_layernorm",
                "attention_sink", "use_sink", "sinks", "add_cross_attention", "is_encoder_decoder")

#: a Llama-layout block: pedestrian layer (in ``blocks.{i}.``) -> HF module (in ``model.layers.{i}.``)
LLAMA_NAMES = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm", "attn.q": "self_attn.q_proj",
               "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj", "attn_proj": "self_attn.o_proj",
               "mlp_gate": "mlp.gate_proj", "mlp_expand": "mlp.up_proj", "mlp_contract": "mlp.down_proj"}
#: the parameters outside the blocks: pedestrian name -> HF name (Llama layout)
TOP_NAMES = {"tok_emb.weight": "model.embed_tokens.weight", "ln_final.weight": "model.norm.weight",
             "logits.weight": "lm_head.weight"}

#: the defaults every Llama-layout config class shares (transformers 5.25)
_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, num_key_value_heads=None,
               head_dim=None, rope_theta=10_000.0, hidden_size=4096, num_hidden_layers=32,
               num_attention_heads=32)


def _none(c: Mapping, source: str) -> dict:
    return {}


def _no_keys(config: GPTConfig) -> dict:
    return {}


def want_key(config: GPTConfig, **allowed) -> list[str]:
    """A problem for each field of ``config`` whose value is not the one allowed."""
    return [f"{k}={getattr(config, k)!r} (needs {v!r})" for k, v in allowed.items() if getattr(config, k) != v]


#: the :class:`GPTConfig` fields of the blocks some families have and others not, with the value
#: that means "not this feature" (a family's :attr:`Family.features` names those it has: every
#: other one must be at this value for it to write a config, and it reads it so)
FEATURES = {"qk_norm": None, "norm_placement": "pre", "rope_layers": None, "n_experts": 0,
            # Gemma's pieces (interop/families_gemma.py): a family without them refuses to write them
            "norm_offset": 0.0, "activation": "silu", "embedding_scale": None, "logit_softcap": None,
            "rope_local_base": None,
            # the attention's window, score cap and scale (a family without them refuses to write them)
            "attn_softcap": None, "attn_scale": None, "sliding_window": None, "layer_types": None}
#: a :attr:`Family.features` value: any value of the field (read by the family's ``fields``)
ANY = object()


def _plain(field: str, value):
    """``value`` with what means the default written as the default (every block turning by RoPE
    is ``rope_layers=None``)."""
    if field == "rope_layers" and value is not None and all(value):
        return None
    if field == "layer_types" and value is not None and all(t == "full_attention" for t in value):
        return None
    return value


def feature_problems(family: "Family", config: GPTConfig) -> list[str]:
    """Why ``family`` cannot write ``config``'s :data:`FEATURES` (empty: it can)."""
    out = []
    for name, default in FEATURES.items():
        want = family.features.get(name, default)
        have = _plain(name, getattr(config, name))
        if want is not ANY and have != _plain(name, want):
            out.append(f"{name}={getattr(config, name)!r} (it has {want!r})")
    return out


@dataclass(frozen=True)
class Family:
    """One Hugging Face model family (module docstring).

    Attributes:
        model_type: ``config.json``'s ``model_type`` (``"llama"``).
        architecture: the class ``save_pretrained`` names in ``architectures`` (``"LlamaForCausalLM"``).
        defaults: the config class's defaults (transformers 5.25), for keys a ``config.json``
            leaves out.
        layout: ``"llama"`` (``model.layers.{i}.<module>``, :data:`LLAMA_NAMES`) or ``"gpt2"``.
        names: pedestrian block layer -> HF module, for the layers this family has (``{}`` in
            a key and its value stands for a number, :func:`hf_block_name`).
        features: the values of :data:`FEATURES` fields this family has (``qk_norm="head"``;
            :data:`ANY`: set by :attr:`fields`); read into every config of the family, and
            needed (the others at their defaults) to write one.
        fields: ``fields(c, source)`` -> the :class:`GPTConfig` fields this family's keys set
            (``c``: ``config.json`` over :attr:`defaults`); raises ``ValueError`` (one line,
            ``source`` first, naming the field and its value) for a setting not implemented.
        write: ``write(config)`` -> this family's own ``config.json`` keys.
        problems: ``problems(config)`` -> why this family cannot write ``config`` (empty: it can),
            beyond what every Llama-layout family needs (:func:`llama_export_problems`).
        exports: whether :func:`export_family` may choose it (a family whose models another
            family writes too says so in its ``problems``: Mistral without a window is a Llama).
        refused_keys: keys refused when set (:data:`REFUSED_KEYS`).
        arch_prefix: an ``architectures`` entry starting with this names the family too
            (GPT-2's ``GPT2LMHeadModel``, ``GPT2Model``, ...).
    """

    model_type: str
    architecture: str
    defaults: Mapping = field(default_factory=dict)
    layout: str = "llama"
    names: Mapping = field(default_factory=lambda: dict(LLAMA_NAMES))
    features: Mapping = field(default_factory=dict)
    fields: Callable[[Mapping, str], dict] = _none
    write: Callable[[GPTConfig], dict] = _no_keys
    problems: Callable[[GPTConfig], list] = lambda config: []
    exports: bool = True
    refused_keys: tuple = REFUSED_KEYS
    arch_prefix: str | None = None

    def matches_architecture(self, arch: str) -> bool:
        """Whether an ``architectures`` entry names this family (its class, or its bare model)."""
        if self.arch_prefix is not None and arch.startswith(self.arch_prefix):
            return True
        return arch in (self.architecture, self.architecture.replace("ForCausalLM", "Model"))


# ------------------------------------------------------------------------------------ the entries
def window_value(w, source: str):
    """A ``sliding_window`` value read: a positive integer, or ``None`` (no window)."""
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
        raise ValueError(f"{source}: sliding_window={w!r} must be a positive integer or null")
    return w


def _qwen_window(c: Mapping, source: str) -> dict:
    """Qwen2's and Qwen3's window (transformers' ``Qwen2Config.__post_init__``): ``use_sliding_window``
    switches ``sliding_window`` on (off: every layer attends to the whole causal context), and the
    layers from ``max_window_layers`` on slide, unless ``layer_types`` names each layer; a sliding
    layer sees keys ``i − w < j <= i`` (``create_sliding_window_causal_mask``, as Mistral's)."""
    w = c.get("sliding_window") if c.get("use_sliding_window") else None
    if w is None:
        sliding = [t for t in c.get("layer_types") or [] if t != "full_attention"]
        if sliding:
            raise ValueError(f"{source}: layer_types names {sliding[0]!r} layers with use_sliding_window="
                             f"{c.get('use_sliding_window')!r} and sliding_window={c.get('sliding_window')!r} (no "
                             "window for them); set use_sliding_window true and a sliding_window, or make every "
                             "layer 'full_attention'")
        return dict(sliding_window=None, layer_types=None)
    window_value(w, source)
    first = c.get("max_window_layers")
    if c.get("layer_types") is None and (isinstance(first, bool) or not isinstance(first, int) or first < 0):
        raise ValueError(f"{source}: max_window_layers={first!r} must be a layer index >= 0 (the first that slides)")
    types = families_gemma.layer_types_of(c, source, lambda i: i >= first)
    if "sliding_attention" not in types:                     # (no layer slides: the window is not used)
        return dict(sliding_window=None, layer_types=None)
    return dict(sliding_window=w, layer_types=types)


def _qwen_window_write(config: GPTConfig) -> dict:
    """The window keys of a Qwen2 / Qwen3 ``config.json`` (every layer's type written out)."""
    n = config.n_blocks
    types = ["sliding_attention" if config.window(i) else "full_attention" for i in range(n)]
    if "sliding_attention" not in types:
        return dict(use_sliding_window=False, sliding_window=None, max_window_layers=n, layer_types=types)
    return dict(use_sliding_window=True, sliding_window=config.sliding_window,
                max_window_layers=types.index("sliding_attention"), layer_types=types)


def _llama_fields(c: Mapping, source: str) -> dict:
    """Llama's ``attention_bias`` and ``mlp_bias``: both or neither (pedestrian's ``bias`` covers
    every linear layer)."""
    ab, mb = bool(c.get("attention_bias", False)), bool(c.get("mlp_bias", False))
    if ab != mb:
        key = "attention_bias" if ab else "mlp_bias"
        raise ValueError(f"{source}: {key}=true without {'mlp_bias' if ab else 'attention_bias'}=true is "
                         "not implemented (pedestrian's bias switch covers every linear layer)")
    return dict(bias=ab, qkv_bias=ab)


def _llama_problems(config: GPTConfig) -> list[str]:
    p = [] if config.bias == config.qkv_bias else [
        f"bias={config.bias} with qkv_bias={config.qkv_bias} (Llama's attention_bias and mlp_bias cover "
        "q, k, v, o and the MLP together)"]
    return p


def _qwen2_fields(c: Mapping, source: str) -> dict:
    return dict(_qwen_window(c, source), bias=False, qkv_bias=True)


def _mistral_fields(c: Mapping, source: str) -> dict:
    """Mistral's ``sliding_window`` (4096 when the key is missing; ``null``: full causal attention):
    every layer sees its last ``w`` keys, ``i − w < j <= i`` (transformers' Mistral masks every
    layer alike with ``create_sliding_window_causal_mask``; it has no ``layer_types``)."""
    return dict(bias=False, qkv_bias=False, sliding_window=window_value(c["sliding_window"], source))


def _mistral_problems(config: GPTConfig) -> list[str]:
    p = want_key(config, bias=False, qkv_bias=False)
    if config.sliding_window is None:
        p.append("no sliding_window (written as a Llama)")
    if config.layer_types is not None and set(config.layer_types) != {"sliding_attention"}:
        p.append(f"layer_types={list(config.layer_types)!r} (Mistral slides every layer)")
    return p


def _gpt2_problems(config: GPTConfig) -> list[str]:
    from .hf_config import export_problems
    return export_problems(config)


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` to :data:`FAMILIES` (by ``model_type``; later entries are tried later by
    :func:`export_family`)."""
    FAMILIES[family.model_type] = family
    return family


register(Family("gpt2", "GPT2LMHeadModel", layout="gpt2", names={}, problems=_gpt2_problems, arch_prefix="GPT2"))
register(Family(
    "llama", "LlamaForCausalLM",
    dict(_COMMON, vocab_size=32000, intermediate_size=11008, max_position_embeddings=2048,
         attention_bias=False, mlp_bias=False),
    fields=_llama_fields, problems=_llama_problems,
    write=lambda c: dict(attention_bias=c.bias, mlp_bias=c.bias, pretraining_tp=1)))
register(Family(
    "qwen2", "Qwen2ForCausalLM",
    dict(_COMMON, vocab_size=151936, intermediate_size=22016, max_position_embeddings=32768,
         num_key_value_heads=32, use_sliding_window=False, sliding_window=4096, max_window_layers=28,
         layer_types=None),
    features={"sliding_window": ANY, "layer_types": ANY},
    fields=_qwen2_fields, problems=lambda c: want_key(c, bias=False, qkv_bias=True), write=_qwen_window_write))
register(Family(
    "mistral", "MistralForCausalLM",
    dict(_COMMON, vocab_size=32000, intermediate_size=14336, max_position_embeddings=131072,
         num_key_value_heads=8, sliding_window=4096),
    features={"sliding_window": ANY, "layer_types": ANY}, fields=_mistral_fields, problems=_mistral_problems,
    write=lambda c: dict(sliding_window=c.sliding_window)))


#: the q/k norms' modules (Qwen3, OLMo 2, Gemma 3)
QK_NORM_NAMES = {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}


def attention_bias_refused(c: Mapping, source: str) -> None:
    """``attention_bias`` puts biases on q, k, v and o but not on the MLP: no pedestrian switch."""
    if c.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias={c['attention_bias']!r} is not implemented (biases on q, k, v "
                         "and o but not on the MLP); only false")


def _qwen3_fields(c: Mapping, source: str) -> dict:
    attention_bias_refused(c, source)
    return dict(_qwen_window(c, source), bias=False, qkv_bias=False)


register(Family(
    "qwen3", "Qwen3ForCausalLM",
    dict(_COMMON, vocab_size=151936, intermediate_size=22016, max_position_embeddings=32768,
         num_key_value_heads=32, head_dim=128, attention_bias=False, use_sliding_window=False,
         sliding_window=4096, max_window_layers=28, layer_types=None),
    names={**LLAMA_NAMES, **QK_NORM_NAMES}, features={"qk_norm": "head", "sliding_window": ANY, "layer_types": ANY},
    fields=_qwen3_fields, problems=lambda c: want_key(c, bias=False, qkv_bias=False),
    write=lambda c: dict(_qwen_window_write(c), attention_bias=False)))


def _olmo2_fields(c: Mapping, source: str) -> dict:
    attention_bias_refused(c, source)
    return dict(bias=False, qkv_bias=False)


register(Family(
    "olmo2", "Olmo2ForCausalLM",
    dict(_COMMON, vocab_size=50304, hidden_size=4096, intermediate_size=11008, max_position_embeddings=2048,
         rms_norm_eps=1e-5, attention_bias=False),
    names={**{k: v for k, v in LLAMA_NAMES.items() if k not in ("ln1", "ln2")}, **QK_NORM_NAMES,
           "ln1_post": "post_attention_layernorm", "ln2_post": "post_feedforward_layernorm"},
    features={"qk_norm": "proj", "norm_placement": "post"},
    fields=_olmo2_fields, problems=lambda c: want_key(c, bias=False, qkv_bias=False),
    write=lambda c: dict(attention_bias=False)))


def _smollm3_fields(c: Mapping, source: str) -> dict:
    """SmolLM3's ``no_rope_layers`` (1: the layer *uses* RoPE; missing: every
    ``no_rope_layer_interval``-th layer skips it) -> ``rope_layers``; Llama's biases."""
    n = c["num_hidden_layers"]
    if c.get("use_sliding_window") and c.get("sliding_window") is not None:
        raise ValueError(f"{source}: use_sliding_window={c['use_sliding_window']!r} with sliding_window="
                         f"{c['sliding_window']!r} (a sliding-window attention on the layers without RoPE) is not "
                         "implemented; only false")
    layers = c.get("no_rope_layers")
    if layers is None:
        interval = c.get("no_rope_layer_interval", 4)
        layers = [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(layers, (list, tuple)) or len(layers) != n or any(v not in (0, 1) for v in layers):
        raise ValueError(f"{source}: no_rope_layers={layers!r} must hold a 0 or 1 for each of the "
                         f"num_hidden_layers={n} layers (1: the layer uses RoPE)")
    return dict(_llama_fields(c, source), rope_layers=tuple(bool(v) for v in layers))


register(Family(
    "smollm3", "SmolLM3ForCausalLM",
    dict(_COMMON, vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768, use_sliding_window=False,
         sliding_window=None, no_rope_layers=None, no_rope_layer_interval=4, layer_types=None,
         attention_bias=False, mlp_bias=False, tie_word_embeddings=True),
    features={"rope_layers": ANY}, fields=_smollm3_fields, problems=_llama_problems,
    write=lambda c: dict(attention_bias=c.bias, mlp_bias=c.bias, use_sliding_window=False, sliding_window=None,
                         no_rope_layers=[int(c.uses_rope(i)) for i in range(c.n_blocks)],
                         layer_types=["full_attention"] * c.n_blocks)))




for _entry in families_gemma.entries(Family, ANY):               # Gemma 2, Gemma 3 text (interop/families_gemma.py)
    register(_entry)


# ------------------------------------------------------------------------------------ lookups
def hf_family(hf_config: Mapping, *, source: str = "config.json") -> str:
    """The family of a parsed ``config.json``: its ``model_type``, else the family an
    ``architectures`` entry names (``LlamaForCausalLM`` -> ``"llama"``).

    Raises:
        ValueError: any other model (the message names its ``model_type`` or architectures).
    """
    model_type = hf_config.get("model_type")
    if model_type is not None:
        if model_type in FAMILIES:
            return model_type
        raise ValueError(f"{source}: model_type={model_type!r} is not implemented; pedestrian reads "
                         f"{sorted(FAMILIES)}")
    archs = [str(a) for a in hf_config.get("architectures") or []]
    for a in archs:
        for family in FAMILIES.values():
            if family.matches_architecture(a):
                return family.model_type
    raise ValueError(f"{source}: no model_type and architectures={archs}; pedestrian reads "
                     f"{sorted(f.architecture for f in FAMILIES.values())}")


def layout_of(config: GPTConfig) -> str:
    """``"gpt2"`` for a GPT-2-shaped config (layer norms, the standard MLP), else ``"llama"``:
    how its tensors and PEFT modules are named."""
    return "gpt2" if config.norm == "layernorm" and config.mlp == "standard" else "llama"


def llama_export_problems(config: GPTConfig) -> list[str]:
    """What no Llama-layout family expresses in ``config`` (empty: some family may write it,
    :func:`export_family` picks which): a layer norm, the standard MLP, learned
    positions, partial RoPE, ``d_qk ≠ d_head``, a logits bias, biases without the q, k, v ones."""
    c, problems = config, []
    for name, want in (("norm", "rmsnorm"), ("mlp", "swiglu"), ("position_encoding", "rope"),
                       ("causal", True), ("rope_fraction", 1.0), ("logits_bias", False)):
        if getattr(c, name) != want:
            problems.append(f"{name}={getattr(c, name)!r} (Llama-family models need {want!r})")
    if c.d_qk != c.d_head:
        problems.append(f"d_qk={c.d_qk} differs from d_head={c.d_head} (Llama has one head_dim)")
    if c.bias and not c.qkv_bias:
        problems.append("bias=True with qkv_bias=False (Llama's attention_bias covers q, k, v and o)")
    return problems


def export_family(config: GPTConfig) -> str:
    """The family that writes ``config``: GPT-2 for a GPT-2-shaped one, else the first Llama-layout
    entry of :data:`FAMILIES` that can (Llama before Qwen2, ...).

    Raises:
        ValueError: one line naming every setting that stops it: for GPT-2 its own list; for the
            Llama layout what no such family expresses (:func:`llama_export_problems`),
            else each family's reasons.
    """
    if layout_of(config) == "gpt2":
        problems = FAMILIES["gpt2"].problems(config)
        if problems:
            raise ValueError("this model cannot be written as a Hugging Face GPT-2: " + "; ".join(problems))
        return "gpt2"
    common = llama_export_problems(config)
    if common:
        raise ValueError("this model cannot be written as a Hugging Face Llama/Qwen2: " + "; ".join(common))
    reasons = []
    for family in FAMILIES.values():
        if family.layout != "llama" or not family.exports:
            continue
        problems = family.problems(config) + feature_problems(family, config)
        if not problems:
            return family.model_type
        reasons.append(f"not {family.model_type}: {', '.join(problems)}")
    raise ValueError("no Hugging Face family writes this model (" + "; ".join(reasons) + ")")


def _pattern(name: str) -> tuple[str, list[str]]:
    """``"experts.3.mlp_gate"`` -> ``("experts.{}.mlp_gate", ["3"])``: a name's numbers taken out."""
    parts = name.split(".")
    numbers = [p for p in parts if p.isdigit()]
    return ".".join("{}" if p.isdigit() else p for p in parts), numbers


def hf_block_name(names: Mapping[str, str], layer: str) -> str | None:
    """The HF module (in ``model.layers.{i}.``) of pedestrian block layer ``layer`` by ``names``
    (:attr:`Family.names`; a key may hold ``{}`` for a number, e.g. an expert's index:
    ``"experts.{}.mlp_gate": "mlp.experts.{}.gate_proj"``); ``None`` if it names none."""
    if layer in names:
        return names[layer]
    key, numbers = _pattern(layer)
    return names[key].format(*numbers) if key in names else None


def block_layer(names: Mapping[str, str], module: str) -> str | None:
    """The inverse of :func:`hf_block_name`: HF module (in ``model.layers.{i}.``) -> pedestrian
    block layer, or ``None``."""
    inverse = {hf: ped for ped, hf in names.items()}
    if module in inverse:
        return inverse[module]
    key, numbers = _pattern(module)
    return inverse[key].format(*numbers) if key in inverse else None


def family_names(config: GPTConfig) -> Mapping[str, str]:
    """The block-layer names (:attr:`Family.names`) of the family that writes ``config``, or
    Llama's when none does (a model that cannot be exported still names its PEFT modules)."""
    try:
        return FAMILIES[export_family(config)].names
    except ValueError:
        return LLAMA_NAMES

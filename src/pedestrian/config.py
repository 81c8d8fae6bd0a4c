"""Model configuration, named presets, and the parameter layout (names, shapes, counts).

The layout is computed from the config alone, so parameter counts for any size (GPT-2 small:
124,439,808) come without allocating a single array.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from .layers.activations import ACTIVATIONS

LORA_LAYER_KINDS = ("q", "k", "v", "attn_proj", "mlp_expand", "mlp_contract", "logits")
#: the GPTConfig fields a user sets by name (a command-line flag, a TOML key); the rest follow
CONFIG_FIELDS = ("vocab_size", "context_length", "d_model", "n_heads", "n_blocks", "d_head", "d_qk",
                 "mlp_ratio", "activation", "ln_eps", "bias", "tie_weights", "causal",
                 "position_encoding", "rope_base", "rope_fraction")
#: how token positions reach the model: a learned table added to the embedding (GPT-2), rotary
#: embeddings of every head's queries and keys (RoPE), or nothing but the causal mask
POSITION_ENCODINGS = ("learned", "rope", "none")


@dataclass(frozen=True)
class GPTConfig:
    """The handful of widths that define a GPT (paper conclusion, "minimalistic transformer").

    Attributes:
        vocab_size: ``V``, number of token ids.
        context_length: the most tokens a sequence may hold (learned positions ``0..C-1``).
        d_model: ``d``, width of the residual stream.
        n_heads: attention heads per block.
        n_blocks: transformer blocks.
        d_head: value width per head (default ``d_model // n_heads``; then ``d_model`` must be
            divisible by ``n_heads``).
        d_qk: query/key width per head, the paper's ``d_ρ`` (default ``d_head``).
        mlp_ratio: ``d_mlp = mlp_ratio · d_model`` (4 in GPT-2) when ``d_mlp`` is not given.
        activation: ``"gelu_tanh"`` (GPT-2), ``"gelu"`` (exact) or ``"relu"``.
        ln_eps: layer-norm epsilon inside the square root, ``>= 0`` (paper 0, GPT-2 1e-5).
        bias: biases on every fully connected layer and layer norm (the q, k, v biases follow
            ``qkv_bias``).
        tie_weights: logits use ``W_tokᵀ`` and no bias (GPT-2); else a separate
            ``logits.weight`` (and ``logits.bias`` if ``logits_bias``).
        logits_bias: ``logits.bias`` exists (untied logits only); ``None`` (default) means
            ``bias and not tie_weights``. ``False`` with untied weights is Hugging Face's
            ``GPT2LMHeadModel`` with ``tie_word_embeddings=False`` (its ``lm_head`` has no bias).
        causal: causal attention mask (a GPT); ``False`` gives a bidirectional encoder.
        dropout: drop probability after the embedding, the attention projection and the MLP
            (0 = off, the default).
        qkv_bias: biases on the query, key and value layers; ``None`` (default) means ``bias``.
            Switched on its own because practitioners often drop them (paper section 3.1,
            "Adjustable bias parameters": the key bias adds the same number to every score of a
            query, so the softmax cancels it and its gradient is zero), or keep only them.
        d_mlp: MLP width (``mlp_expand`` output, ``mlp_contract`` input), any positive integer;
            ``None`` (default) means ``mlp_ratio · d_model``. Hugging Face GPT-2's ``n_inner``.
        position_encoding: ``"learned"`` (default; GPT-2's table ``pos_emb.weight`` added to the
            token embedding), ``"rope"`` (rotary embeddings of every head's queries and keys,
            Su et al. 2021; no parameters) or ``"none"`` (no position information but what the
            causal mask implies; paper section 3, "permutation equivariance").
        rope_base: RoPE's base ``b``: pair ``j`` of ``r`` rotated dimensions turns by
            ``θ_j = b^(−2j/r)`` radians per position (10,000 in RoFormer and GPT-NeoX).
        rope_fraction: fraction of each head's ``d_qk`` query/key dimensions that RoPE rotates
            (GPT-NeoX's ``rotary_pct``): the first ``r = 2·⌊rope_fraction·d_qk / 2⌋`` of them
            (:attr:`rope_dims`), the rest pass through unchanged.

    Raises:
        ValueError: on any inconsistent or out-of-range value, naming it.
    """

    vocab_size: int
    context_length: int
    d_model: int
    n_heads: int
    n_blocks: int
    d_head: int | None = None
    d_qk: int | None = None
    mlp_ratio: int = 4
    activation: str = "gelu_tanh"
    ln_eps: float = 1e-5
    bias: bool = True
    tie_weights: bool = True
    causal: bool = True
    dropout: float = 0.0
    logits_bias: bool | None = None
    qkv_bias: bool | None = None
    d_mlp: int | None = None
    position_encoding: str = "learned"
    rope_base: float = 10_000.0
    rope_fraction: float = 1.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_heads", "n_blocks", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_head is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "choose n_heads dividing d_model or give d_head explicitly"
                )
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        if self.d_qk is None:
            object.__setattr__(self, "d_qk", self.d_head)
        if self.d_mlp is None:
            object.__setattr__(self, "d_mlp", self.mlp_ratio * self.d_model)
        for name in ("d_head", "d_qk", "d_mlp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; choose one of {ACTIVATIONS}")
        if not self.ln_eps >= 0:
            raise ValueError(f"ln_eps must be >= 0 (the paper uses 0, GPT-2 1e-5), got {self.ln_eps}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", self.bias)
        elif not isinstance(self.qkv_bias, bool):
            raise ValueError(f"qkv_bias must be True, False or None (= bias), got {self.qkv_bias!r}")
        if self.logits_bias is None:
            object.__setattr__(self, "logits_bias", self.bias and not self.tie_weights)
        elif self.logits_bias and self.tie_weights:
            raise ValueError("logits_bias=True needs untied logits (tie_weights=False); tied logits "
                             "use W_tokᵀ and no bias")
        if self.position_encoding not in POSITION_ENCODINGS:
            raise ValueError(f"unknown position_encoding {self.position_encoding!r}; choose one of "
                             f"{POSITION_ENCODINGS}")
        for name in ("rope_base", "rope_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not self.rope_base > 1.0:
            raise ValueError(f"rope_base must be > 1 (frequencies b^(-2j/r) must fall with j; "
                             f"RoFormer uses 10000), got {self.rope_base}")
        if not 0.0 < self.rope_fraction <= 1.0:
            raise ValueError(f"rope_fraction must be in (0, 1] (the fraction of d_qk rotated), "
                             f"got {self.rope_fraction}")
        if self.position_encoding == "rope" and self.rope_dims < 2:
            raise ValueError(
                f"rope_fraction={self.rope_fraction} rotates no pair of the d_qk={self.d_qk} "
                f"query/key dimensions (2·⌊{self.rope_fraction}·{self.d_qk}/2⌋ = 0); raise "
                "rope_fraction or d_qk")

    @property
    def rope_dims(self) -> int:
        """``r``, how many of each head's ``d_qk`` query/key dimensions RoPE rotates: the even
        number ``2·⌊rope_fraction·d_qk / 2⌋`` (dimensions turn in pairs). The margin ``1e-9``
        keeps fractions like 0.3·10, which is 3.0000000000000004 in binary, from rounding up
        or down by accident."""
        return 2 * int(math.floor(self.rope_fraction * self.d_qk / 2 + 1e-9))

    @property
    def learned_positions(self) -> bool:
        """The model has a position table ``pos_emb.weight`` (``position_encoding="learned"``)."""
        return self.position_encoding == "learned"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GPTConfig":
        """Build from a dict (e.g. a checkpoint's JSON); unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**data)


#: Named configurations. GPT-2 widths come from the released model (HF ``gpt2``).
PRESETS: dict[str, dict] = {
    # the released GPT-2 small: 12 blocks, tied logits without bias -> 124,439,808
    "gpt2": dict(vocab_size=50257, context_length=1024, d_model=768, n_heads=12, n_blocks=12),
    # twelve blocks, untied logits with bias -> 163,087,441
    "gpt2-untied": dict(vocab_size=50257, context_length=1024, d_model=768, n_heads=12,
                        n_blocks=12, tie_weights=False),
    # the paper's minimal model: one block, embeddings, final LN, logits with bias -> 85,120,849
    "paper-minimal": dict(vocab_size=50257, context_length=1024, d_model=768, n_heads=12,
                          n_blocks=1, tie_weights=False),
    # the small character model of the benchmarks
    "char-small": dict(vocab_size=65, context_length=64, d_model=128, n_heads=4, n_blocks=4),
}


def preset(name: str, **overrides) -> GPTConfig:
    """A :class:`GPTConfig` from :data:`PRESETS`, with optional field overrides.

    Raises:
        ValueError: unknown preset name (the message lists the known ones).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return GPTConfig(**{**PRESETS[name], **overrides})


class ParamSpec(NamedTuple):
    """One named parameter: its shape, its layer kind, and whether weight decay applies."""

    name: str
    shape: tuple[int, ...]
    kind: str
    decay: bool

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def fc_layers(config: GPTConfig) -> list[tuple[str, int, int]]:
    """Every fully connected layer that can carry a LoRA adapter: ``(name, f_in, f_out)``.

    Names: ``blocks.{i}.attn.q|k|v``, ``blocks.{i}.attn_proj``, ``blocks.{i}.mlp_expand``,
    ``blocks.{i}.mlp_contract``, ``logits``.
    """
    c = config
    hq, hv = c.n_heads * c.d_qk, c.n_heads * c.d_head
    out = []
    for i in range(c.n_blocks):
        p = f"blocks.{i}"
        out += [(f"{p}.attn.q", c.d_model, hq), (f"{p}.attn.k", c.d_model, hq),
                (f"{p}.attn.v", c.d_model, hv), (f"{p}.attn_proj", hv, c.d_model),
                (f"{p}.mlp_expand", c.d_model, c.d_mlp), (f"{p}.mlp_contract", c.d_mlp, c.d_model)]
    out.append(("logits", c.d_model, c.vocab_size))
    return out


def fc_kind(fc_name: str) -> str:
    """``"blocks.3.attn.q"`` -> ``"q"``; ``"blocks.0.mlp_expand"`` -> ``"mlp_expand"``."""
    return fc_name.rsplit(".", 1)[-1]


def resolve_lora_targets(config: GPTConfig, targets) -> list[str]:
    """Expand LoRA target names to full FC layer names.

    Args:
        targets: iterable of kinds (``"q"``, ``"k"``, ``"v"``, ``"attn_proj"``,
            ``"mlp_expand"``, ``"mlp_contract"``, ``"logits"``; ``"all"`` for every one) or
            full layer names like ``"blocks.0.attn.q"``.

    Raises:
        ValueError: an unknown name (the message lists the valid kinds).
    """
    layers = [name for name, _, _ in fc_layers(config)]
    targets = [targets] if isinstance(targets, str) else list(targets)
    if "all" in targets:
        return layers
    chosen = []
    for t in targets:
        if t in LORA_LAYER_KINDS:
            chosen += [name for name in layers if fc_kind(name) == t]
        elif t in layers:
            chosen.append(t)
        else:
            raise ValueError(
                f"unknown LoRA target {t!r}; use kinds {LORA_LAYER_KINDS}, 'all', "
                "or full layer names like 'blocks.0.attn.q'"
            )
    return [name for name in layers if name in set(chosen)]


def param_specs(config: GPTConfig) -> list[ParamSpec]:
    """Every base parameter in its documented, stable order.

    ``pos_emb.weight`` exists only with ``position_encoding="learned"``.

    ``y = x W + b`` convention: ``W`` is ``(f_in, f_out)``. Decay: 2-D matrices (embeddings
    included) are decayed; 1-D parameters (biases, layer-norm weights) are not. The q, k, v
    biases exist when ``config.qkv_bias``, every other bias when ``config.bias``.
    """
    c = config
    d = c.d_model
    specs = [ParamSpec("tok_emb.weight", (c.vocab_size, d), "embedding", True)]
    if c.learned_positions:                       # RoPE and none have no position table
        specs.append(ParamSpec("pos_emb.weight", (c.context_length, d), "embedding", True))

    def ln(name: str, kind: str) -> list[ParamSpec]:
        out = [ParamSpec(f"{name}.weight", (d,), kind, False)]
        if c.bias:
            out.append(ParamSpec(f"{name}.bias", (d,), kind, False))
        return out

    for i in range(c.n_blocks):
        p = f"blocks.{i}"
        specs += ln(f"{p}.ln1", "layernorm")
        for fc, f_in, f_out in fc_layers(c)[6 * i:6 * i + 6]:
            kind = "attention" if ".attn" in fc else "mlp"
            specs.append(ParamSpec(f"{fc}.weight", (f_in, f_out), kind, True))
            if (c.qkv_bias if ".attn." in fc else c.bias):
                specs.append(ParamSpec(f"{fc}.bias", (f_out,), kind, False))
            if fc.endswith("attn_proj"):
                specs += ln(f"{p}.ln2", "layernorm")
    specs += ln("ln_final", "layernorm")
    if not c.tie_weights:
        specs.append(ParamSpec("logits.weight", (d, c.vocab_size), "logits", True))
        if c.logits_bias:
            specs.append(ParamSpec("logits.bias", (c.vocab_size,), "logits", False))
    return specs


def lora_layer_values(config: GPTConfig, targets, default, pattern=None, *, what: str = "rank_pattern") -> dict:
    """One value per adapted layer: ``pattern``'s value for the layer, else ``default``.

    Args:
        targets: as :func:`resolve_lora_targets`.
        default: the value of layers no key of ``pattern`` names.
        pattern: ``{key: value}``; a key is a layer kind (``"q"``, ``"mlp_expand"``, ...: every
            block's layer of that kind) or a full layer name (``"blocks.0.attn.q"``). A full
            name wins over a kind. This is PEFT's ``rank_pattern`` / ``alpha_pattern`` with
            pedestrian's layer names instead of module-name regexes.
        what: the pattern's name, for messages.

    Returns:
        ``{full layer name: value}`` over the resolved targets, in layer order.

    Raises:
        ValueError: a key that is neither a kind nor a layer name, or that names no adapted layer
            (a typo would otherwise be ignored silently).
    """
    chosen = resolve_lora_targets(config, targets)
    values = {name: default for name in chosen}
    if not pattern:
        return values
    layers = [name for name, _, _ in fc_layers(config)]
    by_kind, by_name = {}, {}
    for key, value in dict(pattern).items():
        if key in LORA_LAYER_KINDS:
            by_kind[key] = value
        elif key in layers:
            by_name[key] = value
        else:
            raise ValueError(f"{what} key {key!r} is neither a layer kind {LORA_LAYER_KINDS} nor a "
                             "layer name like 'blocks.0.attn.q'")
    unused = [k for k in by_kind if not any(fc_kind(n) == k for n in chosen)]
    unused += [k for k in by_name if k not in values]
    if unused:
        raise ValueError(f"{what} names {unused}, which carry no adapter (targets: {chosen}); "
                         "add them to the targets or drop them from the pattern")
    for name in chosen:
        values[name] = by_name.get(name, by_kind.get(fc_kind(name), default))
    return values


def lora_ranks(config: GPTConfig, targets, rank: int, rank_pattern=None) -> dict[str, int]:
    """``{layer: r}`` for each adapted layer (``rank``, or its ``rank_pattern`` value).

    Raises:
        ValueError: a rank that is not a positive integer, or a bad pattern key
            (:func:`lora_layer_values`).
    """
    ranks = lora_layer_values(config, targets, rank, rank_pattern, what="rank_pattern")
    for name, r in {"rank": rank, **ranks}.items():
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            where = "" if name == "rank" else f" (rank_pattern, layer {name})"
            raise ValueError(f"lora_rank must be a positive integer, got {r!r}{where}")
    return ranks


def lora_specs(config: GPTConfig, targets, rank: int, rank_pattern=None) -> list[ParamSpec]:
    """``X.lora_D (f_in, r_X)`` and ``X.lora_U (r_X, f_out)`` for each target FC layer ``X``.

    ``r_X`` is ``rank``, or ``rank_pattern``'s value for ``X`` (see :func:`lora_layer_values`).

    Raises:
        ValueError: a rank that is not a positive integer, an unknown target or pattern key.
    """
    ranks = lora_ranks(config, targets, rank, rank_pattern)
    specs = []
    for name, f_in, f_out in fc_layers(config):
        if name in ranks:
            r = ranks[name]
            specs += [ParamSpec(f"{name}.lora_D", (f_in, r), "lora", True),
                      ParamSpec(f"{name}.lora_U", (r, f_out), "lora", True)]
    return specs


def count_params(config: GPTConfig, lora_targets=None, lora_rank: int | None = None, *,
                 lora_rank_pattern=None) -> int:
    """Total parameter count (base, or LoRA-only when ``lora_rank`` is given); no allocation."""
    if lora_rank is not None:
        return sum(s.size for s in lora_specs(config, lora_targets or "all", lora_rank, lora_rank_pattern))
    return sum(s.size for s in param_specs(config))

"""Model configuration (:class:`GPTConfig`, Llama 3's :class:`RopeScaling`), the architectures'
field sets (:func:`arch_fields`) and the named presets (:func:`preset`).

The parameter layout a config implies (names, shapes, counts, LoRA targets) is
:mod:`pedestrian.model.layout`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping

from .layers.activations import ACTIVATIONS
#: the activations the gated MLP (``mlp="swiglu"``) may gate with: SiLU (SwiGLU, Llama) or the tanh
#: GELU (GeGLU, Gemma: ``gelu_tanh(x W_gate) ∘ x W_up``)
from .layers.swiglu import GATE_ACTIVATIONS

#: the GPTConfig fields a user sets by name, each with its one-line help: the commands' model flags
#: (:func:`pedestrian.training.specs.add_config_flags`; ``--no-bias`` for a field that defaults to
#: ``True``) and a settings file's [model] keys are made from these and the fields' types
CONFIG_HELP = {
    "vocab_size": "token ids V", "context_length": "the most tokens a sequence holds",
    "d_model": "width of the residual stream", "n_heads": "attention heads per block",
    "n_blocks": "transformer blocks", "d_head": "value width per head (default d_model / n_heads)",
    "d_qk": "query/key width per head (default d_head)",
    "mlp_ratio": "MLP width = mlp_ratio * d_model, unless --d-mlp is given (4)",
    "norm": "the blocks' norm (layernorm: GPT-2; rmsnorm: Llama)",
    "mlp": "the MLP (standard: GPT-2; swiglu: Llama's gated one)",
    "n_kv_heads": "key/value heads, dividing --n-heads (grouped-query attention)",
    "d_mlp": "MLP width, SwiGLU's too (default mlp_ratio · d_model; --arch llama: 8/3 · d_model rounded up to "
             "a multiple of 8)",
    "activation": "the MLP's nonlinearity (default gelu_tanh; silu for swiglu, or gelu_tanh: GeGLU)",
    "ln_eps": "the norm's epsilon (1e-5)", "bias": "no biases (RMS norm has none either way)",
    "tie_weights": "separate logits weights (default: the token embedding's transpose)",
    "causal": "bidirectional attention (no causal mask)",
    "position_encoding": "learned table (GPT-2, default), rotary q/k (rope), or none",
    "rope_base": "RoPE base b: pair j turns by b^(-2j/r) per position (10000)",
    "rope_fraction": "fraction of each head's d_qk RoPE rotates (1.0)",
    "qk_norm": "RMS-norm q and k before RoPE: per head (Qwen3) or over the projection (OLMo 2)",
    "norm_placement": "the blocks' norms: before the sublayers (pre, default), after (post: OLMo 2) or both "
                      "(sandwich: Gemma)",
    "n_experts": "mixture of experts: E SwiGLU experts per block in place of the MLP (0: a dense MLP)",
    "n_experts_per_token": "experts a token is routed to, k (2)",
    "d_expert": "width of one expert's SwiGLU (default d_mlp)",
    "norm_topk_prob": "use the chosen experts' softmax probabilities as they are (default: renormalised to sum 1)",
    "router_aux_loss_coef": "weight of the load-balancing loss added to the cross-entropy (with --output-router-logits)",
    "output_router_logits": "add router_aux_loss_coef times the load-balancing loss to the training loss",
    "norm_offset": "RMS norms scale by (offset + w): Gemma's 1 (its weights start at 1 - offset; default 0)",
    "embedding_scale": "multiply the token embedding by this (Gemma: sqrt(d_model); the tied head stays unscaled)",
    "logit_softcap": "cap the logits at c: c*tanh(z/c) (Gemma 2: 30; default none)",
    "rope_local_base": "RoPE base of the sliding-window blocks (Gemma 3: 10000; default rope_base)",
}
CONFIG_FIELDS = tuple(CONFIG_HELP)
#: the shorter names the switches of ``tie_weights`` and ``causal`` are known by (beside ``--no-...``)
CONFIG_SWITCHES = {"tie_weights": "--untied", "causal": "--non-causal"}
#: how token positions reach the model: a learned table added to the embedding (GPT-2), rotary
#: embeddings of every head's queries and keys (RoPE), or nothing but the causal mask
POSITION_ENCODINGS = ("learned", "rope", "none")
#: the block's normalization: layer norm (GPT-2, paper section 5) or RMS norm (Llama: no mean, no bias)
NORMS = ("layernorm", "rmsnorm")
#: the block's MLP: expand, activation, contract (GPT-2) or the gated SwiGLU (Llama:
#: ``(silu(x W_gate) ∘ x W_expand) W_contract``, Hugging Face's gate_proj, up_proj, down_proj)
MLPS = ("standard", "swiglu")
#: the activation each MLP kind uses when ``activation`` is not given
DEFAULT_ACTIVATION = {"standard": "gelu_tanh", "swiglu": "silu"}
#: q/k RMS norms before RoPE: none, per head (Qwen3, Gemma 3), over the whole projection (OLMo 2)
QK_NORMS = (None, "head", "proj")
#: where a block's norms sit: before the sublayers (GPT-2, Llama), after them (OLMo 2), both (Gemma)
NORM_PLACEMENTS = ("pre", "post", "sandwich")
#: the valid values of the fields that have a list of them (a flag's choices)
CONFIG_CHOICES = {"activation": ACTIVATIONS, "norm": NORMS, "mlp": MLPS,
                  "position_encoding": POSITION_ENCODINGS, "qk_norm": ("head", "proj"),
                  "norm_placement": NORM_PLACEMENTS}


#: the RoPE frequency scalings implemented (Hugging Face ``rope_type``)
ROPE_SCALINGS = ("llama3", "linear")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's RoPE frequency scaling (Hugging Face ``rope_scaling`` / ``rope_parameters`` with
    ``rope_type: "llama3"``; EQUATIONS.md "RoPE as Hugging Face Llama applies it"), or the linear
    one (``rope_type: "linear"``: every ``θ_i / factor``, Gemma 3's global layers; only ``factor``).

    With ``L = original_max_position_embeddings`` and the wavelength ``λ_i = 2π / θ_i`` of pair
    ``i``: ``θ_i / factor`` where ``λ_i > L / low_freq_factor``, ``θ_i`` where
    ``λ_i < L / high_freq_factor``, and in between ``(1 − s) θ_i / factor + s θ_i`` with
    ``s = (L / λ_i − low_freq_factor) / (high_freq_factor − low_freq_factor)``.

    Frozen (so :class:`GPTConfig` stays hashable); :class:`GPTConfig` also accepts the Hugging
    Face dict (``{"rope_type": "llama3", "factor": 32.0, ...}``) and converts it.

    Raises:
        ValueError: a type other than ``"llama3"`` or ``"linear"``, a missing or unknown key, ``factor < 1``,
            ``low_freq_factor <= 0``, ``high_freq_factor <= low_freq_factor``, or
            ``original_max_position_embeddings`` not a positive integer.
    """

    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling rope_type={self.rope_type!r} is not implemented; pedestrian "
                             f"implements {ROPE_SCALINGS} (or rope_scaling=None)")
        if self.rope_type == "linear":
            value = self.factor
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1.0:
                raise ValueError(f"rope_scaling factor must be a number >= 1 (linear scaling divides every "
                                 f"frequency by it; Gemma 3 uses 8), got {value!r}")
            object.__setattr__(self, "factor", float(value))
            extra = [k for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                     if getattr(self, k) is not None]
            if extra:
                raise ValueError(f"rope_scaling of type 'linear' takes only factor; got {extra}")
            return
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"rope_scaling {name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        L = self.original_max_position_embeddings
        if not isinstance(L, int) or isinstance(L, bool) or L < 1:
            raise ValueError(f"rope_scaling original_max_position_embeddings must be a positive integer "
                             f"(the pre-training context, 8192 in Llama 3), got {L!r}")
        if not self.factor >= 1.0:
            raise ValueError(f"rope_scaling factor must be >= 1 (it divides the low frequencies; Llama 3.1 "
                             f"uses 8), got {self.factor}")
        if not 0.0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"rope_scaling needs 0 < low_freq_factor < high_freq_factor (Llama 3.1: 1 and 4), "
                             f"got {self.low_freq_factor} and {self.high_freq_factor}")

    @classmethod
    def from_value(cls, value) -> "RopeScaling | None":
        """``None``, a :class:`RopeScaling`, or a dict with the Hugging Face keys (``rope_type``
        or the older ``type``; ``rope_theta`` is ignored, it is :attr:`GPTConfig.rope_base`).

        Raises:
            ValueError: not one of those, or a dict with unknown or missing keys.
        """
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"rope_scaling must be None or a dict like {{'rope_type': 'llama3', 'factor': 8.0, "
                             f"'low_freq_factor': 1.0, 'high_freq_factor': 4.0, "
                             f"'original_max_position_embeddings': 8192}}, got {value!r}")
        d = {k: v for k, v in value.items() if k != "rope_theta"}
        old_name = d.pop("type", None)
        kind = d.pop("rope_type", old_name or "llama3")
        if kind not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling rope_type={kind!r} is not implemented; pedestrian implements "
                             f"{ROPE_SCALINGS} (or rope_scaling=None)")
        if kind == "linear":                          # (a dict of to_dict holds the llama3 keys as None)
            d = {k: v for k, v in d.items() if v is not None}
            if set(d) != {"factor"}:
                raise ValueError(f"rope_scaling of type 'linear' needs exactly the key ['factor']; got {sorted(d)}")
            return cls(factor=d["factor"], rope_type="linear")
        known = [f.name for f in dataclasses.fields(cls)][:4]
        unknown = sorted(set(d) - set(known))
        missing = [k for k in known if k not in d]
        if unknown or missing:
            raise ValueError(f"rope_scaling of type 'llama3' needs exactly the keys {known}; "
                             + (f"unknown {unknown}" if unknown else f"missing {missing}"))
        return cls(**d)

    def to_hf(self) -> dict:
        """The Hugging Face dict (``rope_type`` first)."""
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {"rope_type": self.rope_type, "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


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
        activation: the MLP's nonlinearity: ``"gelu_tanh"`` (GPT-2), ``"gelu"`` (exact) or
            ``"relu"`` for the standard MLP; the gated MLP's gate (``mlp="swiglu"``): ``"silu"``
            (SwiGLU) or ``"gelu_tanh"`` (GeGLU, Gemma), :data:`GATE_ACTIVATIONS`.
            ``None`` (default): ``"gelu_tanh"`` for ``mlp="standard"``, ``"silu"`` for ``"swiglu"``.
        ln_eps: the norm's epsilon inside the square root, ``>= 0``: layer norm's (paper 0,
            GPT-2 1e-5) or RMS norm's (Hugging Face ``rms_norm_eps``: 1e-5 SmolLM2, 1e-6 Llama 3
            and Qwen2). One field for both because a model has one kind of norm.
        bias: biases on every fully connected layer and on layer norms (the q, k, v biases
            follow ``qkv_bias``; RMS norm has no bias whatever this says).
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
        norm: ``"layernorm"`` (default; GPT-2, paper section 5: weight and bias) or ``"rmsnorm"``
            (Llama: ``x / sqrt(mean_f x² + eps) ∘ w``, a weight and no bias) -- the
            ``ln1``, ``ln2`` and ``ln_final`` slots of every model.
        mlp: ``"standard"`` (default; ``mlp_expand``, activation, ``mlp_contract``) or
            ``"swiglu"`` (Llama: ``(silu(a6 W_gate) ∘ a6 W_expand) W_contract``, three matrices
            of ``d_mlp`` columns/rows; ``mlp_gate`` is Hugging Face's ``gate_proj``,
            ``mlp_expand`` its ``up_proj``, ``mlp_contract`` its ``down_proj``).
        n_kv_heads: key/value heads (grouped-query attention): divides ``n_heads``; query head
            ``h`` reads key/value head ``h // (n_heads / n_kv_heads)``; 1 is multi-query.
            ``None`` (default) means ``n_heads`` (multi-head attention, GPT-2).
        rope_scaling: ``None`` (default) or Llama 3's frequency scaling, a :class:`RopeScaling`
            (a Hugging Face ``{"rope_type": "llama3", ...}`` dict is converted; or the linear
            one, ``{"rope_type": "linear", "factor": 8.0}``); needs ``position_encoding="rope"``.
            With :attr:`rope_local_base` it applies to the global layers only (Gemma 3).
        n_experts: ``E``: a mixture of ``E`` SwiGLU experts in place of the MLP of the blocks
            :attr:`moe_layers` names (EQUATIONS.md, "Mixture of experts"); ``0`` (default):
            dense MLPs. Needs ``mlp="swiglu"``, no biases.
        n_experts_per_token: ``k``, the experts each token is routed to (``1 … E``; default 2).
        d_expert: one expert's SwiGLU width ``m`` (HF ``moe_intermediate_size``, Mixtral's
            ``intermediate_size``); ``None`` (default): ``d_mlp``.
        norm_topk_prob: the chosen experts' weights are their probabilities renormalised to sum
            to 1 (Mixtral, Qwen3-MoE folders); ``False``: the softmax probabilities as they are (OLMoE).
        router_aux_loss_coef: weight of transformers' load-balancing loss in the training loss.
        output_router_logits: the loss is ``CE + router_aux_loss_coef · aux`` (as transformers' when
            the folder says so); ``False``: the cross-entropy alone (aux is still reported).
        moe_layers: the blocks whose MLP is a mixture of experts (ascending indices); ``None``
            (default): every block. The others keep a dense SwiGLU of width ``d_mlp`` (Qwen3-MoE's
            ``mlp_only_layers``, ``decoder_sparse_step``).
        qk_norm: an RMS norm of the queries and keys before RoPE (whatever ``norm`` is; its
            epsilon ``ln_eps``): ``None`` (default, none), ``"head"`` (each head's ``d_qk``
            features, one weight ``(d_qk,)`` shared by the heads: Qwen3, Gemma 3) or ``"proj"``
            (the whole projection: a weight ``(n_heads·d_qk,)`` for q and ``(n_kv_heads·d_qk,)``
            for k: OLMo 2). Parameters ``blocks.{i}.attn.q_norm.weight``, ``.k_norm.weight``.
        rope_layers: which blocks turn q and k by RoPE, one bool per block (SmolLM3's
            ``no_rope_layers``, where 1 means the layer *uses* RoPE); ``None`` (default): every
            block, when ``position_encoding="rope"`` (which it needs).
        norm_placement: where a block's norms sit: ``"pre"`` (default; GPT-2, Llama:
            ``x + f(norm(x))``, norms ``ln1``, ``ln2``), ``"post"`` (OLMo 2: ``x + norm(f(x))``,
            norms ``ln1_post``, ``ln2_post``, none before the sublayers) or ``"sandwich"``
            (Gemma 2/3: ``x + post_norm(f(pre_norm(x)))``, all four).
        sliding_window: ``w``: a sliding-window block's query ``i`` sees only keys
            ``i − w < j <= i`` (Mistral, Gemma 2; transformers' ``sliding_window``); ``None``
            (default): every key. Needs ``causal``.
        layer_types: one ``"full_attention"`` or ``"sliding_attention"`` per block (Hugging
            Face's ``layer_types``); ``None`` (default) with ``sliding_window`` set: every block
            slides (Mistral). :meth:`window` gives block ``i``'s.
        attn_softcap: ``c``: every attention score ``s ↦ c·tanh(s/c)`` after the scale, before the
            mask (Gemma 2's ``attn_logit_softcapping``); ``None`` (default): none.
        attn_scale: the attention's score scale (``None``, default: ``1/√d_qk``; Gemma:
            ``query_pre_attn_scalar^(−1/2)``). :attr:`score_scale` is the one in use.

    Gemma 2 and 3 (docs/EQUATIONS.md, "Gemma"), each off by default:

    Attributes:
        norm_offset: RMS norm scales by ``(norm_offset + w)`` instead of ``w``: Gemma's
            ``x̂ ∘ (1 + w)`` is ``1.0`` (its weights are stored around 0 and initialised to
            ``1 − norm_offset``); needs ``norm="rmsnorm"``. ``0.0`` (default): Llama's ``x̂ ∘ w``.
        embedding_scale: the token embedding is multiplied by this number rounded to the model's
            dtype, ``a1 = W_tok[a0] · s`` (Gemma: ``√d_model``, which bfloat16 rounds to 55.5 at
            ``d = 3072``); the tied logits use the unscaled table. ``None`` (default): no scale.
        logit_softcap: the logits are ``c · tanh(z / c)`` of the head's ``z`` (Gemma 2's
            ``final_logit_softcapping``), before the loss and sampling; ``None`` (default): ``z``.
        rope_local_base: RoPE's base on the sliding-window layers (Gemma 3's
            ``rope_local_base_freq``; those layers take no :attr:`rope_scaling`); :attr:`rope_base`
            stays the global layers'. ``None`` (default): every layer turns by :attr:`rope_base`.
            Needs ``position_encoding="rope"`` and sliding-window layers. :meth:`rope_of` gives a
            block's base and scaling.

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
    activation: str | None = None
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
    norm: str = "layernorm"
    mlp: str = "standard"
    n_kv_heads: int | None = None
    rope_scaling: RopeScaling | None = None
    # mixture of experts (Mixtral, Qwen3-MoE, OLMoE): E = n_experts SwiGLU experts, k per token
    n_experts: int = 0
    n_experts_per_token: int = 2
    d_expert: int | None = None
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0
    output_router_logits: bool = False
    moe_layers: tuple[int, ...] | None = None
    # the attention's prelude and the norms' placement of other families (Qwen3, OLMo 2,
    # SmolLM3, Gemma): q/k RMS norms, RoPE per layer, norms after the sublayers
    qk_norm: str | None = None
    rope_layers: tuple[bool, ...] | None = None
    norm_placement: str = "pre"
    # the attention's mask and scores, per block (docs/EQUATIONS.md "Sliding window",
    # "Score scale and soft-cap"): a sliding window on all or some blocks, Gemma 2's soft-cap and scale
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    attn_softcap: float | None = None
    attn_scale: float | None = None
    # Gemma 2 / 3 (issue 48): (1 + w) RMS norm, √d embedding scale, final-logit soft-cap,
    # the windowed layers' RoPE base
    norm_offset: float = 0.0
    embedding_scale: float | None = None
    logit_softcap: float | None = None
    rope_local_base: float | None = None

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
        if self.norm not in NORMS:
            raise ValueError(f"unknown norm {self.norm!r}; choose one of {NORMS}")
        if self.mlp not in MLPS:
            raise ValueError(f"unknown mlp {self.mlp!r}; choose one of {MLPS}")
        if self.activation is None:
            object.__setattr__(self, "activation", DEFAULT_ACTIVATION[self.mlp])
        if self.mlp == "swiglu" and self.activation not in GATE_ACTIVATIONS:
            raise ValueError(f"mlp='swiglu' gates with one of {GATE_ACTIVATIONS} (silu: SwiGLU, gelu_tanh: "
                             f"Gemma's GeGLU), got activation={self.activation!r}; set one of them (or "
                             "leave it out: silu), or use mlp='standard'")
        if self.mlp == "standard" and self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; choose one of {ACTIVATIONS}")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        kv = self.n_kv_heads
        if not isinstance(kv, int) or isinstance(kv, bool) or kv < 1 or self.n_heads % kv:
            raise ValueError(f"n_kv_heads must be a positive integer dividing n_heads={self.n_heads} "
                             f"(1: multi-query, n_heads: multi-head), got {kv!r}")
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
        object.__setattr__(self, "rope_scaling", RopeScaling.from_value(self.rope_scaling))
        if self.rope_scaling is not None and self.position_encoding != "rope":
            raise ValueError(f"rope_scaling scales RoPE's frequencies but position_encoding="
                             f"{self.position_encoding!r}; set position_encoding='rope' or rope_scaling=None")
        self._check_prelude()
        self._check_gemma_fields()
        if self.position_encoding == "rope" and self.rope_dims < 2:
            raise ValueError(
                f"rope_fraction={self.rope_fraction} rotates no pair of the d_qk={self.d_qk} "
                f"query/key dimensions (2·⌊{self.rope_fraction}·{self.d_qk}/2⌋ = 0); raise "
                "rope_fraction or d_qk")
        self._check_experts()
        self._check_attention_fields()

    def _check_experts(self) -> None:
        """The mixture-of-experts fields (see the class docstring)."""
        E = self.n_experts
        if not isinstance(E, int) or isinstance(E, bool) or E < 0:
            raise ValueError(f"n_experts must be 0 (a dense MLP) or a positive integer, got {E!r}")
        k = self.n_experts_per_token
        if not isinstance(k, int) or isinstance(k, bool) or k < 1 or (E and k > E):
            raise ValueError(f"n_experts_per_token must be an integer from 1 to n_experts={E}, got {k!r}")
        if self.d_expert is None:
            object.__setattr__(self, "d_expert", self.d_mlp)
        if not isinstance(self.d_expert, int) or isinstance(self.d_expert, bool) or self.d_expert < 1:
            raise ValueError(f"d_expert must be a positive integer, got {self.d_expert!r}")
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef) or coef < 0:
            raise ValueError(f"router_aux_loss_coef must be a finite number >= 0, got {coef!r}")
        object.__setattr__(self, "router_aux_loss_coef", float(coef))
        for name in ("norm_topk_prob", "output_router_logits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        layers = self.moe_layers
        if layers is not None:
            if isinstance(layers, (str, bytes)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in layers):
                raise ValueError(f"moe_layers must be block indices (a list of integers) or None, got {layers!r}")
            layers = tuple(layers)
            if list(layers) != sorted(set(layers)) or any(not 0 <= i < self.n_blocks for i in layers):
                raise ValueError(f"moe_layers must be ascending distinct block indices in 0 … {self.n_blocks - 1}, "
                                 f"got {list(layers)}")
            object.__setattr__(self, "moe_layers", layers)
        if E and (self.mlp != "swiglu" or self.bias):
            raise ValueError(f"n_experts={E}: the experts are SwiGLU MLPs without biases; set mlp='swiglu' and "
                             f"bias=False (--arch llama), got mlp={self.mlp!r}, bias={self.bias}")

    def is_moe(self, i: int) -> bool:
        """Whether block ``i``'s MLP is a mixture of experts."""
        return self.n_experts > 0 and (self.moe_layers is None or i in self.moe_layers)

    def _check_prelude(self) -> None:
        """Validate (and normalise) ``qk_norm``, ``rope_layers``, ``norm_placement``."""
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"unknown qk_norm {self.qk_norm!r}; choose one of {QK_NORMS} (None: no q/k norm)")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"unknown norm_placement {self.norm_placement!r}; choose one of {NORM_PLACEMENTS}")
        if self.rope_layers is not None:
            layers = self.rope_layers
            if isinstance(layers, (str, bytes)) or not hasattr(layers, "__len__") or len(layers) != self.n_blocks \
                    or any(not isinstance(v, (bool, int)) or v not in (0, 1) for v in layers):
                raise ValueError(f"rope_layers must hold one bool per block ({self.n_blocks}: True where the "
                                 f"block uses RoPE), got {layers!r}")
            if self.position_encoding != "rope":
                raise ValueError(f"rope_layers chooses the blocks RoPE turns, but position_encoding="
                                 f"{self.position_encoding!r}; set position_encoding='rope' or rope_layers=None")
            object.__setattr__(self, "rope_layers", tuple(bool(v) for v in layers))

    def uses_rope(self, block: int) -> bool:
        """Whether block ``block`` turns its queries and keys by RoPE (``position_encoding`` and
        :attr:`rope_layers`)."""
        return self.position_encoding == "rope" and (self.rope_layers is None or self.rope_layers[block])

    def _check_gemma_fields(self) -> None:
        """The Gemma block of fields (:attr:`norm_offset` …): finite numbers, in range, consistent."""
        for name in ("norm_offset", "embedding_scale", "logit_softcap", "rope_local_base"):
            value = getattr(self, name)
            if value is None and name != "norm_offset":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number{'' if name == 'norm_offset' else ' or None'}, "
                                 f"got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.norm_offset != 0.0 and self.norm != "rmsnorm":
            raise ValueError(f"norm_offset={self.norm_offset} scales RMS norms by (offset + w) but norm="
                             f"{self.norm!r}; set norm='rmsnorm' or norm_offset=0")
        if self.embedding_scale is not None and not self.embedding_scale > 0:
            raise ValueError(f"embedding_scale must be > 0 (Gemma: sqrt(d_model)) or None, got {self.embedding_scale}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit_softcap must be > 0 (Gemma 2: 30) or None, got {self.logit_softcap}")
        if self.rope_local_base is not None:
            if self.position_encoding != "rope":
                raise ValueError(f"rope_local_base is RoPE's base on the windowed layers but position_encoding="
                                 f"{self.position_encoding!r}; set position_encoding='rope' or rope_local_base=None")
            if not self.rope_local_base > 1.0:
                raise ValueError(f"rope_local_base must be > 1 (Gemma 3: 10000), got {self.rope_local_base}")
            if self.sliding_window is None:
                raise ValueError("rope_local_base is RoPE's base on the sliding-window layers, but this model has "
                                 "no sliding_window (no such layer); set rope_local_base=None")

    def rope_of(self, block: int) -> tuple:
        """``(base, scaling)`` of block ``block``'s RoPE: :attr:`rope_local_base` and no scaling on
        a sliding-window block when it is set (Gemma 3's ``rope_local_base_freq``), else
        :attr:`rope_base` and :attr:`rope_scaling`."""
        if self.rope_local_base is not None and self.window(block) is not None:
            return self.rope_local_base, None
        return self.rope_base, self.rope_scaling

    @property
    def embedding_options(self) -> dict:
        """The embedding's keyword arguments: ``{"scale": embedding_scale}`` (Gemma's ``√d``), else ``{}``."""
        return {} if self.embedding_scale is None else {"scale": self.embedding_scale}

    def _check_attention_fields(self) -> None:
        """Validate (and normalise) ``sliding_window``, ``layer_types``, ``attn_softcap``, ``attn_scale``."""
        w = self.sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"sliding_window must be a positive integer (keys i − w < j <= i) or None, got {w!r}")
        if w is not None and not self.causal:
            raise ValueError("sliding_window needs a causal model (causal=True); set sliding_window=None")
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            kinds = ("full_attention", "sliding_attention")
            if len(types) != self.n_blocks or any(t not in kinds for t in types):
                raise ValueError(f"layer_types must hold one of {kinds} per block ({self.n_blocks}), got {types!r}")
            if "sliding_attention" in types and w is None:
                raise ValueError("layer_types has sliding_attention blocks but sliding_window is None; "
                                 "set sliding_window")
            object.__setattr__(self, "layer_types", types)
        for name in ("attn_softcap", "attn_scale"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not value > 0:
                raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")
            object.__setattr__(self, name, float(value))

    def window(self, i: int) -> int | None:
        """Block ``i``'s sliding window ``w`` (keys ``i − w < j <= i``), or ``None`` for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def score_scale(self) -> float:
        """The attention's score scale: ``attn_scale``, or ``1/√d_qk`` when it is ``None``."""
        return 1.0 / math.sqrt(self.d_qk) if self.attn_scale is None else self.attn_scale

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
        """Every field, JSON-ready (``rope_scaling`` as a dict or ``None``, ``layer_types`` a list)."""
        d = dataclasses.asdict(self)
        if d["layer_types"] is not None:
            d["layer_types"] = list(d["layer_types"])
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "GPTConfig":
        """Build from a dict (e.g. a checkpoint's JSON); unknown keys are an error. Dicts written
        before ``norm``, ``mlp``, ``n_kv_heads``, ``rope_scaling`` existed get their defaults
        (GPT-2's layer norm, standard MLP, multi-head attention, no scaling)."""
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


#: what ``--arch NAME`` sets beside the widths (see :func:`arch_fields`)
ARCHS = ("gpt2", "llama")


def swiglu_width(d_model: int, multiple_of: int = 8) -> int:
    """The SwiGLU width Llama derives from GPT-2's ``4·d``: ``int(2/3 · 4·d)`` rounded up to a
    multiple of ``multiple_of`` (Meta's ``llama/model.py`` FeedForward; it uses 256 for the
    released widths). Three ``d × m`` matrices with ``m ≈ 8d/3`` hold as many weights as GPT-2's
    two ``d × 4d`` ones (SmolLM2-135M: ``d = 576`` gives 1,536).

    Raises:
        ValueError: ``d_model`` or ``multiple_of`` not a positive integer.
    """
    for name, v in (("d_model", d_model), ("multiple_of", multiple_of)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    m = int(2 * 4 * d_model / 3)
    return multiple_of * -(-m // multiple_of)


def arch_fields(arch: str, d_model: int, n_heads: int) -> dict:
    """The :class:`GPTConfig` fields an architecture sets beside the widths (``--arch``).

    ``"gpt2"``: ``{}`` (the defaults: layer norm, standard MLP, learned positions, biases).
    ``"llama"``: RMS norm, SwiGLU of width :func:`swiglu_width` (``d_mlp``), RoPE, no biases,
    tied embeddings, ``n_kv_heads = n_heads / 2`` when ``n_heads`` is even (else ``n_heads``).

    Raises:
        ValueError: an unknown architecture (the message lists :data:`ARCHS`).
    """
    if arch == "gpt2":
        return {}
    if arch == "llama":
        return dict(norm="rmsnorm", mlp="swiglu", activation="silu", d_mlp=swiglu_width(d_model),
                    position_encoding="rope", bias=False, tie_weights=True,
                    n_kv_heads=n_heads // 2 if n_heads % 2 == 0 else n_heads)
    raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")


def with_arch(values: dict, arch: str | None, given) -> dict:
    """``values`` with :func:`arch_fields` of ``arch`` (at its ``d_model``,
    ``n_heads``) filled in, except the fields in ``given`` (explicit flags win). ``None``: unchanged.
    ``"gpt2"`` resets the Llama fields a preset may hold to GPT-2's defaults (``pedestrian
    train --arch``, the commands' ``--arch``).

    Raises:
        ValueError: an unknown architecture.
    """
    if arch is None:
        return values
    if "d_model" not in values or "n_heads" not in values:
        raise ValueError(f"--arch {arch} needs the widths first: give --d-model and --n-heads (or --preset)")
    fields = arch_fields(arch, values["d_model"], values["n_heads"])
    if arch == "gpt2":
        fields = {f: GPTConfig.__dataclass_fields__[f].default for f in
                  ("norm", "mlp", "n_kv_heads", "activation", "d_mlp", "position_encoding", "bias",
                   "rope_scaling")}
        fields["activation"] = "gelu_tanh"
    return {**values, **{k: v for k, v in fields.items() if k not in given}}


def merge_config(given: dict, *, preset: str | None = None, arch: str | None = None,
                 base: dict | None = None) -> tuple[dict, set]:
    """The one merge of a model's fields, for every command and settings file: ``base`` (or, with
    ``preset``, the preset's fields instead), then ``given`` (flags, a settings file's keys), then
    the fields of ``arch`` that ``given`` does not set (:func:`with_arch`).

    Returns:
        ``(fields, explicit)``: the merged fields, and those set on purpose -- ``given``, the
        preset's, and those ``arch`` changed.

    Raises:
        ValueError: an unknown preset or architecture, or ``arch`` without the widths.
    """
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    values = {**(PRESETS[preset] if preset is not None else base or {}), **given}
    filled = with_arch(values, arch, given)
    changed = {k for k in filled if k not in values or filled[k] != values[k]}
    return filled, set(given) | changed | set(PRESETS.get(preset, ()))


# the Llama-style character model: char-small's widths with arch_fields("llama", 128, 4)
PRESETS["llama-char"] = dict(PRESETS["char-small"], **arch_fields("llama", 128, 4))
# SmolLM2-135M's shape (HF HuggingFaceTB/SmolLM2-135M config.json: 30 layers, hidden 576, 9 heads,
# 3 key/value heads, head_dim 64, intermediate 1536, vocabulary 49,152, tied, rms_norm_eps 1e-5,
# rope_theta 100,000; max_position_embeddings 2,048 in the transformers-4.48 copy, later revisions
# say 8,192 -- no parameter depends on it) -> 134,515,008 parameters (EQUATIONS.md)
PRESETS["smollm2-135m"] = dict(vocab_size=49152, context_length=2048, d_model=576, n_heads=9, n_blocks=30,
                               n_kv_heads=3, d_mlp=1536, norm="rmsnorm", mlp="swiglu", activation="silu",
                               position_encoding="rope", rope_base=100_000.0, bias=False, tie_weights=True)


def preset(name: str, **overrides) -> GPTConfig:
    """A :class:`GPTConfig` from :data:`PRESETS`, with optional field overrides.

    Raises:
        ValueError: unknown preset name (the message lists the known ones).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return GPTConfig(**{**PRESETS[name], **overrides})

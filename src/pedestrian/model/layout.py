"""The parameter layout of a :class:`~pedestrian.config.GPTConfig`: every parameter's name, shape,
layer kind and weight decay (:func:`param_specs`), the fully connected layers that can carry a LoRA
adapter (:func:`fc_layers`), the adapters' ranks and specs (:func:`lora_specs`), and the counts.

The layout is computed from the config alone, so parameter counts for any size (GPT-2 small:
124,439,808) come without allocating a single array.
"""

from __future__ import annotations

from typing import NamedTuple

from ..config import GPTConfig

#: the kinds of fully connected layer a LoRA adapter can target (:func:`fc_kind`)
LORA_LAYER_KINDS = ("q", "k", "v", "attn_proj", "mlp_gate", "mlp_expand", "mlp_contract", "logits")
#: Hugging Face Llama's module names (PEFT's ``target_modules``), accepted as LoRA kinds
HF_LORA_KINDS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "attn_proj", "gate_proj": "mlp_gate",
                 "up_proj": "mlp_expand", "down_proj": "mlp_contract", "lm_head": "logits"}


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


def block_fc_layers(config: GPTConfig, i: int) -> list[tuple[str, int, int]]:
    """Block ``i``'s fully connected layers in order, ``(name, f_in, f_out)``: ``attn.q``
    ``(d, n_heads·d_qk)``, ``attn.k`` ``(d, n_kv_heads·d_qk)``, ``attn.v`` ``(d, n_kv_heads·d_head)``,
    ``attn_proj`` ``(n_heads·d_head, d)``, then ``mlp_gate`` (SwiGLU only), ``mlp_expand``
    ``(d, d_mlp)``, ``mlp_contract`` ``(d_mlp, d)``; in a mixture-of-experts block
    (:meth:`GPTConfig.is_moe`) instead ``experts.{e}.mlp_gate``, ``.mlp_expand`` ``(d, d_expert)``,
    ``.mlp_contract`` ``(d_expert, d)`` for each expert ``e``."""
    c, p = config, f"blocks.{i}"
    hv = c.n_heads * c.d_head
    out = [(f"{p}.attn.q", c.d_model, c.n_heads * c.d_qk), (f"{p}.attn.k", c.d_model, c.n_kv_heads * c.d_qk),
           (f"{p}.attn.v", c.d_model, c.n_kv_heads * c.d_head), (f"{p}.attn_proj", hv, c.d_model)]
    if c.is_moe(i):                              # each expert's SwiGLU (the router is no FC layer here)
        m = c.d_expert
        return out + [(f"{p}.experts.{e}.{name}", f_in, f_out) for e in range(c.n_experts)
                      for name, f_in, f_out in (("mlp_gate", c.d_model, m), ("mlp_expand", c.d_model, m),
                                                ("mlp_contract", m, c.d_model))]
    if c.mlp == "swiglu":
        out.append((f"{p}.mlp_gate", c.d_model, c.d_mlp))
    return out + [(f"{p}.mlp_expand", c.d_model, c.d_mlp), (f"{p}.mlp_contract", c.d_mlp, c.d_model)]


def fc_layers(config: GPTConfig) -> list[tuple[str, int, int]]:
    """Every fully connected layer that can carry a LoRA adapter: ``(name, f_in, f_out)``.

    Names: ``blocks.{i}.attn.q|k|v``, ``blocks.{i}.attn_proj``, ``blocks.{i}.mlp_gate`` (SwiGLU
    only), ``blocks.{i}.mlp_expand``, ``blocks.{i}.mlp_contract``, ``logits``
    (:func:`block_fc_layers`).
    """
    out = [fc for i in range(config.n_blocks) for fc in block_fc_layers(config, i)]
    out.append(("logits", config.d_model, config.vocab_size))
    return out


def in_block(name: str, i: int) -> str:
    """``"blocks.7.attn_proj.weight"`` → ``"blocks.{i}.attn_proj.weight"``: a block parameter's
    name in block ``i`` (the one-block gradient buffer's names are block 0's)."""
    return f"blocks.{i}." + name.split(".", 2)[2]


def fc_kind(fc_name: str) -> str:
    """``"blocks.3.attn.q"`` -> ``"q"``; ``"blocks.0.mlp_expand"`` -> ``"mlp_expand"``."""
    return fc_name.rsplit(".", 1)[-1]


def resolve_lora_targets(config: GPTConfig, targets) -> list[str]:
    """Expand LoRA target names to full FC layer names.

    Args:
        targets: iterable of kinds (``"q"``, ``"k"``, ``"v"``, ``"attn_proj"``, ``"mlp_gate"``
            (SwiGLU only), ``"mlp_expand"``, ``"mlp_contract"``, ``"logits"``, or their Hugging
            Face Llama names :data:`HF_LORA_KINDS`: ``"q_proj"`` … ``"down_proj"``, ``"lm_head"``;
            ``"all"`` for every one) or full layer names like ``"blocks.0.attn.q"``.

    Raises:
        ValueError: an unknown name (the message lists the valid kinds).
    """
    layers = [name for name, _, _ in fc_layers(config)]
    targets = [targets] if isinstance(targets, str) else list(targets)
    if "all" in targets:
        return layers
    chosen = []
    for t in targets:
        t = HF_LORA_KINDS.get(t, t)
        if t in LORA_LAYER_KINDS:
            chosen += [name for name in layers if fc_kind(name) == t]
        elif t in layers:
            chosen.append(t)
        else:
            raise ValueError(
                f"unknown LoRA target {t!r}; use kinds {LORA_LAYER_KINDS}, their Hugging Face Llama "
                f"names {tuple(HF_LORA_KINDS)}, 'all', or full layer names like 'blocks.0.attn.q'"
                + (" or 'blocks.0.experts.1.mlp_gate'" if config.n_experts else "")
            )
    return [name for name in layers if name in set(chosen)]


def qk_norm_widths(config: GPTConfig) -> tuple[int, int]:
    """The widths of the q and k norm weights: ``(d_qk, d_qk)`` per head (``qk_norm="head"``),
    ``(n_heads·d_qk, n_kv_heads·d_qk)`` over the projection (``"proj"``)."""
    c = config
    if c.qk_norm == "head":
        return c.d_qk, c.d_qk
    return c.n_heads * c.d_qk, c.n_kv_heads * c.d_qk


def param_specs(config: GPTConfig) -> list[ParamSpec]:
    """Every base parameter in its documented, stable order.

    ``pos_emb.weight`` exists only with ``position_encoding="learned"``.

    ``y = x W + b`` convention: ``W`` is ``(f_in, f_out)``. Decay: 2-D matrices (embeddings
    included) are decayed; 1-D parameters (biases, norm weights) are not. The q, k, v
    biases exist when ``config.qkv_bias``, every other bias when ``config.bias``. The norms
    ``ln1``, ``ln2``, ``ln_final`` are of kind ``"layernorm"`` (weight, and bias when
    ``config.bias``) or ``"rmsnorm"`` (weight only); SwiGLU adds ``mlp_gate`` before
    ``mlp_expand`` (:func:`block_fc_layers`); with ``n_kv_heads < n_heads`` the k and v weights
    have ``n_kv_heads`` heads' columns. ``config.qk_norm`` adds ``attn.q_norm.weight`` and
    ``attn.k_norm.weight`` after ``attn.v`` (:func:`qk_norm_widths`); ``norm_placement="post"``
    has ``ln1_post`` after ``attn_proj`` and ``ln2_post`` after ``mlp_contract`` in place of
    ``ln1`` and ``ln2``, ``"sandwich"`` all four.
    A mixture-of-experts block has ``router.weight`` ``(d, E)`` after ``ln2``, then its experts' layers.
    """
    c = config
    d = c.d_model
    specs = [ParamSpec("tok_emb.weight", (c.vocab_size, d), "embedding", True)]
    if c.learned_positions:                       # RoPE and none have no position table
        specs.append(ParamSpec("pos_emb.weight", (c.context_length, d), "embedding", True))

    def ln(name: str) -> list[ParamSpec]:
        out = [ParamSpec(f"{name}.weight", (d,), c.norm, False)]
        if c.bias and c.norm == "layernorm":
            out.append(ParamSpec(f"{name}.bias", (d,), c.norm, False))
        return out

    pre, post = c.norm_placement != "post", c.norm_placement != "pre"
    for i in range(c.n_blocks):
        p = f"blocks.{i}"
        if pre:
            specs += ln(f"{p}.ln1")
        for fc, f_in, f_out in block_fc_layers(c, i):
            kind = "attention" if ".attn" in fc else "mlp"
            specs.append(ParamSpec(f"{fc}.weight", (f_in, f_out), kind, True))
            if (c.qkv_bias if ".attn." in fc else c.bias):
                specs.append(ParamSpec(f"{fc}.bias", (f_out,), kind, False))
            if fc.endswith("attn.v") and c.qk_norm is not None:               # the prelude's q/k norms
                q_width, k_width = qk_norm_widths(c)
                specs += [ParamSpec(f"{p}.attn.q_norm.weight", (q_width,), "rmsnorm", False),
                          ParamSpec(f"{p}.attn.k_norm.weight", (k_width,), "rmsnorm", False)]
            if fc.endswith("attn_proj"):
                specs += ln(f"{p}.ln1_post") if post else []
                specs += ln(f"{p}.ln2") if pre else []
                if c.is_moe(i):                   # the router, W_r (d, E): HF's mlp.gate
                    specs.append(ParamSpec(f"{p}.router.weight", (d, c.n_experts), "router", True))
        if post:
            specs += ln(f"{p}.ln2_post")
    specs += ln("ln_final")
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
        key = HF_LORA_KINDS.get(key, key)
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


def count_active_params(config: GPTConfig) -> int:
    """Parameters one token's forward uses: :func:`count_params` less, in every mixture-of-experts
    block, the ``E − k`` experts it is not routed to (``3 · d · d_expert`` each); no allocation."""
    moe_blocks = sum(config.is_moe(i) for i in range(config.n_blocks))
    unused = config.n_experts - config.n_experts_per_token
    return count_params(config) - moe_blocks * unused * 3 * config.d_model * config.d_expert

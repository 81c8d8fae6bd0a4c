"""Independent PyTorch reference of the `pedestrian` GPT, used as the autograd oracle.

This module deliberately imports NOTHING from `pedestrian`. It restates the forward pass of
/work/shared/EQUATIONS.md ("The minimal GPT") with plain torch ops on a flat dict of
parameters and lets autograd produce every gradient and every error signal Δ_i = dL/da_i.

Parameter names and shapes (``y = x @ W + b``, ``W`` is ``(f_in, f_out)``)::

    tok_emb.weight                  (V, d)
    pos_emb.weight                  (context_length, d)        only for position_encoding "learned"
    blocks.{i}.ln1.weight / .bias   (d,)                       bias only if cfg["bias"]
                                                               (q, k, v: if cfg["qkv_bias"])
    blocks.{i}.attn.q.weight        (d, n_heads*d_qk)          .bias (n_heads*d_qk,)
    blocks.{i}.attn.k.weight        (d, n_heads*d_qk)          .bias (n_heads*d_qk,)
    blocks.{i}.attn.v.weight        (d, n_heads*d_head)        .bias (n_heads*d_head,)
    blocks.{i}.attn_proj.weight     (n_heads*d_head, d)        .bias (d,)
    blocks.{i}.ln2.weight / .bias   (d,)
    blocks.{i}.mlp_expand.weight    (d, d_mlp)                 .bias (d_mlp,)
    blocks.{i}.mlp_contract.weight  (d_mlp, d)                 .bias (d,)
    ln_final.weight / .bias         (d,)
    logits.weight                   (d, V)      only when not tie_weights
    logits.bias                     (V,)        only when not tie_weights and bias
    X.lora_D (f_in, r_X), X.lora_U (r_X, f_out) optional LoRA on FC layer X (its own rank r_X)

Conventions resolved here (see the summary at the bottom of this docstring):

* LoRA uses the paper's plain scalar ``alpha``: ``y = x W + b + alpha * (x D) U`` (no ``/ r``);
  ``lora_alpha`` is one number or ``{layer: alpha}``. Adapter dropout (PEFT's ``lora_dropout``)
  is given as fixed masks ``{layer: m}`` (``m`` shaped like the layer input, holding 0 or
  ``1/(1-p)``): ``y = x W + b + alpha * ((x * m) D) U``.
* Tied logits: ``logits = a11 @ tok_emb.weight.T`` with no bias; a LoRA on ``logits`` then has
  ``D: (d, r)``, ``U: (r, V)``.
* Layer norms have a bias iff ``cfg["bias"]`` (like GPT-2 / nanoGPT's ``bias`` flag); the q, k,
  v layers iff ``cfg["qkv_bias"]`` (``None`` or absent: ``cfg["bias"]``).
* ``d_head`` / ``d_qk`` of ``None`` default to ``d_model // n_heads``;
  ``d_mlp`` of ``None`` (or absent) to ``int(round(mlp_ratio * d_model))``.
* Loss = mean cross-entropy over targets != -100; if nothing counts the loss is exactly 0 and
  every gradient / delta is 0 (no NaN).
* Dropout does not exist here (always 0), except the LoRA input masks given as ``lora_masks``.
* ``position_encoding``: ``"learned"`` (a table added to the token embedding), ``"none"``, or
  ``"rope"``: rotary embeddings of q and k, written here as complex multiplication (RoFormer,
  Su et al. 2021, section 3.2): in each head, dimension ``j < r/2`` is the real part and
  ``j + r/2`` the imaginary part of ``z_j`` (GPT-NeoX's half-split pairing), and
  ``z_j ← z_j · exp(i·t·θ_j)`` with ``θ_j = 1 / base^(2j/r)``; the rotated count is
  ``r = (int(rope_fraction · d_qk) // 2) · 2``; the other dimensions pass.
* ``reference_forward(..., positions=, key_start=)``: positions other than ``0 … T-1``, and a
  sliding window (query ``α`` sees keys ``key_start[α] <= β <= α``). Without learned positions a
  sequence may be longer than ``context_length``.
* The Llama family (EQUATIONS.md "The same chain, Llama-style"), each a cfg key: ``norm``
  ``"rmsnorm"`` (``x / sqrt(mean x² + eps) ∘ w``, a weight and never a bias); ``mlp`` ``"swiglu"``
  (``a7_gate = a6 W_gate``, ``a7_up = a6 W_up`` (the ``mlp_expand`` parameters), ``a8 =
  silu(a7_gate) ∘ a7_up``, ``a9 = a8 W_down`` (``mlp_contract``); parameter
  ``blocks.{i}.mlp_gate.weight (d, d_mlp)``, activations ``a7_gate``, ``a7_up`` in place of ``a7``);
  ``n_kv_heads`` (grouped-query attention: k, v have ``n_kv_heads`` heads, query head ``h`` reads
  head ``h // (n_heads / n_kv_heads)``; ``None``: ``n_heads``); ``rope_scaling`` (``None`` or
  Hugging Face's ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
  "original_max_position_embeddings"}``, transformers' ``_compute_llama3_parameters``).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np
import torch

IGNORE_INDEX = -100

FC_SUFFIXES_PER_BLOCK = ("attn.q", "attn.k", "attn.v", "attn_proj", "mlp_expand", "mlp_contract")

__all__ = [
    "IGNORE_INDEX",
    "FC_SUFFIXES_PER_BLOCK",
    "default_cfg",
    "derived_dims",
    "fc_layer_names",
    "fc_layer_shape",
    "expand_lora_targets",
    "param_shapes",
    "check_params",
    "random_params",
    "activation_names",
    "delta_names",
    "reference_forward",
    "reference_loss",
    "reference_loss_and_grads",
]


# --------------------------------------------------------------------------------------------
# configuration / shapes
# --------------------------------------------------------------------------------------------

def default_cfg(**overrides: Any) -> dict:
    """A small config for tests. Any key may be overridden."""
    cfg = dict(
        vocab_size=11,
        context_length=8,
        d_model=12,
        n_heads=3,
        n_blocks=2,
        d_head=None,
        d_qk=None,
        mlp_ratio=4,
        activation="gelu_tanh",
        ln_eps=1e-5,
        bias=True,
        tie_weights=False,
        causal=True,
        qkv_bias=None,
        d_mlp=None,
        position_encoding="learned",
        rope_base=10000.0,
        rope_fraction=1.0,
        norm="layernorm",
        mlp="standard",
        n_kv_heads=None,
        rope_scaling=None,
    )
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise KeyError(f"unknown cfg keys: {sorted(unknown)}")
    cfg.update(overrides)
    return cfg


def derived_dims(cfg: dict) -> dict:
    """Resolve ``d_head``, ``d_qk`` (None -> d_model // n_heads) and ``d_mlp``."""
    d = int(cfg["d_model"])
    h = int(cfg["n_heads"])
    d_head = cfg.get("d_head")
    d_qk = cfg.get("d_qk")
    d_head = d // h if d_head is None else int(d_head)
    d_qk = d // h if d_qk is None else int(d_qk)
    d_mlp = int(round(float(cfg["mlp_ratio"]) * d)) if cfg.get("d_mlp") is None else int(cfg["d_mlp"])
    n_kv = h if cfg.get("n_kv_heads") is None else int(cfg["n_kv_heads"])
    if h % n_kv:
        raise ValueError(f"n_kv_heads={n_kv} does not divide n_heads={h}")
    return dict(d_model=d, n_heads=h, n_kv_heads=n_kv, d_head=d_head, d_qk=d_qk, d_mlp=d_mlp,
                vocab_size=int(cfg["vocab_size"]), context_length=int(cfg["context_length"]),
                n_blocks=int(cfg["n_blocks"]))


def _block_suffixes(cfg: dict) -> tuple:
    """The FC layers of one block (SwiGLU: ``mlp_gate`` too), in forward order."""
    if cfg.get("mlp", "standard") == "swiglu":
        return ("attn.q", "attn.k", "attn.v", "attn_proj", "mlp_gate", "mlp_expand", "mlp_contract")
    return FC_SUFFIXES_PER_BLOCK


def fc_layer_names(cfg: dict) -> list[str]:
    """Every FC layer that may carry a LoRA adapter, in forward order."""
    names = [f"blocks.{i}.{s}" for i in range(int(cfg["n_blocks"])) for s in _block_suffixes(cfg)]
    names.append("logits")
    return names


def fc_layer_shape(cfg: dict, name: str) -> tuple[int, int]:
    """(f_in, f_out) of the FC layer ``name`` (for tied logits: that of ``tok_emb.weight.T``)."""
    dd = derived_dims(cfg)
    d, h, kv = dd["d_model"], dd["n_heads"], dd["n_kv_heads"]
    if name == "logits":
        return (d, dd["vocab_size"])
    suffix = name.split(".", 2)[2] if name.startswith("blocks.") else None
    table = {
        "attn.q": (d, h * dd["d_qk"]),
        "attn.k": (d, kv * dd["d_qk"]),
        "attn.v": (d, kv * dd["d_head"]),
        "attn_proj": (h * dd["d_head"], d),
        "mlp_gate": (d, dd["d_mlp"]),
        "mlp_expand": (d, dd["d_mlp"]),
        "mlp_contract": (dd["d_mlp"], d),
    }
    if suffix not in table or name not in fc_layer_names(cfg):
        raise KeyError(f"not an FC layer of this config: {name!r}")
    return table[suffix]


def expand_lora_targets(cfg: dict, targets: Iterable[str]) -> list[str]:
    """Full FC names from a list that may mix full names ("blocks.0.attn.q", "logits") and
    per-block suffixes ("attn.q", "mlp_expand", ... meaning that layer in every block)."""
    valid = fc_layer_names(cfg)
    out: list[str] = []
    for t in targets:
        if t in valid:
            full = [t]
        elif t in _block_suffixes(cfg):
            full = [f"blocks.{i}.{t}" for i in range(int(cfg["n_blocks"]))]
        else:
            raise KeyError(f"unknown LoRA target {t!r}; valid: {valid} or {list(_block_suffixes(cfg))}")
        for f in full:
            if f not in out:
                out.append(f)
    return [n for n in valid if n in out]  # canonical (forward) order


def param_shapes(cfg: dict, lora: dict | None = None) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter (insertion order = forward order)."""
    dd = derived_dims(cfg)
    d, V = dd["d_model"], dd["vocab_size"]
    bias = bool(cfg["bias"])
    qkv_bias = bias if cfg.get("qkv_bias") is None else bool(cfg["qkv_bias"])
    shapes: dict[str, tuple[int, ...]] = {"tok_emb.weight": (V, d)}
    if cfg.get("position_encoding", "learned") == "learned":
        shapes["pos_emb.weight"] = (dd["context_length"], d)

    def ln(name: str) -> None:
        shapes[f"{name}.weight"] = (d,)
        if bias and cfg.get("norm", "layernorm") != "rmsnorm":
            shapes[f"{name}.bias"] = (d,)

    def fc(name: str) -> None:
        f_in, f_out = fc_layer_shape(cfg, name)
        shapes[f"{name}.weight"] = (f_in, f_out)
        if (qkv_bias if ".attn." in name else bias):
            shapes[f"{name}.bias"] = (f_out,)

    for i in range(dd["n_blocks"]):
        p = f"blocks.{i}"
        ln(f"{p}.ln1")
        fc(f"{p}.attn.q")
        fc(f"{p}.attn.k")
        fc(f"{p}.attn.v")
        fc(f"{p}.attn_proj")
        ln(f"{p}.ln2")
        if cfg.get("mlp", "standard") == "swiglu":
            fc(f"{p}.mlp_gate")
        fc(f"{p}.mlp_expand")
        fc(f"{p}.mlp_contract")
    ln("ln_final")
    if not cfg["tie_weights"]:
        fc("logits")
    if lora:
        for name in expand_lora_targets(cfg, lora["targets"]):
            r = int(lora.get("ranks", {}).get(name, lora["rank"]))
            f_in, f_out = fc_layer_shape(cfg, name)
            shapes[f"{name}.lora_D"] = (f_in, r)
            shapes[f"{name}.lora_U"] = (r, f_out)
    return shapes


def _lora_names_in(params: dict) -> list[str]:
    return sorted({k[: -len(".lora_D")] for k in params if k.endswith(".lora_D")}
                  | {k[: -len(".lora_U")] for k in params if k.endswith(".lora_U")})


def check_params(params: dict, cfg: dict) -> None:
    """Raise ValueError unless ``params`` has exactly the names/shapes the config implies
    (LoRA adapters are inferred from the ``.lora_D`` / ``.lora_U`` keys present)."""
    lora_layers = _lora_names_in(params)
    valid_fc = fc_layer_names(cfg)
    bad = [n for n in lora_layers if n not in valid_fc]
    if bad:
        raise ValueError(f"LoRA keys on non-FC layers: {bad}")
    ranks = set()
    for n in lora_layers:
        if f"{n}.lora_D" not in params or f"{n}.lora_U" not in params:
            raise ValueError(f"LoRA on {n!r} needs both lora_D and lora_U")
        ranks.add(int(params[f"{n}.lora_D"].shape[1]))
    expected = param_shapes(cfg)
    for n in lora_layers:
        f_in, f_out = fc_layer_shape(cfg, n)
        r = int(params[f"{n}.lora_D"].shape[1])
        expected[f"{n}.lora_D"] = (f_in, r)
        expected[f"{n}.lora_U"] = (r, f_out)
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
        raise ValueError(f"parameter names mismatch: missing={missing} unexpected={extra}")
    wrong = {k: (tuple(params[k].shape), v) for k, v in expected.items() if tuple(params[k].shape) != v}
    if wrong:
        raise ValueError(f"parameter shapes mismatch (got, expected): {wrong}")


def random_params(cfg: dict, seed: int = 0, dtype=np.float64, lora: dict | None = None) -> dict[str, np.ndarray]:
    """Non-trivial random parameters (NumPy) with the names of :func:`param_shapes`.

    * embeddings: N(0, 0.5²) (token) and N(0, 0.3²) (position);
    * FC weights: N(0, s²) with s = min(0.5, 1/sqrt(f_in)) so activations stay O(1);
    * biases: N(0, 0.1²) (nonzero); LN weights 1 + N(0, 0.1²);
    * LoRA (``lora={"targets": [...], "rank": r}``, optionally ``"ranks": {layer: r}``):
      D ~ N(0, 1/f_in), U ~ N(0, 0.2²)
      (U nonzero on purpose, so every LoRA gradient path is exercised).
    """
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(cfg, lora).items():
        if name == "tok_emb.weight":
            a = 0.5 * rng.standard_normal(shape)
        elif name == "pos_emb.weight":
            a = 0.3 * rng.standard_normal(shape)
        elif name.endswith(".lora_D"):
            a = rng.standard_normal(shape) / math.sqrt(shape[0])
        elif name.endswith(".lora_U"):
            a = 0.2 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            a = 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1:  # LayerNorm weight
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        else:  # FC weight
            a = min(0.5, 1.0 / math.sqrt(shape[0])) * rng.standard_normal(shape)
        out[name] = np.ascontiguousarray(a, dtype=dtype)
    return out


def activation_names(cfg: dict) -> list[str]:
    names = ["a1"]
    for i in range(int(cfg["n_blocks"])):
        for j in range(2, 11):
            if j == 7 and cfg.get("mlp", "standard") == "swiglu":
                names += [f"blocks.{i}.a7_gate", f"blocks.{i}.a7_up"]
            else:
                names.append(f"blocks.{i}.a{j}")
    return names + ["a11", "a12"]


def delta_names(cfg: dict) -> list[str]:
    return [_delta_name(n) for n in activation_names(cfg)]


def _delta_name(act_name: str) -> str:
    head, _, last = act_name.rpartition(".")
    if last == "causal":                                 # the masked scores: Δcausal
        return f"{head}.Δcausal"
    assert last.startswith("a")
    d = "Δ" + last[1:]
    return f"{head}.{d}" if head else d


# --------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------

def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float) -> torch.Tensor:
    mu = x.mean(dim=-1, keepdim=True)
    xc = x - mu
    var = (xc * xc).mean(dim=-1, keepdim=True)  # biased variance
    y = xc / torch.sqrt(var + eps) * w
    return y if b is None else y + b


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def _norm(cfg: dict, params: dict, name: str, x: torch.Tensor, eps: float) -> torch.Tensor:
    if cfg.get("norm", "layernorm") == "rmsnorm":
        return _rms_norm(x, params[f"{name}.weight"], eps)
    return _layer_norm(x, params[f"{name}.weight"], params.get(f"{name}.bias"), eps)


def _activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "relu":
        return torch.clamp(x, min=0)
    if kind == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if kind == "gelu_tanh":
        u = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)
        return 0.5 * x * (1.0 + torch.tanh(u))
    if kind == "silu":
        return x * torch.sigmoid(x)
    raise ValueError(f"unknown activation {kind!r}")


def _fc(params: dict, name: str, x: torch.Tensor, alpha, masks: dict,
        weight: torch.Tensor | None = None, allow_bias: bool = True) -> torch.Tensor:
    W = params[f"{name}.weight"] if weight is None else weight
    y = x @ W
    b = params.get(f"{name}.bias") if allow_bias else None
    if b is not None:
        y = y + b
    D = params.get(f"{name}.lora_D")
    if D is not None:
        U = params[f"{name}.lora_U"]
        a = float(alpha[name]) if isinstance(alpha, dict) else float(alpha)
        m = masks.get(name)
        x_in = x if m is None else x * torch.as_tensor(np.asarray(m), dtype=x.dtype)
        y = y + a * ((x_in @ D) @ U)
    return y


def _as_long(tokens: Any) -> torch.Tensor:
    if isinstance(tokens, torch.Tensor):
        t = tokens.to(torch.long)
    else:
        t = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    if t.ndim == 1:
        t = t[None, :]
    if t.ndim != 2:
        raise ValueError(f"tokens must be (B, T), got shape {tuple(t.shape)}")
    return t


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3's frequency table (transformers' ``_compute_llama3_parameters``)."""
    kind = scaling.get("rope_type", scaling.get("type", "llama3"))
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r}: only 'llama3' here")
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    L = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > L / low, inv_freq / factor, inv_freq)
    smooth = (L / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < L / high) & ~(wavelen > L / low)
    return torch.where(medium, smoothed, scaled)


def _rope(x: torch.Tensor, n_heads: int, d_qk: int, pos: torch.Tensor, base: float,
          fraction: float, scaling: dict | None = None) -> torch.Tensor:
    """RoPE as complex multiplication on every head of ``x`` ``(B, T, n_heads·d_qk)``."""
    r = (int(fraction * d_qk) // 2) * 2
    half = r // 2
    B, T, _ = x.shape
    xh = x.reshape(B, T, n_heads, d_qk)
    inv_freq = 1.0 / (base ** (torch.arange(0, r, 2, dtype=torch.float64) / r))   # θ_j
    if scaling is not None:
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    angle = pos.to(torch.float64)[:, None] * inv_freq[None, :]                    # (T, r/2)
    turn = torch.polar(torch.ones_like(angle), angle)[None, :, None, :]           # e^{i t θ_j}
    z = torch.complex(xh[..., :half].to(torch.float64), xh[..., half:r].to(torch.float64)) * turn
    out = torch.cat([z.real.to(x.dtype), z.imag.to(x.dtype), xh[..., r:]], dim=-1)
    return out.reshape(B, T, n_heads * d_qk)


def reference_forward(params: dict[str, torch.Tensor], cfg: dict, tokens, lora_alpha: float | dict = 1.0,
                      return_activations: bool = False, lora_masks: dict | None = None, positions=None,
                      key_start=None, keep_scores: bool = False):
    """Logits ``(B, T, V)``; with ``return_activations=True`` returns ``(logits, acts)`` where
    ``acts`` maps "a1", "blocks.{i}.a2" .. "blocks.{i}.a10", "a11", "a12" to the activations,
    each ``retain_grad()``-ed when it requires grad (so ``acts[n].grad`` is Δ after backward).

    ``tokens`` may be a (B, T) or (T,) LongTensor / array; 1-D input is treated as B = 1.
    ``lora_alpha``: one number or ``{layer: alpha}``; ``lora_masks``: ``{layer: fixed dropout
    mask of the adapter input}`` (absent layers: no dropout).
    ``positions``: ``(T,)`` position of each token (default ``0 … T-1``). ``key_start``: ``(T,)``
    ints, the first key each query may attend to (a causal sliding window; default 0).
    ``keep_scores``: ``acts`` also holds each block's masked, scaled scores ``(B, H, T, T)`` as
    "blocks.{i}.causal" (its grad after backward is Δcausal; ``pedestrian demo --check autograd``).
    """
    check_params(params, cfg)
    dd = derived_dims(cfg)
    tok = _as_long(tokens)
    B, T = tok.shape
    encoding = cfg.get("position_encoding", "learned")
    if encoding not in ("learned", "rope", "none"):
        raise ValueError(f"unknown position_encoding {encoding!r}")
    pos = torch.arange(T) if positions is None else torch.as_tensor(np.asarray(positions), dtype=torch.long)
    if encoding == "learned" and T > dd["context_length"]:
        raise ValueError(f"sequence length {T} exceeds context_length {dd['context_length']}")
    if tok.numel() and (int(tok.min()) < 0 or int(tok.max()) >= dd["vocab_size"]):
        raise ValueError("token id out of range [0, vocab_size)")
    H, dqk, dh, Hkv = dd["n_heads"], dd["d_qk"], dd["d_head"], dd["n_kv_heads"]
    group = H // Hkv                                  # query head h reads key/value head h // group
    scaling = cfg.get("rope_scaling")
    eps = float(cfg["ln_eps"])
    alpha = dict(lora_alpha) if isinstance(lora_alpha, dict) else float(lora_alpha)
    masks = dict(lora_masks or {})
    acts: dict[str, torch.Tensor] = {}

    def keep(name: str, t: torch.Tensor) -> torch.Tensor:
        if return_activations:
            if t.requires_grad:
                t.retain_grad()
            acts[name] = t
        return t

    W_tok = params["tok_emb.weight"]
    if encoding == "learned":
        a1 = keep("a1", W_tok[tok] + params["pos_emb.weight"][pos][None, :, :])
    else:
        a1 = keep("a1", W_tok[tok])

    if cfg["causal"]:
        future = torch.arange(T)[None, :] > torch.arange(T)[:, None]  # [query, key]: key > query
        if key_start is not None:                                      # before the window: hidden too
            start = torch.as_tensor(np.asarray(key_start), dtype=torch.long)
            future = future | (torch.arange(T)[None, :] < start[:, None])
    elif key_start is not None:
        raise ValueError("key_start (a sliding window) needs a causal cfg")
    x = a1
    for i in range(dd["n_blocks"]):
        p = f"blocks.{i}"
        a2 = keep(f"{p}.a2", _norm(cfg, params, f"{p}.ln1", x, eps))
        q = _fc(params, f"{p}.attn.q", a2, alpha, masks)
        k = _fc(params, f"{p}.attn.k", a2, alpha, masks)
        v = _fc(params, f"{p}.attn.v", a2, alpha, masks)
        if encoding == "rope":
            q = _rope(q, H, dqk, pos, float(cfg["rope_base"]), float(cfg["rope_fraction"]), scaling)
            k = _rope(k, Hkv, dqk, pos, float(cfg["rope_base"]), float(cfg["rope_fraction"]), scaling)
        scores = []
        for h in range(H):
            qh = q[..., h * dqk:(h + 1) * dqk]
            j = h // group
            kh = k[..., j * dqk:(j + 1) * dqk]
            S = (qh @ kh.transpose(-1, -2)) / math.sqrt(dqk)  # (B, T, T)
            if cfg["causal"]:
                S = S.masked_fill(future, float("-inf"))
            scores.append(S)
        if keep_scores:                                # one (B, H, T, T) tensor the heads read from
            stacked = keep(f"{p}.causal", torch.stack(scores, dim=1))
            scores = [stacked[:, h] for h in range(H)]
        heads = [torch.softmax(S, dim=-1) @ v[..., (h // group) * dh:(h // group + 1) * dh]
                 for h, S in enumerate(scores)]
        a3 = keep(f"{p}.a3", torch.cat(heads, dim=-1))
        a4 = keep(f"{p}.a4", _fc(params, f"{p}.attn_proj", a3, alpha, masks))
        a5 = keep(f"{p}.a5", x + a4)
        a6 = keep(f"{p}.a6", _norm(cfg, params, f"{p}.ln2", a5, eps))
        if cfg.get("mlp", "standard") == "swiglu":
            gate = keep(f"{p}.a7_gate", _fc(params, f"{p}.mlp_gate", a6, alpha, masks))
            up = keep(f"{p}.a7_up", _fc(params, f"{p}.mlp_expand", a6, alpha, masks))
            a8 = keep(f"{p}.a8", _activation(gate, "silu") * up)
        else:
            a7 = keep(f"{p}.a7", _fc(params, f"{p}.mlp_expand", a6, alpha, masks))
            a8 = keep(f"{p}.a8", _activation(a7, cfg["activation"]))
        a9 = keep(f"{p}.a9", _fc(params, f"{p}.mlp_contract", a8, alpha, masks))
        a10 = keep(f"{p}.a10", a5 + a9)
        x = a10
    a11 = keep("a11", _norm(cfg, params, "ln_final", x, eps))
    if cfg["tie_weights"]:
        a12 = _fc(params, "logits", a11, alpha, masks, weight=W_tok.transpose(0, 1), allow_bias=False)
    else:
        a12 = _fc(params, "logits", a11, alpha, masks)
    a12 = keep("a12", a12)
    return (a12, acts) if return_activations else a12


def reference_loss(logits: torch.Tensor, targets) -> torch.Tensor:
    """Mean cross-entropy over targets != -100, via log-sum-exp. 0 (still attached to the graph,
    so every gradient is exactly 0) when no target counts."""
    tgt = (targets.to(torch.long) if isinstance(targets, torch.Tensor)
           else torch.as_tensor(np.asarray(targets), dtype=torch.long))
    V = logits.shape[-1]
    z = logits.reshape(-1, V)
    t = tgt.reshape(-1)
    if t.shape[0] != z.shape[0]:
        raise ValueError(f"targets shape {tuple(tgt.shape)} does not match logits {tuple(logits.shape)}")
    counted = t != IGNORE_INDEX
    n = int(counted.sum())
    if n == 0:
        return (z * 0.0).sum()
    if int(t[counted].min()) < 0 or int(t[counted].max()) >= V:
        raise ValueError("target id out of range [0, vocab_size) (and not the ignore index -100)")
    m = z.max(dim=-1, keepdim=True).values.detach()
    lse = torch.log(torch.exp(z - m).sum(dim=-1)) + m[:, 0]
    safe_t = torch.where(counted, t, torch.zeros_like(t))
    picked = z.gather(1, safe_t[:, None])[:, 0]
    per_token = (lse - picked) * counted.to(z.dtype)
    return per_token.sum() / n


def reference_loss_and_grads(params_np: dict[str, np.ndarray], cfg: dict, tokens, targets,
                             lora_alpha: float | dict = 1.0, dtype: torch.dtype = torch.float64,
                             lora_masks: dict | None = None, keep_scores: bool = False):
    """Forward + loss + backward in torch.

    Returns ``(loss, logits, grads, deltas)``:
      * ``loss``   python float;
      * ``logits`` np.ndarray (B, T, V);
      * ``grads``  {param name: np.ndarray} for EVERY parameter (zeros where autograd gave none);
      * ``deltas`` {"Δ1", "blocks.{i}.Δ2" .. "blocks.{i}.Δ10", "Δ11", "Δ12": np.ndarray}, the
        total gradient of the loss w.r.t. each activation (Δ1 includes both uses of a1).
        With ``keep_scores``, also "blocks.{i}.Δcausal" ``(B, H, T, T)``, at the masked scores.
    """
    params = {k: torch.tensor(np.asarray(v), dtype=dtype).requires_grad_(True) for k, v in params_np.items()}
    logits, acts = reference_forward(params, cfg, tokens, lora_alpha=lora_alpha, return_activations=True,
                                     lora_masks=lora_masks, keep_scores=keep_scores)
    loss = reference_loss(logits, targets)
    loss.backward()
    grads = {k: (np.zeros(tuple(p.shape), dtype=np.asarray(params_np[k]).dtype) if p.grad is None
                 else p.grad.detach().cpu().numpy())
             for k, p in params.items()}
    deltas = {}
    for name, a in acts.items():
        g = a.grad
        deltas[_delta_name(name)] = (torch.zeros_like(a).detach().cpu().numpy() if g is None
                                   else g.detach().cpu().numpy())
    return float(loss.detach()), logits.detach().cpu().numpy(), grads, deltas

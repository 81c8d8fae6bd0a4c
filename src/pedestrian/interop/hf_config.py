"""The Hugging Face ``GPT2Config`` <-> :class:`~pedestrian.config.GPTConfig` mapping.

Config (``GPT2Config`` field -> :class:`~pedestrian.config.GPTConfig` field)::

    vocab_size -> vocab_size        n_positions -> context_length     n_embd -> d_model
    n_head -> n_heads               n_layer -> n_blocks               n_inner (None: 4 n_embd) -> d_mlp
    layer_norm_epsilon -> ln_eps    tie_word_embeddings -> tie_weights (untied lm_head: no bias)
    activation_function: "gelu_new" / "gelu_pytorch_tanh" -> "gelu_tanh" (the tanh GELU of
        EQUATIONS.md), "gelu" -> "gelu" (exact), "relu" -> "relu"; others are refused.
    scale_attn_weights must be true, scale_attn_by_inverse_layer_idx and add_cross_attention
    false (refused otherwise). reorder_and_upcast_attn only changes the precision of HF's eager
    attention (same formula), so it is accepted. Dropout probabilities are not carried over
    (pedestrian has no attention-probability dropout); the loaded model has dropout 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from ..config import GPTConfig
from .files import read_json_object

#: HF ``activation_function`` -> pedestrian ``activation``.
HF_TO_ACTIVATION = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                    "relu": "relu"}
#: pedestrian ``activation`` -> the HF name written on export.
ACTIVATION_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}

#: ``GPT2Config`` defaults, used for keys a ``config.json`` leaves out (as ``transformers`` does).
_HF_DEFAULTS = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                    n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                    tie_word_embeddings=True, scale_attn_weights=True,
                    scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                    add_cross_attention=False)


def read_hf_config(hf_dir) -> dict:
    """The parsed ``config.json`` of a Hugging Face model directory.

    Raises:
        FileNotFoundError: ``hf_dir`` is not a directory or has no ``config.json``.
        ValueError: ``config.json`` is not a JSON object.
    """
    d = Path(hf_dir).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(f"Hugging Face model directory not found: {d} is not a directory; pass the folder of "
                                "a Hugging Face model (config.json + weights: GPT-2, Llama, Qwen2/3, Mistral, Gemma 2/3, OLMo 2, SmolLM3, a mixture of experts), e.g. one "
                                "downloaded with `hf download gpt2 --local-dir gpt2`, saved with transformers' "
                                "save_pretrained, or written by `pedestrian export-hf`")
    path = d / "config.json"
    if not path.is_file():
        run = " (a pedestrian run: merge its adapters into one with `pedestrian export-hf --adapter RUN --out DIR`)" \
            if (d / "adapter").is_dir() or (d / "log.jsonl").is_file() else ""
        raise FileNotFoundError(f"{d} is not a Hugging Face model directory: it has no config.json "
                                f"(a model saved with transformers' save_pretrained has one){run}")
    return read_json_object(path)


def config_from_hf(hf_config: Mapping, *, source: str = "config.json") -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face ``GPT2Config`` dict (see the module table).

    Args:
        hf_config: the parsed ``config.json``; missing keys take ``GPT2Config``'s defaults.
        source: how to name the config in error messages.

    Raises:
        ValueError: not a GPT-2 config (``model_type`` other than ``"gpt2"``), or settings
            pedestrian cannot reproduce (every one is listed, with the fix).
    """
    model_type = hf_config.get("model_type")
    archs = hf_config.get("architectures") or []
    if model_type != "gpt2" and not (model_type is None and any(str(a).startswith("GPT2") for a in archs)):
        what = f"model_type {model_type!r}" if model_type is not None else "no model_type"
        raise ValueError(f"{source} describes a model with {what}, not GPT-2; pedestrian reads only "
                         "GPT-2 directories (model_type 'gpt2', architectures GPT2LMHeadModel)")
    c = {**_HF_DEFAULTS, **{k: v for k, v in hf_config.items() if k in _HF_DEFAULTS}}
    problems = []
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        v = c[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            problems.append(f"{key}={v!r} is not a positive integer")
    if problems:
        raise ValueError(f"{source} is not a usable GPT-2 config: " + "; ".join(problems))
    d = c["n_embd"]
    act = c["activation_function"]
    if act not in HF_TO_ACTIVATION:
        problems.append(f"activation_function={act!r} is not supported (use one of "
                        f"{sorted(HF_TO_ACTIVATION)})")
    if d % c["n_head"]:
        problems.append(f"n_embd={d} is not divisible by n_head={c['n_head']}")
    n_inner = c["n_inner"]
    if n_inner is not None and (not isinstance(n_inner, int) or isinstance(n_inner, bool) or n_inner < 1):
        problems.append(f"n_inner={n_inner!r} is not a positive integer (the MLP width; null means "
                        "4 · n_embd)")
    if not c["scale_attn_weights"]:
        problems.append("scale_attn_weights=false (pedestrian always scales scores by 1/sqrt(d_head))")
    if c["scale_attn_by_inverse_layer_idx"]:
        problems.append("scale_attn_by_inverse_layer_idx=true (not supported; scores are scaled by "
                        "1/sqrt(d_head) only)")
    if c["add_cross_attention"]:
        problems.append("add_cross_attention=true (an encoder-decoder GPT-2; pedestrian is decoder-only)")
    eps = c["layer_norm_epsilon"]
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        problems.append(f"layer_norm_epsilon={eps!r} is not a number >= 0")
    if problems:
        raise ValueError(f"{source} has GPT-2 settings pedestrian cannot reproduce: "
                         + "; ".join(problems))
    tied = bool(c["tie_word_embeddings"])
    return GPTConfig(vocab_size=c["vocab_size"], context_length=c["n_positions"], d_model=d,
                     n_heads=c["n_head"], n_blocks=c["n_layer"],
                     # mlp_ratio as well when it is a whole number, so a round trip gives the same config
                     mlp_ratio=4 if n_inner is None or n_inner % d else n_inner // d,
                     d_mlp=4 * d if n_inner is None else n_inner,
                     activation=HF_TO_ACTIVATION[act], ln_eps=float(eps), bias=True,
                     tie_weights=tied, logits_bias=False, dropout=0.0)


def export_problems(config: GPTConfig) -> list[str]:
    """Why ``config`` cannot be written as a Hugging Face ``GPT2LMHeadModel`` (empty: it can).

    GPT-2 has biases everywhere except ``lm_head`` (q, k, v included: ``c_attn.bias``),
    ``d_qk = d_head = d_model / n_heads``, causal attention, learned positions (``wpe``), and one
    of the activations of :data:`ACTIVATION_TO_HF`; its MLP width ``n_inner`` may be anything.
    """
    c = config
    problems = []
    if c.norm != "layernorm":
        problems.append(f"norm={c.norm!r} (GPT-2 has layer norms; write a Llama folder instead)")
    if c.mlp != "standard":
        problems.append(f"mlp={c.mlp!r} (GPT-2's MLP is expand, activation, contract)")
    if c.n_kv_heads != c.n_heads:
        problems.append(f"n_kv_heads={c.n_kv_heads} (GPT-2 has as many key/value heads as query heads, {c.n_heads})")
    if c.position_encoding != "learned":
        problems.append(f"position_encoding={c.position_encoding!r} (GPT-2 has learned positions only)")
    if not c.bias:
        problems.append("bias=False (GPT-2 has biases on every layer)")
    if not c.qkv_bias:
        problems.append("qkv_bias=False (GPT-2 has q, k, v biases: attn.c_attn.bias)")
    if c.n_heads * c.d_head != c.d_model or c.d_qk != c.d_head:
        problems.append(f"d_qk={c.d_qk}, d_head={c.d_head}, n_heads={c.n_heads}, d_model={c.d_model} "
                        "(GPT-2 needs d_qk = d_head = d_model / n_heads)")
    if not c.causal:
        problems.append("causal=False (GPT-2 is causal)")
    if c.logits_bias:
        problems.append("logits.bias exists (GPT-2's lm_head has no bias; use logits_bias=False or tied weights)")
    if c.activation not in ACTIVATION_TO_HF:
        problems.append(f"activation={c.activation!r} has no GPT-2 equivalent")
    return problems


def config_to_hf(config: GPTConfig, *, dtype: str = "float32", eos_token_id: int | None = None) -> dict:
    """The ``config.json`` dict of a ``GPT2LMHeadModel`` equal to ``config``.

    ``eos_token_id`` (e.g. the id of ``<|endoftext|>``) is written as both ``bos_token_id`` and
    ``eos_token_id``, as GPT-2 does; ``None`` writes ``null`` (GPT2Config's default 50256 could
    lie outside a small vocabulary). Dropout: ``resid_pdrop = embd_pdrop = config.dropout``,
    ``attn_pdrop = 0`` (pedestrian has no attention-probability dropout).

    Raises:
        ValueError: ``config`` is not expressible as GPT-2 (see :func:`export_problems`).
    """
    problems = export_problems(config)
    if problems:
        raise ValueError("this model cannot be written as a Hugging Face GPT-2: " + "; ".join(problems))
    c = config
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,
        "n_positions": c.context_length,
        "n_embd": c.d_model,
        "n_layer": c.n_blocks,
        "n_head": c.n_heads,
        "n_inner": None if c.d_mlp == 4 * c.d_model else c.d_mlp,
        "activation_function": ACTIVATION_TO_HF[c.activation],
        "layer_norm_epsilon": c.ln_eps,
        "tie_word_embeddings": c.tie_weights,
        "resid_pdrop": c.dropout,
        "embd_pdrop": c.dropout,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "initializer_range": 0.02,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "use_cache": True,
        "dtype": dtype,
    }

"""Read and write Hugging Face GPT-2 model directories, without ``transformers``.

A directory written by ``GPT2LMHeadModel.save_pretrained`` holds ``config.json``, the weights
(``model.safetensors``, a sharded ``model.safetensors.index.json``, or the older
``pytorch_model.bin``) and usually a tokenizer (``tokenizer.json``, or ``vocab.json`` +
``merges.txt``). Safetensors files are read with the ``safetensors`` library; a ``.bin`` file is
a pickle that only PyTorch can read, so it needs ``torch`` installed.

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

Tensors (HF name -> pedestrian name; HF's ``Conv1D`` stores ``(f_in, f_out)`` like pedestrian)::

    transformer.wte.weight (V, d)              tok_emb.weight
    transformer.wpe.weight (C, d)              pos_emb.weight
    transformer.h.{i}.ln_1.weight / .bias      blocks.{i}.ln1.weight / .bias
    transformer.h.{i}.attn.c_attn.weight (d, 3d)   columns [q | k | v] -> blocks.{i}.attn.q/k/v.weight
    transformer.h.{i}.attn.c_attn.bias (3d,)       the same split -> blocks.{i}.attn.q/k/v.bias
    transformer.h.{i}.attn.c_proj.*            blocks.{i}.attn_proj.*
    transformer.h.{i}.ln_2.*                   blocks.{i}.ln2.*
    transformer.h.{i}.mlp.c_fc.*               blocks.{i}.mlp_expand.*
    transformer.h.{i}.mlp.c_proj.*             blocks.{i}.mlp_contract.*
    transformer.ln_f.*                         ln_final.*
    lm_head.weight (V, d)                      logits.weight (d, V), transposed (untied only)

Head ``h`` of HF's attention is columns ``h·d_head … (h+1)·d_head`` of each of q, k, v, which is
pedestrian's layout too. Files of a bare ``GPT2Model`` (the names without ``transformer.``, as in
the original ``gpt2`` release) are read as well; the causal-mask buffers ``h.{i}.attn.bias`` and
``h.{i}.attn.masked_bias`` of old files are ignored. Loading is all-or-nothing: every name and
shape is checked first (for safetensors from the file headers, before any tensor data is read)
and one error lists every mismatch.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from ..atomic import atomic_dir
from ..config import GPTConfig, param_specs

__all__ = [
    "merged_for_export",
    "load_pretrained",
    "load_hf_model",
    "load_hf_tokenizer",
    "save_pretrained",
    "config_from_hf",
    "config_to_hf",
    "export_problems",
    "hf_tensor_shapes",
    "state_from_hf",
    "state_to_hf",
    "read_hf_config",
    "open_hf_weights",
    "SafetensorsFile",
    "write_dir_atomically",
    "OutputExistsError",
    "json_writer",
    "read_json_object",
    "listing",
    "torch_load",
]

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

_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")     # causal-mask buffers of old files
_PREFIX = "transformer."
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
_LIST_MAX = 20


def listing(items, limit: int = _LIST_MAX) -> str:
    """``"a, b, ... (N more)"``: the first ``limit`` items of a list for an error message."""
    items = list(items)
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


# ------------------------------------------------------------------------------------ config
def read_hf_config(hf_dir) -> dict:
    """The parsed ``config.json`` of a Hugging Face model directory.

    Raises:
        FileNotFoundError: ``hf_dir`` is not a directory or has no ``config.json``.
        ValueError: ``config.json`` is not a JSON object.
    """
    d = Path(hf_dir).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(f"Hugging Face model directory not found: {d} is not a directory; pass the folder of "
                                "a GPT-2 (config.json + weights), e.g. one downloaded with `hf download gpt2 "
                                "--local-dir gpt2`, saved with transformers' save_pretrained, or written by "
                                "`pedestrian export-hf`")
    path = d / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{d} is not a Hugging Face model directory: it has no config.json "
                                "(a GPT-2 saved with transformers' save_pretrained has one)")
    return read_json_object(path)


def read_json_object(path: Path) -> dict:
    """Parse a JSON file that must hold an object.

    Raises:
        ValueError: not UTF-8, not valid JSON, or not an object (the message names the file).
    """
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return cfg


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


# ------------------------------------------------------------------------------------ names
def hf_tensor_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name (``transformer.``-prefixed, plus ``lm_head.weight`` when untied) -> shape."""
    c = config
    d, qkv = c.d_model, 2 * c.n_heads * c.d_qk + c.n_heads * c.d_head
    out = {"transformer.wte.weight": (c.vocab_size, d), "transformer.wpe.weight": (c.context_length, d)}
    for i in range(c.n_blocks):
        h = f"transformer.h.{i}"
        out.update({f"{h}.ln_1.weight": (d,), f"{h}.ln_1.bias": (d,),
                    f"{h}.attn.c_attn.weight": (d, qkv), f"{h}.attn.c_attn.bias": (qkv,),
                    f"{h}.attn.c_proj.weight": (c.n_heads * c.d_head, d), f"{h}.attn.c_proj.bias": (d,),
                    f"{h}.ln_2.weight": (d,), f"{h}.ln_2.bias": (d,),
                    f"{h}.mlp.c_fc.weight": (d, c.d_mlp), f"{h}.mlp.c_fc.bias": (c.d_mlp,),
                    f"{h}.mlp.c_proj.weight": (c.d_mlp, d), f"{h}.mlp.c_proj.bias": (d,)})
    out.update({"transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)})
    if not c.tie_weights:
        out["lm_head.weight"] = (c.vocab_size, d)
    return out


#: per-block renames that are a plain copy: HF suffix -> pedestrian suffix
_BLOCK_COPY = {"ln_1": "ln1", "ln_2": "ln2", "attn.c_proj": "attn_proj", "mlp.c_fc": "mlp_expand",
               "mlp.c_proj": "mlp_contract"}


def _normalise_names(names, source: str) -> tuple[dict[str, str], list[str]]:
    """Map each file name to its ``transformer.``-prefixed form; report duplicates."""
    canon, problems = {}, []
    for name in names:
        full = name if name.startswith(_PREFIX) or name == "lm_head.weight" else _PREFIX + name
        if full in canon.values():
            problems.append(f"{name} appears both with and without the 'transformer.' prefix")
        canon[name] = full
    return canon, problems


def _check_hf_shapes(shapes: Mapping[str, tuple], config: GPTConfig, source: str) -> dict[str, str]:
    """Validate names and shapes against ``config``; returns file name -> canonical HF name.

    Raises:
        ValueError: every missing, unexpected or wrong-shaped tensor, in one message.
    """
    canon, problems = _normalise_names(shapes, source)
    expected = hf_tensor_shapes(config)
    present = {full: name for name, full in canon.items()}
    ignored = {name for name, full in canon.items() if _BUFFER.match(full[len(_PREFIX):])}
    optional = {"lm_head.weight"} if config.tie_weights else set()
    missing = [n for n in expected if n not in present]
    unexpected = [name for name, full in canon.items()
                  if full not in expected and name not in ignored and full not in optional]
    wrong = [f"{present[n]} {tuple(shapes[present[n]])} (config.json implies {shape})"
             for n, shape in expected.items() if n in present and tuple(shapes[present[n]]) != shape]
    if "lm_head.weight" in present and config.tie_weights:
        got = tuple(shapes["lm_head.weight"])
        if got != (config.vocab_size, config.d_model):
            wrong.append(f"lm_head.weight {got} (config.json implies {(config.vocab_size, config.d_model)})")
    if missing:
        problems.append(f"{len(missing)} missing: {listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {listing(unexpected)}")
    if wrong:
        problems.append(f"{len(wrong)} with the wrong shape: {listing(wrong)}")
    if problems:
        raise ValueError(
            f"{source} does not hold the GPT-2 that its config.json describes ("
            f"n_layer={config.n_blocks}, n_embd={config.d_model}, vocab_size={config.vocab_size}, "
            f"n_positions={config.context_length}, tie_word_embeddings={config.tie_weights}): "
            + "; ".join(problems)
            + ". Nothing was loaded. Use the config.json saved with these weights, or re-save the "
              "model with transformers' save_pretrained.")
    return {name: full for name, full in canon.items() if name not in ignored}


def state_from_hf(tensors: Mapping[str, np.ndarray], config: GPTConfig, *,
                  source: str = "the weights") -> dict[str, np.ndarray]:
    """HF GPT-2 tensors -> pedestrian parameters (names and layouts of the module table).

    Args:
        tensors: HF name -> ``np.ndarray`` (with or without the ``transformer.`` prefix).
        config: the pedestrian config (e.g. from :func:`config_from_hf`).
        source: how to name the tensors in error messages.

    Returns:
        pedestrian name -> array (views or copies; dtypes unchanged).

    Raises:
        ValueError: missing, unexpected or wrong-shaped tensors (all listed), or a tied
            ``lm_head.weight`` that differs from ``transformer.wte.weight``.
    """
    canon = _check_hf_shapes({k: np.shape(v) for k, v in tensors.items()}, config, source)
    t = {full: tensors[name] for name, full in canon.items()}
    return _convert_from_hf(t, config, source)


def _convert_from_hf(t: Mapping[str, np.ndarray], config: GPTConfig, source: str) -> dict:
    c = config
    hq, hv = c.n_heads * c.d_qk, c.n_heads * c.d_head
    cols = {"q": (0, hq), "k": (hq, 2 * hq), "v": (2 * hq, 2 * hq + hv)}
    out = {"tok_emb.weight": t["transformer.wte.weight"], "pos_emb.weight": t["transformer.wpe.weight"]}
    for i in range(c.n_blocks):
        h, p = f"transformer.h.{i}", f"blocks.{i}"
        for hf, ped in _BLOCK_COPY.items():
            for kind in ("weight", "bias"):
                out[f"{p}.{ped}.{kind}"] = t[f"{h}.{hf}.{kind}"]
        for part, (lo, hi) in cols.items():
            out[f"{p}.attn.{part}.weight"] = t[f"{h}.attn.c_attn.weight"][:, lo:hi]
            out[f"{p}.attn.{part}.bias"] = t[f"{h}.attn.c_attn.bias"][lo:hi]
    out["ln_final.weight"] = t["transformer.ln_f.weight"]
    out["ln_final.bias"] = t["transformer.ln_f.bias"]
    if not c.tie_weights:
        out["logits.weight"] = np.asarray(t["lm_head.weight"]).T
    elif "lm_head.weight" in t and not np.array_equal(t["lm_head.weight"], t["transformer.wte.weight"]):
        raise ValueError(f"{source}: config.json says tie_word_embeddings=true but lm_head.weight differs "
                         "from transformer.wte.weight. Nothing was loaded. Set tie_word_embeddings to "
                         "false in config.json if the model really has a separate lm_head.")
    return out


def state_to_hf(state: Mapping[str, object], config: GPTConfig) -> dict[str, np.ndarray]:
    """pedestrian parameters (or gradients, same names) -> HF GPT-2 tensors, ``transformer.``-prefixed.

    The inverse of :func:`state_from_hf`: q, k, v are concatenated into ``c_attn`` and an untied
    ``logits.weight`` is transposed into ``lm_head.weight``; arrays come back contiguous, in
    their own dtype. Tied models get no ``lm_head.weight`` (as ``save_pretrained`` writes them).

    Raises:
        ValueError: ``config`` is not expressible as GPT-2, or a parameter is missing.
    """
    problems = export_problems(config)
    if problems:
        raise ValueError("this model cannot be written as a Hugging Face GPT-2: " + "; ".join(problems))
    missing = [s.name for s in param_specs(config) if s.name not in state]
    if missing:
        raise ValueError(f"the state lacks parameters {listing(missing)}")
    from ..backend import to_numpy

    s = {k: np.asarray(to_numpy(v)) for k, v in state.items() if ".lora_" not in k}
    out = {"transformer.wte.weight": s["tok_emb.weight"], "transformer.wpe.weight": s["pos_emb.weight"]}
    for i in range(config.n_blocks):
        h, p = f"transformer.h.{i}", f"blocks.{i}"
        out[f"{h}.ln_1.weight"], out[f"{h}.ln_1.bias"] = s[f"{p}.ln1.weight"], s[f"{p}.ln1.bias"]
        out[f"{h}.attn.c_attn.weight"] = np.concatenate([s[f"{p}.attn.{x}.weight"] for x in "qkv"], axis=1)
        out[f"{h}.attn.c_attn.bias"] = np.concatenate([s[f"{p}.attn.{x}.bias"] for x in "qkv"])
        for hf, ped in _BLOCK_COPY.items():
            if hf.startswith("ln_"):
                continue
            out[f"{h}.{hf}.weight"], out[f"{h}.{hf}.bias"] = s[f"{p}.{ped}.weight"], s[f"{p}.{ped}.bias"]
        out[f"{h}.ln_2.weight"], out[f"{h}.ln_2.bias"] = s[f"{p}.ln2.weight"], s[f"{p}.ln2.bias"]
    out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = s["ln_final.weight"], s["ln_final.bias"]
    if not config.tie_weights:
        out["lm_head.weight"] = s["logits.weight"].T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


# ------------------------------------------------------------------------------------ weight files
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
_FLOAT_CODES = ("F64", "F32", "F16", "BF16")


#: bytes per element of the safetensors dtypes (the format's table), to locate a BF16 tensor
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "U16": 2, "I16": 2, "F16": 2,
                "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


class SafetensorsFile:
    """Names, shapes, dtypes and metadata of one ``.safetensors`` file, tensors read on demand,
    all through ``safetensors.safe_open`` (which validates the header: offsets in bounds,
    no overlaps, no holes).

    Attributes:
        path: the file. names: tensor names, in file (offset) order. shapes: name -> shape
        tuple. dtypes: name -> safetensors dtype code (``"F32"``, ``"BF16"``, ...).
        metadata: the ``__metadata__`` string dict (``{}`` if none).

    Raises:
        ValueError: the file cannot be opened or is not a valid safetensors file.
    """

    def __init__(self, path: Path):
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        try:
            with safe_open(str(path), framework="numpy") as f:
                self.names = list(f.offset_keys())
                self.metadata = dict(f.metadata() or {})
                slices = {k: f.get_slice(k) for k in self.names}
                self.shapes = {k: tuple(v.get_shape()) for k, v in slices.items()}
                self.dtypes = {k: v.get_dtype() for k, v in slices.items()}
        except (SafetensorError, OSError, ValueError) as exc:
            raise ValueError(f"{path} is not a safetensors file ({exc})") from None

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a NumPy array (BF16, which NumPy lacks, widened to float32)."""
        if self.dtypes[name] == "BF16":
            return self._bf16_as_float32(name)
        from safetensors import safe_open

        with safe_open(str(self.path), framework="numpy") as f:
            return f.get_tensor(name)

    def _bf16_as_float32(self, name: str) -> np.ndarray:
        # safe_open(framework="numpy") cannot build a bfloat16 array, so read the raw bits. The
        # format stores the tensors back to back in offset order, without holes, up to the end
        # of the file (safe_open has checked that), which places each one.
        sizes = {}
        for k in self.names:
            if self.dtypes[k] not in _ST_ITEMSIZE:
                raise ValueError(f"{self.path}: cannot read the BF16 tensor {name} beside a tensor of "
                                 f"dtype {self.dtypes[k]}")
            sizes[k] = _ST_ITEMSIZE[self.dtypes[k]] * int(np.prod(self.shapes[k], dtype=np.int64))
        start = self.path.stat().st_size - sum(sizes.values())
        for k in self.names:
            if k == name:
                break
            start += sizes[k]
        raw = np.fromfile(self.path, dtype="<u2", count=sizes[name] // 2, offset=start)
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(self.shapes[name])


class HFWeights:
    """The tensors of a model directory: names and shapes up front, data read on demand.

    Attributes:
        source: the file(s) the tensors come from (for messages).
        shapes: name -> shape; dtypes: name -> safetensors dtype string (``"F32"``, ...).
    """

    def __init__(self, source: str, shapes: dict, dtypes: dict, getter: Callable[[str], np.ndarray]):
        self.source, self.shapes, self.dtypes, self._get = source, shapes, dtypes, getter

    def __getitem__(self, name: str) -> np.ndarray:
        return self._get(name)


def torch_load(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a PyTorch pickle (``pytorch_model.bin``), as NumPy arrays (BF16 widened).

    Raises:
        ValueError: PyTorch is not installed, or the file cannot be read.
    """
    try:
        import torch
    except ImportError:
        raise ValueError(f"{path} is a PyTorch pickle, which only PyTorch can read: install torch "
                         "(pip install torch) or convert the model to model.safetensors") from None
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds on a corrupt file
        raise ValueError(f"could not read {path} with torch.load: {exc}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a state dict (got {type(state).__name__})")
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = (v.float() if v.dtype == torch.bfloat16 else v).detach().cpu().numpy()
    return out


def open_hf_weights(hf_dir) -> HFWeights:
    """The weights of a Hugging Face model directory, in the order ``transformers`` prefers:
    ``model.safetensors``, ``model.safetensors.index.json`` (shards), ``pytorch_model.bin``,
    ``pytorch_model.bin.index.json``.

    Raises:
        FileNotFoundError: none of those files (the message lists what the directory holds).
        ValueError: an unreadable file, or a ``.bin`` file without PyTorch installed.
    """
    d = Path(hf_dir).expanduser()
    st = d / "model.safetensors"
    if st.is_file():
        f = SafetensorsFile(st)
        return HFWeights(str(st), f.shapes, f.dtypes, f.get)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files, where = _read_index(index)
        shards = {name: SafetensorsFile(d / name) for name in files}
        shapes, dtypes = {}, {}
        for tensor, name in where.items():
            shard = shards[name]
            if tensor not in shard.shapes:
                raise ValueError(f"{index} places {tensor} in {name}, which does not hold it")
            shapes[tensor] = shard.shapes[tensor]
            dtypes[tensor] = shard.dtypes[tensor]
        return HFWeights(str(index), shapes, dtypes, lambda t: shards[where[t]].get(t))
    for name in ("pytorch_model.bin", "pytorch_model.bin.index.json"):
        p = d / name
        if p.is_file():
            if name.endswith(".json"):
                files, _ = _read_index(p)
                state = {}
                for shard in files:
                    state.update(torch_load(d / shard))
            else:
                state = torch_load(p)
            codes = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
            return HFWeights(str(p), {k: v.shape for k, v in state.items()},
                             {k: codes.get(v.dtype, str(v.dtype)) for k, v in state.items()},
                             state.__getitem__)
    have = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
    raise FileNotFoundError(f"{d} holds no model weights: expected one of {list(_WEIGHT_FILES)}, "
                            f"found {have}")


def _read_index(index: Path) -> tuple[list[str], dict[str, str]]:
    try:
        where = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{index} is not a weight index (needs a 'weight_map'): {exc}") from None
    files = sorted(set(where.values()))
    missing = [f for f in files if not (index.parent / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{index} refers to shard file(s) that do not exist: {missing}")
    return files, where


# ------------------------------------------------------------------------------------ loading
def load_hf_model(hf_dir, *, dtype: str = "float32", backend: str = "numpy"):
    """A pedestrian :class:`~pedestrian.model.GPT` holding a Hugging Face GPT-2's weights.

    Args:
        hf_dir: directory with ``config.json`` and the weights (see :func:`open_hf_weights`).
        dtype: ``"float32"`` or ``"float64"`` (the file's F16/BF16/F32 values are widened).
        backend: ``"numpy"`` or ``"torch"``.

    Returns:
        the model; its logits equal ``GPT2LMHeadModel``'s (float32: within 1e-5).

    Raises:
        FileNotFoundError: no directory, ``config.json`` or weights.
        ValueError: not GPT-2, unsupported settings, tensors that do not match the config, or
            weights that are NaN or ±inf (every problem listed; nothing is loaded).
    """
    from ..model import GPT

    config = config_from_hf(read_hf_config(hf_dir), source=str(Path(hf_dir) / "config.json"))
    weights = open_hf_weights(hf_dir)
    canon = _check_hf_shapes(weights.shapes, config, weights.source)
    bad = [f"{k} ({weights.dtypes[k]})" for k in canon if weights.dtypes[k] not in _FLOAT_CODES]
    if bad:
        raise ValueError(f"{weights.source}: tensors that are not floating point: {listing(bad)}")
    tensors = {full: weights[name] for name, full in canon.items()}
    state = _convert_from_hf(tensors, config, weights.source)
    model = GPT(config, dtype=dtype, backend=backend)
    try:
        model.load_state_dict(state, strict=True)
    except ValueError as exc:                       # e.g. a NaN weight: name the file it is in
        raise ValueError(f"{weights.source}: {exc}") from None
    return model


def load_hf_tokenizer(hf_dir):
    """The tokenizer of a Hugging Face model directory (byte-level BPE, as GPT-2).

    Looks for ``tokenizer.json``, then ``vocab.json`` + ``merges.txt``, then the
    ``pedestrian_tokenizer.json`` that :func:`save_pretrained` writes for a character tokenizer.

    Raises:
        FileNotFoundError: none of those files.
        ValueError: a file ``tokenizers`` cannot read, or one that is not byte-level BPE.
    """
    from ..tokenizer import BPETokenizer, load_tokenizer

    d = Path(hf_dir).expanduser()
    if (d / "tokenizer.json").is_file():
        return BPETokenizer.from_file(d / "tokenizer.json")
    if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        return BPETokenizer.from_vocab_merges(d / "vocab.json", d / "merges.txt")
    if (d / "pedestrian_tokenizer.json").is_file():
        return load_tokenizer(d / "pedestrian_tokenizer.json")
    raise FileNotFoundError(f"{d} has no tokenizer: expected tokenizer.json, or vocab.json and "
                            "merges.txt (copy them from the model the weights came from)")


def load_pretrained(hf_dir, *, dtype: str = "float32", backend: str = "numpy"):
    """Load a Hugging Face GPT-2 directory: ``(GPT, tokenizer)``.

    See :func:`load_hf_model` (weights and config) and :func:`load_hf_tokenizer`.

    Raises:
        FileNotFoundError: no directory, ``config.json``, weights or tokenizer files.
        ValueError: not GPT-2, unsupported settings, mismatching tensors (all listed), or a
            tokenizer with more ids than the model's ``vocab_size``.
    """
    config = config_from_hf(read_hf_config(hf_dir), source=str(Path(hf_dir) / "config.json"))
    tokenizer = load_hf_tokenizer(hf_dir)          # cheap: fail before reading the weights
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer in {hf_dir} has {tokenizer.vocab_size} ids but the model's "
                         f"vocab_size is {config.vocab_size}; the tokenizer belongs to another model")
    return load_hf_model(hf_dir, dtype=dtype, backend=backend), tokenizer


# ------------------------------------------------------------------------------------ saving
class OutputExistsError(ValueError):
    """The output folder ``path`` exists and holds files, and replacing them was not allowed.

    ``str()`` names the Python argument (``overwrite=True``); :meth:`advice` words it for another
    caller (the ``export-hf`` command names its ``--overwrite`` flag)."""

    def __init__(self, path: Path):
        self.path = path
        super().__init__(self.advice("pass overwrite=True"))

    def advice(self, how: str) -> str:
        """The message with ``how`` as the way to allow it (``"pass --overwrite"``)."""
        return f"{self.path} already exists and is not empty; choose a new directory or {how} to replace the files written here"


def write_dir_atomically(out_dir, writers: Mapping[str, Callable[[Path], None]], *,
                         overwrite: bool = False, conflicts=(), what: str = "the model directory") -> Path:
    """Write files into ``out_dir`` so that a failure leaves nothing half-written.

    Every file is first written into a temporary folder next to ``out_dir``
    (:func:`pedestrian.atomic.atomic_dir` with ``merge=True``); a new ``out_dir`` is then
    renamed into place in one step, an existing one gets each file by ``os.replace`` (its other
    files stay).

    Args:
        writers: file name -> function writing that file to the path it is given.
        overwrite: allow an existing non-empty ``out_dir`` (only the files written are replaced).
        conflicts: file names that must not remain beside the new files (e.g. other weight
            files that would shadow them); their presence is an error.
        what: how to name the folder in an error message.

    Raises:
        OutputExistsError (a ``ValueError``): ``out_dir`` is non-empty and ``overwrite`` is false.
        ValueError: ``out_dir`` holds a conflict.
        NotADirectoryError: ``out_dir`` is a file.
        WriteError (an ``OSError``): the OS refused the write (no space, file too large, no
            permission, read-only); ``out_dir`` is left as it was.
    """
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} exists and is not a directory; choose another output path")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise OutputExistsError(out)
        stale = [n for n in conflicts if n not in writers and (out / n).exists()]
        if stale:
            raise ValueError(f"{out} holds {stale}, which would be mixed with the new files; "
                             "remove them or choose another directory")
    with atomic_dir(out, what=what, merge=True) as tmp:
        for name, write in writers.items():
            write(tmp / name)
    return out


def json_writer(obj) -> Callable[[Path], None]:
    """A writer for :func:`write_dir_atomically`: ``obj`` as indented JSON."""
    return lambda p: p.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def tokenizer_writers(tokenizer, context_length: int) -> dict[str, Callable[[Path], None]]:
    """Files that describe ``tokenizer`` in a Hugging Face directory.

    A :class:`~pedestrian.tokenizer.BPETokenizer` becomes ``tokenizer.json`` (plus
    ``vocab.json``/``merges.txt`` and a ``tokenizer_config.json`` naming ``GPT2Tokenizer``); a
    character tokenizer, which GPT-2 has no format for, becomes ``pedestrian_tokenizer.json``.
    """
    from ..tokenizer import BPETokenizer

    if tokenizer is None:
        return {}
    if not isinstance(tokenizer, BPETokenizer):
        return {"pedestrian_tokenizer.json": tokenizer.save}

    def vocab_merges(name):
        def write(p: Path):                  # the model saves both files: keep the one asked for
            for f in map(Path, tokenizer.hf.model.save(str(p.parent), f".{name}")):
                if f.name.endswith(f"-{name}"):
                    os.replace(f, p)
                else:
                    f.unlink()
        return write

    special = tokenizer.special_tokens
    eot = "<|endoftext|>" if "<|endoftext|>" in special else None
    tok_config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": context_length,
                  "add_prefix_space": False, "bos_token": eot, "eos_token": eot, "unk_token": eot}
    return {"tokenizer.json": lambda p: tokenizer.hf.save(str(p)),
            "vocab.json": vocab_merges("vocab.json"), "merges.txt": vocab_merges("merges.txt"),
            "tokenizer_config.json": json_writer(tok_config)}


def save_pretrained(model, out_dir, tokenizer=None, *, overwrite: bool = False) -> Path:
    """Write ``model`` (and ``tokenizer``) as a Hugging Face GPT-2 directory.

    ``GPT2LMHeadModel.from_pretrained(out_dir)`` then gives the same logits, and
    :func:`load_pretrained` gives back exactly the same parameters. Files: ``config.json``
    (:func:`config_to_hf`), ``model.safetensors`` (the model's dtype; tied models without
    ``lm_head.weight``, as ``transformers`` writes them) and the tokenizer files of
    :func:`tokenizer_writers`. Writing is atomic (see :func:`write_dir_atomically`).

    Args:
        model: a :class:`~pedestrian.model.GPT` without LoRA adapters.
        tokenizer: optional; its ``<|endoftext|>`` id becomes ``bos/eos_token_id``.
        overwrite: replace the files in an existing non-empty directory.

    Raises:
        ValueError: the model has adapters (merge them with ``merge_lora()`` or write them with
            :func:`pedestrian.interop.peft.save_peft_adapter`), a config GPT-2 cannot express,
            a tokenizer with more ids than ``vocab_size``, or an output problem.
        WriteError (an ``OSError``): the OS refused the write (no space, file too large, no
            permission, read-only); ``out_dir`` is left as it was.
    """
    from safetensors.numpy import save_file

    if model.lora_targets:
        raise ValueError("the model has LoRA adapters; merge them first (model.merge_lora()) or write "
                         "them separately as a PEFT adapter (pedestrian.interop.peft.save_peft_adapter)")
    config = model.config
    eos = None
    if tokenizer is not None:
        if tokenizer.vocab_size > config.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size "
                             f"is {config.vocab_size}")
        eos = getattr(tokenizer, "special_tokens", {}).get("<|endoftext|>")
    hf_config = config_to_hf(config, dtype=model.dtype_name, eos_token_id=eos)
    tensors = state_to_hf(model.state_dict(), config)
    writers = {"config.json": json_writer(hf_config),
               "model.safetensors": lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
               **tokenizer_writers(tokenizer, config.context_length)}
    return write_dir_atomically(out_dir, writers, overwrite=overwrite, conflicts=_WEIGHT_FILES)


def merged_for_export(model):
    """A copy of ``model`` with its LoRA adapters merged, ready for :func:`save_pretrained`.

    ``W ← W + α D U`` for every adapted layer, each with its own ``α`` (paper section 6;
    ``model`` itself is not changed). A LoRA on *tied* logits (GPT-2 ties ``lm_head`` to ``wte``) cannot be merged
    into ``tok_emb.weight`` without changing the embedding lookup too, so the copy is
    **untied** instead: ``tie_weights=False`` (HF ``tie_word_embeddings=false``), the token
    embedding unchanged, and ``logits.weight = W_tokᵀ + α D U`` of shape ``(d_model, V)``
    (HF ``lm_head.weight = wte + (α D U)ᵀ``, ``(V, d_model)``, no bias). The copy gives the
    same logits as the adapted model.

    Args:
        model: a :class:`~pedestrian.model.GPT` (with or without adapters).

    Returns:
        a new :class:`~pedestrian.model.GPT` without adapters, same dtype, NumPy backend.

    Raises:
        ValueError: the merged parameters do not fit the (untied) config (a bug).
    """
    import dataclasses

    from ..model import GPT

    state = {k: np.asarray(v, dtype=np.float64) for k, v in model.state_dict().items()}
    config = model.config
    targets = list(model.lora_targets or [])
    if "logits" in targets and config.tie_weights:
        config = dataclasses.replace(config, tie_weights=False, logits_bias=False)
        state["logits.weight"] = state["tok_emb.weight"].T.copy()
    for fc in targets:
        state[f"{fc}.weight"] = state[f"{fc}.weight"] + model.lora_alphas[fc] * (
            state.pop(f"{fc}.lora_D") @ state.pop(f"{fc}.lora_U"))
    out = GPT(config, dtype=model.dtype_name)
    out.load_state_dict(state, strict=True)
    return out

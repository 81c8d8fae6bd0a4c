"""Hugging Face GPT-2 tensors <-> pedestrian parameters: names, shapes and layouts.

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

import re
from typing import Mapping

import numpy as np

from ..config import GPTConfig
from ..model.layout import param_specs
from .files import listing
from .hf_config import export_problems

_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")     # causal-mask buffers of old files
_PREFIX = "transformer."


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


def check_hf_shapes(shapes: Mapping[str, tuple], config: GPTConfig, source: str) -> dict[str, str]:
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
    canon = check_hf_shapes({k: np.shape(v) for k, v in tensors.items()}, config, source)
    t = {full: tensors[name] for name, full in canon.items()}
    return convert_from_hf(t, config, source)


def convert_from_hf(t: Mapping[str, np.ndarray], config: GPTConfig, source: str) -> dict:
    """:func:`state_from_hf` after :func:`check_hf_shapes`: ``t`` holds the canonical
    (``transformer.``-prefixed) names, already checked against ``config``."""
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

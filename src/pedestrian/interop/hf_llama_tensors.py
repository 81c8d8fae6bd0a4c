"""Hugging Face Llama-layout tensors (Llama, Qwen2, Mistral, ...) <-> pedestrian parameters:
names, shapes, layouts. A block's module names are its family's (:attr:`.families.Family.names`);

Tensors (Llama's HF name -> pedestrian name; ``nn.Linear`` stores ``(f_out, f_in)``, pedestrian
``(f_in, f_out)``: every linear weight is transposed, embeddings and norms are copied)::

    model.embed_tokens.weight (V, d)                          tok_emb.weight (V, d)
    model.layers.{i}.input_layernorm.weight (d,)              blocks.{i}.ln1.weight
    model.layers.{i}.self_attn.q_proj.weight (H·dh, d)        blocks.{i}.attn.q.weight (d, H·dh)
    model.layers.{i}.self_attn.k_proj.weight (Hkv·dh, d)      blocks.{i}.attn.k.weight (d, Hkv·dh)
    model.layers.{i}.self_attn.v_proj.weight (Hkv·dh, d)      blocks.{i}.attn.v.weight (d, Hkv·dh)
    model.layers.{i}.self_attn.{q,k,v}_proj.bias              blocks.{i}.attn.{q,k,v}.bias (Qwen2)
    model.layers.{i}.self_attn.o_proj.weight (d, H·dh)        blocks.{i}.attn_proj.weight (H·dh, d)
    model.layers.{i}.post_attention_layernorm.weight (d,)     blocks.{i}.ln2.weight
    model.layers.{i}.mlp.gate_proj.weight (m, d)              blocks.{i}.mlp_gate.weight (d, m)
    model.layers.{i}.mlp.up_proj.weight (m, d)                blocks.{i}.mlp_expand.weight (d, m)
    model.layers.{i}.mlp.down_proj.weight (d, m)              blocks.{i}.mlp_contract.weight (m, d)
    model.norm.weight (d,)                                    ln_final.weight
    lm_head.weight (V, d)                                     logits.weight (d, V) (untied only)

plus ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj`` biases for a Llama with
``attention_bias`` and ``mlp_bias`` (pedestrian ``bias=True``). Head ``h`` is rows
``h·dh … (h+1)·dh`` of HF's q (k, v: key/value head ``h``), columns ``h·dh …`` of pedestrian's;
query head ``h`` reads key/value head ``h // (H / Hkv)`` in both (HF's ``repeat_kv``). HF's
RoPE turns feature pairs ``(j, j + dh/2)`` (``rotate_half``), as :mod:`pedestrian.layers.rope`
does, so no row of q or k is permuted. A tied folder usually has no ``lm_head.weight``; if it
has one it must equal the embedding. Every name and shape is checked before anything is
converted, and one error lists every mismatch.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..config import GPTConfig
from ..model.layout import param_specs
from .files import listing
from .families import FAMILIES, TOP_NAMES, hf_block_name
from .hf_llama_config import export_family

_P = "model.layers"


def _names(config: GPTConfig, family: str | None = None) -> list[tuple[str, str, bool]]:
    """``(hf name, pedestrian name, transposed)`` for every pedestrian parameter, in order: the
    block layers named by ``family`` (a folder's), else by the family that writes ``config``
    (:attr:`.families.Family.names`)."""
    rename = FAMILIES[family or export_family(config)].names
    out = []
    for s in param_specs(config):
        if s.name in TOP_NAMES:
            out.append((TOP_NAMES[s.name], s.name, s.name == "logits.weight"))
            continue
        _, i, rest = s.name.split(".", 2)
        layer, kind = rest.rsplit(".", 1)
        hf = hf_block_name(rename, layer)
        if hf is None:
            raise ValueError(f"{s.name} has no Hugging Face name in the {family or export_family(config)} family")
        out.append((f"{_P}.{i}.{hf}.{kind}", s.name, kind == "weight" and len(s.shape) == 2))
    return out


def hf_llama_shapes(config: GPTConfig, family: str | None = None) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for a Llama-family ``config`` (``lm_head.weight`` when untied).

    Raises:
        ValueError: ``config`` is not a Llama-family model
            (:func:`~pedestrian.interop.hf_llama_config.export_family`).
    """
    export_family(config)
    shapes = {s.name: s.shape for s in param_specs(config)}
    return {hf: shapes[ped][::-1] if t else shapes[ped] for hf, ped, t in _names(config, family)}


def check_llama_shapes(shapes: Mapping[str, tuple], config: GPTConfig, source: str, family: str | None = None) -> None:
    """Every missing, unexpected or wrong-shaped tensor of ``shapes`` (file name -> shape), in
    one ``ValueError``; a tied ``lm_head.weight`` may be present."""
    expected = hf_llama_shapes(config, family)
    if config.tie_weights:
        expected_opt = {"lm_head.weight": (config.vocab_size, config.d_model)}
    else:
        expected_opt = {}
    missing = [n for n in expected if n not in shapes]
    unexpected = [n for n in shapes if n not in expected and n not in expected_opt]
    wrong = [f"{n} {tuple(shapes[n])} (config.json implies {s})" for n, s in {**expected, **expected_opt}.items()
             if n in shapes and tuple(shapes[n]) != tuple(s)]
    problems = [f"{len(x)} {what}: {listing(x)}" for x, what in
                ((missing, "missing"), (unexpected, "unexpected"), (wrong, "with the wrong shape")) if x]
    if problems:
        raise ValueError(f"{source} does not hold the model its config.json describes (num_hidden_layers="
                         f"{config.n_blocks}, hidden_size={config.d_model}, num_attention_heads={config.n_heads}, "
                         f"num_key_value_heads={config.n_kv_heads}, head_dim={config.d_head}, "
                         f"tie_word_embeddings={config.tie_weights}): " + "; ".join(problems)
                         + ". Nothing was loaded.")


def llama_state_from_hf(tensors: Mapping[str, np.ndarray], config: GPTConfig, *,
                        source: str = "the weights", family: str | None = None) -> dict[str, np.ndarray]:
    """HF Llama / Qwen2 / Mistral tensors -> pedestrian parameters (the module table).

    Args:
        tensors: HF name -> array (any float dtype; BF16 files come widened by
            :class:`~pedestrian.interop.files.SafetensorsFile`).
        config: the pedestrian config (:func:`~pedestrian.interop.hf_llama_config.config_from_hf`).
        source: how to name the tensors in error messages.
        family: the folder's family (its names); ``None``: the one that writes ``config``.

    Returns:
        pedestrian name -> array (transposed views or the arrays themselves; dtypes unchanged).

    Raises:
        ValueError: missing, unexpected or wrong-shaped tensors (all listed), or a tied
            ``lm_head.weight`` that differs from ``model.embed_tokens.weight``.
    """
    check_llama_shapes({k: np.shape(v) for k, v in tensors.items()}, config, source, family)
    return convert_llama_from_hf(tensors, config, source, family)


def convert_llama_from_hf(tensors: Mapping[str, np.ndarray], config: GPTConfig, source: str,
                          family: str | None = None) -> dict:
    """:func:`llama_state_from_hf` after :func:`check_llama_shapes`: the tied ``lm_head.weight``
    checked, the tensors renamed (and transposed where the module table says)."""
    if (config.tie_weights and "lm_head.weight" in tensors
            and not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])):
        raise ValueError(f"{source}: config.json says tie_word_embeddings=true but lm_head.weight differs from "
                         "model.embed_tokens.weight. Nothing was loaded. Set tie_word_embeddings to false if "
                         "the model really has a separate lm_head.")
    return {ped: np.asarray(tensors[hf]).T if t else tensors[hf] for hf, ped, t in _names(config, family)}


def llama_state_to_hf(state: Mapping[str, object], config: GPTConfig) -> dict[str, np.ndarray]:
    """pedestrian parameters (or gradients, same names) -> HF Llama-family tensors, contiguous, in
    their own dtype; LoRA adapters are left out, a tied model gets no ``lm_head.weight`` (as
    ``save_pretrained`` writes it). The inverse of :func:`llama_state_from_hf`.

    Raises:
        ValueError: a parameter is missing, or ``config`` is not a Llama-family model.
    """
    from ..backend import to_numpy

    hf_llama_shapes(config)
    names = _names(config)
    missing = [ped for _, ped, _ in names if ped not in state]
    if missing:
        raise ValueError(f"the state lacks parameters {listing(missing)}")
    return {hf: np.ascontiguousarray(np.asarray(to_numpy(state[ped])).T if t else np.asarray(to_numpy(state[ped])))
            for hf, ped, t in names}

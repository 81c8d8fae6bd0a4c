"""PEFT's module names <-> pedestrian's FC layers, and PEFT's per-module rank and scaling rules
(what :mod:`pedestrian.interop.peft` reads and writes by).

Modules (HF GPT-2 -> pedestrian FC layer)::

    transformer.h.{i}.attn.c_attn  -> blocks.{i}.attn.q, .k, .v   (output columns [q | k | v])
    transformer.h.{i}.attn.c_proj  -> blocks.{i}.attn_proj
    transformer.h.{i}.mlp.c_fc     -> blocks.{i}.mlp_expand
    transformer.h.{i}.mlp.c_proj   -> blocks.{i}.mlp_contract
    lm_head                        -> logits

Modules (HF Llama / Qwen2 / Mistral -> pedestrian FC layer; one module per layer, ``nn.Linear``)::

    model.layers.{i}.self_attn.q_proj / k_proj / v_proj  -> blocks.{i}.attn.q / .k / .v
    model.layers.{i}.self_attn.o_proj                    -> blocks.{i}.attn_proj
    model.layers.{i}.mlp.gate_proj / up_proj / down_proj -> blocks.{i}.mlp_gate / mlp_expand / mlp_contract
    lm_head                                              -> logits

(with grouped-query attention the k and v adapters have ``n_kv_heads · head_dim`` output
columns, as the modules). The family is the base config's (:func:`is_gpt2`): GPT-2 when it is
GPT-2-shaped, else the Llama-layout family that writes it (:func:`~.families.family_names`).
"""

from __future__ import annotations

import math
import re
from typing import Mapping

import numpy as np

from ..config import GPTConfig
from ..model.layout import fc_layers
from .families import block_layer, family_names, hf_block_name, layout_of

__all__ = ["is_gpt2", "peft_module", "fc_of_module", "pattern_value", "peft_scaling", "fuse", "unfuse",
           "recorded_alpha", "written_parts"]


_MODULE = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)$")
_HF_TO_FC = {"attn.c_proj": "attn_proj", "mlp.c_fc": "mlp_expand", "mlp.c_proj": "mlp_contract"}
_FC_TO_HF = {v: k for k, v in _HF_TO_FC.items()}
_LLAMA_MODULE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def is_gpt2(config: GPTConfig) -> bool:
    """Whether PEFT names ``config``'s modules as GPT-2's (else by its Llama-layout family's
    :attr:`~.families.Family.names`)."""
    return layout_of(config) == "gpt2"


def peft_module(fc: str, config: GPTConfig | None = None) -> tuple[str, str | None]:
    """pedestrian FC layer -> ``(PEFT module name, part of c_attn or None)``.

    GPT-2 (``config`` None or GPT-2-shaped): ``"blocks.0.attn.k"`` ->
    ``("transformer.h.0.attn.c_attn", "k")``; Llama family: ``"blocks.0.attn.k"`` ->
    ``("model.layers.0.self_attn.k_proj", None)``; ``"logits"`` -> ``("lm_head", None)``.
    """
    if fc == "logits":
        return "lm_head", None
    _, i, rest = fc.split(".", 2)
    if config is not None and not is_gpt2(config):
        return f"model.layers.{i}.{hf_block_name(family_names(config), rest)}", None
    if rest.startswith("attn."):
        return f"transformer.h.{i}.attn.c_attn", rest[len("attn."):]
    return f"transformer.h.{i}.{_FC_TO_HF[rest]}", None


def pattern_value(patterns: Mapping, module: str, default):
    """PEFT's rule (``peft.utils.other.get_pattern_key``): the first key ``k`` for which
    ``re.match(rf"(.*\\.)?({k})$", module)`` matches gives the value."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def peft_scaling(peft_config: Mapping, module: str, rank: int) -> float:
    """PEFT's ``scaling`` of one module: ``lora_alpha / r`` (``/ √r`` with ``use_rslora``),
    with ``alpha_pattern`` applied; this is pedestrian's ``α`` for that module."""
    alpha = pattern_value(peft_config.get("alpha_pattern"), module, peft_config.get("lora_alpha", 8))
    denom = math.sqrt(rank) if peft_config.get("use_rslora") else rank
    return float(alpha) / denom


def fc_of_module(module: str, config: GPTConfig) -> list[str] | None:
    """PEFT module name -> the pedestrian FC layers it adapts (three for GPT-2's ``c_attn``: q, k, v),
    or ``None`` for a name that is not a module of ``config``'s base (the inverse of :func:`peft_module`)."""
    if module in ("lm_head",):
        return ["logits"]
    if not is_gpt2(config):
        m = _LLAMA_MODULE.match(module)
        fc = block_layer(family_names(config), m.group(2)) if m else None
        name = f"blocks.{m.group(1)}.{fc}" if fc is not None else None
        return [name] if name is not None and name in {n for n, _, _ in fc_layers(config)} else None
    m = _MODULE.match(module)
    if m is None or int(m.group(1)) >= config.n_blocks:
        return None
    i, kind = int(m.group(1)), m.group(2)
    if kind == "attn.c_attn":
        return [f"blocks.{i}.attn.{p}" for p in "qkv"]
    return [f"blocks.{i}.{_HF_TO_FC[kind]}"]


# --------------------------------------------------------------- one PEFT adapter over several layers
# GPT-2's c_attn (q, k, v) and an expert's gate_up_proj (mlp_gate, mlp_expand): PEFT adapts one module
# or parameter whose output rows are several pedestrian layers' (``cols``: part -> its rows).
def fuse(P: Mapping, members, cols: Mapping, n_out: int, ranks: Mapping, alphas: Mapping):
    """``(A, B, scaling)``: the one PEFT adapter of rank ``R = Σ r`` holding the adapters of
    ``members`` ``[(layer, part)]`` (``P``: their ``.lora_D`` / ``.lora_U`` arrays). ``A (R, f_in)``
    stacks their ``Dᵀ``; ``B (n_out, R)`` is block-diagonal, each ``Uᵀ`` in its part's rows and its own
    columns; the one scaling is the first member's ``α``, another member's ratio folded into its block."""
    scaling = alphas[members[0][0]]
    A = np.concatenate([P[f"{fc}.lora_D"].T for fc, _ in members], axis=0)
    B = np.zeros((n_out, A.shape[0]), dtype=A.dtype)
    start = 0
    for fc, part in members:
        (lo, hi), r, U_T = cols[part], ranks[fc], P[f"{fc}.lora_U"].T
        B[lo:hi, start:start + r] = U_T if alphas[fc] == scaling else U_T * (alphas[fc] / scaling)
        start += r
    return A, B, scaling


def written_parts(layout: Mapping, record: str, module: str, layer_of: Mapping) -> list[tuple[str, int, str]]:
    """``[(layer, rank, part)]`` of a fused adapter :func:`fuse` wrote (``layout[record][module]``: its
    parts in order; ``layer_of``: part -> layer), ``[]`` for a file without that record."""
    parts = (layout.get(record) or {}).get(module)
    if not isinstance(parts, list) or not all(p in layer_of for p in parts):
        return []
    ranks, out = layout.get("ranks") or {}, []
    for part in parts:
        r = ranks.get(layer_of[part], layout.get("rank"))
        if not isinstance(r, int) or r < 1:
            return []
        out.append((layer_of[part], r, part))
    return out


def recorded_alpha(layout: Mapping, fc: str, scaling: float) -> float:
    """The layer's ``α`` as pedestrian recorded it, if that is PEFT's ``scaling`` up to the
    rounding of ``α·r / r`` (a file edited since is read by its config), else ``scaling``."""
    recorded = (layout.get("alphas") or {}).get(fc, layout.get("alpha"))
    if isinstance(recorded, (int, float)) and math.isclose(recorded, scaling, rel_tol=1e-12):
        return float(recorded)
    return scaling


def unfuse(A, B, written, layer_of: Mapping, cols: Mapping, layout: Mapping, scaling: float) -> dict:
    """``{layer: (D, U, α)}`` from one fused PEFT adapter ``A (R, f_in)``, ``B (n_out, R)``. With
    ``written`` (:func:`written_parts`) whose ranks add up to ``R`` and a ``B`` zero outside their
    blocks, the very adapters :func:`fuse` wrote (their recorded ``α`` while the scaling is still the
    first one's); else every layer of ``layer_of`` gets ``D = Aᵀ`` and its rows of ``B``, exactly."""
    blocks = np.ones(B.shape, dtype=bool)
    start = 0
    for _, r, part in written:
        lo, hi = cols[part]
        blocks[lo:hi, start:start + r] = False
        start += r
    if not (written and start == A.shape[0] and not np.any(B[blocks])):
        return {fc: (A.T, B[slice(*cols[part])].T, scaling) for part, fc in layer_of.items()}
    alphas = [(layout.get("alphas") or {}).get(fc, layout.get("alpha")) for fc, _, _ in written]
    if not (all(isinstance(a, (int, float)) and math.isfinite(a) and a != 0 for a in alphas)
            and math.isclose(alphas[0], scaling, rel_tol=1e-12)):
        alphas = [scaling] * len(written)     # (a file edited since: the module's scaling for every part)
    out, start = {}, 0
    for (fc, r, part), alpha in zip(written, alphas):
        U = B[slice(*cols[part]), start:start + r].T
        out[fc] = (A[start:start + r].T, U if alpha == alphas[0] else U * (alphas[0] / alpha), float(alpha))
        start += r
    return out

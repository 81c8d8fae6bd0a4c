"""PEFT adapters on a mixture's experts (``target_parameters``), both ways.

transformers 5 keeps a block's experts as two 3-D parameters of one module,
``model.layers.{i}.mlp.experts``: ``gate_up_proj`` ``(E, 2m, d)`` (rows ``[gate | up]``) and
``down_proj`` ``(E, d, m)`` (Mixtral, Qwen3-MoE and OLMoE alike). PEFT 0.21 adapts such a parameter
when ``adapter_config.json``'s ``target_parameters`` names it (``peft.tuners.lora.layer.ParamWrapper``):
one rank ``R`` and one scaling for all ``E`` experts, ``lora_A`` ``(R·E, f_in)``, ``lora_B``
``(f_out, R·E)``, expert ``e``'s update ``scaling · B_e A_e`` with ``A_e = lora_A[e·R:(e+1)·R]`` and
``B_e = lora_B[:, e::E]`` (PEFT reshapes ``lora_A`` to ``(E, R, f_in)`` and ``lora_B`` to
``(f_out, R, E)``). The rank and scaling come from ``rank_pattern`` / ``alpha_pattern`` under the
parameter's name, as a module's. Two parameters of one module nest: the one registered first
(``gate_up_proj``) is wrapped first, so its tensors are named ``experts.base_layer.lora_A`` /
``lora_B``, the other's ``experts.lora_A`` / ``lora_B`` (one parameter alone: ``experts.lora_A``).
PEFT takes no ``lora_dropout`` on a parameter.

pedestrian's expert ``e`` of block ``i`` has three layers with an adapter each,
``blocks.{i}.experts.{e}.mlp_gate`` / ``mlp_expand`` / ``mlp_contract`` (``D (f_in, r)``,
``U (r, f_out)``, ``α``), so, as GPT-2's ``c_attn`` (:mod:`.peft`):

- export: an expert's gate and up adapters become its part of one ``gate_up_proj`` adapter of rank
  ``R = r_gate + r_up`` (:func:`.peft_modules.fuse`: ``A_e`` stacks their ``Dᵀ``, ``B_e`` is
  block-diagonal in their ``Uᵀ``, another ``α`` folded into its block); ``down_proj``:
  ``A_e = D_downᵀ``, ``B_e = U_downᵀ``. Every expert of a block needs the same layers adapted with
  the same ranks (PEFT has one ``R`` per parameter), and the model no ``lora_dropout``.
- import: ``D_gate = D_up = A_eᵀ`` and ``U_gate``, ``U_up`` the row blocks of ``B_eᵀ`` (exact); a
  file written here gives back the adapters it was written from (its ``expert_parts`` record).
"""

from __future__ import annotations

import re
from typing import Mapping

import numpy as np

from .peft_modules import fuse, pattern_value, peft_scaling, unfuse, written_parts

__all__ = ["experts_to_peft", "experts_from_peft", "PeftRefused"]


class PeftRefused(ValueError):
    """Adapters PEFT files cannot hold as they are (what :func:`experts_to_peft` refuses)."""


#: the experts module's parameters in the order transformers registers them (PEFT's nesting order),
#: each with the pedestrian layers whose output rows it holds
PARAMETERS = {"gate_up_proj": ("mlp_gate", "mlp_expand"), "down_proj": ("mlp_contract",)}
_MODULE = "model.layers.{i}.mlp.experts"
_EXPERT = re.compile(r"^blocks\.(\d+)\.experts\.(\d+)\.(mlp_gate|mlp_expand|mlp_contract)$")


def _rows(config) -> dict:
    """part -> its rows of the parameter's output: ``gate_up_proj`` ``[gate | up]``, ``down_proj`` all."""
    m = config.d_expert
    return {"mlp_gate": (0, m), "mlp_expand": (m, 2 * m), "mlp_contract": (0, config.d_model)}


def _holder(i: int, name: str, targeted) -> str:
    """The module whose ``lora_A`` / ``lora_B`` hold parameter ``name``'s adapter in block ``i``
    (``targeted``: the block's adapted parameters; the first is wrapped innermost)."""
    inner = [p for p in PARAMETERS if p in targeted]
    return _MODULE.format(i=i) + ".base_layer" * (len(inner) - 1 - inner.index(name))


def experts_to_peft(model, P: Mapping, ranks: Mapping, alphas: Mapping) -> tuple[dict, dict, dict]:
    """``(adapters, holders, parts)`` of ``model``'s adapters on experts: ``adapters`` parameter name
    (``model.layers.{i}.mlp.experts.gate_up_proj``) -> ``(A, B, scaling)`` in PEFT's layout, ``holders``
    parameter -> the module its tensors are named under, ``parts`` parameter -> the layers fused in
    it, in order (the layout record). ``({}, {}, {})`` without such adapters.

    Raises:
        PeftRefused (a ``ValueError``): experts of a block adapted unlike each other (other layers or ranks), a
            ``lora_dropout`` (PEFT refuses it on parameters), or adapters on a dense MLP block of a model
            with experts (PEFT 0.21 reads ``gate_proj`` / ``up_proj`` / ``down_proj`` targets of such a
            model as its experts': ``peft.utils.transformers_weight_conversion``).
    """
    E, rows, adapted = model.config.n_experts, _rows(model.config), {}
    dense = [fc for fc in model.lora_targets if E and ".experts." not in fc and ".mlp_" in fc]
    if dense:                       # (peft.utils.transformers_weight_conversion._convert_peft_config_moe)
        raise PeftRefused(f"PEFT files cannot hold the adapters on this mixture's dense MLP blocks ({dense[0]}, "
                          "...): PEFT 0.21 reads gate_proj / up_proj / down_proj targets of a mixture-of-experts model as "
                          "its experts' (converting transformers 4 adapters) and would drop them; adapt the attention "
                          "and the experts only for PEFT files, or merge them (pedestrian export-hf --adapter)")
    for fc in model.lora_targets:
        match = _EXPERT.match(fc)
        if match:
            i, e, layer = int(match.group(1)), int(match.group(2)), match.group(3)
            adapted.setdefault(i, {}).setdefault(e, []).append(layer)
    if adapted and model.lora_dropout:
        raise PeftRefused(f"PEFT files cannot hold adapters on experts with lora_dropout={model.lora_dropout}: "
                          "PEFT adapts a block's experts as one parameter, which takes no dropout; fine-tune with "
                          "--lora-dropout 0 (in Python: set model.lora_dropout = 0 before writing, the weights are "
                          "the same), or merge them (pedestrian export-hf --adapter)")
    adapters, holders, parts = {}, {}, {}
    for i, by_expert in sorted(adapted.items()):
        shape = {e: [(layer, ranks[f"blocks.{i}.experts.{e}.{layer}"]) for layer in sorted(layers)]
                 for e, layers in by_expert.items()}
        if len(by_expert) != E or len({tuple(v) for v in shape.values()}) != 1:
            raise PeftRefused(f"PEFT files cannot hold block {i}'s expert adapters: PEFT adapts a block's {E} experts "
                              f"with one rank per parameter, and these differ by expert ({len(by_expert)} of {E} "
                              "adapted, or other layers or ranks); adapt every expert alike (--lora-targets gate_proj "
                              "up_proj down_proj, add_lora(['mlp_gate', ...]) in Python), or merge them (pedestrian "
                              "export-hf --adapter)")
        layers = by_expert[0]
        targeted = [name for name, of in PARAMETERS.items() if set(of) & set(layers)]
        for name in targeted:
            key = f"{_MODULE.format(i=i)}.{name}"
            members = [(layer, layer) for layer in PARAMETERS[name] if layer in layers]
            per_expert = [fuse(P, [(f"blocks.{i}.experts.{e}.{layer}", part) for layer, part in members],
                               rows, rows[PARAMETERS[name][-1]][1], ranks, alphas) for e in range(E)]
            scaling = per_expert[0][2]
            A = np.concatenate([a for a, _, _ in per_expert], axis=0)                  # (E·R, f_in)
            B = np.stack([b * (s / scaling) if s != scaling else b for _, b, s in per_expert], axis=2)  # (f_out, R, E)
            adapters[key] = (A, B.reshape(B.shape[0], -1), scaling)                    # (f_out, R·E)
            holders[key] = _holder(i, name, targeted)
            parts[key] = [layer for layer, _ in members]
    return adapters, holders, parts


def experts_from_peft(peft_config: Mapping, modules: dict, config, layout: Mapping, problems: list) -> dict:
    """``{layer: (D, U, α)}`` of a PEFT file's adapters on experts; takes their entries out of
    ``modules`` (module name -> ``{"lora_A", "lora_B"}``) and appends what does not fit to
    ``problems``. The parameters adapted are those ``target_parameters`` names (PEFT's rule: the
    full name, or a suffix of it after a dot)."""
    entries, before = peft_config.get("target_parameters") or [], len(problems)
    if not isinstance(entries, list) or not all(isinstance(t, str) for t in entries):
        problems.append(f"target_parameters={entries!r} (a list of parameter names is needed)")
        return {}
    moe = [i for i in range(config.n_blocks) if config.is_moe(i)]
    names = {i: [f"{_MODULE.format(i=i)}.{p}" for p in PARAMETERS] for i in moe}
    for t in entries:
        if not any(k == t or k.endswith(f".{t}") for keys in names.values() for k in keys):
            problems.append(f"target_parameters names {t!r}, which is no parameter of this base (it adapts only "
                            "a mixture's experts: mlp.experts.gate_up_proj, mlp.experts.down_proj)")
    if not entries or len(problems) > before:
        return {}
    E, rows, out = config.n_experts, _rows(config), {}
    for i in moe:
        targeted = [k.rsplit(".", 1)[1] for k in names[i] if any(k == t or k.endswith(f".{t}") for t in entries)]
        for name in targeted:
            key = f"{_MODULE.format(i=i)}.{name}"
            ab = modules.pop(_holder(i, name, targeted), {})
            R = pattern_value(peft_config.get("rank_pattern"), key, peft_config.get("r", 8))
            A, B = ab.get("lora_A"), ab.get("lora_B")
            f_in = config.d_model if name == "gate_up_proj" else config.d_expert
            f_out = rows[PARAMETERS[name][-1]][1]
            if A is None or B is None or A.shape != (R * E, f_in) or B.shape != (f_out, R * E):
                problems.append(f"{key}: needs lora_A ({R * E}, {f_in}) and lora_B ({f_out}, {R * E}) under "
                                f"{_holder(i, name, targeted)} (rank {R} for each of {E} experts), has "
                                f"{None if A is None else A.shape} and {None if B is None else B.shape}")
                continue
            scaling = peft_scaling(peft_config, key, R)
            A_e, B_e = A.reshape(E, R, f_in), B.reshape(f_out, R, E)
            for e in range(E):
                layer_of = {part: f"blocks.{i}.experts.{e}.{part}" for part in PARAMETERS[name]}
                written = written_parts(layout, "expert_parts", key, layer_of)
                out.update(unfuse(A_e[e], B_e[:, :, e], written, layer_of, rows, layout, scaling))
    return out

"""PEFT LoRA adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``).

Hugging Face PEFT adds ``scaling · x Aᵀ Bᵀ`` to a module, with ``A`` of shape ``(r, f_in)``
(``lora_A.weight``), ``B`` of shape ``(f_out, r)`` (``lora_B.weight``) and
``scaling = lora_alpha / r`` (``lora_alpha / √r`` with ``use_rslora``; per-module values from
``rank_pattern`` / ``alpha_pattern``). pedestrian adds ``α · x D U`` (paper section 6, plain
scalar ``α``), so ``D = Aᵀ``, ``U = Bᵀ`` and ``α = scaling`` (EQUATIONS.md, "LoRA"). Which module
is which pedestrian layer, and PEFT's per-module rank and scaling: :mod:`.peft_modules`.

GPT-2 fuses q, k, v in one ``c_attn`` module, so a PEFT adapter on it is shared:

- import: ``D_q = D_k = D_v = Aᵀ`` and ``U_q, U_k, U_v`` are the column blocks of ``Bᵀ`` (exact);
- export: the adapters pedestrian has on some of q, k, v of a block become one ``c_attn`` adapter
  of rank ``R = Σ r_part``: ``A`` stacks their ``Dᵀ``, ``B`` is block-diagonal in their ``Uᵀ``;
  its one scaling is the first part's ``α``, and a part with another ``α`` has the ratio folded
  into its block of ``B`` (same outputs). The file's metadata records the layout and every
  layer's ``α``, so importing a file written here gives back the very same adapters (bit for
  bit, except the ``U`` of a part whose ``α`` differs from its block's first part: within a
  rounding or two).

A mixture's experts are two 3-D parameters of one module in transformers, which PEFT adapts through
``target_parameters``: :mod:`.peft_experts`.

Per-layer settings (PEFT's convention, ``peft.tuners.lora.LoraModel._create_and_replace``): a
module's rank is ``rank_pattern[key]`` and its ``lora_alpha`` is ``alpha_pattern[key]`` for the
first key ``k`` with ``re.match(rf"(.*\\.)?({k})$", module)`` (``peft.utils.other.get_pattern_key``),
else ``r`` / ``lora_alpha``; its scaling is that ``lora_alpha / rank``. pedestrian keeps a rank and
an ``α`` per layer (:attr:`GPT.lora_ranks`, :attr:`GPT.lora_alphas`), so every module is
imported with its own rank and ``α = scaling``, exactly; on export ``r`` and ``lora_alpha`` are
the model's defaults (``lora_rank``, ``lora_alpha · lora_rank``) and every module that differs
gets a ``rank_pattern`` / ``alpha_pattern`` entry under its full module name.
``lora_dropout`` is :attr:`GPT.lora_dropout` both ways (the same placement: the adapter's input,
one mask per module: GPT-2's q, k, v share the ``c_attn`` input's mask, a Llama-family model's
``q_proj``, ``k_proj``, ``v_proj`` draw one each).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Mapping, NamedTuple

import numpy as np

from ..backend import to_numpy
from ..config import GPTConfig
from ..model.inputs import check_finite_state
from ..model.layout import fc_layers
from .files import SafetensorsFile, json_writer, listing, read_json_object, torch_load, write_dir_atomically
from .hf_config import export_problems
from .families import export_family
from .peft_experts import experts_from_peft, experts_to_peft
from .peft_modules import (fc_of_module, fuse, is_gpt2, pattern_value, peft_module, peft_scaling, recorded_alpha,
                           unfuse, written_parts)

__all__ = ["PeftLora", "load_peft_adapter", "save_peft_adapter", "read_peft_adapter", "lora_state_from_peft",
           "lora_state_to_peft"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_META_KEY = "pedestrian_lora"
_LAYOUT_VERSIONS = (1, 2)      # 1: one rank and one alpha for all adapters; 2: per layer


class PeftLora(NamedTuple):
    """A PEFT adapter in pedestrian's terms (what :meth:`GPT.add_lora` and
    :meth:`GPT.load_state_dict` take).

    Attributes:
        state: ``X.lora_D (f_in, r_X)`` / ``X.lora_U (r_X, f_out)`` arrays (float64), by name.
        ranks: ``{layer: r_X}``; alphas: ``{layer: α_X}`` (PEFT's per-module scaling).
        rank, alpha: the file's defaults, ``r`` and its scaling (``lora_alpha / r``).
        dropout: ``lora_dropout``.
    """

    state: dict
    ranks: dict
    alphas: dict
    rank: int
    alpha: float
    dropout: float


_UNSUPPORTED = {  # adapter_config.json option -> value pedestrian needs
    "use_dora": False, "bias": "none", "lora_bias": False, "modules_to_save": None,
    "trainable_token_indices": None, "layer_replication": None,
}


# ------------------------------------------------------------------------------------ reading
def read_peft_adapter(adapter_dir) -> tuple[dict, dict[str, np.ndarray], dict]:
    """``(adapter_config, tensors, metadata)`` of a PEFT adapter directory.

    Reads ``adapter_model.safetensors`` (or ``adapter_model.bin`` through PyTorch).

    Raises:
        FileNotFoundError: no directory, ``adapter_config.json`` or weights file.
        ValueError: unreadable files, or a ``peft_type`` other than ``"LORA"``.
    """
    d = Path(adapter_dir).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(f"PEFT adapter directory not found: {d} is not a directory")
    cfg_path = d / ADAPTER_CONFIG
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{d} is not a PEFT adapter: it has no {ADAPTER_CONFIG}")
    cfg = read_json_object(cfg_path)
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{cfg_path} has peft_type {cfg.get('peft_type')!r}; pedestrian reads only "
                         "LoRA adapters (peft_type 'LORA')")
    st = d / ADAPTER_WEIGHTS
    if st.is_file():
        f = SafetensorsFile(st)
        return cfg, {k: f.get(k) for k in f.names}, f.metadata
    if (d / "adapter_model.bin").is_file():
        return cfg, torch_load(d / "adapter_model.bin"), {}
    raise FileNotFoundError(f"{d} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS} (or adapter_model.bin)")


def _base_weight_np(model, name: str) -> np.ndarray | None:
    """The base tensor a PEFT file may carry a copy of (HF layout), for the same-base check."""
    if name == "lm_head.base_layer.weight" or name == "lm_head.weight":
        w = model.params["tok_emb.weight"] if model.config.tie_weights else model.params["logits.weight"]
        w = np.asarray(to_numpy(w))
        return w if model.config.tie_weights else w.T
    if name in ("transformer.wte.weight", "wte.weight", "model.embed_tokens.weight"):
        return np.asarray(to_numpy(model.params["tok_emb.weight"]))
    return None


def lora_state_from_peft(peft_config: Mapping, tensors: Mapping[str, np.ndarray], config: GPTConfig, *,
                         metadata: Mapping | None = None, model=None,
                         source: str = "the adapter") -> PeftLora:
    """PEFT tensors -> pedestrian adapters, each layer with its own rank and ``α``, fully validated.

    Args:
        peft_config: the parsed ``adapter_config.json``.
        tensors: ``adapter_model`` tensors by name (``base_model.model.`` prefix optional).
        config: the base model's config.
        metadata: the safetensors metadata (a pedestrian layout record, if any).
        model: the base model, to compare any base weights the file carries (PEFT stores
            ``lm_head.base_layer.weight`` when ``lm_head`` is adapted and tied).
        source: how to name the adapter in messages.

    Returns:
        a :class:`PeftLora`. A ``c_attn`` module of rank ``R`` becomes q, k and v adapters of
        rank ``R`` sharing ``D = Aᵀ`` (or, for a file written by :func:`save_peft_adapter`, the
        very adapters it was written from).

    Raises:
        ValueError: unsupported PEFT options, modules the base does not have, missing
            ``lora_A``/``lora_B``, shapes that do not fit the base, a ``lora_dropout`` outside
            ``[0, 1)``, base weights that differ, anything else in the file -- every problem in
            one message.
    """
    problems = []
    for key, ok in _UNSUPPORTED.items():
        value = peft_config.get(key, ok)
        if value != ok and (ok or value):           # null / false / [] all mean "off"
            problems.append(f"{key}={value!r} (pedestrian supports only {key}={ok!r})")
    dropout = peft_config.get("lora_dropout", 0.0)
    dropout = 0.0 if dropout is None else dropout
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        problems.append(f"lora_dropout={dropout!r} (a probability in [0, 1) is needed)")
    shapes = {name: (f_in, f_out) for name, f_in, f_out in fc_layers(config)}
    hq, hv = config.n_heads * config.d_qk, config.n_heads * config.d_head
    cols = {"q": (0, hq), "k": (hq, 2 * hq), "v": (2 * hq, 2 * hq + hv)}
    modules: dict[str, dict[str, np.ndarray]] = {}
    unexpected, base_mismatch = [], []
    for key, value in tensors.items():
        name = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        m = re.match(r"^(.*)\.(lora_A|lora_B)\.weight$", name)
        if m:
            modules.setdefault(m.group(1), {})[m.group(2)] = np.asarray(value)
            continue
        base = _base_weight_np(model, name) if model is not None else None
        if base is not None or name in ("lm_head.base_layer.weight", "transformer.wte.weight",
                                        "model.embed_tokens.weight"):
            if base is not None:
                v = np.asarray(value, dtype=np.float64)
                if v.shape != base.shape or not np.allclose(v, base, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(base).max())):
                    base_mismatch.append(name)
            continue
        unexpected.append(key)
    if unexpected:
        problems.append(f"unsupported tensors {listing(unexpected)}")
    if base_mismatch:
        problems.append(f"the adapter's copy of {base_mismatch} differs from this model's weights "
                        "(the adapter was trained on a different base model)")
    layout = _read_layout(metadata)
    per_fc: dict[str, tuple[np.ndarray, np.ndarray, float]] = experts_from_peft(   # fc -> (D, U, α)
        peft_config, modules, config, layout, problems)                 # (takes the experts' modules out)
    for module, ab in modules.items():
        if "lora_A" not in ab or "lora_B" not in ab:
            problems.append(f"{module} has only {sorted(ab)} (needs lora_A and lora_B)")
            continue
        A, B = ab["lora_A"], ab["lora_B"]
        targets = fc_of_module(module, config)
        if targets is None:
            problems.append(f"{module} is not a module of this base (a GPT-2 with {config.n_blocks} "
                            "blocks has transformer.h.{i}.attn.c_attn / attn.c_proj / mlp.c_fc / "
                            "mlp.c_proj and lm_head)" if is_gpt2(config) else
                            f"{module} is not a module of this base (a Llama with {config.n_blocks} blocks "
                            "has model.layers.{i}.self_attn.q_proj / k_proj / v_proj / o_proj, "
                            "mlp.gate_proj / up_proj / down_proj and lm_head)")
            continue
        f_in = shapes[targets[0]][0]
        f_out = sum(shapes[t][1] for t in targets)
        if A.ndim != 2 or B.ndim != 2 or A.shape[1] != f_in or B.shape[0] != f_out or A.shape[0] != B.shape[1]:
            problems.append(f"{module}: lora_A {A.shape}, lora_B {B.shape} do not fit the base layer "
                            f"(needs lora_A (r, {f_in}), lora_B ({f_out}, r))")
            continue
        rank = A.shape[0]
        expected_rank = pattern_value(peft_config.get("rank_pattern"), module, peft_config.get("r", rank))
        if expected_rank != rank:
            problems.append(f"{module}: tensors have rank {rank} but adapter_config.json says {expected_rank}")
            continue
        scaling = peft_scaling(peft_config, module, rank)
        if len(targets) == 1:
            per_fc[targets[0]] = (A.T, B.T, recorded_alpha(layout, targets[0], scaling))
            continue
        layer_of = {fc.rsplit(".", 1)[1]: fc for fc in targets}                  # c_attn: q, k, v
        per_fc.update(unfuse(A, B, written_parts(layout, "c_attn_parts", module, layer_of), layer_of, cols, layout,
                             scaling))
    if not per_fc and not problems:
        problems.append("it holds no lora_A / lora_B tensors")
    if problems:
        raise ValueError(f"{source} does not fit this model ({config.n_blocks} blocks, d_model="
                         f"{config.d_model}, vocab_size={config.vocab_size}): " + "; ".join(problems)
                         + ". Nothing was loaded.")
    order = [name for name, _, _ in fc_layers(config)]
    fcs = sorted(per_fc, key=order.index)
    state = {}
    for fc in fcs:
        D, U, _ = per_fc[fc]
        state[f"{fc}.lora_D"], state[f"{fc}.lora_U"] = np.asarray(D, np.float64), np.asarray(U, np.float64)
    default_rank = peft_config.get("r", per_fc[fcs[0]][0].shape[1])
    default_alpha = peft_scaling({**peft_config, "alpha_pattern": None}, "", default_rank)
    if "alpha" in layout and math.isclose(float(layout["alpha"]), default_alpha, rel_tol=1e-12):
        default_alpha = float(layout["alpha"])
    return PeftLora(state=state, ranks={fc: int(per_fc[fc][0].shape[1]) for fc in fcs},
                    alphas={fc: float(per_fc[fc][2]) for fc in fcs}, rank=int(default_rank),
                    alpha=float(default_alpha), dropout=float(dropout))


def _read_layout(metadata: Mapping | None) -> dict:
    """The pedestrian layout record of a file written by :func:`save_peft_adapter` (``{}``: none)."""
    try:
        layout = json.loads((metadata or {}).get(_META_KEY, "{}"))
    except (TypeError, ValueError):
        return {}
    return layout if isinstance(layout, dict) and layout.get("version") in _LAYOUT_VERSIONS else {}


def load_peft_adapter(model, adapter_dir, *, freeze_base: bool = True) -> None:
    """Attach the LoRA adapters of a PEFT directory to ``model`` (all or nothing).

    Args:
        model: a :class:`~pedestrian.model.GPT` holding the base the adapter was trained on
            (e.g. from :func:`pedestrian.interop.hf.load_pretrained`), without adapters.
        adapter_dir: directory with ``adapter_config.json`` and ``adapter_model.safetensors``.
        freeze_base: as in :meth:`~pedestrian.model.GPT.add_lora`.

    Afterwards ``model``'s logits equal those of the HF model with the adapter applied by PEFT;
    each layer has the module's rank and scaling (``rank_pattern`` / ``alpha_pattern``
    included), and :attr:`~pedestrian.model.GPT.lora_dropout` is the file's ``lora_dropout``.
    ``model`` is left in inference mode (``model.training = False``: no dropout), as PEFT's
    ``PeftModel.from_pretrained`` leaves its model (``is_trainable=False``, ``eval()``); set
    ``model.training = True`` to train on with the file's dropout.

    Raises:
        FileNotFoundError: missing files. ValueError: the model already has adapters, the
            adapter does not fit this base (see :func:`lora_state_from_peft`), or it holds NaN or
            ±inf values; the model is left unchanged.
    """
    cfg, tensors, metadata = read_peft_adapter(adapter_dir)
    lora = lora_state_from_peft(cfg, tensors, model.config, metadata=metadata, model=model,
                                source=f"the PEFT adapter {adapter_dir}")
    if model.lora_targets:
        raise ValueError("the model already has LoRA adapters; merge_lora() or remove_lora() first")
    try:                                        # before add_lora: a refusal changes nothing
        check_finite_state(lora.state, model.dtype_name)
    except ValueError as exc:
        raise ValueError(f"the PEFT adapter {adapter_dir}: {exc}") from None
    model.add_lora(list(lora.ranks), lora.rank, lora.alpha, rank_pattern=lora.ranks, alpha_pattern=lora.alphas,
                   dropout=lora.dropout, freeze_base=freeze_base)
    model.load_state_dict(lora.state, strict=False)
    model.training = False


# ------------------------------------------------------------------------------------ writing
def lora_state_to_peft(model, *, base_model_name_or_path: str | None = None
                       ) -> tuple[dict, dict[str, np.ndarray], dict[str, str]]:
    """``(adapter_config, tensors, metadata)`` of ``model``'s adapters in PEFT's format.

    Non-fused layers: ``lora_A = Dᵀ``, ``lora_B = Uᵀ``. ``r`` and ``lora_alpha`` are the
    model's defaults (``lora_rank``, ``lora_alpha · lora_rank``); a module with another rank or
    scaling gets ``rank_pattern`` / ``alpha_pattern`` entries (``lora_alpha = α·rank``).
    ``c_attn``: see the module docstring. ``lora_dropout`` = :attr:`GPT.lora_dropout`.

    Adapters on a mixture's experts: ``target_parameters`` (:mod:`.peft_experts`).

    Raises:
        ValueError: the model has no adapters, or its base is neither a Hugging Face GPT-2
            (:func:`pedestrian.interop.hf_config.export_problems`) nor a Llama-family model
            (:func:`pedestrian.interop.families.export_family`); a
            :class:`~.peft_experts.PeftRefused` for expert adapters PEFT cannot hold as they are.
    """
    if not model.lora_targets:
        raise ValueError("the model has no LoRA adapters to write (add_lora() or load some first)")
    if is_gpt2(model.config):
        problems = export_problems(model.config)
        if problems:
            raise ValueError("PEFT adapters apply to a Hugging Face model, and this base is not a GPT-2: "
                             + "; ".join(problems))
    else:
        try:
            export_family(model.config)                    # (:mod:`.families`: the family that names the modules)
        except ValueError as exc:
            raise ValueError(f"PEFT adapters apply to a Hugging Face model: {exc}") from None
    r, alpha = int(model.lora_rank), float(model.lora_alpha)
    ranks = {fc: int(v) for fc, v in model.lora_ranks.items()}
    alphas = {fc: float(v) for fc, v in model.lora_alphas.items()}
    P = {k: np.asarray(to_numpy(v)) for k, v in model.params.items() if ".lora_" in k}
    hq, hv = model.config.n_heads * model.config.d_qk, model.config.n_heads * model.config.d_head
    cols = {"q": (0, hq), "k": (hq, 2 * hq), "v": (2 * hq, 2 * hq + hv)}
    grouped: dict[str, list[tuple[str, str | None]]] = {}
    for fc in model.lora_targets:
        if ".experts." not in fc:                                   # (experts: target_parameters below)
            module, part = peft_module(fc, model.config)
            grouped.setdefault(module, []).append((fc, part))
    tensors, rank_pattern, alpha_pattern, parts_of = {}, {}, {}, {}
    adapters = {}                                                   # module or parameter -> (A, B, scaling)
    for module, members in grouped.items():
        first = members[0][0]
        if members[0][1] is None:
            adapters[module] = (P[f"{first}.lora_D"].T, P[f"{first}.lora_U"].T, alphas[first])
        else:
            adapters[module] = fuse(P, members, cols, 2 * hq + hv, ranks, alphas)
            parts_of[module] = [part for _, part in members]
    experts, wrappers, expert_parts = experts_to_peft(model, P, ranks, alphas)
    adapters.update(experts)
    for module, (A, B, scaling) in adapters.items():
        R = A.shape[0] // (model.config.n_experts if module in experts else 1)     # (experts: E·R rows)
        if R != r:
            rank_pattern[module] = R
        if scaling * R != alpha * r:
            alpha_pattern[module] = scaling * R
        holder = wrappers.get(module, module)               # (the module holding the parameter's lora_A, lora_B)
        tensors[f"{_PREFIX}{holder}.lora_A.weight"] = np.ascontiguousarray(A)
        tensors[f"{_PREFIX}{holder}.lora_B.weight"] = np.ascontiguousarray(B)
    conv1d = is_gpt2(model.config) and any(m != "lm_head" for m in grouped)   # GPT-2's Conv1D
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": r, "lora_alpha": alpha * r, "lora_dropout": float(model.lora_dropout), "use_rslora": False,
        "use_dora": False, "target_modules": list(grouped), "target_parameters": list(experts) or None,
        "fan_in_fan_out": conv1d, "bias": "none",
        "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
        "layers_to_transform": None, "layers_pattern": None,
    }
    meta = {"format": "pt", _META_KEY: json.dumps({"version": 2, "rank": r, "alpha": alpha, "ranks": ranks,
                                                   "alphas": alphas, "c_attn_parts": parts_of,
                                                   "expert_parts": expert_parts})}
    return config, tensors, meta


def save_peft_adapter(model, out_dir, *, base_model_name_or_path: str | None = None,
                      overwrite: bool = False) -> Path:
    """Write ``model``'s LoRA adapters as a PEFT adapter directory (atomically).

    ``PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base), out_dir)`` then gives the
    same logits as ``model``; :func:`load_peft_adapter` gives back the same adapters.

    Args:
        base_model_name_or_path: recorded in ``adapter_config.json`` (where PEFT finds the base).
        overwrite: replace the files of an existing non-empty directory.

    Raises:
        ValueError: see :func:`lora_state_to_peft`; output problems (non-empty directory).
        WriteError (an ``OSError``): the OS refused the write; ``out_dir`` is left as it was.
    """
    from safetensors.numpy import save_file

    config, tensors, meta = lora_state_to_peft(model, base_model_name_or_path=base_model_name_or_path)
    writers = {ADAPTER_CONFIG: json_writer(config),
               ADAPTER_WEIGHTS: lambda p: save_file(tensors, str(p), metadata=meta)}
    return write_dir_atomically(out_dir, writers, overwrite=overwrite, conflicts=("adapter_model.bin",),
                                what="the PEFT adapter directory")

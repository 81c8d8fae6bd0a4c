"""Flat parameter buffers: every parameter (and every gradient) is a view into one 1-D array.

An optimizer then updates a whole model with a few vectorised operations, and data
parallelism sums gradients with one addition per buffer. The decayed 2-D weights come first, so
weight decay is a slice. The q, k, v weights (and biases) of a block are column slices of one
fused region, the block's ``attn.qkv`` layer: three FC layers of the same input are one FC layer
with their columns side by side.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Mapping, NamedTuple

import numpy as np

from ..backend import persistent, to_numpy
from ..config import GPTConfig, lora_specs, param_specs
from .inputs import check_finite_state

__all__ = ["FC", "FlatBuffer", "FlatParams", "FlatParameters", "Norm", "base_regions", "lora_regions",
           "qkv_columns"]


class FlatBuffer(NamedTuple):
    """One flat parameter buffer and its gradient buffer (what an optimizer updates).

    Attributes:
        name: ``"base"`` or ``"lora"``.
        params: ``(n,)`` float array, the parameters (``GPT.params`` are views into it).
        grads: ``(n,)`` array of the same dtype: the last backward's gradient.
        n_decay: the first ``n_decay`` entries are 2-D weights (weight decay applies to them).
    """

    name: str
    params: object
    grads: object
    n_decay: int


class FlatParams:
    """A flat 1-D buffer and named views into it (decayed region first).

    Args:
        xp: the array namespace; dtype, device: of the buffer.
        regions: ``[(region_shape, decay, members)]``, ``members`` a list of
            ``(name, (lo, hi) column slice or None)`` (see :func:`base_regions`).

    Attributes:
        flat: the ``(n,)`` buffer, zeros at first.
        views: ``name -> view`` with the parameter's shape.
        regions: ``name -> view`` of each whole region (a fused ``…attn.qkv.weight`` included).
        n_decay: the first ``n_decay`` entries of ``flat`` get weight decay.
    """

    def __init__(self, xp, dtype, regions, device=None):
        with persistent(xp):                                       # (views made inside too)
            regions = sorted(regions, key=lambda r: not r[1])      # decayed first, stable
            total = sum(math.prod(shape) for shape, _, _ in regions)
            self.flat = xp.zeros((total,), dtype=dtype, device=device)
            self.views: dict = {}
            self.regions: dict = {}
            self.n_decay = 0
            offset = 0
            for shape, decay, members in regions:
                size = math.prod(shape)
                region = xp.reshape(self.flat[offset:offset + size], shape)
                for name, cols in members:
                    self.views[name] = region if cols is None else region[..., cols[0]:cols[1]]
                self.regions[members[0][0] if len(members) == 1 else _fused_name(members[0][0])] = region
                if decay:
                    self.n_decay = offset + size
                offset += size


def _fused_name(member: str) -> str:
    """``blocks.0.attn.q.weight`` -> ``blocks.0.attn.qkv.weight``."""
    prefix, _, last = member.rpartition(".")        # prefix blocks.0.attn.q, last weight
    return prefix.rsplit(".", 1)[0] + ".qkv." + last


def base_regions(config: GPTConfig) -> list:
    """The base parameters' regions for :class:`FlatParams` (each block's q, k, v fused)."""
    specs = {s.name: s for s in param_specs(config)}
    cols = dict(qkv_columns(config))
    width = cols["v"][1]
    regions, fused_done = [], set()
    for name, spec in specs.items():
        parts = name.split(".")
        if len(parts) == 5 and parts[2] == "attn":                # blocks.i.attn.{q,k,v}.{weight,bias}
            key = (parts[1], parts[4])
            if key in fused_done:
                continue
            fused_done.add(key)
            stem = f"blocks.{parts[1]}.attn"
            shape = (config.d_model, width) if parts[4] == "weight" else (width,)
            members = [(f"{stem}.{h}.{parts[4]}", cols[h]) for h in "qkv"]
            regions.append((shape, spec.decay, members))
        else:
            regions.append((spec.shape, spec.decay, [(name, None)]))
    return regions


def qkv_columns(config: GPTConfig) -> tuple:
    """``(("q", (0, hq)), ("k", (hq, hq + hk)), ("v", (hq + hk, hq + hk + hv)))``: the fused qkv
    layer's column slices, ``hq = n_heads·d_qk``, ``hk = n_kv_heads·d_qk``, ``hv = n_kv_heads·d_head``
    (grouped-query attention: k and v hold only the ``n_kv_heads`` shared heads)."""
    hq, hk, hv = (config.n_heads * config.d_qk, config.n_kv_heads * config.d_qk,
                  config.n_kv_heads * config.d_head)
    return ("q", (0, hq)), ("k", (hq, hq + hk)), ("v", (hq + hk, hq + hk + hv))


def lora_regions(specs) -> list:
    """The LoRA adapters' regions for :class:`FlatParams` from :func:`pedestrian.config.lora_specs`
    (every ``D`` and ``U`` decayed)."""
    return [(s.shape, True, [(s.name, None)]) for s in specs]


class Norm(NamedTuple):
    """A layer norm's ``weight`` and ``bias`` (``None`` when absent), or their gradients."""

    weight: object
    bias: object


class FC(NamedTuple):
    """A fully connected layer's ``weight``, ``bias`` (``None`` when absent) and LoRA adapters
    ``(name, D, U, lo, hi)`` on its output columns ``lo:hi`` -- or the gradients of all three."""

    weight: object
    bias: object
    adapters: tuple


class FlatParameters:
    """The parameter methods of :class:`~pedestrian.model.GPT` (a base class, not used alone):
    the flat buffers, the named views into them, state dicts and gradient buffers.

    Expects ``config``, ``xp``, ``dtype``, ``dtype_name``, ``device``, ``backend``, ``params``,
    ``_base`` / ``_grad_base`` (base :class:`FlatParams`), ``_base_names`` and the adapters'
    ``_lora`` / ``_grad_lora`` / ``freeze_base`` (:class:`~pedestrian.model.adapters.LoRAAdapters`).
    """

    def to_xp(self, value):
        """``value`` (NumPy or nested lists) as an array of this model's backend, dtype and device."""
        arr = np.asarray(value)
        if self.backend == "torch":
            import torch

            return torch.as_tensor(arr, dtype=self.dtype, device=self.device)
        return arr.astype(self.dtype, copy=False)

    @property
    def flat(self):
        """The flat base-parameter buffer (views in :attr:`params` alias it)."""
        return self._base.flat

    def num_params(self, trainable_only: bool = False) -> int:
        """Number of parameters (base + LoRA, or only those that get gradients)."""
        n_lora = 0 if self._lora is None else int(self._lora.flat.shape[0])
        n_base = int(self._base.flat.shape[0])
        if trainable_only:
            return n_lora + (0 if self.freeze_base else n_base)
        return n_base + n_lora

    def state_dict(self) -> dict[str, np.ndarray]:
        """Contiguous NumPy copies of every parameter (base and LoRA), by name."""
        return {k: np.array(to_numpy(v), copy=True, order="C") for k, v in self.params.items()}

    def load_state_dict(self, state: Mapping[str, object], *, strict: bool = True) -> None:
        """Copy arrays into the parameters, by name; all-or-nothing.

        Raises:
            ValueError: missing or unexpected names (when ``strict``) or shape mismatches; the
                message lists every problem, and no parameter has been changed. Also a value that
                is NaN or ±inf in the model's dtype (:func:`check_finite_state <pedestrian.model.inputs.check_finite_state>`), nothing changed.
        """
        problems = []
        missing = [k for k in self.params if k not in state]
        extra = [k for k in state if k not in self.params]
        if strict and missing:
            problems.append(f"missing: {missing}")
        if strict and extra:
            problems.append(f"unexpected: {extra}")
        for k, v in state.items():
            if k in self.params and tuple(np.shape(to_numpy(v))) != tuple(self.params[k].shape):
                problems.append(f"{k}: shape {tuple(np.shape(to_numpy(v)))} != expected "
                                f"{tuple(self.params[k].shape)}")
        if problems:
            raise ValueError("parameters do not match this model's config: " + "; ".join(problems))
        arrays = check_finite_state({k: v for k, v in state.items() if k in self.params}, self.dtype_name)
        for k, a in arrays.items():
            self.params[k][...] = self.to_xp(a)

    def trainable_buffers(self) -> list[FlatBuffer]:
        """The flat buffers an optimizer updates: the base (unless frozen), then the LoRA adapters.

        Gradient buffers are created on first use. Call again after :meth:`add_lora` /
        :meth:`remove_lora` or a change of :attr:`freeze_base`: the buffers change.
        """
        self._grad_buffers()
        out = []
        if not self.freeze_base:
            out.append(FlatBuffer("base", self._base.flat, self._grad_base.flat, self._base.n_decay))
        if self._lora is not None:
            out.append(FlatBuffer("lora", self._lora.flat, self._grad_lora.flat, self._lora.n_decay))
        return out

    def _grad_buffers(self) -> None:
        if not self.freeze_base and self._grad_base is None:
            self._grad_base = FlatParams(self.xp, self.dtype, base_regions(self.config), self.device)
        if self._lora is not None and self._grad_lora is None:
            specs = lora_specs(self.config, self.lora_targets, self.lora_rank, self.lora_ranks)
            self._grad_lora = FlatParams(self.xp, self.dtype, lora_regions(specs), self.device)

    @property
    def grads(self) -> dict:
        """Gradients of the trainable parameters (views into the flat gradient buffers)."""
        self._grad_buffers()
        out = {}
        if not self.freeze_base:
            out.update({name: self._grad_base.views[name] for name in self._base_names})
        if self._grad_lora is not None:
            out.update(self._grad_lora.views)
        return out

    def _weights(self) -> SimpleNamespace:
        """:meth:`_layer_table` of the parameters, built once per set of adapters (the views never
        change: loading and optimizer steps write into them)."""
        if self._weights_cache is None:
            self._weights_cache = self._layer_table(grads=False)
        return self._weights_cache

    def _layer_table(self, grads: bool) -> SimpleNamespace:
        """Every layer's parameters by role -- ``tok_emb``, ``pos_emb``, ``blocks[i].ln1`` /
        ``.qkv`` / ``.attn_proj`` / ``.ln2`` / ``.mlp_gate`` (SwiGLU; else ``None``) / ``.mlp_expand`` /
        ``.mlp_contract``, ``ln_final``,
        ``logits`` -- as :class:`Norm` and :class:`FC` entries (the block's q, k, v layers are one
        fused ``qkv`` layer; tied logits use ``W_tokᵀ``). With ``grads``, the gradient arrays
        instead, ``None`` where a parameter gets none (frozen or absent), and ``tok_lookup``:
        the array the embedding backward writes (``tok_emb``'s own, or with tied weights a
        separate one, added to it after)."""
        c = self.config
        if grads:
            self._grad_buffers()
            base = {} if self.freeze_base else {**self._grad_base.views, **self._grad_base.regions}
            P = {**base, **(self._grad_lora.views if self._grad_lora is not None else {})}
        else:
            P = {**self.params, **self._base.regions}
        if c.tie_weights and "tok_emb.weight" in P:
            P["logits.weight"] = self.xp.matrix_transpose(P["tok_emb.weight"])
        lora = set(self.lora_targets)

        def norm(name):
            return Norm(P.get(f"{name}.weight"), P.get(f"{name}.bias"))

        def fc(name, parts=((None, 0, None),)):
            adapters = tuple((a, P[f"{a}.lora_D"], P[f"{a}.lora_U"], lo, hi) for a, lo, hi in
                             ((name if part is None else f"{name[:-3]}{part}", lo, hi) for part, lo, hi in parts)
                             if a in lora)
            return FC(P.get(f"{name}.weight"), P.get(f"{name}.bias"), adapters)

        qkv_parts = tuple((h, lo, hi) for h, (lo, hi) in qkv_columns(c))
        blocks = [SimpleNamespace(ln1=norm(f"blocks.{i}.ln1"), qkv=fc(f"blocks.{i}.attn.qkv", qkv_parts),
                                  attn_proj=fc(f"blocks.{i}.attn_proj"), ln2=norm(f"blocks.{i}.ln2"),
                                  mlp_gate=fc(f"blocks.{i}.mlp_gate") if c.mlp == "swiglu" else None,
                                  mlp_expand=fc(f"blocks.{i}.mlp_expand"),
                                  mlp_contract=fc(f"blocks.{i}.mlp_contract"))
                  for i in range(c.n_blocks)]
        table = SimpleNamespace(tok_emb=P.get("tok_emb.weight"), pos_emb=P.get("pos_emb.weight"), blocks=blocks,
                                ln_final=norm("ln_final"), logits=fc("logits"))
        if grads:                                          # where the embedding backward writes dW_tok
            table.tok_lookup = table.tok_emb
            if c.tie_weights and table.tok_emb is not None:
                if self._grad_lookup is None:
                    with persistent(self.xp):
                        self._grad_lookup = self.xp.zeros(table.tok_emb.shape, dtype=self.dtype, device=self.device)
                table.tok_lookup = self._grad_lookup
        return table

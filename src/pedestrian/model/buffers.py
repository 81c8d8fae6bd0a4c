"""Flat buffers: every parameter (and every gradient) is a view into one 1-D array.

An optimizer then updates a whole model with a few vectorised operations, and data
parallelism sums gradients with one addition per buffer. The decayed 2-D weights come first, so
weight decay is a slice. The q, k, v weights (and biases) of a block are column slices of one
fused region, the block's ``attn.qkv`` layer: three FC layers of the same input are one FC layer
with their columns side by side; so are SwiGLU's gate and up weights, ``mlp_gate_up`` (one
product makes ``[a7_gate | a7_up]``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from array_api_compat import is_torch_namespace

from ..backend import persistent
from ..config import GPTConfig
from .layout import param_specs

__all__ = ["FlatBuffer", "FlatParams", "base_regions", "lora_regions", "qkv_columns"]


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
        xp, dtype, device: as given.
        flat: the ``(n,)`` buffer, zeros at first.
        views: ``name -> view`` with the parameter's shape.
        regions: ``name -> view`` of each whole region (a fused ``…attn.qkv.weight`` included).
        spans: ``name -> (lo, hi)``: where each region lies in ``flat``.
        n_decay: the first ``n_decay`` entries of ``flat`` get weight decay.
    """

    def __init__(self, xp, dtype, regions, device=None):
        self.xp, self.dtype, self.device = xp, dtype, device
        with persistent(xp):                                       # (views made inside too)
            regions = sorted(regions, key=lambda r: not r[1])      # decayed first, stable
            total = sum(math.prod(shape) for shape, _, _ in regions)
            self.flat = xp.zeros((total,), dtype=dtype, device=device)
            self.views: dict = {}
            self.regions: dict = {}
            self.spans: dict = {}
            self.n_decay = 0
            offset = 0
            for shape, decay, members in regions:
                size = math.prod(shape)
                region = xp.reshape(self.flat[offset:offset + size], shape)
                for name, cols in members:
                    self.views[name] = region if cols is None else region[..., cols[0]:cols[1]]
                key = members[0][0] if len(members) == 1 else _fused_name(members[0][0])
                self.regions[key], self.spans[key] = region, (offset, offset + size)
                if decay:
                    self.n_decay = offset + size
                offset += size

    def like(self, regions) -> FlatParams:
        """A new zero buffer of ``regions`` in this one's namespace, dtype and device (a gradient
        buffer, or the LoRA adapters beside the base)."""
        return FlatParams(self.xp, self.dtype, regions, self.device)

    def to_xp(self, value):
        """``value`` (NumPy or nested lists) as an array of this buffer's namespace, dtype and device."""
        arr = np.asarray(value)
        if is_torch_namespace(self.xp):
            import torch

            return torch.as_tensor(arr, dtype=self.dtype, device=self.device)
        return arr.astype(self.dtype, copy=False)


def _fused_name(member: str) -> str:
    """``blocks.0.attn.q.weight`` -> ``blocks.0.attn.qkv.weight``; ``blocks.0.mlp_gate.weight`` ->
    ``blocks.0.mlp_gate_up.weight``."""
    prefix, _, last = member.rpartition(".")        # prefix blocks.0.attn.q, last weight
    if prefix.endswith(".mlp_gate"):
        return f"{prefix}_up.{last}"
    return prefix.rsplit(".", 1)[0] + ".qkv." + last


def qkv_columns(config: GPTConfig) -> tuple:
    """``(("q", (0, hq)), ("k", (hq, hq + hk)), ("v", (hq + hk, hq + hk + hv)))``: the fused qkv
    layer's column slices, ``hq = n_heads·d_qk``, ``hk = n_kv_heads·d_qk``, ``hv = n_kv_heads·d_head``
    (grouped-query attention: k and v hold only the ``n_kv_heads`` shared heads)."""
    hq, hk, hv = (config.n_heads * config.d_qk, config.n_kv_heads * config.d_qk,
                  config.n_kv_heads * config.d_head)
    return ("q", (0, hq)), ("k", (hq, hq + hk)), ("v", (hq + hk, hq + hk + hv))


def base_regions(config: GPTConfig, specs=None, *, fuse_gate_up: bool = True) -> list:
    """The base parameters' regions for :class:`FlatParams` (each block's q, k, v fused, and its
    SwiGLU gate and up): those of ``specs`` (default :func:`pedestrian.model.layout.param_specs`; a
    model with plugged layers passes :meth:`Slots.specs <pedestrian.model.slots.Slots.specs>`).
    ``fuse_gate_up=False``: gate and up apart (the layout of checkpoints written before 2026-12-04)."""
    specs = {s.name: s for s in (param_specs(config) if specs is None else specs)}
    cols = dict(qkv_columns(config))
    width = cols["v"][1]
    regions, fused_done = [], set()

    def gate_up_pair(parts) -> bool:            # blocks.i[.experts.e].mlp_{gate,expand}.{weight,bias}, both there
        stem = ".".join(parts[:-2])
        return (fuse_gate_up and len(parts) in (4, 6) and parts[-2] in ("mlp_gate", "mlp_expand")
                and all(f"{stem}.{k}.{parts[-1]}" in specs for k in ("mlp_gate", "mlp_expand")))

    for name, spec in specs.items():
        parts = name.split(".")
        if len(parts) == 5 and parts[2] == "attn" and parts[3] in ("q", "k", "v"):   # blocks.i.attn.{q,k,v}.*
            key = (parts[1], parts[4])
            if key in fused_done:
                continue
            fused_done.add(key)
            stem = f"blocks.{parts[1]}.attn"
            shape = (config.d_model, width) if parts[4] == "weight" else (width,)
            members = [(f"{stem}.{h}.{parts[4]}", cols[h]) for h in "qkv"]
            regions.append((shape, spec.decay, members))
        elif gate_up_pair(parts):
            if parts[-2] == "mlp_gate":                          # (the up half is placed with it)
                up, m = f"{'.'.join(parts[:-2])}.mlp_expand.{parts[-1]}", spec.shape[-1]
                regions.append(((*spec.shape[:-1], 2 * m), spec.decay, [(name, (0, m)), (up, (m, 2 * m))]))
        else:
            regions.append((spec.shape, spec.decay, [(name, None)]))
    return regions


def lora_regions(specs) -> list:
    """The LoRA adapters' regions for :class:`FlatParams` from :func:`pedestrian.model.layout.lora_specs`
    (every ``D`` and ``U`` decayed)."""
    return [(s.shape, True, [(s.name, None)]) for s in specs]

"""LoRA adapters on a GPT's fully connected layers (paper section 6): their settings, their flat
buffer, and merging ``W ← W ± α D U``.

The forward and backward of an adapter are the model's (:meth:`GPT._fc_forward`, with
:mod:`pedestrian.layers.lora`); a :class:`LoRA` keeps the bookkeeping: which layers carry one,
their ranks and scales ``α``, PEFT's input dropout, the adapters' flat buffer and its gradient
twin. The model's :class:`~pedestrian.model.params.Parameters` owns one (``None`` without
adapters) and adds, merges and removes it.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np

from ..backend import to_numpy
from ..config import GPTConfig
from .buffers import FlatParams, lora_regions
from .layout import lora_layer_values, lora_specs

__all__ = ["LoRA"]


class LoRA:
    """A model's LoRA adapters ``α_X · dropout(x) D_X U_X`` on fully connected layers ``X``.

    Args:
        config: the model's :class:`GPTConfig`.
        like: the base parameters' :class:`FlatParams` (the adapters' buffer takes its namespace,
            dtype and device).
        targets, rank, alpha, rank_pattern, alpha_pattern, dropout, seed: as
            :meth:`GPT.add_lora <pedestrian.model.params.Parameters.add_lora>` documents them
            (``D ~ N(0, 1/f_in)`` from ``seed``; ``U = 0``, so a new adapter starts as a no-op).

    Attributes:
        specs: the adapters' parameter specs (:func:`pedestrian.model.layout.lora_specs`).
        targets: adapted layers, in layer order; ranks, alphas: ``{layer: r}``, ``{layer: α}``;
        rank, alpha: the defaults given; dropout: PEFT's ``lora_dropout``.
        weights: the :class:`FlatParams` of every ``X.lora_D``, ``X.lora_U`` (every one decayed).
        grads: its gradient twin, ``None`` until :meth:`grad_buffer` makes it.

    Raises:
        ValueError: a rank that is not a positive integer, an ``α`` that is not a finite number,
            ``dropout`` outside ``[0, 1)``, unknown targets or pattern keys (nothing made then).
    """

    def __init__(self, config: GPTConfig, like: FlatParams, targets: str | Iterable[str] = "all",
                 rank: int = 8, alpha: float = 1.0, *, rank_pattern: Mapping[str, int] | None = None,
                 alpha_pattern: Mapping[str, float] | None = None, dropout: float = 0.0, seed: int = 0):
        specs = lora_specs(config, targets, rank, rank_pattern)
        alphas = lora_layer_values(config, targets, alpha, alpha_pattern, what="alpha_pattern")
        for name, a in {"alpha": alpha, **alphas}.items():
            if isinstance(a, bool) or not isinstance(a, (int, float, np.floating)) or not math.isfinite(a):
                where = "" if name == "alpha" else f" (alpha_pattern, layer {name})"
                raise ValueError(f"LoRA alpha must be a finite number, got {a!r}{where}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float, np.floating)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be a probability in [0, 1), got {dropout!r}")
        self.config = config
        self.specs = specs
        self.weights = like.like(lora_regions(specs))
        rng = np.random.default_rng(seed)
        for s in specs:
            if s.name.endswith("lora_D"):
                self.weights.views[s.name][...] = self.weights.to_xp(rng.normal(0, 1 / math.sqrt(s.shape[0]), s.shape))
        self.targets = list(alphas)                        # layer order
        self.ranks = {s.name.rsplit(".", 1)[0]: s.shape[1] for s in specs if s.name.endswith("lora_D")}
        self.alphas = {name: float(a) for name, a in alphas.items()}
        self.alpha = float(alpha)
        self.rank = rank
        self.dropout = float(dropout)
        self.grads: FlatParams | None = None

    def grad_buffer(self) -> FlatParams:
        """:attr:`grads`, made (zeros) on first use."""
        if self.grads is None:
            self.grads = self.weights.like(lora_regions(self.specs))
        return self.grads

    def merge_into(self, params: dict, sign: float, dtype_name: str) -> None:
        """``W ← W + sign · α D U`` for every adapted layer's ``params[f"{X}.weight"]``.

        Args:
            params: ``name -> view`` of the model's parameters (the base weights are written).
            sign: ``+1.0`` merges, ``-1.0`` unmerges.
            dtype_name: the model's dtype, for the message.

        Raises:
            ValueError: a LoRA on tied logits, or a merged weight that would not be finite (an
                adapter holding NaN or inf, or ``α D U`` beyond the dtype); nothing is changed then.
        """
        if "logits" in self.targets and self.config.tie_weights:
            raise ValueError("cannot merge a LoRA on tied logits into tok_emb.weight (it would also "
                             "change the embedding); keep the adapter unmerged or untie the weights")
        xp, views = self.weights.xp, self.weights.views

        def merged(fc):
            delta_w = sign * self.alphas[fc] * (views[f"{fc}.lora_D"] @ views[f"{fc}.lora_U"])
            return params[f"{fc}.weight"] + delta_w

        # first every layer is checked (an adapter holding NaN, or α·D·U beyond the dtype), so
        # that a refusal changes nothing; then the same sums are computed again and written
        with np.errstate(over="ignore", invalid="ignore"):
            finite = [xp.all(xp.isfinite(merged(fc))) for fc in self.targets]               # 0-d each, unread
            bad = [fc for fc, ok in zip(self.targets, to_numpy(xp.stack(finite)).tolist() if finite else []) if not ok]
        if bad:
            raise ValueError(f"merging the LoRA adapters of {bad} would make their weights non-finite "
                             f"(an adapter holds NaN or inf, or α·D·U overflows {dtype_name}); "
                             "nothing was changed")
        for fc in self.targets:
            params[f"{fc}.weight"][...] = merged(fc)

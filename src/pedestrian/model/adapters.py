"""LoRA adapters on a GPT's fully connected layers (paper section 6): adding, merging,
unmerging and removing them.

The forward and backward of an adapter are the model's (:meth:`GPT._fc_forward`, with
:mod:`pedestrian.layers.lora`); this module keeps the bookkeeping: which layers carry one, their
ranks and scales ``α``, their flat buffer, and merging ``W ← W ± α D U``. :class:`LoRAAdapters`
is a base class of :class:`~pedestrian.model.GPT`, so these are methods of the model.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np

from ..backend import to_numpy
from ..config import fc_layers, lora_layer_values, lora_specs
from .params import FlatParams, lora_regions

__all__ = ["LoRAAdapters"]


class LoRAAdapters:
    """The adapter methods of :class:`~pedestrian.model.GPT` (a base class, not used alone).

    Attributes (set by :meth:`add_lora`, reset by :meth:`remove_lora`):
        lora_targets: adapted layers, in layer order; lora_ranks, lora_alphas: per layer;
        lora_rank, lora_alpha: the defaults given; lora_dropout: PEFT's ``lora_dropout``;
        freeze_base: whether the base gets no gradients.
    """

    def _init_lora(self) -> None:
        self._lora: FlatParams | None = None
        self._grad_lora: FlatParams | None = None
        self.lora_alpha: float = 1.0                       # add_lora's defaults (PEFT's r, lora_alpha / r)
        self.lora_rank: int | None = None
        self.lora_targets: list[str] = []
        self.lora_ranks: dict[str, int] = {}               # per adapted layer
        self.lora_alphas: dict[str, float] = {}
        self.lora_dropout: float = 0.0
        self.freeze_base = False

    def add_lora(self, targets: str | Iterable[str] = "all", rank: int = 8, alpha: float = 1.0,
                 *, rank_pattern: Mapping[str, int] | None = None,
                 alpha_pattern: Mapping[str, float] | None = None, dropout: float = 0.0,
                 seed: int = 0, freeze_base: bool = True) -> None:
        """Put a LoRA adapter ``α_X · dropout(x) D_X U_X`` on fully connected layers ``X``
        (paper section 6; the dropout and the per-layer settings are PEFT's).

        Args:
            targets: kinds ``"q"``, ``"k"``, ``"v"``, ``"attn_proj"``, ``"mlp_expand"``,
                ``"mlp_contract"``, ``"logits"`` (every block), ``"all"``, or full layer
                names like ``"blocks.0.attn.q"``.
            rank: ``r`` of every adapter that ``rank_pattern`` does not name.
            alpha: the paper's plain scalar ``α`` (PEFT's ``lora_alpha / r``) of every adapter
                that ``alpha_pattern`` does not name.
            rank_pattern, alpha_pattern: ``{kind or full layer name: value}``, per-layer ranks
                and scales (a full name wins over a kind; every key must name an adapted
                layer). ``α`` stays a plain scale: a layer's ``α`` does not change with its rank.
            dropout: PEFT's ``lora_dropout``: inverted dropout with this probability on each
                adapter's input (never on the frozen ``x W + b``), only while
                :attr:`training`. One mask per adapted layer input, drawn from
                :attr:`dropout_rng` in forward order; the q, k, v adapters of a block share the
                mask of their common input (as PEFT's one ``c_attn`` module does).
            seed: ``D ~ N(0, 1/f_in)``; ``U = 0``, so a new adapter starts as a no-op.
            freeze_base: base weights get no gradients at all (their matmuls are skipped).

        Afterwards :attr:`lora_targets`, :attr:`lora_ranks`, :attr:`lora_alphas` (per layer),
        :attr:`lora_rank`, :attr:`lora_alpha` (the defaults) and :attr:`lora_dropout` describe
        the adapters.

        Raises:
            ValueError: adapters already present, a rank that is not a positive integer, an
                ``α`` that is not a finite number, ``dropout`` outside ``[0, 1)``, unknown
                targets or pattern keys; the model is unchanged then.
        """
        if self._lora is not None:
            raise ValueError("this model already has LoRA adapters; merge_lora() or remove_lora() first")
        specs = lora_specs(self.config, targets, rank, rank_pattern)
        alphas = lora_layer_values(self.config, targets, alpha, alpha_pattern, what="alpha_pattern")
        for name, a in {"alpha": alpha, **alphas}.items():
            if isinstance(a, bool) or not isinstance(a, (int, float, np.floating)) or not math.isfinite(a):
                where = "" if name == "alpha" else f" (alpha_pattern, layer {name})"
                raise ValueError(f"LoRA alpha must be a finite number, got {a!r}{where}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float, np.floating)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be a probability in [0, 1), got {dropout!r}")
        self._lora = FlatParams(self.xp, self.dtype, lora_regions(specs), self.device)
        rng = np.random.default_rng(seed)
        for s in specs:
            if s.name.endswith("lora_D"):
                self._lora.views[s.name][...] = self.to_xp(rng.normal(0, 1 / math.sqrt(s.shape[0]), s.shape))
            self.params[s.name] = self._lora.views[s.name]
        self.lora_targets = list(alphas)                   # layer order
        self.lora_ranks = {s.name.rsplit(".", 1)[0]: s.shape[1] for s in specs if s.name.endswith("lora_D")}
        self.lora_alphas = {name: float(a) for name, a in alphas.items()}
        self.lora_alpha = float(alpha)
        self.lora_rank = rank
        self.lora_dropout = float(dropout)
        self.freeze_base = freeze_base
        self._grad_lora = None
        self._weights_cache = None

    def merge_lora(self) -> None:
        """``W ← W + α D U`` for every adapter, then drop the adapters (outputs unchanged).

        For tied logits the update goes into ``tok_emb.weight`` (as ``(α D U)ᵀ``), which also
        changes the embedding lookup; merging tied-logits adapters is therefore refused.

        Raises:
            ValueError: no adapters, a LoRA on tied logits, or a merged weight that would not be
                finite (an adapter holding NaN or inf, or ``α D U`` beyond the dtype); nothing is
                changed then.
        """
        self._apply_lora_delta(+1.0)
        self.remove_lora()

    def unmerge_lora(self, lora_state: Mapping[str, object], alpha: float | Mapping[str, float]) -> None:
        """Undo :meth:`merge_lora`: ``W ← W − α D U`` for the given adapters, then re-attach them.

        Args:
            lora_state: the adapters (``X.lora_D``, ``X.lora_U``); each layer's rank is read
                from its arrays.
            alpha: the ``α`` they were merged with: one number, or ``{layer: α}`` (as
                :attr:`lora_alphas` was before the merge).

        Raises:
            ValueError: an ``alpha`` mapping that does not name exactly the given layers; adapters
                or a result that are not finite (the model is left as it was).
        """
        names = sorted({k.rsplit(".", 1)[0] for k in lora_state}, key=[n for n, _, _ in fc_layers(self.config)].index)
        ranks = {fc: int(np.shape(to_numpy(lora_state[f"{fc}.lora_D"]))[1]) for fc in names}
        alphas = dict(alpha) if isinstance(alpha, Mapping) else {fc: alpha for fc in names}
        if set(alphas) != set(names):
            raise ValueError(f"alpha must give the α of exactly the adapted layers {names}, got {sorted(alphas)}")
        freeze_base = self.freeze_base
        self.add_lora(names, ranks[names[0]], alphas[names[0]], rank_pattern=ranks, alpha_pattern=alphas,
                      freeze_base=freeze_base)
        try:
            self.load_state_dict(lora_state, strict=False)
            self._apply_lora_delta(-1.0)
        except ValueError:                      # non-finite adapters or weights: as before the call
            self.remove_lora()
            self.freeze_base = freeze_base
            raise

    def _apply_lora_delta(self, sign: float) -> None:
        if self._lora is None:
            raise ValueError("this model has no LoRA adapters to merge")
        if "logits" in self.lora_targets and self.config.tie_weights:
            raise ValueError("cannot merge a LoRA on tied logits into tok_emb.weight (it would also "
                             "change the embedding); keep the adapter unmerged or untie the weights")

        def merged(fc):
            delta_w = sign * self.lora_alphas[fc] * (self.params[f"{fc}.lora_D"] @ self.params[f"{fc}.lora_U"])
            return self.params[f"{fc}.weight"] + delta_w

        # first every layer is checked (an adapter holding NaN, or α·D·U beyond the dtype), so
        # that a refusal changes nothing; then the same sums are computed again and written
        with np.errstate(over="ignore", invalid="ignore"):
            bad = [fc for fc in self.lora_targets if not bool(self.xp.all(self.xp.isfinite(merged(fc))))]
        if bad:
            raise ValueError(f"merging the LoRA adapters of {bad} would make their weights non-finite "
                             f"(an adapter holds NaN or inf, or α·D·U overflows {self.dtype_name}); "
                             "nothing was changed")
        for fc in self.lora_targets:
            self.params[f"{fc}.weight"][...] = merged(fc)

    def remove_lora(self) -> None:
        """Drop the adapters (without merging) and unfreeze the base."""
        for name in list(self.params):
            if ".lora_" in name:
                del self.params[name]
        self._lora = self._grad_lora = None
        self.lora_targets, self.lora_ranks, self.lora_alphas = [], {}, {}
        self.lora_dropout = 0.0
        self.freeze_base = False
        self._weights_cache = None

    def lora_state_dict(self) -> dict[str, np.ndarray]:
        """NumPy copies of the adapter parameters only (``X.lora_D``, ``X.lora_U``)."""
        return {k: v for k, v in self.state_dict().items() if ".lora_" in k}

"""A GPT's parameters as one object: the flat buffers and their named views, the gradient
buffers, the LoRA adapters, the layer table the forward and backward read, and the tied-weight
lookup gradient.

:class:`Parameters` owns a base :class:`~pedestrian.model.buffers.FlatParams` (every base
parameter a view into one flat array, a block's q, k, v one fused ``attn.qkv`` region, SwiGLU's
gate and up one ``mlp_gate_up``), its
gradient twin, and, after :meth:`Parameters.add_lora`, a :class:`~pedestrian.model.adapters.LoRA`
(the adapters' own flat buffer and settings). :class:`~pedestrian.model.GPT` holds one as
``model.parameters`` and hands its parameter methods on to it.
"""

from __future__ import annotations

import contextlib

import dataclasses
import math
from types import SimpleNamespace
from typing import Iterable, Mapping, NamedTuple

import numpy as np

from ..backend import to_numpy
from ..config import GPTConfig
from .adapters import LoRA
from .buffers import FlatBuffer, FlatParams, base_regions, qkv_columns
from .inputs import check_finite_state
from .layout import fc_layers, in_block, param_specs

__all__ = ["FC", "Delegated", "Norm", "Parameters"]


class Norm(NamedTuple):
    """A layer norm's ``weight`` and ``bias`` (``None`` when absent), or their gradients."""

    weight: object
    bias: object


class FC(NamedTuple):
    """A fully connected layer's ``weight``, ``bias`` (``None`` when absent) and LoRA adapters
    ``(name, D, U, lo, hi)`` on its output columns ``lo:hi`` -- or the gradients of all three.
    ``own_masks``: each adapter draws its own input-dropout mask (layers fused here that are
    PEFT modules of their own: the Llama family's q, k, v and gate, up), else one mask is shared
    (q, k, v: GPT-2's one ``c_attn``; :func:`qkv_shares_mask`)."""

    weight: object
    bias: object
    adapters: tuple
    own_masks: bool = False


def qkv_shares_mask(config) -> bool:
    """Whether the q, k, v adapters of a block share one input-dropout mask, as PEFT draws them:
    GPT-2's q, k, v are one module (``c_attn``, one ``lora_dropout``), the Llama family's three
    (``q_proj``, ``k_proj``, ``v_proj``, one mask each). The rule of
    :func:`pedestrian.interop.peft_modules.is_gpt2`: layer norms and the standard MLP."""
    return config.norm == "layernorm" and config.mlp == "standard"


class Parameters:
    """A GPT's parameters, their gradients and its LoRA adapters.

    Args:
        config: the model's :class:`GPTConfig`.
        xp, dtype, device: where the arrays live (the model's namespace, dtype and device);
            dtype_name: ``"float32"`` or ``"float64"`` (what loaded values must be finite in).
        numpy_views: the layer tables (:meth:`weight_table`, :meth:`grad_table`) hold NumPy
            views of the (CPU torch) buffers, for a chain that runs NumPy kernels; :attr:`params`
            and :attr:`grads` stay the buffers' own arrays.
        seed: the GPT-2 initialisation (weights ``N(0, 0.02)``, the two residual projections
            ``N(0, 0.02/√(2·n_blocks))``, biases 0, norm weights ``1 − norm_offset``), drawn in the order of
            the learned-position layout so that models differing only in ``position_encoding``
            start from the same weights.
        slots: the model's :class:`~pedestrian.model.slots.Slots`: a plugged layer's parameters
            replace those of the built-in layers of its slot (the others keep the values they
            have without it), each instance starting from its ``init``; ``None``: all built in.

    Attributes:
        base: the base parameters' :class:`FlatParams`; base_grads: its gradient twin (``None``
            until the first backward or :attr:`grads`).
        params: ``name -> view`` of every parameter, base then LoRA (what ``model.params`` is).
        specs: every base parameter's :class:`~pedestrian.model.layout.ParamSpec`, in order (a plugged
            layer's included, kind ``"plugged"``).
        lora: the :class:`LoRA` adapters, or ``None``.
        freeze_base: the base gets no gradients (its matmuls are skipped).
    """

    def __init__(self, config: GPTConfig, xp, dtype, dtype_name: str, device=None, *, seed: int = 0,
                 numpy_views: bool = False, slots=None):
        self.config = config
        self.numpy_views = numpy_views
        self.dtype_name = dtype_name
        self.slots = slots
        self.specs = param_specs(config) if slots is None else slots.specs()
        self.base = FlatParams(xp, dtype, base_regions(config, self.specs), device)
        self.base_names = [s.name for s in self.specs]
        self.params: dict = {name: self.base.views[name] for name in self.base_names}
        self.base_grads: FlatParams | None = None
        self.lora: LoRA | None = None
        self.freeze_base = False
        self._block_grads: FlatParams | None = None        # grad_table(shared_blocks=True)'s
        self._weight_table: SimpleNamespace | None = None
        self._base_table: SimpleNamespace | None = None    # weight_table() without the adapters
        #: forwards run the base alone, as if there were no adapters (:meth:`without_adapters`)
        self.adapters_off = False
        self._init_weights(seed)

    def _init_weights(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_blocks)
        # draw in the order of the learned-position layout, the table's draws discarded when there
        # is no table: models that differ only in position_encoding start from the same weights
        learned = dataclasses.replace(self.config, position_encoding="learned", rope_scaling=None, rope_layers=None,
                                     rope_local_base=None)
        norm_weight = 1.0 - self.config.norm_offset            # the norms start as x̂ (Gemma's 1 + w: w = 0)
        for s in param_specs(learned):
            if len(s.shape) == 2:
                std = resid_std if s.name.endswith(("attn_proj.weight", "mlp_contract.weight")) else 0.02
                value = rng.normal(0.0, std, size=s.shape)
            elif ".ln" in s.name or s.name.startswith("ln_final") or s.name.endswith("_norm.weight"):
                value = np.full(s.shape, norm_weight) if s.name.endswith("weight") else np.zeros(s.shape)
            else:
                value = np.zeros(s.shape)
            if s.name in self.params:
                self.params[s.name][...] = self.to_xp(value)
        for where, layer in ({} if self.slots is None else self.slots.instances()).items():
            for name, value in layer.initial().items():       # init() once per instance
                self.params[f"{where}.{name}"][...] = self.to_xp(value)

    # ------------------------------------------------------------------ values
    def to_xp(self, value):
        """``value`` (NumPy or nested lists) as an array of this model's backend, dtype and device."""
        return self.base.to_xp(value)

    @property
    def flat(self):
        """The flat base-parameter buffer (views in :attr:`params` alias it)."""
        return self.base.flat

    def num_params(self, trainable_only: bool = False) -> int:
        """Number of parameters (base + LoRA, or only those that get gradients)."""
        n_lora = 0 if self.lora is None else int(self.lora.weights.flat.shape[0])
        n_base = int(self.base.flat.shape[0])
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

    # ------------------------------------------------------------------ gradients
    def trainable_buffers(self) -> list[FlatBuffer]:
        """The flat buffers an optimizer updates: the base (unless frozen), then the LoRA adapters.

        Gradient buffers are created on first use. Call again after :meth:`add_lora` /
        :meth:`remove_lora` or a change of :attr:`freeze_base`: the buffers change.
        """
        self._grad_buffers()
        out = []
        if not self.freeze_base:
            out.append(FlatBuffer("base", self.base.flat, self.base_grads.flat, self.base.n_decay))
        if self.lora is not None:
            out.append(FlatBuffer("lora", self.lora.weights.flat, self.lora.grads.flat, self.lora.weights.n_decay))
        return out

    def _grad_buffers(self) -> None:
        if not self.freeze_base and self.base_grads is None:
            self.base_grads = self.base.like(base_regions(self.config, self.specs))
        if self.lora is not None:
            self.lora.grad_buffer()

    @property
    def grads(self) -> dict:
        """Gradients of the trainable parameters (views into the flat gradient buffers)."""
        self._grad_buffers()
        out = {}
        if not self.freeze_base:
            out.update({name: self.base_grads.views[name] for name in self.base_names})
        if self.lora is not None:
            out.update(self.lora.grads.views)
        return out

    # ------------------------------------------------------------------ the layer table
    def weight_table(self) -> SimpleNamespace:
        """:meth:`layer_table` of the parameters, built once per set of adapters (the views never
        change: loading and optimizer steps write into them); inside :meth:`without_adapters`
        the table of the base alone."""
        if self.adapters_off:
            if self._base_table is None:
                self._base_table = self.layer_table(grads=False, adapters=False)
            return self._base_table
        if self._weight_table is None:
            self._weight_table = self.layer_table(grads=False)
        return self._weight_table

    def grad_table(self, shared_blocks: bool = False) -> SimpleNamespace:
        """:meth:`layer_table` of the gradients (what a backward writes); with ``shared_blocks``
        every block writes into the same one-block buffer, :meth:`block_grads` (the whole-model
        gradient buffer's block regions are then never written)."""
        return self.layer_table(grads=True, shared_blocks=shared_blocks)

    def block_grads(self) -> FlatParams:
        """A gradient buffer of one block's regions, named ``blocks.0.…`` (made on first use)."""
        if self._block_grads is None:
            self._block_grads = self.base.like([r for r in base_regions(self.config, self.specs)
                                                if r[2][0][0].startswith("blocks.0.")])
        return self._block_grads

    def layer_table(self, grads: bool, shared_blocks: bool = False, adapters: bool = True) -> SimpleNamespace:
        """Every layer's parameters by role -- ``tok_emb``, ``pos_emb``, ``blocks[i].ln1`` /
        ``.qkv`` / ``.q_norm`` / ``.k_norm`` (``config.qk_norm``; else ``None``) / ``.attn_proj`` /
        ``.ln1_post`` / ``.ln2_post`` (``norm_placement`` post or sandwich; else ``None``, and
        ``ln1``, ``ln2`` ``None`` for post) / ``.ln2`` / ``.mlp_gate`` (SwiGLU; else ``None``) / ``.mlp_expand`` /
        ``.mlp_gate_up`` (SwiGLU; else ``None``) / ``.mlp_contract``, ``ln_final``,
        ``logits`` -- as :class:`Norm` and :class:`FC` entries (a mixture-of-experts block: ``.router``
        and ``.experts[e].mlp_gate_up`` / ``.mlp_contract``, its dense layers ``None``; else ``.router`` ``None``) (the block's q, k, v layers are one
        fused ``qkv`` layer, SwiGLU's gate and up one ``mlp_gate_up``; tied logits use ``W_tokᵀ``); a plugged layer's place holds its
        :class:`~pedestrian.model.slots.Instance` (``blocks[i].ln1``, ``.act``, ``.mlp``; ``act`` is
        ``None`` and ``mlp`` absent when built in, the built-in MLP's layers absent when plugged).
        With ``grads``, the gradient arrays instead, ``None`` where a parameter gets none (frozen
        or absent); ``adapters=False``: no layer carries its adapter."""
        c = self.config
        if grads:
            self._grad_buffers()
            base = {} if self.freeze_base else {**self.base_grads.views, **self.base_grads.regions}
            if shared_blocks:
                one = self.block_grads()
                one = {**one.views, **one.regions}
                base = {k: one[in_block(k, 0)] if k.startswith("blocks.") else v
                        for k, v in base.items()}
            P = {**base, **(self.lora.grads.views if self.lora is not None else {})}
        else:
            P = {**self.params, **self.base.regions}
        if c.tie_weights and "tok_emb.weight" in P:
            P["logits.weight"] = self.base.xp.matrix_transpose(P["tok_emb.weight"])
        if self.numpy_views:                               # (CPU tensors: views, no copies)
            P = {name: to_numpy(a) for name, a in P.items()}
        lora = set(self.lora_targets) if adapters else set()

        S = self.slots

        def norm(name):
            plugged = S and S.entry("norm", name, P)
            return plugged or Norm(P.get(f"{name}.weight"), P.get(f"{name}.bias"))

        def mlp(i):
            p = f"blocks.{i}"
            if S and "mlp" in S.plugged:
                return dict(mlp=S.entry("mlp", f"{p}.mlp", P))
            if c.is_moe(i):                                  # the router and every expert's SwiGLU
                return dict(router=FC(P.get(f"{p}.router.weight"), None, ()), act=None,
                            mlp_gate=None, mlp_expand=None, mlp_contract=None, mlp_gate_up=None,
                            experts=[experts(f"{p}.experts.{e}") for e in range(c.n_experts)])
            swiglu = c.mlp == "swiglu"
            gate_up = ((f"{p}.mlp_gate", 0, c.d_mlp), (f"{p}.mlp_expand", c.d_mlp, 2 * c.d_mlp))
            return dict(mlp_gate=fc(f"{p}.mlp_gate") if swiglu else None,
                        mlp_expand=fc(f"{p}.mlp_expand"), mlp_contract=fc(f"{p}.mlp_contract"),
                        mlp_gate_up=fc(f"{p}.mlp_gate_up", gate_up, own_masks=True) if swiglu else None,
                        act=S and S.entry("activation", f"{p}.act", P))

        def experts(p):
            gate_up = ((f"{p}.mlp_gate", 0, c.d_expert), (f"{p}.mlp_expand", c.d_expert, 2 * c.d_expert))
            return SimpleNamespace(mlp_gate_up=fc(f"{p}.mlp_gate_up", gate_up, own_masks=True),
                                   mlp_contract=fc(f"{p}.mlp_contract"))

        def fc(name, parts=None, own_masks=False):
            """``parts``: the adapted layers fused in this one, ``(name, lo, hi)`` (default: itself)."""
            adapters = tuple((a, P[f"{a}.lora_D"], P[f"{a}.lora_U"], lo, hi)
                             for a, lo, hi in (parts or ((name, 0, None),)) if a in lora)
            return FC(P.get(f"{name}.weight"), P.get(f"{name}.bias"), adapters, own_masks)

        def extra_norms(p):
            """q/k norms (always built in) and the norms after the sublayers (``None`` when absent)."""
            q_norm = Norm(P.get(f"{p}.attn.q_norm.weight"), None) if c.qk_norm is not None else None
            k_norm = Norm(P.get(f"{p}.attn.k_norm.weight"), None) if c.qk_norm is not None else None
            post = c.norm_placement != "pre"
            return dict(q_norm=q_norm, k_norm=k_norm, ln1_post=norm(f"{p}.ln1_post") if post else None,
                        ln2_post=norm(f"{p}.ln2_post") if post else None)

        pre = c.norm_placement != "post"
        blocks = [SimpleNamespace(ln1=norm(f"blocks.{i}.ln1") if pre else None,
                                  qkv=fc(f"blocks.{i}.attn.qkv", tuple((f"blocks.{i}.attn.{h}", lo, hi)
                                                                       for h, (lo, hi) in qkv_columns(c)),
                                         own_masks=not qkv_shares_mask(c)),
                                  attn_proj=fc(f"blocks.{i}.attn_proj"), ln2=norm(f"blocks.{i}.ln2") if pre else None,
                                  **extra_norms(f"blocks.{i}"), **{"router": None, **mlp(i)})
                  for i in range(c.n_blocks)]
        table = SimpleNamespace(tok_emb=P.get("tok_emb.weight"), pos_emb=P.get("pos_emb.weight"), blocks=blocks,
                                ln_final=norm("ln_final"), logits=fc("logits"))
        return table

    # ------------------------------------------------------------------ LoRA adapters
    @property
    def lora_targets(self) -> list[str]:
        """The adapted layers, in layer order (``[]`` without adapters)."""
        return [] if self.lora is None else self.lora.targets

    @property
    def lora_ranks(self) -> dict[str, int]:
        """``{layer: r}`` of every adapter (``{}`` without adapters)."""
        return {} if self.lora is None else self.lora.ranks

    @property
    def lora_alphas(self) -> dict[str, float]:
        """``{layer: α}`` of every adapter (``{}`` without adapters)."""
        return {} if self.lora is None else self.lora.alphas

    @property
    def lora_rank(self) -> int | None:
        """:meth:`add_lora`'s default rank (``None`` without adapters)."""
        return None if self.lora is None else self.lora.rank

    @property
    def lora_alpha(self) -> float:
        """:meth:`add_lora`'s default ``α`` (PEFT's ``lora_alpha / r``; ``1.0`` without adapters)."""
        return 1.0 if self.lora is None else self.lora.alpha

    @property
    def lora_dropout(self) -> float:
        """PEFT's ``lora_dropout`` of the adapters (``0.0`` without adapters)."""
        return 0.0 if self.lora is None else self.lora.dropout

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
                :attr:`dropout_rng` in forward order, as PEFT draws them: one per PEFT module.
                A GPT-2-shaped model's q, k, v adapters share the mask of their common input
                (PEFT's one ``c_attn`` module); the Llama family draws one each for q, k, v (in
                that order; ``q_proj``, ``k_proj``, ``v_proj``) and for gate, up.
            seed: ``D ~ N(0, 1/f_in)``; ``U = 0``, so a new adapter starts as a no-op.
            freeze_base: base weights get no gradients at all (their matmuls are skipped).

        Afterwards :attr:`lora_targets`, :attr:`lora_ranks`, :attr:`lora_alphas` (per layer),
        :attr:`lora_rank`, :attr:`lora_alpha` (the defaults) and :attr:`lora_dropout` describe
        the adapters.

        Raises:
            ValueError: adapters already present, a plugged MLP, a rank that is not a positive integer, an
                ``α`` that is not a finite number, ``dropout`` outside ``[0, 1)``, unknown
                targets or pattern keys; the model is unchanged then.
        """
        if self.lora is not None:
            raise ValueError("this model already has LoRA adapters; merge_lora() or remove_lora() first")
        if self.slots is not None and "mlp" in self.slots.plugged:
            raise ValueError("LoRA adapters sit on the built-in layers, and this model's mlp slot holds a plugged "
                             "layer; give the plugged layer parameters of its own to train, or plug norm/activation only")
        self.lora = LoRA(self.config, self.base, targets, rank, alpha, rank_pattern=rank_pattern,
                         alpha_pattern=alpha_pattern, dropout=dropout, seed=seed)
        self.params.update(self.lora.weights.views)
        self.freeze_base = freeze_base
        self._weight_table = self._base_table = None

    @contextlib.contextmanager
    def without_adapters(self):
        """``with model.without_adapters():`` forwards run the base alone, as if the LoRA adapters
        were not there (PEFT's ``disable_adapter()``): DPO's frozen reference, with no second copy
        of the weights. Such a forward has no backward (it raises). For the whole model: other
        threads' forwards meanwhile run without the adapters too. Without adapters: no change."""
        before, self.adapters_off = self.adapters_off, True
        try:
            yield
        finally:
            self.adapters_off = before

    def merge_lora(self) -> None:
        """``W ← W + α D U`` for every adapter, then drop the adapters (outputs unchanged).

        For tied logits the update goes into ``tok_emb.weight`` (as ``(α D U)ᵀ``), which also
        changes the embedding lookup; merging tied-logits adapters is therefore refused.

        Raises:
            ValueError: no adapters, a LoRA on tied logits, or a merged weight that would not be
                finite (an adapter holding NaN or inf, or ``α D U`` beyond the dtype); nothing is
                changed then.
        """
        if self.lora is None:
            raise ValueError("this model has no LoRA adapters to merge")
        self.lora.merge_into(self.params, +1.0, self.dtype_name)
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
            self.lora.merge_into(self.params, -1.0, self.dtype_name)
        except ValueError:                      # non-finite adapters or weights: as before the call
            self.remove_lora()
            self.freeze_base = freeze_base
            raise

    def remove_lora(self) -> None:
        """Drop the adapters (without merging) and unfreeze the base."""
        for name in list(self.params):
            if ".lora_" in name:
                del self.params[name]
        self.lora = None
        self.freeze_base = False
        self._weight_table = self._base_table = None

    def lora_state_dict(self) -> dict[str, np.ndarray]:
        """NumPy copies of the adapter parameters only (``X.lora_D``, ``X.lora_U``)."""
        return {k: v for k, v in self.state_dict().items() if ".lora_" in k}


class Delegated:
    """A :class:`~pedestrian.model.GPT` attribute that is its :class:`Parameters`' own, of the
    same name (a method or a property, its docstring included): ``model.add_lora(...)`` is
    ``model.parameters.add_lora(...)``. On the class it is the :class:`Parameters` method or
    property itself (for ``help`` and signatures); ``doc`` documents a plain attribute.

    Raises:
        AttributeError: setting it on a model, unless ``settable``.
    """

    def __init__(self, doc: str | None = None, *, settable: bool = False):
        self.__doc__, self.settable = doc, settable

    def __set_name__(self, owner, name):
        self.name = name
        self.target = vars(Parameters).get(name)           # None: an attribute of the instance
        self.__doc__ = self.__doc__ or self.target.__doc__

    def __get__(self, model, owner=None):
        if model is None:
            return self if self.target is None else self.target
        return getattr(model.parameters, self.name)

    def __set__(self, model, value):
        if not self.settable:
            raise AttributeError(f"GPT.{self.name} cannot be set (it is model.parameters.{self.name})")
        setattr(model.parameters, self.name, value)

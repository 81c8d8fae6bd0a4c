"""The GPT: parameters, the forward as the list ``a0 … a12``, the backward as that list reversed.

Paper conclusion ("minimalistic transformer"), restated in docs/EQUATIONS.md::

    a0 (B,T) ints
    a1 = tok-emb + pos-emb (learned positions; else tok-emb)  (B,T,d)
    block i (x = a1 for the first block, the previous a10 after):
      a2 = LN1(x);  a3 = MHA(a2) (RoPE: q, k rotated first);  a4 = FC_attProj(a3);  a5 = x + a4
      a6 = LN2(a5); a7 = FC_expand(a6);  a8 = g(a7);  a9 = FC_contract(a8);  a10 = a5 + a9
    a11 = LN_final(a10);  a12 = logits = FC_logits(a11)     (B,T,V)

Each step is one call of a layer function. Which functions -- the paper's reference layers
(:mod:`pedestrian.layers`) or the fast kernels (:mod:`pedestrian.kernels`), same names and
signatures -- is chosen once, by ``GPT(..., kernels=...)``.

Parameter names (stable; ``W`` is ``(f_in, f_out)``, ``y = x W + b``)::

    tok_emb.weight (V, d)                 pos_emb.weight (context_length, d)   -- learned positions only
    blocks.{i}.ln1.weight / .bias (d,)
    blocks.{i}.attn.q.weight (d, n_heads·d_qk)    .bias     (head h: columns h·d_qk …)
    blocks.{i}.attn.k.weight (d, n_heads·d_qk)    .bias
    blocks.{i}.attn.v.weight (d, n_heads·d_head)  .bias
    blocks.{i}.attn_proj.weight (n_heads·d_head, d) .bias
    blocks.{i}.ln2.weight / .bias
    blocks.{i}.mlp_expand.weight (d, d_mlp)  .bias     blocks.{i}.mlp_contract.weight (d_mlp, d) .bias
    ln_final.weight / .bias
    logits.weight (d, V), logits.bias (V,)          -- only when not tie_weights
    X.lora_D (f_in, r_X), X.lora_U (r_X, f_out)      -- LoRA on FC layer X (see add_lora)

Storage: all base parameters live in one flat buffer (``GPT.flat``; decayed 2-D weights first,
then the 1-D ones) and ``GPT.params`` holds views into it; the q, k, v weights of a block are
column slices of one fused ``(d, 2·n_heads·d_qk + n_heads·d_head)`` matrix, the block's
``attn.qkv`` layer (three FC layers of the same input are one FC layer with their columns side
by side). Gradients mirror this in flat gradient buffers, so an optimizer updates everything
with a few vectorised operations (:meth:`GPT.trainable_buffers`).
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Iterable, Mapping, NamedTuple

import numpy as np

from .backend import array_namespace, is_torch_array, namespace_for, resolve_dtype, to_numpy
from .config import GPTConfig, fc_layers, lora_layer_values, lora_specs, param_specs
from .kernels import kernels_for
from .kernels.workspace import Workspace
from .kv_cache import KVCache
from .layers.loss import IGNORE_INDEX

__all__ = ["GPT", "GPTConfig", "FlatBuffer", "check_tokens", "check_finite_state"]


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


def check_finite_state(state: Mapping[str, object], dtype: str) -> dict[str, np.ndarray]:
    """``state``'s arrays as NumPy arrays of ``dtype``, after checking that every value is finite.

    Args:
        state: name -> array (NumPy, torch or nested lists).
        dtype: ``"float32"`` or ``"float64"``: the values must be finite *in it* (1e39 is a
            finite float64 but ``inf`` as float32).

    Returns:
        name -> ``np.ndarray`` of ``dtype``.

    Raises:
        ValueError: names every tensor holding a NaN or ±inf with its counts, e.g.
            ``blocks.0.ln1.weight (1 NaN, 0 inf of 768 values)`` -- a NaN weight makes every
            logit NaN, so no loader lets one in (issue 13: no silent numbers).
    """
    out, bad = {}, []
    for k, v in state.items():
        with np.errstate(over="ignore", invalid="ignore"):
            a = np.asarray(to_numpy(v)).astype(dtype, copy=False)
        finite = np.isfinite(a)
        if not finite.all():
            n_nan = int(np.count_nonzero(np.isnan(a)))
            bad.append(f"{k} ({n_nan} NaN, {a.size - n_nan - int(np.count_nonzero(finite))} inf of {a.size} values)")
        out[k] = a
    if bad:
        raise ValueError(f"parameters hold non-finite values as {dtype}: {', '.join(bad)}; nothing was loaded "
                         "(a NaN or infinite weight makes the logits NaN)")
    return out


def check_tokens(tokens, vocab_size: int, context_length: int, what: str = "token ids") -> None:
    """Validate a ``(B, T)`` integer token batch.

    Raises:
        TypeError: not an integer array.
        ValueError: not 2-D, empty, ``T > context_length``, or an id outside ``[0, vocab_size)``.
    """
    integral = (tokens.dtype.kind in "iu" if type(tokens) is np.ndarray
                else array_namespace(tokens).isdtype(tokens.dtype, "integral"))
    if not integral:
        raise TypeError(
            f"{what} must be an integer array, got dtype {tokens.dtype}; "
            "encode text with the tokenizer first (e.g. np.asarray(ids, dtype=np.int64))"
        )
    if tokens.ndim != 2:
        raise ValueError(f"{what} must have shape (B, T), got shape {tuple(tokens.shape)}; "
                         "add a batch axis with tokens[None, :]")
    B, T = tokens.shape
    if B == 0 or T == 0:
        raise ValueError(f"{what} must not be empty, got shape {(B, T)}")
    if T > context_length:
        raise ValueError(
            f"sequence length T={T} exceeds the model's context_length={context_length}; "
            f"feed at most the last {context_length} tokens"
        )
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"{what} contain {bad}, outside [0, vocab_size={vocab_size}); "
            "the tokenizer and the model config do not match"
        )


class FlatParams:
    """A flat 1-D buffer and named views into it (decayed region first).

    Attributes:
        flat: the ``(n,)`` buffer.
        views: ``name -> view`` with the parameter's shape.
        n_decay: the first ``n_decay`` entries of ``flat`` get weight decay.
    """

    def __init__(self, xp, dtype, regions, device=None):
        # regions: list of (region_shape, decay, members); members: list of (name, column slice or None)
        regions = sorted(regions, key=lambda r: not r[1])          # decayed first, stable
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


def _base_regions(config: GPTConfig):
    specs = {s.name: s for s in param_specs(config)}
    hq, hv = config.n_heads * config.d_qk, config.n_heads * config.d_head
    cols = {"q": (0, hq), "k": (hq, 2 * hq), "v": (2 * hq, 2 * hq + hv)}
    regions, fused_done = [], set()
    for name, spec in specs.items():
        parts = name.split(".")
        if len(parts) == 5 and parts[2] == "attn":                # blocks.i.attn.{q,k,v}.{weight,bias}
            key = (parts[1], parts[4])
            if key in fused_done:
                continue
            fused_done.add(key)
            stem = f"blocks.{parts[1]}.attn"
            shape = (config.d_model, 2 * hq + hv) if parts[4] == "weight" else (2 * hq + hv,)
            members = [(f"{stem}.{h}.{parts[4]}", cols[h]) for h in "qkv"]
            regions.append((shape, spec.decay, members))
        else:
            regions.append((spec.shape, spec.decay, [(name, None)]))
    return regions



def _resolve_device(backend: str, device):
    """``None`` (the backend's default: the CPU) or a torch device; the NumPy backend has only the CPU."""
    if device is None or (backend == "numpy" and str(device) == "cpu"):
        return None
    if backend != "torch":
        raise ValueError(f"device {device!r} needs backend='torch' (NumPy arrays live on the CPU)")
    import torch

    return torch.device(device)


class GPT:
    """A GPT whose backward is written by hand (no autograd anywhere).

    Args:
        config: a :class:`GPTConfig`.
        seed: initialisation seed (GPT-2 scheme: weights ``N(0, 0.02)``, the two residual
            projections ``N(0, 0.02/√(2·n_blocks))``, biases 0, layer-norm weights 1). Also
            seeds the dropout generator. Models that differ only in ``position_encoding`` get
            the same weights (the learned table aside).
        dtype: ``"float32"`` (default) or ``"float64"``.
        backend: ``"numpy"`` (default) or ``"torch"`` (tensors used as plain arrays).
        device: where every array lives: ``None`` / ``"cpu"``, or for the torch backend any torch
            device (``"cuda"``, ``"cuda:1"``); parameters, gradients, activations and KV caches
            are made there, and NumPy token ids are moved there.
        kernels: ``"fast"`` (default; :mod:`pedestrian.kernels`) or ``"reference"`` (the paper's
            layers, :mod:`pedestrian.layers`); ``None`` reads ``PEDESTRIAN_KERNELS``. Both compute
            the same numbers (to rounding; tested to 1e-12 in float64).

    Use::

        model = GPT(GPTConfig(vocab_size=65, context_length=64, d_model=128, n_heads=4, n_blocks=4))
        loss = model.loss(tokens, targets)     # tokens, targets: (B, T) ints
        grads = model.backward()               # name -> gradient, same shapes as model.params

    Raises:
        TypeError: ``config`` is not a :class:`GPTConfig`.
        ValueError: bad dtype, backend or kernels names; a device other than the CPU for the
            NumPy backend.
    """

    def __init__(self, config: GPTConfig, *, seed: int = 0, dtype: str = "float32",
                 backend: str = "numpy", kernels: str | None = None, device=None):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.backend = backend
        self.xp = namespace_for(backend)
        self.dtype = resolve_dtype(self.xp, dtype)
        self.dtype_name = dtype if isinstance(dtype, str) else str(dtype)
        self.kernels = kernels_for(kernels)
        self.device = _resolve_device(backend, device)
        self._base = FlatParams(self.xp, self.dtype, _base_regions(config), self.device)
        self._base_names = [s.name for s in param_specs(config)]
        self.params: dict = {name: self._base.views[name] for name in self._base_names}
        self._grad_base: FlatParams | None = None
        self._lora: FlatParams | None = None
        self._grad_lora: FlatParams | None = None
        self.lora_alpha: float = 1.0                       # add_lora's defaults (PEFT's r, lora_alpha / r)
        self.lora_rank: int | None = None
        self.lora_targets: list[str] = []
        self.lora_ranks: dict[str, int] = {}               # per adapted layer
        self.lora_alphas: dict[str, float] = {}
        self.lora_dropout: float = 0.0
        self.freeze_base = False
        self.training = True
        self.dropout_rng = np.random.default_rng(seed + 1_000_003)
        self._acts: SimpleNamespace | None = None          # what the last forward kept
        self._deltas: dict = {}
        self._workspace = Workspace()                      # the fast kernels' memory pool
        self._weights_cache: dict | None = None
        self._init_weights(seed)

    @property
    def kernels_name(self) -> str:
        """``"fast"`` or ``"reference"``: which layer functions this model runs."""
        return "reference" if self.kernels.__name__.endswith(".layers") else "fast"

    # ------------------------------------------------------------------ parameters
    def _init_weights(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_blocks)
        # draw in the order of the learned-position layout, the table's draws discarded when there
        # is no table: models that differ only in position_encoding start from the same weights
        learned = dataclasses.replace(self.config, position_encoding="learned")
        for s in param_specs(learned):
            if len(s.shape) == 2:
                std = resid_std if s.name.endswith(("attn_proj.weight", "mlp_contract.weight")) else 0.02
                value = rng.normal(0.0, std, size=s.shape)
            elif ".ln" in s.name or s.name.startswith("ln_final"):
                value = np.ones(s.shape) if s.name.endswith("weight") else np.zeros(s.shape)
            else:
                value = np.zeros(s.shape)
            if s.name in self.params:
                self.params[s.name][...] = self._to_xp(value)

    def _to_xp(self, value):
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
                is NaN or ±inf in the model's dtype (:func:`check_finite_state`), nothing changed.
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
            self.params[k][...] = self._to_xp(a)

    # ------------------------------------------------------------------ LoRA
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
        self._lora = FlatParams(self.xp, self.dtype, [(s.shape, True, [(s.name, None)]) for s in specs], self.device)
        rng = np.random.default_rng(seed)
        for s in specs:
            if s.name.endswith("lora_D"):
                self._lora.views[s.name][...] = self._to_xp(rng.normal(0, 1 / math.sqrt(s.shape[0]), s.shape))
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

    # ------------------------------------------------------------------ inputs
    def _as_tokens(self, tokens, what: str):
        xp = self.xp
        if isinstance(tokens, (list, tuple)):
            tokens = np.asarray(tokens)
        if self.backend == "torch" and isinstance(tokens, np.ndarray):
            import torch

            if not np.issubdtype(tokens.dtype, np.integer):
                raise TypeError(f"{what} must be an integer array, got dtype {tokens.dtype}")
            tokens = torch.as_tensor(tokens.astype(np.int64, copy=False), device=self.device)
        elif self.backend == "torch" and self.device is not None and is_torch_array(tokens):
            tokens = tokens.to(self.device)
        if type(tokens) is np.ndarray and self.backend == "numpy":
            return tokens
        array_namespace(tokens)  # raises TypeError for unsupported types
        return tokens if self.backend == "torch" else xp.asarray(tokens)

    def _as_signal(self, delta, shape):
        """An upstream error signal as an array of this model's backend and dtype."""
        if tuple(np.shape(delta)) != tuple(shape):
            raise ValueError(f"delta_logits must have the logits' shape {tuple(shape)}, got "
                             f"{tuple(np.shape(delta))}")
        return self._to_xp(to_numpy(delta))

    def _check_targets(self, targets, tokens) -> None:
        xp = self.xp
        if not xp.isdtype(targets.dtype, "integral"):
            raise TypeError(f"targets must be an integer array, got dtype {targets.dtype}")
        if tuple(targets.shape) != tuple(tokens.shape):
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal tokens shape "
                             f"{tuple(tokens.shape)} (position t predicts token t+1)")
        bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= self.config.vocab_size))
        if bool(xp.any(bad)):
            value = int(targets[bad][0])
            raise ValueError(f"target id {value} is outside [0, vocab_size={self.config.vocab_size}) "
                             f"and is not the ignore index {IGNORE_INDEX}")

    # ------------------------------------------------------------------ buffers
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
            self._grad_base = FlatParams(self.xp, self.dtype, _base_regions(self.config), self.device)
        if self._lora is not None and self._grad_lora is None:
            specs = lora_specs(self.config, self.lora_targets, self.lora_rank, self.lora_ranks)
            self._grad_lora = FlatParams(self.xp, self.dtype, [(s.shape, True, [(s.name, None)]) for s in specs],
                                         self.device)

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

    def replica(self) -> "GPT":
        """A model that shares this one's parameter arrays but has its own activations, gradient
        buffers and memory pool: one slice of a batch split over threads
        (:class:`pedestrian.parallel.DataParallel`). Adapters added or removed later are not
        seen by an existing replica (make a new one).
        """
        r = object.__new__(GPT)
        r.__dict__.update({k: v for k, v in self.__dict__.items()
                           if k not in ("_grad_base", "_grad_lora", "_acts", "_deltas", "_workspace", "params")})
        r.params = dict(self.params)
        r._grad_base = r._grad_lora = r._acts = None
        r._deltas = {}
        r._workspace = Workspace()
        return r

    def _weights(self) -> SimpleNamespace:
        """:meth:`_layer_table` of the parameters, built once per set of adapters (the views never
        change: loading and optimizer steps write into them)."""
        if self._weights_cache is None:
            self._weights_cache = self._layer_table(grads=False)
        return self._weights_cache

    def _layer_table(self, grads: bool) -> SimpleNamespace:
        """Every layer's parameters by role -- ``tok_emb``, ``pos_emb``, ``blocks[i].ln1`` /
        ``.qkv`` / ``.attn_proj`` / ``.ln2`` / ``.mlp_expand`` / ``.mlp_contract``, ``ln_final``,
        ``logits`` -- as :class:`Norm` and :class:`FC` entries (the block's q, k, v layers are one
        fused ``qkv`` layer; tied logits use ``W_tokᵀ``). With ``grads``, the gradient arrays
        instead, ``None`` where a parameter gets none (frozen or absent)."""
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
        hq, hv = c.n_heads * c.d_qk, c.n_heads * c.d_head

        def norm(name):
            return Norm(P.get(f"{name}.weight"), P.get(f"{name}.bias"))

        def fc(name, parts=((None, 0, None),)):
            adapters = tuple((a, P[f"{a}.lora_D"], P[f"{a}.lora_U"], lo, hi) for a, lo, hi in
                             ((name if part is None else f"{name[:-3]}{part}", lo, hi) for part, lo, hi in parts)
                             if a in lora)
            return FC(P.get(f"{name}.weight"), P.get(f"{name}.bias"), adapters)

        qkv_parts = (("q", 0, hq), ("k", hq, 2 * hq), ("v", 2 * hq, 2 * hq + hv))
        blocks = [SimpleNamespace(ln1=norm(f"blocks.{i}.ln1"), qkv=fc(f"blocks.{i}.attn.qkv", qkv_parts),
                                  attn_proj=fc(f"blocks.{i}.attn_proj"), ln2=norm(f"blocks.{i}.ln2"),
                                  mlp_expand=fc(f"blocks.{i}.mlp_expand"),
                                  mlp_contract=fc(f"blocks.{i}.mlp_contract"))
                  for i in range(c.n_blocks)]
        return SimpleNamespace(tok_emb=P.get("tok_emb.weight"), pos_emb=P.get("pos_emb.weight"), blocks=blocks,
                               ln_final=norm("ln_final"), logits=fc("logits"))

    # ------------------------------------------------------------------ forward
    def forward(self, tokens, targets=None, *, kv_cache: KVCache | None = None, n_total: int | None = None,
                keep_activations: bool = True):
        """Run ``a0 → a12`` and keep what the backward needs.

        Args:
            tokens: ``(B, T)`` integer ids in ``[0, vocab_size)``, ``T <= context_length``
                (NumPy array, list, or -- on the torch backend -- a tensor).
            targets: optional ``(B, T)`` ids (``tokens`` shifted by one) or ``-100`` to ignore;
                when given the mean loss is computed (:meth:`loss`).
            kv_cache: a :class:`~pedestrian.kv_cache.KVCache`: the tokens continue the cached
                ones (positions from ``kv_cache.positions``; RoPE rotates the new keys by them
                before they are cached), their keys and values are appended,
                and ``kv_cache.length`` grows by ``T`` (generation; no backward follows).
            n_total: divide the loss by this many targets instead of the number counted here
                (one slice of a larger batch: the slices' losses and gradients then add up).
            keep_activations: ``False`` keeps only the logits (no :meth:`activations`,
                :meth:`attention_weights` or backward for this step): each block's arrays are
                let go when the block ends. For inference loops (:func:`pedestrian.generate.generate`
                passes it: measured 10 µs of ~340 per token at char-small widths).

        Returns:
            logits ``(B, T, vocab_size)`` in the model's dtype and backend. Arrays of an earlier
            step are reused only when nothing outside the model refers to them any more, so
            arrays the caller kept never change.

        Raises:
            TypeError: non-integer tokens or targets.
            ValueError: ids out of range, ``T > context_length`` (or more than the cache has
                room for), shape mismatch, a cache made for another model or batch size.
        """
        c = self.config
        tokens = self._as_tokens(tokens, "token ids")
        room = c.context_length
        if kv_cache is not None:
            if kv_cache.model is not self:
                raise ValueError("this KVCache was made for a different model; make one with KVCache(model, B)")
            if tokens.ndim == 2 and tokens.shape[0] != kv_cache.batch_size:
                raise ValueError(f"tokens have batch size {tokens.shape[0]} but the cache was made for "
                                 f"{kv_cache.batch_size}")
            room = c.context_length - kv_cache.length
            if tokens.ndim == 2 and tokens.shape[1] > room:
                raise ValueError(
                    f"the cache holds {kv_cache.length} tokens and {tokens.shape[1]} more would exceed "
                    f"context_length={c.context_length}; " + (
                        f"learned positions are absolute, there is no position {c.context_length}: "
                        f"reset the cache and feed at most the last {c.context_length} tokens"
                        if c.learned_positions else
                        "drop the oldest with cache.drop_oldest(n) first")
                    + " (generate() does this for you)")
            if (c.learned_positions and tokens.ndim == 2
                    and kv_cache.offset + kv_cache.length + tokens.shape[1] > c.context_length):
                raise ValueError(f"positions up to {kv_cache.offset + kv_cache.length + tokens.shape[1] - 1} "
                                 f"do not exist in the learned table of context_length={c.context_length} "
                                 "rows; reset the cache with first_position=0")
        check_tokens(tokens, c.vocab_size, c.context_length)
        if targets is not None:
            targets = self._as_tokens(targets, "targets")
            self._check_targets(targets, tokens)
        self._acts, self._deltas = None, {}                # the last step's arrays are free to reuse
        self._workspace.new_step()
        with self._workspace:
            logits = self._forward(tokens, targets, kv_cache, n_total, keep_activations)
        if kv_cache is not None:
            kv_cache.length += tokens.shape[1]
        return logits

    def _forward(self, tokens, targets, kv_cache, n_total, keep=True):
        c, K, W = self.config, self.kernels, self._weights()
        positions = None if kv_cache is None else kv_cache.positions(tokens.shape[1])   # None: 0 … T-1
        rope = c.position_encoding == "rope"
        f = SimpleNamespace(a0=tokens, blocks=[], lora={}, loss=None, kept=keep)
        a1, f.emb = K.embedding_forward(tokens, W.tok_emb, W.pos_emb, positions)
        f.a1, f.drop1 = self._dropout(a1)                                        # (B, T, d)
        x = f.a1
        for i, w in enumerate(W.blocks):
            b = SimpleNamespace()
            b.a2, b.ln1 = K.layernorm_forward(x, w.ln1.weight, w.ln1.bias, c.ln_eps)   # (B, T, d)
            qkv = self._fc_forward(w.qkv, b.a2, f.lora)                              # (B, T, H·(2d_qk+d_head))
            if rope:                                                                 # q, k turned by position
                qkv, b.rope = K.rope_forward(qkv, c.n_heads, c.d_qk, positions, base=c.rope_base, rotated=c.rope_dims)
            b.a3, b.attn = K.multi_head_attention_forward(                           # (B, T, H·d_head)
                qkv, c.n_heads, c.d_qk, c.d_head, causal=c.causal,
                kv_cache=None if kv_cache is None else kv_cache.block(i))
            b.a4, b.drop4 = self._dropout(self._fc_forward(w.attn_proj, b.a3, f.lora))  # (B, T, d)
            b.a5 = K.add(x, b.a4)                                                    # skip
            b.a6, b.ln2 = K.layernorm_forward(b.a5, w.ln2.weight, w.ln2.bias, c.ln_eps)
            b.a7 = self._fc_forward(w.mlp_expand, b.a6, f.lora)                      # (B, T, d_mlp)
            b.a8, b.act = K.activation_forward(b.a7, c.activation)
            b.a9, b.drop9 = self._dropout(self._fc_forward(w.mlp_contract, b.a8, f.lora))  # (B, T, d)
            b.a10 = x = K.add(b.a5, b.a9)                                            # skip
            if keep:                                                                 # else let go now
                f.blocks.append(b)
        f.a11, f.ln_final = K.layernorm_forward(x, W.ln_final.weight, W.ln_final.bias, c.ln_eps)
        f.a12 = self._fc_forward(W.logits, f.a11, f.lora)                            # (B, T, V)
        if targets is not None:
            f.loss_value, f.loss = K.cross_entropy_forward(f.a12, targets, n_total=n_total)
        self._acts = f
        return f.a12

    def _fc_forward(self, fc: "FC", x, lora_caches: dict):
        """``y = x W + b``, plus ``α dropout(x) D U`` on the columns of each LoRA adapter of the
        layer (one dropout mask for the layer's input, shared by its adapters)."""
        y, _ = self.kernels.linear_forward(x, fc.weight, fc.bias)
        if not fc.adapters:
            return y
        mask = self._lora_mask(x)
        for name, lora_D, lora_U, lo, hi in fc.adapters:
            y_lora, lora_caches[name] = self.kernels.lora_forward(x, lora_D, lora_U, self.lora_alphas[name], mask)
            y[..., lo:hi] += y_lora
        return y

    def _lora_mask(self, x):
        """The adapters' input dropout mask (``None``: no dropout, or not training)."""
        if not self.training or self.lora_dropout == 0.0:
            return None
        return self.kernels.dropout_forward(x, self.lora_dropout, self.dropout_rng)[1]

    def _dropout(self, x):
        p = self.config.dropout if self.training else 0.0
        return (x, None) if p == 0.0 else self.kernels.dropout_forward(x, p, self.dropout_rng)

    def loss(self, tokens, targets, *, n_total: int | None = None) -> float:
        """Forward with targets; returns the mean next-token cross-entropy (nats per token).

        If every target is the ignore index ``-100`` the loss is ``0.0`` and the gradients
        are zero (documented convention; no NaN). ``n_total``: see :meth:`forward`.
        """
        self.forward(tokens, targets, n_total=n_total)
        return float(self._acts.loss_value)

    # ------------------------------------------------------------------ backward
    def backward(self, delta_logits=None, *, keep_deltas: bool = False) -> dict:
        """Hand-derived backward from ``Δ12`` down to ``Δ1`` and the embedding tables.

        Args:
            delta_logits: the upstream signal ``Δ12 = dL/dlogits`` ``(B, T, vocab_size)`` of a
                loss of your own (the forward then needs no targets); ``None`` (default) takes
                the cross-entropy's ``Δ12`` from the last :meth:`loss`.
            keep_deltas: keep every error signal ``Δ1 … Δ12`` (and each block's ``Δcausal``)
                for :meth:`deltas`.

        Returns:
            :attr:`grads`: ``name -> gradient``, same shapes as :attr:`params`, for the
            trainable parameters (all of them, or only the LoRA adapters when the base is frozen).

        Raises:
            ValueError: no forward since the last backward's inputs changed; no targets and no
                ``delta_logits``; a ``delta_logits`` of the wrong shape; a forward that ran
                against a KV cache.
        """
        f = self._acts
        if f is None or (delta_logits is None and f.loss is None):
            raise ValueError("backward() called before a forward with targets; call "
                             "model.loss(tokens, targets) first, or pass delta_logits=")
        self._require_forward()                            # its activations were kept
        if delta_logits is not None:
            delta_logits = self._as_signal(delta_logits, f.a12.shape)
        self._deltas = {}
        with self._workspace:
            d12 = self.kernels.cross_entropy_backward(f.loss) if delta_logits is None else delta_logits
            self._deltas = self._backward(f, d12, keep_deltas)
        return self.grads

    def _backward(self, f, d12, keep_deltas: bool) -> dict:
        c, K, W = self.config, self.kernels, self._weights()
        rope = c.position_encoding == "rope"
        G = self._layer_table(grads=True)                  # None = frozen: no gradient
        if G.tok_emb is not None and not c.tie_weights:
            G.tok_emb[...] = 0                             # the embedding backward adds into them
        if G.pos_emb is not None:
            G.pos_emb[...] = 0
        keep = {"Δ12": d12} if keep_deltas else None
        d11 = self._fc_backward(W.logits, G.logits, d12, f.a11, f.lora)                      # Δ11
        d10 = K.layernorm_backward(d11, f.ln_final, dweight=G.ln_final.weight, dbias=G.ln_final.bias)
        for i in reversed(range(c.n_blocks)):
            b, w, g = f.blocks[i], W.blocks[i], G.blocks[i]
            d9 = K.dropout_backward(d10, b.drop9)                                            # Δ9
            d8 = self._fc_backward(w.mlp_contract, g.mlp_contract, d9, b.a8, f.lora)         # Δ8
            d7 = K.activation_backward(d8, b.act, c.activation)                               # Δ7
            d6 = self._fc_backward(w.mlp_expand, g.mlp_expand, d7, b.a6, f.lora)             # Δ6
            d5 = K.add(d10, K.layernorm_backward(d6, b.ln2, dweight=g.ln2.weight, dbias=g.ln2.bias))  # Δ5: skip + LN2
            d4 = K.dropout_backward(d5, b.drop4)                                             # Δ4
            d3 = self._fc_backward(w.attn_proj, g.attn_proj, d4, b.a3, f.lora)               # Δ3
            d_qkv, d_causal = K.multi_head_attention_backward(d3, b.attn, keep_delta_causal=keep_deltas)
            if rope:                                                                         # turned back: R(−tθ)
                d_qkv = K.rope_backward(d_qkv, b.rope)
            d2 = self._fc_backward(w.qkv, g.qkv, d_qkv, b.a2, f.lora)                        # Δ2 = Σ_h (...)
            d1 = K.add(d5, K.layernorm_backward(d2, b.ln1, dweight=g.ln1.weight, dbias=g.ln1.bias))  # skip + LN1
            if keep_deltas:
                p = f"blocks.{i}"
                keep.update({f"{p}.Δ{n}": d for n, d in ((10, d10), (9, d9), (8, d8), (7, d7), (6, d6),
                                                          (5, d5), (4, d4), (3, d3), (2, d2))})
                keep[f"{p}.Δcausal"] = d_causal
            d10 = d1                                        # the previous block's Δ10
        d1 = K.dropout_backward(d10, f.drop1)                                                # Δ1
        K.embedding_backward(d1, f.emb, dtok=G.tok_emb, dpos=G.pos_emb)
        if keep_deltas:
            keep.update({"Δ11": d11, "Δ1": d1})
        return keep or {}

    def _fc_backward(self, fc: "FC", grad: "FC", delta, x, lora_caches: dict):
        """Backward of :meth:`_fc_forward`: writes ``dW``, ``db`` (and the adapters' ``dD``,
        ``dU``) into the gradient arrays of ``grad``; returns ``Δ_in = Δ Wᵀ (+ (α (Δ Uᵀ) Dᵀ) ∘ mask)``."""
        K = self.kernels
        delta_in = K.linear_backward(delta, x, fc.weight, dweight=grad.weight, dbias=grad.bias)
        for (name, lora_D, lora_U, lo, hi), (_, dD, dU, _, _) in zip(fc.adapters, grad.adapters):
            delta_in += K.lora_backward(delta[..., lo:hi], lora_caches[name], lora_D, lora_U,
                                        self.lora_alphas[name], dD=dD, dU=dU)
        return delta_in

    # ------------------------------------------------------------------ inspection
    def activations(self) -> dict:
        """Every activation of the last forward, by the paper's numbering.

        Keys: ``"a0"`` (tokens), ``"a1"``, ``"blocks.{i}.a2"`` … ``"blocks.{i}.a10"``,
        ``"a11"``, ``"a12"`` (logits), plus ``"blocks.{i}.P"`` (attention probabilities,
        ``(B, n_heads, T, L)``; ``L = T`` without a KV cache, the cached length with one).

        Raises:
            ValueError: no forward has been run.
        """
        f = self._require_forward()
        out = {"a0": f.a0, "a1": f.a1}
        for i, b in enumerate(f.blocks):
            for n in range(2, 11):
                out[f"blocks.{i}.a{n}"] = getattr(b, f"a{n}")
            out[f"blocks.{i}.P"] = self.kernels.attention_weights(b.attn)
        out.update(a11=f.a11, a12=f.a12)
        return out

    def attention_weights(self) -> list:
        """``P`` of every block of the last forward (a KV-cache step included): a list over
        blocks of ``(B, n_heads, T, L)`` arrays, row ``α`` of head ``h`` being the softmax weights
        query ``α`` gave every key.

        Raises:
            ValueError: no forward has been run.
        """
        f = self._require_forward()
        return [self.kernels.attention_weights(b.attn) for b in f.blocks]

    def _require_forward(self):
        if self._acts is None:
            raise ValueError("no forward pass has been run yet")
        if not self._acts.kept:
            raise ValueError("the last forward ran with keep_activations=False (generation does): "
                             "run model.forward(tokens) again to keep its activations")
        return self._acts

    def deltas(self) -> dict:
        """Every error signal of the last ``backward(keep_deltas=True)``.

        Keys: ``"Δ12"`` (at the logits), ``"Δ11"``, ``"blocks.{i}.Δ10"`` … ``"blocks.{i}.Δ2"``,
        ``"blocks.{i}.Δcausal"`` (softmax backward, ``(B, n_heads, T, T)``), ``"Δ1"``.
        ``Δ_n = dL/da_n``; a signal that reaches an activation along two paths (the skips)
        is the total.

        Raises:
            ValueError: the last backward did not keep them.
        """
        if not self._deltas:
            raise ValueError("no error signals kept; call backward(keep_deltas=True)")
        return dict(self._deltas)

"""The GPT: parameters, forward as a flat list ``a0 … a12``, backward as the same list reversed.

Paper conclusion ("minimalistic transformer"), restated in EQUATIONS.md::

    a0 (B,T) ints
    a1 = tok-emb + pos-emb                                  (B,T,d)
    block i (x = a1 for the first block, the previous a10 after):
      a2 = LN1(x);  a3 = MHA(a2);  a4 = FC_attProj(a3);  a5 = x + a4
      a6 = LN2(a5); a7 = FC_expand(a6);  a8 = g(a7);  a9 = FC_contract(a8);  a10 = a5 + a9
    a11 = LN_final(a10);  a12 = logits = FC_logits(a11)     (B,T,V)

Parameter names (stable; ``W`` is ``(f_in, f_out)``, ``y = x W + b``)::

    tok_emb.weight (V, d)                 pos_emb.weight (context_length, d)
    blocks.{i}.ln1.weight / .bias (d,)
    blocks.{i}.attn.q.weight (d, n_heads·d_qk)    .bias     (head h: columns h·d_qk …)
    blocks.{i}.attn.k.weight (d, n_heads·d_qk)    .bias
    blocks.{i}.attn.v.weight (d, n_heads·d_head)  .bias
    blocks.{i}.attn_proj.weight (n_heads·d_head, d) .bias
    blocks.{i}.ln2.weight / .bias
    blocks.{i}.mlp_expand.weight (d, d_mlp)  .bias     blocks.{i}.mlp_contract.weight (d_mlp, d) .bias
    ln_final.weight / .bias
    logits.weight (d, V), logits.bias (V,)          -- only when not tie_weights
    X.lora_D (f_in, r), X.lora_U (r, f_out)          -- LoRA on FC layer X (see add_lora)

Storage: all base parameters live in one flat buffer (``GPT.flat``; decayed 2-D weights first,
then the 1-D ones) and ``GPT.params`` holds views into it; the q, k, v weights of a block are
column slices of one fused ``(d, 2·n_heads·d_qk + n_heads·d_head)`` matrix so the forward does
one matmul for all three. Gradients mirror this in ``GPT.grad_flat`` / ``GPT.grads``. An
optimizer can therefore update everything with a few vectorised operations on flat arrays.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np

from .backend import (Workspace, array_namespace, asarray_like, elementwise_lib, empty_array, matmul_into,
                      namespace_for, resolve_dtype, to_numpy)
from .config import GPTConfig, fc_layers, lora_specs, param_specs
from .layers.activations import activation_backward, activation_forward
from .layers.attention import multi_head_attention_backward, multi_head_attention_forward
from .layers.dropout import dropout_backward, dropout_forward
from .layers.embedding import check_tokens, embedding_backward, embedding_forward
from .layers.layernorm import layernorm_backward, layernorm_forward
from .layers.linear import linear_backward, linear_forward
from .layers.lora import lora_backward, lora_forward
from .layers.loss import IGNORE_INDEX, cross_entropy_backward, cross_entropy_forward


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


class GPT:
    """A GPT whose backward is written by hand (no autograd anywhere).

    Args:
        config: a :class:`GPTConfig`.
        seed: initialisation seed (GPT-2 scheme: weights ``N(0, 0.02)``, the two residual
            projections ``N(0, 0.02/√(2·n_blocks))``, biases 0, layer-norm weights 1). Also
            seeds the dropout generator.
        dtype: ``"float32"`` (default) or ``"float64"``.
        backend: ``"numpy"`` (default) or ``"torch"`` (CPU tensors used as plain arrays).

    Use::

        model = GPT(GPTConfig(vocab_size=65, context_length=64, d_model=128, n_heads=4, n_blocks=4))
        loss = model.loss(tokens, targets)     # tokens, targets: (B, T) ints
        grads = model.backward()               # name -> gradient, same shapes as model.params

    Raises:
        ValueError: bad dtype / backend names.
    """

    def __init__(self, config: GPTConfig, *, seed: int = 0, dtype: str = "float32",
                 backend: str = "numpy"):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.backend = backend
        self.xp = namespace_for(backend)
        self.dtype = resolve_dtype(self.xp, dtype)
        self.dtype_name = dtype if isinstance(dtype, str) else str(dtype)
        self._base = FlatParams(self.xp, self.dtype, _base_regions(config))
        self._base_names = [s.name for s in param_specs(config)]
        self.params: dict = {name: self._base.views[name] for name in self._base_names}
        self._grad_base: FlatParams | None = None
        self._lora: FlatParams | None = None
        self._grad_lora: FlatParams | None = None
        self.lora_alpha: float = 1.0
        self.lora_targets: list[str] = []
        self.freeze_base = False
        self.training = True
        self.dropout_rng = np.random.default_rng(seed + 1_000_003)
        self._cache: dict | None = None
        self._deltas: dict = {}
        self._workspace = Workspace()             # last step's arrays, reused by the next
        self._loss_n_total: int | None = None     # set on a batch slice (pedestrian.parallel)
        self._init_weights(seed)

    # ------------------------------------------------------------------ parameters
    def _init_weights(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_blocks)
        for s in param_specs(self.config):
            if len(s.shape) == 2:
                std = resid_std if s.name.endswith(("attn_proj.weight", "mlp_contract.weight")) else 0.02
                value = rng.normal(0.0, std, size=s.shape)
            elif ".ln" in s.name or s.name.startswith("ln_final"):
                value = np.ones(s.shape) if s.name.endswith("weight") else np.zeros(s.shape)
            else:
                value = np.zeros(s.shape)
            self.params[s.name][...] = self._to_xp(value)

    def _to_xp(self, value):
        arr = np.asarray(value)
        if self.backend == "torch":
            import torch

            return torch.as_tensor(arr, dtype=self.dtype)
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
                message lists every problem, and no parameter has been changed.
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
        for k, v in state.items():
            if k in self.params:
                self.params[k][...] = self._to_xp(to_numpy(v))

    # ------------------------------------------------------------------ LoRA
    def add_lora(self, targets: str | Iterable[str] = "all", rank: int = 8, alpha: float = 1.0,
                 *, seed: int = 0, freeze_base: bool = True) -> None:
        """Put a LoRA adapter ``α · x D U`` on fully connected layers (paper section 6).

        Args:
            targets: kinds ``"q"``, ``"k"``, ``"v"``, ``"attn_proj"``, ``"mlp_expand"``,
                ``"mlp_contract"``, ``"logits"`` (every block), ``"all"``, or full layer
                names like ``"blocks.0.attn.q"``.
            rank: ``r``.
            alpha: the paper's plain scalar ``α`` (PEFT's ``lora_alpha / r``).
            seed: ``D ~ N(0, 1/f_in)``; ``U = 0``, so a new adapter starts as a no-op.
            freeze_base: base weights get no gradients at all (their matmuls are skipped).

        Raises:
            ValueError: adapters already present, ``rank < 1``, unknown targets.
        """
        if self._lora is not None:
            raise ValueError("this model already has LoRA adapters; merge_lora() or remove_lora() first")
        specs = lora_specs(self.config, targets, rank)
        self._lora = FlatParams(self.xp, self.dtype, [(s.shape, True, [(s.name, None)]) for s in specs])
        rng = np.random.default_rng(seed)
        for s in specs:
            if s.name.endswith("lora_D"):
                self._lora.views[s.name][...] = self._to_xp(rng.normal(0, 1 / math.sqrt(s.shape[0]), s.shape))
            self.params[s.name] = self._lora.views[s.name]
        self.lora_targets = sorted({s.name.rsplit(".", 1)[0] for s in specs},
                                   key=[n for n, _, _ in fc_layers(self.config)].index)
        self.lora_alpha = float(alpha)
        self.lora_rank = rank
        self.freeze_base = freeze_base
        self._grad_lora = None

    def _base_weight(self, fc: str):
        if fc == "logits" and self.config.tie_weights:
            return self.xp.matrix_transpose(self.params["tok_emb.weight"])
        return self.params[f"{fc}.weight"]

    def merge_lora(self) -> None:
        """``W ← W + α D U`` for every adapter, then drop the adapters (outputs unchanged).

        For tied logits the update goes into ``tok_emb.weight`` (as ``(α D U)ᵀ``), which also
        changes the embedding lookup; merging tied-logits adapters is therefore refused.

        Raises:
            ValueError: no adapters, or a LoRA on tied logits.
        """
        self._apply_lora_delta(+1.0)
        self.remove_lora()

    def unmerge_lora(self, lora_state: Mapping[str, object], alpha: float) -> None:
        """Undo :meth:`merge_lora`: ``W ← W − α D U`` for the given adapters, then re-attach them."""
        names = sorted({k.rsplit(".", 1)[0] for k in lora_state})
        rank = int(np.shape(to_numpy(lora_state[f"{names[0]}.lora_D"]))[1])
        self.add_lora(names, rank, alpha, freeze_base=self.freeze_base)
        self.load_state_dict(lora_state, strict=False)
        self._apply_lora_delta(-1.0)

    def _apply_lora_delta(self, sign: float) -> None:
        if self._lora is None:
            raise ValueError("this model has no LoRA adapters to merge")
        if "logits" in self.lora_targets and self.config.tie_weights:
            raise ValueError("cannot merge a LoRA on tied logits into tok_emb.weight (it would also "
                             "change the embedding); keep the adapter unmerged or untie the weights")
        for fc in self.lora_targets:
            delta_w = sign * self.lora_alpha * (self.params[f"{fc}.lora_D"] @ self.params[f"{fc}.lora_U"])
            self.params[f"{fc}.weight"][...] += delta_w

    def remove_lora(self) -> None:
        """Drop the adapters (without merging) and unfreeze the base."""
        for name in list(self.params):
            if ".lora_" in name:
                del self.params[name]
        self._lora = self._grad_lora = None
        self.lora_targets = []
        self.freeze_base = False

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
            tokens = torch.as_tensor(tokens.astype(np.int64, copy=False))
        array_namespace(tokens)  # raises TypeError for unsupported types
        return tokens if self.backend == "torch" else xp.asarray(tokens)

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

    # ------------------------------------------------------------------ forward
    def _fc_forward(self, fc: str, x, cache: dict):
        """``y = x W + b (+ α x D U)``; the LoRA cache goes to ``cache[fc]``."""
        bias = self.params.get(f"{fc}.bias")
        y, _ = linear_forward(x, self._base_weight(fc), bias)
        if fc in self._lora_set:
            y_lora, cache[fc] = lora_forward(x, self.params[f"{fc}.lora_D"], self.params[f"{fc}.lora_U"],
                                             self.lora_alpha)
            y += y_lora
        return y

    def _dropout(self, x, cache: dict, key: str):
        p = self.config.dropout if self.training else 0.0
        y, cache[key] = dropout_forward(x, p, self.dropout_rng)
        return y

    def forward(self, tokens, targets=None):
        """Run ``a0 → a12`` and keep what the backward needs.

        Args:
            tokens: ``(B, T)`` integer ids in ``[0, vocab_size)``, ``T <= context_length``
                (NumPy array, list, or -- on the torch backend -- a tensor).
            targets: optional ``(B, T)`` ids (``tokens`` shifted by one) or ``-100`` to ignore;
                when given the mean loss is computed and :meth:`backward` may be called.

        Returns:
            logits ``(B, T, vocab_size)`` in the model's dtype and backend. Arrays of an
            earlier step (logits, activations, error signals) are reused for this one only when
            nothing outside the model refers to them any more, so arrays the caller kept never
            change (:class:`pedestrian.backend.Workspace`).

        Raises:
            TypeError: non-integer tokens or targets.
            ValueError: ids out of range, ``T > context_length``, shape mismatch.
        """
        c = self.config
        tokens = self._as_tokens(tokens, "token ids")
        check_tokens(tokens, c.vocab_size, c.context_length)
        if targets is not None:
            targets = self._as_tokens(targets, "targets")
            self._check_targets(targets, tokens)
        self._lora_set = set(self.lora_targets)
        # the last step's activations and signals go first (peak memory), into the workspace
        # unless the caller still holds them (see Workspace.recycle)
        self._workspace.new_step()
        done = [self._cache, self._deltas]
        self._cache, self._deltas = None, {}
        self._workspace.recycle(done)
        with self._workspace.active():
            return self._forward(tokens, targets)

    def _forward(self, tokens, targets):
        c, P = self.config, self.params
        hq, hv = c.n_heads * c.d_qk, c.n_heads * c.d_head
        cache: dict = {"a0": tokens, "blocks": [], "lora": {}, "drop": {}}
        a1, _ = embedding_forward(tokens, P["tok_emb.weight"], P["pos_emb.weight"])
        a1 = self._dropout(a1, cache["drop"], "a1")
        cache["a1"] = x = a1
        for i in range(c.n_blocks):
            p, bc = f"blocks.{i}", {}
            w_qkv = self._base.regions[f"{p}.attn.qkv.weight"]
            b_qkv = self._base.regions.get(f"{p}.attn.qkv.bias")
            a2, bc["ln1"] = layernorm_forward(x, P[f"{p}.ln1.weight"], P.get(f"{p}.ln1.bias"), c.ln_eps)
            qkv, _ = linear_forward(a2, w_qkv, b_qkv)
            for part, lo, hi in (("q", 0, hq), ("k", hq, 2 * hq), ("v", 2 * hq, 2 * hq + hv)):
                fc = f"{p}.attn.{part}"
                if fc in self._lora_set:
                    y_lora, cache["lora"][fc] = lora_forward(
                        a2, P[f"{fc}.lora_D"], P[f"{fc}.lora_U"], self.lora_alpha)
                    qkv[..., lo:hi] += y_lora
            a3, bc["attn"] = multi_head_attention_forward(qkv, c.n_heads, c.d_qk, c.d_head, causal=c.causal)
            a4 = self._dropout(self._fc_forward(f"{p}.attn_proj", a3, cache["lora"]), bc, "drop_a4")
            a5 = self._add(x, a4)
            a6, bc["ln2"] = layernorm_forward(a5, P[f"{p}.ln2.weight"], P.get(f"{p}.ln2.bias"), c.ln_eps)
            a7 = self._fc_forward(f"{p}.mlp_expand", a6, cache["lora"])
            a8, bc["act"] = activation_forward(a7, c.activation)
            a9 = self._dropout(self._fc_forward(f"{p}.mlp_contract", a8, cache["lora"]), bc, "drop_a9")
            a10 = self._add(a5, a9)
            bc.update(a2=a2, a3=a3, a4=a4, a5=a5, a6=a6, a7=a7, a8=a8, a9=a9, a10=a10)
            cache["blocks"].append(bc)
            x = a10
        a11, cache["ln_final"] = layernorm_forward(x, P["ln_final.weight"], P.get("ln_final.bias"), c.ln_eps)
        a12 = self._fc_forward("logits", a11, cache["lora"])
        cache.update(a11=a11, a12=a12)
        if targets is not None:
            loss, cache["loss"] = cross_entropy_forward(a12, targets, n_total=self._loss_n_total)
            cache["loss_value"] = loss
            cache["targets"] = targets
        self._cache = cache
        return a12

    @staticmethod
    def _add(a, b):
        """``a + b`` into a (possibly reused) new array."""
        out = empty_array(a.shape, a)
        elementwise_lib(a).add(a, b, out=out)
        return out

    def loss(self, tokens, targets) -> float:
        """Forward with targets; returns the mean next-token cross-entropy (nats per token).

        If every target is the ignore index ``-100`` the loss is ``0.0`` and the gradients
        are zero (documented convention; no NaN).
        """
        self.forward(tokens, targets)
        return float(self._cache["loss_value"])

    # ------------------------------------------------------------------ backward
    def _grad_buffers(self):
        if not self.freeze_base and self._grad_base is None:
            self._grad_base = FlatParams(self.xp, self.dtype, _base_regions(self.config))
        if self._lora is not None and self._grad_lora is None:
            specs = lora_specs(self.config, self.lora_targets, self.lora_rank)
            self._grad_lora = FlatParams(self.xp, self.dtype, [(s.shape, True, [(s.name, None)]) for s in specs])

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

    def _fc_backward(self, fc: str, delta, x, lora_cache: dict, need_input: bool = True):
        """Backward of :meth:`_fc_forward`: fills the gradient buffers, returns ``Δ_in``."""
        train_base = not self.freeze_base
        has_bias = f"{fc}.bias" in self.params
        g = self._grad_base.views if train_base else {}
        tied_logits = fc == "logits" and self.config.tie_weights
        delta_in, _, _ = linear_backward(
            delta, x, self._base_weight(fc), need_input=need_input,
            need_weight=train_base and not tied_logits, need_bias=train_base and has_bias,
            weight_out=g.get(f"{fc}.weight"), bias_out=g.get(f"{fc}.bias"))
        if train_base and tied_logits:               # d(W_tok) from the logits layer: Δ12ᵀ a11
            V, d = self.params["tok_emb.weight"].shape
            matmul_into(g["tok_emb.weight"], delta.reshape(-1, V).mT, x.reshape(-1, d))
        if fc in self._lora_set:
            d_lora, d_D, d_U = lora_backward(delta, lora_cache[fc], self.params[f"{fc}.lora_D"],
                                             self.params[f"{fc}.lora_U"], self.lora_alpha,
                                             need_input=need_input)
            self._grad_lora.views[f"{fc}.lora_D"][...] = d_D
            self._grad_lora.views[f"{fc}.lora_U"][...] = d_U
            if need_input:
                delta_in += d_lora
        return delta_in

    def backward(self, *, keep_deltas: bool = False) -> dict:
        """Hand-derived backward from ``Δ12`` down to ``Δ1`` and the embedding tables.

        Args:
            keep_deltas: keep every error signal ``Δ1 … Δ12`` (and each block's
                ``Δcausal``) for :meth:`deltas`.

        Returns:
            :attr:`grads`: ``name -> gradient of the mean loss``, same shapes as
            :attr:`params`, for the trainable parameters (all of them, or only the LoRA
            adapters when the base is frozen).

        Raises:
            ValueError: no forward with targets since the last parameter change.
        """
        cache = self._cache
        if cache is None or "loss" not in cache:
            raise ValueError("backward() called before a forward with targets; "
                             "call model.loss(tokens, targets) or model.forward(tokens, targets) first")
        done = [self._deltas]
        self._deltas = {}
        self._workspace.recycle(done)
        with self._workspace.active():
            self._deltas = self._backward(cache, keep_deltas)
        return self.grads

    def _backward(self, cache: dict, keep_deltas: bool) -> dict:
        c, P = self.config, self.params
        self._grad_buffers()
        train_base = not self.freeze_base
        g = self._grad_base.views if train_base else {}
        keep: dict = {}
        hq = c.n_heads * c.d_qk
        lc = cache["lora"]

        d12 = cross_entropy_backward(cache["loss"])
        d11 = self._fc_backward("logits", d12, cache["a11"], lc)
        d10, dw, db = layernorm_backward(d11, cache["ln_final"], need_params=train_base)
        self._put(g, "ln_final", dw, db)
        if keep_deltas:
            keep.update({"Δ12": d12, "Δ11": d11})
        for i in reversed(range(c.n_blocks)):
            p, bc = f"blocks.{i}", cache["blocks"][i]
            x = cache["a1"] if i == 0 else cache["blocks"][i - 1]["a10"]
            if keep_deltas:
                keep[f"{p}.Δ10"] = d10
            d9 = dropout_backward(d10, bc["drop_a9"])
            d8 = self._fc_backward(f"{p}.mlp_contract", d9, bc["a8"], lc)
            d7 = activation_backward(d8, bc["act"], c.activation)
            d6 = self._fc_backward(f"{p}.mlp_expand", d7, bc["a6"], lc)
            d5_ln, dw, db = layernorm_backward(d6, bc["ln2"], need_params=train_base)
            self._put(g, f"{p}.ln2", dw, db)
            d5_ln += d10                                       # skip: Δ10 reaches a5 unchanged
            d5 = d5_ln
            d4 = dropout_backward(d5, bc["drop_a4"])
            d3 = self._fc_backward(f"{p}.attn_proj", d4, bc["a3"], lc)
            d_qkv, d_causal = multi_head_attention_backward(d3, bc["attn"], keep_delta_causal=keep_deltas)
            d2, _, _ = linear_backward(
                d_qkv, bc["a2"], self._base.regions[f"{p}.attn.qkv.weight"],
                need_weight=train_base, need_bias=train_base and c.bias,
                weight_out=self._grad_base.regions[f"{p}.attn.qkv.weight"] if train_base else None,
                bias_out=self._grad_base.regions.get(f"{p}.attn.qkv.bias") if train_base else None)
            for part, lo, hi in (("q", 0, hq), ("k", hq, 2 * hq), ("v", 2 * hq, d_qkv.shape[-1])):
                fc = f"{p}.attn.{part}"
                if fc in self._lora_set:
                    d_lora, d_D, d_U = lora_backward(d_qkv[..., lo:hi], lc[fc], P[f"{fc}.lora_D"],
                                                     P[f"{fc}.lora_U"], self.lora_alpha)
                    self._grad_lora.views[f"{fc}.lora_D"][...] = d_D
                    self._grad_lora.views[f"{fc}.lora_U"][...] = d_U
                    d2 += d_lora
            d1_ln, dw, db = layernorm_backward(d2, bc["ln1"], need_params=train_base)
            self._put(g, f"{p}.ln1", dw, db)
            d1_ln += d5                                        # skip: Δ5 reaches the block input
            if keep_deltas:
                keep.update({f"{p}.Δ9": d9, f"{p}.Δ8": d8, f"{p}.Δ7": d7, f"{p}.Δ6": d6,
                             f"{p}.Δ5": d5, f"{p}.Δ4": d4, f"{p}.Δ3": d3, f"{p}.Δ2": d2,
                             f"{p}.Δcausal": d_causal})
            # this block's signals are done: the next block's backward reuses their arrays
            done = [d10, d9, d8, d7, d6, d5, d4, d3, d_qkv, d2]
            d10 = d1_ln
            del d9, d8, d7, d6, d5, d5_ln, d4, d3, d_qkv, d_causal, d2, d1_ln
            self._workspace.recycle(done)
        d1 = dropout_backward(d10, cache["drop"]["a1"])
        if train_base:
            embedding_backward(d1, cache["a0"], g["tok_emb.weight"], g["pos_emb.weight"],
                               accumulate_tok=c.tie_weights)
        if keep_deltas:
            keep["Δ1"] = d1
        done = [d12, d11, d10, d1]
        del d12, d11, d10, d1
        self._workspace.recycle(done)
        return keep

    @staticmethod
    def _put(g: dict, layer: str, dw, db) -> None:
        if dw is not None and f"{layer}.weight" in g:
            g[f"{layer}.weight"][...] = dw
        if db is not None and f"{layer}.bias" in g:
            g[f"{layer}.bias"][...] = db

    # ------------------------------------------------------------------ inspection
    def activations(self) -> dict:
        """Every activation of the last forward, by the paper's numbering.

        Keys: ``"a0"`` (tokens), ``"a1"``, ``"blocks.{i}.a2"`` … ``"blocks.{i}.a10"``,
        ``"a11"``, ``"a12"`` (logits), plus ``"blocks.{i}.P"`` (attention probabilities,
        ``(B, n_heads, T, T)``).

        Raises:
            ValueError: no forward has been run.
        """
        if self._cache is None:
            raise ValueError("no forward pass has been run yet")
        cache = self._cache
        out = {"a0": cache["a0"], "a1": cache["a1"]}
        for i, bc in enumerate(cache["blocks"]):
            for n in range(2, 11):
                out[f"blocks.{i}.a{n}"] = bc[f"a{n}"]
            out[f"blocks.{i}.P"] = bc["attn"]["p"]
        out.update(a11=cache["a11"], a12=cache["a12"])
        return out

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

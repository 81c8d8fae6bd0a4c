"""The GPT: parameters, the forward as the list ``a0 … a12``, the backward as that list reversed.

Paper conclusion ("minimalistic transformer"), restated in docs/EQUATIONS.md::

    a0 (B,T) ints
    a1 = tok-emb + pos-emb (learned positions; else tok-emb)  (B,T,d)
    block i (x = a1 for the first block, the previous a10 after):
      a2 = LN1(x);  a3 = MHA(a2) (RoPE: q, k rotated first);  a4 = FC_attProj(a3);  a5 = x + a4
      a6 = LN2(a5); a7 = FC_expand(a6);  a8 = g(a7);  a9 = FC_contract(a8);  a10 = a5 + a9
    a11 = LN_final(a10);  a12 = logits = FC_logits(a11)     (B,T,V)

The architecture is configuration (docs/EQUATIONS.md, "The same chain, Llama-style"): the norms
are layer norms or RMS norms (``config.norm``), the MLP is expand-g-contract or SwiGLU
(``config.mlp``: ``a7_gate = FC_gate(a6)``, ``a7_up = FC_up(a6)``, ``a8 = silu(a7_gate) ∘ a7_up``,
``a9 = FC_down(a8)``), the attention has ``config.n_kv_heads`` key/value heads (grouped-query), RoPE
takes ``rope_base`` and Llama 3's ``rope_scaling``, biases are everywhere, nowhere or on q, k, v
only (Qwen2), and the logits are tied or not; the q/k norms and RoPE per block are the attention's
prelude (:mod:`.prelude`), the norms may sit after the sublayers (:mod:`.placement`). The norm, the
activation ``g`` and the whole MLP are slots (:mod:`pedestrian.model.slots`): the chain calls them
alike, built in or a layer of your own.

Each step is one call of a layer function: the paper's reference layers (:mod:`pedestrian.layers`)
or the fast kernels (:mod:`pedestrian.kernels`), same names and signatures, chosen once by
``GPT(..., kernels=...)``. Every layer backward *writes* its parameters' gradients (never adds),
but one: with tied weights the embedding backward adds the lookup's part of ``dW_tok`` to the
logits' part written before it (``accumulate_tok``; no second ``(V, d)`` buffer).

Dropout (off by default) sits on the edges, not in the names: ``a1``, ``a4`` and ``a9`` are the
values before dropout, what flows on is ``dropout(a_i)``, and ``Δ_i = ∂L/∂a_i`` for them too.

Parameter names (stable; ``W`` is ``(f_in, f_out)``, ``y = x W + b``)::

    tok_emb.weight (V, d)                 pos_emb.weight (context_length, d)   -- learned positions only
    blocks.{i}.ln1.weight / .bias (d,)
    blocks.{i}.attn.q.weight (d, n_heads·d_qk)    .bias     (head h: columns h·d_qk …)
    blocks.{i}.attn.k.weight (d, n_kv_heads·d_qk) .bias     (key/value head j: columns j·d_qk …)
    blocks.{i}.attn.v.weight (d, n_kv_heads·d_head) .bias
    blocks.{i}.attn.q_norm.weight, .k_norm.weight   -- qk_norm only: (d_qk,) "head"; (H·d_qk,), (H_kv·d_qk,) "proj"
    blocks.{i}.attn_proj.weight (n_heads·d_head, d) .bias
    blocks.{i}.ln2.weight / .bias                 (RMS norm: .weight only)
    blocks.{i}.ln1_post, blocks.{i}.ln2_post      -- norm_placement "post" (no ln1, ln2) or "sandwich"
    blocks.{i}.mlp_gate.weight (d, d_mlp)            -- SwiGLU only (Hugging Face gate_proj)
    blocks.{i}.mlp_expand.weight (d, d_mlp)  .bias     blocks.{i}.mlp_contract.weight (d_mlp, d) .bias
    ln_final.weight / .bias
    logits.weight (d, V), logits.bias (V,)          -- only when not tie_weights
    X.lora_D (f_in, r_X), X.lora_U (r_X, f_out)      -- LoRA on FC layer X (:mod:`pedestrian.model.adapters`)
    blocks.{i}.ln1.<name>, blocks.{i}.act.<name>, blocks.{i}.mlp.<name>, ...  -- plugged layers' (in slots.py)

Storage: ``model.parameters``, a :class:`~pedestrian.model.params.Parameters` (every parameter and
gradient a view into one flat buffer, a block's q, k, v one fused ``attn.qkv`` layer, SwiGLU's gate
and up one ``mlp_gate_up``; the LoRA adapters; the layer table ``W`` / ``G`` the chain reads and
writes); the model's parameter methods are its. Input checks: :mod:`pedestrian.model.inputs`.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from types import SimpleNamespace

import numpy as np

from ..backend import is_torch_array, namespace_for, resolve_dtype, to_numpy
from ..config import GPTConfig
from ..gpu import kernels_for
from ..kernels.workspace import Workspace
from . import decode, head, moe, placement, prelude, precision as mixed
from .buffers import FlatBuffer
from .device_checks import checked_after, deferring, read_checked
from .inputs import as_signal, as_tokens, check_cache, check_targets, check_tokens, segment_positions
from .edge import NumpyCache, resolve_device, to_torch
from .kv_cache import KVCache
from .params import FC, Delegated, Parameters
from .inspection import named_activations, named_deltas, require_forward
from .recompute import keep_only_what_backward_reads, recomputed_blocks, take_block
from .slots import Slots

__all__ = ["GPT", "GPTConfig", "FlatBuffer"]


class GPT:
    """A GPT whose backward is written by hand (no autograd anywhere).

    Args:
        config: a :class:`GPTConfig`.
        seed: initialisation seed (GPT-2 scheme: weights ``N(0, 0.02)``, the two residual
            projections ``N(0, 0.02/√(2·n_blocks))``, biases 0, layer-norm weights 1). Also
            seeds the dropout generator. Models that differ only in ``position_encoding`` get
            the same weights (the learned table aside).
        dtype: ``"float32"`` (default) or ``"float64"``; precision: ``"float32"`` or ``"bf16"`` (:mod:`.precision`).
        backend: ``"numpy"`` (default) or ``"torch"`` (tensors used as plain arrays; on the CPU
            the fast kernels run on NumPy views of them, converted only at the model's edge,
            :mod:`pedestrian.model.edge`; elsewhere the reference).
        device: where every array lives: ``None`` / ``"cpu"``, or for the torch backend any torch
            device (``"cuda"``, ``"cuda:1"``); parameters, gradients, activations and KV caches
            are made there, and NumPy token ids are moved there.
        kernels: ``"fast"`` (default; :mod:`pedestrian.kernels`) or ``"reference"`` (the paper's
            layers, :mod:`pedestrian.layers`); ``None`` reads ``PEDESTRIAN_KERNELS``. Chosen here
            once (:func:`pedestrian.gpu.kernels_for`): the table :attr:`kernels`. Both compute
            the same numbers (to rounding; tested to 1e-12 in float64).
        layers: ``{slot: layer}`` -- your own layers in the slots ``"norm"``, ``"activation"``,
            ``"mlp"`` (a module of :func:`pedestrian.load_layer`, or its path), run in the chain
            and in its backward in place of the built-in kind (:mod:`pedestrian.model.slots`:
            the contract, what flows through each slot, the parameter names). NumPy backend only.

    Use::

        model = GPT(GPTConfig(vocab_size=65, context_length=64, d_model=128, n_heads=4, n_blocks=4))
        loss = model.loss(tokens, targets)     # tokens, targets: (B, T) ints
        grads = model.backward()               # name -> gradient, same shapes as model.params

    Threads: one model may serve several Python threads at once. :meth:`forward`, :meth:`loss`
    and :func:`pedestrian.generation.generate` keep what a call needs -- activations, memory pool
    (:class:`~pedestrian.kernels.workspace.Workspace`), eval mode during generation
    (:meth:`inference`) -- per thread, so each thread gets the numbers it would get alone, and
    :meth:`activations`, :meth:`attention_weights`, :meth:`deltas` and :meth:`backward` see the
    calling thread's last forward. The parameters and their gradients are one set per model:
    :meth:`backward` holds :attr:`lock` while it writes the gradients (two backward calls run one
    after the other), and a thread that trains while others do must hold ``with model.lock:``
    around its backward and the optimizer step that reads them, or another thread's backward
    may replace the gradients in between. Changing the parameters (an optimizer step,
    ``load_state_dict``, adding or merging adapters) while other threads compute changes what
    those calls see. Several processes: see docs/guide.md, "Deployment".

    Raises:
        TypeError: ``config`` is not a :class:`GPTConfig`.
        ValueError: bad dtype, backend, kernels or precision (:func:`.precision.check_precision`); a device other
            than the CPU for the NumPy backend; bad ``layers`` (:class:`~pedestrian.model.slots.Slots`), or with torch.
    """

    def __init__(self, config: GPTConfig, *, seed: int = 0, dtype: str = "float32", precision: str = "float32",
                 backend: str = "numpy", kernels: str | None = None, device=None, layers: dict | None = None):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.backend = backend
        self.xp = namespace_for(backend)
        self.dtype = resolve_dtype(self.xp, dtype)
        self.dtype_name = dtype if isinstance(dtype, str) else str(dtype)
        self.device, self.precision = resolve_device(backend, device), precision
        #: the kernel table (:func:`pedestrian.gpu.kernels_for`; bf16: :func:`.precision.mixed_table` over it), chosen once
        self.kernels = mixed.kernels_for(kernels_for, precision, kernels, self.device, self.dtype, backend)
        #: the chain runs on NumPy views of this model's torch-CPU tensors (the fast kernels take
        #: NumPy arrays); what enters and leaves the model is converted at its edge (model/edge.py)
        self.numpy_chain = backend == "torch" and self.kernels.name == "fast" and (
            self.device is None or self.device.type == "cpu")
        if layers and backend != "numpy":
            raise ValueError("plugged layers are NumPy code and run in NumPy models: GPT(..., backend='numpy')")
        #: what fills the norm, activation and MLP slots, built in or plugged (:mod:`pedestrian.model.slots`)
        self.slots = Slots(config, self.kernels, self.dtype, layers)
        self.parameters = Parameters(config, self.xp, self.dtype, self.dtype_name, self.device, seed=seed,
                                     numpy_views=self.numpy_chain, slots=self.slots)
        self.training = True
        #: ``True``: keep only each block's input and recompute the block in the backward; an int
        #: ``n``: only the first ``n`` blocks; either way the others keep only what their backward
        #: reads (same numbers, bit for bit; :mod:`pedestrian.model.recompute`)
        self.recompute: bool | int = False
        #: :meth:`loss` fuses the output head with its loss, never keeping the logits (model/head.py)
        self.fused_head = True
        self.dropout_rng = np.random.default_rng(seed + 1_000_003)
        self._local = threading.local()                    # per thread: last forward, memory pool
        #: held by :meth:`backward` while it writes the gradients (reentrant; see the class docstring)
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ per-thread state
    @property
    def _acts(self) -> SimpleNamespace | None:
        """What the calling thread's last forward kept (``None``: none yet)."""
        return getattr(self._local, "acts", None)

    @_acts.setter
    def _acts(self, value) -> None:
        self._local.acts = value

    @property
    def _deltas(self) -> dict:
        """The error signals the calling thread's last ``backward(keep_deltas=True)`` kept."""
        return getattr(self._local, "deltas", {})

    @_deltas.setter
    def _deltas(self, value) -> None:
        self._local.deltas = value

    @property
    def _workspace(self) -> Workspace:
        """The calling thread's memory pool of the fast kernels (made at its first call)."""
        if getattr(self._local, "workspace", None) is None:
            self._local.workspace = Workspace()
        return self._local.workspace

    @contextlib.contextmanager
    def inference(self):
        """``with model.inference():`` the calling thread's forwards run as in eval mode (no
        dropout, on the base or the adapters) while :attr:`training` stays as it is for other
        threads (:func:`pedestrian.generation.generate` uses it)."""
        before, self._local.inference = getattr(self._local, "inference", False), True
        try:
            yield self
        finally:
            self._local.inference = before

    def _dropping_out(self) -> bool:
        return self.training and not getattr(self._local, "inference", False)

    # ------------------------------------------------------------------ forward
    def forward(self, tokens, targets=None, *, kv_cache: KVCache | None = None, n_total: int | None = None,
                keep_activations: bool = True, segments=None):
        """Run ``a0 → a12`` and keep what the backward needs.

        Args:
            tokens: ``(B, T)`` integer ids in ``[0, vocab_size)``, ``T <= context_length``
                (NumPy array, list, or -- on the torch backend -- a tensor).
            targets: optional ``(B, T)`` ids (``tokens`` shifted by one) or ``-100`` to ignore;
                when given the mean loss is computed (:meth:`loss`).
            kv_cache: a :class:`~pedestrian.model.kv_cache.KVCache`: the tokens continue the cached
                ones (positions from ``kv_cache.positions``; RoPE rotates the new keys by them
                before they are cached), their keys and values are appended,
                and ``kv_cache.length`` grows by ``T`` (generation; no backward follows).
            n_total: divide the loss by this many targets instead of the number counted here
                (one slice of a larger batch: the slices' losses and gradients then add up).
            keep_activations: ``False`` keeps only the logits (no :meth:`activations`,
                :meth:`attention_weights` or backward for this step): each block's arrays are
                let go when the block ends (:func:`pedestrian.generation.generate.generate` passes it).
            segments: ``(B, T)`` ints nondecreasing along each row, packed sequences: a query sees only its
                segment's keys, positions restart at 0 at each segment (no ``kv_cache``; :mod:`.inputs`).

        Returns:
            logits ``(B, T, vocab_size)`` in the model's dtype and backend. Arrays of an earlier
            step are reused only when nothing outside the model refers to them any more, so
            arrays the caller kept never change.

        Raises:
            TypeError: non-integer tokens or targets.
            ValueError: ids out of range, ``T > context_length`` (or more than the cache has
                room for), shape mismatch, a cache made for another model or batch size; bad ``segments``.
                On torch tensors (no KV cache) the ids are checked on the device and read once, after
                the forward is queued (:func:`~pedestrian.model.device_checks.checked_after`).
        """
        if self.backend == "torch" and kv_cache is None and deferring() is None:   # the id checks: one read,
            return checked_after(lambda: self.forward(tokens, targets, n_total=n_total,   # after the forward
                                                      keep_activations=keep_activations, segments=segments), True)
        c = self.config
        tokens = as_tokens(self, tokens, "token ids")
        if kv_cache is not None:
            check_cache(self, kv_cache, tokens)
        tokens = check_tokens(tokens, c.vocab_size, c.context_length)      # (in a step on a device: ids
        if targets is not None:                                             # made safe, model/inputs.py)
            targets = as_tokens(self, targets, "targets")
            targets = check_targets(self.xp, targets, tokens, c.vocab_size)
        self._acts, self._deltas = None, {}                # the last step's arrays are free to reuse
        self._workspace.new_step(training=keep_activations and kv_cache is None)
        if self.numpy_chain:                               # the edge: NumPy views in
            tokens, targets = to_numpy(tokens), None if targets is None else to_numpy(targets)
        chain_cache = NumpyCache(kv_cache) if self.numpy_chain and kv_cache is not None else kv_cache
        with self._workspace:
            logits = self._forward(tokens, targets, chain_cache, n_total, keep_activations, segments)
        if kv_cache is not None:
            kv_cache.length += tokens.shape[1]
        return self._out(logits)

    def _forward(self, tokens, targets, kv_cache, n_total, keep=True, segments=None):
        plain = not keep and not (self.config.dropout and self._dropping_out())   # nothing kept, no dropout
        if decode.fits(self, tokens, targets, kv_cache, plain):                     # a generated token: fewer
            logits, self._acts = decode.forward(self, tokens, kv_cache)             # calls, the same numbers
            return logits
        c, K, S, W = self.config, self.kernels, self.slots, self.parameters.weight_table()
        positions = None if kv_cache is None else kv_cache.positions(tokens.shape[1])   # None: 0 … T-1
        if segments is not None:                                                    # packed: per segment
            segments, positions = segment_positions(self, segments, tokens, kv_cache)
        n_re = recomputed_blocks(self.recompute, c.n_blocks) if keep and kv_cache is None else 0
        f = SimpleNamespace(a0=tokens, blocks=[], lora={}, loss=None, kept=keep, recomputed=n_re, routes=[],
                            positions=positions, segments=segments)
        f.a1, f.emb = K.embedding_forward(tokens, W.tok_emb, W.pos_emb, positions,    # (B, T, d); Gemma: · √d
                                          **c.embedding_options)
        x, f.drop1 = self._dropout(f.a1)                                            # into block 0
        for i, w in enumerate(W.blocks):
            if i < n_re:                                                             # keep x and where its dropout draws start
                f.blocks.append(SimpleNamespace(x=x, rng=copy.deepcopy(self.dropout_rng) if self._dropping_out() else None))
            b = self._block(x, w, positions, None if kv_cache is None else kv_cache.block(i), i, segments)
            x = b.a10
            if getattr(b, "route", None) is not None:                               # the router's π and choice
                f.routes.append(moe.kept_route(b.route))                             # (the aux loss's rows)
            if keep and i >= n_re:                                                   # else let go now
                f.blocks.append(keep_only_what_backward_reads(b) if n_re else b)
            del b                                                                    # (before the next block's arrays)
        f.a11, f.ln_final = S.norm.forward(x, W.ln_final)
        head.forward(self, f, W.logits, targets, n_total, getattr(self._local, "fuse", False), self._fc_forward)  # a12, loss
        if c.n_experts:                                                              # + coef · aux (model/moe.py)
            self._local.loss_parts = moe.aux_loss(self, f, targets, n_total)
        self._acts = f
        return f.a12

    def _block(self, x, w, positions, kv_block, i: int = 0, segments=None):
        """Block ``i``'s ``a2 … a10`` (``a4_post``, ``a9_post``: :mod:`.placement`) from its input ``x`` (the
        dropped-out ``a1``, or the previous ``a10``); returns them (and its adapters' caches, ``b.lora``)."""
        c, K, S = self.config, self.kernels, self.slots
        b = SimpleNamespace(lora={}, ln2=None)
        b.a2, b.ln1 = S.norm.forward(x, w.ln1) if w.ln1 is not None else (x, None)    # (B, T, d); post: x
        qkv = self._fc_forward(w.qkv, b.a2, b.lora)                                  # (B, T, H·d_qk+H_kv·(d_qk+d_head))
        qkv, b.prelude = prelude.forward(K, c, i, qkv, w, positions)                 # q/k norms, RoPE (model/prelude.py)
        b.a3, b.attn = K.multi_head_attention_forward(                               # (B, T, H·d_head)
            qkv, c.n_heads, c.d_qk, c.d_head, causal=c.causal, kv_cache=kv_block, n_kv_heads=c.n_kv_heads,
            window=c.window(i), segments=segments, softcap=c.attn_softcap, scale=c.attn_scale)
        b.a4 = self._fc_forward(w.attn_proj, b.a3, b.lora)                           # (B, T, d)
        branch, b.drop4 = self._dropout(placement.post_norm(S.norm, b, "a4", w.ln1_post))   # (or a4_post)
        if w.ln2 is not None:
            (b.a5, b.a6), b.ln2 = S.norm.add_forward(x, branch, w.ln2)              # skip, then LN2 (B, T, d)
        else:                                                                        # post: no norm before the MLP
            b.a5 = b.a6 = K.add(x, branch)
        b.a9 = S.mlp.forward(self._fc_forward, b, w, b.lora)                         # (B, T, d); a7, a8 on b
        branch, b.drop9 = self._dropout(placement.post_norm(S.norm, b, "a9", w.ln2_post))   # (or a9_post)
        b.a10 = K.add(b.a5, branch)                                                  # skip
        return b

    def _fc_forward(self, fc: FC, x, lora_caches: dict):
        """``y = x W + b``, plus ``α dropout(x) D U`` on the columns of each LoRA adapter of the
        layer (one dropout mask for the layer's input, shared by its adapters -- GPT-2's q, k, v;
        one each with ``fc.own_masks`` -- the Llama family's q, k, v and gate, up: PEFT's draws)."""
        y, _ = self.kernels.linear_forward(x, fc.weight, fc.bias)
        if not fc.adapters:
            return y
        mask = None if fc.own_masks else self._lora_mask(x)
        for name, lora_D, lora_U, lo, hi in fc.adapters:                             # y[..., lo:hi] += α (x∘m) D U
            _, lora_caches[name] = self.kernels.lora_forward(x, lora_D, lora_U, self.lora_alphas[name],
                                                             self._lora_mask(x) if fc.own_masks else mask,
                                                             add_to=y[..., lo:hi])
        return y

    def _lora_mask(self, x):
        """The adapters' input dropout mask (``None``: no dropout, or not training)."""
        if not self._dropping_out() or self.lora_dropout == 0.0:
            return None
        return self.kernels.dropout_forward(x, self.lora_dropout, self.dropout_rng)[1]

    def _dropout(self, x):
        p = self.config.dropout if self._dropping_out() else 0.0
        return (x, None) if p == 0.0 else self.kernels.dropout_forward(x, p, self.dropout_rng)

    def loss(self, tokens, targets, *, n_total: int | None = None, keep_activations: bool = True,
             read: bool = True, per_row: bool = False, segments=None) -> float:
        """Forward with targets; the mean next-token cross-entropy (nats per token; ``0.0`` with zero
        gradients when every target is the ignore index ``-100``). ``n_total``, ``keep_activations``:
        see :meth:`forward`; ``segments``: packed sequences (:meth:`forward`; the loss is the segments' own,
        weighted by their counted targets). ``read=False``: the loss as the 0-d array it is, unread (no host sync;
        ``train_step`` reads it once a step); on torch tensors the loss and the id checks' flags
        come to the host in one read (:func:`~pedestrian.model.device_checks.read_checked`).
        ``per_row``: :func:`.head.sequence_logprobs`'."""
        def run():
            self._local.fuse = head.SEQUENCES if per_row else self.fused_head     # (model/head.py)
            try:
                self.forward(tokens, targets, n_total=n_total, keep_activations=keep_activations, segments=segments)
            finally:
                self._local.fuse = False
            self._acts.logits_held = False                 # by no caller: Δ12 may take their place
            return self._acts.loss_value
        return read_checked(run, is_torch_array(tokens)) if read else run()

    @property
    def loss_parts(self) -> dict:
        """``{"ce": cross-entropy, "aux": load-balancing loss}`` of the calling thread's last forward of a
        mixture-of-experts model (:meth:`loss` returns ``ce + router_aux_loss_coef · aux`` when
        ``config.output_router_logits``, else ``ce``; :mod:`pedestrian.model.moe`); ``{}`` for a dense model."""
        return dict(getattr(self._local, "loss_parts", {}))

    # ------------------------------------------------------------------ backward
    def backward(self, delta_logits=None, *, keep_deltas: bool = False, after_block=None) -> dict:
        """Hand-derived backward from ``Δ12`` down to ``Δ1`` and the embedding tables.

        Args:
            delta_logits: the upstream signal ``Δ12 = dL/dlogits`` ``(B, T, vocab_size)`` of a
                loss of your own (the forward then needs no targets); ``None`` (default) takes
                the cross-entropy's ``Δ12`` from the last :meth:`loss`.
            keep_deltas: keep every error signal ``Δ1 … Δ12`` (and each block's ``Δcausal``)
                for :meth:`deltas`.
            after_block: ``after_block(i, grads)`` as soon as block ``i``'s gradients are written,
                last block first; every block writes into the same one-block buffer ``grads``
                (:mod:`pedestrian.training.blockwise` updates the block there).

        Returns:
            :attr:`grads`: ``name -> gradient``, same shapes as :attr:`params`, for the
            trainable parameters (all of them, or only the LoRA adapters when the base is frozen).

        Raises:
            ValueError: no forward since the last backward's inputs changed; no targets and no
                ``delta_logits``; a ``delta_logits`` of the wrong shape; a forward that ran
                against a KV cache; a second backward of a recomputing :meth:`loss` (its logits
                became ``Δ12``, :mod:`pedestrian.model.recompute`).

        The calling thread's last forward is differentiated; the gradients are written under
        :attr:`lock` (see the class docstring for training from several threads).
        """
        f = self._acts
        if f is None or (delta_logits is None and f.loss is None):
            raise ValueError("backward() called before a forward with targets; call "
                             "model.loss(tokens, targets) first, or pass delta_logits=")
        require_forward(f, backward=True)                  # its activations (and logits) were kept
        if delta_logits is not None:
            delta_logits = as_signal(self, delta_logits, f.logits_shape)
            delta_logits = to_numpy(delta_logits) if self.numpy_chain else delta_logits
        self._deltas = {}
        with self.lock, self._workspace:
            top, blocks = self._backward(f, delta_logits, keep_deltas, after_block)
        if keep_deltas:
            self._deltas = named_deltas(top, blocks)
        return self.grads

    def _backward(self, f, delta_logits, keep_deltas: bool, after_block=None):
        """The Δ chain; returns the signals ``Δ12, Δ11, Δ1`` and, with ``keep_deltas``, each
        block's ``Δ10 … Δ2, Δcausal`` (first block first)."""
        c, K, S, W = self.config, self.kernels, self.slots, self.parameters.weight_table()
        G = self.parameters.grad_table(after_block is not None)                              # None = frozen: no gradient
        top, kept, rng_after = SimpleNamespace(), [], self.dropout_rng
        top.d12, top.d11 = head.backward(self, f, W.logits, G.logits, delta_logits, self._fc_backward)  # Δ12 (or None), Δ11
        d10 = S.norm.backward(top.d11, f.ln_final, G.ln_final)
        for i in reversed(range(c.n_blocks)):
            b, w, g = take_block(f, i), W.blocks[i], G.blocks[i]                              # (loss(): let go after)
            if i < f.recomputed:                                                               # a2 … a10 again, same draws
                self.dropout_rng = rng_after if b.rng is None else copy.deepcopy(b.rng)
                b = self._block(b.x, w, f.positions, None, i, f.segments)
            D = SimpleNamespace(d10=d10, aux=None if delta_logits is not None else getattr(f, "aux_grad", None))  # Δ10
            D.d9 = placement.post_norm_backward(S.norm, D, K.dropout_backward(D.d10, b.drop9), b, 9, g.ln2_post)  # Δ9
            D.d6 = S.mlp.backward(self._fc_backward, D, b, w, g, b.lora)                       # Δ6 (Δ8, Δ7 on D)
            D.d5 = placement.skip_backward(S.norm, K, D.d6, b.ln2, D.d10, g.ln2)             # skip + LN2 (or none)
            D.d4 = placement.post_norm_backward(S.norm, D, K.dropout_backward(D.d5, b.drop4), b, 4, g.ln1_post)  # Δ4
            D.d3 = self._fc_backward(w.attn_proj, g.attn_proj, D.d4, b.a3, b.lora)             # Δ3
            d_qkv, D.causal = K.multi_head_attention_backward(D.d3, b.attn, keep_delta_causal=keep_deltas)
            d_qkv = prelude.backward(K, c, d_qkv, b.prelude, g)                               # RoPE, q/k norms back
            D.d2 = self._fc_backward(w.qkv, g.qkv, d_qkv, b.a2, b.lora)                        # Δ2 = Σ_h (...)
            d10 = placement.skip_backward(S.norm, K, D.d2, b.ln1, D.d5, g.ln1)               # skip + LN1 (or none)
            if keep_deltas:
                kept.insert(0, D)
            if after_block is not None:
                after_block(i, self.parameters.block_grads())
            del b, D, d_qkv                                                                    # (before the next block's arrays)
        if f.recomputed:
            self.dropout_rng = rng_after                                                       # as the forward left it
        top.d1 = K.dropout_backward(d10, f.drop1)                                             # Δ1
        K.embedding_backward(top.d1, f.emb, dtok=G.tok_emb, dpos=G.pos_emb,      # tied: W_logits = W_tokᵀ, so the
                             accumulate_tok=c.tie_weights)                      # lookup's part adds to the logits'
        return top, kept

    def _fc_backward(self, fc: FC, grad: FC, delta, x, lora_caches: dict):
        """Backward of :meth:`_fc_forward`: writes ``dW``, ``db`` (and the adapters' ``dD``,
        ``dU``) into the gradient arrays of ``grad``; returns ``Δ_in = Δ Wᵀ (+ (α (Δ Uᵀ) Dᵀ) ∘ mask)``."""
        K = self.kernels
        delta_in = K.linear_backward(delta, x, fc.weight, dweight=grad.weight, dbias=grad.bias)
        for (name, lora_D, lora_U, lo, hi), (_, dD, dU, _, _) in zip(fc.adapters, grad.adapters):
            K.lora_backward(delta[..., lo:hi], lora_caches[name], lora_D, lora_U, self.lora_alphas[name],
                            dD=dD, dU=dU, add_to=delta_in)                  # Δ_in += (α (Δ Uᵀ) Dᵀ) ∘ m
        return delta_in

    # ------------------------------------------------------------------ inspection
    def activations(self) -> dict:
        """Every activation of the last forward, by the paper's numbering.

        Keys: ``"a0"`` (tokens), ``"a1"``, ``"blocks.{i}.a2"`` … ``"blocks.{i}.a10"``, ``"a11"``,
        ``"a12"`` (logits), ``"blocks.{i}.P"`` (attention probabilities, ``(B, n_heads, T, L)``; ``L =
        T`` without a KV cache, the cached length with one). SwiGLU: ``"blocks.{i}.a7_gate"`` (``a6
        W_gate``) and ``"blocks.{i}.a7_up"`` (``a6 W_up``), ``(B, T, d_mlp)``, in place of ``a7``.

        Raises:
            ValueError: no forward has been run, or it kept no activations (:attr:`recompute`,
                ``keep_activations=False``).
        """
        return self._out(named_activations(require_forward(self._acts), self.kernels.attention_weights))

    def attention_weights(self) -> list:
        """``P`` of every block of the last forward (a KV-cache step included): a list over
        blocks of ``(B, n_heads, T, L)`` arrays, row ``α`` of head ``h`` being the softmax weights
        query ``α`` gave every key.

        Raises:
            ValueError: no forward has been run.
        """
        f = require_forward(self._acts)
        return self._out([self.kernels.attention_weights(b.attn) for b in f.blocks])

    def deltas(self) -> dict:
        """Every error signal of the last ``backward(keep_deltas=True)``.

        Keys: ``"Δ12"`` (at the logits), ``"Δ11"``, ``"blocks.{i}.Δ10"`` … ``"blocks.{i}.Δ2"``,
        ``"blocks.{i}.Δcausal"`` (softmax backward, ``(B, n_heads, T, T)``), ``"Δ1"``. With
        SwiGLU, ``"blocks.{i}.Δ7_gate"`` and ``"blocks.{i}.Δ7_up"`` in place of ``Δ7``.
        ``Δ_n = dL/da_n``; a signal that reaches an activation along two paths (the skips)
        is the total.

        Raises:
            ValueError: the last backward did not keep them.
        """
        if not self._deltas:
            raise ValueError("no error signals kept; call backward(keep_deltas=True)")
        return self._out(dict(self._deltas))

    def _out(self, values):
        """What the chain computed, as the caller's arrays (:mod:`pedestrian.model.edge`)."""
        return to_torch(values) if self.numpy_chain else values

    # ------------------------------------------------------------------ kernels and replicas
    @property
    def kernels_name(self) -> str:
        """``"fast"`` or ``"reference"``: which layer functions this model runs (its table's ``name``)."""
        return self.kernels.name

    # ------------------------------------------------------------------ parameters: model.parameters'
    params = Delegated("``name -> array`` of every parameter (base, then LoRA adapters): views into the "
                        "flat buffers, :mod:`pedestrian.model.gpt` lists the names and shapes.")
    grads = Delegated()
    flat = Delegated()
    freeze_base = Delegated("Whether the base parameters get no gradients (their matmuls skipped); set "
                             "by :meth:`add_lora`, cleared by :meth:`remove_lora`, may be set.", settable=True)
    lora_targets = Delegated()
    lora_ranks = Delegated()
    lora_alphas = Delegated()
    lora_rank = Delegated()
    lora_alpha = Delegated()
    lora_dropout = Delegated()
    to_xp = Delegated()
    num_params = Delegated()
    state_dict = Delegated()
    load_state_dict = Delegated()
    trainable_buffers = Delegated()
    add_lora = Delegated()
    merge_lora = Delegated()
    unmerge_lora = Delegated()
    remove_lora = Delegated()
    without_adapters = Delegated()
    lora_state_dict = Delegated()

"""Text generation: a KV cache, a cached forward pass, sampling, and the generation loop.

KV cache (paper section 3, side note; EQUATIONS.md "KV cache"): the keys and values of a token
never change once computed -- each is a per-token fully connected map of that token's input to
the block. During generation :class:`KVCache` keeps, per block and head, the ``k`` and ``v`` rows
of every token seen so far in arrays preallocated to the context length::

    cache.keys[i]   (B, n_heads, context_length, d_qk)      block i
    cache.values[i] (B, n_heads, context_length, d_head)

A new token computes only its own ``q, k, v`` (one fused matmul; its position index is the
number of tokens already cached), writes ``k, v`` into the next free row, and takes one softmax
row against the cached keys: O(current length) work per token instead of the O(length²) of a
full forward pass. The logits equal those of a full forward pass over the same prefix (tested to
1e-10 relative in float64, 1e-5 in float32).

At the context length (learned positions are absolute: there is no position ``context_length``)
generation goes on by *sliding the window*: when appending a token would make the window hold
``context_length + 1`` tokens, the oldest ``window_shift`` tokens are dropped and the cache is
rebuilt from scratch over the remaining ``context_length + 1 - window_shift`` tokens, which get
positions ``0, 1, …`` again. A position index is never reused for a different token inside one
cache, and no token ever sees a position ``>= context_length``. With the default
``window_shift=1`` every token is predicted from exactly the last ``context_length`` tokens
(nanoGPT's ``idx[:, -context_length:]`` convention), at the price of one full rebuild per token
past the context; a larger shift rebuilds once every ``window_shift`` tokens.

Sampling (temperature, top-k, top-p, greedy) lives in :mod:`pedestrian.sampling`.

Public API::

    cache = KVCache(model, batch_size)
    logits = model_step(model, cache, tokens_new)          # (B, V): logits of the last new token
    ids = sample_next(logits, rng, temperature, top_k, top_p)
    out = generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                   seed=None, stop_tokens=None, use_cache=True, on_token=None)
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Callable, Iterable

import numpy as np

from .backend import is_torch_array, to_numpy
from .sampling import _sample, check_sampling, filter_logits, sample_next  # noqa: F401 (re-exported)
from .layers.activations import activation_forward
from .layers.layernorm import layernorm_forward

__all__ = [
    "KVCache",
    "model_step",
    "sample_next",
    "filter_logits",
    "check_sampling",
    "generate",
]


# --------------------------------------------------------------------------------------------
# The cache and the cached forward pass
# --------------------------------------------------------------------------------------------


class _Plan:
    """The model's parameters gathered once for the cached forward (references, not copies).

    Built from the model's *current* adapters: a cache made before ``add_lora`` /
    ``merge_lora`` / ``remove_lora`` does not see the change (make a new :class:`KVCache`).
    """

    def __init__(self, model) -> None:
        c = model.config
        P = model.params
        self.xp = model.xp
        self.dtype = model.dtype
        self.torch = model.backend == "torch"
        self.n_heads, self.d_qk, self.d_head = c.n_heads, c.d_qk, c.d_head
        self.hq, self.hv = c.n_heads * c.d_qk, c.n_heads * c.d_head
        self.eps = c.ln_eps
        self.activation = c.activation
        self.scale = 1.0 / math.sqrt(c.d_qk)
        self.inv_d = 1.0 / c.d_model
        self.alpha = model.lora_alpha
        lora = set(model.lora_targets)

        def adapter(fc):
            return (P[f"{fc}.lora_D"], P[f"{fc}.lora_U"]) if fc in lora else None

        self.tok_emb = P["tok_emb.weight"]
        self.pos_emb = P["pos_emb.weight"]
        self.blocks = []
        for i in range(c.n_blocks):
            p = f"blocks.{i}"
            qkv_lora = [(lo, hi, adapter(f"{p}.attn.{part}")) for part, lo, hi in
                        (("q", 0, self.hq), ("k", self.hq, 2 * self.hq),
                         ("v", 2 * self.hq, 2 * self.hq + self.hv)) if f"{p}.attn.{part}" in lora]
            self.blocks.append((
                P[f"{p}.ln1.weight"], P.get(f"{p}.ln1.bias"),
                model._base.regions[f"{p}.attn.qkv.weight"], model._base.regions.get(f"{p}.attn.qkv.bias"),
                qkv_lora,
                P[f"{p}.attn_proj.weight"], P.get(f"{p}.attn_proj.bias"), adapter(f"{p}.attn_proj"),
                P[f"{p}.ln2.weight"], P.get(f"{p}.ln2.bias"),
                P[f"{p}.mlp_expand.weight"], P.get(f"{p}.mlp_expand.bias"), adapter(f"{p}.mlp_expand"),
                P[f"{p}.mlp_contract.weight"], P.get(f"{p}.mlp_contract.bias"), adapter(f"{p}.mlp_contract"),
            ))
        self.lnf = (P["ln_final.weight"], P.get("ln_final.bias"))
        self.w_logits = model._base_weight("logits")
        self.b_logits = P.get("logits.bias")
        self.lora_logits = adapter("logits")


class KVCache:
    """Keys and values of every token seen so far, per block and head, for ``B`` sequences.

    Args:
        model: a causal :class:`~pedestrian.model.GPT` (the cache takes its dtype and backend).
        batch_size: ``B``, the number of sequences generated together.

    Attributes:
        keys: list over blocks of ``(B, n_heads, context_length, d_qk)`` arrays.
        values: list over blocks of ``(B, n_heads, context_length, d_head)`` arrays.
        length: number of tokens cached so far (= the position index of the next token).
        context_length: capacity (the model's ``context_length``).

    Memory: ``B · n_blocks · n_heads · context_length · (d_qk + d_head)`` numbers, i.e.
    ``2 · n_blocks · context_length · d_model`` per sequence when ``d_qk = d_head = d/n_heads``
    (EQUATIONS.md). Allocated once, here; generation allocates nothing of that size afterwards.

    Raises:
        ValueError: a non-causal model (a token's keys would depend on later tokens, so nothing
            can be cached -- use ``generate(..., use_cache=False)``), or ``batch_size < 1``.
    """

    def __init__(self, model, batch_size: int = 1) -> None:
        c = model.config
        if not c.causal:
            raise ValueError("a KV cache needs a causal model (config.causal=True): in a "
                             "bidirectional model earlier tokens' keys change when a token is "
                             "added; generate with use_cache=False instead")
        if not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        xp = model.xp
        self.batch_size = int(batch_size)
        self.context_length = c.context_length
        self.keys = [xp.zeros((batch_size, c.n_heads, c.context_length, c.d_qk), dtype=model.dtype)
                     for _ in range(c.n_blocks)]
        self.values = [xp.zeros((batch_size, c.n_heads, c.context_length, c.d_head), dtype=model.dtype)
                       for _ in range(c.n_blocks)]
        self.length = 0
        self.model = model
        self.plan = _Plan(model)

    def reset(self) -> None:
        """Forget every cached token (the arrays are kept and overwritten; no allocation)."""
        self.length = 0

    def __repr__(self) -> str:
        return (f"KVCache(batch_size={self.batch_size}, length={self.length}, "
                f"context_length={self.context_length}, n_blocks={len(self.keys)})")


def _fc(x, weight, bias, adapter, alpha):
    """``y = x W + b (+ α (x D) U)`` on ``(N, f_in)`` rows (EQUATIONS.md FC and LoRA)."""
    y = x @ weight
    if bias is not None:
        y += bias
    if adapter is not None:
        y += (alpha * (x @ adapter[0])) @ adapter[1]
    return y


def _cached_forward(plan: _Plan, cache: KVCache, tokens, all_logits: bool):
    """The cached forward, no validation: ``tokens`` ``(B, T)`` in the model's backend.

    Same list ``a0 … a12`` as ``GPT.forward`` (model.py), with the attention of each block
    computed against the cached keys and values. Activations are kept as ``(B·T, ·)`` rows.
    """
    xp = plan.xp
    B, T = tokens.shape
    L0 = cache.length
    L = L0 + T
    H, d_qk, d_head, hq = plan.n_heads, plan.d_qk, plan.d_head, plan.hq
    alpha = plan.alpha
    # a1 = W_tok[a0] + W_pos[L0 : L0+T]: the new tokens' positions continue the cached ones
    x = plan.tok_emb[tokens] + plan.pos_emb[L0:L]                      # (B, T, d)
    d = x.shape[-1]
    x = xp.reshape(x, (B * T, d))
    mask = None
    if T > 1:                                                          # causal among the new tokens
        key_pos = xp.arange(L)
        query_pos = xp.arange(L0, L)
        zeros = xp.zeros((T, L), dtype=plan.dtype)
        mask = xp.where(key_pos[None, :] > query_pos[:, None], xp.full_like(zeros, -math.inf), zeros)
    for i, (ln1_w, ln1_b, w_qkv, b_qkv, qkv_lora, w_proj, b_proj, lora_proj, ln2_w, ln2_b,
            w_exp, b_exp, lora_exp, w_con, b_con, lora_con) in enumerate(plan.blocks):
        a2, _ = layernorm_forward(x, ln1_w, ln1_b, plan.eps)
        qkv = a2 @ w_qkv                                               # one fused matmul for q, k, v
        if b_qkv is not None:
            qkv += b_qkv
        for lo, hi, (lora_D, lora_U) in qkv_lora:
            qkv[:, lo:hi] += (alpha * (a2 @ lora_D)) @ lora_U
        qkv = xp.reshape(qkv, (B, T, -1))
        q = xp.permute_dims(xp.reshape(qkv[..., :hq], (B, T, H, d_qk)), (0, 2, 1, 3)) * plan.scale
        keys, values = cache.keys[i], cache.values[i]
        keys[:, :, L0:L, :] = xp.permute_dims(xp.reshape(qkv[..., hq:2 * hq], (B, T, H, d_qk)), (0, 2, 1, 3))
        values[:, :, L0:L, :] = xp.permute_dims(xp.reshape(qkv[..., 2 * hq:], (B, T, H, d_head)),
                                                (0, 2, 1, 3))
        scores = q @ xp.matrix_transpose(keys[:, :, :L, :])           # (B, H, T, L)
        if mask is not None:
            scores += mask
        p = xp.exp(scores - xp.max(scores, axis=-1, keepdims=True))
        p /= xp.sum(p, axis=-1, keepdims=True)
        a3 = p @ values[:, :, :L, :]                                   # (B, H, T, d_head)
        a3 = xp.reshape(xp.permute_dims(a3, (0, 2, 1, 3)), (B * T, plan.hv))
        a5 = x + _fc(a3, w_proj, b_proj, lora_proj, alpha)             # a4 = FC_attProj(a3)
        a6, _ = layernorm_forward(a5, ln2_w, ln2_b, plan.eps)
        a8, _ = activation_forward(_fc(a6, w_exp, b_exp, lora_exp, alpha), plan.activation)
        x = a5 + _fc(a8, w_con, b_con, lora_con, alpha)                # a10 = a5 + a9
    cache.length = L
    if not all_logits:                                                 # only the last token's logits
        x = xp.reshape(x, (B, T, d))[:, T - 1, :]
    a11, _ = layernorm_forward(x, plan.lnf[0], plan.lnf[1], plan.eps)
    logits = _fc(a11, plan.w_logits, plan.b_logits, plan.lora_logits, alpha)
    return xp.reshape(logits, (B, T, -1)) if all_logits else logits


_GELU_A = math.sqrt(2.0 / math.pi)
_GELU_B = 0.044715 * _GELU_A


def _layernorm_rows(x, weight, bias, eps, inv_d):
    """NumPy layer norm of ``(N, d)`` rows (EQUATIONS.md section 5), few ufunc calls, no cache."""
    mean = np.add.reduce(x, axis=-1, keepdims=True)
    mean *= inv_d
    xc = x - mean
    var = np.add.reduce(xc * xc, axis=-1, keepdims=True)
    var *= inv_d
    var += eps
    np.sqrt(var, out=var)
    xc /= var
    xc *= weight
    if bias is not None:
        xc += bias
    return xc


def _activation_rows(x, name):
    """NumPy activation, in place on ``x`` where possible (EQUATIONS.md activations)."""
    if name == "gelu_tanh":                      # ½x(1 + tanh(√(2/π)(x + 0.044715x³)))
        u = x * x
        u *= _GELU_B
        u += _GELU_A
        u *= x
        np.tanh(u, out=u)
        u += 1.0
        u *= x
        u *= 0.5
        return u
    return activation_forward(x, name)[0]


def _decode_numpy(plan: _Plan, cache: KVCache, ids: np.ndarray):
    """One new token per row, NumPy backend: the lean per-token path of the generation loop.

    Same computation as :func:`_cached_forward` with ``T = 1`` (so no mask), written with
    ``(B, ·)`` rows and in-place ufuncs to keep the per-token Python and allocation overhead
    small. ``ids``: ``(B,)`` int64, already validated. Returns ``(B, V)`` logits.
    """
    B = ids.shape[0]
    L0 = cache.length
    L = L0 + 1
    H, d_qk, d_head, hq = plan.n_heads, plan.d_qk, plan.d_head, plan.hq
    alpha, eps, inv_d = plan.alpha, plan.eps, plan.inv_d
    x = plan.tok_emb[ids]                                              # a1, (B, d)
    x += plan.pos_emb[L0]                                              # position index = cached count
    for i, (ln1_w, ln1_b, w_qkv, b_qkv, qkv_lora, w_proj, b_proj, lora_proj, ln2_w, ln2_b,
            w_exp, b_exp, lora_exp, w_con, b_con, lora_con) in enumerate(plan.blocks):
        a2 = _layernorm_rows(x, ln1_w, ln1_b, eps, inv_d)
        qkv = a2 @ w_qkv                                               # fused q, k, v of the new token
        if b_qkv is not None:
            qkv += b_qkv
        for lo, hi, (lora_D, lora_U) in qkv_lora:
            qkv[:, lo:hi] += (alpha * (a2 @ lora_D)) @ lora_U
        keys, values = cache.keys[i], cache.values[i]
        keys[:, :, L0, :] = qkv[:, hq:2 * hq].reshape(B, H, d_qk)
        values[:, :, L0, :] = qkv[:, 2 * hq:].reshape(B, H, d_head)
        q = qkv[:, :hq].reshape(B, H, 1, d_qk)
        q *= plan.scale
        s = q @ keys[:, :, :L, :].transpose(0, 1, 3, 2)                # one score row, (B, H, 1, L)
        s -= np.maximum.reduce(s, axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= np.add.reduce(s, axis=-1, keepdims=True)
        a3 = (s @ values[:, :, :L, :]).reshape(B, plan.hv)             # heads concatenated
        a5 = _fc(a3, w_proj, b_proj, lora_proj, alpha)
        a5 += x                                                        # a5 = x + a4
        a6 = _layernorm_rows(a5, ln2_w, ln2_b, eps, inv_d)
        a8 = _activation_rows(_fc(a6, w_exp, b_exp, lora_exp, alpha), plan.activation)
        x = _fc(a8, w_con, b_con, lora_con, alpha)
        x += a5                                                        # a10 = a5 + a9
    cache.length = L
    a11 = _layernorm_rows(x, plan.lnf[0], plan.lnf[1], eps, inv_d)
    return _fc(a11, plan.w_logits, plan.b_logits, plan.lora_logits, alpha)


def _as_backend_tokens(plan: _Plan, tokens: np.ndarray):
    if plan.torch:
        import torch

        return torch.as_tensor(tokens)
    return tokens


def model_step(model, cache: KVCache, tokens_new, *, all_logits: bool = False):
    """Feed new tokens through the model against the cache; append their keys and values.

    Used both for the prompt (``T`` tokens at once, "prefill") and for each generated token
    (``T = 1``). Position ``t`` of ``tokens_new`` gets position index ``cache.length + t``.

    Args:
        model: the :class:`~pedestrian.model.GPT` the cache was made for.
        cache: a :class:`KVCache`; its ``length`` grows by ``T``.
        tokens_new: ``(B, T)`` integer ids (NumPy, list, or a torch tensor on the torch
            backend), ``B = cache.batch_size``, ``cache.length + T <= context_length``.
        all_logits: return the logits of every new token, not only of the last.

    Returns:
        logits in the model's dtype and backend: ``(B, vocab_size)`` of the last new token, or
        ``(B, T, vocab_size)`` with ``all_logits``. They equal ``model.forward(prefix)[:, -1]``
        (resp. the last ``T`` rows) for the prefix of every token cached so far.

    Raises:
        TypeError: non-integer ids.
        ValueError: the cache belongs to another model; wrong shape or batch size; ids outside
            ``[0, vocab_size)``; the cache would overflow the context (slide the window: reset
            the cache and feed the last tokens again, as :func:`generate` does).
    """
    if cache.model is not model:
        raise ValueError("this KVCache was made for a different model; make one with KVCache(model, B)")
    tokens = np.asarray(to_numpy(tokens_new) if is_torch_array(tokens_new) else tokens_new)
    if tokens.ndim != 2 or tokens.shape[1] == 0:
        raise ValueError(f"tokens_new must have shape (B, T) with T >= 1, got {tokens.shape}; "
                         "add a batch axis with tokens[None, :]")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got dtype {tokens.dtype}")
    if tokens.shape[0] != cache.batch_size:
        raise ValueError(f"tokens_new has batch size {tokens.shape[0]} but the cache was made for "
                         f"{cache.batch_size}")
    V = model.config.vocab_size
    if tokens.min() < 0 or tokens.max() >= V:
        raise ValueError(f"token ids must be in [0, vocab_size={V}), got min {tokens.min()}, "
                         f"max {tokens.max()}; the tokenizer and the model do not match")
    if cache.length + tokens.shape[1] > cache.context_length:
        raise ValueError(
            f"the cache holds {cache.length} tokens and {tokens.shape[1]} more would exceed "
            f"context_length={cache.context_length} (learned positions are absolute, there is no "
            f"position {cache.context_length}); reset the cache and feed at most the last "
            f"{cache.context_length} tokens (generate() slides the window for you)")
    tokens = tokens.astype(np.int64)
    if tokens.shape[1] == 1 and not cache.plan.torch:
        logits = _decode_numpy(cache.plan, cache, tokens[:, 0])
        return logits[:, None, :] if all_logits else logits
    return _cached_forward(cache.plan, cache, _as_backend_tokens(cache.plan, tokens), all_logits)


# --------------------------------------------------------------------------------------------
# The generation loop
# --------------------------------------------------------------------------------------------


def _check_prompt(prompt_ids, vocab_size: int) -> np.ndarray:
    prompt = np.asarray(to_numpy(prompt_ids) if is_torch_array(prompt_ids) else prompt_ids)
    if prompt.ndim == 1:
        prompt = prompt[None, :]
    if prompt.ndim != 2:
        raise ValueError(f"prompt_ids must have shape (B, T0) or (T0,), got {prompt.shape}")
    if prompt.shape[0] == 0:
        raise ValueError("prompt_ids holds no sequence (batch size 0)")
    if prompt.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token to condition on (GPT-2 "
                         "models start from <|endoftext|>; a char model from e.g. a newline)")
    if prompt.dtype == object or not np.issubdtype(prompt.dtype, np.integer):
        raise TypeError(f"prompt ids must be integers, got dtype {prompt.dtype}; encode text with "
                        "the tokenizer first")
    if prompt.min() < 0 or prompt.max() >= vocab_size:
        bad = prompt.min() if prompt.min() < 0 else prompt.max()
        raise ValueError(f"prompt holds token id {bad}, outside [0, vocab_size={vocab_size}); the "
                         "tokenizer and the model do not match")
    return prompt.astype(np.int64)


def _stop_set(stop_tokens, vocab_size: int) -> np.ndarray | None:
    if stop_tokens is None:
        return None
    if isinstance(stop_tokens, numbers.Integral):
        stop_tokens = [stop_tokens]
    stops = np.asarray(list(stop_tokens))
    if stops.size == 0:
        return None
    if not np.issubdtype(stops.dtype, np.integer) or stops.min() < 0 or stops.max() >= vocab_size:
        raise ValueError(f"stop_tokens must be token ids in [0, vocab_size={vocab_size}), got "
                         f"{list(stop_tokens)}")
    return stops.astype(np.int64)


def generate(model, prompt_ids, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None,
             seed: int | np.random.Generator | None = None,
             stop_tokens: int | Iterable[int] | None = None, use_cache: bool = True,
             on_token: Callable[[np.ndarray], object] | None = None, *, window_shift: int = 1,
             return_logits: bool = False, min_p: float | None = None,
             repetition_penalty: float | None = None, vocab_limit: int | None = None):
    """Autoregressive generation for ``B`` prompts of the same length.

    Args:
        model: a :class:`~pedestrian.model.GPT` (any dtype/backend, with or without unmerged
            LoRA adapters). Dropout is never applied during generation.
        prompt_ids: ``(B, T0)`` (or ``(T0,)``) integer ids, ``T0 >= 1``. An empty prompt is an
            error (there is nothing to condition on; start GPT-2 from ``<|endoftext|>``).
            A prompt longer than ``context_length`` is conditioned on its last
            ``context_length`` tokens only, with a ``UserWarning``; the returned array still
            starts with the whole prompt.
        max_new_tokens: ``>= 0`` tokens to generate per row.
        temperature, top_k, top_p, min_p: see :func:`~pedestrian.sampling.sample_next`
            (``temperature=0``: greedy); applied in Hugging Face's order (see
            :mod:`pedestrian.sampling`).
        repetition_penalty: ``None`` / ``1``: none; ``r > 0``: each row's seen tokens -- its
            whole prompt (also the part beyond the context) and every token generated so far,
            each counted once -- have a positive logit divided by ``r``, a negative one
            multiplied by it (HF ``repetition_penalty``); applied in greedy decoding too.
        vocab_limit: ``None`` or ``1 <= n <= vocab_size``: only ids ``< n`` are ever generated
            (the others are masked to ``-inf`` before any penalty or filter) -- pass the
            tokenizer's size for a model whose vocabulary is padded (GPT-2's 50,304).
        seed: seed or ``numpy.random.Generator``; the same seed gives the same tokens.
        stop_tokens: id or ids; a row that emits one is finished (the stop token is kept in the
            output, and the row is padded with it afterwards); generation ends early when
            every row is finished.
        use_cache: ``True``: KV cache (:func:`model_step`); ``False``: a full
            ``model.forward`` over the window at every step (the reference; same tokens).
        on_token: called after each step with the ``(B,)`` int64 ids just chosen (streaming;
            finished rows show their padding). It may return ``None`` or a ``(B,)`` bool
            array-like: ``True`` marks a row as finished (e.g. its text now holds a stop
            string), which is then treated like a row that emitted a stop token -- padded with
            the token that finished it -- and generation ends once every row is finished.
        window_shift: past the context, how many of the oldest tokens to drop when the window
            overflows (``1 <= window_shift <= context_length``; see the module docstring).
        return_logits: also return the float64 logits each token was drawn from.

    Returns:
        ``(B, T0 + n)`` int64 NumPy array (``(T0 + n,)`` for a 1-D prompt), ``n <= max_new_tokens``
        (smaller only when every row stopped); with ``return_logits`` a tuple
        ``(tokens, logits)`` with ``logits`` ``(n, B, V)`` float64.

    Raises:
        ValueError / TypeError: empty or non-integer prompt, ids outside the vocabulary,
            ``max_new_tokens < 0``, bad sampling settings (see :func:`check_sampling`), bad
            ``window_shift``, ``vocab_limit > vocab_size``, a non-causal model with
            ``use_cache=True``, an ``on_token`` result that is not ``(B,)``.
            NonFiniteLogitsError (a ValueError): the model produced NaN logits.
    """
    c = model.config
    C, V = c.context_length, c.vocab_size
    squeeze = np.ndim(to_numpy(prompt_ids) if is_torch_array(prompt_ids) else prompt_ids) == 1
    prompt = _check_prompt(prompt_ids, V)
    if not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    check_sampling(temperature, top_k, top_p, min_p, repetition_penalty, vocab_limit)
    if vocab_limit is not None and vocab_limit > V:
        raise ValueError(f"vocab_limit={vocab_limit} is larger than the model's vocab_size={V}")
    if not isinstance(window_shift, numbers.Integral) or not 1 <= window_shift <= C:
        raise ValueError(f"window_shift must be an integer in [1, context_length={C}], got {window_shift!r}")
    stops = _stop_set(stop_tokens, V)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    B, T0 = prompt.shape
    if T0 > C:
        warnings.warn(f"the prompt has {T0} tokens but the model's context_length is {C}: only the "
                      f"last {C} tokens are used to condition the generation", UserWarning, stacklevel=2)
    seq = np.empty((B, T0 + max_new_tokens), dtype=np.int64)
    seq[:, :T0] = prompt
    n, start = T0, max(0, T0 - C)                      # seq[:, start:n] is the window
    finished = np.zeros(B, dtype=bool)
    pad = np.zeros(B, dtype=np.int64)
    kept_logits = []
    rows = np.arange(B)
    seen = None                                        # (B, V): the tokens each row has seen
    if repetition_penalty is not None and repetition_penalty != 1.0:
        seen = np.zeros((B, V), dtype=bool)
        seen[rows[:, None], prompt] = True

    if use_cache:
        cache = KVCache(model, B)
        plan = cache.plan

        def window_logits(rebuild: bool):
            if rebuild:
                cache.reset()
                return _cached_forward(plan, cache, _as_backend_tokens(plan, seq[:, start:n]), False)
            if not plan.torch:
                return _decode_numpy(plan, cache, seq[:, n - 1])
            return _cached_forward(plan, cache, _as_backend_tokens(plan, seq[:, n - 1:n]), False)
    else:
        def window_logits(rebuild: bool):
            return model.forward(seq[:, start:n])[:, -1, :]

    was_training = model.training
    model.training = False
    try:
        logits = window_logits(True) if max_new_tokens > 0 else None
        for step in range(max_new_tokens):
            if return_logits:
                kept_logits.append(np.asarray(to_numpy(logits), dtype=np.float64))
            ids = _sample(logits, rng, temperature, top_k, top_p, min_p, repetition_penalty, seen,
                          vocab_limit)
            ids = np.where(finished, pad, ids)
            if stops is not None:
                newly = ~finished & np.isin(ids, stops)
                pad = np.where(newly, ids, pad)
                finished |= newly
            seq[:, n] = ids
            n += 1
            if seen is not None:
                seen[rows, ids] = True
            if on_token is not None:
                done = on_token(ids)
                if done is not None:                   # rows the caller ended (e.g. a stop string)
                    done = np.asarray(done, dtype=bool)
                    if done.shape != (B,):
                        raise ValueError(f"on_token must return None or a (B,) = ({B},) bool array "
                                         f"of finished rows, got shape {done.shape}")
                    newly = done & ~finished
                    pad = np.where(newly, ids, pad)
                    finished |= newly
            if step == max_new_tokens - 1 or finished.all():
                break
            rebuild = n - start > C
            if rebuild:                                # slide: positions are absolute, never reuse one
                start += window_shift
            logits = window_logits(rebuild)
    finally:
        model.training = was_training
    out = seq[:, :n]
    out = out[0] if squeeze else out
    if return_logits:
        return out, (np.stack(kept_logits) if kept_logits else np.zeros((0, B, V)))
    return out

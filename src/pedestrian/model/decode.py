"""A generated token's forward with the fast kernels: the chain of :mod:`pedestrian.model.gpt`
for a KV-cache step of a few tokens that keeps nothing, in fewer calls.

The same layers in the same order, with the same products (the few-token branch of
:func:`pedestrian.kernels.linear.linear_forward`, on the same arrays) and the same compiled loops
(:mod:`pedestrian.kernels.decode`), so the same numbers as the chain -- but per block four numba
calls beside the five products instead of seven kernel calls, each with its checks, reshapes
and pooled arrays: the skip and the next norm are one call (``add_rmsnorm``, ``a5 = x + a4``
with ``a6 = LN2(a5)``, ``a10 = a5 + a9`` with the next block's ``a2``), RoPE, the cache append
and the attention one more; the RoPE angles are looked up once for all blocks and the scratch
arrays made once per step. What it covers is :func:`fits` (Llama-style blocks: RMS norm, SwiGLU,
RoPE or no positions, per block, and the q/k norms of the attention's prelude -- the chain's own
:func:`pedestrian.model.prelude.forward`; norms before the sublayers; no adapters, no plugged
layers, no dropout); anything else runs the chain.
Measured: docs/kernels.md, "One generated token at SmolLM2-135M's shape".
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ..kernels import attention, linear, rmsnorm, rope, schedule, swiglu
from ..kernels import decode as fused
from ..kernels.jit import threads_used
from . import prelude

__all__ = ["fits", "forward"]

#: the kernel-table entries the fused step stands for: a table holding anything else (a spy, the
#: reference layers) runs the chain
_STANDS_FOR = {"rmsnorm_forward": rmsnorm.rmsnorm_forward, "rope_forward": rope.rope_forward,
               "swiglu_forward": swiglu.swiglu_forward, "linear_forward": linear.linear_forward,
               "add": linear.add, "multi_head_attention_forward": attention.multi_head_attention_forward}


def fits(model, tokens, targets, kv_cache, plain: bool) -> bool:
    """Whether :func:`forward` computes this step: a KV-cache step of at most
    :data:`~pedestrian.kernels.schedule.DECODE_MAX_T` new tokens, ``plain`` (it keeps no
    activations and runs no dropout), no targets, NumPy arrays of a model on the fast kernels with
    RMS norms, a SwiGLU MLP (no experts: a mixture of experts runs the chain) and RoPE (or no
    positions), no LoRA adapters, no plugged layer (a sliding-window block's ring runs in its own
    frame, :func:`pedestrian.kernels.attention.ring_frame`)."""
    c, K = model.config, model.kernels
    if not plain or kv_cache is None or targets is not None or type(tokens) is not np.ndarray:
        return False
    if tokens.ndim != 2 or tokens.shape[1] > schedule.DECODE_MAX_T or model.slots.plugged or model.lora_targets:
        return False
    if c.n_experts or c.norm != "rmsnorm" or c.mlp != "swiglu" or c.position_encoding not in ("rope", "none") or not c.causal:
        return False
    if c.norm_placement != "pre":                      # its skips and norms are fused as pre-norms
        return False
    return all(getattr(K, name) is f for name, f in _STANDS_FOR.items())


def forward(model, tokens, kv_cache):
    """``(logits, kept)``: the logits ``(B, T, vocab_size)`` of ``tokens`` ``(B, T)`` after the
    cached ones (what :meth:`GPT.forward <pedestrian.model.GPT.forward>` computes for them), and
    what the model keeps of the step (no activations); writes their keys and values into
    ``kv_cache`` (its ``length`` is counted by the caller).

    Raises:
        ValueError: the step does not fit the cache's capacity."""
    c, W = model.config, model.parameters.weight_table()
    B, T = tokens.shape
    d, H, H_kv, d_qk, d_head = c.d_model, c.n_heads, c.n_kv_heads or c.n_heads, c.d_qk, c.d_head
    width, eps = H * d_qk + H_kv * (d_qk + d_head), float(c.ln_eps)
    first = kv_cache.block(0)
    L0, L = first.length, first.length + T
    if L0 < 0 or L > kv_cache.context_length:
        raise ValueError(f"a KV-cache step of {T} tokens at length {L0} does not fit the cache's "
                         f"capacity {kv_cache.context_length}")
    positions = kv_cache.positions(T)
    x = np.array(model.kernels.embedding_forward(tokens, W.tok_emb, W.pos_emb, positions,      # (B, T, d), own
                                                 **c.embedding_options)[0])
    dtype = x.dtype
    angles = {}                                        # the angles, once per RoPE base (Gemma 3: two)
    if c.position_encoding == "rope":
        r = c.rope_dims
        for i in range(c.n_blocks):
            base, scaling = c.rope_of(i)
            if (base, scaling) not in angles:
                angles[base, scaling] = rope.angle_rows(positions, r, base, scaling, dtype)
    else:
        r = 0
    none = (np.zeros((1, 1), dtype),) * 2

    def starts(block):                                 # each row's first real key, in the block's frame
        return (np.zeros(B, np.int64) if block.key_start is None
                else np.asarray(block.key_start, dtype=np.int64).reshape(B))
    key_start = starts(first)                          # (every block's but a ring's, made once)
    x2 = x.reshape(B * T, d)
    y = np.empty((B, T, d), dtype)                     # each norm's output (a2, a6, a11)
    y2, xhat, rrms = y.reshape(B * T, d), np.empty((B * T, d), dtype), np.empty(B * T)
    turned, q = np.empty((B * T, width), dtype), np.empty((B, H, T, d_qk), dtype)
    scores = {}                                        # (B, H, T, keys) by the keys a block's step sees
    a3 = np.empty((B, T, H * d_head), dtype)
    m = c.d_mlp
    a8 = np.empty((B, T, m), dtype)
    n_qk, scale = H + H_kv, c.score_scale
    cap = 0.0 if c.attn_softcap is None else float(c.attn_softcap)
    mm = _products()
    gate = swiglu.GATES[c.activation]                  # silu, or Gemma's gelu_tanh

    def w_norm(norm):                                  # RMS norm's scale: w, or Gemma's 1 + w
        return norm.weight if not c.norm_offset else c.norm_offset + norm.weight

    fused.rmsnorm_rows(x2, w_norm(W.blocks[0].ln1), eps, y2, xhat, rrms)                   # a2 of block 0
    for i, w in enumerate(W.blocks):
        block = ring = kv_cache.block(i)
        start, block_start = 0, key_start                           # (the slot of cache index 0)
        if ring.window is not None:                                 # a sliding window's ring, in its tokens' order
            block, start = attention.ring_frame(ring, T)
            block_start = starts(block)
        qkv = mm(y, w.qkv)                                          # (B, T, width)
        qkv, _ = prelude.forward(model.kernels, c, i, qkv, w, None, turn=False)          # q/k norms (the chain's)
        window = c.window(i)
        cos, sin = angles.get(c.rope_of(i), none) if r else none
        n_keys = block.length + T
        p = scores.get(n_keys)
        if p is None:
            p = scores[n_keys] = np.empty((B, H, T, n_keys), dtype)
        fused.rope_decode_attention(qkv, cos, sin, n_qk, d_qk, r if c.uses_rope(i) else 0, turned, block.keys,
                                    block.values, block.length, start, block_start, True,
                                    0 if window is None else window, cap, scale, q, p, a3)  # RoPE, a3
        if ring.window is not None:
            attention.ring_keep(ring, block, T)
        a4 = mm(a3, w.attn_proj)
        fused.add_rmsnorm(x2, a4.reshape(B * T, d), w_norm(w.ln2), eps, y2, xhat, rrms)     # a5 in x, a6 in y
        a7 = mm(y, w.mlp_gate_up).reshape(B * T, -1)                                   # [a7_gate | a7_up]
        swiglu.gate_fused_into(a7, a8.reshape(B * T, m), gate)                            # a8
        a9 = mm(a8, w.mlp_contract)
        norm = W.blocks[i + 1].ln1 if i + 1 < len(W.blocks) else W.ln_final
        fused.add_rmsnorm(x2, a9.reshape(B * T, d), w_norm(norm), eps, y2, xhat, rrms)     # a10 in x, next a2 / a11 in y
    logits = mm(y, W.logits)                                     # (B, T, V)
    if c.logit_softcap is not None:                              # Gemma 2: c tanh(z / c)
        logits = model.kernels.softcap_forward(logits, c.logit_softcap)[0]
    return logits, SimpleNamespace(a0=tokens, a12=logits, blocks=[], lora={}, loss=None, kept=False, recomputed=0)


def _products():
    """``product(x, fc) = x W + b`` by :func:`pedestrian.kernels.linear.linear_forward`'s route for
    ``x``, without its per-call checks where that route is NumPy's ``x @ W`` (a few tokens on
    several threads: :func:`pedestrian.kernels.blas.few_rows_matmul`)."""
    if threads_used() == 1:
        return lambda x, fc: linear.linear_forward(x, fc.weight, fc.bias)[0]

    def product(x, fc):
        if x.size > schedule.SMALL_ELEMENTS:
            return linear.linear_forward(x, fc.weight, fc.bias)[0]
        y = x @ fc.weight
        if fc.bias is not None:
            y += fc.bias
        return y
    return product

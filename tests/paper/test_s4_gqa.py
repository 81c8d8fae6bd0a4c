"""Grouped-query attention (issue 33; EQUATIONS.md "Grouped-query attention"): ``n_kv_heads``
key/value heads shared by ``n_heads`` query heads, query head ``h`` reading key/value head
``h // (n_heads / n_kv_heads)`` (Hugging Face's ``repeat_kv``); the backward sums each group's
``dk``, ``dv``. 1 key/value head is multi-query attention, ``n_heads`` of them multi-head.

Every path of the layer: the reference (``pedestrian.layers``), the fast full-matrix kernel, the
tiled kernel (numba, and its torch loop), the KV-cache step (the reference's and the fast decode
loop), RoPE on ``n_heads`` query and ``n_kv_heads`` key heads, against:

- an independent per-head torch oracle (autograd, float64): ``RTOL_AUTOGRAD = 1e-9`` relative per
  tensor (tests/oracles/gradcheck.py: both sides differ by rounding only, a few hundred ulps at
  these shapes; a wrong group sum errs by O(1));
- central finite differences (gradcheck's ``RTOL_FD``);
- multi-head attention with the key/value heads repeated (the definition), the full-matrix
  kernel (tiled), the full forward (KV cache): the same sums in another order,
  ``assert_rounding_close`` / ``1e-12`` of the tensor's scale (gradcheck's rounding bound);
- transformers' own ``LlamaAttention`` and ``Qwen2Attention`` (weights copied, HF's rotary
  convention), float64, 1e-12 of the output's scale.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pedestrian.kernels as fast
import pedestrian.layers as reference
from pedestrian.kernels import attention_tiled
from pedestrian.kernels.attention_tiled import TILED_MIN_T, tiled_attention_backward, tiled_attention_forward
from pedestrian.model.kv_cache import KVCache
from pedestrian.layers.attention import qkv_width
from pedestrian.layers.rope import rope_backward, rope_forward
from gradcheck import (
    EPS64,
    as_np,
    assert_autograd_close,
    assert_fd_close,
    assert_rounding_close,
    autograd,
    kernels_param,
    numerical_grad,
    projection,
)

# id -> (n_heads, n_kv_heads, d_qk, d_head)
CASES = {
    "gqa-4:2": (4, 2, 3, 2),
    "mqa-4:1": (4, 1, 2, 3),
    "mha-4:4": (4, 4, 2, 2),
    "gqa-6:3-head_dim5": (6, 3, 5, 5),          # head_dim 5: q 30 columns, d_model need not be 30
}
CASE = pytest.mark.parametrize("case", list(CASES))
CAUSAL = pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
TOL_ORDER = 1e-12         # same float64 sums in another order (tests/paper/test_s4_attention_tiled.py)


def split(qkv, H, KV, d_qk):
    """The q, k, v parts of the fused ``qkv``."""
    hq, hk = H * d_qk, KV * d_qk
    return qkv[..., :hq], qkv[..., hq:hq + hk], qkv[..., hq + hk:]


def torch_gqa(qkv, H, KV, d_qk, d_head, causal):
    """Independent oracle: section 3's head once per query head ``h``, on its own q columns and
    key/value head ``h // (H/KV)``'s k, v columns; the outputs concatenated."""
    q, k, v = split(qkv, H, KV, d_qk)
    T, g = qkv.shape[1], H // KV
    outs = []
    for h in range(H):
        j = h // g
        S = q[..., h * d_qk:(h + 1) * d_qk] @ k[..., j * d_qk:(j + 1) * d_qk].transpose(-1, -2) / math.sqrt(d_qk)
        if causal:
            S = S.masked_fill(torch.arange(T)[None, :] > torch.arange(T)[:, None], float("-inf"))
        outs.append(torch.softmax(S, dim=-1) @ v[..., j * d_head:(j + 1) * d_head])
    return torch.cat(outs, dim=-1)


def random_qkv(rng, B, T, H, KV, d_qk, d_head, scale=1.0, dtype=np.float64):
    qkv = scale * rng.standard_normal((B, T, qkv_width(H, d_qk, d_head, KV)))
    return qkv.astype(dtype), rng.standard_normal((B, T, H * d_head)).astype(dtype)


def repeat_kv(qkv, H, KV, d_qk, d_head):
    """The multi-head ``qkv`` (``2·H·d_qk + H·d_head`` columns) whose key/value heads are the
    grouped ones repeated, head ``h`` getting head ``h // (H/KV)`` (transformers' ``repeat_kv``)."""
    q, k, v = split(qkv, H, KV, d_qk)
    B, T, g = qkv.shape[0], qkv.shape[1], H // KV
    rep = lambda a, w: np.repeat(a.reshape(B, T, KV, w), g, axis=2).reshape(B, T, H * w)  # noqa: E731
    return np.concatenate([q, rep(k, d_qk), rep(v, d_head)], axis=-1)


def group_sum(d_mha, H, KV, d_qk, d_head):
    """The multi-head signal at ``qkv`` folded to the grouped layout: each key/value head's
    ``dk``, ``dv`` is the sum over its group's query heads (the GQA backward, by definition)."""
    hq = H * d_qk
    B, T, g = d_mha.shape[0], d_mha.shape[1], H // KV
    fold = lambda a, w: a.reshape(B, T, KV, g, w).sum(3).reshape(B, T, KV * w)  # noqa: E731
    return np.concatenate([d_mha[..., :hq], fold(d_mha[..., hq:2 * hq], d_qk), fold(d_mha[..., 2 * hq:], d_head)], -1)


def scales(qkv, H, KV, d_qk, d_head, R=None):
    """The absolute terms of the layer (tests/paper/test_s4_multi_head.py :func:`chain_scales`):
    every quantity recomputed with every term made positive, times the softmax's condition
    ``cond = 1 + 2·max|q||k|ᵀ/√d_qk`` (an absolute error of a score is a relative one of ``P``).

    Returns ``(cond, out scale, scale of the signal at qkv, scale of Δcausal)`` (the last two
    with ``R``, the error signal at the output, else ``None``); two computations of the same
    values in another order differ by at most (rounded operations along the chain)·ε times these.
    """
    a = repeat_kv(np.abs(np.asarray(qkv, dtype=np.float64)), H, KV, d_qk, d_head)
    B, T, hq = a.shape[0], a.shape[1], H * d_qk
    sh = lambda x, w: x.reshape(B, T, H, w).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v = sh(a[..., :hq], d_qk), sh(a[..., hq:2 * hq], d_qk), sh(a[..., 2 * hq:], d_head)
    cond = 1 + 2 * float(np.max(q @ np.swapaxes(k, -1, -2))) / math.sqrt(d_qk)
    if R is None:
        return cond, cond * float(np.max(v)), None, None
    d = sh(np.abs(np.asarray(R, dtype=np.float64)), d_head)
    dP = d @ np.swapaxes(v, -1, -2)                                       # |Δ||v|ᵀ
    dc = dP + dP.max(-1, keepdims=True)                                   # bounds |P∘(dP − rowsum)|/P
    merge = lambda x: x.transpose(0, 2, 1, 3).reshape(B, T, -1)  # noqa: E731
    dq, dk = dc @ k / math.sqrt(d_qk), np.swapaxes(dc, -1, -2) @ q / math.sqrt(d_qk)
    dv = np.broadcast_to(d.sum(2, keepdims=True), d.shape)                # Σ_α P_αβ|Δ_α| <= Σ_α |Δ_α|
    d_qkv = group_sum(np.concatenate([merge(dq), merge(dk), merge(dv)], axis=-1), H, KV, d_qk, d_head)
    return cond, cond * float(np.max(v)), cond * float(np.max(d_qkv)), cond * float(np.max(dc))


# =========================================================================== gradients
@kernels_param()
@CASE
@CAUSAL
def test_gqa_matches_autograd(K, case, causal):
    H, KV, d_qk, d_head = CASES[case]
    B, T = 2, 5
    qkv, R = random_qkv(np.random.default_rng(0), B, T, H, KV, d_qk, d_head)
    out, cache = K.multi_head_attention_forward(qkv, H, d_qk, d_head, causal=causal, n_kv_heads=KV)
    d_qkv, delta_causal = K.multi_head_attention_backward(R, cache, keep_delta_causal=True)
    ref_out, ref = autograd(lambda qkv: torch_gqa(qkv, H, KV, d_qk, d_head, causal), {"qkv": qkv}, upstream=R)
    assert out.shape == (B, T, H * d_head) and d_qkv.shape == qkv.shape
    assert_autograd_close(out, ref_out, "a3")
    assert_autograd_close(d_qkv, ref["qkv"], "signal at qkv (dk, dv summed over each group)")
    assert delta_causal.shape == (B, H, T, T)
    assert as_np(K.attention_weights(cache)).shape == (B, H, T, T)


@kernels_param()
@CASE
def test_gqa_matches_finite_differences(K, case):
    H, KV, d_qk, d_head = CASES[case]
    qkv, R = random_qkv(np.random.default_rng(1), 2, 4, H, KV, d_qk, d_head)

    def f():
        return projection(K.multi_head_attention_forward(qkv, H, d_qk, d_head, n_kv_heads=KV)[0], R)

    cache = K.multi_head_attention_forward(qkv, H, d_qk, d_head, n_kv_heads=KV)[1]
    assert_fd_close(K.multi_head_attention_backward(R, cache)[0], numerical_grad(f, qkv), "gqa.qkv")


@kernels_param()
@CASE
@CAUSAL
def test_gqa_is_multi_head_with_repeated_kv_and_group_summed_gradients(K, case, causal):
    """The definition: GQA = multi-head attention on ``repeat_kv``'d keys and values; its signal
    at the shared ``k``, ``v`` = the sum of the repeated heads' signals (the chain rule through
    the copy). Same sums, another order: the rounding bound."""
    H, KV, d_qk, d_head = CASES[case]
    qkv, R = random_qkv(np.random.default_rng(2), 3, 6, H, KV, d_qk, d_head)
    out, cache = K.multi_head_attention_forward(qkv, H, d_qk, d_head, causal=causal, n_kv_heads=KV)
    d_qkv, dc = K.multi_head_attention_backward(R, cache, keep_delta_causal=True)
    mha_out, mha_cache = K.multi_head_attention_forward(repeat_kv(qkv, H, KV, d_qk, d_head), H, d_qk, d_head,
                                                        causal=causal)
    mha_d, mha_dc = K.multi_head_attention_backward(R, mha_cache, keep_delta_causal=True)
    cond, out_scale, d_scale, dc_scale = scales(qkv, H, KV, d_qk, d_head, R)
    assert_rounding_close(out, mha_out, out_scale, "out")
    assert_rounding_close(d_qkv, group_sum(mha_d, H, KV, d_qk, d_head), d_scale, "signal at qkv")
    assert_rounding_close(dc, mha_dc, dc_scale, "Δcausal")
    assert_rounding_close(K.attention_weights(cache), K.attention_weights(mha_cache), cond, "P")


@kernels_param()
def test_n_kv_heads_equal_to_n_heads_is_todays_multi_head_bit_for_bit(K):
    rng = np.random.default_rng(3)
    H, d_qk, d_head = 3, 4, 5
    for T in (7, 300):                                             # 300: the fast path runs tiled
        qkv, R = random_qkv(rng, 2, T, H, H, d_qk, d_head)
        runs = []
        for kv in ({}, {"n_kv_heads": H}):
            out, cache = K.multi_head_attention_forward(qkv, H, d_qk, d_head, **kv)
            runs.append((out, *K.multi_head_attention_backward(R, cache, keep_delta_causal=True),
                         K.attention_weights(cache)))
        assert all(np.array_equal(a, b) for a, b in zip(*runs))


@kernels_param()
@pytest.mark.parametrize("kv", [0, 3, 5])
def test_n_kv_heads_must_divide_n_heads(K, kv):
    with pytest.raises(ValueError, match=f"n_kv_heads={kv} must divide n_heads=4"):
        K.multi_head_attention_forward(np.zeros((1, 2, 40)), 4, 2, 2, n_kv_heads=kv)


# =========================================================================== tiled
@pytest.mark.parametrize("case", ["gqa-4:2", "mqa-4:1", "gqa-6:3-head_dim5"])
@pytest.mark.parametrize("T", [7, 65, 300])
@CAUSAL
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_tiled_matches_full_matrix(case, T, causal, backend, monkeypatch, one_torch_thread):
    """Tiled (numba prange kernels, or the torch loop) against the full-matrix fast kernel and the
    reference: output, signal at ``qkv``, ``Δcausal``, ``P``; blocks that divide neither T."""
    H, KV, d_qk, d_head = CASES[case]
    qkv, R = random_qkv(np.random.default_rng(T), 2, T, H, KV, d_qk, d_head, scale=1.5)
    ref_out, ref_cache = reference.multi_head_attention_forward(qkv, H, d_qk, d_head, causal=causal, n_kv_heads=KV)
    ref_d, ref_dc = reference.multi_head_attention_backward(R, ref_cache, keep_delta_causal=True)
    monkeypatch.setitem(TILED_MIN_T, "numpy", 1 << 30)
    full_out, full_cache = fast.multi_head_attention_forward(qkv, H, d_qk, d_head, causal=causal, n_kv_heads=KV)
    full_d, full_dc = fast.multi_head_attention_backward(R, full_cache, keep_delta_causal=True)
    x, r = (qkv, R) if backend == "numpy" else (torch.from_numpy(qkv), torch.from_numpy(R))
    out, cache = tiled_attention_forward(x, H, d_qk, d_head, causal=causal, block_q=16, block_k=24, n_kv_heads=KV)
    d, dc = tiled_attention_backward(r, cache, keep_delta_causal=True)
    p = attention_tiled.tiled_attention_weights(cache)
    assert cache["k"].shape == (2 * KV, T, d_qk) and cache["v"].shape == (2 * KV, T, d_head)   # O(T), KV heads
    for name, got, full, ref in (("out", out, full_out, ref_out), ("d_qkv", d, full_d, ref_d),
                                 ("Δcausal", dc, full_dc, ref_dc),
                                 ("P", p, full_cache["p"], reference.attention_weights(ref_cache))):
        scale = max(float(np.max(np.abs(ref))), 1e-300)
        assert np.max(np.abs(as_np(got) - full)) <= TOL_ORDER * scale, (name, "full")
        assert np.max(np.abs(as_np(got) - ref)) <= TOL_ORDER * scale, (name, "reference")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_tiled_and_full_gqa_same_bits_for_1_and_2_threads(dtype, monkeypatch):
    """The group sums add the heads in head order, after the parallel loops: the same bits on any
    number of threads (full-matrix and tiled, both directions)."""
    H, KV, d_qk, d_head = 4, 2, 3, 5
    results = []
    for threads in ("1", "2"):
        monkeypatch.setenv("PEDESTRIAN_NUM_THREADS", threads)
        run = []
        for T in (40, 300):                                          # full-matrix, tiled
            qkv, R = random_qkv(np.random.default_rng(T), 3, T, H, KV, d_qk, d_head, dtype=dtype)
            out, cache = fast.multi_head_attention_forward(qkv, H, d_qk, d_head, n_kv_heads=KV)
            run += [out, *fast.multi_head_attention_backward(R, cache, keep_delta_causal=True)]
        results.append(run)
    assert all(np.array_equal(a, b) for a, b in zip(*results))


# =========================================================================== KV cache
def empty_block(B, KV, capacity, d_qk, d_head, key_start=None, dtype=np.float64):
    return reference.KVBlock(np.zeros((B, KV, capacity, d_qk), dtype), np.zeros((B, KV, capacity, d_head), dtype),
                             0, key_start)


@kernels_param()
@pytest.mark.parametrize("case", ["gqa-4:2", "mqa-4:1", "gqa-6:3-head_dim5"])
@pytest.mark.parametrize("chunks", [(1,) * 12, (4, 1, 1, 6), (9, 1, 2)],       # 9 > DECODE_MAX_T: the reference
                         ids=["token-by-token", "prefix-then-steps", "long-prefix"])
def test_kv_cache_steps_equal_the_full_forward(K, case, chunks):
    """Token by token (the fast path's decode loop) and a prefix then steps: every chunk's output
    and ``P`` rows equal the full forward's; the cache holds ``n_kv_heads`` heads whose rows are
    the grouped keys and values; left padding (row 1: 2 junk tokens) is never attended to."""
    H, KV, d_qk, d_head = CASES[case]
    B, T = 2, 12
    qkv, _ = random_qkv(np.random.default_rng(5), B, T, H, KV, d_qk, d_head)
    full, full_cache = K.multi_head_attention_forward(qkv, H, d_qk, d_head, n_kv_heads=KV)
    P_full = as_np(K.attention_weights(full_cache))
    alone, _ = K.multi_head_attention_forward(qkv[1:, 2:], H, d_qk, d_head, n_kv_heads=KV)
    block = empty_block(B, KV, T + 3, d_qk, d_head)
    padded = empty_block(B, KV, T + 3, d_qk, d_head, key_start=np.array([0, 2]))
    cond, out_scale, _, _ = scales(qkv, H, KV, d_qk, d_head)
    start = 0
    for n in chunks:
        out, c = K.multi_head_attention_forward(qkv[:, start:start + n], H, d_qk, d_head, n_kv_heads=KV,
                                                kv_cache=block._replace(length=start))
        assert as_np(K.attention_weights(c)).shape == (B, H, n, start + n)
        assert_rounding_close(out, full[:, start:start + n], out_scale, f"out rows {start}…{start + n}")
        assert_rounding_close(K.attention_weights(c), P_full[:, :, start:start + n, :start + n], cond, "P rows")
        out_p, _ = K.multi_head_attention_forward(qkv[:, start:start + n], H, d_qk, d_head, n_kv_heads=KV,
                                                  kv_cache=padded._replace(length=start))
        if start + n > 2:
            lo = max(start, 2)
            assert_rounding_close(out_p[1:, lo - start:], alone[:, lo - 2:start + n - 2], out_scale, "padded row")
        start += n
    _, k, v = split(qkv, H, KV, d_qk)
    assert np.array_equal(block.keys[:, :, :T], k.reshape(B, T, KV, d_qk).transpose(0, 2, 1, 3))
    assert np.array_equal(block.values[:, :, :T], v.reshape(B, T, KV, d_head).transpose(0, 2, 1, 3))
    with pytest.raises(ValueError, match="no backward through a KV-cache forward"):
        K.multi_head_attention_backward(np.ones_like(out), c)


@kernels_param()
def test_kv_cache_with_the_wrong_number_of_heads_is_an_error(K):
    block = empty_block(1, 4, 5, 2, 2)                               # made for multi-head
    with pytest.raises(ValueError, match="holds 4 heads but the attention has n_kv_heads=2"):
        K.multi_head_attention_forward(np.zeros((1, 1, qkv_width(4, 2, 2, 2))), 4, 2, 2, n_kv_heads=2, kv_cache=block)


def fake_model(n_kv_heads, n_heads=9, d_head=64, n_blocks=30, context_length=512, dtype=np.float32):
    """What :class:`KVCache` reads of a model (config, backend, dtype): GQA is not in GPTConfig yet."""
    config = SimpleNamespace(causal=True, context_length=context_length, n_heads=n_heads, n_kv_heads=n_kv_heads,
                             d_qk=d_head, d_head=d_head, n_blocks=n_blocks, learned_positions=False)
    return SimpleNamespace(config=config, xp=np, device=None, dtype=dtype, backend="numpy")


@pytest.mark.parametrize("n_kv_heads", [1, 3, 9, None])
def test_kv_cache_memory_shrinks_by_n_heads_over_n_kv_heads(n_kv_heads):
    """SmolLM2-135M's attention shape (30 blocks, 9 query / 3 key-value heads of width 64,
    context 512, float32): the cache holds ``n_kv_heads`` heads, 9/n_kv_heads times less than
    multi-head (``None``: a config without the field is multi-head)."""
    cache = KVCache(fake_model(n_kv_heads))
    kv = n_kv_heads or 9
    assert cache.keys[0].shape == (1, kv, 512, 64) and cache.values[0].shape == (1, kv, 512, 64)
    assert cache.nbytes == 2 * 30 * kv * 512 * 64 * 4                 # keys + values, 4-byte floats
    assert KVCache(fake_model(9)).nbytes == cache.nbytes * 9 // kv


# =========================================================================== RoPE
def test_rope_turns_n_heads_query_and_n_kv_heads_key_heads():
    """RoPE on the grouped ``qkv`` = RoPE on its multi-head version (the k heads repeated) with the
    repeats dropped: each of the ``H + H_kv`` q and k heads turned by its token's angles, v kept;
    the backward is the inverse rotation (``R(−tθ) R(tθ) = 1``)."""
    H, KV, d_qk, d_head = 4, 2, 6, 3
    qkv, _ = random_qkv(np.random.default_rng(6), 2, 5, H, KV, d_qk, d_head)
    y, c = rope_forward(qkv, H, d_qk, base=100.0, n_kv_heads=KV)
    y_mha, _ = rope_forward(repeat_kv(qkv, H, KV, d_qk, d_head), H, d_qk, base=100.0)
    assert np.array_equal(repeat_kv(y, H, KV, d_qk, d_head), y_mha)   # the same elementwise operations
    assert np.array_equal(y[..., (H + KV) * d_qk:], qkv[..., (H + KV) * d_qk:])
    assert_rounding_close(rope_backward(y, c), qkv, np.max(np.abs(qkv)) * 4, "R(−tθ) R(tθ) x = x")


# =========================================================================== transformers
def hf_attention(kind, H, KV, head_dim, d_model, bias, seed):
    """A float64 transformers ``LlamaAttention`` / ``Qwen2Attention`` with random weights, on
    torch's ``scaled_dot_product_attention`` (float64 throughout; HF's eager path rounds ``P`` to
    float32: 7.5e-7 relative)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(hidden_size=d_model, num_attention_heads=H, num_key_value_heads=KV, head_dim=head_dim,
                  intermediate_size=8, num_hidden_layers=1, vocab_size=11, rope_theta=500.0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, attention_bias=bias)
        attn = transformers.models.llama.modeling_llama.LlamaAttention(cfg, layer_idx=0)
    else:
        cfg = transformers.Qwen2Config(**common)
        attn = transformers.models.qwen2.modeling_qwen2.Qwen2Attention(cfg, layer_idx=0)
    cfg._attn_implementation = "sdpa"       # "eager" takes its softmax in float32 whatever the dtype
    attn = attn.double().eval()
    with torch.no_grad():
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            lin.weight.normal_(0, 0.5)
            if lin.bias is not None:
                lin.bias.normal_(0, 0.5)
    return attn, cfg


def hf_rope(T, head_dim, base):
    """HF's ``cos``, ``sin`` ``(1, T, head_dim)`` (``emb = cat(freqs, freqs)``: rotate_half pairs
    ``j`` with ``j + head_dim/2``), the angles in float64 (HF's rotary module forms them in float32)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    emb = torch.cat([torch.arange(T, dtype=torch.float64)[:, None] * inv_freq] * 2, dim=-1)
    return emb.cos()[None], emb.sin()[None]


@pytest.mark.parametrize("kind,H,KV,head_dim,d_model,bias", [
    ("llama", 4, 2, 4, 16, False),          # GQA 4:2, head_dim = d_model / n_heads
    ("llama", 4, 1, 6, 16, False),          # multi-query, explicit head_dim (q: 24 columns of a 16-wide model)
    ("llama", 4, 4, 4, 16, True),           # multi-head with Llama's attention_bias (q, k, v and o)
    ("qwen2", 6, 2, 4, 12, True),           # Qwen2: biases on q, k, v only
], ids=["llama-gqa", "llama-mqa-head_dim6", "llama-mha-bias", "qwen2-bias-qkv"])
@kernels_param()
def test_equals_transformers_attention_forward_and_gradients(K, kind, H, KV, head_dim, d_model, bias):
    """Pedestrian's chain -- fused ``qkv = x [Wq | Wk | Wv] + b`` (pedestrian's ``W`` is HF's
    Linear weight transposed, ``(in, out)``), RoPE (the same rotate_half pairing: no
    permutation), grouped attention, ``a3 Wo (+ bo)`` -- against HF's module: output to 1e-12 of
    its scale and every weight's gradient (pedestrian's hand-derived chain against HF's autograd)
    to ``RTOL_AUTOGRAD``."""
    attn, cfg = hf_attention(kind, H, KV, head_dim, d_model, bias, seed=7)
    B, T = 2, 6
    rng = np.random.default_rng(8)
    x = rng.standard_normal((B, T, d_model))
    R = rng.standard_normal((B, T, d_model))
    base = cfg.rope_parameters["rope_theta"]
    cos, sin = hf_rope(T, head_dim, base)
    mask = torch.full((T, T), -math.inf, dtype=torch.float64).triu(1)[None, None].expand(B, 1, T, T)
    xt = torch.tensor(x, requires_grad=True)
    ref, _ = attn(xt, position_embeddings=(cos, sin), attention_mask=mask)
    ref.backward(torch.tensor(R))

    lins = (attn.q_proj, attn.k_proj, attn.v_proj)
    W = np.concatenate([lin.weight.detach().numpy().T for lin in lins], axis=1)       # (d, H·hd + 2·KV·hd)
    b = np.concatenate([lin.bias.detach().numpy() for lin in lins]) if lins[0].bias is not None else None
    Wo = attn.o_proj.weight.detach().numpy().T                                        # (H·hd, d)
    bo = None if attn.o_proj.bias is None else attn.o_proj.bias.detach().numpy()
    qkv, _ = K.linear_forward(x, W, b)
    qkv_r, rope_cache = K.rope_forward(qkv, H, head_dim, base=base, n_kv_heads=KV)
    a3, cache = K.multi_head_attention_forward(qkv_r, H, head_dim, head_dim, causal=True, n_kv_heads=KV)
    out, _ = K.linear_forward(a3, Wo, bo)
    _, a3_scale, _, _ = scales(qkv_r, H, KV, head_dim, head_dim)
    o_scale = a3_scale * np.abs(Wo).sum(0).max() + (0.0 if bo is None else np.abs(bo).max())   # |a3||Wo| + |bo|
    assert_rounding_close(out, ref.detach().numpy(), o_scale, "output")

    dWo, dbo = np.zeros_like(Wo), None if bo is None else np.zeros_like(bo)
    d3 = K.linear_backward(R, a3, Wo, dweight=dWo, dbias=dbo)
    d_qkv = K.rope_backward(K.multi_head_attention_backward(d3, cache)[0], rope_cache)
    dW, db = np.zeros_like(W), None if b is None else np.zeros_like(b)
    dx = K.linear_backward(d_qkv, x, W, dweight=dW, dbias=db)
    assert_autograd_close(dx, xt.grad.numpy(), "Δ at x")
    assert_autograd_close(dWo, attn.o_proj.weight.grad.numpy().T, "dW_o")
    if bo is not None:
        assert_autograd_close(dbo, attn.o_proj.bias.grad.numpy(), "db_o")
    cols = np.cumsum([0] + [lin.weight.shape[0] for lin in lins])
    for i, (name, lin) in enumerate(zip("qkv", lins)):
        assert_autograd_close(dW[:, cols[i]:cols[i + 1]], lin.weight.grad.numpy().T, f"dW_{name}")
        if db is not None:          # db_k is not ≡ 0 here: RoPE turns b_k by the key's position
            assert_autograd_close(db[cols[i]:cols[i + 1]], lin.bias.grad.numpy(), f"db_{name}")
    if db is not None:
        assert np.max(np.abs(db[cols[1]:cols[2]])) > 1e-3 * np.max(np.abs(db))


def test_hf_rotary_module_is_the_rope_convention_used():
    """HF's own ``LlamaRotaryEmbedding`` (angles formed in float32) gives the ``cos``, ``sin`` of
    :func:`hf_rope` to float32 rounding of the angle: ``|Δ| <= t·θ·2⁻²³ + 2⁻²³`` (the product
    ``t·θ`` and ``θ`` each rounded once, t < 16), so the float64 angles above are HF's convention."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   rope_theta=500.0)
    rot = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    T = 16
    cos, sin = rot(torch.zeros(1, T, 8, dtype=torch.float64), torch.arange(T)[None])
    cos64, sin64 = hf_rope(T, 8, 500.0)
    bound = (T * 2.0 ** -23 + 2.0 ** -23) * 2
    assert float((cos - cos64).abs().max()) <= bound and float((sin - sin64).abs().max()) <= bound


# =========================================================================== float32
@kernels_param()
@pytest.mark.parametrize("case", ["gqa-4:2", "mqa-4:1"])
def test_float32_error_within_its_rounding_bound(K, case):
    """Float32 against float64 on the same (float32) inputs, forward and backward: within
    ``n·ε32`` of the absolute terms (``n = 4·(d_qk + d_head + T) + 32`` rounded operations along
    the longest chain: the score's ``d_qk``-term dot product, the softmax's ``T``-term sum, ``P v``
    and ``Δ vᵀ``, the ``T``-term row sums of the backward, ``exp`` and division a few ulps each),
    times the softmax's condition ``1 + 2·S_abs`` (an absolute score error becomes a relative
    error of ``P``)."""
    H, KV, d_qk, d_head = CASES[case]
    B, T = 2, 40
    qkv32, R32 = random_qkv(np.random.default_rng(9), B, T, H, KV, d_qk, d_head, dtype=np.float32)
    qkv, R = qkv32.astype(np.float64), R32.astype(np.float64)
    out, cache = K.multi_head_attention_forward(qkv32, H, d_qk, d_head, n_kv_heads=KV)
    d = K.multi_head_attention_backward(R32, cache)[0]
    assert out.dtype == np.float32 and d.dtype == np.float32
    out64, cache64 = reference.multi_head_attention_forward(qkv, H, d_qk, d_head, n_kv_heads=KV)
    d64 = reference.multi_head_attention_backward(R, cache64)[0]
    _, out_scale, d_scale, _ = scales(qkv, H, KV, d_qk, d_head, R)
    n = 4 * (d_qk + d_head + T) + 32
    eps32 = float(np.finfo(np.float32).eps)
    assert np.max(np.abs(out - out64)) <= n * eps32 * out_scale
    assert np.max(np.abs(d - d64)) <= n * eps32 * d_scale
    assert np.max(np.abs(d - d64)) > EPS64 * d_scale                  # it is a float32 computation


# =========================================================================== property
@settings(max_examples=12, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 3), T=st.sampled_from([1, 2, 5, 33, 255, 256, 257, 600]),
       n_kv=st.integers(1, 3), g=st.integers(1, 3), d_qk=st.integers(1, 9), d_head=st.integers(1, 9),
       causal=st.booleans(), float32=st.booleans())
def test_fast_equals_reference_over_the_shape_space(seed, B, T, n_kv, g, d_qk, d_head, causal, float32):
    """The fast path (full-matrix below ``TILED_MIN_T = 256``, tiled from it) equals the reference
    over ``B`` 1-3, ``T`` across the tiled threshold up to 600, 1-3 key/value heads of 1-3 query
    heads each, odd and even widths, causal or not, float64 (1e-12 of the scale: the same sums in
    another order, at most 600 terms) and float32 (the float32 fast path within the bound of
    :func:`test_float32_error_within_its_rounding_bound` of the float64 reference on the same
    inputs), on 1 and 2 threads (the same bits)."""
    H = n_kv * g
    dtype = np.float32 if float32 else np.float64
    qkv, R = random_qkv(np.random.default_rng(seed), B, T, H, n_kv, d_qk, d_head, dtype=dtype)
    ref_out, ref_cache = reference.multi_head_attention_forward(qkv.astype(np.float64), H, d_qk, d_head,
                                                                causal=causal, n_kv_heads=n_kv)
    ref_d = reference.multi_head_attention_backward(R.astype(np.float64), ref_cache)[0]
    runs = []
    for threads in ("1", "2"):
        with pytest.MonkeyPatch.context() as m:
            m.setenv("PEDESTRIAN_NUM_THREADS", threads)
            out, cache = fast.multi_head_attention_forward(qkv, H, d_qk, d_head, causal=causal, n_kv_heads=n_kv)
            runs.append((out, fast.multi_head_attention_backward(R, cache)[0]))
    assert all(np.array_equal(a, b) for a, b in zip(*runs))
    _, out_scale, d_scale, _ = scales(qkv, H, n_kv, d_qk, d_head, R)
    rtol = TOL_ORDER if not float32 else (4 * (d_qk + d_head + T) + 32) * float(np.finfo(np.float32).eps)
    out, d = runs[0]
    assert np.max(np.abs(out - ref_out)) <= rtol * out_scale
    assert np.max(np.abs(d - ref_d)) <= rtol * d_scale

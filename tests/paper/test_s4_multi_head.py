"""Paper section 4 (EQUATIONS.md "Multi-head attention"): ``n_heads`` section-3 heads on the same
input, their outputs concatenated; in the backward the incoming ``Δ`` is cut into one column block
per head and the heads' input signals are SUMMED. Plus the KV-cache path of the same forward
(section 3's side note): attending to cached keys gives the rows a full forward gives.

For both kernel modules: ``multi_head_attention_forward/_backward`` (from the fused ``qkv``)
against a per-head torch autograd oracle (float64), finite differences, the concat/sum property
against the reference section-3 head, and the KV-cache path. Tolerances: tests/oracles/gradcheck.py
and :func:`chain_scales` below.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pedestrian.layers as reference
from gradcheck import (
    as_np,
    assert_autograd_close,
    assert_fd_close,
    assert_rounding_close,
    autograd,
    kernels_param,
    key_bias_bound,
    numerical_grad,
    projection,
)

CAUSAL = pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])


def torch_multi_head(qkv, n_heads, d_qk, d_head, causal):
    """Independent per-head oracle: slice, run each head, concatenate (section 4 as written)."""
    hq = n_heads * d_qk
    T = qkv.shape[1]
    outs = []
    for h in range(n_heads):
        q = qkv[..., h * d_qk:(h + 1) * d_qk]
        k = qkv[..., hq + h * d_qk:hq + (h + 1) * d_qk]
        v = qkv[..., 2 * hq + h * d_head:2 * hq + (h + 1) * d_head]
        S = q @ k.transpose(-1, -2) / math.sqrt(d_qk)
        if causal:
            S = S.masked_fill(torch.arange(T)[None, :] > torch.arange(T)[:, None], float("-inf"))
        outs.append(torch.softmax(S, dim=-1) @ v)
    return torch.cat(outs, dim=-1)


@kernels_param()
@CAUSAL
def test_multi_head_attention_matches_autograd(K, causal):
    rng = np.random.default_rng(0)
    B, T, H, d_qk, d_head = 2, 5, 3, 2, 4                       # d_qk != d_head
    qkv = rng.standard_normal((B, T, H * (2 * d_qk + d_head)))
    R = rng.standard_normal((B, T, H * d_head))
    out, cache = K.multi_head_attention_forward(qkv, H, d_qk, d_head, causal=causal)
    d_qkv, delta_causal = K.multi_head_attention_backward(R, cache, keep_delta_causal=True)
    ref_out, ref = autograd(lambda qkv: torch_multi_head(qkv, H, d_qk, d_head, causal), {"qkv": qkv}, upstream=R)
    assert out.shape == (B, T, H * d_head) and d_qkv.shape == qkv.shape
    assert_autograd_close(out, ref_out, "a3 (heads concatenated)")
    assert_autograd_close(d_qkv, ref["qkv"], "signal at qkv")
    assert delta_causal.shape == (B, H, T, T)
    assert K.multi_head_attention_backward(R, cache)[1] is None               # kept only when asked


@kernels_param()
@CAUSAL
def test_multi_head_attention_matches_finite_differences(K, causal):
    rng = np.random.default_rng(1)
    B, T, H, d_qk, d_head = 2, 4, 2, 3, 2
    qkv = rng.standard_normal((B, T, H * (2 * d_qk + d_head)))
    R = rng.standard_normal((B, T, H * d_head))

    def f():
        return projection(K.multi_head_attention_forward(qkv, H, d_qk, d_head, causal=causal)[0], R)

    d_qkv, _ = K.multi_head_attention_backward(R, K.multi_head_attention_forward(qkv, H, d_qk, d_head, causal=causal)[1])
    assert_fd_close(d_qkv, numerical_grad(f, qkv), "mha.qkv")


# =========================================================================== multi-head = heads
def random_head(rng, d, d_qk, d_head, scale=0.7):
    wq, wk, wv = (scale * rng.standard_normal((d, w)) for w in (d_qk, d_qk, d_head))
    bq, bk, bv = (0.5 * rng.standard_normal(w) for w in (d_qk, d_qk, d_head))
    return wq, bq, wk, bk, wv, bv


def chain_scales(x, W, b, delta, n_heads, d_qk, d_head, causal):
    """The absolute-term magnitudes of every quantity the fused and the per-head paths compute
    (each value recomputed with every term made positive: ``|x||W|``, ``P|v|``, ...), and the
    number of rounded operations along the longest chain.

    Two computations of the same value that differ only in order err by at most
    ``n_ops·ε·(absolute terms)``, here <= 2.2e-14 of the scales (n_ops <= ~100), so
    ``gradcheck.RTOL_ROUNDING = 1e-12`` holds on any IEEE-754 machine; the softmax turns an
    absolute error of the scores into a relative one of ``P``, hence the factor ``1 + S_abs``.
    """
    ax = np.abs(x)
    qkv_abs = ax @ np.abs(W) + np.abs(b)
    hq = n_heads * d_qk
    B, T, _ = x.shape
    sh = lambda a, w: a.reshape(B, T, n_heads, w).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v = sh(qkv_abs[..., :hq], d_qk), sh(qkv_abs[..., hq:2 * hq], d_qk), sh(qkv_abs[..., 2 * hq:], d_head)
    s_abs = float(np.max(q @ np.swapaxes(k, -1, -2))) / math.sqrt(d_qk)
    cond = 1.0 + 2.0 * s_abs
    d_abs = sh(np.abs(delta), d_head)
    dP = d_abs @ np.swapaxes(v, -1, -2)                                   # |Δ||v|ᵀ
    dc = dP + dP.max(-1, keepdims=True)                                   # bounds |P∘(dP − r)|/P
    dq, dk, dv = dc @ k / math.sqrt(d_qk), np.swapaxes(dc, -1, -2) @ q / math.sqrt(d_qk), \
        np.ones_like(dc).swapaxes(-1, -2) @ d_abs
    merge = lambda a: a.transpose(0, 2, 1, 3).reshape(B, T, -1)  # noqa: E731
    dqkv = np.concatenate([merge(dq), merge(dk), merge(dv)], axis=-1)
    return dict(out=cond * v.max() * np.ones((1,)), d_x=cond * dqkv @ np.abs(W).T,
                d_W=cond * ax.reshape(-1, x.shape[-1]).T @ dqkv.reshape(-1, dqkv.shape[-1]),
                d_b=cond * dqkv.sum((0, 1)), d_causal=cond * dc)


def check_multi_head_equals_heads(K, seed: int, B: int, T: int, d: int, n_heads: int, d_qk: int,
                                  d_head: int, causal: bool) -> None:
    """Section 4: MHA == concat of independent heads; Δ_in(MHA) == Σ_h Δ_in(head h); the fused
    q/k/v gradient is the heads' gradients side by side. ``K``'s fused path against the
    reference section-3 head (``layers.attention_head_forward``) run once per head."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, d))
    heads = [random_head(rng, d, d_qk, d_head) for _ in range(n_heads)]
    # the fused layout: [Wq_0 … Wq_{H-1} | Wk_0 … | Wv_0 …]
    W = np.concatenate([h[0] for h in heads] + [h[2] for h in heads] + [h[4] for h in heads], axis=1)
    b = np.concatenate([h[1] for h in heads] + [h[3] for h in heads] + [h[5] for h in heads])
    delta = rng.standard_normal((B, T, n_heads * d_head))

    qkv, _ = K.linear_forward(x, W, b)
    out, cache = K.multi_head_attention_forward(qkv, n_heads, d_qk, d_head, causal=causal)
    d_qkv, d_causal = K.multi_head_attention_backward(delta, cache, keep_delta_causal=True)
    d_W, d_b = np.zeros_like(W), np.zeros_like(b)
    d_x = K.linear_backward(d_qkv, x, W, dweight=d_W, dbias=d_b)

    per_head = []
    for h, weights in enumerate(heads):
        o, c = reference.attention_head_forward(x, *weights, causal=causal)
        per_head.append((o, *reference.attention_head_backward(delta[..., h * d_head:(h + 1) * d_head], c)))
    scales = chain_scales(x, W, b, delta, n_heads, d_qk, d_head, causal)
    assert_rounding_close(out, np.concatenate([o for o, *_ in per_head], axis=-1), scales["out"], "concat")
    assert_rounding_close(d_x, sum(dx for _, dx, _, _ in per_head), scales["d_x"], "Δ_in = Σ_h Δ_in^h")
    grads = [g for _, _, g, _ in per_head]
    hq = n_heads * d_qk
    key_cols = np.zeros(W.shape[1], dtype=bool)
    key_cols[hq:2 * hq] = True
    fused_W = np.concatenate([g["w" + n] for n in "qkv" for g in grads], axis=1)
    fused_b = np.concatenate([g["b" + n] for n in "qkv" for g in grads])
    assert_rounding_close(d_W, fused_W, scales["d_W"], "[dWq | dWk | dWv]")
    assert_rounding_close(d_b[~key_cols], fused_b[~key_cols], scales["d_b"][~key_cols], "[dbq | dbv]")
    # the key bias: ≡ 0 in both (section 3), rounding noise bounded by key_bias_bound
    dcs = np.stack([dc for *_, dc in per_head], axis=1)                      # (B, H, T, T)
    q = (x @ W[:, :hq] + b[:hq]).reshape(B, T, n_heads, d_qk).transpose(0, 2, 1, 3)
    v = (x @ W[:, 2 * hq:] + b[2 * hq:]).reshape(B, T, n_heads, d_head).transpose(0, 2, 1, 3)
    dP = delta.reshape(B, T, n_heads, d_head).transpose(0, 2, 1, 3) @ np.swapaxes(v, -1, -2)
    bound = key_bias_bound(q, dP, dcs)
    assert np.all(np.abs(d_b[key_cols]) <= bound) and np.all(np.abs(fused_b[key_cols]) <= bound)
    assert_rounding_close(d_causal, dcs, scales["d_causal"], "Δcausal per head")


@kernels_param()
@CAUSAL
def test_multi_head_is_the_concat_of_heads_and_its_input_signal_is_their_sum(K, causal):
    check_multi_head_equals_heads(K, seed=3, B=2, T=5, d=6, n_heads=3, d_qk=2, d_head=4, causal=causal)


@kernels_param()
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 3), T=st.integers(1, 6), d=st.integers(1, 6),
       n_heads=st.integers(1, 3), d_qk=st.integers(1, 4), d_head=st.integers(1, 4), causal=st.booleans())
def test_multi_head_properties_random_shapes(K, seed, B, T, d, n_heads, d_qk, d_head, causal):
    check_multi_head_equals_heads(K, seed, B, T, d, n_heads, d_qk, d_head, causal)


# =========================================================================== the KV-cache path
def empty_cache(B, H, capacity, d_qk, d_head, length=0, key_start=None):
    return reference.KVBlock(np.zeros((B, H, capacity, d_qk)), np.zeros((B, H, capacity, d_head)),
                             length, key_start)


def attention_scales(qkv, H, d_qk):
    """``(scale of P, scale of out)``: the softmax condition ``1 + 2·S_abs`` (rows of ``P`` lie in
    [0, 1]) and that times ``max|v|`` (see :func:`chain_scales`)."""
    hq = H * d_qk
    a = np.abs(qkv)
    B, T, _ = qkv.shape
    sh = lambda x, w: x.reshape(B, T, H, w).transpose(0, 2, 1, 3)  # noqa: E731
    q, k = sh(a[..., :hq], d_qk), sh(a[..., hq:2 * hq], d_qk)
    cond = 1 + 2 * float(np.max(q @ np.swapaxes(k, -1, -2))) / math.sqrt(d_qk)
    return cond, cond * float(np.max(a[..., 2 * hq:]))


@kernels_param()
@pytest.mark.parametrize("chunks", [(3, 1, 1, 1, 2), (8,), (1,) * 8], ids=["prefix-then-steps", "one-call", "token-by-token"])
@pytest.mark.parametrize("d_qk", [3, 4])                            # d_head = 4: both head layouts
def test_kv_cache_path_equals_the_full_forward(K, chunks, d_qk):
    """Feeding the tokens in chunks against a cache gives the full forward's output rows and
    attention-weight rows (``P`` of a chunk is ``(B, H, T_chunk, L)``, L = tokens so far)."""
    rng = np.random.default_rng(5)
    B, T, H, d_head = 2, 8, 2, 4
    qkv = rng.standard_normal((B, T, H * (2 * d_qk + d_head)))
    full, full_cache = K.multi_head_attention_forward(qkv, H, d_qk, d_head, causal=True)
    P_full = as_np(K.attention_weights(full_cache))
    cache = empty_cache(B, H, T + 2, d_qk, d_head)                   # capacity beyond T: unused rows
    start = 0
    p_scale, out_scale = attention_scales(qkv, H, d_qk)
    for n in chunks:
        block = reference.KVBlock(cache.keys, cache.values, start)
        out, c = K.multi_head_attention_forward(qkv[:, start:start + n], H, d_qk, d_head, causal=True,
                                                kv_cache=block)
        P = as_np(K.attention_weights(c))
        assert P.shape == (B, H, n, start + n)
        assert_rounding_close(out, full[:, start:start + n], out_scale, f"out rows {start}…{start + n}")
        assert_rounding_close(P, P_full[:, :, start:start + n, :start + n], p_scale, f"P rows {start}…{start + n}")
        start += n
    assert start == T
    if len(chunks) > 1:   # the reference detects a cached forward by L != T (one call from an
        # empty cache computes exactly a plain forward, so its backward would be right)
        with pytest.raises(ValueError, match="no backward through a KV-cache forward"):
            K.multi_head_attention_backward(np.ones_like(out), c)


@kernels_param()
def test_kv_cache_with_left_padding_ignores_the_padding(K):
    """Row 1 is left-padded by 2 junk tokens (``key_start = [0, 2]``): its real tokens' outputs
    are those of the unpadded sequence alone (no query attends to the padding)."""
    rng = np.random.default_rng(6)
    T, H, d_qk, d_head = 6, 2, 2, 3
    qkv = rng.standard_normal((2, T, H * (2 * d_qk + d_head)))
    alone, _ = K.multi_head_attention_forward(qkv[1:, 2:], H, d_qk, d_head, causal=True)
    cache = empty_cache(2, H, T, d_qk, d_head, key_start=np.array([0, 2]))
    out, c = K.multi_head_attention_forward(qkv, H, d_qk, d_head, causal=True, kv_cache=cache)
    _, out_scale = attention_scales(qkv, H, d_qk)
    assert_rounding_close(out[1:, 2:], alone, out_scale, "padded row")
    P = as_np(K.attention_weights(c))
    assert np.all(P[1, :, 2:, :2] == 0.0)                              # exp(−∞) = 0, exactly
    full, _ = K.multi_head_attention_forward(qkv[:1], H, d_qk, d_head, causal=True)
    assert_rounding_close(out[:1], full, out_scale, "unpadded row")


@kernels_param()
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_scores_of_magnitude_1e4_in_every_head(K, dtype):
    """The fused path (the fast one folds 1/√d_qk into q) keeps scores of magnitude 1e4 finite in
    every head, future weights exactly 0 and the backward finite, in float32 too."""
    rng = np.random.default_rng(8)
    B, T, H, d_qk, d_head = 2, 5, 2, 4, 3
    qkv = (1e3 * rng.standard_normal((B, T, H * (2 * d_qk + d_head)))).astype(dtype)
    hq = H * d_qk
    q = qkv[..., :hq].astype(np.float64).reshape(B, T, H, d_qk).transpose(0, 2, 1, 3)
    k = qkv[..., hq:2 * hq].astype(np.float64).reshape(B, T, H, d_qk).transpose(0, 2, 1, 3)
    assert np.max(np.abs(q @ np.swapaxes(k, -1, -2))) / 2.0 > 1e4
    out, cache = K.multi_head_attention_forward(qkv, H, d_qk, d_head, causal=True)
    P = as_np(K.attention_weights(cache))
    future = np.triu(np.ones((T, T), dtype=bool), 1)
    assert np.all(P[..., future] == 0.0)
    assert np.all(np.isfinite(as_np(out))) and np.all(np.isfinite(P))
    d_qkv, dc = K.multi_head_attention_backward(np.ones_like(out), cache, keep_delta_causal=True)
    assert np.all(np.isfinite(as_np(d_qkv))) and np.all(as_np(dc)[..., future] == 0.0)

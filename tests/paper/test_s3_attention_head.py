"""The properties the paper proves (sections 2-4), each demonstrated as a test, plus numerical
robustness at extreme magnitudes. Sources: EQUATIONS.md, "One attention head" /
"Multi-head attention" / "Embedding" / "Next-token loss".

- the key-bias gradient is identically zero and the output does not depend on the key bias;
- every row of Δcausal (the softmax backward) sums to zero;
- without the causal mask, permuting the input tokens permutes the output rows; with it, not;
- multi-head attention is the concatenation of independent heads, and its input signal is
  the SUM of the heads' input signals (section 4);
- the embedding backward accumulates repeated token ids (``ohe(a0)ᵀ Δ1``);
- logits or attention scores of magnitude 1e4 stay finite, and future tokens get weight 0.0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pedestrian.layers import (
    attention_head_backward,
    attention_head_forward,
    cross_entropy_backward,
    cross_entropy_forward,
    embedding_backward,
    embedding_forward,
    linear_backward,
    linear_forward,
    multi_head_attention_backward,
    multi_head_attention_forward,
)
from torch_reference import default_cfg, random_params


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-15))


def random_head(rng, d: int, d_qk: int, d_head: int, scale: float = 0.7):
    """``(wq, bq, wk, bk, wv, bv)`` with nonzero biases (a zero key bias would make its test empty)."""
    wq, wk, wv = (scale * rng.standard_normal((d, w)) for w in (d_qk, d_qk, d_head))
    bq, bk, bv = (0.5 * rng.standard_normal(w) for w in (d_qk, d_qk, d_head))
    return wq, bq, wk, bk, wv, bv


def head_case(seed: int, B=2, T=5, d=6, d_qk=3, d_head=4):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, d))
    return rng, x, random_head(rng, d, d_qk, d_head), rng.standard_normal((B, T, d_head))


def model_case(build_model, token_batch, **overrides):
    cfg = default_cfg(**overrides)
    params = random_params(cfg, seed=5)
    model = build_model(cfg, params, dtype="float64")
    tokens, targets = token_batch(cfg, 3, cfg["context_length"], seed=5, n_ignored=2)
    return cfg, model, tokens, targets


# =========================================================================== key bias
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_key_bias_gradient_is_zero_and_output_ignores_key_bias_single_head(causal):
    rng, x, (wq, bq, wk, bk, wv, bv), delta = head_case(0)
    out, cache = attention_head_forward(x, wq, bq, wk, bk, wv, bv, causal=causal)
    _, grads, _ = attention_head_backward(delta, cache)
    assert np.max(np.abs(grads["bk"])) <= 1e-12
    assert np.max(np.abs(grads["bq"])) > 1e-3          # the other biases do get gradients

    out_shifted, _ = attention_head_forward(x, wq, bq, wk, bk + 3.0 * rng.standard_normal(bk.shape),
                                            wv, bv, causal=causal)
    assert rel_err(out_shifted, out) <= 1e-12
    # control: the query bias is not inert, so the comparison above can fail
    out_q, _ = attention_head_forward(x, wq, bq + 3.0, wk, bk, wv, bv, causal=causal)
    assert rel_err(out_q, out) > 1e-3


def test_key_bias_gradient_is_zero_and_logits_ignore_key_bias_whole_model(build_model, token_batch):
    cfg, model, tokens, targets = model_case(build_model, token_batch, n_blocks=2, d_qk=5, d_head=3)
    logits = np.array(model.forward(tokens, targets))
    grads = model.backward()
    for i in range(cfg["n_blocks"]):
        assert np.max(np.abs(model.params[f"blocks.{i}.attn.k.bias"])) > 1e-2
        assert np.max(np.abs(grads[f"blocks.{i}.attn.k.bias"])) <= 1e-12
        assert np.max(np.abs(grads[f"blocks.{i}.attn.q.bias"])) > 1e-4
    for i in range(cfg["n_blocks"]):
        model.params[f"blocks.{i}.attn.k.bias"][...] += 5.0
    assert rel_err(model.forward(tokens), logits) <= 1e-12


# =========================================================================== Δcausal rows
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_delta_causal_rows_sum_to_zero_single_head(causal):
    _, x, weights, delta = head_case(1, T=6)
    out, cache = attention_head_forward(x, *weights, causal=causal)
    _, _, delta_causal = attention_head_backward(delta, cache)
    assert delta_causal.shape == (2, 6, 6)
    scale = np.max(np.abs(delta_causal))
    assert scale > 1e-3
    assert np.max(np.abs(delta_causal.sum(axis=-1))) <= 1e-13 * scale
    if causal:  # P is exactly 0 above the diagonal, so Δcausal is exactly 0 there
        assert np.all(delta_causal[:, np.triu_indices(6, 1)[0], np.triu_indices(6, 1)[1]] == 0.0)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_delta_causal_rows_sum_to_zero_in_the_model(causal, build_model, token_batch):
    cfg, model, tokens, targets = model_case(build_model, token_batch, causal=causal)
    model.loss(tokens, targets)
    model.backward(keep_deltas=True)
    T = tokens.shape[1]
    for i in range(cfg["n_blocks"]):
        dc = np.asarray(model.deltas()[f"blocks.{i}.Δcausal"])
        assert dc.shape == (3, cfg["n_heads"], T, T)
        scale = np.max(np.abs(dc))
        assert scale > 1e-4
        assert np.max(np.abs(dc.sum(axis=-1))) <= 1e-13 * scale
        future = np.triu(np.ones((T, T), dtype=bool), 1)
        if causal:
            assert np.all(dc[..., future] == 0.0)
        else:
            assert np.max(np.abs(dc[..., future])) > 1e-3 * scale


# =========================================================================== permutations
def test_permutation_equivariance_single_head():
    rng, x, weights, _ = head_case(2, T=6)
    perm = np.array([3, 0, 5, 1, 4, 2])
    out, _ = attention_head_forward(x, *weights, causal=False)
    out_perm, _ = attention_head_forward(x[:, perm], *weights, causal=False)
    assert rel_err(out_perm, out[:, perm]) <= 1e-12
    # with the mask a token sees only its predecessors, which the permutation changes
    out_c, _ = attention_head_forward(x, *weights, causal=True)
    out_c_perm, _ = attention_head_forward(x[:, perm], *weights, causal=True)
    assert rel_err(out_c_perm, out_c[:, perm]) > 1e-2


@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
def test_permutation_equivariance_whole_model_without_positions(causal, build_model, token_batch):
    """With position embeddings zeroed, only attention mixes tokens: a non-causal model is
    permutation-equivariant (logits, and hence loss and gradients, follow the permutation)."""
    cfg, model, tokens, targets = model_case(build_model, token_batch, causal=causal)
    model.params["pos_emb.weight"][...] = 0.0
    perm = np.random.default_rng(0).permutation(tokens.shape[1])
    assert np.any(tokens[:, perm] != tokens)

    logits = np.array(model.forward(tokens))
    loss = model.loss(tokens, targets)
    grads = {k: np.array(v) for k, v in model.backward().items()}
    logits_perm = np.array(model.forward(tokens[:, perm]))
    if not causal:
        assert rel_err(logits_perm, logits[:, perm]) <= 1e-12
        loss_perm = model.loss(tokens[:, perm], targets[:, perm])
        assert abs(loss_perm - loss) <= 1e-12 * abs(loss)
        grads_perm = model.backward()
        for name, g in grads.items():
            if name != "pos_emb.weight":  # position rows are permuted with the tokens
                assert rel_err(grads_perm[name], g) <= 1e-10 or np.max(np.abs(g)) <= 1e-12, name
    else:
        assert rel_err(logits_perm, logits[:, perm]) > 1e-2


# =========================================================================== multi-head = heads
def check_multi_head_equals_heads(seed: int, B: int, T: int, d: int, n_heads: int, d_qk: int,
                                  d_head: int, causal: bool, rtol: float = 1e-12) -> None:
    """Section 4: MHA == concat of independent heads; Δ_in(MHA) == Σ_h Δ_in(head h).

    The fused path and the per-head path differ only in rounding (summation order, where the
    1/√d_qk scale is applied); ``rtol`` is per whole tensor.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, d))
    heads = [random_head(rng, d, d_qk, d_head) for _ in range(n_heads)]
    # the fused layout: [Wq_0 … Wq_{H-1} | Wk_0 … | Wv_0 …]
    W = np.concatenate([h[0] for h in heads] + [h[2] for h in heads] + [h[4] for h in heads], axis=1)
    b = np.concatenate([h[1] for h in heads] + [h[3] for h in heads] + [h[5] for h in heads])
    delta = rng.standard_normal((B, T, n_heads * d_head))

    qkv, _ = linear_forward(x, W, b)
    out, cache = multi_head_attention_forward(qkv, n_heads, d_qk, d_head, causal=causal)
    d_qkv, d_causal = multi_head_attention_backward(delta, cache, keep_delta_causal=True)
    d_x, d_W, d_b = linear_backward(d_qkv, x, W)

    per_head = []
    for h, weights in enumerate(heads):
        o, c = attention_head_forward(x, *weights, causal=causal)
        per_head.append((o, *attention_head_backward(delta[..., h * d_head:(h + 1) * d_head], c)))
    assert rel_err(out, np.concatenate([o for o, *_ in per_head], axis=-1)) <= rtol
    assert rel_err(d_x, sum(dx for _, dx, _, _ in per_head)) <= rtol       # the SUM of the heads
    # the fused q/k/v gradient is the heads' gradients side by side (compared as whole tensors:
    # a single head's bias gradient may be tiny through cancellation)
    grads = [g for _, _, g, _ in per_head]
    for part, axis in (("w", 1), ("b", 0)):
        fused = np.concatenate([g[part + n] for n in "qkv" for g in grads], axis=axis)
        assert rel_err(d_W if part == "w" else d_b, fused) <= rtol
    hq = n_heads * d_qk
    assert np.max(np.abs(d_b[hq:2 * hq])) <= 1e-12
    assert all(np.max(np.abs(g["bk"])) <= 1e-12 for g in grads)
    dcs = np.stack([dc for *_, dc in per_head], axis=1)                      # (B, H, T, T)
    assert rel_err(d_causal, dcs) <= rtol
    assert np.max(np.abs(dcs.sum(-1))) <= 1e-13 * max(np.max(np.abs(dcs)), 1.0)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_multi_head_is_concat_of_heads_and_input_signal_is_their_sum(causal):
    check_multi_head_equals_heads(seed=3, B=2, T=5, d=6, n_heads=3, d_qk=2, d_head=4, causal=causal)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 3), T=st.integers(1, 6), d=st.integers(1, 6),
       n_heads=st.integers(1, 3), d_qk=st.integers(1, 4), d_head=st.integers(1, 4), causal=st.booleans())
def test_multi_head_attention_properties_random_shapes(seed, B, T, d, n_heads, d_qk, d_head, causal):
    check_multi_head_equals_heads(seed, B, T, d, n_heads, d_qk, d_head, causal)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 7), d=st.integers(1, 5),
       d_qk=st.integers(1, 4), d_head=st.integers(1, 4), causal=st.booleans(),
       shift=st.floats(-10, 10, allow_nan=False))
def test_key_bias_properties_random_shapes(seed, T, d, d_qk, d_head, causal, shift):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, T, d))
    wq, bq, wk, bk, wv, bv = random_head(rng, d, d_qk, d_head)
    out, cache = attention_head_forward(x, wq, bq, wk, bk, wv, bv, causal=causal)
    _, grads, dc = attention_head_backward(rng.standard_normal(out.shape), cache)
    assert np.max(np.abs(grads["bk"])) <= 1e-12
    assert np.max(np.abs(dc.sum(-1))) <= 1e-13 * max(np.max(np.abs(dc)), 1.0)
    out_shifted, _ = attention_head_forward(x, wq, bq, wk, bk + shift, wv, bv, causal=causal)
    np.testing.assert_allclose(out_shifted, out, rtol=1e-11, atol=1e-12)


# =========================================================================== embedding
def one_hot(tokens: np.ndarray, V: int) -> np.ndarray:
    return (tokens.reshape(-1)[:, None] == np.arange(V)[None, :]).astype(np.float64)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_embedding_backward_accumulates_repeated_ids(backend):
    rng = np.random.default_rng(4)
    V, ctx, d = 9, 8, 5
    tokens = np.array([[2, 2, 7, 2, 0, 7], [7, 3, 3, 3, 2, 8]])
    assert len(np.unique(tokens)) < tokens.size       # repeats, which a plain `+=` would drop
    delta = rng.standard_normal((2, 6, d))
    tok_grad, pos_grad = np.full((V, d), np.nan), np.full((ctx, d), np.nan)
    if backend == "torch":
        t_tok, t_pos = torch.from_numpy(tok_grad), torch.from_numpy(pos_grad)  # shared memory
        embedding_backward(torch.from_numpy(delta), torch.from_numpy(tokens), t_tok, t_pos)
    else:
        embedding_backward(delta, tokens, tok_grad, pos_grad)
    dense = one_hot(tokens, V).T @ delta.reshape(-1, d)   # ohe(a0)ᵀ Δ1, the paper's form
    np.testing.assert_allclose(tok_grad, dense, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(pos_grad[:6], delta.sum(0), rtol=1e-13, atol=1e-14)
    assert np.all(pos_grad[6:] == 0.0)
    # the forward is the same one-hot product: ohe(a0) W_tok + W_pos[:T]
    tok_w, pos_w = rng.standard_normal((V, d)), rng.standard_normal((ctx, d))
    a1, _ = embedding_forward(tokens, tok_w, pos_w)
    np.testing.assert_allclose(a1, (one_hot(tokens, V) @ tok_w).reshape(2, 6, d) + pos_w[:6], rtol=1e-14)


def test_model_token_embedding_gradient_is_one_hot_product(build_model):
    cfg = default_cfg(tie_weights=False)
    model = build_model(cfg, random_params(cfg, seed=6), dtype="float64")
    tokens = np.array([[1, 1, 1, 4, 1, 4, 0, 1], [4, 1, 2, 2, 2, 2, 2, 9]])
    model.loss(tokens, np.roll(tokens, -1, axis=1))
    grads = model.backward(keep_deltas=True)
    d1 = np.asarray(model.deltas()["Δ1"])
    dense = one_hot(tokens, cfg["vocab_size"]).T @ d1.reshape(-1, cfg["d_model"])
    assert rel_err(grads["tok_emb.weight"], dense) <= 1e-13


# =========================================================================== extreme values
def reference_log_softmax_loss(logits: np.ndarray, targets: np.ndarray, ignore_index: int = -100):
    """float64 log-sum-exp, computed here independently of the library."""
    z = logits.astype(np.float64).reshape(-1, logits.shape[-1])
    t = targets.reshape(-1)
    m = z.max(axis=-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=-1))
    counted = t != ignore_index
    nll = lse[counted] - z[counted, t[counted]]
    y = np.exp(z - lse[:, None])
    delta = y.copy()
    delta[np.arange(len(t))[counted], t[counted]] -= 1.0
    delta *= counted[:, None] / counted.sum()
    return nll.mean(), delta.reshape(logits.shape)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cross_entropy_with_logits_of_magnitude_1e4_is_finite(dtype):
    rng = np.random.default_rng(7)
    logits = (1e4 * rng.choice([-1.0, 1.0], size=(2, 3, 6)) * rng.uniform(0.5, 1.0, size=(2, 3, 6)))
    logits[0, 0, :] = 1e4          # a row of ties at the extreme
    logits = logits.astype(dtype)
    targets = np.array([[1, 4, -100], [0, 5, 2]])
    loss, cache = cross_entropy_forward(logits, targets)
    delta = cross_entropy_backward(cache)
    expected_loss, expected_delta = reference_log_softmax_loss(logits, targets)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(delta))
    rtol, atol_delta = (1e-12, 1e-15) if dtype == np.float64 else (1e-6, 1e-7)
    assert abs(float(loss) - expected_loss) <= rtol * abs(expected_loss)
    assert np.max(np.abs(delta - expected_delta)) <= atol_delta


def test_attention_scores_of_magnitude_1e4_give_future_tokens_exactly_zero_weight():
    rng = np.random.default_rng(8)
    B, T, d = 2, 5, 4
    x = rng.standard_normal((B, T, d))
    wq, bq, wk, bk, wv, bv = random_head(rng, d, 4, 3)
    wq *= 300.0
    wk *= 300.0
    out, cache = attention_head_forward(x, wq, bq, wk, bk, wv, bv, causal=True)
    q, k = cache["q"], cache["k"]
    assert np.max(np.abs(q @ np.swapaxes(k, -1, -2) / 2.0)) > 1e4      # the scores really are huge
    P = cache["p"]
    future = np.triu(np.ones((T, T), dtype=bool), 1)
    assert np.all(P[:, future] == 0.0)
    assert np.all(np.isfinite(P)) and np.all(np.isfinite(out))
    np.testing.assert_allclose(P.sum(-1), 1.0, rtol=1e-12)
    d_x, grads, dc = attention_head_backward(rng.standard_normal(out.shape), cache)
    assert all(np.all(np.isfinite(g)) for g in (d_x, dc, *grads.values()))
    assert np.all(dc[:, future] == 0.0)

    # the fused multi-head path (q pre-scaled) behaves the same, in float32 too
    for dtype in (np.float64, np.float32):
        qkv = (1e3 * rng.standard_normal((B, T, 2 * (2 * 4 + 3)))).astype(dtype)
        out, cache = multi_head_attention_forward(qkv, 2, 4, 3, causal=True)
        assert np.max(np.abs(cache["q"] @ np.swapaxes(cache["k"], -1, -2))) > 1e4
        assert np.all(cache["p"][..., future] == 0.0)
        assert np.all(np.isfinite(out))
        d_qkv, _ = multi_head_attention_backward(np.ones_like(out), cache)
        assert np.all(np.isfinite(d_qkv))

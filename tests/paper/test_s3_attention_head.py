"""Paper section 3 (EQUATIONS.md "One attention head"): one head with its projections,
``q = x Wq + bq``, ``k = x Wk + bk``, ``v = x Wv + bv``, ``P = softmax(q kᵀ/√d_qk, masked)``,
``out = P v``, and its backward; for both kernel modules, against torch autograd (float64),
finite differences, and the properties the paper proves:

- the key-bias gradient is identically zero, and the output does not depend on the key bias;
- every row of Δcausal (the softmax backward) sums to zero (masked entries are exactly 0);
- without the causal mask, permuting the input tokens permutes the output rows; with it, not;
- scores of magnitude 1e4 stay finite and give future tokens exactly zero weight.

The fast kernels have no separate one-head function: a head there is the fused projection
``x [Wq | Wk | Wv] + [bq | bk | bv]`` followed by multi-head attention with one head, which is how
the model runs it. The reference module's own ``attention_head_forward`` / ``_backward`` (the
section-3 code the paper derives) is checked the same way. Tolerances: tests/oracles/gradcheck.py;
the bounds of the "unchanged" properties are derived in :func:`head_tolerance`.
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
    autograd,
    kernels_name,
    kernels_param,
    key_bias_bound,
    max_rel_err,
    model_key_bias_bounds,
    numerical_grad,
    projection,
    torch_head,
)
from torch_reference import default_cfg, random_params

WEIGHT_NAMES = ("wq", "bq", "wk", "bk", "wv", "bv")


def random_head(rng, d: int, d_qk: int, d_head: int, scale: float = 0.7):
    """``(wq, bq, wk, bk, wv, bv)`` with nonzero biases (a zero key bias would make its test empty)."""
    wq, wk, wv = (scale * rng.standard_normal((d, w)) for w in (d_qk, d_qk, d_head))
    bq, bk, bv = (0.5 * rng.standard_normal(w) for w in (d_qk, d_qk, d_head))
    return wq, bq, wk, bk, wv, bv


def head_case(seed: int, B=2, T=5, d=6, d_qk=3, d_head=4):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, d))
    return rng, x, random_head(rng, d, d_qk, d_head), rng.standard_normal((B, T, d_head))


# --------------------------------------------------------------------------- one head through K
def head_forward(K, x, weights, causal: bool):
    """One head through kernel module ``K``: fused projection, then attention with one head."""
    wq, bq, wk, bk, wv, bv = weights
    d_qk, d_head = wq.shape[1], wv.shape[1]
    W, b = np.concatenate([wq, wk, wv], axis=1), np.concatenate([bq, bk, bv])
    qkv, _ = K.linear_forward(x, W, b)
    out, attn = K.multi_head_attention_forward(qkv, 1, d_qk, d_head, causal=causal)
    return out, dict(x=x, W=W, attn=attn, d_qk=d_qk, P=as_np(K.attention_weights(attn))[:, 0])


def head_backward(K, delta, cache):
    """``(Δ_in, grads, Δcausal)`` of :func:`head_forward`, ``grads`` keyed like :data:`WEIGHT_NAMES`."""
    d_qkv, delta_causal = K.multi_head_attention_backward(delta, cache["attn"], keep_delta_causal=True)
    W, d_qk = cache["W"], cache["d_qk"]
    dW, db = np.zeros_like(W), np.zeros(W.shape[1])
    d_x = K.linear_backward(d_qkv, cache["x"], W, dweight=dW, dbias=db)
    cols = {"q": slice(0, d_qk), "k": slice(d_qk, 2 * d_qk), "v": slice(2 * d_qk, None)}
    grads = {}
    for n, c in cols.items():
        grads["w" + n], grads["b" + n] = dW[:, c], db[c]
    return d_x, grads, as_np(delta_causal)[:, 0]


def projections(x, weights):
    wq, bq, wk, bk, wv, bv = weights
    return x @ wq + bq, x @ wk + bk, x @ wv + bv


def head_tolerance(x, weights, dtype=np.float64) -> float:
    """Absolute bound on how much two computations of the same head output may differ when only
    their rounding differs (a key-bias shift, a permutation of the tokens, another kernel).

    A score ``S_αβ = q_α·k_β/√d_qk`` is computed to ``(d + d_qk)·ε·S_abs`` (``S_abs`` its absolute
    terms ``|q||k|/√d_qk``, with ``q, k`` themselves sums of ``d + 1`` terms); the softmax turns an
    absolute error ``δ`` of the scores into a relative error ``2δ`` of ``P``, plus ``(T + 2)·ε``
    of its own; ``P v`` adds ``T·ε``. With ``|P v| <= max|v|`` and a factor 4 for the two sides
    and second-order terms: ``4·(d + d_qk + 2T + 4)·ε·(1 + 2·max S_abs)·max|v|``.
    """
    wq, bq, wk, bk, wv, bv = weights
    ax = np.abs(x)
    q_abs, k_abs = ax @ np.abs(wq) + np.abs(bq), ax @ np.abs(wk) + np.abs(bk)
    v_abs = ax @ np.abs(wv) + np.abs(bv)
    d, d_qk, T = x.shape[-1], wq.shape[1], x.shape[1]
    s_abs = float(np.max(q_abs @ np.swapaxes(k_abs, -1, -2))) / math.sqrt(d_qk)
    eps = float(np.finfo(dtype).eps)
    return 4 * (d + d_qk + 2 * T + 4) * eps * (1 + 2 * s_abs) * float(np.max(v_abs))


def head_key_bias_bound(x, weights, delta, delta_causal):
    """:func:`gradcheck.key_bias_bound` for one head: ``q`` and ``dP = Δ vᵀ`` from the inputs."""
    q, _, v = projections(x, weights)
    dP = delta @ np.swapaxes(v, -1, -2)
    return key_bias_bound(q[:, None], dP[:, None], delta_causal[:, None])


def torch_delta_causal(x, weights, delta, causal: bool):
    """Autograd's ``dL/dS`` of the scaled, masked scores (a leaf here), ``(B, T, T)``."""
    q, k, v = (torch.tensor(a) for a in projections(x, weights))
    S = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        T = x.shape[1]
        S = S.masked_fill(torch.arange(T)[None, :] > torch.arange(T)[:, None], float("-inf"))
    S = S.detach().requires_grad_(True)
    (torch.softmax(S, dim=-1) @ v).backward(torch.tensor(delta))
    return S.grad.numpy()


CAUSAL = pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])


# =========================================================================== autograd, FD
@kernels_param()
@CAUSAL
def test_head_matches_autograd(K, causal):
    _, x, weights, delta = head_case(0)                           # d_qk = 3 != d_head = 4
    out, cache = head_forward(K, x, weights, causal)
    d_x, grads, delta_causal = head_backward(K, delta, cache)
    inputs = {"x": x} | dict(zip(WEIGHT_NAMES, weights))
    ref_out, ref = autograd(lambda x, wq, bq, wk, bk, wv, bv: torch_head(x, wq, bq, wk, bk, wv, bv, causal),
                            inputs, upstream=delta)
    assert_autograd_close(out, ref_out, "out = P v")
    assert_autograd_close(d_x, ref["x"], "Δ_in (the head's share of Δ_{i-1})")
    for name in ("wq", "bq", "wk", "wv", "bv"):
        assert_autograd_close(grads[name], ref[name], f"∂L/∂{name}")
    assert_autograd_close(delta_causal, torch_delta_causal(x, weights, delta, causal), "Δcausal")
    bound = head_key_bias_bound(x, weights, delta, delta_causal)
    assert np.all(np.abs(grads["bk"]) <= bound) and np.all(np.abs(ref["bk"]) <= bound)   # both ≡ 0


@kernels_param()
@CAUSAL
def test_head_matches_finite_differences(K, causal):
    rng = np.random.default_rng(11)
    B, T, d, d_qk, d_head = 2, 4, 5, 3, 2                          # d_qk != d_head
    x = rng.standard_normal((B, T, d))
    weights = list(random_head(rng, d, d_qk, d_head))
    R = rng.standard_normal((B, T, d_head))

    def f():
        return projection(head_forward(K, x, weights, causal)[0], R)

    d_x, grads, _ = head_backward(K, R, head_forward(K, x, weights, causal)[1])
    for i, name in enumerate(WEIGHT_NAMES):
        if name != "bk":
            assert_fd_close(grads[name], numerical_grad(f, weights[i]), f"head.{name}")
    assert_fd_close(d_x, numerical_grad(f, x), "head.x")
    # the key bias: its true gradient is 0, and FD sees only the rounding of f (|f| <= 10):
    # <= a few ε·10 / h = ~1e-8
    assert np.max(np.abs(numerical_grad(f, weights[3]))) <= 1e-8


@CAUSAL
def test_reference_head_is_the_section_3_code(causal):
    """``layers.attention_head_forward/_backward`` (the head as the paper derives it, with its
    own projections) against autograd and against the fused path of the same module."""
    _, x, weights, delta = head_case(1)
    out, cache = reference.attention_head_forward(x, *weights, causal=causal)
    d_x, grads, delta_causal = reference.attention_head_backward(delta, cache)
    assert set(grads) == set(WEIGHT_NAMES)
    ref_out, ref = autograd(lambda x, wq, bq, wk, bk, wv, bv: torch_head(x, wq, bq, wk, bk, wv, bv, causal),
                            {"x": x} | dict(zip(WEIGHT_NAMES, weights)), upstream=delta)
    assert_autograd_close(out, ref_out, "out")
    assert_autograd_close(d_x, ref["x"], "Δ_in")
    for name in ("wq", "bq", "wk", "wv", "bv"):
        assert_autograd_close(grads[name], ref[name], f"∂L/∂{name}")
    assert_autograd_close(delta_causal, torch_delta_causal(x, weights, delta, causal), "Δcausal")
    assert np.all(np.abs(grads["bk"]) <= head_key_bias_bound(x, weights, delta, delta_causal))
    np.testing.assert_array_equal(cache["p"], reference.attention_weights(cache["attn"]))
    fused_out, _ = head_forward(reference, x, weights, causal)
    assert np.max(np.abs(fused_out - out)) <= head_tolerance(x, weights)


# =========================================================================== key bias
@kernels_param()
@CAUSAL
def test_key_bias_gradient_is_zero_and_output_ignores_key_bias(K, causal):
    rng, x, weights, delta = head_case(0)
    out, cache = head_forward(K, x, weights, causal)
    _, grads, delta_causal = head_backward(K, delta, cache)
    assert np.all(np.abs(grads["bk"]) <= head_key_bias_bound(x, weights, delta, delta_causal))
    assert np.max(np.abs(grads["bq"])) > 1e-3                    # the other biases do get gradients

    wq, bq, wk, bk, wv, bv = weights
    shifted = (wq, bq, wk, bk + 3.0 * rng.standard_normal(bk.shape), wv, bv)
    out_shifted, _ = head_forward(K, x, shifted, causal)
    tol = max(head_tolerance(x, weights), head_tolerance(x, shifted))
    assert np.max(np.abs(out_shifted - out)) <= tol
    # control: the query bias is not inert, so the comparison above can fail
    out_q, _ = head_forward(K, x, (wq, bq + 3.0, wk, bk, wv, bv), causal)
    assert np.max(np.abs(out_q - out)) > 1e3 * tol


@kernels_param()
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(1, 7), d=st.integers(1, 5),
       d_qk=st.integers(1, 4), d_head=st.integers(1, 4), causal=st.booleans(),
       shift=st.floats(-10, 10, allow_nan=False))
def test_key_bias_properties_random_shapes(K, seed, T, d, d_qk, d_head, causal, shift):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, T, d))
    weights = random_head(rng, d, d_qk, d_head)
    out, cache = head_forward(K, x, weights, causal)
    delta = rng.standard_normal(out.shape)
    _, grads, dc = head_backward(K, delta, cache)
    assert np.all(np.abs(grads["bk"]) <= head_key_bias_bound(x, weights, delta, dc))
    wq, bq, wk, bk, wv, bv = weights
    shifted = (wq, bq, wk, bk + shift, wv, bv)
    out_shifted, _ = head_forward(K, x, shifted, causal)
    assert np.max(np.abs(out_shifted - out)) <= max(head_tolerance(x, weights), head_tolerance(x, shifted))


# =========================================================================== Δcausal rows
@kernels_param()
@CAUSAL
def test_delta_causal_rows_sum_to_zero(K, causal):
    _, x, weights, delta = head_case(1, T=6)
    out, cache = head_forward(K, x, weights, causal)
    _, _, delta_causal = head_backward(K, delta, cache)
    assert delta_causal.shape == (2, 6, 6)
    assert np.max(np.abs(delta_causal)) > 1e-3
    # a computed row sums to at most (2T + 6)·ε·max|dP| (gradcheck.key_bias_bound), dP = Δ vᵀ
    _, _, v = projections(x, weights)
    dP = np.abs(delta @ np.swapaxes(v, -1, -2))
    bound = 2 * (2 * 6 + 6) * np.finfo(np.float64).eps * np.max(dP, axis=-1)
    assert np.all(np.abs(delta_causal.sum(axis=-1)) <= bound)
    future = np.triu(np.ones((6, 6), dtype=bool), 1)
    if causal:  # P is exactly 0 above the diagonal (exp(−∞) = 0), so Δcausal is exactly 0 there
        assert np.all(delta_causal[:, future] == 0.0) and np.all(cache["P"][:, future] == 0.0)
    else:
        assert np.all(delta_causal[:, future] != 0.0)


# =========================================================================== permutations
@kernels_param()
def test_permutation_equivariance_without_the_mask_and_not_with_it(K):
    _, x, weights, _ = head_case(2, T=6)
    perm = np.array([3, 0, 5, 1, 4, 2])
    out, _ = head_forward(K, x, weights, causal=False)
    out_perm, _ = head_forward(K, x[:, perm], weights, causal=False)
    assert np.max(np.abs(out_perm - out[:, perm])) <= head_tolerance(x, weights)
    # with the mask a token sees only its predecessors, which the permutation changes
    out_c, _ = head_forward(K, x, weights, causal=True)
    out_c_perm, _ = head_forward(K, x[:, perm], weights, causal=True)
    assert max_rel_err(out_c_perm, out_c[:, perm]) > 1e-2


# =========================================================================== extreme scores
@kernels_param()
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_scores_of_magnitude_1e4_give_future_tokens_exactly_zero_weight(K, dtype):
    rng = np.random.default_rng(8)
    B, T, d = 2, 5, 4
    x = rng.standard_normal((B, T, d)).astype(dtype)
    wq, bq, wk, bk, wv, bv = (a.astype(dtype) for a in random_head(rng, d, 4, 3))
    weights = (300 * wq, bq, 300 * wk, bk, wv, bv)
    out, cache = head_forward(K, x, weights, causal=True)
    q, k, _ = projections(x.astype(np.float64), [w.astype(np.float64) for w in weights])
    assert np.max(np.abs(q @ np.swapaxes(k, -1, -2) / 2.0)) > 1e4      # the scores really are huge
    P = cache["P"]
    future = np.triu(np.ones((T, T), dtype=bool), 1)
    assert np.all(P[:, future] == 0.0)
    assert np.all(np.isfinite(P)) and np.all(np.isfinite(as_np(out)))
    # each row of P: T quotients e_β / Σe (one rounding each) of a sum of T terms, so the row
    # sums to 1 within (2T + 2) ulps on any IEEE-754 machine (tighter than 1e-12 for that reason)
    eps = float(np.finfo(dtype).eps)
    assert np.max(np.abs(P.sum(-1) - 1.0)) <= (2 * T + 2) * eps
    d_x, grads, dc = head_backward(K, rng.standard_normal(out.shape).astype(dtype), cache)
    assert all(np.all(np.isfinite(as_np(g))) for g in (d_x, dc, *grads.values()))
    assert np.all(dc[:, future] == 0.0)


# =========================================================================== in the model
def model_case(build_model, token_batch, K, **overrides):
    cfg = default_cfg(**overrides)
    model = build_model(cfg, random_params(cfg, seed=5), dtype="float64", kernels=kernels_name(K))
    tokens, targets = token_batch(cfg, 3, cfg["context_length"], seed=5, n_ignored=2)
    return cfg, model, tokens, targets


# Whole-model comparisons of quantities equal in exact arithmetic: a block's attention output
# differs by at most head_tolerance (~1e-14 of its scale here); the later layers (layer norms with
# 1/σ = O(1), FC layers with O(1) weights, 2 blocks) amplify that by O(10-100), so 1e-10
# relative leaves a margin of 100 or more on any IEEE-754 machine.
RTOL_MODEL_ROUNDING = 1e-10


@kernels_param()
def test_key_bias_gradient_is_zero_and_logits_ignore_key_bias_in_the_model(K, build_model, token_batch):
    cfg, model, tokens, targets = model_case(build_model, token_batch, K, n_blocks=2, d_qk=5, d_head=3)
    logits = as_np(model.forward(tokens, targets))
    grads = model.backward(keep_deltas=True)
    bounds = model_key_bias_bounds(model)
    for i in range(cfg["n_blocks"]):
        assert np.max(np.abs(as_np(model.params[f"blocks.{i}.attn.k.bias"]))) > 1e-2
        assert np.all(np.abs(as_np(grads[f"blocks.{i}.attn.k.bias"])) <= bounds[i])
        assert np.max(np.abs(as_np(grads[f"blocks.{i}.attn.q.bias"]))) > 1e-4
    for i in range(cfg["n_blocks"]):
        model.params[f"blocks.{i}.attn.k.bias"][...] += 5.0
    assert max_rel_err(model.forward(tokens), logits) <= RTOL_MODEL_ROUNDING


@kernels_param()
@CAUSAL
def test_delta_causal_rows_sum_to_zero_in_the_model(K, causal, build_model, token_batch):
    cfg, model, tokens, targets = model_case(build_model, token_batch, K, causal=causal)
    model.loss(tokens, targets)
    model.backward(keep_deltas=True)
    T, H = tokens.shape[1], cfg["n_heads"]
    deltas, acts = model.deltas(), model.activations()
    for i in range(cfg["n_blocks"]):
        dc = as_np(deltas[f"blocks.{i}.Δcausal"])
        assert dc.shape == (3, H, T, T)
        scale = np.max(np.abs(dc))
        assert scale > 1e-4
        a2 = as_np(acts[f"blocks.{i}.a2"])
        v = a2 @ as_np(model.params[f"blocks.{i}.attn.v.weight"]) + as_np(model.params[f"blocks.{i}.attn.v.bias"])
        d3 = as_np(deltas[f"blocks.{i}.Δ3"])
        split = lambda a: a.reshape(3, T, H, -1).transpose(0, 2, 1, 3)  # noqa: E731
        dP = np.abs(split(d3) @ np.swapaxes(split(v), -1, -2))
        assert np.all(np.abs(dc.sum(axis=-1)) <= 2 * (2 * T + 6) * np.finfo(np.float64).eps * dP.max(-1))
        future = np.triu(np.ones((T, T), dtype=bool), 1)
        if causal:
            assert np.all(dc[..., future] == 0.0)
        else:
            assert np.max(np.abs(dc[..., future])) > 1e-3 * scale


@kernels_param()
@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
def test_permutation_equivariance_of_the_model_without_positions(K, causal, build_model, token_batch):
    """With position embeddings zeroed, only attention mixes tokens: a non-causal model is
    permutation-equivariant (logits, and hence loss and gradients, follow the permutation)."""
    cfg, model, tokens, targets = model_case(build_model, token_batch, K, causal=causal)
    model.params["pos_emb.weight"][...] = 0.0
    perm = np.random.default_rng(0).permutation(tokens.shape[1])
    assert np.any(tokens[:, perm] != tokens)

    logits = as_np(model.forward(tokens))
    loss = model.loss(tokens, targets)
    grads = {k: as_np(v) for k, v in model.backward().items()}
    logits_perm = as_np(model.forward(tokens[:, perm]))
    if not causal:
        assert max_rel_err(logits_perm, logits[:, perm]) <= RTOL_MODEL_ROUNDING
        loss_perm = model.loss(tokens[:, perm], targets[:, perm])
        assert abs(loss_perm - loss) <= RTOL_MODEL_ROUNDING * abs(loss)
        grads_perm = model.backward(keep_deltas=True)
        bounds = model_key_bias_bounds(model)
        for name, g in grads.items():
            if name.endswith(".attn.k.bias"):                    # rounding noise, ≡ 0
                assert np.all(np.abs(as_np(grads_perm[name])) <= bounds[int(name.split(".")[1])]), name
            elif name != "pos_emb.weight":  # position rows are permuted with the tokens
                assert max_rel_err(grads_perm[name], g) <= RTOL_MODEL_ROUNDING, name
    else:
        assert max_rel_err(logits_perm, logits[:, perm]) > 1e-2


"""Every layer's hand-derived backward against central finite differences, one layer at a time.

Each layer gets its own tiny float64 problem and the scalar objective ``f = Σ out ∘ R`` with a
fixed random ``R`` (so ``Δ = R`` is the error signal fed to the backward). Every entry of every
input and parameter is perturbed by ``±h``: ``(f(θ+h) − f(θ−h)) / 2h``. Truncation error is
``O(h²) ≈ 1e-12`` and rounding ``≈ 1e-16·|f|/h ≈ 1e-9`` (observed: <= 4e-9), so agreement to a
relative 1e-7 (per tensor, ``max|a−b| / max|b|``) is a real check while leaving room for rounding.
A final test spot-checks the whole model's gradients the same way.
"""

from __future__ import annotations

import numpy as np
import pytest

from pedestrian.layers import (
    activation_backward,
    activation_forward,
    attention_head_backward,
    attention_head_forward,
    cross_entropy_backward,
    cross_entropy_forward,
    dropout_backward,
    dropout_forward,
    embedding_backward,
    embedding_forward,
    layernorm_backward,
    layernorm_forward,
    linear_backward,
    linear_forward,
    lora_backward,
    lora_forward,
    multi_head_attention_backward,
    multi_head_attention_forward,
)
from torch_reference import default_cfg, expand_lora_targets, random_params

H_STEP = 1e-6
RTOL_FD = 1e-7


def numerical_grad(f, arr: np.ndarray, h: float = H_STEP) -> np.ndarray:
    """Central differences of the scalar ``f()`` w.r.t. every entry of ``arr`` (perturbed in place)."""
    grad = np.zeros_like(arr)
    for idx in np.ndindex(arr.shape):
        old = arr[idx]
        arr[idx] = old + h
        f_plus = f()
        arr[idx] = old - h
        f_minus = f()
        arr[idx] = old
        grad[idx] = (f_plus - f_minus) / (2 * h)
    return grad


def assert_fd_close(analytic, numeric, name: str, rtol: float = RTOL_FD) -> None:
    analytic = np.asarray(analytic)
    assert analytic.shape == numeric.shape, name
    scale = np.max(np.abs(numeric))
    assert scale > 1e-3, f"{name}: the finite-difference gradient is ~0, the check would prove nothing"
    err = np.max(np.abs(analytic - numeric)) / scale
    assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol:.0e}"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# --------------------------------------------------------------------------- fully connected
def test_linear(rng):
    x = rng.standard_normal((2, 3, 4))
    W = rng.standard_normal((4, 5))
    b = rng.standard_normal(5)
    R = rng.standard_normal((2, 3, 5))

    def f():
        return float(np.sum(linear_forward(x, W, b)[0] * R))

    y, cache = linear_forward(x, W, b)
    d_x, d_W, d_b = linear_backward(R, cache, W)
    for name, analytic, arr in (("W", d_W, W), ("b", d_b, b), ("x", d_x, x)):
        assert_fd_close(analytic, numerical_grad(f, arr), f"linear.{name}")


# --------------------------------------------------------------------------- activations
@pytest.mark.parametrize("name", ["relu", "gelu", "gelu_tanh"])
def test_activation(name, rng):
    x = rng.standard_normal((2, 3, 4)) * 2.0
    x = np.where(np.abs(x) < 0.05, 0.5, x)  # keep ReLU's kink farther than h from every point
    R = rng.standard_normal(x.shape)

    def f():
        return float(np.sum(activation_forward(x, name)[0] * R))

    y, cache = activation_forward(x, name)
    assert_fd_close(activation_backward(R, cache, name), numerical_grad(f, x), name)


# --------------------------------------------------------------------------- dropout
def test_dropout_with_fixed_mask(rng):
    x = rng.standard_normal((2, 3, 8))
    R = rng.standard_normal(x.shape)
    p = 0.3

    def f():  # the same seed each time: the same mask
        return float(np.sum(dropout_forward(x, p, np.random.default_rng(5))[0] * R))

    y, mask = dropout_forward(x, p, np.random.default_rng(5))
    assert np.any(mask == 0.0) and np.any(mask > 0.0)
    np.testing.assert_allclose(mask[mask > 0], 1.0 / (1.0 - p))
    assert_fd_close(dropout_backward(R, mask), numerical_grad(f, x), "dropout.x")


# --------------------------------------------------------------------------- layer norm
@pytest.mark.parametrize("eps", [0.0, 1e-5])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layernorm(eps, with_bias, rng):
    x = rng.standard_normal((2, 3, 6)) * 1.5 + 0.3
    w = 1.0 + 0.3 * rng.standard_normal(6)
    b = 0.2 * rng.standard_normal(6) if with_bias else None
    R = rng.standard_normal(x.shape)

    def f():
        return float(np.sum(layernorm_forward(x, w, b, eps)[0] * R))

    y, cache = layernorm_forward(x, w, b, eps)
    d_x, d_w, d_b = layernorm_backward(R, cache)
    checks = [("w", d_w, w), ("x", d_x, x)] + ([("b", d_b, b)] if with_bias else [])
    for name, analytic, arr in checks:
        assert_fd_close(analytic, numerical_grad(f, arr), f"layernorm(eps={eps}).{name}")


# --------------------------------------------------------------------------- one attention head
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_attention_head(causal, rng):
    B, T, d, d_qk, d_head = 2, 4, 5, 3, 2  # d_qk != d_head
    x = rng.standard_normal((B, T, d))
    wq, wk, wv = (rng.standard_normal((d, w)) * 0.7 for w in (d_qk, d_qk, d_head))
    bq, bk, bv = (rng.standard_normal(w) * 0.5 for w in (d_qk, d_qk, d_head))
    R = rng.standard_normal((B, T, d_head))

    def f():
        return float(np.sum(attention_head_forward(x, wq, bq, wk, bk, wv, bv, causal=causal)[0] * R))

    out, cache = attention_head_forward(x, wq, bq, wk, bk, wv, bv, causal=causal)
    d_x, grads, _ = attention_head_backward(R, cache)
    for name, arr in (("wq", wq), ("bq", bq), ("wk", wk), ("wv", wv), ("bv", bv)):
        assert_fd_close(grads[name], numerical_grad(f, arr), f"head.{name}")
    assert_fd_close(d_x, numerical_grad(f, x), "head.x")
    # the key bias: its true gradient is 0 (paper section 3); FD sees only rounding noise
    assert np.max(np.abs(grads["bk"])) <= 1e-12
    assert np.max(np.abs(numerical_grad(f, bk))) <= 1e-8


# --------------------------------------------------------------------------- multi-head attention
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_multi_head_attention(causal, rng):
    B, T, n_heads, d_qk, d_head = 2, 4, 2, 3, 2
    qkv = rng.standard_normal((B, T, n_heads * (2 * d_qk + d_head)))
    R = rng.standard_normal((B, T, n_heads * d_head))

    def f():
        return float(np.sum(multi_head_attention_forward(qkv, n_heads, d_qk, d_head, causal=causal)[0] * R))

    out, cache = multi_head_attention_forward(qkv, n_heads, d_qk, d_head, causal=causal)
    d_qkv, _ = multi_head_attention_backward(R, cache)
    assert_fd_close(d_qkv, numerical_grad(f, qkv), "mha.qkv")


# --------------------------------------------------------------------------- embedding
def test_embedding_with_repeated_ids(rng):
    V, ctx, d = 6, 7, 3
    tokens = np.array([[1, 4, 1, 1, 0], [4, 4, 2, 1, 5]])  # ids 1 and 4 repeat, 3 is unused
    tok = rng.standard_normal((V, d))
    pos = rng.standard_normal((ctx, d))
    R = rng.standard_normal((2, 5, d))

    def f():
        return float(np.sum(embedding_forward(tokens, tok, pos)[0] * R))

    a1, cache = embedding_forward(tokens, tok, pos)
    d_tok, d_pos = np.full_like(tok, np.nan), np.full_like(pos, np.nan)  # must be overwritten
    embedding_backward(R, cache, d_tok, d_pos)
    assert_fd_close(d_tok, numerical_grad(f, tok), "embedding.tok")
    assert_fd_close(d_pos, numerical_grad(f, pos), "embedding.pos")
    assert np.all(d_tok[3] == 0.0) and np.all(d_pos[5:] == 0.0)  # unused rows get exactly 0


# --------------------------------------------------------------------------- LoRA
def test_lora(rng):
    x = rng.standard_normal((2, 3, 4))
    D = rng.standard_normal((4, 2))
    U = rng.standard_normal((2, 5))  # nonzero, unlike a fresh adapter, so every path matters
    alpha = 0.7
    R = rng.standard_normal((2, 3, 5))

    def f():
        return float(np.sum(lora_forward(x, D, U, alpha)[0] * R))

    y, cache = lora_forward(x, D, U, alpha)
    d_x, d_D, d_U = lora_backward(R, cache, D, U, alpha)
    for name, analytic, arr in (("D", d_D, D), ("U", d_U, U), ("x", d_x, x)):
        assert_fd_close(analytic, numerical_grad(f, arr), f"lora.{name}")


# --------------------------------------------------------------------------- cross-entropy
def test_cross_entropy_with_ignore_index(rng):
    logits = rng.standard_normal((2, 4, 5)) * 2.0
    targets = np.array([[0, 3, -100, 4], [-100, 1, 1, 2]])

    def f():
        return float(cross_entropy_forward(logits, targets)[0])

    loss, cache = cross_entropy_forward(logits, targets)
    delta = cross_entropy_backward(cache)
    assert_fd_close(delta, numerical_grad(f, logits), "cross_entropy.logits")
    assert np.all(delta[targets == -100] == 0.0)  # ignored rows get no signal


# --------------------------------------------------------------------------- whole model
def spot_check(model, tokens, targets, n_per_tensor: int = 3, h: float = 1e-5, dropout_seed=None) -> None:
    """FD on ``n_per_tensor`` random entries of every parameter tensor of ``model``.

    With ``dropout_seed`` the dropout generator is reset before every loss, so every
    evaluation draws the same masks (a fixed mask, as in :func:`test_dropout_with_fixed_mask`).
    """
    def loss():
        if dropout_seed is not None:
            model.dropout_rng = np.random.default_rng(dropout_seed)
        return model.loss(tokens, targets)

    loss()
    grads = {k: np.array(v) for k, v in model.backward().items()}
    assert set(grads) == set(model.params)
    assert max(float(np.max(np.abs(g))) for g in grads.values()) > 1e-2
    pick = np.random.default_rng(0)
    for name, value in model.params.items():
        for _ in range(n_per_tensor):
            idx = tuple(int(pick.integers(0, n)) for n in value.shape)
            old = value[idx]
            value[idx] = old + h
            f_plus = loss()
            value[idx] = old - h
            f_minus = loss()
            value[idx] = old
            fd = (f_plus - f_minus) / (2 * h)
            assert abs(grads[name][idx] - fd) <= 1e-8 + 1e-6 * abs(fd), (name, idx, grads[name][idx], fd)


SMALL = dict(vocab_size=7, context_length=5, d_model=6, n_heads=2, n_blocks=2, d_qk=2, d_head=3)


def test_whole_model_spot_check(build_model, token_batch):
    """FD on a few entries of every parameter tensor (LoRA adapters included) of a 2-block GPT."""
    cfg = default_cfg(**SMALL)
    lora = {"targets": expand_lora_targets(cfg, ["blocks.1.attn.q", "mlp_expand", "logits"]), "rank": 2}
    params = random_params(cfg, seed=3, lora=lora)
    model = build_model(cfg, params, dtype="float64", lora=lora, lora_alpha=0.7)
    tokens, targets = token_batch(cfg, 2, 5, seed=3, n_ignored=2)
    spot_check(model, tokens, targets)


def test_whole_model_spot_check_with_dropout(build_model, token_batch):
    """Dropout after the embedding, the attention projection and the MLP, with fixed masks."""
    cfg = default_cfg(**SMALL, tie_weights=True, activation="gelu")
    model = build_model(cfg, random_params(cfg, seed=4), dtype="float64", dropout=0.3)
    assert model.training
    tokens, targets = token_batch(cfg, 2, 5, seed=4, n_ignored=1)
    model.dropout_rng = np.random.default_rng(9)
    masked = model.loss(tokens, targets)
    model.training = False
    assert abs(model.loss(tokens, targets) - masked) > 1e-6  # dropout really is on in training
    model.training = True
    spot_check(model, tokens, targets, dropout_seed=9)

"""Paper section 2 (EQUATIONS.md "Embedding"): ``a1 = W_tok[a0] + W_pos[positions]``,
``dW_tok = ohe(a0)ᵀ Δ1`` (repeated ids accumulate), ``dW_pos[p] = Σ Δ1`` over position ``p``;
for both kernel modules, against torch autograd (float64), finite differences, and the paper's
one-hot form. Tolerances: tests/oracles/gradcheck.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradcheck import (
    as_np,
    assert_autograd_close,
    assert_fd_close,
    autograd,
    kernels_name,
    kernels_param,
    numerical_grad,
    projection,
    sum_rounding_bound,
)
from torch_reference import default_cfg, random_params

V, CTX, D = 9, 8, 5
TOKENS = np.array([[2, 2, 7, 2, 0, 7], [7, 3, 3, 3, 2, 8]])   # ids 2, 3, 7 repeat; 1, 4, 5, 6 unused


def tables(seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((V, D)), rng.standard_normal((CTX, D)), rng.standard_normal((*TOKENS.shape, D))


def one_hot(tokens: np.ndarray, n: int) -> np.ndarray:
    return (np.asarray(tokens).reshape(-1)[:, None] == np.arange(n)[None, :]).astype(np.float64)


def backward(K, R, cache, like_tok, like_pos):
    dtok, dpos = np.zeros_like(like_tok), np.zeros_like(like_pos)
    assert K.embedding_backward(R, cache, dtok=dtok, dpos=dpos) is None   # no Δ_in: a0 are ints
    return dtok, dpos


POSITIONS = {
    "default": None,                                          # 0 … T-1
    "offset": np.arange(2, 8),                                # a KV-cache step continuing at 2
    "per-row": np.array([[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]),   # row 0 left-padded by 2
}


@kernels_param()
@pytest.mark.parametrize("positions", list(POSITIONS), ids=list(POSITIONS))
def test_embedding_matches_autograd(K, positions):
    tok, pos, R = tables()
    p = POSITIONS[positions]
    a1, cache = K.embedding_forward(TOKENS, tok, pos, p)
    dtok, dpos = backward(K, R, cache, tok, pos)
    index = torch.arange(TOKENS.shape[1]) if p is None else torch.as_tensor(p)
    out, grads = autograd(lambda W_tok, W_pos: W_tok[torch.as_tensor(TOKENS)] + W_pos[index],
                          {"W_tok": tok, "W_pos": pos}, upstream=R)
    assert_autograd_close(a1, out, "a1")
    assert_autograd_close(dtok, grads["W_tok"], "∂L/∂W_tok")
    assert_autograd_close(dpos, grads["W_pos"], "∂L/∂W_pos")


@kernels_param()
@pytest.mark.parametrize("positions", ["default", "per-row"])
def test_embedding_matches_finite_differences(K, positions):
    tok, pos, R = tables(1)
    p = POSITIONS[positions]

    def f():
        return projection(K.embedding_forward(TOKENS, tok, pos, p)[0], 0.3 * R)

    dtok, dpos = backward(K, 0.3 * R, K.embedding_forward(TOKENS, tok, pos, p)[1], tok, pos)
    assert_fd_close(dtok, numerical_grad(f, tok), "embedding.W_tok")
    assert_fd_close(dpos, numerical_grad(f, pos), "embedding.W_pos")
    assert np.all(dtok[[1, 4, 5, 6]] == 0.0)                    # unused ids get exactly 0
    used = set(range(6)) if p is None else set(np.unique(p).tolist())
    assert all(np.all(dpos[i] == 0.0) for i in range(CTX) if i not in used)


@kernels_param()
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_repeated_ids_accumulate_as_the_one_hot_product(K, backend):
    """``dW_tok = ohe(a0)ᵀ Δ1``, the paper's form, computed densely: a plain fancy-index ``+=``
    would drop the repeats. The embedding backward *writes* the arrays it is given, whatever
    they held (every layer backward writes: docs/EQUATIONS.md; the model adds a tied logits
    layer's part after)."""
    _, _, R = tables(2)
    assert len(np.unique(TOKENS)) < TOKENS.size
    start_tok, start_pos = np.random.default_rng(3).standard_normal((V, D)), np.zeros((CTX, D))
    dtok, dpos = start_tok.copy(), start_pos.copy()
    if backend == "torch":
        t_tok, t_pos = torch.from_numpy(dtok), torch.from_numpy(dpos)          # share memory
        tok_t, pos_t = torch.zeros(V, D, dtype=torch.float64), torch.zeros(CTX, D, dtype=torch.float64)
        _, cache = K.embedding_forward(torch.from_numpy(TOKENS), tok_t, pos_t)
        K.embedding_backward(torch.from_numpy(R), cache, dtok=t_tok, dpos=t_pos)
    else:
        _, cache = K.embedding_forward(TOKENS, np.zeros((V, D)), np.zeros((CTX, D)))
        K.embedding_backward(R, cache, dtok=dtok, dpos=dpos)
    ohe = one_hot(TOKENS, V)
    dense = ohe.T @ R.reshape(-1, D)
    # the same ≤ 4 terms per entry (a token occurs at most 4 times), summed in another order: Higham's
    # bound on the absolute terms; the start value is gone
    bound = sum_rounding_bound(5, ohe.T @ np.abs(R.reshape(-1, D)))
    assert np.all(np.abs(dtok - dense) <= bound)
    bound_pos = sum_rounding_bound(2, np.abs(R).sum(0))
    assert np.all(np.abs(dpos[:6] - R.sum(0)) <= bound_pos)
    assert np.all(dpos[6:] == 0.0)


@kernels_param()
def test_forward_is_the_one_hot_product(K):
    tok, pos, _ = tables(4)
    a1, _ = K.embedding_forward(TOKENS, tok, pos)
    # a one-hot row times W_tok adds exact zeros to one product by exactly 1: the same number
    dense = (one_hot(TOKENS, V) @ tok).reshape(*TOKENS.shape, D) + pos[:6]
    np.testing.assert_array_equal(as_np(a1), dense)
    a1_np, _ = K.embedding_forward(TOKENS, tok, None)                       # no learned positions
    np.testing.assert_array_equal(as_np(a1_np), tok[TOKENS])


@kernels_param()
def test_model_token_embedding_gradient_is_the_one_hot_product(K, build_model):
    cfg = default_cfg(tie_weights=False)
    model = build_model(cfg, random_params(cfg, seed=6), dtype="float64", kernels=kernels_name(K))
    tokens = np.array([[1, 1, 1, 4, 1, 4, 0, 1], [4, 1, 2, 2, 2, 2, 2, 9]])
    model.loss(tokens, np.roll(tokens, -1, axis=1))
    grads = model.backward(keep_deltas=True)
    d1 = as_np(model.deltas()["Δ1"]).reshape(-1, cfg["d_model"])
    ohe = one_hot(tokens, cfg["vocab_size"])
    bound = sum_rounding_bound(tokens.size, ohe.T @ np.abs(d1))
    assert np.all(np.abs(as_np(grads["tok_emb.weight"]) - ohe.T @ d1) <= bound)
    assert np.max(np.abs(ohe.T @ d1)) > 1e-3


@kernels_param()
def test_accumulate_tok_adds_the_lookups_part_to_what_is_there(K):
    """Tied weights: ``dtok`` already holds the logits' part; ``accumulate_tok`` adds
    ``ohe(a0)ᵀ Δ1`` to it (each row a sum of at most 3 terms added to it: a rounding or two)."""
    W_tok, W_pos, R = tables()
    _, cache = K.embedding_forward(TOKENS, W_tok, W_pos)
    logits_part = np.random.default_rng(1).standard_normal(W_tok.shape)
    dtok, dpos = logits_part.copy(), np.full_like(W_pos, np.nan)      # dpos is still written
    K.embedding_backward(R, cache, dtok=dtok, dpos=dpos, accumulate_tok=True)
    want = logits_part + one_hot(TOKENS, V).T @ R.reshape(-1, D)
    np.testing.assert_allclose(dtok, want, rtol=0, atol=8 * np.finfo(float).eps * np.abs(want).max())
    np.testing.assert_allclose(dpos, backward(K, R, cache, W_tok, W_pos)[1], rtol=0, atol=0)

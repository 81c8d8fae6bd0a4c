"""The GPU's embedding backward, LoRA branch and AdamW (:mod:`pedestrian.gpu.embedding`,
:mod:`~pedestrian.gpu.lora`, :mod:`~pedestrian.gpu.adamw`) against the reference, float32 and float64.

Tolerances (gpu_helpers.bound):

- embedding: a table row is a sum of the ``k ≤ B·T`` rows of ``Δ1`` holding its token, in token
  order on both sides (the reference's scatter-add, the kernel's runs of sorted ids): ``S = k·max|Δ|``,
  ``n = k``; run twice, the same bits (no atomics);
- LoRA: products of inner length ``K = max(f_in, N, f_out)`` (cuBLAS / BLAS block them differently),
  two in a row, scaled by ``α``: ``S = K²·max|x|·max|D|·max|U|·α`` (and the same with ``Δ``) and
  ``n = 2K``;
- AdamW: elementwise, about a dozen roundings per element on each side from the same inputs:
  ``bound(0, 24, max|θ| + lr·11)`` (a step moves ``θ`` by at most about ``10·lr``, optim.py's AdamW).
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import DEVICE, DTYPES, assert_close, bound, numpy, table, tensor

from pedestrian import layers


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,d,positions", [(1, 5, 7, False), (2, 9, 33, True), (3, 4, 300, False)])
def test_embedding_backward_sums_repeated_ids_in_token_order_as_the_reference(B, T, d, positions, dtype):
    K = table(dtype)
    V, ctx = 11, 16
    rng = np.random.default_rng(d)
    tokens = rng.integers(0, V, (B, T))
    tokens[0, :3] = 4                                                         # repeats
    pos = np.stack([np.arange(T) + 2 * b for b in range(B)]) if positions else None
    delta = rng.normal(0.0, 1.0, (B, T, d)).astype(dtype)
    cache_ref = (tokens, pos)
    want_tok, want_pos = np.zeros((V, d), dtype), np.zeros((ctx, d), dtype)
    layers.embedding_backward(delta, cache_ref, dtok=want_tok, dpos=want_pos)
    cache = (tensor(tokens), None if pos is None else tensor(pos))
    runs = []
    for _ in range(2):
        dtok, dpos = tensor(np.full((V, d), np.nan, dtype)), tensor(np.full((ctx, d), np.nan, dtype))
        K.embedding_backward(tensor(delta), cache, dtok=dtok, dpos=dpos)
        runs.append((numpy(dtok), numpy(dpos)))
    tol = bound(B * T, 1, B * T * np.abs(delta).max(), dtype)
    assert_close(runs[0][0], want_tok, tol, "dW_tok")
    assert_close(runs[0][1], want_pos, tol, "dW_pos")
    np.testing.assert_array_equal(runs[0][0], runs[1][0])                   # deterministic
    # tied weights: the lookup's part added to the logits' part already there
    base = rng.normal(0.0, 1.0, (V, d)).astype(dtype)
    want_tied = base.copy()
    layers.embedding_backward(delta, cache_ref, dtok=want_tied, accumulate_tok=True)
    got_tied = tensor(base)
    K.embedding_backward(tensor(delta), cache, dtok=got_tied, accumulate_tok=True)
    assert_close(got_tied, want_tied, tol + bound(0, 1, np.abs(base).max(), dtype), "dW_tok tied")


def test_embedding_backward_refuses_an_id_outside_the_table_by_name():
    K = table("float32")
    cache = (tensor(np.array([[1, 12]])), None)
    with pytest.raises(ValueError, match="token id 12 at position"):
        K.embedding_backward(tensor(np.zeros((1, 2, 3), np.float32)), cache, dtok=tensor(np.zeros((5, 3), np.float32)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("into_columns", [False, True])
def test_lora_branch_added_into_the_frozen_product_equals_the_reference(masked, into_columns, dtype):
    K = table(dtype)
    rng = np.random.default_rng(7)
    B, T, f_in, r, f_out, alpha = 2, 5, 9, 3, 7, 0.7
    x = rng.normal(0.0, 1.0, (B, T, f_in)).astype(dtype)
    D = rng.normal(0.0, 0.5, (f_in, r)).astype(dtype)
    U = rng.normal(0.0, 0.5, (r, f_out)).astype(dtype)
    mask = (rng.random((B, T, f_in)) > 0.3).astype(dtype) / np.dtype(dtype).type(0.7) if masked else None
    wide = rng.normal(0.0, 1.0, (B, T, f_out + 4)).astype(dtype)            # the frozen output
    delta = rng.normal(0.0, 1.0, (B, T, f_out)).astype(dtype)
    base_in = rng.normal(0.0, 1.0, (B, T, f_in)).astype(dtype)               # the frozen Δ Wᵀ
    want_y = wide.copy()
    _, cache_ref = layers.lora_forward(x, D, U, alpha, mask, add_to=want_y[..., 2:2 + f_out])
    got_wide = tensor(wide)
    target = got_wide[..., 2:2 + f_out] if into_columns else got_wide
    if not into_columns:
        want_y = wide.copy()
        want_y[..., :f_out] += layers.lora_forward(x, D, U, alpha, mask)[0]
        target = got_wide[..., :f_out]
    out, cache = K.lora_forward(tensor(x), tensor(D), tensor(U), alpha, None if mask is None else tensor(mask),
                                add_to=target)
    assert out.data_ptr() == target.data_ptr()
    K_len = max(f_in, B * T, f_out)
    scale = K_len ** 2 * 1.0 * np.abs(x).max() * (1.5 if masked else 1) * np.abs(D).max() * np.abs(U).max() * alpha
    tol = bound(2 * K_len, 2, scale + np.abs(wide).max(), dtype)
    assert_close(got_wide, want_y, tol, "x W + α x D U")
    want_D, want_U = np.zeros_like(D), np.zeros_like(U)
    want_in = base_in.copy()
    layers.lora_backward(delta, cache_ref, D, U, alpha, dD=want_D, dU=want_U, add_to=want_in)
    got_D, got_U = tensor(np.full_like(D, np.nan)), tensor(np.full_like(U, np.nan))
    got_in = tensor(base_in)
    back = K.lora_backward(tensor(delta), cache, tensor(D), tensor(U), alpha, dD=got_D, dU=got_U, add_to=got_in)
    assert back.data_ptr() == got_in.data_ptr()
    scale_b = K_len ** 2 * np.abs(delta).max() * max(np.abs(x).max() * 1.5, 1.0) * max(np.abs(D).max(), 1.0) \
        * max(np.abs(U).max(), 1.0) * alpha
    tol_b = bound(2 * K_len, 2, scale_b + np.abs(base_in).max(), dtype)
    assert_close(got_D, want_D, tol_b, "dD")
    assert_close(got_U, want_U, tol_b, "dU")
    assert_close(got_in, want_in, tol_b, "Δ_in")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grad_scale", [1.0, 0.25])
def test_adamw_kernel_is_the_numpy_update_with_the_clipping_scale_inside(grad_scale, dtype):
    from pedestrian.gpu.adamw import adamw_update
    from pedestrian.training import optim

    rng = np.random.default_rng(3)
    n = 3000                                                                  # 3 blocks, the last partial
    p, g = rng.normal(0, 1, n).astype(dtype), rng.normal(0, 1, n).astype(dtype)
    m, v = rng.normal(0, 0.1, n).astype(dtype), rng.random(n).astype(dtype) * 0.01
    lr, b1, b2, eps_, t, wd = 1e-2, 0.9, 0.99, 1e-8, 3, 0.1
    step_size, bc2, decay = lr / (1 - b1 ** t), (1 - b2 ** t) ** 0.5, 1 - lr * wd
    want = [a.copy() for a in (p, g * np.dtype(dtype).type(grad_scale), m, v)]
    optim._adamw_numpy(want[0], want[1], want[2], want[3], decay, b1, b2, step_size * bc2, eps_ * bc2, 1024)
    got = [tensor(a) for a in (p, g, m, v)]
    adamw_update(*got, decay, b1, b2, step_size * bc2, eps_ * bc2, grad_scale=grad_scale)
    np.testing.assert_array_equal(numpy(got[1]), g)                          # the gradient is only read
    for k, name in ((0, "θ"), (2, "m"), (3, "v")):
        assert_close(got[k], want[k], bound(0, 24, np.abs(want[k]).max() + 11 * lr, dtype), name)


@pytest.mark.skipif(DEVICE != "cuda", reason="the optimizer takes the Triton pass for CUDA tensors only")
def test_adamw_on_cuda_buffers_runs_the_kernel(monkeypatch):
    import torch

    from pedestrian.gpu import adamw
    from pedestrian.training.optim import AdamW, ParamGroup

    calls = []
    real = adamw.adamw_update
    monkeypatch.setattr(adamw, "adamw_update", lambda *a, **k: calls.append(1) or real(*a, **k))
    p = torch.zeros(10, device="cuda")
    opt = AdamW([ParamGroup("base", p, torch.ones(10, device="cuda"), 5)], lr=0.1)
    opt.step()
    assert calls and torch.all(p != 0)

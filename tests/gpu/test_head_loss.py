"""The fused head's Triton kernel (``gpu/head_loss.py``) against the reference layer, tiny shapes.

Tolerance: the module docstring of ``gpu_helpers`` (``bound(n, k, S)``): the two compute the same
formulas; the logits are sums of ``d`` terms, each row's statistics sums of ``V`` terms (Triton
in blocks, the reference pairwise), ``dW`` sums of ``N`` terms over chunks, ``Δ11`` of ``V``
terms; so every tensor is within ``(N + V + d + 8)·ε`` of its scale (``S``: the largest sum of
magnitudes entering it, bounded here by ``max|h|·max|W|·d`` for the logits and 2 for a softmax row
over ``C``) -- the same first-order bound as tests/paper/test_s1_head_loss.py, applied per tensor.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import DTYPES, assert_close, eps, numpy, tensor

from pedestrian import layers


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias,chunk_rows,device_count", [(True, 4, False), (False, 7, True), (True, None, True)])
def test_fused_head_kernel_equals_the_reference(dtype, bias, chunk_rows, device_count, monkeypatch):
    from pedestrian.gpu import head_loss

    monkeypatch.setattr(head_loss, "BLOCK", 16)                # V = 37: three blocks of a row
    B, T, d, V = 2, 5, 6, 37
    rng = np.random.default_rng(1)
    h, W = rng.standard_normal((B, T, d)), rng.standard_normal((d, V))
    b = rng.standard_normal(V) if bias else None
    y = rng.integers(0, V, (B, T))
    y[1, :3] = -100
    n_total = 9 if not device_count else None
    want_loss, want = layers.head_loss_forward(h, W, b, y, n_total=n_total)
    ht, Wt = tensor(h, dtype), tensor(W, dtype)
    bt = None if b is None else tensor(b, dtype)
    loss, cache = head_loss.head_loss_forward(ht, Wt, bt, tensor(y), n_total=n_total, chunk_rows=chunk_rows)
    dW, db = tensor(np.empty_like(W), dtype), None if b is None else tensor(np.empty_like(b), dtype)
    dh = head_loss.head_loss_backward(cache, dweight=dW, dbias=db)
    N, S = B * T, float(np.abs(h).max() * np.abs(W).max() * d)
    tol = lambda scale: (N + V + d + 8) * eps(dtype) * scale            # noqa: E731
    assert_close(loss, want_loss, tol(S + 2.0), "loss")
    assert_close(dh, want.dh, tol(2.0 * np.abs(W).max() * (1 + 2 * d * S)), "Δ11")
    assert_close(dW, want.dweight, tol(2.0 * np.abs(h).max() * N * (1 + 2 * d * S)), "dW")
    if b is not None:
        assert_close(db, want.dbias, tol(2.0 * N * (1 + 2 * d * S)), "db")
    assert np.abs(numpy(dW)).max() > 1e-3


def test_evaluation_makes_no_gradient():
    from pedestrian.gpu import head_loss

    rng = np.random.default_rng(2)
    h, W, y = rng.standard_normal((1, 3, 4)), rng.standard_normal((4, 9)), rng.integers(0, 9, (1, 3))
    loss, cache = head_loss.head_loss_forward(tensor(h), tensor(W), None, tensor(y), grad=False)
    assert cache.dh is None and cache.dweight is None
    assert_close(loss, layers.head_loss_forward(h, W, None, y)[0], 1e-13, "loss")

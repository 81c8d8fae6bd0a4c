"""The NumPy and the PyTorch-tensor backends run the same hand-written code (array API) and must
agree: same loss, logits, gradients and error signals in float64 to a relative 1e-12 per tensor
(only summation order may differ), LoRA included. No autograd is involved on either side.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pedestrian.backend import to_numpy
from pedestrian.layers import (
    activation_backward,
    activation_forward,
    attention_head_backward,
    attention_head_forward,
    cross_entropy_backward,
    cross_entropy_forward,
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

RTOL = 1e-12

CASES = {
    "untied-gelu_tanh": (dict(), None),
    "tied-relu-nobias-dqk5-dhead3": (dict(tie_weights=True, activation="relu", bias=False, d_qk=5, d_head=3), None),
    "noncausal-gelu-eps0": (dict(causal=False, activation="gelu", ln_eps=0.0), None),
    "lora-frozen-tied": (dict(tie_weights=True), (["attn.q", "attn.v", "mlp_contract", "logits"], True)),
    "lora-trained-untied": (dict(), (["attn.k", "attn_proj", "mlp_expand", "logits"], False)),
}


@pytest.mark.parametrize("case_id", list(CASES))
def test_numpy_and_torch_backends_agree_float64(case_id, build_model, token_batch, max_rel_err):
    overrides, lora_case = CASES[case_id]
    cfg = default_cfg(**overrides)
    lora = None if lora_case is None else {"targets": expand_lora_targets(cfg, lora_case[0]), "rank": 2}
    params = random_params(cfg, seed=11, lora=lora)
    tokens, targets = token_batch(cfg, 3, cfg["context_length"], seed=11, n_ignored=3)
    kw = dict(dtype="float64", lora=lora, lora_alpha=0.7, freeze_base=bool(lora_case and lora_case[1]))

    results = {}
    for backend in ("numpy", "torch"):
        model = build_model(cfg, params, backend=backend, **kw)
        loss = model.loss(tokens, targets)
        grads = model.backward(keep_deltas=True)
        if backend == "torch":
            assert all(isinstance(g, torch.Tensor) and g.dtype == torch.float64 for g in grads.values())
            assert isinstance(model.activations()["a12"], torch.Tensor)
        results[backend] = (loss, to_numpy(model.activations()["a12"]),
                            {k: to_numpy(v).copy() for k, v in grads.items()},
                            {k: to_numpy(v).copy() for k, v in model.deltas().items()})

    (loss_np, logits_np, grads_np, deltas_np), (loss_t, logits_t, grads_t, deltas_t) = results.values()
    assert abs(loss_t - loss_np) <= RTOL * abs(loss_np)
    assert max_rel_err(logits_t, logits_np) <= RTOL
    assert set(grads_t) == set(grads_np) and len(grads_np) > 0
    for name in grads_np:
        if name.endswith(".attn.k.bias"):   # identically 0 in exact arithmetic
            assert np.max(np.abs(grads_t[name])) <= 1e-12 and np.max(np.abs(grads_np[name])) <= 1e-12
        else:
            assert max_rel_err(grads_t[name], grads_np[name]) <= RTOL, name
    assert set(deltas_t) == set(deltas_np)
    for name in deltas_np:
        assert max_rel_err(deltas_t[name], deltas_np[name]) <= RTOL, name


def test_backends_agree_with_dropout_and_float32(build_model, token_batch, max_rel_err):
    """Dropout masks are drawn in NumPy from the same seed on both backends; float32 agrees to 1e-5."""
    cfg = default_cfg()
    params = random_params(cfg, seed=12)
    tokens, targets = token_batch(cfg, 2, 8, seed=12, n_ignored=1)
    out = {}
    for backend in ("numpy", "torch"):
        model = build_model(cfg, params, backend=backend, dtype="float32", dropout=0.2)
        model.training = True
        loss = model.loss(tokens, targets)
        grads = model.backward()
        out[backend] = loss, {k: to_numpy(v).copy() for k, v in grads.items()}
    (l_np, g_np), (l_t, g_t) = out.values()
    assert abs(l_t - l_np) <= 1e-5 * abs(l_np)
    for name in g_np:
        if not name.endswith(".attn.k.bias"):
            assert max_rel_err(g_t[name], g_np[name]) <= 1e-5, name


def _torch(*arrays):
    return [None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


def test_every_layer_function_runs_on_torch_tensors(max_rel_err):
    """Each layer's forward/backward on torch tensors equals the NumPy result (float64)."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 4, 6))
    W, b, R = rng.standard_normal((6, 5)), rng.standard_normal(5), rng.standard_normal((2, 4, 5))

    def same(a_np, a_t, what):
        assert isinstance(a_t, torch.Tensor), what
        assert max_rel_err(to_numpy(a_t), np.asarray(a_np)) <= RTOL, what

    y, c = linear_forward(x, W, b)
    yt, ct = linear_forward(*_torch(x, W, b))
    same(y, yt, "linear fwd")
    for a, at in zip(linear_backward(R, c, W), linear_backward(*_torch(R), ct, *_torch(W))):
        same(a, at, "linear bwd")

    for name in ("relu", "gelu", "gelu_tanh"):
        y, c = activation_forward(x, name)
        yt, ct = activation_forward(*_torch(x), name)
        same(y, yt, name)
        same(activation_backward(x, c, name), activation_backward(*_torch(x), ct, name), name + " bwd")

    w = 1 + 0.1 * rng.standard_normal(6)
    x_rows = rng.standard_normal((3, 5, 6))          # > 8 rows: the torch path's other statistics
    for xs, eps in ((x, 0.0), (x, 1e-5), (x_rows, 1e-5)):
        y, c = layernorm_forward(xs, w, b[:1].repeat(6), eps)
        yt, ct = layernorm_forward(*_torch(xs, w, b[:1].repeat(6)), eps)
        same(y, yt, "layernorm")
        for a, at in zip(layernorm_backward(xs, c), layernorm_backward(*_torch(xs), ct)):
            same(a, at, "layernorm bwd")

    D, U = rng.standard_normal((6, 2)), rng.standard_normal((2, 5))
    y, c = lora_forward(x, D, U, 0.7)
    yt, ct = lora_forward(*_torch(x, D, U), 0.7)
    same(y, yt, "lora")
    for a, at in zip(lora_backward(R, c, D, U, 0.7), lora_backward(*_torch(R), ct, *_torch(D, U), 0.7)):
        same(a, at, "lora bwd")

    head = [rng.standard_normal(s) for s in ((6, 3), (3,), (6, 3), (3,), (6, 2), (2,))]
    for causal in (True, False):
        y, c = attention_head_forward(x, *head, causal=causal)
        yt, ct = attention_head_forward(*_torch(x, *head), causal=causal)
        same(y, yt, "head")
        d_in, g, dc = attention_head_backward(R[..., :2], c)
        d_in_t, g_t, dc_t = attention_head_backward(*_torch(R[..., :2]), ct)
        same(d_in, d_in_t, "head bwd")
        same(dc, dc_t, "head Δcausal")
        for k in ("wq", "bq", "wk", "wv", "bv"):
            same(g[k], g_t[k], "head " + k)

        qkv = rng.standard_normal((2, 4, 2 * (2 * 3 + 2)))
        y, c = multi_head_attention_forward(qkv, 2, 3, 2, causal=causal)
        yt, ct = multi_head_attention_forward(*_torch(qkv), 2, 3, 2, causal=causal)
        same(y, yt, "mha")
        delta = rng.standard_normal(y.shape)
        same(multi_head_attention_backward(delta, c)[0],
             multi_head_attention_backward(*_torch(delta), ct)[0], "mha bwd")

    logits, targets = 3 * rng.standard_normal((2, 4, 5)), np.array([[0, -100, 4, 1], [2, 2, -100, 3]])
    loss, c = cross_entropy_forward(logits, targets)
    loss_t, ct = cross_entropy_forward(*_torch(logits, targets))
    assert abs(float(loss_t) - float(loss)) <= RTOL * abs(float(loss))
    same(cross_entropy_backward(c), cross_entropy_backward(ct), "cross-entropy bwd")


def test_large_product_with_transposed_right_operand_in_blocks():
    """matmul_into's torch path for big ``a @ Wᵀ`` (tied logits) computes it in row blocks of W."""
    torch = pytest.importorskip("torch")
    from pedestrian.backend import matmul_into

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 32, generator=gen, dtype=torch.float64)
    w = torch.randn(70_001, 32, generator=gen, dtype=torch.float64)   # 4.5M outputs: the blocked path
    out = torch.empty(64, 70_001, dtype=torch.float64)
    matmul_into(out, a, w.mT)
    torch.testing.assert_close(out, a @ w.mT, rtol=1e-12, atol=1e-12)

"""The NumPy and the PyTorch-tensor backends run the same hand-written code (the reference layers
in array-API form; the fast kernels run torch CPU tensors through NumPy views of their memory,
tensors on other devices through the reference) and must agree, for both kernel modules: same loss,
logits, gradients and error signals in float64 to a relative 1e-12 per tensor (only the order of
rounded operations differs: a few hundred operations along a chain, <= ~1e-13; see
tests/paper/test_model.py), LoRA included. No autograd is involved on either side.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradcheck import KERNEL_IDS, kernels_param, model_key_bias_bounds
from pedestrian.backend import to_numpy
from torch_reference import default_cfg, expand_lora_targets, random_params

RTOL = 1e-12

CASES = {
    "untied-gelu_tanh": (dict(), None),
    "tied-relu-nobias-dqk5-dhead3": (dict(tie_weights=True, activation="relu", bias=False, d_qk=5, d_head=3), None),
    "noncausal-gelu-eps0": (dict(causal=False, activation="gelu", ln_eps=0.0), None),
    "lora-frozen-tied": (dict(tie_weights=True), (["attn.q", "attn.v", "mlp_contract", "logits"], True)),
    "lora-trained-untied": (dict(), (["attn.k", "attn_proj", "mlp_expand", "logits"], False)),
}


@pytest.mark.parametrize("kernels", KERNEL_IDS)
@pytest.mark.parametrize("case_id", list(CASES))
def test_numpy_and_torch_backends_agree_float64(case_id, kernels, build_model, token_batch, max_rel_err):
    overrides, lora_case = CASES[case_id]
    cfg = default_cfg(**overrides)
    lora = None if lora_case is None else {"targets": expand_lora_targets(cfg, lora_case[0]), "rank": 2}
    params = random_params(cfg, seed=11, lora=lora)
    tokens, targets = token_batch(cfg, 3, cfg["context_length"], seed=11, n_ignored=3)
    kw = dict(dtype="float64", lora=lora, lora_alpha=0.7, freeze_base=bool(lora_case and lora_case[1]),
              kernels=kernels)

    results = {}
    for backend in ("numpy", "torch"):
        model = build_model(cfg, params, backend=backend, **kw)
        loss = model.loss(tokens, targets)
        grads = model.backward(keep_deltas=True)
        if backend == "torch":
            assert all(isinstance(g, torch.Tensor) and g.dtype == torch.float64 for g in grads.values())
            assert isinstance(model.activations()["a11"], torch.Tensor)
        grads = {k: to_numpy(v).copy() for k, v in grads.items()}
        deltas = {k: to_numpy(v).copy() for k, v in model.deltas().items()}
        bounds = model_key_bias_bounds(model)
        logits = to_numpy(model.forward(tokens))          # (model.loss fuses the head: no a12 kept)
        results[backend] = (loss, logits, grads, deltas, bounds)

    (loss_np, logits_np, grads_np, deltas_np, bounds), (loss_t, logits_t, grads_t, deltas_t, _) = results.values()
    assert abs(loss_t - loss_np) <= RTOL * abs(loss_np)
    assert max_rel_err(logits_t, logits_np) <= RTOL
    assert set(grads_t) == set(grads_np) and len(grads_np) > 0
    for name in grads_np:
        if name.endswith(".attn.k.bias"):   # identically 0 in exact arithmetic: rounding noise
            i = int(name.split(".")[1])
            assert np.all(np.abs(grads_t[name]) <= bounds[i]) and np.all(np.abs(grads_np[name]) <= bounds[i])
        else:
            assert max_rel_err(grads_t[name], grads_np[name]) <= RTOL, name
    assert set(deltas_t) == set(deltas_np)
    for name in deltas_np:
        assert max_rel_err(deltas_t[name], deltas_np[name]) <= RTOL, name


@pytest.mark.parametrize("kernels", KERNEL_IDS)
def test_backends_agree_with_dropout_and_float32(kernels, build_model, token_batch, max_rel_err):
    """Dropout masks are drawn in NumPy from the same seed on both backends; float32 agrees to 1e-5."""
    cfg = default_cfg()
    params = random_params(cfg, seed=12)
    tokens, targets = token_batch(cfg, 2, 8, seed=12, n_ignored=1)
    out = {}
    for backend in ("numpy", "torch"):
        model = build_model(cfg, params, backend=backend, dtype="float32", dropout=0.2, kernels=kernels)
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


@kernels_param()
def test_every_layer_function_runs_on_torch_tensors(K, max_rel_err):
    """Each layer's forward/backward on torch tensors equals the NumPy result (float64), for both
    kernel modules; the gradients land in the caller's torch tensors (the fast kernels write
    them through NumPy views)."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 4, 6))
    W, b, R = rng.standard_normal((6, 5)), rng.standard_normal(5), rng.standard_normal((2, 4, 5))

    def same(a_np, a_t, what):
        assert isinstance(a_t, torch.Tensor), what
        assert max_rel_err(to_numpy(a_t), np.asarray(a_np)) <= RTOL, what

    def grads_of(backward, *args, shapes, **kwargs):
        """Run a backward that writes gradients into given arrays; returns (Δ_in, *gradients)."""
        names = list(shapes)
        if isinstance(args[0], torch.Tensor):
            out = {n: torch.zeros(s, dtype=torch.float64) for n, s in shapes.items()}
        else:
            out = {n: np.zeros(s) for n, s in shapes.items()}
        d_in = backward(*args, **kwargs, **out)
        return [d_in] + [out[n] for n in names]

    y, c = K.linear_forward(x, W, b)
    yt, ct = K.linear_forward(*_torch(x, W, b))
    same(y, yt, "linear fwd")
    shapes = dict(dweight=W.shape, dbias=b.shape)
    for a, at in zip(grads_of(K.linear_backward, R, c, W, shapes=shapes),
                     grads_of(K.linear_backward, *_torch(R), ct, *_torch(W), shapes=shapes)):
        same(a, at, "linear bwd")

    for name in ("relu", "gelu", "gelu_tanh"):
        y, c = K.activation_forward(x, name)
        yt, ct = K.activation_forward(*_torch(x), name)
        same(y, yt, name)
        same(K.activation_backward(x, c, name), K.activation_backward(*_torch(x), ct, name), name + " bwd")

    w = 1 + 0.1 * rng.standard_normal(6)
    x_rows = rng.standard_normal((3, 5, 6))
    shapes = dict(dweight=(6,), dbias=(6,))
    for xs, eps in ((x, 0.0), (x, 1e-5), (x_rows, 1e-5)):
        y, c = K.layernorm_forward(xs, w, b[:1].repeat(6), eps)
        yt, ct = K.layernorm_forward(*_torch(xs, w, b[:1].repeat(6)), eps)
        same(y, yt, "layernorm")
        for a, at in zip(grads_of(K.layernorm_backward, xs, c, shapes=shapes),
                         grads_of(K.layernorm_backward, *_torch(xs), ct, shapes=shapes)):
            same(a, at, "layernorm bwd")

    D, U = rng.standard_normal((6, 2)), rng.standard_normal((2, 5))
    y, c = K.lora_forward(x, D, U, 0.7)
    yt, ct = K.lora_forward(*_torch(x, D, U), 0.7)
    same(y, yt, "lora")
    shapes = dict(dD=D.shape, dU=U.shape)
    for a, at in zip(grads_of(K.lora_backward, R, c, D, U, 0.7, shapes=shapes),
                     grads_of(K.lora_backward, *_torch(R), ct, *_torch(D, U), 0.7, shapes=shapes)):
        same(a, at, "lora bwd")

    tokens = np.array([[1, 4, 1, 0], [4, 4, 2, 1]])
    tok, pos = rng.standard_normal((5, 6)), rng.standard_normal((4, 6))
    a1, c = K.embedding_forward(tokens, tok, pos)
    a1t, ct = K.embedding_forward(*_torch(tokens, tok, pos))
    same(a1, a1t, "embedding")
    shapes = dict(dtok=tok.shape, dpos=pos.shape)
    for a, at in zip(grads_of(K.embedding_backward, x, c, shapes=shapes)[1:],
                     grads_of(K.embedding_backward, *_torch(x), ct, shapes=shapes)[1:]):
        same(a, at, "embedding bwd")

    for causal in (True, False):
        qkv = rng.standard_normal((2, 4, 2 * (2 * 3 + 2)))
        y, c = K.multi_head_attention_forward(qkv, 2, 3, 2, causal=causal)
        yt, ct = K.multi_head_attention_forward(*_torch(qkv), 2, 3, 2, causal=causal)
        same(y, yt, "mha")
        same(K.attention_weights(c), K.attention_weights(ct), "P")
        delta = rng.standard_normal(y.shape)
        d, dc = K.multi_head_attention_backward(delta, c, keep_delta_causal=True)
        dt, dct = K.multi_head_attention_backward(*_torch(delta), ct, keep_delta_causal=True)
        same(d, dt, "mha bwd")
        same(dc, dct, "mha Δcausal")

    logits, targets = 3 * rng.standard_normal((2, 4, 5)), np.array([[0, -100, 4, 1], [2, 2, -100, 3]])
    loss, c = K.cross_entropy_forward(logits, targets)
    loss_t, ct = K.cross_entropy_forward(*_torch(logits, targets))
    assert abs(float(loss_t) - float(loss)) <= RTOL * abs(float(loss))
    same(K.cross_entropy_backward(c), K.cross_entropy_backward(ct), "cross-entropy bwd")
    same(K.add(x, x), K.add(*_torch(x, x)), "add")


def test_reference_head_runs_on_torch_tensors(max_rel_err):
    """The section-3 head of the reference layers (no fast version) on torch tensors."""
    import pedestrian.layers as reference

    rng = np.random.default_rng(14)
    x, R = rng.standard_normal((2, 4, 6)), rng.standard_normal((2, 4, 2))
    head = [rng.standard_normal(s) for s in ((6, 3), (3,), (6, 3), (3,), (6, 2), (2,))]
    for causal in (True, False):
        y, c = reference.attention_head_forward(x, *head, causal=causal)
        yt, ct = reference.attention_head_forward(*_torch(x, *head), causal=causal)
        assert max_rel_err(to_numpy(yt), y) <= RTOL
        d_in, g, dc = reference.attention_head_backward(R, c)
        d_in_t, g_t, dc_t = reference.attention_head_backward(*_torch(R), ct)
        assert max_rel_err(to_numpy(d_in_t), d_in) <= RTOL
        assert max_rel_err(to_numpy(dc_t), dc) <= RTOL
        for k in ("wq", "bq", "wk", "wv", "bv"):
            assert max_rel_err(to_numpy(g_t[k]), g[k]) <= RTOL, k


def test_fast_kernels_run_tensors_off_the_cpu_through_the_reference():
    """Torch tensors on another device (torch's shape-only ``meta`` device here: no data, so no
    NumPy view of it can exist) run the reference layers, and attention from
    ``TILED_MIN_T["torch"]`` tokens on the tiled kernel's torch loop; CPU tensors run the numba
    kernels (whose layer-norm cache holds ``1/σ`` where the reference's holds ``σ``)."""
    import pedestrian.kernels as fast
    from pedestrian.kernels.attention_tiled import TILED_MIN_T

    x, w = torch.empty((2, 4, 6), device="meta", dtype=torch.float64), torch.empty(6, device="meta", dtype=torch.float64)
    y, (_, sigma, _) = fast.layernorm_forward(x, w, w, 1e-5)
    assert y.device.type == "meta" and sigma.shape == (2, 4, 1)               # the reference's cache: σ
    for T, tiled in ((4, False), (TILED_MIN_T["torch"], True)):
        qkv = torch.empty((1, T, 2 * (2 * 3 + 2)), device="meta", dtype=torch.float64)
        out, cache = fast.multi_head_attention_forward(qkv, 2, 3, 2)
        assert out.shape == (1, T, 4) and bool(cache.get("tiled")) == tiled
        d_qkv, _ = fast.multi_head_attention_backward(out, cache)
        assert d_qkv.shape == qkv.shape and d_qkv.device.type == "meta"
    x = torch.arange(48, dtype=torch.float64).reshape(2, 4, 6) ** 2
    y, (_, inv_sigma, _) = fast.layernorm_forward(x, torch.ones(6, dtype=torch.float64), None, 1e-5)
    assert isinstance(y, torch.Tensor) and isinstance(inv_sigma, torch.Tensor)
    assert torch.allclose(inv_sigma * (x.var(-1, correction=0, keepdim=True) + 1e-5).sqrt(), torch.ones(1, dtype=torch.float64))


def test_fast_kernels_take_torch_tensors_by_keyword_and_hand_inputs_back_as_given():
    """The seam finds the tensors among keyword arguments too, and an input a kernel returns as it
    came (the ReLU cache holds ``x``) is the caller's own tensor, not a new one around its view
    (a result fed back in then never nests views call after call)."""
    import pedestrian.kernels as fast

    x, w = torch.randn((3, 5), dtype=torch.float64), torch.randn((5, 4), dtype=torch.float64)
    y, cache = fast.linear_forward(x=x, weight=w, bias=None)
    assert torch.allclose(y, x @ w) and cache is x
    y, cache = fast.activation_forward(x, "relu")
    assert cache is x and torch.equal(y, x.clamp(min=0))


@pytest.mark.parametrize("kernels", KERNEL_IDS)
def test_a_backward_under_inference_mode_leaves_the_model_usable(kernels):
    """The gradient buffers are made on the first backward; made inside ``torch.inference_mode``
    they would be inference tensors that no later backward outside it may write."""
    from pedestrian import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=11, context_length=8, d_model=8, n_heads=2, n_blocks=1, tie_weights=True)
    model = GPT(cfg, seed=0, backend="torch", kernels=kernels, dtype="float64")
    tokens = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model.loss(tokens, tokens)
        first = {k: v.clone() for k, v in model.backward().items()}
    model.loss(tokens, tokens)
    again = model.backward()
    assert all(torch.equal(first[k], again[k]) for k in first)

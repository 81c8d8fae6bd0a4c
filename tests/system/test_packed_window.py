"""The model with the attention's new masks and scores: exact causal zeros through the whole chain,
packed segments (``GPT.loss(..., segments=)``), sliding windows (config, KV cache, generation),
score soft-cap and scale (EQUATIONS.md "Exact zeros", "Packed segments", "Sliding window",
"Score scale and soft-cap")."""

from __future__ import annotations

import numpy as np
import pytest

from pedestrian import GPT, GPTConfig
from pedestrian.generation.generate import generate
from pedestrian.generation.sampling import Sampling
from pedestrian.model.kv_cache import KVCache

KERNELS = pytest.mark.parametrize("kernels", ["reference", "fast"])


def _config(**over) -> GPTConfig:
    base = dict(vocab_size=13, context_length=24, d_model=12, n_heads=4, n_blocks=2, n_kv_heads=2,
                position_encoding="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    return GPTConfig(**{**base, **over})


def _grads(model) -> dict:
    return {k: np.asarray(v, np.float64).copy() for k, v in model.backward().items()}


@KERNELS
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("pe", ["rope", "learned"])
def test_loss_at_t_sends_exactly_zero_to_later_embeddings(kernels, dtype, pe):
    """A loss at position ``t`` only: ``Δ1`` (the signal at the input embeddings ``a1``) of every
    later position is ``== 0.0``, through every block (issue 49 item 5)."""
    model = GPT(_config(position_encoding=pe, norm="layernorm", mlp="standard", bias=True), dtype=dtype,
                kernels=kernels, seed=1)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 13, (2, 11))
    for t in (0, 4, 9):
        targets = np.full((2, 11), -100)
        targets[:, t] = rng.integers(0, 13, 2)
        model.loss(tokens, targets)
        model.backward(keep_deltas=True)
        d1 = np.asarray(model.deltas()["Δ1"])
        assert np.all(d1[:, t + 1:] == 0.0) and np.any(d1[:, :t + 1] != 0.0)


def _packed_case(T=20, seed=0):
    rng = np.random.default_rng(seed)
    segments = np.array([[0] * 7 + [1] * 9 + [2] * 4, [3] * 12 + [4] * 8])
    tokens = rng.integers(0, 13, (2, T))
    targets = rng.integers(0, 13, (2, T))
    ends = np.ones((2, T), bool)
    ends[:, :-1] = segments[:, 1:] != segments[:, :-1]
    targets[ends] = -100                                                 # no target across a boundary
    targets[0, 2] = -100                                                 # and one ignored inside
    return tokens, targets, segments


@KERNELS
@pytest.mark.parametrize("pe", ["rope", "learned"])
def test_packed_window_equals_the_segments_one_by_one(kernels, pe):
    """Loss and gradients of a packed window = the count-weighted sums of each segment's own
    run (float64; the same products summed in another order: 1e-12 of the largest entry)."""
    config = _config(position_encoding=pe, sliding_window=5, layer_types=("sliding_attention", "full_attention"))
    model = GPT(config, dtype="float64", kernels=kernels, seed=2)
    tokens, targets, segments = _packed_case()
    N = int(np.sum(targets != -100))
    loss = model.loss(tokens, targets, segments=segments)
    grads = _grads(model)
    total_loss, total = 0.0, {k: np.zeros_like(v) for k, v in grads.items()}
    for b in range(2):
        for s in np.unique(segments[b]):
            cols = segments[b] == s
            n = int(np.sum(targets[b, cols] != -100))
            if n == 0:
                continue
            total_loss += n / N * model.loss(tokens[b:b + 1, cols], targets[b:b + 1, cols])
            for k, v in _grads(model).items():
                total[k] += n / N * v
    assert abs(loss - total_loss) <= 1e-12 * abs(total_loss)
    for k, v in grads.items():
        assert np.max(np.abs(v - total[k])) <= 1e-12 * max(np.max(np.abs(total[k])), 1e-300), k


@KERNELS
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_loss_on_one_segment_sends_exactly_zero_to_the_others(kernels, dtype):
    model = GPT(_config(), dtype=dtype, kernels=kernels, seed=3)
    tokens, targets, segments = _packed_case(seed=1)
    targets = np.where(segments == 1, targets, -100)                     # only segment 1 (row 0) counts
    model.loss(tokens, targets, segments=segments)
    model.backward(keep_deltas=True)
    d1 = np.asarray(model.deltas()["Δ1"])
    assert np.all(d1[0, segments[0] != 1] == 0.0) and np.all(d1[1] == 0.0)
    assert np.any(d1[0, segments[0] == 1] != 0.0)


def test_fast_equals_reference_with_every_mask_and_score_option():
    """Window on one block, packed segments, soft-cap and scale together: the fast chain's loss
    and gradients against the reference chain's (float64, 1e-10 of each tensor's largest entry:
    two orders of the same float64 sums through two blocks)."""
    config = _config(sliding_window=3, layer_types=("full_attention", "sliding_attention"), attn_softcap=2.0,
                     attn_scale=0.3)
    tokens, targets, segments = _packed_case(seed=2)
    out = {}
    for kernels in ("reference", "fast"):
        model = GPT(config, dtype="float64", kernels=kernels, seed=4)
        out[kernels] = (model.loss(tokens, targets, segments=segments), _grads(model))
    assert abs(out["fast"][0] - out["reference"][0]) <= 1e-12 * abs(out["reference"][0])
    for k, v in out["reference"][1].items():
        assert np.max(np.abs(out["fast"][1][k] - v)) <= 1e-10 * max(np.max(np.abs(v)), 1e-300), k


def test_segments_are_refused_with_a_cache_or_when_bad():
    model = GPT(_config(), dtype="float64")
    tokens = np.zeros((2, 6), np.int64)
    with pytest.raises(ValueError, match="KV cache"):
        model.forward(tokens, kv_cache=KVCache(model, 2), segments=np.zeros((2, 6), np.int64))
    with pytest.raises(ValueError, match="nondecreasing"):
        model.forward(tokens, segments=np.array([[0, 0, 1, 1, 0, 0]] * 2))
    with pytest.raises(ValueError, match="shaped like the tokens"):
        model.forward(tokens, segments=np.zeros((2, 5), np.int64))


# ---------------------------------------------------------------------------------------------- window
@KERNELS
@pytest.mark.parametrize("layer_types", [None, ("sliding_attention", "full_attention")], ids=["all", "mixed"])
def test_greedy_generation_past_the_window_equals_full_recompute(kernels, layer_types):
    """Generating 14 tokens after a 5-token prompt with a window of 4 (the ring of each windowed
    block wraps several times): the KV-cache tokens equal those of recomputing the whole
    sequence with the window mask at every step (``use_cache=False``), and the cached logits the
    full forward's (float64, 1e-10)."""
    model = GPT(_config(sliding_window=4, layer_types=layer_types), dtype="float64", kernels=kernels, seed=5)
    prompt = np.random.default_rng(3).integers(0, 13, (2, 5))
    greedy = Sampling(temperature=0.0)
    cached = np.asarray(generate(model, prompt, 14, greedy))
    recomputed = np.asarray(generate(model, prompt, 14, greedy, use_cache=False))
    assert np.array_equal(cached, recomputed)
    cache, steps = KVCache(model, 2), []
    steps.append(np.asarray(model.forward(cached[:, :5], kv_cache=cache)))
    for t in range(5, cached.shape[1]):
        steps.append(np.asarray(model.forward(cached[:, t:t + 1], kv_cache=cache)))
    full = np.asarray(model.forward(cached))
    step_logits = np.concatenate(steps, axis=1)
    assert np.max(np.abs(step_logits - full)) <= 1e-10 * np.max(np.abs(full))


def test_window_cache_memory():
    """At context 4 × window, a cache whose every block slides holds a quarter of a full one's
    bytes; half of the blocks sliding: 5/8 (docs/guide.md)."""
    w = 6
    full = KVCache(GPT(_config(context_length=4 * w)), 1).nbytes
    every = KVCache(GPT(_config(context_length=4 * w, sliding_window=w)), 1).nbytes
    mixed = KVCache(GPT(_config(context_length=4 * w, sliding_window=w,
                                layer_types=("sliding_attention", "full_attention"))), 1).nbytes
    assert every * 4 == full and mixed * 8 == 5 * full


def test_config_fields_are_checked_and_serialised():
    c = _config(sliding_window=4, layer_types=["sliding_attention", "full_attention"], attn_softcap=50,
                attn_scale=0.25)
    assert c.window(0) == 4 and c.window(1) is None and c.layer_types == ("sliding_attention", "full_attention")
    assert _config(sliding_window=4).window(1) == 4 and _config().window(0) is None
    assert c.score_scale == 0.25 and _config().score_scale == 1 / np.sqrt(3)
    assert GPTConfig.from_dict(c.to_dict()) == c
    for over, match in ((dict(sliding_window=0), "sliding_window"),
                        (dict(sliding_window=4, causal=False), "causal"),
                        (dict(sliding_window=4, layer_types=("sliding_attention",)), "layer_types"),
                        (dict(layer_types=("sliding_attention", "full_attention")), "sliding_window"),
                        (dict(attn_softcap=0.0), "attn_softcap"), (dict(attn_scale=float("nan")), "attn_scale")):
        with pytest.raises(ValueError, match=match):
            _config(**over)


@KERNELS
def test_padded_prompts_and_generation_past_the_context_with_a_window(kernels):
    """Prompts of different lengths generated together (left padding in the ring's frame) give
    each row's tokens alone; generating past ``context_length`` (``drop_oldest``: a ring does not
    move) keeps going with the same tokens as a cache that never dropped, up to the context."""
    model = GPT(_config(sliding_window=3, layer_types=("sliding_attention", "full_attention"), context_length=12),
                dtype="float64", kernels=kernels, seed=6)
    greedy = Sampling(temperature=0.0)
    prompts = [np.array([1, 2, 3, 4, 5, 6]), np.array([7, 8])]
    together = generate(model, prompts, 5, greedy)
    for row, prompt in zip(together, prompts):
        alone = np.asarray(generate(model, prompt[None], 5, greedy))[0]
        assert np.array_equal(np.asarray(row)[-len(alone):], alone)
    long = np.asarray(generate(model, prompts[0][None], 20, greedy))
    assert long.shape == (1, 26)
    short = np.asarray(generate(model, prompts[0][None], 6, greedy))
    assert np.array_equal(long[:, :12], short)


def test_segments_with_recompute_and_on_torch_tensors():
    """The packed window's gradients are the same bits with the blocks recomputed in the backward,
    and the same numbers on the torch backend (its tensors, a CPU model: the fast kernels on NumPy
    views; float64, 1e-12)."""
    import torch

    config = _config(sliding_window=4)
    tokens, targets, segments = _packed_case(seed=3)
    model = GPT(config, dtype="float64", seed=7)
    loss = model.loss(tokens, targets, segments=segments)
    grads = _grads(model)
    model.recompute = True
    assert model.loss(tokens, targets, segments=segments) == loss
    for k, v in _grads(model).items():
        assert np.array_equal(v, grads[k]), k
    on_torch = GPT(config, dtype="float64", seed=7, backend="torch")
    t_loss = on_torch.loss(torch.from_numpy(tokens), torch.from_numpy(targets), segments=torch.from_numpy(segments))
    assert abs(t_loss - loss) <= 1e-12 * abs(loss)
    for k, v in on_torch.backward().items():
        assert np.max(np.abs(v.numpy() - grads[k])) <= 1e-12 * max(np.max(np.abs(grads[k])), 1e-300), k

"""KV cache and generation loop: cached logits == full forward logits at every step.

The reference for every comparison is ``GPT.forward`` over the window the model conditions on
(itself tested against the PyTorch autograd oracle in the model tests). Error measure:
``max |cached - full| / max |full|`` over the whole ``(B, V)`` logits of a step.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from pedestrian.generation.sampling import Sampling
from pedestrian.config import GPTConfig
from pedestrian.generation.generate import KVCache, generate, model_step
from pedestrian.model import GPT

TOL = {"float64": 1e-10, "float32": 1e-5}
C = 16


def small_config(**overrides) -> GPTConfig:
    base = dict(vocab_size=29, context_length=C, d_model=24, n_heads=3, n_blocks=2)
    base.update(overrides)
    return GPTConfig(**base)


def make_model(dtype="float64", backend="numpy", seed=0, **overrides) -> GPT:
    model = GPT(small_config(**overrides), seed=seed, dtype=dtype, backend=backend)
    # non-trivial biases / layer-norm parameters so every term of the forward matters
    rng = np.random.default_rng(seed + 100)
    for name, p in model.params.items():
        if p.ndim == 1:
            mean = 1.0 if "ln" in name and name.endswith("weight") else 0.0
            value = rng.normal(mean, 0.1, size=p.shape)
            p[...] = model.to_xp(value)
    return model


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def full_logits(model, window: np.ndarray) -> np.ndarray:
    """Last-position logits of a full forward pass over ``window`` ``(B, L)``."""
    from pedestrian.backend import to_numpy

    was = model.training
    model.training = False
    try:
        return np.asarray(to_numpy(model.forward(window)[:, -1, :]), dtype=np.float64)
    finally:
        model.training = was


def window_starts_shift1(T0: int, n_steps: int, context_length: int) -> list[int]:
    """Independent statement of the default rule: predict from the last context_length tokens."""
    return [max(0, T0 + j - context_length) for j in range(n_steps)]


def window_starts(T0: int, n_steps: int, context_length: int, shift: int) -> list[int]:
    """The documented sliding rule: when the window would hold C + 1 tokens, drop ``shift``."""
    start, starts = max(0, T0 - context_length), []
    for j in range(n_steps):
        m = T0 + j                                     # index of the token being predicted
        if m - start > context_length:
            start += shift
        starts.append(start)
    return starts


def check_every_step(model, prompt, n_new, tol, shift=1, **kw):
    tokens, logits = generate(model, prompt, n_new, return_logits=True, window_shift=shift, **kw)
    T0 = prompt.shape[1]
    assert tokens.shape == (prompt.shape[0], T0 + n_new)
    assert logits.shape == (n_new, prompt.shape[0], model.config.vocab_size)
    starts = (window_starts_shift1(T0, n_new, C) if shift == 1
              else window_starts(T0, n_new, C, shift))
    worst = 0.0
    for j, start in enumerate(starts):
        expected = full_logits(model, tokens[:, start:T0 + j])
        worst = max(worst, rel_err(logits[j], expected))
    assert worst <= tol, f"cached vs full forward: relative error {worst:.3g} > {tol}"
    return tokens, starts


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("prompt_len", [1, 7, C - 1])
def test_cached_logits_equal_full_forward_every_step(dtype, batch, prompt_len):
    model = make_model(dtype)
    prompt = np.random.default_rng(prompt_len).integers(0, 29, size=(batch, prompt_len))
    n_new = C + 4 - prompt_len + 3                     # always crosses the context: several slides
    _, starts = check_every_step(model, prompt, n_new, TOL[dtype], temperature=1.0, seed=1)
    assert starts[-1] > 0                              # the window did slide


@pytest.mark.parametrize("shift", [3, C])
def test_cached_logits_equal_full_forward_across_larger_slides(shift):
    model = make_model("float64")
    prompt = np.random.default_rng(5).integers(0, 29, size=(2, 5))
    tokens, starts = check_every_step(model, prompt, 2 * C + 3, TOL["float64"], shift=shift,
                                      temperature=1.0, seed=2)
    assert len(set(starts)) > 2
    # the uncached path applies the same window rule, so it draws the same tokens
    ref = generate(model, prompt, 2 * C + 3, Sampling(temperature=1.0, seed=2), use_cache=False, window_shift=shift)
    np.testing.assert_array_equal(tokens, ref)


@pytest.mark.parametrize("overrides", [
    dict(tie_weights=False),
    dict(bias=False, activation="relu"),
    dict(activation="gelu", d_qk=5, d_head=7, ln_eps=0.0),
    dict(mlp_ratio=2, n_heads=1),
])
def test_cached_logits_other_architectures(overrides):
    model = make_model("float64", **overrides)
    prompt = np.random.default_rng(0).integers(0, 29, size=(2, 6))
    check_every_step(model, prompt, C, TOL["float64"], temperature=1.0, seed=3)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_cached_logits_with_unmerged_lora(dtype):
    model = make_model(dtype, tie_weights=False)
    model.add_lora("all", rank=3, alpha=1.5, seed=4)
    rng = np.random.default_rng(9)
    for name in model.params:
        if name.endswith("lora_U"):                    # U = 0 at init: make the adapters matter
            model.params[name][...] = model.to_xp(rng.normal(0, 0.3, size=model.params[name].shape))
    prompt = rng.integers(0, 29, size=(3, 4))
    check_every_step(model, prompt, C, TOL[dtype], temperature=1.0, seed=5)
    # ... and the adapters change the logits (the cached path does not silently skip them)
    with_lora = generate(model, prompt, 1, Sampling(temperature=0), return_logits=True)[1]
    model.remove_lora()
    without = generate(model, prompt, 1, Sampling(temperature=0), return_logits=True)[1]
    assert rel_err(with_lora, without) > 1e-3


def test_cached_logits_tied_lora_on_logits():
    model = make_model("float64")
    model.add_lora(["logits", "q", "mlp_contract"], rank=2, alpha=2.0, seed=1)
    for name in model.params:
        if name.endswith("lora_U"):
            model.params[name][...] = np.random.default_rng(1).normal(0, 0.3, model.params[name].shape)
    prompt = np.random.default_rng(0).integers(0, 29, size=(1, 3))
    check_every_step(model, prompt, C, TOL["float64"], temperature=1.0, seed=6)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_torch_backend_cached_logits(dtype):
    pytest.importorskip("torch")
    model = make_model(dtype, backend="torch")
    prompt = np.random.default_rng(0).integers(0, 29, size=(2, 7))
    tokens, _ = check_every_step(model, prompt, C, TOL[dtype], temperature=1.0, seed=7)
    # same tokens as the numpy model with the same weights (float64: logits agree to 1e-15)
    if dtype == "float64":
        np_model = make_model(dtype)
        np.testing.assert_array_equal(tokens, generate(np_model, prompt, C, Sampling(temperature=1.0, seed=7)))


def test_model_step_prefill_all_logits_and_decode():
    model = make_model("float64")
    tokens = np.random.default_rng(0).integers(0, 29, size=(2, 10))
    full = model.forward(tokens)
    cache = KVCache(model, 2)
    out = model_step(model, cache, tokens[:, :6], all_logits=True)
    assert out.shape == (2, 6, 29) and cache.length == 6
    assert rel_err(out, full[:, :6]) <= 1e-10
    for t in range(6, 10):                            # one token at a time: positions 6, 7, 8, 9
        logits = model_step(model, cache, tokens[:, t:t + 1])
        assert logits.shape == (2, 29) and cache.length == t + 1
        assert rel_err(logits, full[:, t]) <= 1e-10


def test_keep_activations_false_gives_the_same_logits_and_keeps_nothing():
    """``forward(..., keep_activations=False)`` (what generate() passes) computes the same
    logits bit for bit -- same kernels, same order -- and afterwards every inspection and the
    backward say why they have nothing, instead of showing an older step's arrays."""
    model = make_model("float64")
    tokens = np.random.default_rng(1).integers(0, 29, size=(2, 9))
    kept, lean = KVCache(model, 2), KVCache(model, 2)
    for lo, hi in ((0, 5), (5, 6), (6, 9)):           # a prefill, then one token, then three
        expected = np.array(model.forward(tokens[:, lo:hi], kv_cache=kept))
        got = model.forward(tokens[:, lo:hi], kv_cache=lean, keep_activations=False)
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(lean.keys[0], kept.keys[0])
        for inspect in (model.activations, model.attention_weights,
                        lambda: model.backward(delta_logits=np.ones_like(got))):
            with pytest.raises(ValueError, match="keep_activations=False"):
                inspect()
    model.forward(tokens)                             # a plain forward keeps them again
    assert model.activations()["a12"].shape == (2, 9, 29)


def test_cache_is_preallocated_and_never_overflows():
    model = make_model("float64")
    cache = KVCache(model, 3)
    assert len(cache.keys) == 2
    assert cache.keys[0].shape == (3, 3, C, 8) and cache.values[0].shape == (3, 3, C, 8)
    arrays = [id(a) for a in cache.keys + cache.values]
    ids = np.zeros((3, 1), dtype=np.int64)
    for _ in range(C):
        model_step(model, cache, ids)
    assert cache.length == C
    assert [id(a) for a in cache.keys + cache.values] == arrays     # written in place, not regrown
    with pytest.raises(ValueError, match="context_length"):
        model_step(model, cache, ids)                 # position C does not exist: refused
    assert cache.length == C
    cache.reset()
    assert cache.length == 0
    model_step(model, cache, ids)
    assert cache.length == 1


def test_model_step_bad_input():
    model = make_model("float64")
    cache = KVCache(model, 2)
    with pytest.raises(ValueError, match="batch size"):
        model_step(model, cache, np.zeros((3, 1), dtype=np.int64))
    with pytest.raises(ValueError, match="vocab_size"):
        model_step(model, cache, np.full((2, 1), 29))
    with pytest.raises(TypeError, match="integers"):
        model_step(model, cache, np.zeros((2, 1)))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        model_step(model, cache, np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match="different model"):
        model_step(make_model("float64"), cache, np.zeros((2, 1), dtype=np.int64))
    with pytest.raises(ValueError, match="batch_size"):
        KVCache(model, 0)


def test_uncached_generation_gives_the_same_tokens():
    model = make_model("float64")
    prompt = np.random.default_rng(3).integers(0, 29, size=(4, 5))
    for kw in (dict(temperature=0), dict(temperature=0.9, top_k=7, top_p=0.9, seed=11)):
        cached = generate(model, prompt, 2 * C, **kw)
        uncached = generate(model, prompt, 2 * C, use_cache=False, **kw)
        np.testing.assert_array_equal(cached, uncached)


def test_prompt_is_kept_and_shapes():
    model = make_model("float64")
    prompt = np.random.default_rng(0).integers(0, 29, size=(2, 4))
    out = generate(model, prompt, 5, Sampling(temperature=0))
    assert out.shape == (2, 9) and out.dtype == np.int64
    np.testing.assert_array_equal(out[:, :4], prompt)
    np.testing.assert_array_equal(generate(model, prompt, 0), prompt)
    one_d = generate(model, list(prompt[0]), 5, Sampling(temperature=0))   # a 1-D prompt gives a 1-D result
    np.testing.assert_array_equal(one_d, out[0])


def test_on_token_streams_each_step():
    model = make_model("float64")
    prompt = np.zeros((3, 2), dtype=np.int64)
    seen = []
    out = generate(model, prompt, 6, Sampling(temperature=1.0, seed=0), on_token=lambda ids: seen.append(ids.copy()))
    assert len(seen) == 6
    np.testing.assert_array_equal(np.stack(seen, axis=1), out[:, 2:])


def test_stop_tokens_end_rows_and_pad():
    model = make_model("float64")
    prompt = np.random.default_rng(1).integers(0, 29, size=(3, 3))
    free = generate(model, prompt, 12, Sampling(temperature=1.0, seed=4))
    new = free[:, 3:]
    stop = int(new[0, 2])                             # a token row 0 emits at step 2
    out = generate(model, prompt, 12, Sampling(temperature=1.0, seed=4, stop_ids=[stop]))
    for b in range(3):
        hits = np.flatnonzero(new[b] == stop)
        if hits.size:                                  # identical until the stop, then padded with it
            k = hits[0]
            np.testing.assert_array_equal(out[b, 3:3 + k + 1], new[b, :k + 1])
            assert np.all(out[b, 3 + k:] == stop)
        else:
            np.testing.assert_array_equal(out[b, 3:], new[b, :out.shape[1] - 3])
    # when every row stops, generation ends early
    free1 = generate(model, prompt[:1], 12, Sampling(temperature=1.0, seed=4))[0, 3:]
    stop1 = int(free1[4])
    k = int(np.flatnonzero(free1 == stop1)[0])
    single = generate(model, prompt[:1], 12, Sampling(temperature=1.0, seed=4, stop_ids=stop1))
    assert single.shape == (1, 3 + k + 1) and single[0, -1] == stop1
    np.testing.assert_array_equal(single[0, 3:], free1[:k + 1])
    with pytest.raises(ValueError, match="stop_tokens"):
        generate(model, prompt, 2, Sampling(stop_ids=[29]))


def test_seeded_generation_is_reproducible():
    model = make_model("float32")
    prompt = np.zeros((2, 1), dtype=np.int64)
    a = generate(model, prompt, 25, Sampling(temperature=1.2, top_k=10, seed=123))
    b = generate(model, prompt, 25, Sampling(temperature=1.2, top_k=10, seed=123))
    c = generate(model, prompt, 25, Sampling(temperature=1.2, top_k=10, seed=124))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_dropout_is_off_and_training_flag_restored():
    model = make_model("float64", dropout=0.5)
    model.training = True
    prompt = np.zeros((1, 3), dtype=np.int64)
    a = generate(model, prompt, 10, Sampling(temperature=0))
    b = generate(model, prompt, 10, Sampling(temperature=0), use_cache=False)
    np.testing.assert_array_equal(a, b)
    assert model.training is True


def test_prompt_longer_than_context_keeps_last_tokens_with_warning():
    model = make_model("float64")
    prompt = np.random.default_rng(0).integers(0, 29, size=(2, C + 5))
    with pytest.warns(UserWarning, match="context_length"):
        out, logits = generate(model, prompt, 3, Sampling(temperature=0), return_logits=True)
    np.testing.assert_array_equal(out[:, :C + 5], prompt)           # the whole prompt is returned
    assert rel_err(logits[0], full_logits(model, prompt[:, -C:])) <= 1e-10


def test_bad_generation_input():
    model = make_model("float64")
    good = np.zeros((1, 2), dtype=np.int64)
    with pytest.raises(ValueError, match="empty"):
        generate(model, np.zeros((1, 0), dtype=np.int64), 3)
    with pytest.raises(ValueError, match="empty"):
        generate(model, [], 3)
    with pytest.raises(TypeError, match="integers"):
        generate(model, np.zeros((1, 2)), 3)
    with pytest.raises(ValueError, match="vocab_size"):
        generate(model, np.array([[0, 29]]), 3)
    with pytest.raises(ValueError, match="vocab_size"):
        generate(model, np.array([[-1, 2]]), 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, good, -1)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, good, 3, Sampling(temperature=-0.5))
    with pytest.raises(ValueError, match="top_p"):
        generate(model, good, 3, Sampling(top_p=0.0))
    with pytest.raises(ValueError, match="top_k"):
        generate(model, good, 3, Sampling(top_k=0))
    with pytest.raises(ValueError, match="window_shift"):
        generate(model, good, 3, window_shift=0)
    with pytest.raises(ValueError, match="window_shift"):
        generate(model, good, 3, window_shift=C + 1)


def test_non_causal_model_has_no_cache():
    model = make_model("float64", causal=False)
    with pytest.raises(ValueError, match="causal"):
        KVCache(model, 1)
    with pytest.raises(ValueError, match="use_cache=False"):
        generate(model, np.zeros((1, 2), dtype=np.int64), 3)
    out = generate(model, np.zeros((1, 2), dtype=np.int64), 3, Sampling(temperature=0), use_cache=False)
    assert out.shape == (1, 5)


def test_no_warning_for_normal_prompts():
    model = make_model("float64")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate(model, np.zeros((1, C), dtype=np.int64), 2, Sampling(temperature=0))

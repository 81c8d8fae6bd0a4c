"""KV cache and generation past the context length, for each position encoding (issue 14).

Rules under test (``pedestrian.generation.generate`` module docstring):

- ``"rebuild"`` (learned positions; any encoding without a cache): each token is predicted from a
  full forward over its window -- the reference is ``GPT.forward`` over that window.
- ``"keep-cache"`` (default for RoPE and ``none``): the oldest cached entries are dropped, the
  others kept, positions keep counting. The reference is one full forward of the independent
  PyTorch model (``tests/torch_reference.py``) over the *whole* sequence, in which query ``q``
  attends to keys ``key_start[q] … q`` (its window) and RoPE uses positions ``0 … N-1``.

Error measure: ``max |cached − reference| / max |reference|`` over a step's ``(B, V)`` logits.
float64 throughout; bound 1e-10 (the two computations differ only in summation order and, for
RoPE, in the rounding of angles up to ~40 radians: far below 1e-12).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from pedestrian.generation.sampling import Sampling
from pedestrian.generation.generate import KVCache, generate, model_step
from pedestrian.kernels import kernels_for
from pedestrian.layers.rope import rope_forward
from torch_reference import default_cfg, random_params, reference_forward

C = 8
TOL = 1e-10


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def make(build_model, encoding: str, kernels: str = "fast", **overrides):
    cfg = default_cfg(position_encoding=encoding, context_length=C, **overrides)
    params = random_params(cfg, seed=11)
    model = build_model(cfg, params, dtype="float64")
    model.kernels = kernels_for(kernels)
    model.training = False
    return cfg, params, model


def key_starts(T0: int, n_new: int, shift: int) -> list[int]:
    """Window start of every query of the sequence, by the documented rule: the prompt's queries
    share the first window; query q >= T0 slides it when the window would hold C + 1 tokens.
    Prompt tokens before the first window are never fed; no later query sees them, and their own
    (unused) rows get start 0 so that none is empty."""
    start = max(0, T0 - C)
    starts = [0] * start + [start] * (T0 - start)
    for q in range(T0, T0 + n_new - 1):
        if q + 1 - start > C:
            start += shift
        starts.append(start)
    return starts


def whole_sequence_logits(cfg, params, tokens, starts) -> np.ndarray:
    with torch.no_grad():
        logits = reference_forward({k: torch.tensor(v) for k, v in params.items()}, cfg, tokens,
                                   key_start=starts)
    return logits.numpy()


@pytest.mark.parametrize("kernels", ["fast", "reference"])
@pytest.mark.parametrize("shift", [1, 3])
@pytest.mark.parametrize("T0", [1, 5, C + 3])
@pytest.mark.parametrize("encoding", ["rope", "none"])
def test_keep_cache_equals_a_sliding_window_forward_of_the_whole_sequence(encoding, T0, shift, kernels,
                                                                          build_model):
    cfg, params, model = make(build_model, encoding, kernels)
    prompt = np.random.default_rng(T0).integers(0, cfg["vocab_size"], size=(2, T0))
    n_new = 3 * C
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                           # a prompt longer than the context
        tokens, logits = generate(model, prompt, n_new, Sampling(temperature=1.0, seed=T0), window_shift=shift, return_logits=True)
    starts = key_starts(T0, n_new, shift)
    assert starts[-1] > 0                                          # the window did slide
    ref = whole_sequence_logits(cfg, params, tokens[:, :T0 + n_new - 1], starts)
    worst = max(rel_err(logits[j], ref[:, T0 - 1 + j]) for j in range(n_new))
    assert worst <= TOL, f"keep-cache vs whole-sequence window forward: {worst:.3g}"


@pytest.mark.parametrize("kernels", ["fast", "reference"])
@pytest.mark.parametrize("shift", [1, 3])
@pytest.mark.parametrize("encoding", ["learned", "rope", "none"])
def test_rebuild_equals_a_forward_over_the_window(encoding, shift, kernels, build_model):
    cfg, params, model = make(build_model, encoding, kernels)
    T0, n_new = 5, 3 * C
    prompt = np.random.default_rng(1).integers(0, cfg["vocab_size"], size=(2, T0))
    tokens, logits = generate(model, prompt, n_new, Sampling(temperature=1.0, seed=2), window_shift=shift, past_context="rebuild", return_logits=True)
    starts = key_starts(T0, n_new, shift)
    worst = 0.0
    for j in range(n_new):
        q = T0 - 1 + j
        window = tokens[:, starts[q]:q + 1]
        worst = max(worst, rel_err(logits[j], np.asarray(model.forward(window))[:, -1]))
    assert worst <= TOL
    uncached = generate(model, prompt, n_new, Sampling(temperature=1.0, seed=2), window_shift=shift, use_cache=False)
    np.testing.assert_array_equal(uncached, tokens)               # the same rule without a cache


@pytest.mark.parametrize("encoding", ["rope", "none"])
def test_keep_cache_sees_further_back_than_the_window_only_after_the_first_block(encoding, build_model):
    """With one block a kept key depends on its token (and, for RoPE, on the query-key offset)
    only, so keeping the cache gives the rebuild's logits; with two blocks the kept keys of the
    second block carry dropped tokens' information, and the two rules part."""
    for n_blocks, same in ((1, True), (2, False)):
        cfg, _, model = make(build_model, encoding, n_blocks=n_blocks)
        prompt = np.random.default_rng(3).integers(0, cfg["vocab_size"], size=(1, 4))
        kept = generate(model, prompt, 2 * C, Sampling(temperature=0.0), return_logits=True)[1]
        rebuilt = generate(model, prompt, 2 * C, Sampling(temperature=0.0), past_context="rebuild", return_logits=True)[1]
        inside = C - 4                                             # steps before the first slide
        assert rel_err(kept[:inside], rebuilt[:inside]) <= TOL
        err = rel_err(kept, rebuilt)
        assert (err <= TOL) if same else (err > 1e-6), (n_blocks, err)


def test_rope_keys_are_cached_rotated_and_positions_are_relative(build_model):
    """Feeding a sequence at positions s, s+1, … (``first_position=s``) gives the logits of
    positions 0, 1, …: RoPE depends on offsets only (angles up to ~10³ rad: bound 1e-10)."""
    cfg, params, model = make(build_model, "rope")
    tokens = np.random.default_rng(4).integers(0, cfg["vocab_size"], size=(2, C))
    plain = np.asarray(model.forward(tokens))
    for s in (1, 7, 1000):
        cache = KVCache(model, 2)
        cache.reset(first_position=s)
        shifted = np.asarray(model.forward(tokens, kv_cache=cache))
        assert rel_err(shifted, plain) <= TOL
        # block 0's cache holds its keys rotated by their own positions s … s + C - 1
        a2 = np.asarray(model.activations()["blocks.0.a2"])
        H, d_qk = cfg["n_heads"], 4
        raw_k = a2 @ params["blocks.0.attn.k.weight"] + params["blocks.0.attn.k.bias"]      # (2, C, H·d_qk)
        qkv = np.concatenate([np.zeros_like(raw_k), raw_k], axis=-1)
        turned, _ = rope_forward(qkv, H, d_qk, np.arange(s, s + C), base=cfg["rope_base"])
        expected = turned[..., H * d_qk:].reshape(2, C, H, d_qk).transpose(0, 2, 1, 3)
        assert rel_err(cache.keys[0][:, :, :C], expected) <= 1e-12
        assert cache.offset == s and cache.length == C
    learned = make(build_model, "learned")[2]
    cache = KVCache(learned, 2)
    cache.reset(first_position=1)
    with pytest.raises(ValueError, match="do not exist in the learned table"):
        learned.forward(tokens, kv_cache=cache)                    # position 8 does not exist


@pytest.mark.parametrize("encoding", ["rope", "none"])
def test_drop_oldest_keeps_the_rest_and_padding(encoding, build_model):
    """A left-padded batch: rows keep computing what they compute alone after a drop."""
    cfg, params, model = make(build_model, encoding)
    rng = np.random.default_rng(5)
    short = rng.integers(0, cfg["vocab_size"], size=C - 3)
    long = rng.integers(0, cfg["vocab_size"], size=C)
    batch = np.stack([np.concatenate([np.zeros(3, dtype=np.int64), short]), long])
    cache = KVCache(model, 2, key_start=[3, 0])
    model_step(model, cache, batch)
    cache.drop_oldest(2)                                          # row 0 keeps one padding slot
    assert cache.length == C - 2 and cache.offset == 2
    nxt = rng.integers(0, cfg["vocab_size"], size=(2, 2))
    step = np.asarray(model_step(model, cache, nxt, all_logits=True))
    for row, (seq, pad) in enumerate(((short, 3), (long, 0))):
        whole = np.concatenate([seq, nxt[row]])                   # alone, unpadded
        starts = [0] * len(seq) + [max(0, 2 - pad)] * 2           # slots 0, 1 dropped
        ref = whole_sequence_logits(cfg, params, whole[None], starts)
        assert rel_err(step[row], ref[0, -2:]) <= TOL, row


def test_errors_name_the_rule(build_model):
    _, _, learned = make(build_model, "learned")
    _, _, rope = make(build_model, "rope")
    prompt = np.zeros((1, 2), dtype=np.int64)
    with pytest.raises(ValueError, match="learned positions are absolute"):
        generate(learned, prompt, 3, past_context="keep-cache")
    with pytest.raises(ValueError, match="needs use_cache=True"):
        generate(rope, prompt, 3, past_context="keep-cache", use_cache=False)
    with pytest.raises(ValueError, match="past_context must be one of"):
        generate(rope, prompt, 3, past_context="slide")
    cache = KVCache(learned, 1)
    model_step(learned, cache, prompt)
    with pytest.raises(ValueError, match="cannot drop cached tokens"):
        cache.drop_oldest(1)
    cache = KVCache(rope, 1)
    model_step(rope, cache, np.zeros((1, C), dtype=np.int64))
    with pytest.raises(ValueError, match="drop_oldest"):
        model_step(rope, cache, prompt)
    with pytest.raises(ValueError, match="can drop 0 to length"):
        cache.drop_oldest(C + 1)
    with pytest.raises(ValueError, match="first_position must be"):
        cache.reset(first_position=-1)

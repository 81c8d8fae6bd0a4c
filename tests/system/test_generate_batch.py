"""A batch of prompts of different lengths in one generate() call (issue: HF users' controls):
each row gets the tokens and logits it gets alone, through the context boundary."""

from __future__ import annotations

import numpy as np
import pytest

from pedestrian.generation.sampling import Sampling
from pedestrian import GPT, GPTConfig
from pedestrian.generation.generate import generate
from pedestrian.model.kv_cache import KVCache

CFG = GPTConfig(vocab_size=23, context_length=16, d_model=16, n_heads=2, n_blocks=2)


def _prompts(lengths=(1, 5, 12), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, size=L) for L in lengths]


@pytest.mark.parametrize("kernels", ["fast", "reference"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_each_row_equals_its_prompt_alone_through_the_context_boundary(kernels, use_cache):
    model = GPT(CFG, seed=1, dtype="float64", kernels=kernels)
    prompts = _prompts()
    n_new = 14                                     # 12 + 14 > context 16: every row slides at the end
    out, logits = generate(model, prompts, n_new, Sampling(temperature=0.0), return_logits=True, use_cache=use_cache)
    assert isinstance(out, list) and len(out) == 3
    for b, prompt in enumerate(prompts):
        alone, alone_logits = generate(model, prompt, n_new, Sampling(temperature=0.0), return_logits=True)
        np.testing.assert_array_equal(out[b], alone)
        assert out[b][:len(prompt)].tolist() == prompt.tolist()
        # the rows differ from the row alone only in the order of float64 sums over keys (the
        # padded keys add exact zeros): a few ulps of the logits' scale, 1e-10 is far above it
        scale = float(np.max(np.abs(alone_logits)))
        assert float(np.max(np.abs(logits[:, b] - alone_logits[:, 0]))) <= 1e-10 * scale


def test_padding_is_never_attended_and_positions_start_at_each_row():
    model = GPT(CFG, seed=2, dtype="float64")
    cache = KVCache(model, 2, key_start=[3, 0])
    tokens = np.array([[0, 0, 0, 7, 8], [1, 2, 3, 7, 8]])
    logits = model.forward(tokens, kv_cache=cache)
    P = model.attention_weights()[0]               # (B, H, T, L)
    assert np.all(P[0, :, 3:, :3] == 0)            # real queries give padding exactly 0 weight
    np.testing.assert_array_equal(np.asarray(cache.positions(1)), [[2], [5]])
    alone = GPT(CFG, seed=2, dtype="float64").forward(tokens[:1, 3:])
    # float64; only the summation order differs (the padded keys add exact zeros): ~1e-15 seen
    np.testing.assert_allclose(logits[0, 3:], alone[0], rtol=1e-12, atol=1e-13)


def test_repetition_penalty_sees_only_the_real_prompt_tokens():
    model = GPT(CFG, seed=3, dtype="float64")
    prompts = _prompts((2, 6), seed=4)
    out = generate(model, prompts, 6, Sampling(temperature=0.0, repetition_penalty=1.5))
    for b, prompt in enumerate(prompts):
        np.testing.assert_array_equal(out[b], generate(model, prompt, 6, Sampling(temperature=0.0, repetition_penalty=1.5)))


def test_prompts_of_one_length_keep_the_array_interface():
    model = GPT(CFG, seed=0)
    out = generate(model, [[1, 2, 3], [4, 5, 6]], 3, Sampling(temperature=0.0))
    assert isinstance(out, np.ndarray) and out.shape == (2, 6)
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[1, 2], []], 3)
    with pytest.raises(ValueError, match="outside"):
        generate(model, [[1, 2], [99]], 3)

"""generate() with the sampling controls: the repetition penalty sees the prompt and every
generated token of its row, vocab_limit keeps undecodable ids out, on_token can end rows (the
hook stop strings use), and NaN logits stop generation with a clear error.

The reference for the loop is a replay: the logits generate() drew each token from
(``return_logits``) fed to :func:`pedestrian.generation.sampling.sample_next` with the seen tokens given
explicitly must give the same tokens, draw for draw.
"""

from __future__ import annotations

import numpy as np
import pytest

from pedestrian.generation.sampling import Sampling
from pedestrian.config import GPTConfig
from pedestrian.generation.generate import generate
from pedestrian.model import GPT
from pedestrian.generation.sampling import NonFiniteLogitsError, sample_next

C = 12


def make_model(V=23, seed=0, dtype="float64", **overrides) -> GPT:
    return GPT(GPTConfig(vocab_size=V, context_length=C, d_model=16, n_heads=2, n_blocks=1,
                         **overrides), seed=seed, dtype=dtype)


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0, repetition_penalty=1.7),
    dict(temperature=0.8, repetition_penalty=0.6, top_k=8, min_p=0.05),
    dict(temperature=1.2, repetition_penalty=1.3, top_p=0.9, vocab_limit=17),
    dict(temperature=0, repetition_penalty=2.5),
])
@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_replays_with_seen_tokens(kw, use_cache):
    model = make_model()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 23, size=(3, 15))                   # longer than the context (12)
    n_new = 25                                                   # and slides past it
    with pytest.warns(UserWarning, match="only the"):
        tokens, logits = generate(model, prompt, n_new, seed=5, use_cache=use_cache,
                                  return_logits=True, **kw)
    replay_rng = np.random.default_rng(5)
    for step in range(n_new):
        seen = tokens[:, :15 + step]                             # the whole prompt, all generated
        expected = sample_next(logits[step], replay_rng, seen=seen, **kw)
        np.testing.assert_array_equal(tokens[:, 15 + step], expected, err_msg=f"step {step}")
    # the penalty is felt: without it (same seed) the tokens differ
    plain = dict(kw, repetition_penalty=None)
    with pytest.warns(UserWarning):
        assert not np.array_equal(generate(model, prompt, n_new, seed=5, **plain), tokens)


def test_penalty_counts_tokens_that_slid_out_of_the_window():
    # token 0 is the greedy choice, but it is in the prompt -- only in the part beyond the
    # context -- so a strong penalty must still push it below token 2
    model = make_model(V=5, tie_weights=False)
    model.params["logits.bias"][[0, 2]] = [50.0, 20.0]
    prompt = np.array([[0] + [1] * 13])                          # 14 > C = 12: token 0 slid out
    with pytest.warns(UserWarning):
        assert generate(model, prompt, 1, Sampling(temperature=0))[0, -1] == 0
    with pytest.warns(UserWarning):
        assert generate(model, prompt, 1, Sampling(temperature=0, repetition_penalty=1e3))[0, -1] == 2


def test_vocab_limit_never_generates_padded_ids():
    # a model with 128 ids and a "tokenizer" of 40; the padded ids are made the most likely
    model = make_model(V=128, seed=1, tie_weights=False)
    model.params["logits.bias"][40:] += 6.0
    prompt = np.random.default_rng(2).integers(0, 40, size=(64, 4))
    free = generate(model, prompt, 60, Sampling(seed=3))
    assert (free[:, 4:] >= 40).mean() > 0.5                      # without the limit: mostly padding
    for kw in (dict(), dict(temperature=0), dict(top_k=3), dict(top_p=0.5, min_p=0.1),
               dict(repetition_penalty=1.5)):
        tokens = generate(model, prompt, 60, seed=3, vocab_limit=40, **kw)
        assert tokens[:, 4:].max() < 40, kw
    with pytest.raises(ValueError, match="vocab_limit=129 is larger than the model's vocab_size=128"):
        generate(model, prompt, 1, vocab_limit=129)
    with pytest.raises(ValueError, match="vocab_limit must be >= 1"):
        generate(model, prompt, 1, vocab_limit=0)


def test_on_token_can_finish_rows():
    model = make_model()
    prompt = np.random.default_rng(4).integers(0, 23, size=(3, 3))
    free = generate(model, prompt, 10, Sampling(seed=6))
    calls = []

    def on_token(ids):
        calls.append(ids.copy())
        step = len(calls)
        return np.array([step >= 2, False, step >= 4])           # rows 0 and 2 end early

    tokens = generate(model, prompt, 10, Sampling(seed=6), on_token=on_token)
    assert tokens.shape == (3, 13)
    np.testing.assert_array_equal(tokens[1], free[1])            # an unfinished row is untouched
    np.testing.assert_array_equal(tokens[0, :5], free[0, :5])
    assert (tokens[0, 5:] == free[0, 4]).all()                   # padded with its finishing token
    np.testing.assert_array_equal(tokens[2, :7], free[2, :7])
    assert (tokens[2, 7:] == free[2, 6]).all()
    # every row finished: generation ends at once
    tokens = generate(model, prompt, 10, Sampling(seed=6), on_token=lambda ids: np.ones(3, dtype=bool))
    assert tokens.shape == (3, 4)
    assert generate(model, prompt, 10, Sampling(seed=6), on_token=lambda ids: None).shape == (3, 13)
    with pytest.raises(ValueError, match=r"on_token must return None or a \(B,\) = \(3,\) bool array"):
        generate(model, prompt, 5, on_token=lambda ids: [True, False])


@pytest.mark.parametrize("use_cache", [True, False])
def test_nan_weights_stop_generation_with_an_error(use_cache):
    model = make_model()
    model.params["blocks.0.mlp_expand.weight"][3, 5] = np.nan
    with pytest.raises(NonFiniteLogitsError, match=r"row 0: 23 of 23.*row 1: 23 of 23.*non-finite weights"):
        generate(model, np.zeros((2, 3), dtype=np.int64), 5, Sampling(temperature=0), use_cache=use_cache)

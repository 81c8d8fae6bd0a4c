"""pedestrian.generation.prompts, the sampling front end as a library: text in, text out.

- each row of a batch of prompts of different lengths continues as that prompt alone would
  (greedy), in the order prompt by prompt, sample by sample;
- a stop string cuts the text right before it, and ``on_text`` streams exactly the text returned;
- one check of the settings names them as its caller does (keywords, or the command line's flags).
"""

from __future__ import annotations

import numpy as np
import pytest

from pedestrian.generation.sampling import Sampling
from pedestrian.config import GPTConfig
from pedestrian.generation.generate import generate
from pedestrian.generation.prompts import check_completion, complete, encode_prompt
from pedestrian.generation.sampling import check_sampling
from pedestrian.model import GPT
from pedestrian.text.tokenizer import CharTokenizer

TEXT = "hello world, the quick brown fox jumps over the lazy dog.\n" * 4


@pytest.fixture(scope="module")
def setup():
    tok = CharTokenizer.from_text(TEXT)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=16, d_model=16, n_heads=2, n_blocks=1),
                seed=3, dtype="float64")
    return model, tok


def test_rows_continue_as_each_prompt_alone(setup):
    model, tok = setup
    prompts = ["h", "the q", "over the lazy"]
    ids = [encode_prompt(tok, p) for p in prompts]
    done = complete(model, tok, ids, 12, Sampling(temperature=0), num_samples=2)
    assert done.rows == [(i, j) for i in range(3) for j in range(2)]
    for (i, _), text in zip(done.rows, done.texts):
        alone = generate(model, np.asarray([ids[i]]), 12, Sampling(temperature=0))[0, len(ids[i]):]
        assert text == tok.decode(alone)


def test_stop_text_cuts_before_it_and_on_text_streams_what_is_returned(setup):
    model, tok = setup
    ids = [encode_prompt(tok, "the q")]
    full = complete(model, tok, ids, 30, Sampling(temperature=0)).texts[0]
    stop = full[5:7]                                    # two characters the greedy text holds
    pieces = []
    done = complete(model, tok, ids, 30, Sampling(temperature=0, stop=[stop]), on_text=lambda r, t: pieces.append(t))
    assert done.texts[0] == full[:full.index(stop)] and "".join(pieces) == done.texts[0]


def test_one_check_names_settings_as_the_caller_does(setup):
    model, tok = setup
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\].*use temperature=0"):
        check_sampling(1.0, None, 0.0)
    flag = lambda name: "--" + name.replace("_", "-")   # noqa: E731
    with pytest.raises(ValueError, match=r"^--top-p must be in \(0, 1\].*use --temperature=0"):
        check_sampling(1.0, None, 0.0, named=flag)
    with pytest.raises(ValueError, match=r"^--window-shift must be in \[1, context_length=16\]"):
        check_completion(model, tok, max_new_tokens=5, window_shift=17, named=flag)
    with pytest.raises(ValueError, match=r"^stop needs a non-empty text"):
        complete(model, tok, [encode_prompt(tok, "h")], 5, Sampling(stop=[""]))
    with pytest.raises(ValueError, match="the prompt is empty"):
        encode_prompt(tok, "")


def test_sampling_is_one_frozen_value_checked_once_when_made(setup, monkeypatch):
    import dataclasses

    import pedestrian.generation.sampling as sampling_module

    model, tok = setup
    s = Sampling(temperature=0.7, top_k=5, seed=1, stop=["\n"], stop_ids=3)
    assert s.stop == ("\n",) and s.stop_ids == (3,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.temperature = 2.0
    with pytest.raises(ValueError, match=r"^--temperature must be a finite number >= 0"):
        Sampling(temperature=-1.0, named=lambda n: "--" + n)
    with pytest.raises(TypeError, match="stop_ids must be token ids"):
        Sampling(stop_ids=[1.5])
    calls = []
    real = sampling_module.check_sampling
    monkeypatch.setattr(sampling_module, "check_sampling", lambda *a, **k: calls.append(a) or real(*a, **k))
    s = Sampling(temperature=0.7, top_k=5, seed=1)      # checked here ...
    complete(model, tok, [encode_prompt(tok, "the")], 6, s)
    assert len(calls) == 1                              # ... and nowhere after


def test_loose_keywords_still_work_with_a_deprecation_warning(setup):
    model, tok = setup
    ids = np.asarray([encode_prompt(tok, "the q")])
    want = generate(model, ids, 8, Sampling(temperature=0.9, top_k=4, seed=2, stop_ids=[3]))
    with pytest.warns(DeprecationWarning, match="pass one pedestrian.generation.Sampling"):
        np.testing.assert_array_equal(generate(model, ids, 8, temperature=0.9, top_k=4, seed=2, stop_tokens=3), want)
    with pytest.warns(DeprecationWarning):
        old = complete(model, tok, [ids[0].tolist()], 8, temperature=0, stop=["o"])
    assert old.texts == complete(model, tok, [ids[0].tolist()], 8, Sampling(temperature=0, stop=["o"])).texts
    with pytest.raises(TypeError, match="one Sampling"):
        generate(model, ids, 3, 0.8)
    with pytest.raises(TypeError, match="either as a Sampling or as keywords"):
        generate(model, ids, 3, Sampling(), temperature=0)

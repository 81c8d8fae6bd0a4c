"""Repetition penalty, min-p and their order against Hugging Face ``transformers`` (the oracle).

- On random logits, the distribution :func:`pedestrian.generation.sampling.filter_logits` leaves equals the
  one HF's logits processors leave, with the processors and their order taken from HF itself
  (``GenerationMixin._get_logits_processor`` for a ``GenerationConfig``), alone and combined with
  temperature, top-k and top-p.
- The same through HF's public ``generate`` (``output_logits`` / ``output_scores``).
- Greedy generation with a repetition penalty equals HF ``generate`` on a tiny random GPT-2 for 40
  tokens.

Both sides compute in float64 here: the kept sets must agree exactly (continuous random logits
have no ties, and no cut lands within rounding of a threshold) and the probabilities to 1e-12,
a few ulps of float64 softmax arithmetic (exp, sum, divide) in two libraries, far above their
rounding and far below any filtering effect.
"""

from __future__ import annotations

import numpy as np
import pytest
from hf_fixtures import hf_model, save_hf_dir, tiny_tokenizer, torch, transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from pedestrian.generation.sampling import Sampling
from pedestrian.generation.generate import generate
from pedestrian.interop.hf import load_pretrained
from pedestrian.generation.sampling import filter_logits

PROB_TOL = 1e-12


@pytest.fixture(scope="module")
def hf_tiny():
    return hf_model(seed=1)


def hf_processors(model, **settings_):
    """HF's own list of processors for these settings, in its own order."""
    config = transformers.GenerationConfig(do_sample=True, **settings_)
    return model._get_logits_processor(generation_config=config, input_ids_seq_length=1,
                                       device="cpu", model_kwargs={})


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def assert_same_distribution(ours, theirs, tol=PROB_TOL):
    kept, kept_hf = np.isfinite(ours), np.isfinite(theirs)
    np.testing.assert_array_equal(kept, kept_hf)
    assert np.abs(softmax(ours) - softmax(np.asarray(theirs, dtype=np.float64))).max() <= tol


def test_hf_orders_the_processors_as_documented(hf_tiny):
    names = [type(p).__name__ for p in hf_processors(hf_tiny, temperature=0.7, top_k=5, top_p=0.9,
                                                     min_p=0.05, repetition_penalty=1.3)]
    assert names == ["RepetitionPenaltyLogitsProcessor", "TemperatureLogitsWarper", "TopKLogitsWarper",
                     "TopPLogitsWarper", "MinPLogitsWarper"]


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**31), V=st.integers(2, 120), T=st.integers(1, 30),
       temperature=st.one_of(st.none(), st.floats(0.2, 3.0)),
       top_k=st.one_of(st.none(), st.integers(1, 130)),
       top_p=st.one_of(st.none(), st.floats(0.05, 1.0)),
       min_p=st.one_of(st.none(), st.floats(0.0, 1.0)),
       penalty=st.one_of(st.none(), st.floats(0.3, 3.0)))
def test_filtered_distribution_equals_hf_processors(hf_tiny, seed, V, T, temperature, top_k, top_p,
                                                    min_p, penalty):
    rng = np.random.default_rng(seed)
    B = 3
    logits = rng.normal(0, 2.5, size=(B, V))
    seen = rng.integers(0, V, size=(B, T))
    hf_settings = {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p,
                                         min_p=min_p, repetition_penalty=penalty).items() if v is not None}
    theirs = hf_processors(hf_tiny, **hf_settings)(torch.as_tensor(seen), torch.as_tensor(logits)).numpy()
    ours = filter_logits(logits, 1.0 if temperature is None else temperature, top_k, top_p, min_p=min_p,
                         repetition_penalty=penalty, seen=seen)
    assert_same_distribution(ours, theirs)


@pytest.mark.parametrize("kw", [
    dict(repetition_penalty=1.4),
    dict(repetition_penalty=0.7),
    dict(min_p=0.1),
    dict(repetition_penalty=1.3, min_p=0.05, temperature=0.8),
    dict(repetition_penalty=1.2, temperature=1.3, top_k=40, top_p=0.9, min_p=0.02),
])
def test_one_step_of_hf_generate(hf_tiny, kw):
    """The processed scores of HF's public generate equal filter_logits of its raw logits.

    generate casts the logits to float32 before its processors run, so HF's side rounds each of
    its few operations (penalty, division, softmax) to float32: about 1e-7 relative on logits of
    magnitude < 10, i.e. < 1e-6 on each probability (the bound of issue 15)."""
    model = hf_tiny.double()
    prompt = torch.as_tensor([tiny_tokenizer().encode("the quick brown fox jumps over the fox")])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=1, do_sample=True, output_logits=True,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                             top_k=kw.get("top_k", 0), **{k: v for k, v in kw.items() if k != "top_k"})
    model.float()
    raw, scores = out.logits[0].numpy(), out.scores[0].numpy()
    ours = filter_logits(raw, kw.get("temperature", 1.0), kw.get("top_k"), kw.get("top_p"),
                         min_p=kw.get("min_p"), repetition_penalty=kw.get("repetition_penalty"),
                         seen=prompt.numpy())
    assert_same_distribution(ours, scores, tol=1e-6)
    if "min_p" in kw:                                            # the filter removed tokens
        assert not np.isfinite(scores).all()
    if "repetition_penalty" in kw:                               # the penalty changed the logits
        assert np.abs(softmax(ours) - softmax(filter_logits(raw, kw.get("temperature", 1.0)))).max() > 1e-4


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_greedy_repetition_penalty_matches_hf_generate(tmp_path, dtype, penalty):
    hf = hf_model(seed=2)
    d = save_hf_dir(hf, tmp_path / "hf")
    model, tok = load_pretrained(d, dtype=dtype)
    prompt = np.asarray([tok.encode("the quick brown fox, the quick")])
    torch_dtype = torch.float32 if dtype == "float32" else torch.float64
    with torch.no_grad():
        ref = hf.to(torch_dtype).generate(torch.as_tensor(prompt), max_new_tokens=40, do_sample=False,
                                          repetition_penalty=penalty, eos_token_id=None,
                                          pad_token_id=0).numpy()
        plain = hf.generate(torch.as_tensor(prompt), max_new_tokens=40, do_sample=False,
                            eos_token_id=None, pad_token_id=0).numpy()
    assert ref.shape == (1, prompt.shape[1] + 40)
    assert not np.array_equal(ref, plain)                        # the penalty changes the text
    # equal ids follow from equal logits only away from ties: every step's gap between the two
    # largest penalised float64 logits (teacher-forced on HF's ids) exceeds 4x the two libraries'
    # logit agreement (float32: 1e-5, float64: 1e-10; tests/system/test_interop_hf.py)
    tol = 1e-5 if dtype == "float32" else 1e-10
    m64, _ = load_pretrained(d, dtype="float64")
    logits = m64.forward(ref[:, :-1])[0]
    for t in range(prompt.shape[1] - 1, ref.shape[1] - 1):
        top2 = np.sort(filter_logits(logits[t], repetition_penalty=penalty, seen=ref[0, :t + 1]))[-2:]
        assert top2[1] - top2[0] > 4 * tol, t
    for use_cache in (True, False):
        ours = generate(model, prompt, 40, Sampling(temperature=0, repetition_penalty=penalty), use_cache=use_cache)
        np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("min_p", [1.0, 0.5, 0.3])
def test_min_p_keeps_every_token_tied_with_the_cut_as_hf(hf_tiny, min_p):
    """Ties: HF's MinPLogitsWarper removes a token only when its probability is *below* ``min_p``
    times the largest (``probs < min_p * top``), so ``min_p = 1`` keeps every token tied with the
    most likely one -- it is greedy only when that token is unique -- and tokens tied with each
    other are kept or removed together. Identical logits give bit-identical probabilities in
    either library, so the kept sets must agree exactly."""
    logits = np.array([[2.0, 2.0, 1.0, 2.0, -1.0, 1.0],          # three tied at the top
                       [0.5, 3.0, 3.0, 0.5, 2.5, 2.5],           # two at the top, two just below
                       [1.0, 4.0, 0.0, 0.0, 0.0, 0.0]])          # a unique top: min_p = 1 is greedy
    theirs = hf_processors(hf_tiny, min_p=min_p)(torch.zeros((3, 1), dtype=torch.long),
                                                 torch.as_tensor(logits)).numpy()
    ours = filter_logits(logits, min_p=min_p)
    assert_same_distribution(ours, theirs)
    if min_p == 1.0:
        assert np.isfinite(ours).tolist() == [[True, True, False, True, False, False],
                                              [False, True, True, False, False, False],
                                              [False, True, False, False, False, False]]


def test_min_p_one_draws_among_the_tied_top_tokens():
    """sample_next with ``min_p=1``: only tokens tied with the most likely one are ever drawn,
    each of them (uniformly), while ``temperature=0`` takes the lowest id."""
    from pedestrian.generation.sampling import sample_next

    logits = np.tile([[2.0, 2.0, 1.0, 2.0, -1.0, 1.0]], (600, 1))
    drawn = sample_next(logits, rng=0, min_p=1.0)
    counts = np.bincount(drawn, minlength=6)
    assert counts[[2, 4, 5]].sum() == 0 and counts[[0, 1, 3]].min() > 150
    assert set(sample_next(logits, temperature=0).tolist()) == {0}

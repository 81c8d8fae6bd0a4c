"""Sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, vocab_limit, their
combinations, non-finite logits, edge values, bad input.

Expected distributions are computed here independently of ``pedestrian.generation.generate``, by the
definitions: top-k keeps the k largest logits; the nucleus is the smallest set of the most
likely tokens whose probabilities add up to at least p (Holtzman et al. 2020; HF
``TopPLogitsWarper``); min-p keeps tokens at least min_p times as likely as the top one (HF
``MinPLogitsWarper``); the order is penalty -> temperature -> top-k -> top-p -> min-p (HF logits
processors). The same against transformers itself: tests/test_sampling_hf.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from pedestrian.generation.sampling import NonFiniteLogitsError, check_sampling, filter_logits, sample_next

ALPHA = 1e-3        # significance of the chi-square goodness-of-fit tests (seeded: deterministic)


def softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def expected_probs(logits_row, temperature, top_k=None, top_p=None, min_p=None,
                   penalty=None, seen=()) -> np.ndarray:
    """The filtered distribution, by the definitions, with plain loops: repetition penalty
    (CTRL / HF: positive logits of seen tokens divided, negative ones multiplied), temperature,
    top-k, the nucleus, then min-p (the order of HF's logits processors)."""
    x = np.asarray(logits_row, dtype=np.float64).copy()
    for t in set(seen):
        x[t] = x[t] / penalty if x[t] > 0 else x[t] * penalty
    x = x / temperature
    V = x.size
    keep = np.ones(V, dtype=bool)
    if top_k is not None and top_k < V:
        keep[:] = False
        keep[np.argsort(-x, kind="stable")[:top_k]] = True
    if top_p is not None and top_p < 1:
        p = softmax(np.where(keep, x, -np.inf))
        nucleus, mass = np.zeros(V, dtype=bool), 0.0
        for token in sorted(range(V), key=lambda t: (-p[t], t)):
            nucleus[token] = True
            mass += p[token]
            if mass >= top_p:
                break
        keep &= nucleus
    if min_p is not None:
        p = softmax(np.where(keep, x, -np.inf))
        keep &= p >= min_p * p.max()
    return softmax(np.where(keep, x, -np.inf))


def nucleus_upper(probs, top_p, slack=1e-9) -> set[int]:
    """Tokens that may belong to the nucleus: those whose more-likely mass is < p (+ slack for
    floating-point ties at the boundary)."""
    order = sorted(range(len(probs)), key=lambda t: (-probs[t], t))
    out, mass = set(), 0.0
    for t in order:
        if mass >= top_p + slack:
            break
        out.add(t)
        mass += probs[t]
    return out


# ------------------------------------------------------------------ greedy
def test_temperature_zero_is_greedy():
    logits = np.random.default_rng(0).normal(size=(6, 40))
    expected = logits.argmax(axis=-1)
    for seed in range(3):
        np.testing.assert_array_equal(sample_next(logits, seed, temperature=0), expected)
        # filters never remove the argmax, so they change nothing at temperature 0
        np.testing.assert_array_equal(sample_next(logits, seed, 0, top_k=3, top_p=0.5), expected)


def test_greedy_ties_go_to_lowest_id():
    logits = np.array([[0.0, 2.0, 2.0, 1.0]])
    assert sample_next(logits, 0, temperature=0)[0] == 1
    assert sample_next(logits, 0, temperature=1.0, top_p=1e-12)[0] == 1


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), V=st.integers(2, 60), temperature=st.floats(0.05, 5.0))
def test_tiny_top_p_equals_greedy(seed, V, temperature):
    logits = np.random.default_rng(seed).normal(0, 3, size=(4, V))
    got = sample_next(logits, seed, temperature=temperature, top_p=1e-9)
    np.testing.assert_array_equal(got, logits.argmax(axis=-1))


def test_top_k_one_is_greedy():
    logits = np.random.default_rng(1).normal(size=(5, 30))
    for seed in range(5):
        np.testing.assert_array_equal(sample_next(logits, seed, 1.7, top_k=1), logits.argmax(-1))


# ------------------------------------------------------------------ membership properties
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), V=st.integers(2, 80), k=st.integers(1, 90),
       temperature=st.floats(0.1, 3.0))
def test_top_k_never_outside_the_k_most_likely(seed, V, k, temperature):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, size=(3, V))
    draws = np.stack([sample_next(logits, rng, temperature, top_k=k) for _ in range(50)])
    for b in range(3):
        allowed = set(np.argsort(-logits[b])[:k].tolist())           # continuous logits: no ties
        assert set(draws[:, b].tolist()) <= allowed


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), V=st.integers(2, 80), top_p=st.floats(1e-6, 1.0),
       temperature=st.floats(0.1, 3.0))
def test_top_p_never_outside_the_nucleus(seed, V, top_p, temperature):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, size=(3, V))
    draws = np.stack([sample_next(logits, rng, temperature, top_p=top_p) for _ in range(50)])
    for b in range(3):
        allowed = nucleus_upper(softmax(logits[b] / temperature), top_p)
        assert set(draws[:, b].tolist()) <= allowed


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), V=st.integers(2, 60), top_p=st.floats(1e-6, 1.0),
       k=st.integers(1, 70))
def test_filter_matches_definition(seed, V, top_p, k):
    logits = np.random.default_rng(seed).normal(0, 2, size=(2, V))
    filtered = filter_logits(logits, 0.8, top_k=k, top_p=top_p)
    for b in range(2):
        kept = np.isfinite(filtered[b])
        assert kept.sum() >= 1                                     # never empty
        probs_after_k = expected_probs(logits[b], 0.8, top_k=k)
        assert set(np.flatnonzero(kept).tolist()) <= nucleus_upper(probs_after_k, top_p)
        # the kept set reaches p: it is a nucleus, not smaller
        assert probs_after_k[kept].sum() >= top_p - 1e-12
        np.testing.assert_array_equal(filtered[b][kept], logits[b][kept] / 0.8)


def test_nucleus_by_hand():
    # probabilities 0.5, 0.3, 0.15, 0.05 (softmax of their logs)
    logits = np.log(np.array([0.15, 0.5, 0.05, 0.3]))
    kept = lambda p: set(np.flatnonzero(np.isfinite(filter_logits(logits, top_p=p))).tolist())
    assert kept(0.4) == {1}
    assert kept(0.75) == {1, 3}
    assert kept(0.85) == {1, 3, 0}
    assert kept(0.99) == {0, 1, 2, 3}
    assert kept(1.0) == {0, 1, 2, 3}
    # top-k then top-p renormalises: after top_k=2 the probabilities are 0.625, 0.375
    assert set(np.flatnonzero(np.isfinite(filter_logits(logits, top_k=2, top_p=0.6))).tolist()) == {1}
    assert set(np.flatnonzero(np.isfinite(filter_logits(logits, top_k=2, top_p=0.7))).tolist()) == {1, 3}


# ------------------------------------------------------------------ edge values
def test_no_filter_edge_values():
    logits = np.random.default_rng(2).normal(size=(3, 17))
    np.testing.assert_array_equal(filter_logits(logits, 1.0), logits)
    np.testing.assert_array_equal(filter_logits(logits, 1.0, top_k=17), logits)     # k = V
    np.testing.assert_array_equal(filter_logits(logits, 1.0, top_k=10_000), logits)  # k > V: no filter
    np.testing.assert_array_equal(filter_logits(logits, 1.0, top_p=1.0), logits)     # p = 1: no filter
    np.testing.assert_array_equal(filter_logits(logits, 2.0), logits / 2.0)
    # and the draws with those settings are the unfiltered draws, seed for seed
    base = sample_next(logits, 7, 1.0)
    np.testing.assert_array_equal(sample_next(logits, 7, 1.0, top_k=10_000, top_p=1.0), base)


def test_top_p_zero_is_an_error_not_greedy():
    logits = np.zeros((1, 5))
    with pytest.raises(ValueError, match="temperature=0"):
        sample_next(logits, 0, 1.0, top_p=0.0)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(temperature=-0.1), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(temperature="hot"), TypeError, "temperature"),
    (dict(top_k=0), ValueError, "top_k"),
    (dict(top_k=-3), ValueError, "top_k"),
    (dict(top_k=2.5), TypeError, "top_k"),
    (dict(top_p=-0.2), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p=float("nan")), ValueError, "top_p"),
    (dict(min_p=-0.1), ValueError, r"min_p must be in \[0, 1\]"),
    (dict(min_p=1.5), ValueError, r"min_p must be in \[0, 1\]"),
    (dict(min_p=float("nan")), ValueError, "min_p"),
    (dict(min_p="low"), TypeError, "min_p"),
    (dict(repetition_penalty=0.0), ValueError, "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=-1.2), ValueError, "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=float("inf")), ValueError, "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), ValueError, "repetition_penalty"),
    (dict(repetition_penalty=True), TypeError, "repetition_penalty"),
    (dict(vocab_limit=0), ValueError, "vocab_limit must be >= 1"),
    (dict(vocab_limit=2.5), TypeError, "vocab_limit"),
])
def test_bad_sampling_settings(kwargs, exc, match):
    settings_ = dict(temperature=1.0, top_k=None, top_p=None)
    settings_.update(kwargs)
    with pytest.raises(exc, match=match):
        check_sampling(**settings_)
    with pytest.raises(exc, match=match):
        sample_next(np.zeros((1, 4)), 0, **settings_)


def test_bad_logits_shape():
    with pytest.raises(ValueError, match=r"\(B, V\)"):
        sample_next(np.zeros(4), 0)
    with pytest.raises(ValueError, match="temperature"):
        filter_logits(np.zeros((1, 4)), 0.0)


# ------------------------------------------------------------------ reproducibility, dtypes
def test_fixed_seed_is_reproducible():
    logits = np.random.default_rng(3).normal(size=(4, 50))
    runs = [[sample_next(logits, rng, 1.1, top_k=20, top_p=0.9) for _ in range(20)]
            for rng in (np.random.default_rng(42), np.random.default_rng(42))]
    np.testing.assert_array_equal(np.stack(runs[0]), np.stack(runs[1]))
    np.testing.assert_array_equal(sample_next(logits, 5), sample_next(logits, 5))
    other = np.stack([sample_next(logits, np.random.default_rng(43), 1.1) for _ in range(3)])
    assert not np.array_equal(np.stack(runs[0][:3]), other)


def test_float32_and_torch_logits():
    torch = pytest.importorskip("torch")
    logits = np.random.default_rng(4).normal(size=(3, 20))
    a = sample_next(logits, 9, 0.7, top_k=5)
    np.testing.assert_array_equal(sample_next(torch.tensor(logits), 9, 0.7, top_k=5), a)
    assert sample_next(logits.astype(np.float32), 9, 0.7, top_k=5).dtype == np.int64


# ------------------------------------------------------------------ distribution (chi-square)
@pytest.mark.parametrize("temperature, top_k, top_p, min_p, penalty", [
    (1.0, None, None, None, None),
    (0.7, None, None, None, None),
    (1.0, 5, None, None, None),
    (1.3, None, 0.8, None, None),
    (0.9, 8, 0.9, None, None),
    (1.0, None, None, 0.2, None),
    (1.0, None, None, None, 1.8),
    (0.8, None, None, None, 0.6),
    (1.1, 9, 0.95, 0.1, 1.5),
])
def test_frequencies_match_filtered_probabilities(temperature, top_k, top_p, min_p, penalty):
    V, N = 12, 20_000
    logits = np.random.default_rng(11).normal(0, 1.5, size=V)
    seen = [1, 4, 4, 7, 9]                                       # a repeat counts once
    expected = expected_probs(logits, temperature, top_k, top_p, min_p, penalty,
                              seen if penalty else ())
    # N independent draws as one batch of N identical rows (the batched path), seeded
    draws = sample_next(np.tile(logits, (N, 1)), np.random.default_rng(2024), temperature, top_k, top_p,
                        min_p=min_p, repetition_penalty=penalty,
                        seen=np.tile(seen, (N, 1)) if penalty else None)
    counts = np.bincount(draws, minlength=V)
    assert counts[expected == 0].sum() == 0                      # filtered tokens never drawn
    support = expected > 0
    result = stats.chisquare(counts[support], N * expected[support])
    assert result.pvalue > ALPHA, (counts, N * expected)
    if top_k is not None or top_p is not None or min_p is not None:
        assert support.sum() < V                                 # the filter did remove tokens
    if penalty is not None:                                      # the penalty did move mass
        assert np.abs(expected - expected_probs(logits, temperature, top_k, top_p, min_p)).max() > 0.01


def test_sequential_draws_match_probabilities():
    V, N = 6, 6000
    logits = np.random.default_rng(12).normal(size=(1, V))
    rng = np.random.default_rng(99)
    counts = np.bincount([int(sample_next(logits, rng, 1.0)[0]) for _ in range(N)], minlength=V)
    assert stats.chisquare(counts, N * softmax(logits[0])).pvalue > ALPHA


# ------------------------------------------------------------------ repetition penalty
def test_repetition_penalty_by_hand():
    # the example of issue 15 / HF RepetitionPenaltyLogitsProcessor: tokens 0 and 1 seen
    logits = np.array([2.0, -1.0, 0.5])
    np.testing.assert_array_equal(filter_logits(logits, repetition_penalty=2.0, seen=[0, 1]),
                                  [1.0, -2.0, 0.5])
    # a token seen several times is penalised once
    np.testing.assert_array_equal(filter_logits(logits, repetition_penalty=2.0, seen=[1, 0, 1, 1, 0]),
                                  [1.0, -2.0, 0.5])
    # r < 1 favours seen tokens; r = 1 and r = None change nothing; no seen token: nothing
    np.testing.assert_array_equal(filter_logits(logits, repetition_penalty=0.5, seen=[0, 1]),
                                  [4.0, -0.5, 0.5])
    for r, seen in ((1.0, [0, 1]), (None, None), (3.0, np.zeros(0, dtype=np.int64))):
        np.testing.assert_array_equal(filter_logits(logits, repetition_penalty=r, seen=seen), logits)
    # the penalty scales, so it commutes with the temperature: (z / r) / T
    np.testing.assert_array_equal(filter_logits(logits, 0.5, repetition_penalty=2.0, seen=[0, 1]),
                                  [2.0, -4.0, 1.0])


def test_repetition_penalty_rows_have_their_own_seen_tokens():
    logits = np.array([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    ids = np.array([[0, 0, 1], [3, 2, 3]])
    out = filter_logits(logits, repetition_penalty=2.0, seen=ids)
    np.testing.assert_array_equal(out, [[1.0, -2.0, 0.5, 3.0], [2.0, -1.0, 0.25, 1.5]])
    mask = np.zeros((2, 4), dtype=bool)
    mask[[0, 0, 1, 1], [0, 1, 2, 3]] = True                      # the same as a (B, V) mask
    np.testing.assert_array_equal(filter_logits(logits, repetition_penalty=2.0, seen=mask), out)
    # greedy takes the argmax of the penalised logits: row 0 -> 3, row 1 -> 0
    np.testing.assert_array_equal(sample_next(logits, 0, 0, repetition_penalty=2.0, seen=ids), [3, 0])
    np.testing.assert_array_equal(sample_next(logits, 0, 0, repetition_penalty=2.0, seen=mask), [3, 0])


def test_repetition_penalty_comes_before_top_k():
    # HF order: the penalty first, so top-k ranks the penalised logits
    logits = np.array([2.0, 1.5, 0.0])
    kept = np.isfinite(filter_logits(logits, top_k=1, repetition_penalty=2.0, seen=[0]))
    np.testing.assert_array_equal(kept, [False, True, False])    # top-k first would keep token 0


def test_repetition_penalty_needs_valid_seen_tokens():
    logits = np.zeros((2, 5))
    with pytest.raises(ValueError, match="repetition_penalty needs the tokens seen so far"):
        sample_next(logits, 0, repetition_penalty=1.3)
    with pytest.raises(ValueError, match="outside"):
        sample_next(logits, 0, repetition_penalty=1.3, seen=np.array([[0, 5], [1, 2]]))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        sample_next(logits, 0, repetition_penalty=1.3, seen=np.array([[0, 1]]))        # B = 1 != 2
    with pytest.raises(ValueError, match=r"\(B, V\)"):
        sample_next(logits, 0, repetition_penalty=1.3, seen=np.zeros((2, 4), dtype=bool))


def test_repetition_penalty_overflow_is_an_error():
    with pytest.raises(ValueError, match="overflows float64"):
        sample_next(np.array([[1e308, 1.0]]), 0, repetition_penalty=0.5, seen=[[0]])


# ------------------------------------------------------------------ min-p
def test_min_p_by_hand():
    # probabilities 0.5, 0.3, 0.15, 0.05: kept = at least min_p * 0.5
    logits = np.log(np.array([0.15, 0.5, 0.05, 0.3]))
    kept = lambda **kw: set(np.flatnonzero(np.isfinite(filter_logits(logits, **kw))).tolist())
    assert kept(min_p=0.0) == {0, 1, 2, 3}
    assert kept(min_p=0.09) == {0, 1, 2, 3}                     # threshold 0.045
    assert kept(min_p=0.2) == {0, 1, 3}                         # 0.1
    assert kept(min_p=0.59) == {1, 3}                           # 0.295
    assert kept(min_p=0.61) == {1}                              # 0.305
    assert kept(min_p=1.0) == {1}
    # min-p after top-p (HF order): the nucleus of 0.75 is {0.5, 0.3, 0.15}; min_p 0.3 (0.15)
    # keeps all three. The other order would drop 0.05 first, renormalise, and the nucleus of
    # 0.75 would then be {0.5, 0.3} only.
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    kept_both = np.isfinite(filter_logits(np.log(probs), top_p=0.75, min_p=0.3))
    np.testing.assert_array_equal(kept_both, [True, True, True, False])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), V=st.integers(2, 60), temperature=st.floats(0.05, 5.0))
def test_min_p_one_equals_greedy(seed, V, temperature):
    """Without ties (continuous random logits); with ties min_p=1 keeps every token tied for the
    top, as HF does (test_sampling_hf.py)."""
    logits = np.random.default_rng(seed).normal(0, 3, size=(4, V))
    np.testing.assert_array_equal(sample_next(logits, seed, temperature, min_p=1.0), logits.argmax(-1))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), V=st.integers(2, 60), min_p=st.floats(0.0, 1.0),
       temperature=st.floats(0.1, 3.0))
def test_min_p_never_below_the_threshold(seed, V, min_p, temperature):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, size=(3, V))
    draws = np.stack([sample_next(logits, rng, temperature, min_p=min_p) for _ in range(30)])
    for b in range(3):
        p = softmax(logits[b] / temperature)
        allowed = set(np.flatnonzero(p >= min_p * p.max() * (1 - 1e-12)).tolist())  # rounding slack
        assert set(draws[:, b].tolist()) <= allowed


# ------------------------------------------------------------------ vocab_limit
SETTINGS = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.3, top_k=1),
            dict(temperature=1.0, top_k=3), dict(temperature=2.0, top_p=0.5),
            dict(temperature=1.0, min_p=0.5), dict(temperature=0.7, top_k=4, top_p=0.9, min_p=0.1)]


@pytest.mark.parametrize("kw", SETTINGS)
def test_vocab_limit_ids_are_never_chosen(kw):
    logits = np.random.default_rng(5).normal(size=(400, 10))
    logits[:, 7:] += 20.0                                         # the masked ids would win
    ids = sample_next(logits, 1, **kw, vocab_limit=7)
    assert ids.max() < 7
    if kw["temperature"] == 0:
        np.testing.assert_array_equal(ids, logits[:, :7].argmax(-1))
    assert sample_next(logits, 1, **kw).min() >= 7                # without the limit they would be
    # masked before the filters: top_k=1 picks the best of the allowed ids, not an error
    np.testing.assert_array_equal(sample_next(logits, 1, 1.0, top_k=1, vocab_limit=7),
                                  logits[:, :7].argmax(-1))


def test_vocab_limit_edge_values():
    logits = np.random.default_rng(6).normal(size=(3, 9))
    # vocab_limit = V: no mask, the very same draws
    np.testing.assert_array_equal(sample_next(logits, 4, 1.0, vocab_limit=9), sample_next(logits, 4, 1.0))
    np.testing.assert_array_equal(filter_logits(logits, vocab_limit=9), logits)
    np.testing.assert_array_equal(sample_next(logits, 4, 1.0, vocab_limit=1), [0, 0, 0])
    with pytest.raises(ValueError, match="vocab_limit=10 is larger than the logits' V=9"):
        sample_next(logits, 0, vocab_limit=10)
    with pytest.raises(ValueError, match="vocab_limit=10 is larger"):
        filter_logits(logits, vocab_limit=10)
    bad = logits.copy()
    bad[1, :4] = -np.inf                                          # nothing left below the limit
    with pytest.raises(NonFiniteLogitsError, match="row 1 .*no finite logit below vocab_limit=4"):
        sample_next(bad, 0, vocab_limit=4)


# ------------------------------------------------------------------ non-finite logits
NONFINITE_SETTINGS = SETTINGS + [
    dict(temperature=1e-300), dict(temperature=50.0),
    dict(temperature=1.0, repetition_penalty=2.0, seen=[[2, 0]]),
    dict(temperature=0, repetition_penalty=0.5, seen=[[2, 1]]),
    dict(temperature=1.0, vocab_limit=4),
]


@pytest.mark.parametrize("kw", NONFINITE_SETTINGS)
def test_posinf_logit_is_picked(kw):
    # issue 13: this row gave token 0
    logits = np.array([[1.0, 2.0, np.inf, 0.5]])
    for seed in range(20):
        assert sample_next(logits, seed, **kw)[0] == 2
    if kw["temperature"] > 0:
        out = filter_logits(logits[0], **{k: (v[0] if k == "seen" else v) for k, v in kw.items()})
        np.testing.assert_array_equal(np.isfinite(out), [False, False, True, False])


@pytest.mark.parametrize("kw", NONFINITE_SETTINGS)
def test_several_posinf_logits_are_equally_likely(kw):
    logits = np.array([np.inf, 3.0, np.inf, 9.0, np.inf, -np.inf])
    N = 9000
    seen = kw.get("seen")
    kw = dict(kw, seen=None if seen is None else np.tile(seen, (N, 1)))
    ids = sample_next(np.tile(logits, (N, 1)), np.random.default_rng(3), **kw)
    if kw["temperature"] == 0:
        assert (ids == 0).all()                                   # greedy: a tie -> the lowest id
        return
    counts = np.bincount(ids, minlength=6)
    tied = [0, 2] if kw.get("vocab_limit") == 4 else [0, 2, 4]  # the limit masks id 4 first
    assert counts.sum() == counts[tied].sum()
    # the filters (top_k=1, a small top_p) would keep only some of the tied tokens: not applied
    assert stats.chisquare(counts[tied]).pvalue > ALPHA, counts


@pytest.mark.parametrize("kw", NONFINITE_SETTINGS)
def test_nan_logits_are_an_error_naming_the_row(kw):
    logits = np.array([[1.0, 2.0, 3.0, 0.5], [1.0, np.nan, 3.0, np.nan]])
    seen = kw.get("seen")
    kw = dict(kw, seen=None if seen is None else np.tile(seen, (2, 1)))
    with pytest.raises(NonFiniteLogitsError, match=r"NaN \(row 1: 2 of 4\).*non-finite weights"):
        sample_next(logits, 0, **kw)
    if kw["temperature"] > 0:
        with pytest.raises(NonFiniteLogitsError, match="row 1: 2 of 4"):
            filter_logits(logits, **kw)
    # a NaN next to +inf is still an error, not a pick
    with pytest.raises(ValueError, match=r"row 0: 1 of 3"):
        sample_next(np.array([[np.inf, np.nan, 1.0]]), 0, kw["temperature"])


def test_all_neginf_row_is_an_error():
    logits = np.array([[0.0, 1.0], [-np.inf, -np.inf]])
    for kw in (dict(temperature=0), dict(temperature=1.0), dict(temperature=1.0, top_k=1)):
        with pytest.raises(NonFiniteLogitsError, match="row 1 of the logits has no finite logit"):
            sample_next(logits, 0, **kw)


@pytest.mark.parametrize("kw", SETTINGS + [dict(temperature=1.0, repetition_penalty=3.0, seen=[[0, 2]])])
def test_neginf_logits_are_never_drawn(kw):
    logits = np.array([[-np.inf, 0.5, -np.inf, 0.1, 0.2, -np.inf]])
    N = 2000
    seen = kw.get("seen")
    kw = dict(kw, seen=None if seen is None else np.tile(seen, (N, 1)))
    ids = sample_next(np.tile(logits, (N, 1)), 0, **kw)
    assert not np.isin(ids, [0, 2, 5]).any()


def test_tiny_temperature_does_not_overflow_into_a_tie():
    # finite / 1e-300 overflows: [2, 2.5] must not become a +inf tie, [-1, -2] not all -inf
    logits = np.array([[2.0, 2.5, 1.0], [-1.0, -2.0, -3.0], [1e300, 0.0, -1e300]])
    for seed in range(10):
        np.testing.assert_array_equal(sample_next(logits, seed, 1e-300), [1, 0, 0])
        np.testing.assert_array_equal(sample_next(logits, seed, 1e-300, top_p=0.9, min_p=0.1), [1, 0, 0])
    out = filter_logits(logits, 1e-300)
    assert np.isfinite(out.max(axis=-1)).all()
    # rows that do not overflow are still exactly logits / T
    np.testing.assert_array_equal(filter_logits(logits[:2], 1e-3), logits[:2] / 1e-3)


def test_nonfinite_torch_logits():
    torch = pytest.importorskip("torch")
    assert sample_next(torch.tensor([[1.0, 2.0, float("inf"), 0.5]]), 0)[0] == 2
    with pytest.raises(NonFiniteLogitsError, match="row 0: 1 of 4"):
        sample_next(torch.tensor([[1.0, float("nan"), 3.0, 0.5]], dtype=torch.float32), 0, 0)

"""Sampling: greedy, temperature, top-k, top-p, their combinations, edge values, bad input.

Expected distributions are computed here independently of ``pedestrian.generate``, by the
definitions: top-k keeps the k largest logits; the nucleus is the smallest set of the most
likely tokens whose probabilities add up to at least p (Holtzman et al. 2020; HF
``TopPLogitsWarper``); the order is temperature -> top-k -> top-p (HF logits warpers).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from pedestrian.sampling import check_sampling, filter_logits, sample_next

ALPHA = 1e-3        # significance of the chi-square goodness-of-fit tests (seeded: deterministic)


def softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def expected_probs(logits_row, temperature, top_k=None, top_p=None) -> np.ndarray:
    """The filtered distribution, by the definitions, with a plain loop for the nucleus."""
    x = np.asarray(logits_row, dtype=np.float64) / temperature
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
@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, None, None),
    (0.7, None, None),
    (1.0, 5, None),
    (1.3, None, 0.8),
    (0.9, 8, 0.9),
])
def test_frequencies_match_filtered_probabilities(temperature, top_k, top_p):
    V, N = 12, 20_000
    logits = np.random.default_rng(11).normal(0, 1.5, size=V)
    expected = expected_probs(logits, temperature, top_k, top_p)
    # N independent draws as one batch of N identical rows (the batched path), seeded
    draws = sample_next(np.tile(logits, (N, 1)), np.random.default_rng(2024), temperature, top_k, top_p)
    counts = np.bincount(draws, minlength=V)
    assert counts[expected == 0].sum() == 0                      # filtered tokens never drawn
    support = expected > 0
    result = stats.chisquare(counts[support], N * expected[support])
    assert result.pvalue > ALPHA, (counts, N * expected)
    if top_k is not None or top_p is not None:
        assert support.sum() < V                                 # the filter did remove tokens


def test_sequential_draws_match_probabilities():
    V, N = 6, 6000
    logits = np.random.default_rng(12).normal(size=(1, V))
    rng = np.random.default_rng(99)
    counts = np.bincount([int(sample_next(logits, rng, 1.0)[0]) for _ in range(N)], minlength=V)
    assert stats.chisquare(counts, N * softmax(logits[0])).pvalue > ALPHA

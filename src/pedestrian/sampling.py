"""Sampling the next token from logits: temperature, top-k, top-p (nucleus), greedy.

Sampling (:func:`sample_next`) follows the order of Hugging Face ``transformers``' logits warpers
(``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` -> ``TopPLogitsWarper``): divide the logits
by the temperature, keep the ``top_k`` largest, then keep the nucleus of the renormalised
distribution, renormalise and draw. All filtering is done in float64 on the final ``(B, V)``
logits.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .backend import to_numpy

__all__ = ["sample_next", "filter_logits", "check_sampling"]




def check_sampling(temperature, top_k, top_p) -> None:
    """Validate sampling settings (see :func:`sample_next` for their meaning).

    Raises:
        ValueError: ``temperature`` negative or not finite; ``top_k < 1``; ``top_p`` outside
            ``(0, 1]`` (``top_p = 0`` is an error, not greedy: for greedy decoding use
            ``temperature=0``).
        TypeError: ``top_k`` not an integer, ``temperature`` / ``top_p`` not real numbers.
    """
    if not isinstance(temperature, numbers.Real) or isinstance(temperature, bool):
        raise TypeError(f"temperature must be a real number >= 0, got {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k is not None:
        if not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool):
            raise TypeError(f"top_k must be a positive integer or None, got {top_k!r}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1 (or None for no top-k filter), got {top_k}")
    if top_p is not None:
        if not isinstance(top_p, numbers.Real) or isinstance(top_p, bool):
            raise TypeError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = no nucleus filter), got {top_p}; "
                             "top_p=0 would keep no token -- for greedy decoding use temperature=0")


def _softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    e /= e.sum(axis=-1, keepdims=True)
    return e


def filter_logits(logits, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> np.ndarray:
    """Temperature, top-k and top-p applied to logits; removed tokens get ``−∞``.

    Args:
        logits: ``(B, V)`` (or ``(V,)``), any float dtype or backend; converted to float64.
        temperature: ``> 0`` divides the logits (``temperature = 0`` is handled by
            :func:`sample_next` as greedy and is not accepted here).
        top_k: keep the ``top_k`` largest logits of each row (exactly ``top_k``; ties at the
            k-th value are broken arbitrarily). ``None`` or ``top_k >= V``: no top-k filter.
        top_p: nucleus -- keep the smallest set of the most likely tokens whose probabilities
            (after temperature and top-k, renormalised) add up to at least ``top_p``; never
            empty (the most likely token is always kept; ties in probability are ordered by
            token id). ``None`` or ``1``: no nucleus filter.

    Returns:
        float64 ``(B, V)`` logits divided by the temperature, ``−∞`` where removed.

    Raises:
        ValueError / TypeError: as :func:`check_sampling`, and ``temperature = 0``.

    Source: Hugging Face ``transformers`` logits warpers, applied in the order temperature ->
    top-k -> top-p (HF ``TopPLogitsWarper`` keeps at least one token, as here).
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        raise ValueError("filter_logits needs temperature > 0; temperature 0 means greedy (argmax), "
                         "use sample_next")
    x = np.asarray(to_numpy(logits), dtype=np.float64)
    squeeze = x.ndim == 1
    x = np.atleast_2d(x) / float(temperature)
    return (_filter(x, top_k, top_p))[0] if squeeze else _filter(x, top_k, top_p)


def _filter(x: np.ndarray, top_k, top_p) -> np.ndarray:
    """Top-k then top-p on float64 ``(B, V)`` (already divided by the temperature)."""
    B, V = x.shape
    if top_k is not None and top_k < V:
        kept = np.argpartition(x, V - top_k, axis=-1)[:, V - top_k:]   # the k largest, any order
        filtered = np.full_like(x, -np.inf)
        np.put_along_axis(filtered, kept, np.take_along_axis(x, kept, axis=-1), axis=-1)
        x = filtered
    if top_p is not None and top_p < 1.0:
        probs = _softmax64(x)
        order = np.argsort(-probs, axis=-1, kind="stable")                 # most likely first
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        before = np.zeros_like(sorted_p)                                   # mass of the more likely ones
        np.cumsum(sorted_p[:, :-1], axis=-1, out=before[:, 1:])
        # keep a token while the mass before it is still short of top_p: the smallest set
        # reaching top_p; the first token always (0 < top_p)
        keep_sorted = before < top_p
        keep = np.empty_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        x = np.where(keep, x, -np.inf)
    return x


def _draw(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One id per row of float64 logits ``x`` (``−∞`` = impossible), by the inverse CDF."""
    cdf = np.cumsum(_softmax64(x), axis=-1)
    u = rng.random(x.shape[0]) * cdf[:, -1]              # scaled: u < total, so an id is always found
    # first index with cdf > u; that token has probability > 0 (cdf[i] > u >= cdf[i-1])
    return np.sum(cdf <= u[:, None], axis=-1).astype(np.int64)


def _sample(logits, rng, temperature, top_k, top_p) -> np.ndarray:
    """:func:`sample_next` without validation (the generation loop validates once)."""
    if temperature == 0:
        return np.asarray(to_numpy(logits).argmax(axis=-1), dtype=np.int64)   # greedy
    x = np.asarray(to_numpy(logits), dtype=np.float64) / temperature
    return _draw(_filter(x, top_k, top_p), rng)


def sample_next(logits, rng: np.random.Generator | int | None = None, temperature: float = 1.0,
                top_k: int | None = None, top_p: float | None = None) -> np.ndarray:
    """Draw the next token of each row from ``(B, V)`` logits.

    Args:
        logits: ``(B, V)`` float array (NumPy or torch); filtering is done in float64.
        rng: a ``numpy.random.Generator``, or a seed for one (``None``: fresh entropy).
        temperature: ``0`` = greedy (argmax; ties go to the lowest id; ``top_k`` / ``top_p``
            then change nothing since the argmax is always kept); ``> 0`` divides the logits.
        top_k: ``None`` or ``>= 1``; ``top_k >= V`` means no top-k filter.
        top_p: ``None`` or in ``(0, 1]``; ``1`` means no nucleus filter; a tiny ``top_p``
            keeps only the most likely token (= greedy). ``0`` is an error.

    Returns:
        ``(B,)`` int64 ids. Each has probability > 0 under the filtered distribution.

    Raises:
        ValueError / TypeError: see :func:`check_sampling`; logits that are not 2-D.
    """
    check_sampling(temperature, top_k, top_p)
    if len(getattr(logits, "shape", ())) != 2:
        raise ValueError(f"logits must have shape (B, V), got {getattr(logits, 'shape', None)}")
    if not isinstance(rng, np.random.Generator):
        rng = np.random.default_rng(rng)
    return _sample(logits, rng, temperature, top_k, top_p)

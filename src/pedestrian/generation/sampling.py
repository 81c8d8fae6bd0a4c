"""Sampling the next token from logits: vocabulary limit, repetition penalty, temperature, top-k,
top-p (nucleus), min-p, greedy.

Order. For the same settings the steps run in the order Hugging Face ``transformers`` builds its
logits processors (``GenerationMixin._get_logits_processor`` in ``transformers/generation/utils.py``,
checked against version 5.24; the repetition penalty is a plain logits processor, applied in
greedy decoding too, and the sampling warpers follow it)::

    0. vocab_limit         ids >= vocab_limit get -inf   (pedestrian's; before everything else)
    1. repetition_penalty  RepetitionPenaltyLogitsProcessor
    --- greedy (temperature = 0) stops here: argmax ---
    2. temperature         TemperatureLogitsWarper
    3. top_k               TopKLogitsWarper
    4. top_p               TopPLogitsWarper
    5. min_p               MinPLogitsWarper
    then softmax and one draw per row

- The **repetition penalty** ``r`` (CTRL, Keskar et al. 2019; HF ``repetition_penalty``) changes the
  logit of every token *seen* in that row -- the prompt and the tokens generated so far, each
  counted once however often it occurs: a positive logit is divided by ``r``, a negative one
  multiplied by it (``[2, -1, 0.5]`` with ``r = 2`` and tokens 0 and 1 seen -> ``[1, -2, 0.5]``).
  ``r > 1`` discourages repetition, ``r < 1`` encourages it, ``r = 1`` changes nothing.
- **min-p** keeps the tokens whose probability (after the steps before it) is at least ``min_p``
  times the largest probability of the row, as HF's ``MinPLogitsWarper`` (it removes those
  *below* the cut): the most likely token is always kept, and so is every token tied with it --
  ``min_p = 1`` keeps exactly the tokens tied for the top, one token unless there are ties.

All arithmetic is float64 on the final ``(B, V)`` logits, vectorised over rows.

Non-finite logits (one policy, every path: greedy, each filter, the draw):

- **NaN** anywhere in a row is an error (:class:`NonFiniteLogitsError`, a ``ValueError``) that names
  the rows and how many NaNs each holds: a model only produces NaN logits from non-finite weights
  (a damaged or diverged checkpoint) or an overflow inside the forward pass.
- **+inf** is the limit of a logit growing without bound, so a row with ``+inf`` logits picks one
  of its ``+inf`` tokens for certain: uniformly among them when there are several (greedy: the
  lowest such id, as for any tie). The penalty and the temperature leave ``+inf`` infinite; the
  filters, which would keep an arbitrary subset of such ties, are not applied to that row.
- **-inf** is probability 0 (never drawn). A row left with no finite logit (all ``-inf``, or every
  id below ``vocab_limit`` ``-inf``) is an error.
- Dividing finite logits by a tiny temperature cannot overflow into a false ``+inf`` tie: a row
  that would overflow has its maximum subtracted first (the softmax does not change). A
  repetition penalty that would overflow a finite logit is an error.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..backend import is_torch_array, to_numpy
from ..text.tokenizer_base import check_text

__all__ = ["Sampling", "sample_next", "sample_unchecked", "filter_logits", "check_sampling", "NonFiniteLogitsError"]


class NonFiniteLogitsError(ValueError):
    """Logits that hold NaN, or a row without a single finite logit (see the module docstring)."""


def check_sampling(temperature, top_k, top_p, min_p=None, repetition_penalty=None,
                   vocab_limit=None, named=None) -> None:
    """Validate sampling settings (see :func:`sample_next` for their meaning).

    ``named``: how a message names a setting, ``named("top_p")`` (default: the keyword itself;
    ``pedestrian sample`` passes its flags, ``--top-p``), so one check serves both.

    Raises:
        ValueError: ``temperature`` negative or not finite; ``top_k < 1``; ``top_p`` outside
            ``(0, 1]`` (``top_p = 0`` is an error, not greedy: for greedy decoding use
            ``temperature=0``); ``min_p`` outside ``[0, 1]``; ``repetition_penalty`` not a
            finite number ``> 0``; ``vocab_limit < 1``.
        TypeError: ``top_k`` / ``vocab_limit`` not integers, the others not real numbers.
    """
    n = named or str

    def real(value) -> bool:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)

    def integer(value) -> bool:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)

    if not real(temperature):
        raise TypeError(f"{n('temperature')} must be a real number >= 0, got {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"{n('temperature')} must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k is not None:
        if not integer(top_k):
            raise TypeError(f"{n('top_k')} must be a positive integer or None, got {top_k!r}")
        if top_k < 1:
            raise ValueError(f"{n('top_k')} must be >= 1 (leave it unset for no top-k filter), got {top_k}")
    if top_p is not None:
        if not real(top_p):
            raise TypeError(f"{n('top_p')} must be a number in (0, 1] or None, got {top_p!r}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"{n('top_p')} must be in (0, 1] (1 = no nucleus filter), got {top_p:g}; "
                             f"{n('top_p')}=0 would keep no token -- for greedy decoding use "
                             f"{n('temperature')}=0")
    if min_p is not None:
        if not real(min_p):
            raise TypeError(f"{n('min_p')} must be a number in [0, 1] or None, got {min_p!r}")
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"{n('min_p')} must be in [0, 1] (0 = no min-p filter; it is a fraction of the "
                             f"most likely token's probability), got {min_p:g}")
    if repetition_penalty is not None:
        if not real(repetition_penalty):
            raise TypeError(f"{n('repetition_penalty')} must be a number > 0 or None, got {repetition_penalty!r}")
        if not (math.isfinite(repetition_penalty) and repetition_penalty > 0):
            raise ValueError(f"{n('repetition_penalty')} must be a finite number > 0 (1 = no penalty, > 1 "
                             f"discourages repeats, e.g. 1.2), got {repetition_penalty:g}")
    check_vocab_limit(vocab_limit, n)


def check_vocab_limit(vocab_limit, named=None) -> None:
    """Raise ``TypeError`` / ``ValueError`` unless ``vocab_limit`` is ``None`` or an integer ``>= 1``."""
    n = named or str
    if vocab_limit is not None:
        if not isinstance(vocab_limit, numbers.Integral) or isinstance(vocab_limit, bool):
            raise TypeError(f"{n('vocab_limit')} must be a positive integer or None, got {vocab_limit!r}")
        if vocab_limit < 1:
            raise ValueError(f"{n('vocab_limit')} must be >= 1 (the number of ids that may be sampled), "
                             f"got {vocab_limit}")


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen and where a row ends: one value, validated once, when it is
    made, and passed whole (:func:`~pedestrian.generation.generate.generate`,
    :func:`~pedestrian.generation.prompts.complete`, ``pedestrian sample``).

    Attributes:
        temperature, top_k, top_p, min_p, repetition_penalty: the steps of the module docstring
            (their valid values: :func:`check_sampling`); ``temperature=0`` is greedy.
        seed: an int or a ``numpy.random.Generator`` (``None``: fresh entropy); the same seed
            gives the same tokens.
        stop_ids: token ids that end a row (the token is kept in ``generate``'s output, not in
            ``complete``'s text).
        stop: texts that end a row right before them (``complete``: matched on the decoded text).
        ignore_eot: ``complete`` does not stop at ``<|endoftext|>``.
        named: how a message names a setting (default: the keyword; ``pedestrian sample`` passes
            its flags, ``--top-p``); not part of the value.

    Raises:
        ValueError / TypeError: a bad setting (:func:`check_sampling`), a stop id that is no
            integer, an empty or non-Unicode stop text. (Whether a stop id is one of the model's
            is checked where the model is known: ``generate``, ``complete``.)
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | np.random.Generator | None = None
    stop_ids: tuple = ()
    stop: tuple = ()
    ignore_eot: bool = False
    named: Callable[[str], str] = dataclasses.field(default=str, repr=False, compare=False)

    def __post_init__(self):
        n = self.named
        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty, named=n)
        ids = (self.stop_ids,) if isinstance(self.stop_ids, numbers.Integral) else tuple(self.stop_ids)
        if any(not isinstance(i, numbers.Integral) or isinstance(i, bool) for i in ids):
            raise TypeError(f"{n('stop_ids')} must be token ids (integers), got {list(ids)}")
        texts = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(text == "" for text in texts):
            raise ValueError(f"{n('stop')} needs a non-empty text (an empty stop string would end every sample "
                             "before its first token)")
        for i, text in enumerate(texts):                # bytes that are not UTF-8: it could never match
            check_text(text, n("stop") if len(texts) == 1 else f"{n('stop')} {i + 1}")
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in ids))
        object.__setattr__(self, "stop", texts)

    def ending_at(self, stop_ids) -> "Sampling":
        """This sampling, also ending at the token ids ``stop_ids`` (``complete`` adds
        ``<|endoftext|>``); what was checked is not checked again."""
        more = copy.copy(self)
        object.__setattr__(more, "stop_ids", self.stop_ids + tuple(int(i) for i in stop_ids))
        return more

    @property
    def penalised(self) -> bool:
        """Whether a repetition penalty changes anything (``r`` given and not 1)."""
        return self.repetition_penalty is not None and self.repetition_penalty != 1.0

    def rng(self) -> np.random.Generator:
        """The generator the draws come from: ``seed`` itself, or a new one seeded with it."""
        return self.seed if isinstance(self.seed, np.random.Generator) else np.random.default_rng(self.seed)


def _softmax64(x: np.ndarray) -> np.ndarray:
    """Row softmax of float64 logits whose row maxima are finite."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    e /= e.sum(axis=-1, keepdims=True)
    return e


def _seen_mask(seen, B: int, V: int) -> np.ndarray:
    """``(B, V)`` bool from ``seen``: ``(B, T)`` integer ids or a ``(B, V)`` bool mask."""
    s = to_numpy(seen) if is_torch_array(seen) else np.asarray(seen)
    if s.dtype == bool:
        if s.shape != (B, V):
            raise ValueError(f"a boolean seen mask must have shape (B, V) = {(B, V)}, got {s.shape}")
        return s
    if s.ndim != 2 or s.shape[0] != B or (s.size and not np.issubdtype(s.dtype, np.integer)):
        raise ValueError(f"seen must be (B, T) = ({B}, T) integer token ids (or a (B, V) bool "
                         f"mask), got shape {s.shape} and dtype {s.dtype}")
    mask = np.zeros((B, V), dtype=bool)
    if s.size:
        if s.min() < 0 or s.max() >= V:
            raise ValueError(f"seen holds token id {s.min() if s.min() < 0 else s.max()}, outside "
                             f"[0, V={V})")
        mask[np.arange(B)[:, None], s] = True
    return mask


def _nan_message(nan: np.ndarray) -> str:
    rows = np.flatnonzero(nan.any(axis=-1))
    counts = nan.sum(axis=-1)
    V = nan.shape[-1]
    listed = "; ".join(f"row {r}: {counts[r]} of {V}" for r in rows[:5])
    more = f"; and {rows.size - 5} more row(s)" if rows.size > 5 else ""
    return (f"the logits hold NaN ({listed}{more}); a model produces NaN logits from non-finite "
            "weights (a damaged or diverged checkpoint) or an overflow in its forward pass; "
            "check the checkpoint's weights")


def _prepare(logits, repetition_penalty, seen_mask, vocab_limit):
    """Steps 0-1 and the non-finite policy on a float64 copy of ``(B, V)`` logits.

    Returns ``(x, certain)``: ``x`` float64 ``(B, V)``; ``certain`` ``None`` or a ``(B,)`` bool
    mask of the rows that had ``+inf`` logits, which ``x`` then holds as ``0`` at those tokens and
    ``-inf`` elsewhere (a uniform choice among them).
    """
    x = np.array(to_numpy(logits), dtype=np.float64)      # a copy: edited in place below
    B, V = x.shape
    nonfinite = not np.isfinite(x).all()                 # one pass; the common case stops here
    if nonfinite:
        nan = np.isnan(x)
        if nan.any():
            raise NonFiniteLogitsError(_nan_message(nan))
    if vocab_limit is not None and vocab_limit < V:
        x[:, vocab_limit:] = -np.inf
    if repetition_penalty is not None and repetition_penalty != 1.0 and seen_mask is not None:
        r = float(repetition_penalty)
        with np.errstate(over="ignore"):
            penalised = np.where(x < 0, x * r, x / r)
        overflow = seen_mask & np.isinf(penalised) & np.isfinite(x)
        if overflow.any():
            row, token = np.argwhere(overflow)[0]
            raise ValueError(f"repetition_penalty={r} overflows float64 on logit {x[row, token]:.3g} "
                             f"(row {row}, token {token}); such logits are not a model's")
        x = np.where(seen_mask, penalised, x)
    certain = None
    if nonfinite:
        posinf = np.isposinf(x)
        rows = posinf.any(axis=-1)
        if rows.any():
            certain = rows
            x[rows] = np.where(posinf[rows], 0.0, -np.inf)
        empty = np.flatnonzero(np.isneginf(x).all(axis=-1))
        if empty.size:
            where = (f" below vocab_limit={vocab_limit}" if vocab_limit is not None and vocab_limit < V
                     else "")
            raise NonFiniteLogitsError(
                f"row {empty[0]} of the logits has no finite logit{where} (all -inf"
                f"{f'; {empty.size} such rows' if empty.size > 1 else ''}): there is no token to pick")
    # all finite: ids below vocab_limit (>= 1) stay finite, and the penalty cannot overflow
    return x, certain


def _divide(x: np.ndarray, temperature: float) -> np.ndarray:
    """``x / temperature``; a row where that overflows a finite logit is shifted by its max first."""
    if temperature == 1.0:
        return x
    with np.errstate(over="ignore"):
        y = x / temperature
    if temperature < 1.0 and not np.isfinite(y).all():
        bad = (np.isinf(y) & np.isfinite(x)).any(axis=-1)
        if bad.any():
            shifted = x[bad] - x[bad].max(axis=-1, keepdims=True)
            with np.errstate(over="ignore"):
                y[bad] = shifted / temperature           # -> -inf = probability 0, exactly the limit
    return y


def _filter(x: np.ndarray, top_k, top_p, min_p=None) -> np.ndarray:
    """Top-k, top-p, then min-p on float64 ``(B, V)`` (already divided by the temperature)."""
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
    if min_p is not None and min_p > 0.0:
        # as HF MinPLogitsWarper: probabilities of what is left, the top one always kept
        probs = _softmax64(x)
        x = np.where(probs >= min_p * probs.max(axis=-1, keepdims=True), x, -np.inf)
    return x


def _warp(x: np.ndarray, certain, temperature, top_k, top_p, min_p) -> np.ndarray:
    """Steps 2-5 (temperature > 0); rows in ``certain`` (+inf rows) are left as they are."""
    y = _filter(_divide(x, float(temperature)), top_k, top_p, min_p)
    if certain is not None:
        y[certain] = x[certain]
    return y


def _draw(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One id per row of float64 logits ``x`` (``−∞`` = impossible; every row has a finite
    maximum), by the inverse CDF."""
    cdf = np.cumsum(_softmax64(x), axis=-1)
    u = rng.random(x.shape[0]) * cdf[:, -1]              # scaled: u < total, so an id is always found
    # first index with cdf > u; that token has probability > 0 (cdf[i] > u >= cdf[i-1])
    return np.sum(cdf <= u[:, None], axis=-1).astype(np.int64)


def sample_unchecked(logits, rng, s: Sampling, seen_mask=None, vocab_limit=None) -> np.ndarray:
    """:func:`sample_next` without validation (a :class:`Sampling` was validated when made);
    ``seen_mask`` is ``None`` or a ``(B, V)`` bool array."""
    x, certain = _prepare(logits, s.repetition_penalty, seen_mask, vocab_limit)
    if s.temperature == 0:
        return x.argmax(axis=-1).astype(np.int64)        # greedy; ties (and +inf ties) -> lowest id
    return _draw(_warp(x, certain, s.temperature, s.top_k, s.top_p, s.min_p), rng)


def _check_penalty_inputs(repetition_penalty, seen) -> None:
    if repetition_penalty is not None and repetition_penalty != 1.0 and seen is None:
        raise ValueError("repetition_penalty needs the tokens seen so far: pass seen=(B, T) ids "
                         "(the prompt and the generated tokens) or a (B, V) bool mask")


def filter_logits(logits, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None, *, min_p: float | None = None,
                  repetition_penalty: float | None = None, seen=None,
                  vocab_limit: int | None = None) -> np.ndarray:
    """The logits a token is drawn from: vocabulary limit, repetition penalty, temperature, top-k,
    top-p and min-p applied in that order (the module docstring); removed tokens get ``−∞``.

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
        min_p: keep the tokens whose probability (after the filters above, renormalised) is at
            least ``min_p`` times the row's largest (tokens tied at the cut all stay: ``1``
            keeps every token tied for the top); ``None`` or ``0``: no min-p filter.
        repetition_penalty: ``r > 0``; the logit ``z`` of each token in ``seen`` becomes ``z / r``
            if ``z > 0``, else ``z * r``. ``None`` or ``1``: no penalty.
        seen: the tokens each row has seen -- ``(B, T)`` integer ids (repeats count once) or a
            ``(B, V)`` bool mask (``(T,)`` / ``(V,)`` for 1-D logits). Needed with a penalty.
        vocab_limit: only ids ``< vocab_limit`` may be chosen (the others get ``−∞`` first);
            for a model whose ``vocab_size`` is larger than its tokenizer's. ``None``: all ids.

    Returns:
        float64 ``(B, V)`` (or ``(V,)``): the penalised logits divided by the temperature, ``−∞``
        where removed (a row whose division would overflow is shifted by its maximum first; a
        row with ``+inf`` logits comes back as ``0`` at those tokens, ``−∞`` elsewhere).

    Raises:
        ValueError / TypeError: as :func:`check_sampling`; ``temperature = 0``; a penalty
            without ``seen``; ``seen`` ids outside ``[0, V)``. NonFiniteLogitsError: NaN
            logits, or a row with no finite logit.

    Source: Hugging Face ``transformers`` ``RepetitionPenaltyLogitsProcessor``,
    ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``,
    in the order of ``GenerationMixin._get_logits_processor``.
    """
    check_sampling(temperature, top_k, top_p, min_p, repetition_penalty, vocab_limit)
    if temperature == 0:
        raise ValueError("filter_logits needs temperature > 0; temperature 0 means greedy (argmax), "
                         "use sample_next")
    _check_penalty_inputs(repetition_penalty, seen)
    x = np.asarray(to_numpy(logits), dtype=np.float64)
    squeeze = x.ndim == 1
    x = np.atleast_2d(x)
    if x.ndim != 2:
        raise ValueError(f"logits must have shape (B, V) or (V,), got {x.shape}")
    if vocab_limit is not None and vocab_limit > x.shape[1]:
        raise ValueError(f"vocab_limit={vocab_limit} is larger than the logits' V={x.shape[1]}")
    mask = None
    if seen is not None:
        s = to_numpy(seen) if is_torch_array(seen) else np.asarray(seen)
        mask = _seen_mask(s[None] if squeeze else s, *x.shape)
    y, certain = _prepare(x, repetition_penalty, mask, vocab_limit)
    y = _warp(y, certain, temperature, top_k, top_p, min_p)
    return y[0] if squeeze else y


def sample_next(logits, rng: np.random.Generator | int | None = None, temperature: float = 1.0,
                top_k: int | None = None, top_p: float | None = None, *,
                min_p: float | None = None, repetition_penalty: float | None = None, seen=None,
                vocab_limit: int | None = None) -> np.ndarray:
    """Draw the next token of each row from ``(B, V)`` logits.

    Args:
        logits: ``(B, V)`` float array (NumPy or torch); all steps run in float64.
        rng: a ``numpy.random.Generator``, or a seed for one (``None``: fresh entropy).
        temperature: ``0`` = greedy (argmax of the penalised logits; ties go to the lowest id;
            ``top_k`` / ``top_p`` / ``min_p`` then change nothing since the argmax is always
            kept); ``> 0`` divides the logits.
        top_k: ``None`` or ``>= 1``; ``top_k >= V`` means no top-k filter.
        top_p: ``None`` or in ``(0, 1]``; ``1`` means no nucleus filter; a tiny ``top_p``
            keeps only the most likely token (= greedy). ``0`` is an error.
        min_p: ``None`` or in ``[0, 1]``: keep tokens with probability ``>= min_p`` times the
            most likely one's, as transformers' ``MinPLogitsWarper`` (``0``: no filter; ``1``:
            the tokens tied with the most likely one, drawn uniformly -- greedy only when it is
            unique, where ``temperature=0`` takes the lowest tied id).
        repetition_penalty: ``None`` or a finite ``r > 0`` (``1``: none); see
            :func:`filter_logits`. Applied in greedy decoding too (as Hugging Face does).
        seen: ``(B, T)`` integer ids each row has seen (prompt and generated tokens) or a
            ``(B, V)`` bool mask; needed with a repetition penalty.
        vocab_limit: only ids ``< vocab_limit`` (``<= V``) are ever returned.

    Returns:
        ``(B,)`` int64 ids. Each has probability > 0 under the filtered distribution.

    Raises:
        ValueError / TypeError: see :func:`check_sampling`; logits that are not 2-D;
            ``vocab_limit > V``; a penalty without ``seen``. NonFiniteLogitsError (a
            ValueError): NaN logits (the message names each row and its NaN count), or a row
            with no finite logit (below ``vocab_limit``). A row with ``+inf`` logits returns
            one of those tokens (see the module docstring).

    Order and source: the module docstring (Hugging Face ``transformers``' logits processors).
    """
    s = Sampling(temperature, top_k, top_p, min_p, repetition_penalty)
    check_vocab_limit(vocab_limit)
    shape = tuple(getattr(logits, "shape", ()))
    if len(shape) != 2:
        raise ValueError(f"logits must have shape (B, V), got {getattr(logits, 'shape', None)}")
    if vocab_limit is not None and vocab_limit > shape[1]:
        raise ValueError(f"vocab_limit={vocab_limit} is larger than the logits' V={shape[1]}")
    _check_penalty_inputs(repetition_penalty, seen)
    if not isinstance(rng, np.random.Generator):
        rng = np.random.default_rng(rng)
    mask = None if seen is None else _seen_mask(seen, *shape)
    return sample_unchecked(logits, rng, s, mask, vocab_limit)

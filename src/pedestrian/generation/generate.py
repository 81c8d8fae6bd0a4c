"""Text generation: the generation loop over the KV cache (paper section 3, side note).

Each step is ``model.forward(new_tokens, kv_cache=cache)``: the same layer forwards as training,
with every block's attention reading and extending the cache (:mod:`pedestrian.model.kv_cache`). A
new token computes only its own ``q, k, v`` and takes one softmax row against the cached keys:
O(current length) work per token instead of the O(length²) of a full forward pass, with the
same logits (tested to 1e-10 relative in float64).

Past the context length -- two rules, chosen by ``past_context``; both slide a window of at most
``context_length`` tokens, dropping the oldest ``window_shift`` whenever appending a token would
make it hold ``context_length + 1``:

- ``"rebuild"`` (the only rule for learned positions, which are absolute: there is no position
  ``context_length``): the cache is rebuilt from scratch over the remaining
  ``context_length + 1 - window_shift`` tokens, which get positions ``0, 1, …`` again. A position
  index is never reused for a different token inside one cache, and no token ever sees a
  position ``>= context_length``. Every token is predicted from exactly the tokens of its
  window, as a full forward over them would (nanoGPT's ``idx[:, -context_length:]``), at the
  price of one O(length²) rebuild every ``window_shift`` tokens past the context.
- ``"keep-cache"`` (the default for ``"rope"`` and ``"none"`` models with a cache): the oldest
  ``window_shift`` entries are dropped from the cache (:meth:`KVCache.drop_oldest`) and the others
  are kept; positions keep counting up (RoPE scores depend only on query-key offsets, ``none``
  on no position at all). Each new token costs O(context) like any cached step: no rebuild ever.
  Every block's query attends to the keys of its window, but a kept key or value is the one its
  token got when it was computed, with the dropped tokens still in its context (blocks after
  the first see further back than the window: Mistral's rolling-buffer cache). So the logits
  equal those of one full forward over the *whole* sequence with a causal sliding-window mask
  (query ``n`` sees keys ``start_n … n``) -- tested to 1e-10 in float64 against the PyTorch
  reference -- and differ from a recompute of the window alone.

``use_cache=False`` recomputes the window at every step, i.e. the ``"rebuild"`` rule.

Sampling (temperature, top-k, top-p, greedy) lives in :mod:`pedestrian.generation.sampling`.

Public API::

    cache = KVCache(model, batch_size)
    logits = model_step(model, cache, tokens_new)          # (B, V): logits of the last new token
    ids = sample_next(logits, rng, temperature, top_k, top_p)
    out = generate(model, prompt_ids, max_new_tokens, Sampling(temperature=0.8, top_k=40, seed=0),
                   use_cache=True, on_token=None, window_shift=1, past_context=None)
"""

from __future__ import annotations

import numbers
import warnings
from typing import Callable

import numpy as np

from ..backend import is_torch_array, to_numpy
from ..model import eval_mode
from ..model.kv_cache import KVCache
from .sampling import Sampling, check_sampling, check_vocab_limit, filter_logits, sample_next, sample_unchecked  # noqa: F401

#: what generation does past the context length (module docstring)
PAST_CONTEXT_RULES = ("rebuild", "keep-cache")

__all__ = [
    "KVCache",
    "PAST_CONTEXT_RULES",
    "Sampling",
    "model_step",
    "sample_next",
    "filter_logits",
    "check_sampling",
    "generate",
]


# --------------------------------------------------------------------------------------------
# One step against the cache
# --------------------------------------------------------------------------------------------


def model_step(model, cache: KVCache, tokens_new, *, all_logits: bool = False):
    """Feed new tokens through the model against the cache; append their keys and values.

    Used both for the prompt (``T`` tokens at once, "prefill") and for each generated token
    (``T = 1``). Position ``t`` of ``tokens_new`` gets position index ``cache.length + t``.

    Args:
        model: the :class:`~pedestrian.model.GPT` the cache was made for.
        cache: a :class:`KVCache`; its ``length`` grows by ``T``.
        tokens_new: ``(B, T)`` integer ids (NumPy, list, or a torch tensor on the torch
            backend), ``B = cache.batch_size``, ``cache.length + T <= context_length``.
        all_logits: return the logits of every new token, not only of the last.

    Returns:
        logits in the model's dtype and backend: ``(B, vocab_size)`` of the last new token, or
        ``(B, T, vocab_size)`` with ``all_logits``. They equal ``model.forward(prefix)[:, -1]``
        (resp. the last ``T`` rows) for the prefix of every token cached so far.

    Raises:
        TypeError: non-integer ids.
        ValueError: the cache belongs to another model; wrong shape or batch size; ids outside
            ``[0, vocab_size)``; the cache would overflow the context (slide the window: reset
            the cache and feed the last tokens again, or -- RoPE and ``none`` --
            ``cache.drop_oldest(n)``, as :func:`generate` does).
    """
    if cache.model is not model:
        raise ValueError("this KVCache was made for a different model; make one with KVCache(model, B)")
    tokens = np.asarray(to_numpy(tokens_new) if is_torch_array(tokens_new) else tokens_new)
    if tokens.ndim != 2 or tokens.shape[1] == 0:
        raise ValueError(f"tokens_new must have shape (B, T) with T >= 1, got {tokens.shape}; "
                         "add a batch axis with tokens[None, :]")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got dtype {tokens.dtype}")
    if tokens.shape[0] != cache.batch_size:
        raise ValueError(f"tokens_new has batch size {tokens.shape[0]} but the cache was made for "
                         f"{cache.batch_size}")
    V = model.config.vocab_size
    if tokens.min() < 0 or tokens.max() >= V:
        raise ValueError(f"token ids must be in [0, vocab_size={V}), got min {tokens.min()}, "
                         f"max {tokens.max()}; the tokenizer and the model do not match")
    if cache.length + tokens.shape[1] > cache.context_length:
        fix = (f"learned positions are absolute, there is no position {cache.context_length}: reset "
               f"the cache and feed at most the last {cache.context_length} tokens"
               if model.config.learned_positions else "drop the oldest with cache.drop_oldest(n) first")
        raise ValueError(
            f"the cache holds {cache.length} tokens and {tokens.shape[1]} more would exceed "
            f"context_length={cache.context_length}; {fix} (generate() slides the window for you)")
    logits = model.forward(tokens.astype(np.int64), kv_cache=cache)
    return logits if all_logits else logits[:, -1, :]


# --------------------------------------------------------------------------------------------
# The generation loop
# --------------------------------------------------------------------------------------------


def _ragged(prompt_ids) -> list | None:
    """The rows of a list of prompts of different lengths (``None``: not such a list)."""
    if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
        return None
    rows = [np.asarray(to_numpy(p) if is_torch_array(p) else p) for p in prompt_ids]
    if any(r.ndim != 1 for r in rows) or len({r.shape[0] for r in rows}) == 1:
        return None
    return rows


def _left_pad(rows: list, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(B, T0)`` prompts right-aligned (padding id 0 on the left) and each row's padding."""
    for r in rows:
        _check_prompt(r, vocab_size)
    T0 = max(r.shape[0] for r in rows)
    padding = np.array([T0 - r.shape[0] for r in rows], dtype=np.int64)
    prompt = np.zeros((len(rows), T0), dtype=np.int64)
    for b, r in enumerate(rows):
        prompt[b, padding[b]:] = r
    return prompt, padding


def _check_prompt(prompt_ids, vocab_size: int) -> np.ndarray:
    prompt = np.asarray(to_numpy(prompt_ids) if is_torch_array(prompt_ids) else prompt_ids)
    if prompt.ndim == 1:
        prompt = prompt[None, :]
    if prompt.ndim != 2:
        raise ValueError(f"prompt_ids must have shape (B, T0) or (T0,), got {prompt.shape}")
    if prompt.shape[0] == 0:
        raise ValueError("prompt_ids holds no sequence (batch size 0)")
    if prompt.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token to condition on (GPT-2 "
                         "models start from <|endoftext|>; a char model from e.g. a newline)")
    if prompt.dtype == object or not np.issubdtype(prompt.dtype, np.integer):
        raise TypeError(f"prompt ids must be integers, got dtype {prompt.dtype}; encode text with "
                        "the tokenizer first")
    if prompt.min() < 0 or prompt.max() >= vocab_size:
        bad = prompt.min() if prompt.min() < 0 else prompt.max()
        raise ValueError(f"prompt holds token id {bad}, outside [0, vocab_size={vocab_size}); the "
                         "tokenizer and the model do not match")
    return prompt.astype(np.int64)


def _stop_set(stop_ids: tuple, vocab_size: int) -> np.ndarray | None:
    if not stop_ids:
        return None
    if min(stop_ids) < 0 or max(stop_ids) >= vocab_size:
        raise ValueError(f"stop_tokens must be token ids in [0, vocab_size={vocab_size}), got {list(stop_ids)}")
    return np.asarray(stop_ids, dtype=np.int64)


#: the keywords ``generate`` took before a :class:`Sampling` held them (issue 46): still read, with a warning
_LOOSE = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "seed": "seed", "stop_tokens": "stop_ids"}


def loose_sampling(sampling: Sampling | None, loose: dict, where: str) -> Sampling:
    """``sampling``, or the :class:`Sampling` of the old loose keywords ``loose`` (a
    ``DeprecationWarning``); ``TypeError`` for an unknown keyword or both ways at once."""
    if sampling is not None and not isinstance(sampling, Sampling):
        raise TypeError(f"{where}(): the sampling settings are one Sampling(temperature=..., ...), got {sampling!r}")
    unknown = sorted(set(loose) - set(_LOOSE))
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")
    if not loose:
        return Sampling() if sampling is None else sampling
    if sampling is not None:
        raise TypeError(f"{where}(): pass the sampling settings either as a Sampling or as keywords, not both")
    warnings.warn(f"{where}(temperature=..., top_k=..., ...) is deprecated: pass one "
                  f"pedestrian.generation.Sampling(...)", DeprecationWarning, stacklevel=3)
    given = {_LOOSE[k]: v for k, v in loose.items()}
    if given.get("stop_ids") is None:
        given.pop("stop_ids", None)
    return Sampling(**given)


def generate(model, prompt_ids, max_new_tokens: int, sampling: Sampling | None = None, *,
             use_cache: bool = True, on_token: Callable[[np.ndarray], object] | None = None,
             window_shift: int = 1, past_context: str | None = None, vocab_limit: int | None = None,
             return_logits: bool = False, **loose):
    """Autoregressive generation for ``B`` prompts.

    Args:
        model: a :class:`~pedestrian.model.GPT` (any dtype/backend, with or without unmerged
            LoRA adapters). Dropout is never applied during generation.
        prompt_ids: ``(B, T0)`` (or ``(T0,)``) integer ids, ``T0 >= 1``; or a list of ``B``
            1-D prompts of different lengths, generated together: they are left-padded, the
            padding is never attended to and each row's positions count from its own first
            token, so every row gets the tokens and logits it would get alone (to rounding).
            An empty prompt is an
            error (there is nothing to condition on; start GPT-2 from ``<|endoftext|>``).
            A prompt longer than ``context_length`` is conditioned on its last
            ``context_length`` tokens only, with a ``UserWarning``; the returned array still
            starts with the whole prompt.
        max_new_tokens: ``>= 0`` tokens to generate per row.
        sampling: a :class:`~pedestrian.generation.sampling.Sampling` (default ``Sampling()``:
            temperature 1, no filter, fresh entropy): temperature, top-k, top-p, min-p in Hugging
            Face's order (:mod:`pedestrian.generation.sampling`; ``temperature=0``: greedy); the
            repetition penalty ``r`` -- each row's seen tokens, its whole prompt (also the part
            beyond the context) and every token generated so far, each counted once, have a
            positive logit divided by ``r``, a negative one multiplied by it (HF
            ``repetition_penalty``; in greedy decoding too); the seed (the same seed gives the
            same tokens); ``stop_ids``: a row that emits one is finished (the stop token is kept
            in the output, and the row is padded with it afterwards); generation ends early when
            every row is finished.
        vocab_limit: ``None`` or ``1 <= n <= vocab_size``: only ids ``< n`` are ever generated
            (the others are masked to ``-inf`` before any penalty or filter) -- pass the
            tokenizer's size for a model whose vocabulary is padded (GPT-2's 50,304).
        use_cache: ``True``: KV cache (:func:`model_step`); ``False``: a full
            ``model.forward`` over the window at every step (the reference: the same tokens as
            the cache with the ``"rebuild"`` rule, which past the context is not the default of
            RoPE and ``none`` models).
        on_token: called after each step with the ``(B,)`` int64 ids just chosen (streaming;
            finished rows show their padding). It may return ``None`` or a ``(B,)`` bool
            array-like: ``True`` marks a row as finished (e.g. its text now holds a stop
            string), which is then treated like a row that emitted a stop token -- padded with
            the token that finished it -- and generation ends once every row is finished.
        window_shift: past the context, how many of the oldest tokens to drop when the window
            overflows (``1 <= window_shift <= context_length``; see the module docstring).
        past_context: ``"rebuild"`` or ``"keep-cache"`` (module docstring); ``None`` (default):
            ``"keep-cache"`` for a ``"rope"`` or ``"none"`` model with ``use_cache``, else
            ``"rebuild"``.
        return_logits: also return the float64 logits each token was drawn from.
        loose: the keywords of earlier versions (``temperature=``, ``top_k=``, ``top_p=``,
            ``min_p=``, ``repetition_penalty=``, ``seed=``, ``stop_tokens=``), deprecated: they
            make the ``Sampling``, with a ``DeprecationWarning``.

    Returns:
        ``(B, T0 + n)`` int64 NumPy array (``(T0 + n,)`` for a 1-D prompt; for prompts of
        different lengths a list of ``B`` 1-D arrays, each its own prompt and ``n`` new tokens),
        ``n <= max_new_tokens``
        (smaller only when every row stopped); with ``return_logits`` a tuple
        ``(tokens, logits)`` with ``logits`` ``(n, B, V)`` float64.

    Raises:
        ValueError / TypeError: empty or non-integer prompt, ids outside the vocabulary,
            ``max_new_tokens < 0``, a stop id outside the vocabulary, bad ``window_shift``, ``vocab_limit > vocab_size``, a non-causal model with
            ``use_cache=True``, an ``on_token`` result that is not ``(B,)``, ``past_context``
            not one of the two rules, ``"keep-cache"`` with learned positions or without a cache.
            NonFiniteLogitsError (a ValueError): the model produced NaN logits.
    """
    sampling = loose_sampling(sampling, loose, "generate")
    c = model.config
    C, V = c.context_length, c.vocab_size
    ragged = _ragged(prompt_ids)
    if ragged is None:
        squeeze = np.ndim(to_numpy(prompt_ids) if is_torch_array(prompt_ids) else prompt_ids) == 1
        prompt = _check_prompt(prompt_ids, V)
        padding = np.zeros(prompt.shape[0], dtype=np.int64)
    else:
        squeeze = False
        prompt, padding = _left_pad(ragged, V)
    if not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    check_vocab_limit(vocab_limit)
    if vocab_limit is not None and vocab_limit > V:
        raise ValueError(f"vocab_limit={vocab_limit} is larger than the model's vocab_size={V}")
    if not isinstance(window_shift, numbers.Integral) or not 1 <= window_shift <= C:
        raise ValueError(f"window_shift must be an integer in [1, context_length={C}], got {window_shift!r}")
    if past_context is None:
        past_context = "rebuild" if c.learned_positions or not use_cache else "keep-cache"
    if past_context not in PAST_CONTEXT_RULES:
        raise ValueError(f"past_context must be one of {PAST_CONTEXT_RULES}, got {past_context!r}")
    keep_cache = past_context == "keep-cache"
    if keep_cache and c.learned_positions:
        raise ValueError("past_context='keep-cache' needs relative or no positions (position_encoding "
                         "'rope' or 'none'); learned positions are absolute: use 'rebuild'")
    if keep_cache and not use_cache:
        raise ValueError("past_context='keep-cache' needs use_cache=True (without a cache every step "
                         "recomputes the window: that is 'rebuild')")
    stops = _stop_set(sampling.stop_ids, V)
    rng = sampling.rng()
    B, T0 = prompt.shape
    if T0 - padding.min() > C:
        warnings.warn(f"the prompt has {T0 - padding.min()} tokens but the model's context_length is {C}: only the "
                      f"last {C} tokens are used to condition the generation", UserWarning, stacklevel=2)
    seq = np.empty((B, T0 + max_new_tokens), dtype=np.int64)
    seq[:, :T0] = prompt
    n, start = T0, max(0, T0 - C)                      # seq[:, start:n] is the window
    finished = np.zeros(B, dtype=bool)
    pad = np.zeros(B, dtype=np.int64)
    kept_logits = []
    rows = np.arange(B)
    seen = None                                        # (B, V): the tokens each row has seen
    if sampling.penalised:
        seen = np.zeros((B, V), dtype=bool)
        seen[rows[:, None], prompt] = True
        for b in np.flatnonzero(padding):              # the padding id is no token of the row
            seen[b] = False
            seen[b, prompt[b, padding[b]:]] = True

    if use_cache:
        cache = KVCache(model, B)

        def window_logits(rebuild: bool):
            if rebuild:                                # the whole window, from an empty cache
                cache.reset(key_start=np.maximum(padding - start, 0))
                return model.forward(seq[:, start:n], kv_cache=cache, keep_activations=False)[:, -1, :]
            return model.forward(seq[:, n - 1:n], kv_cache=cache, keep_activations=False)[:, -1, :]
    elif not padding.any():
        def window_logits(rebuild: bool):
            return model.forward(seq[:, start:n])[:, -1, :]
    else:                                              # the reference: each row alone
        def window_logits(rebuild: bool):
            return model.xp.concat([model.forward(seq[b:b + 1, max(start, int(padding[b])):n])[:, -1, :]
                                    for b in range(B)], axis=0)

    with model.inference():                            # eval mode, in this thread only
        logits = window_logits(True) if max_new_tokens > 0 else None
        for step in range(max_new_tokens):
            if return_logits:
                kept_logits.append(np.asarray(to_numpy(logits), dtype=np.float64))
            ids = sample_unchecked(logits, rng, sampling, seen, vocab_limit)
            ids = np.where(finished, pad, ids)
            if stops is not None:
                newly = ~finished & np.isin(ids, stops)
                pad = np.where(newly, ids, pad)
                finished |= newly
            seq[:, n] = ids
            n += 1
            if seen is not None:
                seen[rows, ids] = True
            if on_token is not None:
                done = on_token(ids)
                if done is not None:                   # rows the caller ended (e.g. a stop string)
                    done = np.asarray(done, dtype=bool)
                    if done.shape != (B,):
                        raise ValueError(f"on_token must return None or a (B,) = ({B},) bool array "
                                         f"of finished rows, got shape {done.shape}")
                    newly = done & ~finished
                    pad = np.where(newly, ids, pad)
                    finished |= newly
            if step == max_new_tokens - 1 or finished.all():
                break
            slide = n - start > C
            if slide:
                start += window_shift
                if keep_cache:                         # relative positions: the kept keys stay valid
                    cache.drop_oldest(window_shift)
            logits = window_logits(slide and not keep_cache)
    out = seq[:, :n]
    if ragged is not None:
        out = [out[b, padding[b]:] for b in range(B)]
    else:
        out = out[0] if squeeze else out
    if return_logits:
        return out, (np.stack(kept_logits) if kept_logits else np.zeros((0, B, V)))
    return out

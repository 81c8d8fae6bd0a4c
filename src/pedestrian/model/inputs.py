"""What a :class:`~pedestrian.model.GPT` checks before it computes: token and target batches,
an upstream error signal, a KV cache's room, and loaded weights (finite in the model's dtype).

Every check raises with a message that names the fix; none of them changes anything. Inside
:func:`~pedestrian.model.device_checks.deferred_checks` (a training step on a device) the id checks of
torch tensors read nothing: their verdict is a flag on the device, raised as the same error when
the step reads its flags, and the ids are returned with every bad one replaced by a valid one, so
that no kernel reads outside a table before the error is raised (on a GPU an index out of
range is a device-side assert that ends the process).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..backend import array_namespace, is_torch_array, to_numpy
from ..layers.loss import IGNORE_INDEX
from .device_checks import deferring
from .finite import non_finite_counts, non_finite_report

__all__ = ["check_tokens", "check_targets", "check_cache", "check_finite_state", "as_tokens", "as_signal"]


def check_finite_state(state: Mapping[str, object], dtype: str) -> dict[str, np.ndarray]:
    """``state``'s arrays as NumPy arrays of ``dtype``, after checking that every value is finite.

    Args:
        state: name -> array (NumPy, torch or nested lists).
        dtype: ``"float32"`` or ``"float64"``: the values must be finite *in it* (1e39 is a
            finite float64 but ``inf`` as float32).

    Returns:
        name -> ``np.ndarray`` of ``dtype``.

    Raises:
        ValueError: names every tensor holding a NaN or ±inf with its counts, e.g.
            ``blocks.0.ln1.weight (1 NaN, 0 inf of 768 values)`` -- a NaN weight makes every
            logit NaN, so no loader lets one in (issue 13: no silent numbers).
    """
    out = {}
    for k, v in state.items():
        with np.errstate(over="ignore", invalid="ignore"):
            out[k] = np.asarray(to_numpy(v)).astype(dtype, copy=False)
    bad = non_finite_counts(out)
    if bad:
        raise ValueError(f"parameters hold non-finite values as {dtype}: {non_finite_report(bad, out, None)}; "
                         "nothing was loaded (a NaN or infinite weight makes the logits NaN)")
    return out


def check_tokens(tokens, vocab_size: int, context_length: int, what: str = "token ids"):
    """Validate a ``(B, T)`` integer token batch; returns the ids to compute with: ``tokens``
    itself, or inside :func:`~pedestrian.model.device_checks.deferred_checks` a torch tensor's ids with
    each one out of range replaced by 0 (its error raised when the flags are read).

    Raises:
        TypeError: not an integer array.
        ValueError: not 2-D, empty, ``T > context_length``, or an id outside ``[0, vocab_size)``.
    """
    integral = (tokens.dtype.kind in "iu" if type(tokens) is np.ndarray
                else array_namespace(tokens).isdtype(tokens.dtype, "integral"))
    if not integral:
        raise TypeError(
            f"{what} must be an integer array, got dtype {tokens.dtype}; "
            "encode text with the tokenizer first (e.g. np.asarray(ids, dtype=np.int64))"
        )
    if tokens.ndim != 2:
        raise ValueError(f"{what} must have shape (B, T), got shape {tuple(tokens.shape)}; "
                         "add a batch axis with tokens[None, :]")
    B, T = tokens.shape
    if B == 0 or T == 0:
        raise ValueError(f"{what} must not be empty, got shape {(B, T)}")
    if T > context_length:
        raise ValueError(
            f"sequence length T={T} exceeds the model's context_length={context_length}; "
            f"feed at most the last {context_length} tokens"
        )
    flags = None if type(tokens) is np.ndarray else deferring()
    if flags is not None:                                        # a flag on the device, no read
        bad = (tokens < 0) | (tokens >= vocab_size)
        flags.add(bad.any(), lambda: check_tokens(tokens, vocab_size, context_length, what))
        return array_namespace(tokens).where(bad, 0, tokens)
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"{what} contain {bad}, outside [0, vocab_size={vocab_size}); "
            "the tokenizer and the model config do not match"
        )
    return tokens


def check_targets(xp, targets, tokens, vocab_size: int):
    """Validate ``(B, T)`` targets for ``tokens``: integers in ``[0, vocab_size)`` or the ignore
    index; returns the targets to compute with (as :func:`check_tokens`: inside
    :func:`~pedestrian.model.device_checks.deferred_checks` a torch tensor's bad targets become the
    ignore index, their error raised when the flags are read).

    Raises:
        TypeError: not integers.  ValueError: another shape, or an id out of range.
    """
    if not xp.isdtype(targets.dtype, "integral"):
        raise TypeError(f"targets must be an integer array, got dtype {targets.dtype}")
    if tuple(targets.shape) != tuple(tokens.shape):
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal tokens shape "
                         f"{tuple(tokens.shape)} (position t predicts token t+1)")
    bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab_size))
    flags = None if type(targets) is np.ndarray else deferring()
    if flags is not None:                                        # a flag on the device, no read
        flags.add(xp.any(bad), lambda: check_targets(xp, targets, tokens, vocab_size))
        return xp.where(bad, IGNORE_INDEX, targets)
    if bool(xp.any(bad)):
        value = int(targets[bad][0])
        raise ValueError(f"target id {value} is outside [0, vocab_size={vocab_size}) "
                         f"and is not the ignore index {IGNORE_INDEX}")
    return targets


def check_cache(model, kv_cache, tokens) -> None:
    """Whether ``kv_cache`` belongs to ``model`` and has room for ``tokens`` ``(B, T)``.

    Raises:
        ValueError: a cache made for another model or batch size; more tokens than the
            context has room for; positions beyond a learned table.
    """
    c = model.config
    if kv_cache.model is not model:
        raise ValueError("this KVCache was made for a different model; make one with KVCache(model, B)")
    if tokens.ndim != 2:
        return                                          # check_tokens says what is wrong
    if tokens.shape[0] != kv_cache.batch_size:
        raise ValueError(f"tokens have batch size {tokens.shape[0]} but the cache was made for "
                         f"{kv_cache.batch_size}")
    room = c.context_length - kv_cache.length
    if tokens.shape[1] > room:
        raise ValueError(
            f"the cache holds {kv_cache.length} tokens and {tokens.shape[1]} more would exceed "
            f"context_length={c.context_length}; " + (
                f"learned positions are absolute, there is no position {c.context_length}: "
                f"reset the cache and feed at most the last {c.context_length} tokens"
                if c.learned_positions else
                "drop the oldest with cache.drop_oldest(n) first")
            + " (generate() does this for you)")
    if c.learned_positions and kv_cache.offset + kv_cache.length + tokens.shape[1] > c.context_length:
        raise ValueError(f"positions up to {kv_cache.offset + kv_cache.length + tokens.shape[1] - 1} "
                         f"do not exist in the learned table of context_length={c.context_length} "
                         "rows; reset the cache with first_position=0")


def as_tokens(model, tokens, what: str):
    """``tokens`` (a list, NumPy array or tensor) as an array of the model's backend and device.

    Raises:
        TypeError: not integers, or a type no array namespace takes.
    """
    if isinstance(tokens, (list, tuple)):
        tokens = np.asarray(tokens)
    if model.backend == "torch" and isinstance(tokens, np.ndarray):
        import torch

        if not np.issubdtype(tokens.dtype, np.integer):
            raise TypeError(f"{what} must be an integer array, got dtype {tokens.dtype}")
        tokens = torch.as_tensor(tokens.astype(np.int64, copy=False), device=model.device)
    elif model.backend == "torch" and model.device is not None and is_torch_array(tokens):
        tokens = tokens.to(model.device)
    if type(tokens) is np.ndarray and model.backend == "numpy":
        return tokens
    array_namespace(tokens)  # raises TypeError for unsupported types
    return tokens if model.backend == "torch" else model.xp.asarray(tokens)


def as_signal(model, delta, shape):
    """An upstream error signal as an array of the model's backend and dtype.

    Raises:
        ValueError: not of ``shape`` (the logits').
    """
    if tuple(np.shape(delta)) != tuple(shape):
        raise ValueError(f"delta_logits must have the logits' shape {tuple(shape)}, got "
                         f"{tuple(np.shape(delta))}")
    return model.to_xp(to_numpy(delta))


def segment_positions(model, segments, tokens, kv_cache):
    """``(segments, positions)`` of a packed window, as arrays of the model's backend and device:
    ``segments`` ``(B, T)`` the ids as given (int64), ``positions`` ``(B, T)`` each token's index
    less the index where its segment starts (RoPE and a learned table count from 0 in every
    segment). Read on the host (one transfer of ``(B, T)`` ids for a tensor on a device).

    Raises:
        ValueError: ``segments`` with a ``kv_cache``, not ``(B, T)`` integers like ``tokens``, or
            decreasing along a row.
    """
    if kv_cache is not None:
        raise ValueError("segments (packed sequences) cannot be used with a KV cache: generate one "
                         "sequence per row (segments=None)")
    seg = to_numpy(segments) if is_torch_array(segments) else np.asarray(segments)
    if seg.dtype.kind not in "iu" or tuple(seg.shape) != tuple(tokens.shape):
        raise ValueError(f"segments must be integers shaped like the tokens {tuple(tokens.shape)} (one "
                         f"segment id per token), got {seg.dtype} {tuple(seg.shape)}")
    seg = seg.astype(np.int64)
    if seg.shape[1] > 1 and np.any(seg[:, 1:] < seg[:, :-1]):
        raise ValueError("segments must be nondecreasing along each row (one id per packed sequence, "
                         "in order); renumber them")
    B, T = seg.shape
    t = np.broadcast_to(np.arange(T, dtype=np.int64), (B, T))
    change = np.ones((B, T), bool)
    change[:, 1:] = seg[:, 1:] != seg[:, :-1]
    positions = t - np.maximum.accumulate(np.where(change, t, 0), axis=1)      # index − its segment's start
    if model.backend != "torch" or model.numpy_chain:                       # (a torch-CPU model's chain: NumPy)
        return seg, positions
    import torch

    return torch.as_tensor(seg, device=model.device), torch.as_tensor(positions, device=model.device)

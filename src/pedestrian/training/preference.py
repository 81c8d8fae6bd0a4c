"""Preference pairs for DPO (``pedestrian finetune --dpo pairs.jsonl``): the records, their tokens
as TRL's ``DPOTrainer`` (1.16) makes them, and batches of pairs (:mod:`pedestrian.training.dpo`).

A JSONL file, one record a line, in either of TRL's two forms::

    {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Lyon."}
    {"prompt": [{"role": "user", "content": "Capital of France?"}],
     "chosen": [{"role": "assistant", "content": "Paris."}],
     "rejected": [{"role": "assistant", "content": "Lyon."}]}

Tokens, as TRL makes them:

- plain text: the end-of-sequence token's text is appended to each answer (unless it ends with
  it); ``prompt``, ``prompt + chosen`` and ``prompt + rejected`` are encoded as one string each,
  with the tokenizer's post-processor (a Llama tokenizer's BOS);
- messages: ``prompt`` rendered with the folder's chat template and the generation prompt, and
  ``prompt + chosen``, ``prompt + rejected`` rendered whole (:mod:`pedestrian.text.chat`);
- the answer starts where the prompt's tokens and each whole sequence's first differ (their
  common prefix: a template may render the prompt alone differently, and tokens may merge
  across the boundary), the same prompt length for both answers.

Length: each sequence keeps its first ``T + 1`` tokens (TRL's ``truncation_mode="keep_start"``
with ``max_length = T + 1``, so that the model sees ``T`` positions); a pair whose prompt alone
fills that is left out (as TRL drops it), counted in :attr:`Pairs.dropped`.

A batch of ``P`` pairs is ``2P`` rows, the chosen sequences then the rejected ones:
``tokens[b] = seq[:-1]``, ``targets[b, t] = seq[t + 1]`` on answer tokens and ``-100`` on the
prompt and the padding (:func:`pair_batch`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from ..layers.loss import IGNORE_INDEX
from ..text.jsonl import json_lines

__all__ = ["Pair", "Pairs", "common_prefix_length", "encode_record", "pair_batch", "read_pairs"]


class Pair(NamedTuple):
    """One record's token ids: ``prompt``, and the answers ``chosen`` and ``rejected``."""

    prompt: tuple
    chosen: tuple
    rejected: tuple


class Pairs(NamedTuple):
    """What :func:`read_pairs` read: the ``pairs`` kept, how many were ``dropped`` (a prompt that
    fills the window), and the file's form, ``"text"`` or ``"messages"``."""

    pairs: list
    dropped: int
    form: str


def common_prefix_length(a, b) -> int:
    """Leading ids ``a`` and ``b`` have in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def encode_record(record, tokenizer, *, eos_token: str | None, render: Callable | None = None,
                  where: str = "the record") -> Pair:
    """A record's :class:`Pair` (module docstring).

    Args:
        record: a dict with ``prompt``, ``chosen``, ``rejected``: three strings, or three lists of
            messages (``{"role", "content"}``).
        tokenizer: the base's tokenizer (``encode(text, add_special_tokens=True)``).
        eos_token: the end-of-sequence token's text, appended to plain-text answers (``None``: none).
        render: ``render(messages, add_generation_prompt) -> ids`` with the folder's chat
            template (needed for messages only).
        where: how to name the record in messages (``"pairs.jsonl line 3"``).

    Raises:
        ValueError: a missing or mistyped field, a form mixing strings and messages, messages
            without ``render``, an empty answer.
    """
    if not isinstance(record, dict) or any(k not in record for k in ("prompt", "chosen", "rejected")):
        raise ValueError(f"{where}: a preference record needs the fields prompt, chosen and rejected "
                         '({"prompt": ..., "chosen": ..., "rejected": ...})')
    fields = [record["prompt"], record["chosen"], record["rejected"]]
    if all(isinstance(v, str) for v in fields):
        prompt, chosen, rejected = fields
        if eos_token:
            chosen, rejected = (a if a.endswith(eos_token) else a + eos_token for a in (chosen, rejected))
        ids = [tokenizer.encode(prompt, add_special_tokens=True)] + [
            tokenizer.encode(prompt + a, add_special_tokens=True) for a in (chosen, rejected)]
    elif all(_is_messages(v) for v in fields):
        if render is None:
            raise ValueError(f"{where}: records of messages are rendered with the folder's chat template, and "
                             "this folder has none (tokenizer_config.json's chat_template); write the records "
                             "as plain text (prompt, chosen, rejected strings)")
        ids = [render(fields[0], True), render(fields[0] + fields[1], False), render(fields[0] + fields[2], False)]
    else:
        raise ValueError(f"{where}: prompt, chosen and rejected must be three strings or three lists of messages "
                         '({"role": ..., "content": ...}), not a mix')
    p = min(common_prefix_length(ids[0], ids[1]), common_prefix_length(ids[0], ids[2]))
    pair = Pair(tuple(ids[1][:p]), tuple(ids[1][p:]), tuple(ids[2][p:]))
    if not pair.chosen or not pair.rejected:
        raise ValueError(f"{where}: an answer adds no token to the prompt; give chosen and rejected answers")
    return pair


def read_pairs(path, tokenizer, window: int, *, eos_token: str | None, render: Callable | None = None) -> Pairs:
    """Every record of a JSONL file of preference pairs, as :class:`Pair` s that fit ``window``.

    Args:
        path: the JSONL file (UTF-8; blank lines skipped).
        tokenizer, eos_token, render: as :func:`encode_record`.
        window: the model's positions ``T`` of a training window (a sequence keeps ``T + 1`` tokens).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not JSON or not a record (named by its number), a file
            mixing the two forms, no pair left.
    """
    p = Path(path).expanduser()
    pairs, dropped, forms = [], 0, set()
    for _, where, record in json_lines(p, missing=f"preference pairs not found: {p} is not a file (a JSONL file of "
                                       '{"prompt": ..., "chosen": ..., "rejected": ...} records)',
                                       holds='one pair: {"prompt": ..., "chosen": ..., "rejected": ...}'):
        pair = encode_record(record, tokenizer, eos_token=eos_token, render=render, where=where)
        forms.add("text" if isinstance(record["prompt"], str) else "messages")
        if len(forms) > 1:
            raise ValueError(f"{where}: the file mixes plain-text records and records of messages; use one form")
        if len(pair.prompt) >= window + 1:
            dropped += 1
            continue
        pairs.append(pair)
    if not pairs:
        raise ValueError(f"{p} holds no preference pair to train on" + (
            f" ({dropped} left out: their prompt alone fills the window of {window} tokens; raise "
            "--context-length)" if dropped else ""))
    return Pairs(pairs, dropped, forms.pop())


def pair_batch(pairs, window: int, pad_id: int = 0):
    """``(tokens, targets)`` ``(2P, W)`` of ``P`` pairs: the chosen rows, then the rejected ones
    (module docstring); ``W <= window`` is the longest kept sequence less one; padding ids are
    ``pad_id`` with ignored targets."""
    seqs = [(p.prompt + p.chosen)[:window + 1] for p in pairs] + [(p.prompt + p.rejected)[:window + 1] for p in pairs]
    starts = [len(p.prompt) for p in pairs] * 2
    W = max(len(s) for s in seqs) - 1
    tokens = np.full((len(seqs), W), pad_id, dtype=np.int64)
    targets = np.full((len(seqs), W), IGNORE_INDEX, dtype=np.int64)
    for b, (s, start) in enumerate(zip(seqs, starts)):
        s = np.asarray(s, dtype=np.int64)
        tokens[b, :len(s) - 1] = s[:-1]
        first = max(start, 1)                                         # (no prompt: the first id is not predicted)
        targets[b, first - 1:len(s) - 1] = s[first:]                  # answer tokens: seq[t + 1], t ≥ start − 1
    return tokens, targets


def pairs_fingerprint(pairs) -> str:
    """SHA-256 of the pairs' token ids (a resumed run must read the same pairs)."""
    h = hashlib.sha256()
    for p in pairs:
        h.update(json.dumps([p.prompt, p.chosen, p.rejected]).encode())
    return h.hexdigest()

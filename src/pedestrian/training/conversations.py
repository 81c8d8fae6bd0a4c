"""``pedestrian finetune --data chat.jsonl``: a conversations file as the run's training and
validation rows (:mod:`pedestrian.text.chat`: the base folder's chat template, the loss on the
assistant's tokens, the truncation rule, what is left out and why).

One conversation a row, or several packed in a row (``--pack``: first fit in file order, each
attending only to itself with its positions from 0, ``GPT.loss(..., segments=)``). The last
``round(n · val_fraction)`` conversations (at least one) are the validation rows, the
others the training rows; a conversation left out (the template refuses it, or no assistant
token is within the window) is said on the ``pedestrian.finetune`` logger, one line each.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np

__all__ = ["is_conversations", "conversation_rows", "split_conversations", "evaluate_conversations"]

log = logging.getLogger("pedestrian.finetune")


def is_conversations(data) -> bool:
    """Whether ``--data`` names a conversations file (a ``.jsonl`` file) rather than text."""
    return data is not None and Path(data).suffix.lower() == ".jsonl"


def pad_id(tokenizer, hf_dir) -> int:
    """The id padded rows hold as input (never a target): the folder's ``pad_token``, else its
    ``eos_token``, else 0 -- any id would do, causal attention never lets it reach a counted position."""
    from ..interop.hf_chat import special_tokens_map

    special = special_tokens_map(hf_dir)
    ids = getattr(tokenizer, "special_tokens", {})
    return next((ids[special[k]] for k in ("pad_token", "eos_token") if special.get(k) in ids), 0)


def split_conversations(conversations: list, val_fraction: float) -> tuple[list, list]:
    """``(train, validation)``: the last ``round(n · val_fraction)`` conversations (at least one,
    at most ``n - 1``) are the validation part.

    Raises:
        ValueError: fewer than 2 conversations.
    """
    n = len(conversations)
    if n < 2:
        raise ValueError(f"the file holds {n} conversation; fine-tuning needs at least 2 (the last "
                         f"round(n x --val-fraction), at least one, are held out for validation)")
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    return conversations[:n - n_val], conversations[n - n_val:]


def evaluate_conversations(model, tokenizer, hf_dir, data, *, window: int, val_fraction: float, split: str,
                           train_on_all_tokens: bool = False, batch_size: int = 32,
                           max_batches: int | None = None) -> tuple[float, int]:
    """``(loss, n_targets)``: the mean loss over the assistant's tokens (every token with
    ``train_on_all_tokens``) of one split of a conversations file (``"train"``, ``"val"`` as
    fine-tuning cuts it with ``val_fraction``, or ``"all"``), one conversation a row of ``window``
    tokens, rendered with ``hf_dir``'s chat template; conversations left out are said on the logger.

    Raises:
        ValueError: as :func:`conversation_rows`.
    """
    from ..interop.hf_chat import folder_chat_template
    from ..text.chat import IGNORE_INDEX, chat_rows, read_conversations
    from .step import estimate_loss

    conversations = read_conversations(data)
    if split != "all":
        conversations = dict(zip(("train", "val"), split_conversations(conversations, val_fraction)))[split]
    rows, left_out = chat_rows(conversations, tokenizer, folder_chat_template(hf_dir), window,
                               train_on_all_tokens=train_on_all_tokens, pad_id=pad_id(tokenizer, hf_dir))
    for line in left_out:
        log.warning(f"left out: {Path(data).name} {line}")
    batches = rows.fixed_batches(0, max_batches or len(rows), batch_size, window)
    return estimate_loss(model, batches), sum(int((b[1] != IGNORE_INDEX).sum()) for b in batches)


def conversation_rows(settings, tokenizer, window: int, model=None):
    """``(train, validation, sha256)``: the :class:`~pedestrian.text.chat.ChatRows` of the
    conversations in ``settings.data`` rendered with ``settings.hf_dir``'s template, windows of
    ``window`` tokens, ``settings.train_on_all_tokens``, packed with ``settings.pack`` (several
    conversations a row, :func:`pedestrian.text.chat.pack_windows`; ``model``'s ``loss`` must take
    ``segments``); the SHA-256 of every row's ids, targets (and segments) (a resume checks the
    data is the same).

    Raises:
        ValueError / FileNotFoundError: no template in the folder; a malformed record (named by its
            line); fewer than 2 conversations; nothing left in a split.
    """
    from ..interop.hf_chat import folder_chat_template
    from ..text.chat import chat_rows, read_conversations

    pack = bool(getattr(settings, "pack", False))
    template = folder_chat_template(settings.hf_dir)
    try:
        halves = split_conversations(read_conversations(settings.data), settings.val_fraction)
    except ValueError as exc:
        raise ValueError(f"{settings.data}: {exc}") if str(exc).startswith("the file holds") else exc from None
    pad = pad_id(tokenizer, settings.hf_dir)
    parts = []
    for name, part in zip(("training", "validation"), halves):
        try:
            rows, left_out = chat_rows(part, tokenizer, template, window,
                                       train_on_all_tokens=settings.train_on_all_tokens, pad_id=pad, pack=pack)
        except ValueError as exc:
            raise ValueError(f"{settings.data}: {name} split: {exc}") from None
        for line in left_out:
            log.warning(f"left out: {Path(settings.data).name} {line}")
        parts.append(rows)
    h = hashlib.sha256()
    for rows in parts:
        for a in (rows.x, rows.y) if rows.segments is None else (rows.x, rows.y, rows.segments):
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return parts[0], parts[1], h.hexdigest()


def evaluate_loaded(loaded, data, *, split: str, val_fraction: float, batch_size: int = 32,
                    max_batches: int | None = None, progress: bool = False) -> tuple[float, int, str]:
    """``(loss, n_targets, unit)`` of a loaded model (:func:`pedestrian.load.load_model`'s result)
    on one split of ``data``: a conversations file on the assistant's tokens, as its fine-tune
    measured them (the base folder's chat template, the run's window and ``train_on_all_tokens``),
    else a text's every token; ``unit``: ``"character"``, ``"token"`` or ``"assistant token"``.

    Raises:
        ValueError: a conversations file and no Hugging Face folder (no chat template); as
            :func:`evaluate_conversations` and :func:`~.corpus.corpus_split`.
    """
    from .corpus import corpus_split, evaluate_tokens
    from .settings import training_window

    model, tokenizer, saved = loaded.model, loaded.tokenizer, loaded.settings
    chat = is_conversations(data)
    if chat and loaded.base is None:
        raise ValueError(f"{data} is a conversations file: it is rendered with a Hugging Face folder's chat "
                         "template, and this model has none; evaluate it on text")
    if chat:                                             # the assistant's tokens, as fine-tuning measured them
        loss, n = evaluate_conversations(
            model, tokenizer, loaded.base, data, val_fraction=val_fraction, split=split,
            window=training_window(saved.get("context_length"), model.config.context_length),
            train_on_all_tokens=bool(saved.get("train_on_all_tokens")), batch_size=batch_size,
            max_batches=max_batches)
    else:
        tokens = corpus_split(data, tokenizer, val_fraction, split)
        loss, n = evaluate_tokens(model, tokens, batch_size=batch_size, max_batches=max_batches, progress=progress)
    unit = ("character" if tokenizer.to_dict().get("kind") == "char" else
            "token" if not chat or saved.get("train_on_all_tokens") else "assistant token")
    return loss, n, unit

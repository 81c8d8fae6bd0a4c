"""A run's tokens: the tokenizer for its corpus, the token file, the train/validation split,
and the validation loss over a token array.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ..model import eval_mode
from ..text.data import BUNDLED_CORPUS, iter_corpus_pieces, iter_train_pieces
from ..text.tokens import encode_to_token_file
from .settings import TrainSettings
from .step import TrainingError

# ---------------------------------------------------------------------------------------- data
def data_fingerprint(train_tokens: np.ndarray, val_tokens: np.ndarray) -> str:
    """SHA-256 of a run's training and validation token ids: a resumed run checks its text is the
    one it was trained on (its batches are drawn from these ids)."""
    import hashlib

    h = hashlib.sha256()
    for tokens in (train_tokens, val_tokens):
        h.update(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
    return h.hexdigest()


def build_tokenizer(settings: TrainSettings, corpus: Path):
    """A new tokenizer for ``corpus``.

    ``char``: the sorted set of characters of the whole corpus (train and validation, so the
    validation text never holds an unknown character), read piece by piece. ``bpe``: byte-level
    BPE of ``bpe_vocab_size`` ids trained on the training split only, streamed piece by piece
    (:func:`pedestrian.text.data.iter_train_pieces`).
    """
    from ..text.tokenizer import BPETokenizer, CharTokenizer

    if settings.tokenizer == "char":
        chars: set[str] = set()
        for piece in iter_corpus_pieces(corpus):
            chars.update(piece)
        return CharTokenizer(sorted(chars))
    return BPETokenizer.train(iter_train_pieces(corpus, settings.val_fraction),
                              vocab_size=settings.bpe_vocab_size)


def split_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` views: the last ``round(n · val_fraction)`` tokens are validation.

    For the character tokenizer this is exactly :func:`pedestrian.text.data.split_train_val` (one
    token per character).
    """
    n = int(tokens.shape[0])
    n_val = round(n * val_fraction)
    return tokens[: n - n_val], tokens[n - n_val:]


def corpus_split(data, tokenizer, val_fraction: float, split: str) -> np.ndarray:
    """The token ids of one split of a corpus, as ``pedestrian eval`` reads it: ``data`` (a text
    file or folder; ``None``: the bundled plays) encoded with ``tokenizer``; ``split`` ``"train"``
    or ``"val"`` as :func:`split_tokens` cuts them with ``val_fraction``, or ``"all"``.

    Raises:
        TrainingError: fewer than 2 tokens in the split (the message names the fixes).
    """
    corpus = Path(data).expanduser() if data else BUNDLED_CORPUS
    tokens = encode_to_token_file(corpus, tokenizer)
    if split == "all":
        part = tokens
    else:
        part = dict(zip(("train", "val"), split_tokens(tokens, val_fraction)))[split]
    if part.shape[0] < 2:
        what = "the whole text" if split == "all" else (
            f"its {split} part (val_fraction {val_fraction}: the last {val_fraction:g} of the tokens "
            "is the val part, the rest the train part)")
        raise TrainingError(f"{corpus} has {tokens.shape[0]} tokens and {what} holds {part.shape[0]}; "
                            "evaluation needs at least 2. Use a longer text"
                            + ("" if split == "all" else ", --split all, or another --val-fraction"))
    return part


def prepare_data(settings, tokenizer=None, group=None, window: int | None = None):
    """Tokenizer and the encoded train / validation token streams of the corpus.

    The corpus is encoded once into a token file cached beside it (memory-mapped; see
    :func:`pedestrian.text.tokens.encode_to_token_file`). With several ranks, rank 0 builds the
    tokenizer and the token file first; the others then take its tokenizer (broadcast, the
    object itself) and read the same file.

    Args:
        settings: a :class:`~pedestrian.training.settings.TrainSettings` (or fine-tuning
            settings, with a tokenizer); uses ``data`` (``None``: the bundled plays),
            ``tokenizer``, ``bpe_vocab_size``, ``val_fraction`` and ``context_length``.
        tokenizer: an existing tokenizer (resume, fine-tuning); else one is built.
        group: the process group (:mod:`pedestrian.training.distributed`); ``None``: one process.
        window: tokens of one training window (default ``settings.context_length``).

    Returns:
        ``(tokenizer, train_tokens, val_tokens)``.

    Raises:
        FileNotFoundError / ValueError: missing, empty or non-UTF-8 corpus; a character the
            given tokenizer does not know; a split shorter than one window (``window + 1``
            tokens; :class:`TrainingError`).
    """
    if group is not None and not group.is_writer:
        tokenizer = group.broadcast(None, "the tokenizer")       # rank 0's (pickled), once its file is written
    corpus = Path(settings.data).expanduser() if settings.data else BUNDLED_CORPUS
    if settings.data is None and not BUNDLED_CORPUS.is_dir():
        from ..text.data import bundled_corpus

        bundled_corpus()  # raises the explanatory error
    if tokenizer is None:
        tokenizer = build_tokenizer(settings, corpus)
    tokens = encode_to_token_file(corpus, tokenizer)
    train_tokens, val_tokens = split_tokens(tokens, settings.val_fraction)
    need = (settings.context_length if window is None else window) + 1
    for name, part in (("training", train_tokens), ("validation", val_tokens)):
        if part.shape[0] < need:
            raise TrainingError(
                f"corpus {corpus} is too short: {tokens.shape[0]} tokens in all, {part.shape[0]} in the "
                f"{name} split (val_fraction {settings.val_fraction}), but one window needs "
                f"context_length + 1 = {need}. Use a longer corpus or a smaller --context-length.")
    if group is not None and group.is_writer:
        group.broadcast(tokenizer, "the tokenizer")
    return tokenizer, train_tokens, val_tokens


# ---------------------------------------------------------------------------------------- evaluation, logs
#: at most this many bytes of logits per forward pass of an evaluation (:func:`evaluate_tokens`)
EVAL_LOGITS_BYTES = 1 << 30


def evaluate_tokens(model, tokens: np.ndarray, batch_size: int = 32, max_batches: int | None = None,
                    progress: bool = False) -> tuple[float, int]:
    """Mean next-token loss over a whole token stream, every target counted once.

    The stream is cut into consecutive non-overlapping windows of ``context_length`` inputs
    (the next token of each window starts the following one); a shorter final window covers
    the remainder. Dropout is off; the forward keeps no activations (one block's arrays at a
    time), and a batch whose logits would pass :data:`EVAL_LOGITS_BYTES` runs as several
    forwards of fewer windows (a Llama folder's context of 2,048-8,192 positions times a
    vocabulary of 49,152: 0.4-1.6 GB of float32 logits per window).

    Args:
        tokens: 1-D ids (e.g. a memory-mapped validation split), at least 2.
        batch_size: windows per batch (per forward pass, up to the logits' budget).
        max_batches: stop after this many full batches (``None`` = the whole stream).

    Returns:
        ``(loss, n_targets)``: nats per token, averaged over all ``n_targets`` targets.
    """
    T = model.config.context_length
    n = int(tokens.shape[0])
    if n < 2:
        raise ValueError(f"need at least 2 tokens to evaluate, got {n}")
    n_windows = (n - 1) // T
    total, count = 0.0, 0
    starts = list(range(0, n_windows * T, T))
    chunks = [starts[i:i + batch_size] for i in range(0, len(starts), batch_size)]
    if max_batches is not None:
        chunks = chunks[:max_batches]
    from tqdm import tqdm

    per_forward = max(1, EVAL_LOGITS_BYTES // (T * model.config.vocab_size * np.dtype(model.dtype_name).itemsize))
    with eval_mode(model):
        # (a text shorter than one window has no full batch: no bar, rather than an empty one)
        for chunk in tqdm(chunks, desc="eval", unit="batch", disable=not progress or not chunks, file=sys.stderr):
            for i in range(0, len(chunk), per_forward):
                idx = np.asarray(chunk[i:i + per_forward])[:, None] + np.arange(T + 1)
                w = np.asarray(tokens[idx], dtype=np.int64)
                loss = model.loss(w[:, :-1], w[:, 1:], keep_activations=False)
                total += getattr(model, "loss_parts", {}).get("ce", loss) * w[:, 1:].size          # (experts: no aux loss)
                count += w[:, 1:].size
        rest = n - 1 - n_windows * T
        if rest > 0 and (max_batches is None or len(chunks) * batch_size >= n_windows):
            w = np.asarray(tokens[n_windows * T:], dtype=np.int64)[None, :]
            loss = model.loss(w[:, :-1], w[:, 1:], keep_activations=False)
            total += getattr(model, "loss_parts", {}).get("ce", loss) * rest
            count += rest
    return total / count, count

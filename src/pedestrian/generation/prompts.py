"""Text in, text out: prompts encoded, settings checked once, continuations decoded and cut at
their stop strings -- what ``pedestrian sample`` runs, for any caller.

Usage::

    ids = [encode_prompt(tokenizer, text) for text in prompts]
    sampling = Sampling(temperature=0.8, stop=["\\n\\n"], seed=0)   # checked here, once
    done = complete(model, tokenizer, ids, 200, sampling)
    done.texts[row]                                   # the continuation of row ``row``, as text

Rows are ``num_samples`` samples of each prompt, prompt by prompt (``done.rows[row] =
(prompt, sample)``); prompts of different lengths are left-padded into one batch, each row
computing what it would alone (:func:`pedestrian.generation.generate.generate`). A row ends at
the model's end-of-sequence ids (a Hugging Face folder's ``eos_token_id``, else the tokenizer's
``<|endoftext|>``; not when ``ignore_eot``), at a ``stop_ids``
token, or right before the first ``stop`` text it generates (matched on the decoded text however
it is split into tokens, :class:`~pedestrian.text.tokenizer.StopText`); neither the stop token
nor the stop text is part of the continuation. Only ids below ``tokenizer.vocab_size`` are
sampled, so a model with a padded vocabulary (GPT-2's 50,304) never produces an id the tokenizer
cannot decode.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..text.bpe_tokenizer import EOS_TOKENS
from ..text.tokenizer import BPETokenizer, StopText, UnknownCharacterError, check_text
from .generate import generate, loose_sampling
from .sampling import Sampling

EOT = "<|endoftext|>"

__all__ = ["EOT", "Completion", "check_completion", "complete", "encode_prompt", "eot_id", "read_prompts", "write_completions"]


def eot_id(tokenizer) -> int | None:
    """The id of ``<|endoftext|>`` in ``tokenizer``, else of the first other end-of-text token it
    has (:data:`~pedestrian.text.bpe_tokenizer.EOS_TOKENS`: Llama 2's ``</s>``, Llama 3's
    ``<|end_of_text|>``, ...), or ``None`` when it has none."""
    special = getattr(tokenizer, "special_tokens", {})
    return next((special[t] for t in (EOT, *EOS_TOKENS) if t in special), None)


def read_prompts(prompts: Sequence[str] = (), prompts_file=None) -> list[str]:
    """The prompts of ``pedestrian sample``: ``prompts``, then the non-empty lines of the UTF-8 text
    file ``prompts_file`` (a byte-order mark dropped); ``[""]`` when there are none.

    Raises:
        ValueError: ``prompts_file`` missing, not UTF-8, or holding only empty lines.
    """
    texts = list(prompts)
    if prompts_file:
        from pathlib import Path

        path = Path(prompts_file)
        try:
            lines = path.read_text(encoding="utf-8-sig").splitlines()
        except FileNotFoundError:
            raise ValueError(f"--prompts-file {path}: no such file") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"--prompts-file {path} is not UTF-8 text (byte {exc.start}); save it as "
                             "UTF-8") from None
        texts += [line for line in lines if line.strip()]
        if not any(line.strip() for line in lines):
            raise ValueError(f"--prompts-file {path} holds no prompt (every line is empty)")
    return texts or [""]


def encode_prompt(tokenizer, text: str, what: str = "the prompt") -> list[int]:
    """Token ids of one prompt; an empty prompt starts from ``<|endoftext|>`` (GPT-2's convention).

    A BPE tokenizer encodes it as ``tokenizers`` does with the file's post-processor
    (``add_special_tokens=True``, transformers' default too): a Llama ``tokenizer.json`` puts its
    ``<s>`` / ``<|begin_of_text|>`` first, GPT-2's and Qwen2's add nothing.

    ``what`` names the prompt in messages (``"prompt 2"``, ``"the --prompt"``).

    Raises:
        ValueError: text that is not valid Unicode (a lone surrogate); characters a character
            tokenizer lacks (the message lists up to 10); an empty prompt and no ``<|endoftext|>``.
    """
    check_text(text, what)
    try:
        if isinstance(tokenizer, BPETokenizer):
            ids = tokenizer.encode(text, add_special_tokens=True)
        else:
            ids = tokenizer.encode(text)                # a char tokenizer raises on unknown chars
    except UnknownCharacterError as exc:
        shown = ", ".join(f"{c!r}" for c in list(exc.unknown)[:10])
        raise ValueError(f"{what} has {len(exc.unknown)} character(s) this model's character vocabulary "
                         f"lacks ({shown}); use only characters that occur in its training text, or "
                         "train with --tokenizer bpe (which encodes any text)") from None
    if not ids:
        if eot_id(tokenizer) is None:
            raise ValueError(f"{what} is empty and this tokenizer has no <|endoftext|> token to "
                             "start from; give at least one character")
        ids = [eot_id(tokenizer)]
    return list(ids)


def check_completion(model, tokenizer, *, max_new_tokens: int, num_samples: int = 1, stop_ids=(),
                     window_shift: int = 1, named: Callable[[str], str] | None = None) -> None:
    """Check what :func:`complete` is given beside its :class:`~pedestrian.generation.sampling.Sampling`
    (which checked itself when made), before anything is generated.

    ``named``: how a message names a setting (default: the keyword; ``pedestrian sample`` passes
    its flags); ``stop_ids``: the sampling's.

    Raises:
        ValueError: ``max_new_tokens < 0``; ``num_samples < 1``; ``window_shift`` outside
            ``[1, context_length]``; a tokenizer larger than the model's vocabulary; a stop id
            that is not a token id of the model.
    """
    n = named or str
    if max_new_tokens < 0:
        raise ValueError(f"{n('max_new_tokens')} must be >= 0, got {max_new_tokens}")
    if num_samples < 1:
        raise ValueError(f"{n('num_samples')} must be >= 1, got {num_samples}")
    C, V = model.config.context_length, model.config.vocab_size
    if not 1 <= window_shift <= C:
        raise ValueError(f"{n('window_shift')} must be in [1, context_length={C}] (window_shift), "
                         f"got {window_shift}")
    if tokenizer.vocab_size > V:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                         f"{V}; they do not belong together")
    bad = [i for i in stop_ids if not 0 <= i < V]
    if bad:
        raise ValueError(f"{n('stop_ids')} {bad[0]} is not a token id of this model: ids are 0 ... {V - 1}")


def _loose(sampling: Sampling | None, loose: dict) -> Sampling:
    """``complete``'s deprecated keywords: those of ``generate`` and the stops."""
    stops = {k: loose.pop(k) for k in ("stop", "stop_ids", "ignore_eot") if k in loose}
    sampling = loose_sampling(sampling, loose, "complete")
    if stops:
        if not loose:
            import warnings

            warnings.warn("complete(stop=..., stop_ids=..., ignore_eot=...) is deprecated: pass them in "
                          "pedestrian.generation.Sampling(...)", DeprecationWarning, stacklevel=3)
        sampling = dataclasses.replace(sampling, **stops)
    return sampling


@dataclass
class Completion:
    """What :func:`complete` generated.

    ``rows[r] = (prompt index, sample index)``; ``texts[r]``: row ``r``'s continuation (without the
    prompt, cut before its stop); ``ids``: ``generate``'s ids, prompt included (one array per row
    when the prompts differ in length); ``new_tokens``: tokens generated for row 0 (its stop
    token included); ``seconds``: the wall time of the generation.
    """

    rows: list
    texts: list
    ids: object
    new_tokens: int
    seconds: float


def complete(model, tokenizer, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: Sampling | None = None, *, num_samples: int = 1, window_shift: int = 1,
             use_cache: bool = True, on_text: Callable[[int, str], None] | None = None,
             eos_ids: Sequence[int] | None = None, **loose) -> Completion:
    """Continue each prompt ``num_samples`` times, as one batch, and decode the continuations.

    Args:
        model: a :class:`~pedestrian.model.GPT`; tokenizer: a Char/BPE tokenizer (see the module).
        prompt_ids: one list of token ids per prompt (:func:`encode_prompt`).
        max_new_tokens, window_shift, use_cache: as :func:`~pedestrian.generation.generate.generate`.
        sampling: a :class:`~pedestrian.generation.sampling.Sampling` (default ``Sampling()``); its
            ``stop`` / ``stop_ids`` / ``ignore_eot`` say where a row ends (module docstring).
        on_text: called as ``on_text(row, text)`` with each piece of decoded text as soon as it
            is certain (a character complete, no stop string that it may begin).
        eos_ids: the end-of-sequence ids a row ends at unless ``sampling.ignore_eot``: a Hugging
            Face folder's ``eos_token_id`` (:func:`pedestrian.interop.hf_chat.eos_token_ids`);
            ``None`` or ``()``: the tokenizer's ``<|endoftext|>`` (:func:`eot_id`).
        loose: ``generate``'s deprecated keywords (``temperature=`` ...), and ``stop=``,
            ``stop_ids=``, ``ignore_eot=``: they make the ``Sampling``, with a ``DeprecationWarning``.

    The other settings are checked first (:func:`check_completion`, keyword names). A prompt
    longer than the context keeps its last ``context_length`` tokens (``generate`` warns).

    Raises:
        ValueError: as :func:`check_completion`; NaN logits while generating
            (:class:`~pedestrian.generation.sampling.NonFiniteLogitsError`).
    """
    sampling = _loose(sampling, loose)
    check_completion(model, tokenizer, max_new_tokens=max_new_tokens, num_samples=num_samples,
                     stop_ids=sampling.stop_ids, window_shift=window_shift)
    eot = eot_id(tokenizer)
    ends = [] if sampling.ignore_eot else [int(i) for i in eos_ids] if eos_ids else [] if eot is None else [eot]
    stop_set = set(sampling.stop_ids) | set(ends)
    rows = [(i, j) for i in range(len(prompt_ids)) for j in range(num_samples)]
    row_ids = [np.asarray(prompt_ids[i], dtype=np.int64) for i, _ in rows]
    prompt = row_ids if len({len(r) for r in row_ids}) > 1 else np.stack(row_ids)
    decoders = [StopText(tokenizer, list(sampling.stop)) for _ in rows]
    texts: list[list[str]] = [[] for _ in rows]
    done = np.zeros(len(rows), dtype=bool)

    def emit(r: int, text: str) -> None:
        if text:
            texts[r].append(text)
            if on_text is not None:
                on_text(r, text)

    def on_token(ids):
        for r, token in enumerate(ids.tolist()):
            if done[r]:
                continue
            if token in stop_set:                      # generate() ends the row too
                done[r] = True
                continue
            emit(r, decoders[r].push(token))
            done[r] = decoders[r].stopped
        return done.copy()

    t0 = time.perf_counter()
    ids = generate(model, prompt, max_new_tokens, sampling.ending_at(ends),
                   use_cache=use_cache, on_token=on_token, window_shift=window_shift, vocab_limit=tokenizer.vocab_size)
    seconds = time.perf_counter() - t0
    for r in range(len(rows)):
        emit(r, decoders[r].finish())
    return Completion(rows=rows, texts=["".join(t) for t in texts], ids=ids,
                      new_tokens=len(ids[0]) - len(row_ids[0]), seconds=seconds)


def write_completions(model, tokenizer, prompts: Sequence[str], prompt_ids: Sequence[Sequence[int]],
                      max_new_tokens: int, sampling: Sampling, out, err=None, *, num_samples: int = 1,
                      **settings) -> Completion:
    """:func:`complete` the prompts (``prompt_ids``, encoded from the texts ``prompts``; ``settings``:
    the other keywords of :func:`complete`) and write the text to the stream ``out`` as
    ``pedestrian sample`` prints it: one prompt and one sample is streamed -- the prompt, each
    token's text as soon as it is complete, a newline; several are written when all are done,
    each under a ``--- sample M ---``, ``--- prompt N ---`` or ``--- prompt N, sample M ---`` line
    and followed by its prompt and continuation. A prompt longer than the model's context is
    said once per prompt on the stream ``err`` (``warning: ...``) instead of as a ``UserWarning``
    (when ``err`` is given). Returns the :class:`Completion`."""
    import warnings

    C = model.config.context_length
    for i, ids in enumerate(prompt_ids if err is not None else ()):
        if len(ids) > C:
            which = "the prompt" if len(prompts) == 1 else f"prompt {i + 1}"
            err.write(f"warning: {which} has {len(ids)} tokens but the model's context is {C}: "
                      f"only the last {C} condition the generation\n")
            err.flush()
    streaming = len(prompt_ids) * num_samples == 1

    def stream(row: int, text: str) -> None:
        out.write(text)
        out.flush()

    if streaming:
        stream(0, prompts[0])
    with warnings.catch_warnings():
        if err is not None:                             # already said above, in one line
            warnings.filterwarnings("ignore", message="the prompt has", category=UserWarning)
        done = complete(model, tokenizer, prompt_ids, max_new_tokens, sampling, num_samples=num_samples,
                        on_text=stream if streaming else None, **settings)
    if streaming:
        out.write("\n")
    for (i, j), text in zip(done.rows, done.texts) if not streaming else ():
        label = (f"sample {j + 1}" if len(prompts) == 1 else
                 f"prompt {i + 1}" if num_samples == 1 else f"prompt {i + 1}, sample {j + 1}")
        out.write(f"--- {label} ---\n{prompts[i]}{text}\n")
    out.flush()
    return done

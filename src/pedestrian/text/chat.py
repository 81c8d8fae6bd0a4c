"""Conversations as token ids: a folder's chat template rendered as transformers renders it, the
assistant's tokens marked, and a JSONL file of conversations turned into training rows.

**Rendering** (:class:`ChatTemplate`, :func:`render`). The template is Jinja, rendered with
``jinja2`` in the environment of transformers' ``apply_chat_template``: a sandbox,
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` tag,
a ``tojson`` filter that leaves non-ASCII as it is, and ``raise_exception``, ``strftime_now``,
``dict``, ``namespace``; its variables are ``messages``, ``add_generation_prompt``, ``tools`` and
``documents`` (``None``) and the folder's special tokens (``bos_token``, ``eos_token``, ...,
:func:`pedestrian.interop.hf_chat.special_tokens_map`). A message's keys whose value is ``None``
are dropped first, as transformers does. The text is encoded **without** the tokenizer's special
tokens (``add_special_tokens=False``, as ``apply_chat_template``): a template that writes
``bos_token`` itself -- Llama 3's -- gets one ``<|begin_of_text|>``, not two.

**The assistant's tokens.** A template with ``{% generation %}`` ... ``{% endgeneration %}``
marks them itself: a token is the assistant's when its characters overlap a marked span
(``return_assistant_tokens_mask=True``). A template without the tag (Llama 3's, ChatML's, most
folders') marks them by prefixes: assistant message ``i`` owns the text that rendering
``messages[:i + 1]`` adds to rendering ``messages[:i]`` with ``add_generation_prompt=True`` --
its content and the end of its turn (``<|eot_id|>``; ``<|im_end|>`` and the newline after it),
never the header the prompt already wrote. A template that renders earlier turns differently
once later ones follow (so that neither text is a prefix of the whole) is refused: mark its
assistant text with ``{% generation %}``.

**Data** (:func:`read_conversations`, :func:`chat_rows`). A JSONL file, one record a line:
``{"messages": [{"role": ..., "content": ...}, ...]}``, or ``{"prompt": ..., "completion":
...}`` -- two strings (a user turn and the assistant's answer) or two lists of messages (TRL's
conversational prompt-completion records; the loss on the completion's assistant turns). Each
conversation becomes one row of a training window of ``T`` inputs: ``x = ids[:-1]``, ``y =
ids[1:]`` with every target that is not the assistant's replaced by the ignore index ``-100``
(``train_on_all_tokens``: every target counts). **Truncation**: a conversation longer than the
window keeps its first ``T + 1`` tokens (the start of the conversation, as TRL's default); one
with no assistant target left in them is left out, and said. A shorter one is padded at the end
with ignored targets (causal attention: the padding changes nothing before it).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .jsonl import json_lines

#: the targets the loss does not count (:data:`pedestrian.layers.loss.IGNORE_INDEX`; text/ imports no layers)
IGNORE_INDEX = -100

__all__ = ["ChatTemplate", "ChatTemplateError", "render", "user_turn_prompt", "read_conversations", "Conversation",
           "ChatRows", "chat_rows", "pack_windows", "IGNORE_INDEX"]


class ChatTemplateError(ValueError):
    """The template cannot render a conversation (its ``raise_exception``, or a Jinja error)."""


# ------------------------------------------------------------------------------------ the environment
@functools.lru_cache(maxsize=16)
def _compiled(source: str):
    """``source`` compiled in transformers' ``apply_chat_template`` environment (module docstring)."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: the rendered text, its span recorded."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

        def _span(self, caller):
            text = caller()
            blocks, spans = self.environment.tracking[-1] if self.environment.tracking else (None, None)
            if blocks is not None:
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.tracking = []
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=dict, namespace=jinja2.utils.Namespace)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template is not valid Jinja (line {exc.lineno}: {exc.message})") from None


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the special tokens its folder names (``{"bos_token": ...}``).

    ``marks_generation``: the template has ``{% generation %}`` (module docstring)."""

    source: str
    special_tokens: tuple = ()          # ((name, text), ...): hashable, so the template is

    @property
    def marks_generation(self) -> bool:
        import re

        return re.search(r"\{%-?\s*generation\s*-?%\}", self.source) is not None

    def text(self, messages: Sequence[dict], *, add_generation_prompt: bool = False) -> str:
        """The rendered conversation (a string). Raises :class:`ChatTemplateError`."""
        return self._render(messages, add_generation_prompt, None)

    def _render(self, messages, add_generation_prompt: bool, spans: list | None) -> str:
        import jinja2

        template = _compiled(self.source)
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = dict(self.special_tokens, messages=messages, add_generation_prompt=add_generation_prompt,
                         tools=None, documents=None)
        blocks: list[str] = []
        template.environment.tracking.append((blocks, spans) if spans is not None else (None, None))
        try:
            for block in template.generate(**variables):
                blocks.append(block)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template cannot render this conversation: {exc}") from None
        finally:
            template.environment.tracking.pop()
        return "".join(blocks)

    def assistant_spans(self, messages: Sequence[dict], *,
                        add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: the rendered conversation and the character spans of the assistant's
        text (module docstring: ``{% generation %}``, else by prefixes).

        Raises:
            ChatTemplateError: the template cannot render it, or renders earlier turns differently
                once later ones follow.
        """
        if self.marks_generation:
            spans: list = []
            return self._render(messages, add_generation_prompt, spans), spans
        text = self.text(messages, add_generation_prompt=add_generation_prompt)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before, upto = self.text(messages[:i], add_generation_prompt=True), self.text(messages[:i + 1])
            start, end = len(before), len(upto)
            if not (text.startswith(upto) and upto.startswith(before)):
                raise ChatTemplateError(f"the chat template renders the turns before message {i + 1} differently "
                                        "once later turns follow, so the assistant's tokens cannot be told by "
                                        "prefixes; mark its assistant text with {% generation %} ... "
                                        "{% endgeneration %}, or pass --train-on-all-tokens")
            spans.append((start, end))
        return text, spans


def render(messages: Sequence[dict], tokenizer, template: ChatTemplate | str, *,
           add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
    """A conversation as ``(ids, assistant_mask)``: ``transformers``' ``apply_chat_template(messages,
    tokenize=True, add_generation_prompt=..., return_assistant_tokens_mask=True)`` for a template
    with ``{% generation %}``, and the same ids with the prefix rule's mask for one without
    (module docstring). ``assistant_mask[i]`` is 1 where ``ids[i]`` is the assistant's.

    Args:
        messages: ``[{"role": ..., "content": ...}, ...]``.
        tokenizer: a :class:`~pedestrian.text.bpe_tokenizer.BPETokenizer` (a folder's ``tokenizer.json``).
        template: a :class:`ChatTemplate` (a folder's: :func:`pedestrian.interop.hf_chat.folder_chat_template`), or a template string
            (then no special tokens are defined for it).
        add_generation_prompt: end with the header of an assistant turn (for sampling).

    Raises:
        ChatTemplateError: the template cannot render the conversation (its ``raise_exception``).
        TypeError: a tokenizer without offsets (a character tokenizer).
    """
    if isinstance(template, str):
        template = ChatTemplate(template)
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        raise TypeError("chat templates need a Hugging Face tokenizer (a folder's tokenizer.json), "
                        f"not a {type(tokenizer).__name__}")
    text, spans = template.assistant_spans(messages, add_generation_prompt=add_generation_prompt)
    encoding = hf.encode(text, add_special_tokens=False)
    mask, s = [0] * len(encoding.ids), 0
    for t, (lo, hi) in enumerate(encoding.offsets):             # (transformers' loop: tokens overlapping a span)
        while s < len(spans) and lo >= spans[s][1]:
            s += 1
        if s == len(spans):
            break
        if hi > spans[s][0]:
            mask[t] = 1
    return list(encoding.ids), mask


# ------------------------------------------------------------------------------------ conversations file
@dataclass
class Conversation:
    """One record of a conversations file: its messages, its line, and how many of its first
    messages are prompt (``prompt``/``completion`` records: the assistant turns among them do not
    count in the loss)."""

    messages: list
    line: int
    prompt_messages: int = 0


def _messages(value, what: str, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {what} must be a non-empty list of messages ({{\"role\": ..., \"content\": ...}})")
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: {what}[{j}] must be an object with a string \"role\" and a string \"content\", "
                             f"got {json.dumps(m)[:80]}")
    return value


def read_conversations(path) -> list[Conversation]:
    """The conversations of a JSONL file (module docstring); blank lines are skipped.

    Raises:
        FileNotFoundError: no such file. ValueError: not UTF-8, or a malformed record -- named by
            its line number (``chat.jsonl line 7: ...``); a file without records.
    """
    path = Path(path).expanduser()
    out = []
    for n, where, record in json_lines(path, missing=f"--data {path}: no such file",
                                    holds='one conversation: {"messages": [...]} or {"prompt": ..., "completion": ...}'):
        if not isinstance(record, dict):
            raise ValueError(f"{where} is not a JSON object")
        if "messages" in record:
            out.append(Conversation(_messages(record["messages"], '"messages"', where), n))
        elif "prompt" in record and "completion" in record:
            prompt, completion = record["prompt"], record["completion"]
            if isinstance(prompt, str) and isinstance(completion, str):
                out.append(Conversation([{"role": "user", "content": prompt},
                                         {"role": "assistant", "content": completion}], n, 1))
            else:
                prompt = _messages(prompt, '"prompt"', where)
                out.append(Conversation(prompt + _messages(completion, '"completion"', where), n, len(prompt)))
        else:
            raise ValueError(f"{where} has neither \"messages\" nor \"prompt\" and \"completion\" (keys: "
                             f"{', '.join(map(str, record)) or 'none'})")
    if not out:
        raise ValueError(f"{path} holds no conversation (every line is empty)")
    return out


# ------------------------------------------------------------------------------------ training rows
class ChatRows:
    """Training rows of conversations: ``x``, ``y`` int64 ``(N, T)`` (module docstring), drawn as
    :class:`~pedestrian.text.tokens.TokenDataset`'s windows are (same interface); packed rows also
    hold ``segments`` int64 ``(N, T)`` (:func:`pack_windows`), and their batches are ``(x, y,
    segments)``. ``lines[r]``: the file lines of row ``r``'s conversations."""

    def __init__(self, x: np.ndarray, y: np.ndarray, lines: list, segments: np.ndarray | None = None):
        self.x, self.y, self.lines, self.segments = x, y, lines, segments

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def _rows(self, i) -> tuple:
        parts = (self.x, self.y) if self.segments is None else (self.x, self.y, self.segments)
        return tuple(np.ascontiguousarray(a[i]) for a in parts)

    def get_batch(self, rng: np.random.Generator, batch_size: int, context_length: int):
        """``batch_size`` rows drawn uniformly with replacement (``rng.integers``); ``context_length``
        must be the rows' width."""
        if context_length != self.x.shape[1]:
            raise ValueError(f"these rows are {self.x.shape[1]} tokens wide, not {context_length}")
        return self._rows(rng.integers(0, len(self), size=batch_size))

    def fixed_batches(self, seed: int, n_batches: int, batch_size: int, context_length: int):
        """Every row once, in order, ``batch_size`` at a time, at most ``n_batches`` batches (the
        validation loss then covers the validation conversations; ``seed`` is not needed)."""
        if context_length != self.x.shape[1]:
            raise ValueError(f"these rows are {self.x.shape[1]} tokens wide, not {context_length}")
        starts = range(0, len(self), batch_size)
        return [self._rows(slice(s, s + batch_size)) for s in starts][:n_batches]


def chat_rows(conversations: Sequence[Conversation], tokenizer, template: ChatTemplate, window: int, *,
              train_on_all_tokens: bool = False, pad_id: int = 0, pack: bool = False) -> tuple[ChatRows, list[str]]:
    """The rows of ``conversations`` (module docstring) and what was left out, one line each
    (``"line 4: the chat template cannot render this conversation: ..."``). ``pack``: several
    conversations a row (:func:`pack_windows`), else one.

    Raises:
        ValueError: nothing is left to train on.
    """
    T = window
    pieces, left_out = [], []
    for c in conversations:
        try:
            ids, mask = render(c.messages, tokenizer, template)
            if c.prompt_messages:                    # a completion record: the prompt's turns never count
                prompt_len = len(render(c.messages[:c.prompt_messages], tokenizer, template,
                                        add_generation_prompt=True)[0])
                mask = [0] * prompt_len + mask[prompt_len:]
        except ChatTemplateError as exc:
            if not train_on_all_tokens or "prefixes" not in str(exc):
                left_out.append(f"line {c.line}: {exc}")
                continue
            ids, mask = render_all(c.messages, tokenizer, template)
        ids, mask = ids[:T + 1], mask[:T + 1]                                      # truncation: the start kept
        counted = [1] * len(ids) if train_on_all_tokens else mask
        if not any(counted[1:]):
            left_out.append(f"line {c.line}: no assistant token within the first {T + 1} tokens (the window "
                            f"--context-length {T} + 1): raise --context-length or shorten the conversation")
            continue
        y = np.where(np.asarray(counted[1:], dtype=bool), ids[1:], IGNORE_INDEX).astype(np.int64)
        pieces.append((np.asarray(ids[:-1], dtype=np.int64), y, c.line))
    if not pieces:
        raise ValueError(f"no conversation is left to train on ({len(left_out)} left out; the first: {left_out[0]})")
    if pack:
        return pack_windows(pieces, T, pad_id), left_out
    x = np.full((len(pieces), T), pad_id, dtype=np.int64)
    y = np.full((len(pieces), T), IGNORE_INDEX, dtype=np.int64)
    for r, (xc, yc, _) in enumerate(pieces):
        x[r, :len(xc)], y[r, :len(yc)] = xc, yc
    return ChatRows(x, y, [[line] for _, _, line in pieces]), left_out


def pack_windows(pieces: Sequence[tuple], window: int, pad_id: int = 0) -> ChatRows:
    """Conversations packed into rows of ``window`` positions: each ``(x_c, y_c, line)`` (its inputs
    and targets, at most ``window`` long) goes, in file order, into the first row with room for it
    (first fit), else a new row. ``segments`` numbers a row's conversations 0, 1, ... in order and
    its padding (inputs ``pad_id``, targets ignored) one more, so they are nondecreasing: with
    ``GPT.loss(x, y, segments=...)`` a conversation attends only to itself, its positions from 0,
    and no target crosses a boundary (each conversation's targets are its own next tokens)."""
    T = window
    rows: list[list] = []
    for piece in pieces:
        room = next((r for r in rows if T - sum(len(p[0]) for p in r) >= len(piece[0])), None)
        if room is None:
            rows.append(room := [])
        room.append(piece)
    x = np.full((len(rows), T), pad_id, dtype=np.int64)
    y = np.full((len(rows), T), IGNORE_INDEX, dtype=np.int64)
    segments = np.empty((len(rows), T), dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for k, (xc, yc, _) in enumerate(row):
            x[r, at:at + len(xc)], y[r, at:at + len(yc)], segments[r, at:at + len(xc)] = xc, yc, k
            at += len(xc)
        segments[r, at:] = len(row)
    return ChatRows(x, y, [[line for _, _, line in row] for row in rows], segments)


def user_turn_prompt(text: str, tokenizer, template: ChatTemplate | str, *, system: str | None = None) -> list[int]:
    """The ids of a chat prompt: ``[system turn,] user turn`` with ``text``, then the assistant's
    header (``add_generation_prompt``), as ``pedestrian sample --chat`` and transformers'
    ``apply_chat_template(..., add_generation_prompt=True)`` make them."""
    turns = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": text}]
    return render(turns, tokenizer, template, add_generation_prompt=True)[0]


def render_all(messages, tokenizer, template: ChatTemplate) -> tuple[list[int], list[int]]:
    """The ids of a conversation with every token marked (``train_on_all_tokens``)."""
    ids = tokenizer.hf.encode(template.text(messages), add_special_tokens=False).ids
    return list(ids), [1] * len(ids)

"""What an instruct folder says about chats, read as ``transformers`` reads it: the ids that end a
generation (``eos_token_id``), the chat template and the special tokens a template may name.

- :func:`eos_token_ids`: ``generation_config.json``'s ``eos_token_id`` when the file gives one,
  else ``config.json``'s (an int or a list of ints: Llama 3 Instruct lists ``<|end_of_text|>`` and
  ``<|eot_id|>``, Qwen2 Instruct ``<|im_end|>`` and ``<|endoftext|>``), as ``generate`` does
  (``GenerationConfig.from_pretrained``, falling back to the model config).
- :func:`chat_template`: ``chat_template.jinja`` (what ``save_pretrained`` writes since
  transformers 4.50), else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
  ``{"name", "template"}`` of which the one named ``"default"`` is used).
- :func:`special_tokens_map`: ``tokenizer_config.json``'s ``bos_token``, ``eos_token``,
  ``unk_token``, ``pad_token``... as strings (a serialised ``AddedToken`` reduced to its
  ``content``): the variables transformers hands a template beside ``messages``.
"""

from __future__ import annotations

import json
from pathlib import Path

from .files import read_json_object

__all__ = ["eos_token_ids", "chat_template", "special_tokens_map", "folder_chat_template", "SPECIAL_TOKEN_KEYS"]

#: the keys of transformers' ``special_tokens_map`` (``SpecialTokensMixin.SPECIAL_TOKENS_ATTRIBUTES``)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _ids(value, where: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in values):
        raise ValueError(f"{where} must be a token id or a list of token ids (non-negative integers), got "
                         f"{json.dumps(value)}; fix the file or remove the field")
    return tuple(values)


def eos_token_ids(hf_dir) -> tuple[int, ...]:
    """The token ids that end a generation from the folder ``hf_dir``: ``generation_config.json``'s
    ``eos_token_id`` if it has one (not null), else ``config.json``'s; ``()`` when neither gives one.

    Raises:
        ValueError: a file that is not a JSON object, or an ``eos_token_id`` that is neither a
            non-negative integer nor a non-empty list of them (the message names the file).
    """
    d = Path(hf_dir).expanduser()
    for name in ("generation_config.json", "config.json"):
        path = d / name
        if path.is_file():
            ids = _ids(read_json_object(path).get("eos_token_id"), f"{path}: eos_token_id")
            if ids is not None:
                return ids
    return ()


def _tokenizer_config(d: Path) -> dict:
    path = d / "tokenizer_config.json"
    return read_json_object(path) if path.is_file() else {}


def chat_template(hf_dir) -> str | None:
    """The folder's chat template (module docstring), or ``None`` when it has none.

    Raises:
        ValueError: a ``chat_template`` that is neither a string nor a list of named templates
            with one named ``"default"`` (the message names the file).
    """
    d = Path(hf_dir).expanduser()
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    template = _tokenizer_config(d).get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(f"{d / 'tokenizer_config.json'}: chat_template must be a Jinja template (a string) or a list "
                     "of {\"name\", \"template\"} with one named \"default\"")


def special_tokens_map(hf_dir) -> dict[str, str]:
    """``tokenizer_config.json``'s special tokens as strings (module docstring); ``{}`` without the file."""
    config = _tokenizer_config(Path(hf_dir).expanduser())
    found = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):                     # a serialised AddedToken
            value = value.get("content")
        if isinstance(value, str):
            found[key] = value
    return found


def folder_chat_template(hf_dir):
    """The folder's chat template with its special tokens, a
    :class:`~pedestrian.text.chat.ChatTemplate` (what :func:`pedestrian.text.chat.render` takes).

    Raises:
        ValueError: the folder has none (the message says where one goes); as :func:`chat_template`.
    """
    from ..text.chat import ChatTemplate

    source = chat_template(hf_dir)
    if source is None:
        raise ValueError(f"{hf_dir} has no chat template (chat_template.jinja, or chat_template in "
                         "tokenizer_config.json): a base model is not an instruct model; copy the template "
                         "of the instruct model you follow into its tokenizer_config.json")
    return ChatTemplate(source, tuple(sorted(special_tokens_map(hf_dir).items())))

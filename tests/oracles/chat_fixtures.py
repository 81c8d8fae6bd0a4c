"""Tiny instruct folders for the chat tests, built with ``tokenizers`` and ``transformers`` (nothing
downloads): byte-level BPE tokenizers with the special tokens of Llama 3 Instruct and of Qwen2 /
SmolLM (ChatML), their chat templates (written here, as the model cards' ``tokenizer_config.json``
ship them), and random ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` weights.

The templates: ``LLAMA3`` is Meta-Llama-3-8B-Instruct's, ``QWEN2`` Qwen2-0.5B-Instruct's,
``SMOLLM`` SmolLM2-135M-Instruct's (ChatML with a default system turn); ``LLAMA3_GEN`` and
``CHATML_GEN`` mark the assistant's text with ``{% generation %}`` (what
``return_assistant_tokens_mask`` needs) and refuse, with ``raise_exception``, a conversation whose
roles do not alternate.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from hf_fixtures import TEXT  # noqa: E402

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
         "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
         "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SMOLLM = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
          "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
_ALTERNATE = ("{% set offset = 1 if messages[0]['role'] == 'system' else 0 %}"
              "{% for message in messages %}"
              "{% if message['role'] != 'system' and (message['role'] == 'user') != ((loop.index0 - offset) % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
              "{% endif %}{% endfor %}")
LLAMA3_GEN = (_ALTERNATE + "{{- bos_token }}{% for message in messages %}"
              "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
              "{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}"
              "{% endgeneration %}{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}{% endfor %}"
              "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")
CHATML_GEN = (_ALTERNATE + "{% for message in messages %}\n"
              "{{ '<|im_start|>' + message['role'] + '\n' }}\n"
              "{% if message['role'] == 'assistant' %}\n"
              "    {% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}\n"
              "{% else %}\n"
              "    {{ message['content'] + '<|im_end|>' + '\n' }}\n"
              "{% endif %}\n"
              "{% endfor %}\n"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATES = {"llama3": LLAMA3, "qwen2": QWEN2, "smollm": SMOLLM, "llama3-gen": LLAMA3_GEN, "chatml-gen": CHATML_GEN}
CHAT_TEXT = TEXT + "user assistant system You are a helpful assistant. Hello! How are you? I am fine, thanks.\n" * 5

_TOKENIZERS: dict = {}


def chat_tokenizer(kind: str):
    """A ``tokenizers.Tokenizer``: byte-level BPE of ~300 ids plus the special tokens of ``kind``
    (``"llama3"``: Llama 3's, with a post-processor that puts ``<|begin_of_text|>`` first as
    Llama 3's tokenizer.json does; anything else: ChatML's)."""
    family = "llama3" if kind.startswith("llama3") else "chatml"
    if family not in _TOKENIZERS:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

        specials = LLAMA3_SPECIALS if family == "llama3" else CHATML_SPECIALS
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300 + len(specials), special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator([CHAT_TEXT], trainer)
        if family == "llama3":
            bos = tok.token_to_id("<|begin_of_text|>")
            tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                               special_tokens=[("<|begin_of_text|>", bos)])
        else:
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
        _TOKENIZERS[family] = tok
    return _TOKENIZERS[family]


def fast_tokenizer(kind: str, template: str | None = None):
    """transformers' ``PreTrainedTokenizerFast`` of :func:`chat_tokenizer` with the chat template
    of ``kind`` (or ``template``) and the special tokens the model cards name."""
    tok = chat_tokenizer(kind)
    if kind.startswith("llama3"):
        names = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    else:
        names = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template or TEMPLATES[kind],
                                                **names)


def hf_instruct_model(kind: str, seed: int = 0):
    """A random float64 ``LlamaForCausalLM`` (``kind`` llama3...) or ``Qwen2ForCausalLM``, untied,
    weights of std 0.1 (logits of order 1), eval mode; its ``config.eos_token_id`` as the model
    cards' ``config.json`` (Llama 3: ``<|end_of_text|>``, Qwen2: ``<|im_end|>``)."""
    tok = chat_tokenizer(kind)
    llama = kind.startswith("llama3")
    eos = tok.token_to_id("<|end_of_text|>" if llama else "<|im_end|>")
    bos = tok.token_to_id("<|begin_of_text|>") if llama else None
    kw = dict(vocab_size=tok.get_vocab_size(), hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=40, max_position_embeddings=128, rms_norm_eps=1e-5,
              tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos)
    torch.manual_seed(seed)
    cfg = (transformers.LlamaConfig if llama else transformers.Qwen2Config)(**kw)
    model = (transformers.LlamaForCausalLM if llama else transformers.Qwen2ForCausalLM)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p) if p.shape[0] == kw["hidden_size"] else 0.3 * torch.randn_like(p))
            else:
                p.mul_(5.0)
    return model.double()


def greedy(model, ids: list[int], n: int, eos=None) -> list[int]:
    """transformers' greedy ``generate`` of ``n`` new tokens after ``ids`` (``eos``: its
    ``eos_token_id``; ``None``: none), the new ids only."""
    with torch.no_grad():
        out = model.generate(torch.as_tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                             pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def write_folder(d: Path, kind: str, model, *, generation_eos=None, template: str | None = None,
                 template_in_config: bool = False) -> Path:
    """``save_pretrained`` of ``model`` and its tokenizer into ``d``; ``generation_eos``: the
    ``eos_token_id`` written to ``generation_config.json`` (``None``: no such file, so
    ``config.json``'s rules); ``template_in_config``: the template in ``tokenizer_config.json``
    (older folders) rather than ``chat_template.jinja``."""
    d = Path(d)
    model.save_pretrained(str(d))
    fast_tokenizer(kind, template).save_pretrained(str(d))
    gen = d / "generation_config.json"
    if generation_eos is None:
        gen.unlink(missing_ok=True)
    else:
        gen.write_text(json.dumps({"eos_token_id": generation_eos, "do_sample": False}))
    jinja = d / "chat_template.jinja"
    if template_in_config and jinja.is_file():
        config = json.loads((d / "tokenizer_config.json").read_text())
        config["chat_template"] = jinja.read_text()
        (d / "tokenizer_config.json").write_text(json.dumps(config))
        jinja.unlink()
    return d


def ids_of(kind: str, *names: str) -> list[int]:
    tok = chat_tokenizer(kind)
    return [tok.token_to_id(n) for n in names]


def stop_after(model, prompt_ids: list[int], stop_id: int, k: int) -> None:
    """Make ``model`` write ``stop_id`` as its greedy token after ``prompt_ids`` where it first writes
    a token ``a`` new in its output at the ``k``-th token or later: the output row of ``stop_id``
    becomes 1.001 times that of ``a``, so that where ``a`` led with a positive logit ``stop_id`` now
    leads (the input embeddings, and so the prompt's meaning, are unchanged). Checked: the greedy
    run is the same up to there, then ``stop_id``."""
    new = greedy(model, prompt_ids, 3 * k)
    j = next(j for j in range(k - 1, 3 * k) if new[j] not in new[:j])     # a token new there
    w = model.get_output_embeddings().weight
    with torch.no_grad():
        w[stop_id] = 1.001 * w[new[j]]
    assert greedy(model, prompt_ids, 3 * k, eos=[stop_id]) == new[:j] + [stop_id], "the stop was not made greedy"

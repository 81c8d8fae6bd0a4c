"""Conversations rendered as transformers' ``apply_chat_template`` renders them: the same ids for
the chat templates of Llama 3 Instruct, Qwen2 Instruct (ChatML) and SmolLM2 Instruct, and the same
assistant masks (``return_assistant_tokens_mask=True``) for templates with ``{% generation %}``;
for templates without it, the prefix rule (pedestrian.text.chat) computed from transformers' own
renderings. The tokenizers are tiny byte-level BPEs with the families' special tokens
(tests/oracles/chat_fixtures.py); nothing downloads."""

from __future__ import annotations

import json

import numpy as np
import pytest
from chat_fixtures import TEMPLATES, chat_tokenizer, fast_tokenizer, hf_instruct_model, write_folder

from pedestrian.interop.hf_chat import folder_chat_template
from pedestrian.layers.loss import IGNORE_INDEX
from pedestrian.text import chat
from pedestrian.text.bpe_tokenizer import BPETokenizer
from pedestrian.text.chat import ChatTemplate, ChatTemplateError, chat_rows, read_conversations, render

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CHATS = [
    [{"role": "user", "content": "Hello! How are you?"}, {"role": "assistant", "content": "I am fine, thanks."}],
    [SYSTEM, {"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": " jumps over"},
     {"role": "user", "content": "and then?"}, {"role": "assistant", "content": "the lazy dog. é ✓"}],
    [SYSTEM, {"role": "user", "content": "  spaces around  "}, {"role": "assistant", "content": "\n\nnew lines\n"}],
]


def ours(kind, template=None):
    tok = BPETokenizer(chat_tokenizer(kind))
    special = fast_tokenizer(kind).special_tokens_map
    return tok, ChatTemplate(template or TEMPLATES[kind], tuple(sorted(special.items())))


def prefix_mask(fast, messages, ids_len, add_generation_prompt=False):
    """The prefix rule with transformers rendering every prefix: a token is the assistant's where it
    overlaps the text that assistant message i adds to messages[:i] with the generation prompt."""
    text = fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            before = fast.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
            upto = fast.apply_chat_template(messages[:i + 1], tokenize=False)
            assert text.startswith(upto) and upto.startswith(before)
            spans.append((len(before), len(upto)))
    offsets = fast(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert len(offsets) == ids_len
    return [int(any(hi > a and lo < b for a, b in spans)) for lo, hi in offsets]


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "smollm"])
@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("gen", [False, True], ids=["", "generation_prompt"])
def test_ids_equal_apply_chat_template(kind, chat, gen):
    tok, template = ours(kind)
    fast = fast_tokenizer(kind)
    messages = CHATS[chat][:-1] if gen else CHATS[chat]
    ids, mask = render(messages, tok, template, add_generation_prompt=gen)
    want = fast.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=True)["input_ids"]
    assert ids == list(want)
    assert mask == prefix_mask(fast, messages, len(ids), gen)
    assert any(mask) == any(m["role"] == "assistant" for m in messages)


@pytest.mark.parametrize("kind", ["llama3-gen", "chatml-gen"])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_generation_masks_equal_return_assistant_tokens_mask(kind, chat):
    tok, template = ours(kind)
    fast = fast_tokenizer(kind)
    got_ids, got_mask = render(CHATS[chat], tok, template)
    want = fast.apply_chat_template(CHATS[chat], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert got_ids == list(want["input_ids"])
    assert got_mask == list(want["assistant_masks"])
    assert 0 < sum(got_mask) < len(got_mask)


def test_the_ignore_index_is_the_losses():
    assert chat.IGNORE_INDEX == IGNORE_INDEX


def test_the_template_writes_bos_once():
    """Llama 3's tokenizer.json puts <|begin_of_text|> first and its template writes bos_token:
    the rendered ids hold it once, as transformers' (add_special_tokens=False)."""
    tok, template = ours("llama3")
    bos = tok.special_tokens["<|begin_of_text|>"]
    assert tok.encode("hi", add_special_tokens=True)[0] == bos          # the tokenizer would add one
    ids, _ = render(CHATS[0], tok, template)
    assert ids[0] == bos and ids.count(bos) == 1


def test_raise_exception_refuses_the_conversation():
    tok, template = ours("chatml-gen")
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render(bad, tok, template)
    with pytest.raises(Exception, match="roles must alternate"):
        fast_tokenizer("chatml-gen").apply_chat_template(bad, tokenize=False)


def test_a_template_that_rewrites_earlier_turns_is_refused_without_generation_tags():
    """A template that drops earlier assistant turns' text once later turns follow (as reasoning
    templates do with their thinking): no prefix rule; the error names the fix."""
    template = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|im_start|>assistant\n"
                "...<|im_end|>\n{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok, t = ours("qwen2", template)
    with pytest.raises(ChatTemplateError, match=r"\{% generation %\}"):
        render(CHATS[1], tok, t)


def test_folder_template_and_special_tokens(tmp_path):
    """The template is read from chat_template.jinja or tokenizer_config.json, with bos_token."""
    hf = hf_instruct_model("llama3")
    for in_config in (False, True):
        d = write_folder(tmp_path / str(in_config), "llama3", hf, template_in_config=in_config)
        t = folder_chat_template(d)
        assert t.source == TEMPLATES["llama3"] and dict(t.special_tokens)["bos_token"] == "<|begin_of_text|>"
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no chat template"):
        folder_chat_template(tmp_path / "base")


# ------------------------------------------------------------------------------------ the data file
def write_jsonl(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def test_rows_count_the_assistants_tokens_only(tmp_path):
    tok, template = ours("qwen2")
    fast = fast_tokenizer("qwen2")
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHATS[1]}, "",
                                                 {"prompt": "Hello! How are you?", "completion": "I am fine."}])
    convs = read_conversations(path)
    assert [c.line for c in convs] == [1, 3]
    rows, left_out = chat_rows(convs, tok, template, 160)
    assert left_out == []
    for r, messages in enumerate([CHATS[1], [{"role": "user", "content": "Hello! How are you?"},
                                             {"role": "assistant", "content": "I am fine."}]]):
        ids = fast.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        mask = prefix_mask(fast, messages, len(ids))
        n = len(ids) - 1
        np.testing.assert_array_equal(rows.x[r, :n], ids[:-1])
        np.testing.assert_array_equal(rows.y[r, :n], np.where(np.asarray(mask[1:]) == 1, ids[1:], -100))
        assert (rows.y[r, n:] == -100).all()
    everything, _ = chat_rows(convs, tok, template, 160, train_on_all_tokens=True)
    n = len(fast.apply_chat_template(CHATS[1], tokenize=True, return_dict=True)["input_ids"]) - 1
    assert (everything.y[0, :n] != -100).all() and (everything.y[0, n:] == -100).all()


def test_truncation_keeps_the_start_and_leaves_out_answers_past_the_window(tmp_path):
    tok, template = ours("qwen2")
    long_question = [{"role": "user", "content": "the quick brown fox " * 30}, {"role": "assistant", "content": "ok"}]
    convs = read_conversations(write_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[1]}, {"messages": long_question}]))
    full, mask = render(CHATS[1], tok, template)
    T = 70                                             # CHATS[1]: 108 tokens, its first answer from token 61
    assert len(full) > T + 1
    rows, left_out = chat_rows(convs, tok, template, T)
    assert rows.x.shape == (1, T)
    np.testing.assert_array_equal(rows.x[0], full[:T])                   # the first T + 1 tokens: x, then y
    np.testing.assert_array_equal(rows.y[0], np.where(np.asarray(mask[1:T + 1]) == 1, full[1:T + 1], -100))
    assert len(left_out) == 1 and left_out[0].startswith("line 2: no assistant token within the first 71")


@pytest.mark.parametrize("line, message", [
    ("{not json", "chat.jsonl line 2 is not JSON"),
    ('{"text": "hi"}', 'chat.jsonl line 2 has neither "messages" nor "prompt" and "completion"'),
    ('{"messages": [{"role": "user"}]}', 'chat.jsonl line 2: "messages"[0] must be an object with a string "role"'),
    ('{"messages": []}', 'chat.jsonl line 2: "messages" must be a non-empty list'),
    ('{"prompt": [{"role": "user", "content": "a"}], "completion": 3}', 'chat.jsonl line 2: "completion" must be'),
])
def test_a_malformed_record_is_named_by_its_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHATS[0]}, line])
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_conversations(path)


def test_a_conversation_the_template_refuses_is_left_out_and_said(tmp_path):
    tok, template = ours("chatml-gen")
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    convs = read_conversations(write_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[0]}, {"messages": bad}]))
    rows, left_out = chat_rows(convs, tok, template, 160)
    assert rows.lines == [[1]]
    assert left_out == ["line 2: the chat template cannot render this conversation: Conversation roles must "
                        "alternate user/assistant/user/assistant/..."]
    with pytest.raises(ValueError, match="no conversation is left to train on"):
        chat_rows(convs[1:], tok, template, 64)


def test_prompt_completion_messages_count_only_the_completion(tmp_path):
    tok, template = ours("chatml-gen")
    prompt = CHATS[1][:3] + [CHATS[1][3]]          # system, user, assistant, user
    record = {"prompt": prompt, "completion": [CHATS[1][4]]}
    convs = read_conversations(write_jsonl(tmp_path / "c.jsonl", [record]))
    rows, _ = chat_rows(convs, tok, template, 160)
    ids, mask = render(CHATS[1], tok, template)
    prompt_ids, _ = render(prompt, tok, template, add_generation_prompt=True)
    counted = [m if i >= len(prompt_ids) else 0 for i, m in enumerate(mask)]
    np.testing.assert_array_equal(rows.y[0, :len(ids) - 1], np.where(np.asarray(counted[1:]) == 1, ids[1:], -100))
    assert sum(counted) < sum(mask)                      # the prompt's assistant turn does not count

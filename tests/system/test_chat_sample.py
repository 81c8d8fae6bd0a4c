"""``pedestrian sample --hf-dir DIR --chat`` (and ``--system``): the prompt as a user turn through
the folder's template with the assistant's header, greedy tokens equal to transformers'
``generate`` from ``apply_chat_template(..., add_generation_prompt=True)`` with the folder's stop
ids, ending at the end of the turn (not printed); a fine-tune's run samples as a chat too."""

from __future__ import annotations

import json

import pytest
from chat_fixtures import fast_tokenizer, greedy, hf_instruct_model, ids_of, stop_after, write_folder

from pedestrian import cli

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

N = 16


@pytest.mark.parametrize("kind, seed, stop, generation_eos, system", [
    ("llama3", 0, "<|eot_id|>", ["<|end_of_text|>", "<|eot_id|>"], None),
    ("qwen2", 0, "<|im_end|>", None, "Be brief."),
])
def test_chat_greedy_equals_generate_with_the_template(tmp_path, capsys, kind, seed, stop, generation_eos, system):
    hf = hf_instruct_model(kind, seed)
    fast = fast_tokenizer(kind)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "Hello!"}]
    prompt_ids = list(fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"])
    (stop_id,) = ids_of(kind, stop)
    stop_after(hf, prompt_ids, stop_id, 4)
    gen_eos = ids_of(kind, *generation_eos) if generation_eos else None
    d = write_folder(tmp_path / kind, kind, hf, generation_eos=gen_eos)
    want = greedy(hf, prompt_ids, N, eos=gen_eos or [hf.config.eos_token_id])
    assert want[-1] == stop_id and len(want) < N
    capsys.readouterr()
    argv = ["sample", "--hf-dir", str(d), "--chat", "--prompt", "Hello!", "--max-new-tokens", str(N),
            "--temperature", "0", "--dtype", "float64"] + (["--system", system] if system else [])
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out == fast.decode(want[:-1], skip_special_tokens=True) + "\n"


def test_system_without_chat_and_chat_without_template_are_refused(tmp_path, capsys):
    hf = hf_instruct_model("qwen2")
    d = write_folder(tmp_path / "q", "qwen2", hf)
    capsys.readouterr()
    assert cli.main(["sample", "--hf-dir", str(d), "--system", "x", "--prompt", "hi"]) == 2
    assert "--system is the system turn of a --chat prompt" in capsys.readouterr().err
    (d / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert cli.main(["sample", "--hf-dir", str(d), "--chat", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "has no chat template" in err and len(err.splitlines()) == 1


def test_finetune_on_conversations_then_sample_the_run_as_a_chat(tmp_path, capsys):
    """The new user's path: a conversations file, `finetune`, then `sample --checkpoint RUN --chat`
    (the base's template and stop ids, the adapters applied)."""
    hf = hf_instruct_model("llama3")
    d = write_folder(tmp_path / "llama3", "llama3", hf, generation_eos=ids_of("llama3", "<|end_of_text|>", "<|eot_id|>"))
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                            + "\n" for q, a in [("Hello!", "Hi."), ("How are you?", "Fine."), ("the fox", "jumps.")] * 2))
    run = tmp_path / "run"
    assert cli.main(["finetune", "--hf-dir", str(d), "--data", str(data), "--lora-rank", "2", "--max-steps", "2",
                     "--batch-size", "2", "--context-length", "48", "--eval-interval", "2", "--eval-batches", "1",
                     "--out", str(run), "--no-progress", "--no-plot"]) == 0
    capsys.readouterr()
    chat = ["--chat", "--prompt", "Hello!", "--max-new-tokens", "8", "--temperature", "0", "--dtype", "float64"]
    assert cli.main(["sample", "--checkpoint", str(run), *chat]) == 0
    out = capsys.readouterr().out
    assert "Hello!" not in out and len(out.splitlines()) == 1               # the answer alone
    # merged into a folder of its own, it keeps the base's chat template and stop ids
    assert cli.main(["export-hf", "--adapter", str(run), "--out", str(tmp_path / "merged")]) == 0
    capsys.readouterr()
    for name in ("chat_template.jinja", "generation_config.json", "tokenizer_config.json"):
        assert (tmp_path / "merged" / name).read_bytes() == (d / name).read_bytes(), name
    assert cli.main(["sample", "--hf-dir", str(tmp_path / "merged"), *chat]) == 0
    assert capsys.readouterr().out == out
    import transformers

    messages = [{"role": "user", "content": "Hello!"}]
    assert (transformers.AutoTokenizer.from_pretrained(str(tmp_path / "merged")).apply_chat_template(messages)
            == transformers.AutoTokenizer.from_pretrained(str(d)).apply_chat_template(messages))

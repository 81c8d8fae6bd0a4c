"""``pedestrian finetune --data chat.jsonl`` on a tiny Llama-3-Instruct-shaped folder: the loss it
measures before training is transformers' cross-entropy over the assistant's tokens of the same
conversations (rendered by ``apply_chat_template``, the prefix rule's mask; float64 model); the
run trains and saves; a malformed record is one error line naming its line."""

from __future__ import annotations

import json

import pytest
from chat_fixtures import fast_tokenizer, hf_instruct_model, write_folder, torch

from pedestrian import cli
from pedestrian.training.finetune import FinetuneSettings, finetune

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

QA = [("Hello! How are you?", "I am fine, thanks."), ("the quick brown fox", "jumps over the lazy dog."),
      ("pack my box", "with five dozen liquor jugs!"), ("Sphinx of black quartz,", "judge my vow."),
      ("How are you?", "Fine."), ("the lazy dog", "sleeps.")]
CONVERSATIONS = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in QA]


def write_chat(path, conversations=CONVERSATIONS):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("instruct")
    hf = hf_instruct_model("llama3")
    return write_folder(d / "llama3", "llama3", hf, generation_eos=[1, 4]), hf


def transformers_loss(hf, conversations) -> float:
    """Mean cross-entropy over the assistant's tokens (the text each assistant turn adds after the
    generation prompt), transformers rendering and computing."""
    fast = fast_tokenizer("llama3")
    total, count = 0.0, 0
    for messages in conversations:
        text = fast.apply_chat_template(messages, tokenize=False)
        before = fast.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        enc = fast(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        labels = [t if hi > len(before) else -100 for t, (lo, hi) in zip(ids, enc["offset_mapping"])]
        with torch.no_grad():
            logits = hf(torch.as_tensor([ids])).logits[0, :-1]
        target = torch.as_tensor(labels[1:])
        loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
        total, count = total + loss.item(), count + int((target != -100).sum())
    return total / count


def test_finetune_on_conversations_measures_transformers_loss_and_trains(folder, tmp_path, capsys):
    d, hf = folder
    data = write_chat(tmp_path / "chat.jsonl")
    settings = FinetuneSettings(hf_dir=str(d), data=str(data), lora_rank=2, max_steps=4, batch_size=2,
                                context_length=100, eval_interval=4, eval_batches=4, val_fraction=0.34,
                                lr=1e-2, dtype="float64", out=str(tmp_path / "run"), progress=False, plot=False,
                                lora_targets=["q", "k", "v", "attn_proj"])
    result = finetune(settings)
    # 2 validation conversations (round(6 x 0.34)); float64 against transformers' float32 rotary
    # table and norms: ~1e-7 relative
    assert result.initial_val_loss == pytest.approx(transformers_loss(hf, CONVERSATIONS[4:]), rel=1e-6)
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert sum("loss" in r for r in records) == 4
    assert result.val_loss < result.initial_val_loss
    assert (tmp_path / "run" / "peft" / "adapter_config.json").is_file()
    # `pedestrian eval RUN`: the same validation loss, over the assistant's tokens
    assert cli.main(["eval", str(tmp_path / "run"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"val loss {result.val_loss:.4f} nats per assistant token" in out, out


def test_train_on_all_tokens_counts_more(folder, tmp_path):
    d, _ = folder
    data = write_chat(tmp_path / "chat.jsonl")
    common = dict(hf_dir=str(d), data=str(data), lora_rank=2, max_steps=1, batch_size=2, context_length=100,
                  eval_interval=1, eval_batches=4, val_fraction=0.34, dtype="float64", progress=False, plot=False)
    only = finetune(FinetuneSettings(**common, out=str(tmp_path / "a")))
    every = finetune(FinetuneSettings(**common, out=str(tmp_path / "b"), train_on_all_tokens=True))
    assert only.initial_val_loss != every.initial_val_loss


def test_a_malformed_record_is_one_error_line(folder, tmp_path, capsys):
    d, _ = folder
    capsys.readouterr()
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n" + json.dumps({"messages": CONVERSATIONS[1]})
                    + '\n{"messages": [{"role": "user", "content": 3}]}\n', encoding="utf-8")
    code = cli.main(["finetune", "--hf-dir", str(d), "--data", str(data), "--lora-rank", "2",
                     "--out", str(tmp_path / "run"), "--no-progress", "--no-plot"])
    err = capsys.readouterr().err
    assert code != 0
    assert err.startswith('error: chat.jsonl line 3: "messages"[0] must be an object with a string "role" and a '
                          'string "content"') and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()                          # nothing written


def test_a_folder_without_a_template_is_refused(tmp_path, capsys):
    hf = hf_instruct_model("qwen2")
    d = write_folder(tmp_path / "base", "qwen2", hf)
    (d / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    capsys.readouterr()
    code = cli.main(["finetune", "--hf-dir", str(d), "--data", str(write_chat(tmp_path / "chat.jsonl")),
                     "--lora-rank", "2", "--out", str(tmp_path / "run"), "--no-progress", "--no-plot"])
    err = capsys.readouterr().err
    assert code != 0 and "has no chat template" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_dpo_on_message_records_renders_them_with_the_template(folder, tmp_path, capsys):
    """`finetune --dpo` with TRL's conversational records: the prompt and the answers rendered by
    text/chat.render with the folder's template (the ids of apply_chat_template), and it trains."""
    from pedestrian.interop.hf import load_hf_tokenizer
    from pedestrian.training.dpo import chat_renderer

    d, _ = folder
    prompt = [{"role": "user", "content": "Hello! How are you?"}]
    chosen, rejected = [{"role": "assistant", "content": "Fine."}], [{"role": "assistant", "content": "the dog"}]
    render = chat_renderer(d, load_hf_tokenizer(d))
    fast = fast_tokenizer("llama3")
    assert render(prompt + chosen, False) == list(fast.apply_chat_template(prompt + chosen, tokenize=True,
                                                                          return_dict=True)["input_ids"])
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n"
                             for _ in range(4)), encoding="utf-8")
    capsys.readouterr()
    assert cli.main(["finetune", "--hf-dir", str(d), "--dpo", str(pairs), "--lora-rank", "2", "--max-steps", "2",
                     "--batch-size", "2", "--context-length", "64", "--eval-interval", "2", "--eval-batches", "1",
                     "--out", str(tmp_path / "run"), "--no-progress", "--no-plot"]) == 0


def test_packed_conversations_measure_the_same_loss_and_train(folder, tmp_path):
    """--pack puts several conversations in a window; each attends only to itself from position
    0, so the validation loss (a mean over the same counted targets) is the one-a-row loss."""
    d, _ = folder
    data = write_chat(tmp_path / "chat.jsonl", CONVERSATIONS * 2)
    common = dict(hf_dir=str(d), data=str(data), lora_rank=2, max_steps=3, batch_size=2, context_length=100,
                  eval_interval=3, eval_batches=8, val_fraction=0.34, dtype="float64", progress=False, plot=False)
    one = finetune(FinetuneSettings(**common, out=str(tmp_path / "a")))
    packed = finetune(FinetuneSettings(**common, out=str(tmp_path / "b"), pack=True))
    # float64: the same products, summed in another order
    assert packed.initial_val_loss == pytest.approx(one.initial_val_loss, rel=1e-12)
    assert packed.val_loss < packed.initial_val_loss


def test_conversation_flags_on_plain_text_are_refused(folder, tmp_path, capsys):
    d, _ = folder
    text = tmp_path / "notes.txt"
    text.write_text("the quick brown fox. " * 50, encoding="utf-8")
    capsys.readouterr()
    code = cli.main(["finetune", "--hf-dir", str(d), "--data", str(text), "--train-on-all-tokens", "--lora-rank", "2",
                     "--out", str(tmp_path / "run"), "--no-progress", "--no-plot"])
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("error: --train-on-all-tokens applies to a conversations file")


def test_pack_with_dpo_is_refused_naming_dpo(folder, tmp_path, capsys):
    """--pack belongs to a conversations file; with --dpo the message says so (not "plain text")."""
    d, _ = folder
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n", encoding="utf-8")
    capsys.readouterr()
    code = cli.main(["finetune", "--hf-dir", str(d), "--dpo", str(pairs), "--pack", "--lora-rank", "2",
                     "--out", str(tmp_path / "run"), "--no-progress", "--no-plot"])
    err = capsys.readouterr().err
    assert code != 0 and "not to --dpo" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_run_folder_as_hf_dir_points_to_export_hf(folder, tmp_path, capsys):
    """A pedestrian run given as --hf-dir: the error names the merge that makes it a folder."""
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    capsys.readouterr()
    code = cli.main(["sample", "--hf-dir", str(run), "--prompt", "x"])
    err = capsys.readouterr().err
    assert code != 0 and "export-hf --adapter" in err and len(err.splitlines()) == 1

"""``pedestrian sample --hf-dir`` stops where the folder says, as transformers' ``generate``: at
``generation_config.json``'s ``eos_token_id`` (an int or a list), else ``config.json``'s -- on a
Llama-3-Instruct-shaped folder (``[<|end_of_text|>, <|eot_id|>]``, ``config.json`` naming only the
first) and a Qwen2-Instruct-shaped one (``<|im_end|>`` in ``config.json``, no generation config),
whose tokenizers also hold ``<|endoftext|>`` / ``<|end_of_text|>``, the names the old rule looked
for. The stop token is not printed. transformers (float64 model) is the oracle."""

from __future__ import annotations

import json

import pytest
from chat_fixtures import fast_tokenizer, greedy, hf_instruct_model, ids_of, stop_after, write_folder

from pedestrian import cli
from pedestrian.interop.hf_chat import eos_token_ids

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

PROMPT = "the quick brown"
N = 12


def sampled(capsys, d, *more) -> str:
    code = cli.main(["sample", "--hf-dir", str(d), "--prompt", PROMPT, "--max-new-tokens", str(N),
                     "--temperature", "0", "--dtype", "float64", *more])
    out, _ = capsys.readouterr()
    assert code == 0
    return out


@pytest.mark.parametrize("kind, seed, stop, generation_eos", [        # (seeds whose greedy runs vary)
    ("llama3", 0, "<|eot_id|>", ["<|end_of_text|>", "<|eot_id|>"]),  # a list, in generation_config.json
    ("qwen2", 1, "<|im_end|>", None),                                  # config.json's int
])
def test_sample_stops_at_the_folders_eos_as_generate(tmp_path, capsys, kind, seed, stop, generation_eos):
    hf = hf_instruct_model(kind, seed)
    tok = fast_tokenizer(kind)
    prompt_ids = tok(PROMPT)["input_ids"]              # Llama 3: <|begin_of_text|> first
    (stop_id,) = ids_of(kind, stop)
    stop_after(hf, prompt_ids, stop_id, 5)
    gen_eos = ids_of(kind, *generation_eos) if generation_eos else None
    d = write_folder(tmp_path / kind, kind, hf, generation_eos=gen_eos)
    eos = gen_eos or [hf.config.eos_token_id]
    assert eos_token_ids(d) == tuple(eos)
    want = greedy(hf, prompt_ids, N, eos=eos)
    assert want[-1] == stop_id and 5 <= len(want) < N     # transformers stopped at the end of the turn
    stopped = sampled(capsys, d)
    assert stopped == PROMPT + tok.decode(want[:-1], skip_special_tokens=True) + "\n"
    # the folder's ids, not the tokenizer's names: the old rule would stop at <|end_of_text|> /
    # <|endoftext|> only and run on past the turn
    hf_loaded = transformers_generate_from_folder(d, prompt_ids)
    assert hf_loaded == want                           # (generate reading the folder itself agrees)
    assert len(sampled(capsys, d, "--ignore-eot")) > len(stopped)      # runs on past the stop


def transformers_generate_from_folder(d, prompt_ids):
    """transformers' own reading of the folder: ``from_pretrained`` then ``generate`` with the
    generation config it loaded (greedy)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float64).eval()
    with torch.no_grad():
        out = model.generate(torch.as_tensor([prompt_ids]), max_new_tokens=N, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def test_eos_rules(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids(tmp_path) == (7,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert eos_token_ids(tmp_path) == (7,)                            # null: config.json's
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 9]}))
    assert eos_token_ids(tmp_path) == (3, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be a token id"):
        eos_token_ids(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").write_text("{}")
    assert eos_token_ids(tmp_path) == ()

"""`pedestrian sample` with several prompts (--prompt repeated, --prompts-file): one batch, each
continuation labelled and equal to that prompt's alone."""

from __future__ import annotations

import io

import pytest

from pedestrian.commands import sample as sample_cmd
from pedestrian.config import GPTConfig
from pedestrian.model import GPT
from pedestrian.text.tokenizer import CharTokenizer
from sample_helpers import parse

TEXT = "hello world, the quick brown fox jumps over the lazy dog.\n" * 4


@pytest.fixture(scope="module")
def char_setup():
    tok = CharTokenizer.from_text(TEXT)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=16, d_model=16, n_heads=2,
                          n_blocks=1), seed=3, dtype="float64")
    return model, tok


def _alone(model, tok, prompt: str) -> str:
    out = io.StringIO()
    sample_cmd.run_sample(model, tok, parse("--prompt", prompt, "--max-new-tokens", "20",
                                            "--temperature", "0"), out=out)
    return out.getvalue()


def test_several_prompts_are_labelled_and_equal_each_alone(char_setup):
    model, tok = char_setup
    prompts = ["h", "the q", "over the lazy"]           # 1, 5 and 13 characters; 13 + 20 > 16
    out = io.StringIO()
    argv = [a for p in prompts for a in ("--prompt", p)]
    assert sample_cmd.run_sample(model, tok, parse(*argv, "--max-new-tokens", "20", "--temperature", "0"),
                                 out=out) == 0
    text = out.getvalue()
    for i, p in enumerate(prompts):
        assert f"--- prompt {i + 1} ---\n" + _alone(model, tok, p) in text


def test_prompts_file_and_num_samples(char_setup, tmp_path):
    model, tok = char_setup
    f = tmp_path / "prompts.txt"
    f.write_text("\ufeffthe\n\nfox\n", encoding="utf-8")  # a BOM and an empty line are skipped
    out = io.StringIO()
    sample_cmd.run_sample(model, tok, parse("--prompts-file", str(f), "--num-samples", "2",
                                            "--max-new-tokens", "5", "--temperature", "0"), out=out)
    labels = [line for line in out.getvalue().splitlines() if line.startswith("---")]
    assert labels == ["--- prompt 1, sample 1 ---", "--- prompt 1, sample 2 ---",
                      "--- prompt 2, sample 1 ---", "--- prompt 2, sample 2 ---"]


def test_bad_prompts_file(char_setup, tmp_path):
    model, tok = char_setup
    with pytest.raises(ValueError, match="no such file"):
        sample_cmd.run_sample(model, tok, parse("--prompts-file", str(tmp_path / "none.txt")))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no prompt"):
        sample_cmd.run_sample(model, tok, parse("--prompts-file", str(empty)))
    with pytest.raises(ValueError, match="--prompt 2 has 1 character"):
        sample_cmd.run_sample(model, tok, parse("--prompt", "he", "--prompt", "h€"))

"""`pedestrian sample`: streaming output, UTF-8 hold-back, stop tokens, bad input, the CLI wiring.

Stop strings as text: tests/test_stop_strings.py."""

from __future__ import annotations

import io

import numpy as np
import pytest

from pedestrian.generation.sampling import Sampling
from pedestrian import cli
from pedestrian.commands import sample as sample_cmd
from pedestrian.config import GPTConfig
from pedestrian.generation.generate import generate
from pedestrian.model import GPT
from pedestrian.text.tokenizer import BPETokenizer, CharTokenizer, bytes_to_unicode
from sample_helpers import Chunks, forced_model, parse

TEXT = "hello world, the quick brown fox jumps over the lazy dog.\n" * 4


@pytest.fixture(scope="module")
def char_setup():
    tok = CharTokenizer.from_text(TEXT)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=32, d_model=16, n_heads=2,
                          n_blocks=1), seed=3)
    return model, tok


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(TEXT, vocab_size=300)


def byte_id(tok: BPETokenizer, b: int) -> int:
    return tok.hf.token_to_id(bytes_to_unicode()[b])


# ------------------------------------------------------------------ streaming, char tokenizer
def test_prints_prompt_then_generated_text(char_setup):
    model, tok = char_setup
    out = Chunks()
    args = parse("--prompt", "the ", "--max-new-tokens", "20", "--temperature", "0.9",
                 "--top-k", "5", "--seed", "7")
    assert sample_cmd.run_sample(model, tok, args, out=out) == 0
    ids = generate(model, np.array([tok.encode("the ")]), 20, Sampling(temperature=0.9, top_k=5, seed=7))
    assert out.getvalue() == "the " + tok.decode(ids[0, 4:]) + "\n"
    assert len(out.chunks) >= 20                      # printed token by token, not at the end
    # same seed, same text
    again = Chunks()
    sample_cmd.run_sample(model, tok, args, out=again)
    assert again.getvalue() == out.getvalue()


def test_num_samples_and_greedy(char_setup):
    model, tok = char_setup
    out = io.StringIO()
    sample_cmd.run_sample(model, tok, parse("--prompt", "he", "--max-new-tokens", "8",
                                            "--temperature", "0", "--num-samples", "3"), out=out)
    text = out.getvalue()
    assert text.count("--- sample") == 3
    bodies = [part.split("\n", 1)[1] for part in text.split("--- sample")[1:]]
    assert len(set(bodies)) == 1                      # greedy: three identical samples
    greedy = generate(model, np.array([tok.encode("he")]), 8, Sampling(temperature=0))
    assert bodies[0] == "he" + tok.decode(greedy[0, 2:]) + "\n"


def test_no_cache_flag_gives_same_text(char_setup):
    model, tok = char_setup
    a, b = io.StringIO(), io.StringIO()
    common = ("--prompt", "fox", "--max-new-tokens", "40", "--seed", "1", "--top-p", "0.9")
    sample_cmd.run_sample(model, tok, parse(*common), out=a)
    sample_cmd.run_sample(model, tok, parse(*common, "--no-cache"), out=b)
    assert a.getvalue() == b.getvalue()               # 40 new tokens: past the context of 32


# ------------------------------------------------------------------ byte-level BPE: UTF-8 hold-back
def test_partial_utf8_is_held_back(bpe):
    target = "é😀"                                     # 2-byte and 4-byte characters
    raw = target.encode("utf-8")
    eot = bpe.special_tokens["<|endoftext|>"]
    chain = [bpe.encode("a")[0]] + [byte_id(bpe, b) for b in raw] + [eot]
    model = forced_model(bpe, chain)
    out = Chunks()
    code = sample_cmd.run_sample(model, bpe, parse("--prompt", "a", "--max-new-tokens", "20",
                                                   "--temperature", "0"), out=out)
    assert code == 0
    assert out.getvalue() == "a" + target + "\n"      # stopped at <|endoftext|>, not printed
    assert "\ufffd" not in out.getvalue()
    for chunk in out.chunks:                           # every chunk is whole characters
        assert chunk.encode("utf-8").decode("utf-8") == chunk
    assert [c for c in out.chunks if c] == ["a", "é", "😀", "\n"]


def test_cut_off_character_at_the_end_prints_replacement_not_crash(bpe):
    chain = [bpe.encode("a")[0]] + [byte_id(bpe, b) for b in "😀".encode("utf-8")]
    model = forced_model(bpe, chain)
    out = io.StringIO()
    sample_cmd.run_sample(model, bpe, parse("--prompt", "a", "--max-new-tokens", "2",
                                            "--temperature", "0"), out=out)
    assert out.getvalue() == "a\ufffd\n"              # 2 of 4 bytes: flushed as U+FFFD at the end


def test_empty_prompt_starts_from_endoftext_for_bpe(bpe):
    eot = bpe.special_tokens["<|endoftext|>"]
    chain = [eot, bpe.encode("h")[0], bpe.encode("i")[0], eot]
    model = forced_model(bpe, chain)
    out = io.StringIO()
    sample_cmd.run_sample(model, bpe, parse("--prompt", "", "--temperature", "0",
                                            "--max-new-tokens", "10"), out=out)
    assert out.getvalue() == "hi\n"
    # --ignore-eot: the end-of-text token does not stop generation (and is not printed)
    out = io.StringIO()
    sample_cmd.run_sample(model, bpe, parse("--prompt", "", "--temperature", "0",
                                            "--max-new-tokens", "5", "--ignore-eot"), out=out)
    assert out.getvalue() == "hihi\n"


def test_stop_text_and_stop_id(char_setup):
    model, tok = char_setup
    free = io.StringIO()
    sample_cmd.run_sample(model, tok, parse("--prompt", "o", "--max-new-tokens", "30",
                                            "--temperature", "0"), out=free)
    body = free.getvalue()[1:-1]
    stop_char = body[3]
    cut = body.index(stop_char)
    for flag, value in (("--stop", stop_char), ("--stop-id", str(tok.encode(stop_char)[0]))):
        out = io.StringIO()
        sample_cmd.run_sample(model, tok, parse("--prompt", "o", "--max-new-tokens", "30",
                                                "--temperature", "0", flag, value), out=out)
        assert out.getvalue() == "o" + body[:cut] + "\n"
    with pytest.raises(ValueError, match="--stop needs a non-empty text"):
        sample_cmd.run_sample(model, tok, parse("--prompt", "o", "--stop", ""), out=io.StringIO())


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("argv, match", [
    (("--prompt", "hi", "--temperature", "-1"), "temperature"),
    (("--prompt", "hi", "--top-p", "0"), r"--top-p must be in \(0, 1\]"),
    (("--prompt", "hi", "--top-p", "1.5"), "got 1.5"),
    (("--prompt", "hi", "--top-k", "0"), "--top-k"),
    (("--prompt", "hi", "--max-new-tokens", "-2"), "max-new-tokens"),
    (("--prompt", "hi", "--num-samples", "0"), "num-samples"),
    (("--prompt", "hi", "--window-shift", "0"), "window_shift"),
    (("--prompt", "hi", "--min-p", "1.5"), r"--min-p must be in \[0, 1\]"),
    (("--prompt", "hi", "--min-p", "-0.1"), r"--min-p must be in \[0, 1\]"),
    (("--prompt", "hi", "--repetition-penalty", "0"), "--repetition-penalty must be a finite number > 0"),
    (("--prompt", "hi", "--repetition-penalty", "-1.2"), "--repetition-penalty"),
    (("--prompt", "hi", "--repetition-penalty", "nan"), "--repetition-penalty"),
    (("--prompt", "hi", "--repetition-penalty", "inf"), "--repetition-penalty"),
    (("--prompt", "héllo"), "characters that occur in its training text"),   # unknown character
    (("--prompt", ""), "the --prompt is empty"),                         # char model: no <|endoftext|>
    ((), "no --prompt was given, so the prompt is empty"),               # none at all: says so
])
def test_bad_input_is_a_clear_error(char_setup, argv, match):
    model, tok = char_setup
    with pytest.raises(ValueError, match=match):
        sample_cmd.run_sample(model, tok, parse(*argv), out=io.StringIO())


def test_long_prompt_keeps_last_tokens_with_warning(char_setup):
    model, tok = char_setup
    prompt = TEXT[:50]                                 # 50 characters > context 32
    out, err = io.StringIO(), io.StringIO()
    sample_cmd.run_sample(model, tok, parse("--prompt", prompt, "--max-new-tokens", "5",
                                            "--temperature", "0"), out=out, err=err)
    assert err.getvalue().startswith("warning: ") and "only the last 32 condition" in err.getvalue()
    ids = generate(model, np.array([tok.encode(prompt[-32:])]), 5, Sampling(temperature=0))
    assert out.getvalue() == prompt + tok.decode(ids[0, 32:]) + "\n"


# ------------------------------------------------------------------ the command line end to end
def test_cli_with_a_real_checkpoint(char_setup, tmp_path, capsys):
    from pedestrian.checkpoint import save_checkpoint

    model, tok = char_setup
    save_checkpoint(tmp_path / "ckpt", model, tokenizer=tok, step=1)
    code = cli.main(["sample", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "the",
                     "--max-new-tokens", "12", "--temperature", "0.8", "--top-k", "4",
                     "--top-p", "0.95", "--seed", "3", "--stats"])
    captured = capsys.readouterr()
    assert code == 0
    ids = generate(model, np.array([tok.encode("the")]), 12, Sampling(temperature=0.8, top_k=4, top_p=0.95, seed=3))
    assert captured.out == "the" + tok.decode(ids[0, 3:]) + "\n"
    assert "tokens/s" in captured.err


def test_cli_errors_are_one_line(char_setup, tmp_path, capsys):
    from pedestrian.checkpoint import save_checkpoint

    model, tok = char_setup
    save_checkpoint(tmp_path / "ckpt", model, tokenizer=tok, step=1)
    code = cli.main(["sample", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "hi",
                     "--top-p", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "--top-p" in err and "Traceback" not in err
    code = cli.main(["sample", "--checkpoint", str(tmp_path / "missing"), "--prompt", "hi"])
    assert code == 2 and capsys.readouterr().err.startswith("error: ")


def test_cli_needs_a_model_source(capsys):
    assert cli.main(["sample", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--checkpoint" in err and "--hf-dir" in err


# ------------------------------------------------------------------ repetition penalty, min-p
def test_penalty_and_min_p_reach_generate(char_setup):
    model, tok = char_setup
    # this random model's logits are small (near-uniform): strong settings, to change the text
    for extra, kw in ((("--repetition-penalty", "20"), dict(repetition_penalty=20.0)),
                      (("--min-p", "0.97"), dict(min_p=0.97)),
                      (("--repetition-penalty", "0.05", "--min-p", "0.5", "--top-k", "9"),
                       dict(repetition_penalty=0.05, min_p=0.5, top_k=9))):
        out = io.StringIO()
        sample_cmd.run_sample(model, tok, parse("--prompt", "the ", "--max-new-tokens", "40",
                                                "--seed", "2", *extra), out=out)
        ids = generate(model, np.array([tok.encode("the ")]), 40, seed=2, **kw)
        assert out.getvalue() == "the " + tok.decode(ids[0, 4:]) + "\n"
        plain = generate(model, np.array([tok.encode("the ")]), 40, Sampling(seed=2))
        assert not np.array_equal(ids, plain), extra               # the setting changed the text


def test_help_shows_the_sampling_controls(capsys):
    with pytest.raises(SystemExit):
        cli.main(["sample", "--help"])
    text = " ".join(capsys.readouterr().out.split())            # whatever the line breaks
    for needle in ("--repetition-penalty 1.2", "--min-p 0.05", "--stop $'\\n\\n'",
                   "repetition penalty -> temperature -> top-k -> top-p -> min-p",
                   "neither the stop token nor the stop text is printed",
                   "a model whose vocabulary is larger than its tokenizer's"):
        assert needle in text, needle


# ------------------------------------------------------------------ a padded vocabulary
@pytest.fixture(scope="module")
def padded_setup():
    """A char model with 128 ids for a tokenizer of far fewer, whose padded ids are the most
    likely (a checkpoint with vocab_size=128 and the Shakespeare tokenizer, issue 13)."""
    tok = CharTokenizer.from_text(TEXT)
    model = GPT(GPTConfig(vocab_size=128, context_length=32, d_model=16, n_heads=2, n_blocks=1,
                          tie_weights=False), seed=4)
    model.params["logits.bias"][tok.vocab_size:] += 5.0
    free = generate(model, np.array([tok.encode("the")] * 8), 40, Sampling(seed=0))
    assert (free[:, 3:] >= tok.vocab_size).mean() > 0.5           # unmasked: mostly undecodable
    return model, tok


def test_padded_vocabulary_never_samples_undecodable_ids(padded_setup):
    model, tok = padded_setup
    out = io.StringIO()
    code = sample_cmd.run_sample(model, tok, parse("--prompt", "the", "--max-new-tokens", "150",
                                                   "--num-samples", "40", "--seed", "1"), out=out)
    assert code == 0
    bodies = out.getvalue().split("--- sample ")[1:]
    assert len(bodies) == 40
    assert sum(len(b.split("\n", 1)[1]) for b in bodies) > 40 * 150  # every sample ran in full
    assert set(out.getvalue()) <= set(tok.chars) | set("-0123456789 \n")


def test_padded_vocabulary_cli_end_to_end(padded_setup, tmp_path, capsys):
    from pedestrian.checkpoint import save_checkpoint

    model, tok = padded_setup
    save_checkpoint(tmp_path / "ckpt", model, tokenizer=tok, step=1)
    for extra in ((), ("--temperature", "0"), ("--top-p", "0.9", "--min-p", "0.02")):
        code = cli.main(["sample", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "the",
                         "--max-new-tokens", "200", "--seed", "3", *extra])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        assert captured.out.startswith("the") and len(captured.out) == 3 + 200 + 1
        assert set(captured.out) <= set(tok.chars) | {"\n"}


# ------------------------------------------------------------------ non-finite weights
def test_nan_weights_are_one_error_line(char_setup, monkeypatch, capsys):
    model, tok = char_setup
    broken = GPT(model.config, seed=3)
    broken.params["blocks.0.attn.q.weight"][0, 0] = np.nan
    monkeypatch.setattr(sample_cmd, "_load_model", lambda args: (broken, tok, None))
    code = cli.main(["sample", "--checkpoint", "unused", "--prompt", "the fox", "--max-new-tokens", "50"])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith("error: the logits hold NaN (row 0: ") and "non-finite weights" in captured.err
    assert len(captured.err.splitlines()) == 1
    assert "\n" not in captured.out.removeprefix("the fox")          # no page of id-0 characters

"""Messages a new user meets on the command line: one line, CLI terms (flags, not Python
arguments), printed before any output, and no tracebacks or raw Python warnings."""

from __future__ import annotations

import numpy as np
import pytest

from pedestrian.checkpoint import save_checkpoint
from pedestrian.cli import main
from pedestrian.config import GPTConfig
from pedestrian.model import GPT
from pedestrian.text.tokenizer import CharTokenizer


def _one_line_error(capsys, *fragments) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return out


@pytest.fixture
def char_ckpt(tmp_path):
    tok = CharTokenizer.from_text("abcdefgh \n")
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=8, d_model=8, n_heads=2, n_blocks=1), seed=1)
    return save_checkpoint(tmp_path / "ckpt", model, None, tok, step=1)


def test_demo_validates_its_flags(capsys):
    assert main(["demo", "--step", "0"]) == 2
    _one_line_error(capsys, "--step must be a finite number > 0")
    assert main(["demo", "--rtol", "-1"]) == 2
    _one_line_error(capsys, "--rtol must be a finite number >= 0")
    for n in ("0", "-1"):
        assert main(["demo", "--entries", n]) == 2
        _one_line_error(capsys, "--entries must be a positive integer")


def test_demo_shows_no_relative_error_for_a_zero_gradient(capsys):
    assert main(["demo", "--check", "fd", "--entries", "2"]) == 0
    out = capsys.readouterr().out
    k_bias = [line for line in out.splitlines() if line.startswith("∂L/∂b_k") and "block 0" in line][0]
    assert k_bias.split()[-1] == "rounding", k_bias   # its gradient is identically 0 (section 3)
    assert "e+" not in out.split("check\n")[1]        # no absurd 1e+283 anywhere
    assert "-> OK" in out


def test_sample_cli_messages(char_ckpt, capsys):
    ckpt = str(char_ckpt)
    assert main(["sample", "--checkpoint", ckpt, "--prompt", "xyz"]) == 2
    _one_line_error(capsys, "use only characters that occur in its training text", "--tokenizer bpe")
    assert main(["sample", "--checkpoint", ckpt, "--prompt", "ab", "--top-p", "1.5"]) == 2
    _one_line_error(capsys, "--top-p must be in (0, 1]", "got 1.5")
    assert main(["sample", "--checkpoint", ckpt, "--prompt", "ab", "--stop-id", "999"]) == 2
    assert _one_line_error(capsys, "--stop-id 999", "0 ... 9") == ""          # nothing printed first


def test_long_prompt_warns_in_one_line_before_generating(char_ckpt, capsys):
    with _no_python_warning():
        assert main(["sample", "--checkpoint", str(char_ckpt), "--prompt", "abcdefghabcd",
                     "--max-new-tokens", "3", "--seed", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("abcdefghabcd")
    assert err.strip().splitlines() == [
        "warning: the prompt has 12 tokens but the model's context is 8: only the last 8 condition the "
        "generation"]


class _no_python_warning:
    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self.records = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)
        assert not [w for w in self.records if issubclass(w.category, UserWarning)], self.records
        return False


def test_params_validates_before_printing(capsys):
    assert main(["params", "--preset", "gpt2", "--lora-rank", "0"]) == 2
    assert _one_line_error(capsys, "--lora-rank must be a positive integer") == ""


def test_eval_on_a_short_file_names_the_evaluated_part(char_ckpt, tmp_path, capsys):
    one = tmp_path / "one.txt"
    one.write_text("abcdefgh", encoding="utf-8")
    assert main(["eval", str(char_ckpt), "--data", str(one), "--no-progress"]) == 2
    _, err = capsys.readouterr()
    assert "training split" not in err and "val part" in err and "--split all" in err
    assert main(["eval", str(char_ckpt), "--data", str(one), "--split", "all", "--no-progress"]) == 0
    assert "all loss" in capsys.readouterr().out
    assert main(["eval", str(char_ckpt), "--data", str(one), "--split", "all"]) == 0    # shorter than a window:
    assert "batch" not in capsys.readouterr().err                                       # no empty bar ("0batch")


def test_sample_piped_into_head_ends_quietly(char_ckpt):
    """`pedestrian sample ... | head -c 20` for real: once the reader is gone the command stops
    with status 141 (a shell's status for SIGPIPE) and prints no traceback (it printed one, exit 1).
    20,000 tokens take seconds to stream: the reader closes long before the end."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"), PEDESTRIAN_DEBUG="")
    argv = [sys.executable, "-m", "pedestrian", "sample", "--checkpoint", str(char_ckpt), "--prompt", "ab",
            "--max-new-tokens", "20000"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.read(20)
    proc.stdout.close()                                    # what `head -c 20` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert len(first) == 20 and err == "", err


def test_any_command_whose_stdout_closes_ends_quietly(monkeypatch, capsys):
    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    monkeypatch.setattr("sys.stdout", Closed())
    assert main(["explain"]) == 141
    assert capsys.readouterr().err == ""


def test_missing_hf_dir_says_how_to_get_one(tmp_path, capsys):
    """The README's `--hf-dir gpt2` is a local folder; without it the one line says where one
    comes from (it said only 'gpt2 is not a directory')."""
    for command in (["sample", "--prompt", "a"], ["finetune", "--data", str(tmp_path), "--lora-rank", "2"]):
        assert main([command[0], "--hf-dir", str(tmp_path / "gpt2"), *command[1:]]) == 2
        _one_line_error(capsys, "is not a directory", "hf download gpt2 --local-dir gpt2", "pedestrian export-hf")


@pytest.mark.parametrize("argv, fragment", [
    (["train", "--max-steps", "many"], "pedestrian train: argument --max-steps: invalid int value: 'many'"),
    (["trian"], "invalid choice: 'trian'"),
    (["export-hf", "--out", "x"], "one of the arguments --checkpoint --adapter is required"),
])
def test_flags_argparse_cannot_read_are_one_error_line(argv, fragment, capsys):
    """A value argparse rejects is one `error:` line naming the command's --help, exit status 2
    (it printed the usage block first)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    _one_line_error(capsys, fragment, "--help`")

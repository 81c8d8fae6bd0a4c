"""`pedestrian train` / `pedestrian eval` from the command line: settings from flags and TOML,
resume, and every bad input ending in one clear line, a non-zero exit, and no damage on disk."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from cli_helpers import one_line_error, write_fox_corpus

from pedestrian.cli import build_parser, main
from pedestrian.training.settings import settings_from_args
from pedestrian.training import TrainSettings, read_log

REPO = Path(__file__).resolve().parents[2]
TINY = ["--context-length", "16", "--d-model", "16", "--n-heads", "2", "--n-blocks", "2", "--batch-size", "4",
        "--eval-interval", "3", "--eval-batches", "2", "--warmup-steps", "2", "--lr", "1e-2",
        "--max-minutes", "0", "--no-progress", "--no-plot"]


@pytest.fixture
def corpus(tmp_path):
    return write_fox_corpus(tmp_path / "corpus.txt", 200)


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


_one_line_error = one_line_error


@pytest.fixture
def run(corpus, tmp_path, capsys):
    """A finished 6-step run in tmp_path/run; returns its folder."""
    out = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(out), "--max-steps", "6", *TINY]) == 0
    capsys.readouterr()
    return out


def test_train_eval_resume(run, corpus, capsys):
    state = json.loads((run / "latest" / "state.json").read_text())
    assert state["step"] == 6 and state["config"]["d_model"] == 16
    assert state["meta"]["settings"]["data"] == str(corpus.resolve())
    assert (run / "best" / "state.json").is_file()
    assert main(["eval", str(run), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "val loss" in out and "nats per character" in out
    # resume to a larger max_steps: no other setting needed, and no conflict
    assert main(["train", "--out", str(run), "--resume", "--max-steps", "8", "--no-progress", "--no-plot"]) == 0
    steps = [r["step"] for r in read_log(run / "log.jsonl") if "loss" in r]
    assert steps == list(range(1, 9))
    # finished runs say so
    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 2
    assert "already reaches --max-steps" in _one_line_error(capsys)


def test_resume_honours_no_progress_and_no_sample_of_the_resume_command(run, capsys):
    """--no-progress and --no-sample belong to the invocation (PER_RUN_SETTINGS; --no-sample is the
    command's own flag): given on the --resume command line they hold there, the resume command
    printed at the end repeats them (issue 22: copying it used to drop them), and a resume without
    them shows the bar and the samples again, whatever the first run was given."""
    import re

    def bar(err: str) -> bool:
        return any(line.startswith("train") for line in re.split(r"[\r\n]", err))

    assert main(["train", "--out", str(run), "--resume", "--max-steps", "8", "--no-progress", "--no-sample",
                 "--no-plot"]) == 0
    captured = capsys.readouterr()
    assert not bar(captured.err) and "--- sample" not in captured.out, captured
    # the command it prints to go on repeats them (they come from the command, not the checkpoint)
    assert f"train on: pedestrian train --out {run} --resume --no-progress --no-plot --no-sample --max-steps 16" \
        in captured.out.splitlines(), captured.out
    assert main(["train", "--out", str(run), "--resume", "--max-steps", "10", "--no-plot"]) == 0
    captured = capsys.readouterr()
    assert bar(captured.err) and "--- sample 1 ---" in captured.out, captured
    assert [r["step"] for r in read_log(run / "log.jsonl") if "loss" in r] == list(range(1, 11))


def test_toml_config_and_flag_priority(tmp_path, corpus, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"""
data = "{corpus}"
max_steps = 10
[model]
context_length = 16
d_model = 16
n_heads = 2
n_blocks = 2
dropout = 0.1
[optim]
lr = 5e-3
batch_size = 4
""")
    out = tmp_path / "r"
    rc = main(["train", "--config", str(cfg), "--max-steps", "3", "--out", str(out), "--no-progress",
               "--no-plot", "--eval-batches", "1"])
    assert rc == 0
    s = json.loads((out / "latest" / "state.json").read_text())["meta"]["settings"]
    assert s["max_steps"] == 3 and s["lr"] == 5e-3 and s["model"]["dropout"] == 0.1 and s["batch_size"] == 4


def test_bundled_config_file_is_the_default_run():
    """configs/shakespeare_char.toml spells out exactly what `pedestrian train` does."""
    parser = build_parser()
    from_file, _ = settings_from_args(parser.parse_args(["train", "--config", str(REPO / "configs" / "shakespeare_char.toml")]))
    default, explicit = settings_from_args(parser.parse_args(["train"]))
    assert explicit == set()
    assert from_file.to_dict() == default.to_dict() == TrainSettings().to_dict()


# ------------------------------------------------------------------------------ bad input
def _bad(capsys, argv, expect, protect: Path | None = None):
    before = _snapshot(protect) if protect else None
    rc = main(argv)
    assert rc == 2
    msg = _one_line_error(capsys)
    assert expect in msg, msg
    if protect:
        assert _snapshot(protect) == before
    return msg


def test_missing_corpus(tmp_path, capsys):
    msg = _bad(capsys, ["train", "--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o"), *TINY],
               "corpus not found")
    assert "nope.txt" in msg
    assert not (tmp_path / "o").exists()


def test_empty_corpus(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("  \n\n ")
    _bad(capsys, ["train", "--data", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o"), *TINY],
         "contains no text")
    (tmp_path / "folder").mkdir()
    _bad(capsys, ["train", "--data", str(tmp_path / "folder"), "--out", str(tmp_path / "o"), *TINY],
         "no *.txt files")
    assert not (tmp_path / "o").exists()


def test_non_utf8_corpus(tmp_path, capsys):
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait, ".encode("latin-1") * 20)
    _bad(capsys, ["train", "--data", str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "o"), *TINY],
         "not valid UTF-8")


def test_corpus_shorter_than_one_window(tmp_path, capsys):
    (tmp_path / "short.txt").write_text("to be or not to be, that is the question")   # 41 chars
    msg = _bad(capsys, ["train", "--data", str(tmp_path / "short.txt"), "--out", str(tmp_path / "o"), *TINY],
               "too short")
    assert "context_length + 1 = 17" in msg


def test_existing_run_is_not_overwritten(run, corpus, capsys):
    _bad(capsys, ["train", "--data", str(corpus), "--out", str(run), "--max-steps", "6", *TINY],
         "already holds a checkpoint", protect=run)


def test_checkpoint_from_a_different_config(run, corpus, capsys, tmp_path):
    msg = _bad(capsys, ["train", "--out", str(run), "--resume", "--d-model", "32", "--no-progress"],
               "different config", protect=run)
    assert "--d-model 16 (you gave 32)" in msg
    _bad(capsys, ["train", "--out", str(run), "--resume", "--lr", "0.5", "--no-progress"],
         "different config", protect=run)
    # evaluating it on a text with characters its tokenizer never saw
    (tmp_path / "greek.txt").write_text("αβγδ " * 200, encoding="utf-8")
    _bad(capsys, ["eval", str(run), "--data", str(tmp_path / "greek.txt"), "--no-progress"],
         "not in the CharTokenizer vocabulary", protect=run)


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "state"])
def test_damaged_checkpoint(run, capsys, damage):
    target = run / "latest" / ("state.json" if damage == "state" else "model.safetensors")
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "corrupt":
        target.write_bytes(data[:-64] + bytes(64))
    else:
        target.write_bytes(data[:100])
    for argv in (["eval", str(run), "--no-progress"],
                 ["train", "--out", str(run), "--resume", "--max-steps", "9", "--no-progress"]):
        msg = _bad(capsys, argv, "re-run training", protect=run)
        assert "truncated" in msg or "corrupted" in msg
    assert (run / "best" / "state.json").is_file()       # the other checkpoint is untouched


def test_unknown_flag_values(tmp_path, corpus, capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--tokenizer", "words"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "invalid choice: 'words'" in err
    with pytest.raises(SystemExit):
        main(["train", "--max-steps", "many"])
    assert "invalid int value" in capsys.readouterr().err
    with pytest.raises(SystemExit):                      # removed: says so, and what replaced it
        main(["train", "--data-parallel", "off"])
    assert "--data-parallel was removed" in capsys.readouterr().err
    _bad(capsys, ["train", "--data", str(corpus), "--lr", "-1", *TINY[:-6]], "--lr must be a finite number > 0")
    _bad(capsys, ["train", "--data", str(corpus), "--batch-size", "0"], "--batch-size must be a positive integer")
    _bad(capsys, ["train", "--data", str(corpus), "--vocab-size", "50"], "set by the tokenizer")
    cfg = tmp_path / "bad.toml"
    cfg.write_text('tokenizer = "words"\n')
    _bad(capsys, ["train", "--config", str(cfg)], "--tokenizer must be 'char' or 'bpe'")
    cfg.write_text("learning_rate = 3\n")
    _bad(capsys, ["train", "--config", str(cfg)], "unknown setting 'learning_rate'")
    cfg.write_text('data_parallel = "off"\n')
    _bad(capsys, ["train", "--config", str(cfg)], "'data_parallel' was removed")
    cfg.write_text("lr = \n")
    _bad(capsys, ["train", "--config", str(cfg)], "not valid TOML")
    _bad(capsys, ["train", "--config", str(tmp_path / "missing.toml")], "config file not found")
    _bad(capsys, ["eval", str(tmp_path / "no_run")], "no checkpoint at")
    assert not (REPO / "runs" / "corpus_char").exists()


def test_bpe_tokenizer_run(corpus, tmp_path, capsys):
    out = tmp_path / "bpe"
    assert main(["train", "--data", str(corpus), "--out", str(out), "--tokenizer", "bpe", "--bpe-vocab-size", "300",
                 "--max-steps", "3", *TINY]) == 0
    state = json.loads((out / "latest" / "state.json").read_text())
    assert state["tokenizer"]["kind"] == "bpe" and state["config"]["vocab_size"] == 300
    capsys.readouterr()
    assert main(["eval", str(out), "--no-progress"]) == 0
    assert "nats per token" in capsys.readouterr().out


def test_a_relative_data_path_is_recorded_absolute(corpus, tmp_path, capsys, monkeypatch):
    """A run started with --data given relative to the working folder is resumed and evaluated
    from another folder (the record holds the absolute path), also with --data spelled anew."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--data", corpus.name, "--out", "run", "--max-steps", "2", *TINY]) == 0
    assert json.loads((tmp_path / "run" / "latest" / "state.json").read_text())["meta"]["settings"]["data"] \
        == str(corpus.resolve())
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert main(["train", "--out", "../run", "--resume", "--max-steps", "3", "--no-progress", "--no-plot"]) == 0
    assert main(["train", "--out", "../run", "--resume", "--data", f"../{corpus.name}", "--max-steps", "4",
                 "--no-progress", "--no-plot"]) == 0
    assert main(["eval", "../run", "--no-progress"]) == 0


def test_resume_without_a_checkpoint(tmp_path, capsys):
    _bad(capsys, ["train", "--out", str(tmp_path / "fresh"), "--resume", "--no-progress"], "no checkpoint at")
    assert not (tmp_path / "fresh").exists()


def test_resume_accepts_the_same_settings_again(run, corpus, capsys):
    """Repeating the original flags (or derived widths like --d-head) on resume is no conflict."""
    assert main(["train", "--data", str(corpus), "--out", str(run), "--resume", "--max-steps", "7",
                 "--d-head", "8", *TINY]) == 0
    msg = _bad(capsys, ["train", "--out", str(run), "--resume", "--max-steps", "9", "--n-blocks", "3",
                        "--no-progress"], "different config", protect=run)
    assert "--n-blocks 2 (you gave 3)" in msg and "d-model" not in msg


# ------------------------------------------------------------------------- new-user fixes
def test_end_of_run_prints_samples_and_where_things_are(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(out), "--max-steps", "3", *TINY]) == 0
    stdout = capsys.readouterr().out
    assert "--- sample 1 ---" in stdout and "--- sample 2 ---" in stdout
    assert str(out / "log.jsonl") in stdout and f"pedestrian sample --checkpoint {out / 'best'}" in stdout
    assert f"pedestrian train --out {out} --resume" in stdout
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "r2"), "--max-steps", "3",
                 "--no-sample", *TINY]) == 0
    assert "--- sample" not in capsys.readouterr().out


def test_overwrite_keeps_the_old_run_until_the_first_checkpoint(run, corpus, capsys, monkeypatch):
    import pedestrian.training.loop as loop_module

    before = _snapshot(run)
    real, calls = loop_module.train_step, [0]

    def crash_at_step_2(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("simulated crash")
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(loop_module, "train_step", crash_at_step_2)
        with pytest.raises(RuntimeError):
            main(["train", "--data", str(corpus), "--out", str(run), "--overwrite", "--max-steps", "6", *TINY])
    assert _snapshot(run) == before                  # old log and checkpoints untouched, no .new left
    # resuming the old run after the aborted overwrite: only its own log records
    assert main(["train", "--out", str(run), "--resume", "--max-steps", "8", "--no-progress", "--no-plot",
                 "--no-sample"]) == 0
    assert [r["step"] for r in read_log(run / "log.jsonl") if "loss" in r] == list(range(1, 9))
    # a completed overwrite replaces the log (and best/) with the new run's
    assert main(["train", "--data", str(corpus), "--out", str(run), "--overwrite", "--max-steps", "4",
                 "--checkpoint-interval", "1", "--no-sample", *TINY]) == 0
    assert [r["step"] for r in read_log(run / "log.jsonl") if "loss" in r] == [1, 2, 3, 4]
    assert json.loads((run / "best" / "state.json").read_text())["step"] == 3
    assert not (run / "log.jsonl.new").exists()


def test_ctrl_c_saves_and_says_how_to_resume(corpus, tmp_path, capsys, monkeypatch):
    from cli_helpers import ctrl_c_at_step

    ctrl_c_at_step(monkeypatch, 2)
    out = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(out), "--max-steps", "6", *TINY]) == 130
    err = capsys.readouterr().err
    assert f"checkpoint of step 2 is saved in {out / 'latest'}" in err
    assert f"pedestrian train --out {out} --resume" in err
    assert json.loads((out / "latest" / "state.json").read_text())["step"] == 2


def test_progress_bar_never_shows_val_nan(corpus, tmp_path, capsys):
    import re

    argv = ["train", "--data", str(corpus), "--out", str(tmp_path / "run"), "--max-steps", "2", *TINY,
            "--eval-interval", "100", "--no-sample"]
    argv.remove("--no-progress")
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "nan" not in err
    last_bar = [line for line in re.split(r"[\r\n]", err) if line.startswith("train")][-1]
    assert re.search(r"val \d\.\d{4}", last_bar), last_bar        # updated after the final validation


def test_progress_bar_draws_each_steps_own_loss(corpus, tmp_path, capsys, monkeypatch):
    """Every frame of the bar shows the loss of the step it counts (it showed the step before's:
    the loss was set after the update that drew the frame). Frames drawn at every update here."""
    import re

    from pedestrian.training import loop, read_log

    make = loop.Trainer._progress_bar

    def every_update(self):
        bar = make(self)
        bar.mininterval, bar.miniters = 0, 0
        return bar

    monkeypatch.setattr(loop.Trainer, "_progress_bar", every_update)
    argv = ["train", "--data", str(corpus), "--out", str(tmp_path / "run"), "--max-steps", "3", *TINY,
            "--eval-interval", "100", "--no-sample"]
    argv.remove("--no-progress")
    assert main(argv) == 0
    frames = [line for line in re.split(r"[\r\n]", capsys.readouterr().err) if line.startswith("train")]
    losses = {r["step"]: f"loss {r['loss']:.4f}" for r in read_log(tmp_path / "run" / "log.jsonl") if "loss" in r}
    for step in (2, 3):
        drawn = [f for f in frames if f" {step}/3 " in f]
        assert drawn and all(losses[step] in f for f in drawn), (step, losses, drawn)


@pytest.mark.parametrize("flags, expect", [
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "0"], "--lr must be a finite number > 0"),
    (["--min-lr", "inf"], "--min-lr must be in [0, lr="),
    (["--grad-clip", "inf"], "--grad-clip must be a finite number >= 0"),
    (["--max-minutes", "nan"], "--max-minutes must be a finite number > 0"),
])
def test_non_finite_float_flags(corpus, tmp_path, capsys, flags, expect):
    _bad(capsys, ["train", "--data", str(corpus), "--out", str(tmp_path / "r"), *TINY, *flags], expect)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("toml, expect", [
    ('[model]\nbias = "no"\n', 'bias = \'no\' must be true or false'),
    ("[train]\ndata = 5\n", "data = 5 must be a string"),
    ("[optim]\nlr = \"fast\"\n", "lr = 'fast' must be a number"),
    ("[optim]\nlr = inf\n", "lr = inf must be a finite number"),
    ("[model]\nd_model = 16.5\n", "d_model = 16.5 must be an integer"),
    ("[train]\nmax_steps = true\n", "max_steps = True must be an integer"),
])
def test_toml_value_types_are_checked(corpus, tmp_path, capsys, toml, expect):
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    _bad(capsys, ["train", "--config", str(cfg), "--data", str(corpus), "--out", str(tmp_path / "r"), *TINY],
         expect)


def test_warmup_longer_than_the_run_is_warned_about(corpus, tmp_path, capsys):
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "r"), *TINY, "--max-steps", "3",
                 "--warmup-steps", "100", "--no-sample"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "--warmup-steps 100 >= --max-steps 3" in warnings[0]


def test_missing_torch_and_out_of_memory_are_one_line_errors(corpus, tmp_path, capsys, monkeypatch):
    import sys

    import pedestrian.model as model_module

    monkeypatch.setitem(sys.modules, "torch", None)          # `import torch` fails as if not installed
    monkeypatch.setitem(sys.modules, "array_api_compat.torch", None)
    _bad(capsys, ["train", "--data", str(corpus), "--out", str(tmp_path / "r"), *TINY, "--backend", "torch"],
         'pip install -e ".[torch]"')
    monkeypatch.undo()

    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 192. TiB for an array")

    monkeypatch.setattr(model_module.GPT, "__init__", no_memory)
    msg = _bad(capsys, ["train", "--data", str(corpus), "--out", str(tmp_path / "r"), *TINY],
               "too large for this machine's memory")
    assert "choose smaller widths" in msg
    monkeypatch.setenv("PEDESTRIAN_DEBUG", "1")
    with pytest.raises(MemoryError):
        main(["train", "--data", str(corpus), "--out", str(tmp_path / "r"), *TINY])


def test_pipe_into_head_stops_like_ctrl_c(corpus, tmp_path):
    """`pedestrian train | head -n 1` for real: once the reader is gone the run stops at its next
    step boundary, saves a checkpoint, exits 130 and prints no traceback (messages go through
    logging; the console handler turns the broken pipe into a stop request)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    argv = [sys.executable, "-m", "pedestrian", "train", "--data", str(corpus), "--out", str(out), *TINY,
            "--max-steps", "100000", "--eval-interval", "1", "--max-minutes", "2", "--no-sample"]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.readline()
    proc.stdout.close()                                    # what `head -n 1` does after one line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 130, err
    assert first.startswith(b"pedestrian train: ")
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert f"checkpoint of step" in err and f"pedestrian train --out {out} --resume" in err
    step = json.loads((out / "latest" / "state.json").read_text())["step"]
    assert step < 100000


def test_config_file_with_a_byte_order_mark_reads_as_without(tmp_path, capsys):
    """Editors on Windows save UTF-8 with a byte-order mark; tomllib calls it an 'invalid
    statement at line 1'. It is dropped, as for corpus and prompt files (README: the byte-order
    mark rule); bytes that are not UTF-8 are one line that says so."""
    text = 'max_steps = 7\n[model]\nd_model = 24\n'
    plain, bom = tmp_path / "plain.toml", tmp_path / "bom.toml"
    plain.write_text(text, encoding="utf-8")
    bom.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    parser = build_parser()
    a, _ = settings_from_args(parser.parse_args(["train", "--config", str(plain)]))
    b, _ = settings_from_args(parser.parse_args(["train", "--config", str(bom)]))
    assert a == b and b.max_steps == 7 and b.model["d_model"] == 24
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('data = "caf\xe9.txt"\n'.encode("latin-1"))
    _bad(capsys, ["train", "--config", str(bad)], "is not UTF-8 text (byte 11)")



def test_arch_llama_trains_and_lowers_the_loss(corpus, tmp_path, capsys):
    """``--arch llama`` trains a Llama-style model (RMS norm, SwiGLU, RoPE, no biases, n_heads/2
    key/value heads: the gradient records carry SwiGLU's Δ7_gate, Δ7_up); 20 steps lower the
    validation loss."""
    out = tmp_path / "llama"
    assert main(["train", "--arch", "llama", "--data", str(corpus), "--out", str(out), "--max-steps", "20",
                 *TINY]) == 0
    assert "norm='rmsnorm', mlp='swiglu', n_kv_heads=1" in capsys.readouterr().out
    log = read_log(out / "log.jsonl")
    val = [r["val_loss"] for r in log if "val_loss" in r]
    assert len(val) >= 2 and val[-1] < val[0] - 0.3
    norms = [r["delta_norms"]["blocks.0"] for r in log if "delta_norms" in r]
    assert norms and {"Δ7_gate", "Δ7_up"} <= set(norms[0]) and "Δ7" not in norms[0]


def test_arch_fills_the_fields_not_given():
    args = build_parser().parse_args(["train", "--arch", "llama", *TINY, "--n-kv-heads", "2", "--mlp", "standard"])
    settings, explicit = settings_from_args(args)
    m = settings.model
    assert (m["norm"], m["position_encoding"], m["bias"], m["activation"]) == ("rmsnorm", "rope", False, "silu")
    assert m["mlp"] == "standard" and m["n_kv_heads"] == 2                  # explicit flags win
    assert {"model.norm", "model.n_kv_heads", "model.position_encoding"} <= explicit
    default = settings_from_args(build_parser().parse_args(["train", *TINY]))[0].model
    gpt2 = settings_from_args(build_parser().parse_args(["train", "--arch", "gpt2", *TINY]))[0].model
    from pedestrian.config import GPTConfig

    assert GPTConfig(vocab_size=5, **default) == GPTConfig(vocab_size=5, **gpt2)

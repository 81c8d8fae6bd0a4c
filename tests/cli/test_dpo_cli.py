"""`pedestrian finetune --dpo` end to end on a tiny GPT-2 directory: the DPO loss goes down and the
rewards' accuracy up, margin and accuracy are logged per step, the adapters load in PEFT, an
interrupted run resumes to the uninterrupted one bit for bit, and bad input ends with one
`error:` line."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
from hf_fixtures import hf_model, save_hf_dir

from pedestrian import cli
from pedestrian.training import read_log

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:peft"),
              pytest.mark.filterwarnings("ignore::FutureWarning:transformers")]

PAIRS = [{"prompt": f"the quick brown fox {i}", "chosen": " jumps over the lazy dog.",
          "rejected": " pack my box with five dozen liquor jugs!"} for i in range(24)]


def main(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(code, err, *fragments):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo")
    base = save_hf_dir(hf_model(seed=4), tmp / "base")
    pairs = tmp / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps(r) for r in PAIRS) + "\n", encoding="utf-8")
    return tmp, base, pairs


def argv(base, pairs, steps=6):
    return ["finetune", "--hf-dir", base, "--dpo", pairs, "--dpo-beta", "0.1", "--lora-rank", "4",
            "--lora-targets", "q", "v", "mlp_expand", "--max-steps", steps, "--batch-size", "4", "--lr", "1e-2",
            "--eval-interval", "2", "--eval-batches", "1", "--context-length", "24", "--no-progress", "--no-plot"]


@pytest.fixture(scope="module")
def run(setup):
    """One 20-step run in tmp/run: (its stdout, stderr)."""
    tmp, base, pairs = setup
    import io
    from contextlib import redirect_stderr, redirect_stdout

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main([str(a) for a in argv(base, pairs, 20)] + ["--out", str(tmp / "run")])
    assert code == 0, err.getvalue()
    return out.getvalue(), err.getvalue()


def test_dpo_lowers_the_loss_and_logs_margin_and_accuracy(setup, run):
    tmp, base, pairs = setup
    assert "validation DPO loss 0.6931 -> " in run[0]
    records = read_log(tmp / "run" / "log.jsonl")
    steps = [r for r in records if "loss" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(steps) == 20 and val[0] == pytest.approx(np.log(2), abs=1e-6)      # U = 0: policy = reference
    assert steps[0]["margin"] == 0.0 and steps[0]["accuracy"] == 0.0
    assert val[-1] < 0.4 and steps[-1]["accuracy"] == 1.0 and steps[-1]["margin"] > 0.5
    state = json.loads((tmp / "run" / "adapter" / "state.json").read_text())
    assert state["meta"]["finetune"]["dpo"] == str(pairs.resolve()) and state["meta"]["finetune"]["dpo_beta"] == 0.1
    assert (tmp / "run" / "peft" / "adapter_config.json").is_file()


def test_an_interrupted_dpo_run_resumes_to_the_uninterrupted_run(setup, tmp_path, capsys, monkeypatch):
    import pedestrian.training.dpo as dpo_module
    from pedestrian.checkpoint import load_checkpoint
    from pedestrian.interop.hf import load_pretrained

    _, base, pairs = setup
    assert main(capsys, *argv(base, pairs), "--out", tmp_path / "straight")[0] == 0
    real, calls = dpo_module.dpo_step, [0]

    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(dpo_module, "dpo_step", step)
    out = tmp_path / "stopped"
    code, _, err = main(capsys, *argv(base, pairs), "--out", out)
    assert code == 130 and f"--dpo {pairs} --lora-rank 4 --out {out} --resume" in err
    monkeypatch.setattr(dpo_module, "dpo_step", real)
    code, _, err = main(capsys, *argv(base, pairs), "--out", out, "--resume")
    assert code == 0, err
    a = load_checkpoint(tmp_path / "straight", base_model=load_pretrained(base)[0])
    b = load_checkpoint(out, base_model=load_pretrained(base)[0])
    assert a.step == b.step == 6
    for k, v in a.model.params.items():
        np.testing.assert_array_equal(b.model.params[k], v, err_msg=k)
    strip = [{k: v for k, v in r.items() if k not in ("time_s", "tokens_per_s")} for r in
             read_log(tmp_path / "straight" / "log.jsonl")]
    assert strip == [{k: v for k, v in r.items() if k not in ("time_s", "tokens_per_s")}
                     for r in read_log(out / "log.jsonl")]


def test_dpo_bad_input(setup, run, tmp_path, capsys):
    tmp, base, pairs = setup
    common = ["--hf-dir", base, "--lora-rank", "2", "--out", tmp_path / "x"]
    one_error_line(*main(capsys, "finetune", *common)[::2], "--data PATH", "--dpo PAIRS.jsonl")
    one_error_line(*main(capsys, "finetune", *common, "--data", pairs, "--dpo", pairs)[::2], "one of them")
    one_error_line(*main(capsys, "finetune", *common, "--dpo", pairs, "--dpo-beta", "0")[::2], "--dpo-beta")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PAIRS[0]) + "\n" + '{"prompt": "a", "chosen": "b"}\n', encoding="utf-8")
    one_error_line(*main(capsys, "finetune", *common, "--dpo", bad)[::2], "bad.jsonl line 2", "prompt, chosen and rejected")
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(PAIRS[0]) + "\n", encoding="utf-8")
    one_error_line(*main(capsys, "finetune", *common, "--dpo", one)[::2], "at least 2")
    assert not (tmp_path / "x").exists()                                             # nothing written
    code, _, err = main(capsys, *argv(base, pairs), "--out", tmp / "run", "--resume", "--dpo-beta", "0.5")
    one_error_line(code, err, "--dpo-beta 0.1 (you gave 0.5)")
    one_error_line(*main(capsys, "eval", tmp / "run")[::2], "fine-tuned on preference pairs",
                   "pass --data PATH")

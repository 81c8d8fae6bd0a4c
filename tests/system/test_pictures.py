"""The pictures of issue 14: the error-signal / gradient log and gradients.png of a training run,
and ``pedestrian attention``'s grid of attention weights. A short run on a tiny corpus; the PNGs
must exist, be PNGs and not be empty; the logged norms must be those of the model's own
``backward(keep_deltas=True)`` on the batch."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pedestrian.checkpoint import load_checkpoint
from pedestrian.cli import main as cli_main
from pedestrian.training import TrainSettings, gradient_record, read_log, train

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pictures")
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question"]
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(words, 9)) for _ in range(300)), encoding="utf-8")
    settings = TrainSettings(data=str(corpus), out=str(tmp / "run"), batch_size=4, max_steps=6, warmup_steps=2,
                             model=dict(context_length=16, d_model=16, n_heads=2, n_blocks=3,
                                        position_encoding="rope"),
                             lr=1e-2, min_lr=1e-3, eval_interval=2, eval_batches=2, max_minutes=None,
                             progress=False, plot=True)
    train(settings)
    return tmp / "run"


def test_the_log_records_every_blocks_signal_and_gradient_norms(run):
    records = [r for r in read_log(run / "log.jsonl") if "delta_norms" in r]
    assert [r["step"] for r in records] == [2, 4, 6]                 # every --eval-interval steps
    for r in records:
        for i in range(3):
            block = r["delta_norms"][f"blocks.{i}"]
            assert list(block) == [f"Δ{n}" for n in range(2, 11)]
            assert all(math.isfinite(v) and v > 0 for v in block.values())
            assert set(r["grad_norms"][f"blocks.{i}"]) == {"ln1", "attn.qkv", "attn_proj", "ln2",
                                                           "mlp_expand", "mlp_contract"}
        assert "pos_emb" not in r["grad_norms"]                         # RoPE: no position table
        assert r["grad_norms"]["tok_emb"] > 0 and r["delta_norms"]["Δ1"] > 0


def test_recorded_norms_are_those_of_the_backward(run):
    """gradient_record on a batch equals norms taken by hand from the model's own backward."""
    model = load_checkpoint(run).model
    rng = np.random.default_rng(1)
    x = rng.integers(0, model.config.vocab_size, size=(2, 16))
    y = rng.integers(0, model.config.vocab_size, size=(2, 16))
    rec = gradient_record(model, x, y, step=7)
    model.loss(x, y)
    grads = {k: np.array(v, dtype=np.float64) for k, v in model.backward(keep_deltas=True).items()}
    deltas = model.deltas()
    d5 = np.linalg.norm(np.asarray(deltas["blocks.1.Δ5"], dtype=np.float64))
    assert rec["delta_norms"]["blocks.1"]["Δ5"] == pytest.approx(d5, rel=1e-12)
    qkv = math.sqrt(sum(np.sum(grads[f"blocks.2.attn.{p}.{w}"] ** 2) for p in "qkv" for w in ("weight", "bias")))
    assert rec["grad_norms"]["blocks.2"]["attn.qkv"] == pytest.approx(qkv, rel=1e-12)
    assert rec["step"] == 7 and model.training                       # dropout state restored


def test_gradients_png_and_loss_curve_are_written(run):
    for name in ("gradients.png", "loss_curve.png"):
        data = (run / name).read_bytes()
        assert data[:8] == PNG and len(data) > 10_000, name


def test_attention_command_writes_the_grid(run, tmp_path, capsys):
    out = tmp_path / "attention.png"
    assert cli_main(["attention", "--checkpoint", str(run / "latest"), "--prompt", "to be or not",
                     "--out", str(out)]) == 0
    assert "3 × 2 maps of 12 × 12 weights" in capsys.readouterr().out
    data = out.read_bytes()
    assert data[:8] == PNG and len(data) > 10_000
    assert not list(tmp_path.glob(".tmp-*"))


def test_attention_command_on_a_full_disk_keeps_the_old_picture(run, tmp_path, capsys, monkeypatch):
    """Issue 13 part 3: the PNG goes through pedestrian.atomic like every other file, so a full
    disk is one error line that says what was kept, and the old picture is unchanged."""
    import errno
    import os

    out = tmp_path / "attention.png"
    out.write_bytes(b"the old picture")
    real_write = os.write

    def full(fd, data):
        if fd > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    assert cli_main(["attention", "--checkpoint", str(run / "latest"), "--prompt", "to be or not",
                     "--out", str(out)]) == 2
    monkeypatch.undo()
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: could not write the attention picture {out}: no space left") and "\n" not in err
    assert "unchanged" in err
    assert out.read_bytes() == b"the old picture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attention.png"]


@pytest.mark.parametrize("argv,message", [
    (["--out", "{tmp}/a.jpg"], "--out must name a .png file"),
    (["--out", "{tmp}/missing/a.png"], "the folder of --out does not exist"),
    (["--out", "{tmp}/a.png", "--prompt", ""], "--prompt is empty"),
    (["--out", "{tmp}/a.png", "--prompt", "xyz§"], "§"),
])
def test_attention_command_errors(run, tmp_path, capsys, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    base = ["attention", "--checkpoint", str(run / "latest")]
    if "--prompt" not in argv:
        argv += ["--prompt", "to be"]
    assert cli_main(base + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0]


def test_readme_shows_one_of_each_picture_and_the_experiment():
    """README's pictures and the experiment's page exist in docs/ (PNGs, not placeholders)."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    readme = (repo / "README.md").read_text(encoding="utf-8")
    for name in ("attention.png", "gradients.png", "position_experiment.png"):
        assert f"](docs/{name})" in readme, name
        data = (repo / "docs" / name).read_bytes()
        assert data[:8] == PNG and len(data) > 10_000, name
    assert "](docs/position_experiment.md)" in readme
    page = (repo / "docs" / "position_experiment.md").read_text(encoding="utf-8")
    assert "python3 benchmarks/position_experiment.py" in page and "![loss curves](position_experiment.png)" in page


def test_arch_experiment_page_shows_its_picture_and_is_linked():
    """docs/arch_experiment.md (GPT-2 style against Llama style) exists with the command that
    wrote it, its table and its PNG, and the guide and EQUATIONS.md link it."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    data = (repo / "docs" / "arch_experiment.png").read_bytes()
    assert data[:8] == PNG and len(data) > 10_000
    page = (repo / "docs" / "arch_experiment.md").read_text(encoding="utf-8")
    assert "python3 benchmarks/arch_experiment.py" in page and "![loss curves](arch_experiment.png)" in page
    table = page.split("<!-- results:start -->", 1)[1].split("<!-- results:end -->", 1)[0]
    assert "| `gpt2` |" in table and "| `llama` |" in table and "812,288" in table and "812,160" in table
    for doc in ("guide.md", "EQUATIONS.md"):
        assert "](arch_experiment.md)" in (repo / "docs" / doc).read_text(encoding="utf-8"), doc

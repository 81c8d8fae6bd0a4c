"""``pedestrian attention --gradients`` (issue 25, item 4): one step's P beside Δcausal for every
block and head, for a checkpoint or a fresh random model (``--random``, no checkpoint needed).

The figure is caught as it is closed: it must hold one P map and one Δcausal map per (block,
head), and the arrays drawn must be the model's own ``attention_weights()`` and
``deltas()["blocks.{i}.Δcausal"]`` for the prompt's next-token loss, recomputed here."""

from __future__ import annotations

import numpy as np
import pytest

from cli_helpers import one_line_error
from pedestrian import GPT, GPTConfig
from pedestrian.checkpoint import save_checkpoint
from pedestrian.cli import main
from pedestrian.text.tokenizer import CharTokenizer

PNG = b"\x89PNG\r\n\x1a\n"
PROMPT = "to be or not to be"


@pytest.fixture
def figures(monkeypatch):
    """Every matplotlib figure closed during the test (plot functions close after saving)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen, real_close = [], plt.close

    def close(fig=None):
        seen.append(fig)
        return real_close(fig)

    monkeypatch.setattr(plt, "close", close)
    return seen


def maps(fig) -> dict:
    """``title -> array`` of every heat map of the figure."""
    return {ax.get_title(): np.asarray(ax.images[0].get_array()) for ax in fig.axes if ax.images}


def expected(model, ids):
    x, y = np.asarray([ids[:-1]]), np.asarray([ids[1:]])
    model.training = False
    model.loss(x, y)
    model.backward(keep_deltas=True)
    P = [np.asarray(p)[0] for p in model.attention_weights()]
    D = [np.asarray(model.deltas()[f"blocks.{i}.Δcausal"])[0] for i in range(model.config.n_blocks)]
    return P, D


def check_grid(fig, P, D, n_blocks, n_heads):
    drawn = maps(fig)
    assert len(drawn) == 2 * n_blocks * n_heads
    for i in range(n_blocks):
        for h in range(n_heads):
            p = drawn[f"block {i}, head {h}: P"]
            [d] = [v for k, v in drawn.items() if k.startswith(f"block {i}, head {h}: Δcausal")]
            assert np.array_equal(p, P[i][h]) and np.array_equal(d, D[i][h])
            assert np.max(np.abs(d.sum(axis=1))) <= 1e-15 and np.all(d[np.triu_indices(len(d), 1)] == 0)


def test_random_model_step_picture(tmp_path, figures, capsys):
    out = tmp_path / "step.png"
    argv = ["attention", "--random", "--n-blocks", "2", "--n-heads", "3", "--d-model", "12", "--seed", "4",
            "--prompt", PROMPT, "--gradients", "--out", str(out)]
    assert main(argv) == 0
    assert "P beside Δcausal: 12 maps of 17 × 17" in capsys.readouterr().out
    data = out.read_bytes()
    assert data[:8] == PNG and len(data) > 10_000
    tok = CharTokenizer.from_text(PROMPT)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=len(PROMPT), d_model=12, n_heads=3,
                          n_blocks=2), seed=4, dtype="float64")
    P, D = expected(model, tok.encode(PROMPT))
    [fig] = [f for f in figures if f is not None]
    check_grid(fig, P, D, 2, 3)


def test_checkpoint_step_picture_and_plain_weights(tmp_path, figures, capsys):
    tok = CharTokenizer.from_text("abcdefgh \n")
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=8, d_model=8, n_heads=2, n_blocks=1), seed=1)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, None, tok, step=3)
    out = tmp_path / "step.png"
    assert main(["attention", "--checkpoint", str(ckpt), "--prompt", "abc head", "--gradients",
                 "--out", str(out)]) == 0
    assert "1 × 2 heads, P beside Δcausal: 4 maps of 7 × 7" in capsys.readouterr().out
    reloaded = GPT(model.config, seed=1, dtype="float64")
    reloaded.load_state_dict(model.state_dict())
    P, D = expected(reloaded, tok.encode("abc head"))
    check_grid(figures[-1], P, D, 1, 2)
    # without --gradients: the P grid of the whole prompt, as before
    assert main(["attention", "--random", "--prompt", "abcd", "--out", str(tmp_path / "p.png")]) == 0
    assert "2 × 2 maps of 4 × 4 weights" in capsys.readouterr().out
    assert len(maps(figures[-1])) == 4


@pytest.mark.parametrize("argv,fragment", [
    (["--prompt", "abc"], "give either --checkpoint CKPT or --random"),
    (["--random", "--checkpoint", "x", "--prompt", "abc"], "not both"),
    (["--random", "--prompt", "a", "--gradients"], "at least 2 tokens"),
    (["--random", "--prompt", "abc", "--n-heads", "0"], "--n-heads must be a positive integer"),
    (["--random", "--prompt", "abc", "--d-model", "10", "--n-heads", "3"], "not divisible"),
    (["--checkpoint", "x", "--prompt", "abc", "--seed", "2"], "--seed sets up --random's model"),
])
def test_step_picture_errors(argv, fragment, tmp_path, capsys):
    assert main(["attention", *argv, "--out", str(tmp_path / "a.png")]) == 2
    assert fragment in one_line_error(capsys)

"""Non-finite numbers at the command line, outside training (issue 13, part 1, swept): a loss
that ``pedestrian eval`` computes as NaN or inf, a perplexity too large for a float, Hugging Face
weights or PEFT adapters that hold NaN. Each is one ``error:`` line (exit 2) that names the
problem, or a printed ``inf`` -- never a silent ``nan`` or a traceback."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from cli_helpers import fox_text, one_line_error

from pedestrian.checkpoint import save_checkpoint
from pedestrian.cli import main
from pedestrian.config import GPTConfig
from pedestrian.model import GPT
from pedestrian.text.tokenizer import CharTokenizer

TEXT = fox_text(40)


_one_line_error = one_line_error


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def _checkpoint(tmp_path, *, logits_weight: float | None = None, embedding_scale: float = 1.0,
                dtype: str = "float32"):
    """A checkpoint with finite weights (a valid one) whose forward misbehaves: logits weights
    of 1e38 overflow float32 to ±inf logits (a NaN loss); large embeddings, through the tied
    logits, make a huge but finite loss."""
    tok = CharTokenizer.from_text(TEXT)
    cfg = GPTConfig(vocab_size=tok.vocab_size, context_length=16, d_model=8, n_heads=2, n_blocks=1,
                    tie_weights=logits_weight is None)
    model = GPT(cfg, dtype=dtype, seed=0)
    if logits_weight is not None:
        model.params["logits.weight"][...] = np.sign(model.params["logits.weight"]) * logits_weight
    model.params["tok_emb.weight"][...] *= embedding_scale
    return save_checkpoint(tmp_path / "ckpt", model, None, tok)


def test_eval_of_a_forward_that_overflows_is_an_error_not_nan(tmp_path, corpus, capsys):
    """Logits weights of 1e38 are finite (the checkpoint is valid), but the logits overflow
    float32 to ±inf and the loss is NaN: eval says so, and how to go on, instead of 'loss nan'."""
    folder = _checkpoint(tmp_path, logits_weight=1e38)
    with warnings.catch_warnings(record=True) as caught:          # NumPy's overflow warnings
        warnings.simplefilter("always")                           # would print lines of their own
        assert main(["eval", str(folder), "--data", str(corpus), "--split", "all", "--no-progress"]) == 2
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    err = _one_line_error(capsys)
    assert "loss" in err and "nan" in err and "--dtype float64" in err, err


def test_eval_perplexity_too_large_for_a_float_prints_inf(tmp_path, corpus, capsys):
    """A loss above ln(max float) = 709.8 nats is finite but its perplexity is not: printed as
    inf, not an OverflowError traceback."""
    folder = _checkpoint(tmp_path, embedding_scale=1e5, dtype="float64")     # a loss of ~1500 nats
    assert main(["eval", str(folder), "--data", str(corpus), "--split", "all", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "perplexity inf" in out, out

"""``pedestrian.training.finetune.load_model``: the one loader behind ``pedestrian sample``,
``eval`` and ``export-hf`` (a train checkpoint here; fine-tunes and Hugging Face directories
through the commands in tests/cli/test_finetune_cli.py), and ``read_prompts`` of
``pedestrian sample --prompts-file``."""

from __future__ import annotations

import numpy as np
import pytest

from pedestrian.checkpoint import save_checkpoint
from pedestrian.config import GPTConfig
from pedestrian.generation.prompts import read_prompts
from pedestrian.model import GPT
from pedestrian.text.tokenizer import CharTokenizer
from pedestrian.training.finetune import load_model


@pytest.fixture
def checkpoint(tmp_path):
    tok = CharTokenizer.from_text("to be or not")
    config = GPTConfig(vocab_size=tok.vocab_size, context_length=8, d_model=8, n_heads=2, n_blocks=1)
    model = GPT(config, seed=0, dtype="float64")
    path = save_checkpoint(tmp_path / "run" / "latest", model, tokenizer=tok, step=7,
                           meta={"settings": {"data": "x.txt", "val_fraction": 0.2}})
    return model, tok, path


def test_a_train_checkpoint_loads_with_its_step_settings_and_tokenizer(checkpoint):
    model, tok, path = checkpoint
    loaded = load_model(path)
    assert (loaded.step, loaded.base, loaded.settings) == (7, None, {"data": "x.txt", "val_fraction": 0.2})
    assert loaded.tokenizer.to_dict() == tok.to_dict() and loaded.path.resolve() == path.resolve()
    for name, value in model.state_dict().items():
        assert np.array_equal(np.asarray(loaded.model.state_dict()[name]), np.asarray(value)), name
    assert load_model(path, dtype="float32").model.dtype_name == "float32"


def test_bad_sources_are_one_line_errors(checkpoint, tmp_path):
    _, _, path = checkpoint
    with pytest.raises(ValueError, match="pass a checkpoint .*--checkpoint CKPT.* or --hf-dir DIR"):
        load_model()
    with pytest.raises(ValueError, match="is not one, so leave --hf-dir out"):
        load_model(path, tmp_path)                          # --hf-dir is a fine-tune's base only
    with pytest.raises(ValueError, match="is a full checkpoint, not an adapter-only one"):
        load_model(path, adapters=True)


def test_read_prompts(tmp_path):
    assert read_prompts() == [""]
    f = tmp_path / "p.txt"
    f.write_text("\ufeffone\n\n  \ntwo\n", encoding="utf-8")
    assert read_prompts(["zero"], f) == ["zero", "one", "two"]
    f.write_text("\n \n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no prompt"):
        read_prompts([], f)
    with pytest.raises(ValueError, match="no such file"):
        read_prompts([], tmp_path / "none.txt")

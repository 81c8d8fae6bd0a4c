"""`pedestrian finetune --lora-dropout`: the adapters train with dropout on their input, the
probability travels into the adapter checkpoint and the PEFT directory, and a bad value is one
`error:` line with nothing written."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hf_fixtures import TEXT, hf_logits, hf_model, save_hf_dir, transformers

from pedestrian import cli
from pedestrian.training.finetune import load_finetuned

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:peft"),
              pytest.mark.filterwarnings("ignore::FutureWarning:transformers")]


def finetune(base, data, out, *extra):
    return cli.main(["finetune", "--hf-dir", str(base), "--data", str(data), "--lora-rank", "2",
                     "--lora-targets", "q", "v", "mlp_expand", "--max-steps", "3", "--context-length", "16",
                     "--batch-size", "2", "--lr", "5e-2", "--eval-interval", "3", "--eval-batches", "1",
                     "--out", str(out), "--no-progress", "--no-plot", *extra])


def test_finetune_with_lora_dropout(tmp_path, capsys):
    peft = pytest.importorskip("peft")
    base = save_hf_dir(hf_model(seed=4), tmp_path / "base")
    data = tmp_path / "data.txt"
    data.write_text(TEXT, encoding="utf-8")
    assert finetune(base, data, tmp_path / "drop", "--lora-dropout", "0.2") == 0
    assert finetune(base, data, tmp_path / "plain") == 0
    state = json.loads((tmp_path / "drop" / "adapter" / "state.json").read_text())
    assert state["lora"]["dropout"] == 0.2 and state["meta"]["finetune"]["lora_dropout"] == 0.2
    cfg = json.loads((tmp_path / "drop" / "peft" / "adapter_config.json").read_text())
    assert cfg["lora_dropout"] == 0.2
    model, _ = load_finetuned(tmp_path / "drop")
    plain, _ = load_finetuned(tmp_path / "plain")
    assert model.lora_dropout == 0.2 and plain.lora_dropout == 0.0
    # the same seed, data and steps: only the masks differ, so the adapters do
    assert any(not np.array_equal(v, plain.params[k]) for k, v in model.lora_state_dict().items())
    assert not model.training                   # loaded for inference, as PEFT's from_pretrained: no dropout
    x = np.random.default_rng(3).integers(0, 300, size=(2, 16))
    np.testing.assert_array_equal(model.forward(x), model.forward(x))
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(base)).eval()
    with_adapter = peft.PeftModel.from_pretrained(hf, str(tmp_path / "drop" / "peft")).eval()
    # float32 logits of O(1-10): a few ulps of the largest, both libraries rounding their own way
    assert np.max(np.abs(hf_logits(with_adapter, x) - model.forward(x))) <= 1e-5
    capsys.readouterr()
    for bad in ("1", "-0.5"):
        assert finetune(base, data, tmp_path / "bad", "--lora-dropout", bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --lora-dropout must be a probability in [0, 1)")
    assert not (tmp_path / "bad").exists()

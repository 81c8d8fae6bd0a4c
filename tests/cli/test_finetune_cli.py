"""`pedestrian finetune` and `pedestrian export-hf` end to end on a tiny GPT-2 directory:
the loss goes down, only the adapters move, the outputs load in transformers / peft, and
bad input ends with one `error:` line and nothing written."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hf_fixtures import TEXT, hf_logits, hf_model, save_hf_dir, tiny_tokenizer, transformers

from pedestrian.generation.sampling import Sampling
from pedestrian import cli
from pedestrian.checkpoint import save_checkpoint
from pedestrian.training.finetune import adapter_base, load_finetuned
from pedestrian.interop.hf import load_hf_model, load_pretrained
from pedestrian.interop.peft import read_peft_adapter
from pedestrian.model import GPT

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:peft"),
              pytest.mark.filterwarnings("ignore::FutureWarning:transformers")]

X = np.random.default_rng(3).integers(0, 300, size=(2, 16))


def main(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One fine-tuning run: (tmp folder, base dir, run dir)."""
    tmp = tmp_path_factory.mktemp("ft")
    base = save_hf_dir(hf_model(seed=4), tmp / "base")
    data = tmp / "data.txt"
    data.write_text(TEXT * 3, encoding="utf-8")
    code = cli.main(["finetune", "--hf-dir", str(base), "--data", str(data), "--lora-rank", "4",
                     "--lora-alpha", "2", "--lora-targets", "q", "v", "mlp_expand", "--max-steps", "40",
                     "--context-length", "32", "--batch-size", "4", "--lr", "1e-2", "--eval-interval", "20",
                     "--eval-batches", "4", "--out", str(tmp / "run"), "--no-progress", "--no-plot"])
    assert code == 0
    return tmp, base, tmp / "run"


def test_finetune_lowers_the_validation_loss(run):
    _, _, out = run
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 40 and len(val) == 3                       # steps 0, 20, 40
    assert val[-1] < val[0] - 0.05


def test_only_adapters_are_saved_and_the_base_is_untouched(run):
    _, base, out = run
    state = json.loads((out / "adapter" / "state.json").read_text())
    assert state["params"] == "lora" and state["lora"]["rank"] == 4 and state["lora"]["alpha"] == 2.0
    assert state["optimizer"]["groups"] == ["lora"]
    assert adapter_base(out)["hf_dir"] == str(base.resolve())
    adapter_bytes = (out / "adapter" / "model.safetensors").stat().st_size
    assert adapter_bytes < 0.15 * (base / "model.safetensors").stat().st_size
    model, tok = load_finetuned(out)
    assert tok.encode(TEXT) == tiny_tokenizer().encode(TEXT)
    assert model.lora_targets == [f"blocks.{i}.{k}" for i in range(2) for k in ("attn.q", "attn.v", "mlp_expand")]
    original = load_hf_model(base)
    for k, v in original.params.items():
        np.testing.assert_array_equal(model.params[k], v)
    assert any(np.any(v != 0) for k, v in model.lora_state_dict().items() if k.endswith("lora_U"))


def test_peft_output_matches_in_transformers(run):
    peft = pytest.importorskip("peft")
    _, base, out = run
    model, _ = load_finetuned(out)
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(base)).eval()
    with_adapter = peft.PeftModel.from_pretrained(hf, str(out / "peft")).eval()
    assert np.max(np.abs(hf_logits(with_adapter, X) - model.forward(X))) <= 1e-5


def test_export_merged_model_and_sample_from_it(run, capsys):
    tmp, _, out = run
    code, stdout, _ = main(capsys, "export-hf", "--adapter", out, "--out", tmp / "merged")
    assert code == 0 and "wrote a Hugging Face GPT2LMHeadModel" in stdout
    model, _ = load_finetuned(out)
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp / "merged")).eval()
    assert np.max(np.abs(hf_logits(hf, X) - model.forward(X))) <= 1e-5
    code, stdout, _ = main(capsys, "sample", "--hf-dir", tmp / "merged", "--prompt", "the quick",
                           "--max-new-tokens", "5", "--temperature", "0", "--ignore-eot")
    assert code == 0 and stdout.startswith("the quick")
    code, stdout, _ = main(capsys, "export-hf", "--adapter", out / "adapter", "--format", "peft",
                           "--out", tmp / "peft2")
    assert code == 0
    (cfg_a, tensors_a, meta_a), (cfg_b, tensors_b, meta_b) = (read_peft_adapter(tmp / "peft2"),
                                                             read_peft_adapter(out / "peft"))
    assert cfg_a == cfg_b and meta_a == meta_b and tensors_a.keys() == tensors_b.keys()
    for k, v in tensors_a.items():
        np.testing.assert_array_equal(v, tensors_b[k])


def test_export_full_checkpoint(tmp_path, capsys):
    tok = tiny_tokenizer()
    from pedestrian.config import GPTConfig

    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=32, d_model=16, n_heads=2, n_blocks=1,
                          activation="gelu"), seed=5)
    save_checkpoint(tmp_path / "ckpt", model, None, tok)
    code, _, _ = main(capsys, "export-hf", "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "hf")
    assert code == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.config.activation_function == "gelu"
    assert np.max(np.abs(hf_logits(hf, X) - model.forward(X))) <= 1e-5
    back, back_tok = load_pretrained(tmp_path / "hf")
    assert back_tok == tok
    for k, v in model.params.items():
        np.testing.assert_array_equal(back.params[k], v)


# ------------------------------------------------------------------------------------ bad input
def one_error_line(code, err, *fragments):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def test_finetune_bad_input(run, tmp_path, capsys):
    tmp, base, _ = run
    data = tmp / "data.txt"
    (tmp_path / "short.txt").write_text("the quick", encoding="utf-8")
    new = tmp_path / "new"
    common = ["--data", data, "--out", new, "--no-progress", "--max-steps", "2"]
    one_error_line(*main(capsys, "finetune", "--hf-dir", tmp_path, "--lora-rank", "2", *common)[::2],
                   "no config.json")
    one_error_line(*main(capsys, "finetune", "--hf-dir", base, "--lora-rank", "0", *common)[::2],
                   "--lora-rank must be a positive integer")
    one_error_line(*main(capsys, "finetune", "--hf-dir", base, "--lora-rank", "2", "--context-length", "65",
                         *common)[::2], "longer than the model's context (64 positions)")
    one_error_line(*main(capsys, "finetune", "--hf-dir", base, "--lora-rank", "2", "--lora-targets", "wq",
                         *common)[::2], "unknown LoRA target 'wq'")
    one_error_line(*main(capsys, "finetune", "--hf-dir", base, "--lora-rank", "2", "--data",
                         tmp_path / "short.txt", "--out", new)[::2], "too short")
    assert not new.exists()                                        # nothing written
    one_error_line(*main(capsys, "finetune", "--hf-dir", base, "--lora-rank", "2", "--data", data,
                         "--out", tmp / "run")[::2], "already holds a run")
    one_error_line(*main(capsys, "finetune", "--hf-dir", base, "--lora-rank", "2", "--update-in-backward",
                         *common)[::2], "--update-in-backward is a flag of `pedestrian train`")
    assert not new.exists()


def test_export_bad_input(run, tmp_path, capsys):
    tmp, _, out = run
    other = save_hf_dir(hf_model(seed=9), tmp_path / "other")
    capsys.readouterr()                                   # transformers' own progress output
    one_error_line(*main(capsys, "export-hf", "--adapter", out, "--hf-dir", other, "--out", tmp_path / "x")[::2],
                   "trained on other weights")
    one_error_line(*main(capsys, "export-hf", "--adapter", other, "--out", tmp_path / "x")[::2],
                   "no checkpoint")
    # a fine-tune run given as --checkpoint is read as --adapter (so --hf-dir is its base)
    one_error_line(*main(capsys, "export-hf", "--checkpoint", out, "--hf-dir", other,
                         "--out", tmp_path / "x")[::2], "trained on other weights")
    assert not (tmp_path / "x").exists()


def test_export_of_a_tied_logits_adapter_is_untied(tmp_path, capsys):
    """A LoRA on GPT-2's tied logits cannot go into wte (that would change the embedding too), so
    export writes an untied model: wte unchanged, lm_head.weight = wte + (alpha D U)^T."""
    tok = tiny_tokenizer()
    from pedestrian.config import GPTConfig

    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=16, d_model=8, n_heads=2, n_blocks=1))
    model.add_lora("logits", rank=2, alpha=1.5, freeze_base=False)
    model.params["logits.lora_U"][...] = np.random.default_rng(0).normal(0, 0.3, model.params["logits.lora_U"].shape)
    save_checkpoint(tmp_path / "ckpt", model, None, tok)
    code, out, _ = main(capsys, "export-hf", "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "x")
    assert code == 0 and "untied" in out
    assert json.loads((tmp_path / "x" / "config.json").read_text())["tie_word_embeddings"] is False
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "x")).eval()
    x = X[:, :16] % tok.vocab_size
    assert np.max(np.abs(hf_logits(hf, x) - model.forward(x))) <= 1e-5
    wte = model.params["tok_emb.weight"]
    np.testing.assert_array_equal(hf.transformer.wte.weight.detach().numpy(), wte)
    expected = wte + (1.5 * model.params["logits.lora_D"] @ model.params["logits.lora_U"]).T
    np.testing.assert_allclose(hf.lm_head.weight.detach().numpy(), expected, rtol=1e-6, atol=1e-6)
    assert "logits.lora_D" in model.params                            # the source model is unchanged
    code, _, _ = main(capsys, "export-hf", "--checkpoint", tmp_path / "ckpt", "--format", "peft",
                      "--out", tmp_path / "p")
    assert code == 0 and (tmp_path / "p" / "adapter_config.json").is_file()


@pytest.mark.parametrize("fmt", ["model", "peft"])
def test_export_to_a_non_empty_out_names_the_flag_not_the_python_argument(tmp_path, capsys, fmt):
    """export-hf into a folder that holds files: one error line naming --overwrite (what the user
    types), not the library's overwrite=True; nothing is written; with --overwrite it goes."""
    from pedestrian.config import GPTConfig
    from pedestrian.interop.hf import save_pretrained

    tok = tiny_tokenizer()
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=16, d_model=8, n_heads=2, n_blocks=1))
    model.add_lora("blocks.0.attn.q", rank=2, freeze_base=False)
    save_checkpoint(tmp_path / "ckpt", model, None, tok)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine", encoding="utf-8")
    argv = ["export-hf", "--checkpoint", tmp_path / "ckpt", "--format", fmt, "--out", out]
    code, _, err = main(capsys, *argv)
    one_error_line(code, err, f"{out} already exists and is not empty", "--overwrite")
    assert "overwrite=True" not in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    code, _, _ = main(capsys, *argv, "--overwrite")
    assert code == 0 and (out / "notes.txt").read_text(encoding="utf-8") == "mine"
    with pytest.raises(ValueError, match="pass overwrite=True") as info:      # the library names its argument
        save_pretrained(GPT(model.config), out)
    assert "--overwrite" not in str(info.value)


@pytest.fixture(scope="module")
def run_all(run):
    """A 3-step fine-tune with adapters on every layer, tied logits included (GPT-2)."""
    tmp, base, _ = run
    code = cli.main(["finetune", "--hf-dir", str(base), "--data", str(tmp / "data.txt"), "--lora-rank", "2",
                     "--lora-targets", "all", "--max-steps", "3", "--context-length", "16", "--batch-size",
                     "2", "--lr", "5e-2", "--eval-interval", "3", "--eval-batches", "1",
                     "--out", str(tmp / "run_all"), "--no-progress", "--no-plot"])
    assert code == 0
    return tmp, base, tmp / "run_all"


def test_finetune_with_tied_logits_exports_from_the_cli(run_all, capsys):
    tmp, base, out = run_all
    code, stdout, _ = main(capsys, "export-hf", "--adapter", out, "--out", tmp / "merged_all")
    assert code == 0 and "untied" in stdout
    model, _ = load_finetuned(out)
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp / "merged_all")).eval()
    assert hf.config.tie_word_embeddings is False
    assert np.max(np.abs(hf_logits(hf, X) - model.forward(X))) <= 1e-5
    base_model, _ = load_pretrained(base)
    np.testing.assert_array_equal(hf.transformer.wte.weight.detach().numpy(),
                                  base_model.params["tok_emb.weight"])


def test_sample_and_eval_accept_a_finetune_run(run_all, tmp_path, capsys):
    tmp, base, out = run_all
    texts = []
    for ckpt, extra in ((out, []), (out / "adapter", []), (out, ["--hf-dir", base])):
        code, stdout, err = main(capsys, "sample", "--checkpoint", ckpt, *extra, "--prompt", "the quick",
                                 "--max-new-tokens", "5", "--temperature", "0", "--ignore-eot")
        assert code == 0, err
        texts.append(stdout)
    assert texts[0].startswith("the quick") and texts[0] == texts[1] == texts[2]
    model, tok = load_finetuned(out)                                   # the same text as the library
    from pedestrian.generation.generate import generate

    ids = generate(model, np.array(tok.encode("the quick")), 5, Sampling(temperature=0))
    assert texts[0] == tok.decode(ids) + "\n"
    code, stdout, err = main(capsys, "eval", out, "--no-progress")
    assert code == 0 and "val loss" in stdout, err
    code, stdout, err = main(capsys, "eval", out / "adapter", "--hf-dir", base, "--split", "all",
                             "--no-progress")
    assert code == 0 and "all loss" in stdout, err
    # the run's PEFT folder given as a checkpoint: named, with the run to pass instead
    code, _, err = main(capsys, "sample", "--checkpoint", out / "peft", "--prompt", "a")
    one_error_line(code, err, "a PEFT adapter", f"--checkpoint {out}")
    # the recorded base is gone: a short CLI-level message naming the fix
    moved = tmp_path / "ft"
    import shutil

    shutil.copytree(out, moved)
    state = json.loads((moved / "adapter" / "state.json").read_text())
    state["base"]["hf_dir"] = str(tmp_path / "gone")
    (moved / "adapter" / "state.json").write_text(json.dumps(state))
    for argv in (["sample", "--checkpoint", moved, "--prompt", "a"], ["eval", moved, "--no-progress"]):
        code, _, err = main(capsys, *argv)
        one_error_line(code, err, "pass --hf-dir BASE_DIR")
        assert len(err) < 300 and "base_model=" not in err


def test_finetune_stops_on_non_finite_steps_naming_the_last_good_adapter(run, tmp_path, capsys, monkeypatch):
    """The loop of `pedestrian train`, so its non-finite rule: the loss turns NaN at step 3;
    steps 3-5 are skipped with a warning each, then (--max-skipped-steps 3) one error line names
    the last adapter checkpoint, of step 4 (saved during the streak: its adapters are those of
    step 2's update, finite), which is kept; no PEFT export is written."""
    import math

    import pedestrian.training.loop as loop_module
    from pedestrian.checkpoint import load_checkpoint

    tmp, base, _ = run
    real, calls = loop_module.train_step, [0]

    def step(*args, **kwargs):
        calls[0] += 1
        return (math.nan, math.nan) if calls[0] >= 3 else real(*args, **kwargs)

    monkeypatch.setattr(loop_module, "train_step", step)
    out = tmp_path / "ft"
    code, _, err = main(capsys, "finetune", "--hf-dir", base, "--data", tmp / "data.txt", "--lora-rank", "2",
                        "--max-steps", "20", "--context-length", "16", "--batch-size", "2", "--eval-interval", "2",
                        "--eval-batches", "1", "--max-skipped-steps", "3", "--out", out, "--no-progress")
    lines = err.strip().splitlines()
    assert code == 2 and [line.split(":")[1] for line in lines[:3]] == [" step 3", " step 4", " step 5"]
    assert lines[3].startswith("error: the training loss is nan and 3 step(s) in a row were skipped (steps 3-5)")
    assert f"the adapter checkpoint of step 4 in {out / 'adapter'} is kept (the last good one)" in lines[3]
    ckpt = load_checkpoint(out / "adapter", base_model=load_pretrained(base)[0])
    assert ckpt.step == 4 and ckpt.meta["skipped_steps"] == 2 and ckpt.optimizer_state()["step"] == 2
    assert load_checkpoint(out, base_model=load_pretrained(base)[0]).path == out / "adapter"   # the run folder too
    assert not (out / "peft").exists()


def test_a_full_disk_while_saving_names_the_last_adapter_checkpoint(run, tmp_path, monkeypatch, capsys):
    import os

    import safetensors.numpy as stn
    from safetensors import SafetensorError

    _, base, _ = run
    data = tmp_path / "data.txt"
    data.write_text(TEXT * 3, encoding="utf-8")
    out = tmp_path / "ft"
    real = stn.save_file
    seen = {"saves": 0, "at_failure": None}

    def save_file(tensors, filename, *a, **k):
        if ".adapter.tmp-" in filename and filename.endswith("model.safetensors"):
            seen["saves"] += 1
            if seen["saves"] == 2:
                seen["at_failure"] = {p.name: p.read_bytes() for p in (out / "adapter").iterdir()}
                raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(28)} (os error 28)")
        return real(tensors, filename, *a, **k)

    monkeypatch.setattr(stn, "save_file", save_file)
    code, _, err = main(capsys, "finetune", "--hf-dir", base, "--data", data, "--lora-rank", "2",
                        "--max-steps", "4", "--eval-interval", "2", "--eval-batches", "1", "--context-length",
                        "16", "--batch-size", "2", "--out", out, "--no-progress", "--no-plot")
    err = err.strip()
    assert code == 2 and err.startswith("error: could not write the checkpoint") and "\n" not in err
    assert "ENOSPC" in err and f"the adapter checkpoint of step 2 in {out / 'adapter'} is kept" in err
    assert "--overwrite" in err
    assert {p.name: p.read_bytes() for p in (out / "adapter").iterdir()} == seen["at_failure"]


def test_an_interrupted_finetune_resumes_to_the_uninterrupted_run(run, tmp_path, capsys, monkeypatch):
    """Ctrl-C after step 3, then the same command with --resume: the adapters, the AdamW state
    and the log equal those of the run that was never stopped, bit for bit (the batches' generator
    is recorded, the adapter-dropout masks depend only on the step)."""
    import pedestrian.training.loop as loop_module
    from cli_helpers import ctrl_c_at_step
    from pedestrian.checkpoint import load_checkpoint
    from pedestrian.training import read_log

    tmp, base, _ = run
    data = tmp_path / "data.txt"
    data.write_text((tmp / "data.txt").read_text(encoding="utf-8"), encoding="utf-8")
    argv = ["finetune", "--hf-dir", base, "--data", data, "--lora-rank", "2", "--lora-dropout", "0.1",
            "--lora-targets", "q", "mlp_contract", "--max-steps", "6", "--context-length", "16", "--batch-size", "2",
            "--eval-interval", "2", "--eval-batches", "1", "--lr", "1e-2", "--no-progress", "--no-plot"]
    assert main(capsys, *argv, "--out", tmp_path / "straight")[0] == 0
    real = loop_module.train_step
    ctrl_c_at_step(monkeypatch, 3)
    out = tmp_path / "stopped"
    code, said, err = main(capsys, *argv, "--out", out)
    assert code == 130 and f"continue with: pedestrian finetune --hf-dir {base} --data {data} " \
        f"--lora-rank 2 --out {out} --resume" in err
    assert "(at step 2, the last evaluation)" in said + err         # the val loss is step 2's, not 3's
    monkeypatch.setattr(loop_module, "train_step", real)
    assert json.loads((out / "adapter" / "state.json").read_text())["step"] == 3
    code, _, err = main(capsys, *argv, "--out", out, "--resume")
    assert code == 0, err
    base_model = load_pretrained(base)[0]
    a = load_checkpoint(tmp_path / "straight", base_model=base_model)
    a_params = {k: v.copy() for k, v in a.model.params.items() if ".lora_" in k}
    a_opt = a.optimizer_state()
    b = load_checkpoint(out, base_model=load_pretrained(base)[0])
    assert b.step == a.step == 6
    for k, v in a_params.items():
        np.testing.assert_array_equal(b.model.params[k], v, err_msg=k)
    b_opt = b.optimizer_state()
    assert b_opt["step"] == a_opt["step"] and all(np.array_equal(b_opt[k], a_opt[k]) for k in ("lora.m", "lora.v"))
    assert read_log(out / "log.jsonl") == [dict(r, time_s=r2["time_s"], tokens_per_s=r2["tokens_per_s"])
                                           if "time_s" in r else r for r, r2 in
                                           zip(read_log(tmp_path / "straight" / "log.jsonl"), read_log(out / "log.jsonl"))]
    # the record: the text's absolute path (a resume or eval from another folder finds it)
    assert json.loads((out / "adapter" / "state.json").read_text())["meta"]["finetune"]["data"] == str(data.resolve())
    # the same layers by their Llama-style or pedestrian names, in any order: the same run
    swapped = ["mlp_contract" if a == "q" else "q" if a == "mlp_contract" else a for a in argv]
    code, _, err = main(capsys, *swapped, "--out", out, "--resume", "--max-steps", "7")
    assert code == 0, err
    # from Python, every setting must match the record (here --lora-targets and more do not)
    from pedestrian.training.finetune import FinetuneSettings, finetune
    with pytest.raises(ValueError, match=r"was fine-tuned with .*--lora-dropout 0.1 \(you gave 0.0\); .*"
                                         r"--lora-targets q mlp_contract \(you gave q v\)"):
        finetune(FinetuneSettings(hf_dir=str(base), data=str(data), lora_rank=2, out=str(out), resume=True, max_steps=9))
    data.write_text(data.read_text(encoding="utf-8") + "one more line\n", encoding="utf-8")   # another text
    code, _, err = main(capsys, *argv, "--out", out, "--resume", "--max-steps", "9")
    one_error_line(code, err, "is not the one the run in", "changed since")


def test_finetune_resume_refuses_what_it_cannot_continue(run, tmp_path, capsys):
    tmp, base, out = run
    argv = ["finetune", "--hf-dir", base, "--data", tmp / "data.txt", "--lora-rank", "4", "--no-progress"]
    code, _, err = main(capsys, *argv, "--out", tmp_path / "none", "--resume")
    one_error_line(code, err, "does not exist", "start the run without --resume")
    (tmp_path / "empty").mkdir()
    code, _, err = main(capsys, *argv, "--out", tmp_path / "empty", "--resume")
    one_error_line(code, err, "holds no adapter checkpoint", "start the run without --resume")
    (tmp_path / "trained" / "latest").mkdir(parents=True)                # a `pedestrian train` run
    (tmp_path / "trained" / "latest" / "state.json").write_text("{}")
    code, _, err = main(capsys, *argv, "--out", tmp_path / "trained", "--resume")
    one_error_line(code, err, "holds a `pedestrian train` run: choose another --out")
    code, _, err = main(capsys, *argv, "--out", tmp_path / "trained")
    one_error_line(code, err, "holds a `pedestrian train` run; choose another --out")
    code, _, err = main(capsys, *argv, "--out", out, "--resume")                    # at its --max-steps 40
    one_error_line(code, err, "already reaches --max-steps 40", "pass a larger --max-steps")
    other = save_hf_dir(hf_model(seed=9), tmp_path / "other")     # another base: that is said first
    capsys.readouterr()
    code, _, err = main(capsys, "finetune", "--hf-dir", other, "--data", tmp / "data.txt", "--lora-rank", "4",
                        "--no-progress", "--out", out, "--resume")
    one_error_line(code, err, "trained on other weights", "pass the base they were trained on")
    code, _, err = main(capsys, *argv, "--out", out, "--resume", "--max-steps", "50", "--lora-rank", "8")
    one_error_line(code, err, "fine-tuned with a different config: --lora-rank 4 (you gave 8)", "leave those flags out")
    code, _, err = main(capsys, *argv, "--out", out, "--resume", "--overwrite")
    one_error_line(code, err, "pass one of them")
    code, _, err = main(capsys, *argv, "--out", out, "--max-steps", "50")
    one_error_line(code, err, "already holds a run; pass --resume to continue it")

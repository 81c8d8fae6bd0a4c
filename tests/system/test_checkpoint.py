"""Checkpoints: round trip, atomic replacement (a kill at any moment leaves one loadable),
damaged files detected, adapter-only (LoRA) checkpoints."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from pedestrian import atomic
from pedestrian import checkpoint as ck
from pedestrian.checkpoint import CheckpointError, copy_checkpoint, load_checkpoint, save_checkpoint
from pedestrian.config import GPTConfig
from pedestrian.model import GPT
from pedestrian.training.optim import AdamW
from pedestrian.text.tokenizer import CharTokenizer

CFG = GPTConfig(vocab_size=7, context_length=6, d_model=8, n_heads=2, n_blocks=1, dropout=0.1)
X = np.array([[0, 1, 2, 3, 4, 5]])
Y = np.array([[1, 2, 3, 4, 5, 6]])


def _trained(seed=0, steps=2, dtype="float32"):
    model = GPT(CFG, seed=seed, dtype=dtype)
    opt = AdamW(model, lr=1e-2)
    for _ in range(steps):
        model.loss(X, Y)
        model.backward()
        opt.step()
    return model, opt


def _files(folder):
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


def test_round_trip(tmp_path):
    model, opt = _trained()
    tok = CharTokenizer(list("abcdefg"))
    path = save_checkpoint(tmp_path / "latest", model, opt, tok, step=2, meta={"note": "x", "n": [1, 2]})
    assert sorted(os.listdir(path)) == ["model.safetensors", "optimizer.safetensors", "state.json"]
    c = load_checkpoint(tmp_path)                        # the run folder means its latest/
    assert c.path == path and c.step == 2 and c.config == CFG and c.meta == {"note": "x", "n": [1, 2]}
    assert c.tokenizer == tok
    for k, v in model.params.items():
        np.testing.assert_array_equal(c.model.params[k], v)
    assert c.model.dtype_name == "float32"
    # the dropout RNG continues where it was
    assert c.model.dropout_rng.random() == model.dropout_rng.random()
    state = c.optimizer_state()
    fresh = AdamW(c.model, lr=1e-2)
    fresh.load_state_dict(state)
    assert fresh.step_count == 2
    np.testing.assert_array_equal(fresh.m[0], opt.m[0])
    assert list(os.listdir(tmp_path)) == ["latest"]      # no temporary folders left behind


def test_other_backend_and_dtype(tmp_path):
    model, opt = _trained()
    save_checkpoint(tmp_path / "c", model, opt, None, step=2)
    c = load_checkpoint(tmp_path / "c", backend="torch", dtype="float64")
    assert str(c.model.flat.dtype) == "torch.float64"
    np.testing.assert_allclose(c.model.flat.numpy(), model.flat, rtol=1e-7)
    assert c.tokenizer is None


def test_replace_keeps_one_loadable_checkpoint_at_every_moment(tmp_path, monkeypatch):
    """Kill the second save at each stage: while writing files, between the two renames, and
    before the old folder is deleted. Every time the checkpoint still loads (old or new)."""
    m1, o1 = _trained(seed=1)
    m2, o2 = _trained(seed=2)
    final = tmp_path / "latest"
    save_checkpoint(final, m1, o1, None, step=1)
    original = _files(final)

    class Killed(BaseException):
        pass

    # 1. killed while writing the optimizer file
    import safetensors.numpy as stn

    calls = {"n": 0}
    real_save_file = stn.save_file

    def dying_save_file(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise Killed()
        return real_save_file(*a, **k)

    monkeypatch.setattr(stn, "save_file", dying_save_file)
    with pytest.raises(Killed):
        save_checkpoint(final, m2, o2, None, step=2)
    monkeypatch.setattr(stn, "save_file", real_save_file)
    assert _files(final) == original and load_checkpoint(final).step == 1

    # 2. killed between "latest -> .latest.old" and ".tmp -> latest"
    real_rename = os.rename
    seen = []

    def dying_rename(src, dst):
        seen.append((str(src), str(dst)))
        if len(seen) == 2:
            raise Killed()
        return real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", dying_rename)
    with pytest.raises(Killed):
        save_checkpoint(final, m2, o2, None, step=2)
    monkeypatch.setattr(atomic.os, "rename", real_rename)
    assert not final.exists()
    c = load_checkpoint(final)                           # found at .latest.old
    assert c.step == 1
    np.testing.assert_array_equal(c.model.flat, m1.flat)
    assert load_checkpoint(tmp_path).step == 1           # also through the run folder

    # the next save recovers the old folder first, then replaces it
    save_checkpoint(final, m2, o2, None, step=2)
    assert load_checkpoint(final).step == 2
    assert sorted(os.listdir(tmp_path)) == ["latest"]

    # 3. killed after the swap, before the old copy is removed: the new one is in place
    real_rmtree = ck.shutil.rmtree

    def dying_rmtree(path, *a, **k):
        if str(path).endswith(".latest.old"):
            raise Killed()
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(ck.shutil, "rmtree", dying_rmtree)
    with pytest.raises(Killed):
        save_checkpoint(final, m1, o1, None, step=3)
    monkeypatch.setattr(ck.shutil, "rmtree", real_rmtree)
    assert load_checkpoint(final).step == 3
    save_checkpoint(final, m1, o1, None, step=4)         # cleans the stale .latest.old
    assert sorted(os.listdir(tmp_path)) == ["latest"]


def test_copy_checkpoint(tmp_path):
    model, opt = _trained()
    save_checkpoint(tmp_path / "latest", model, opt, None, step=5)
    copy_checkpoint(tmp_path / "latest", tmp_path / "best")
    assert _files(tmp_path / "best") == _files(tmp_path / "latest")
    assert load_checkpoint(tmp_path / "best").step == 5


@pytest.mark.parametrize("damage", ["truncate_model", "flip_model", "truncate_optimizer", "state_json",
                                    "missing_model", "foreign_tensors"])
def test_damaged_checkpoint_is_a_clear_error(tmp_path, damage):
    model, opt = _trained()
    folder = save_checkpoint(tmp_path / "latest", model, opt, None, step=2)
    f = folder / "model.safetensors"
    if damage == "truncate_model":
        f.write_bytes(f.read_bytes()[:-100])
    elif damage == "flip_model":
        data = bytearray(f.read_bytes())
        data[-5] ^= 0xFF
        f.write_bytes(bytes(data))
    elif damage == "truncate_optimizer":
        g = folder / "optimizer.safetensors"
        g.write_bytes(g.read_bytes()[:50])
    elif damage == "state_json":
        s = folder / "state.json"
        s.write_text(s.read_text()[:200])
    elif damage == "missing_model":
        f.unlink()
    elif damage == "foreign_tensors":
        # a model file from another config, with its record updated so only the shapes differ
        other = GPT(GPTConfig(vocab_size=7, context_length=6, d_model=4, n_heads=2, n_blocks=1))
        save_checkpoint(tmp_path / "other", other, None, None)
        f.write_bytes((tmp_path / "other" / "model.safetensors").read_bytes())
        s = folder / "state.json"
        state = json.loads(s.read_text())
        state["files"]["model.safetensors"] = ck._file_record(f)
        s.write_text(json.dumps(state))
    with pytest.raises(CheckpointError) as info:
        c = load_checkpoint(folder)
        c.optimizer_state()
    msg = str(info.value)
    assert "\n" not in msg
    assert str(folder) in msg
    if damage == "foreign_tensors":
        assert "do not match" in msg
    else:
        assert any(w in msg for w in ("truncated", "corrupted", "missing"))
    assert "re-run training" in msg


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="state.json"):
        load_checkpoint(tmp_path / "empty")
    (tmp_path / "hf").mkdir()                       # `pedestrian eval llama/`: a Hugging Face folder
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="a Hugging Face model folder.*--hf-dir"):
        load_checkpoint(tmp_path / "hf")


def test_lora_adapter_only_checkpoint(tmp_path):
    base = GPT(CFG, seed=4, dtype="float64")
    model = GPT(CFG, seed=4, dtype="float64")
    model.add_lora(["q", "v"], rank=2, alpha=2.0, seed=1, freeze_base=True)
    opt = AdamW(model, lr=1e-2)
    model.training = False
    for _ in range(2):
        model.loss(X, Y)
        model.backward()
        opt.step()
    folder = save_checkpoint(tmp_path / "adapter", model, opt, None, step=2, params="lora",
                             base={"source": "test base, seed 4"})
    state = json.loads((folder / "state.json").read_text())
    assert state["params"] == "lora" and state["base"]["source"] == "test base, seed 4"
    assert state["base"]["config"] == CFG.to_dict()
    assert state["lora"] == {"targets": ["blocks.0.attn.q", "blocks.0.attn.v"], "rank": 2, "alpha": 2.0,
                             "freeze_base": True, "ranks": {"blocks.0.attn.q": 2, "blocks.0.attn.v": 2},
                             "alphas": {"blocks.0.attn.q": 2.0, "blocks.0.attn.v": 2.0}, "dropout": 0.0}
    from safetensors.numpy import load_file

    assert sorted(load_file(str(folder / "model.safetensors"))) == sorted(model.lora_state_dict())
    assert sorted(load_file(str(folder / "optimizer.safetensors"))) == ["lora.m", "lora.v"]
    with pytest.raises(CheckpointError, match="only LoRA adapters"):
        load_checkpoint(folder)
    c = load_checkpoint(folder, base_model=base)
    c.model.training = False
    np.testing.assert_array_equal(c.model.forward(X), model.forward(X))   # the same numbers, the same operations
    wrong = GPT(GPTConfig(vocab_size=7, context_length=6, d_model=4, n_heads=2, n_blocks=1))
    with pytest.raises(CheckpointError, match="belong to a base model"):
        load_checkpoint(folder, base_model=wrong)


def test_meta_must_be_json(tmp_path):
    model, opt = _trained()
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path / "c", model, opt, None, meta={"x": object()})
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------------------------- no NaN / inf
@pytest.mark.parametrize("where", ["parameter", "moment"])
def test_save_refuses_non_finite_values_and_keeps_the_previous_checkpoint(tmp_path, where):
    model, opt = _trained()
    final = save_checkpoint(tmp_path / "latest", model, opt, None, step=2)
    before = _files(final)
    if where == "parameter":
        model.params["blocks.0.attn.q.weight"][0, :3] = [np.nan, np.inf, np.nan]
        name = "blocks.0.attn.q.weight (2 NaN, 1 inf of 64 values)"
    else:
        opt.v[0][5] = np.inf
        name = "optimizer base.v (0 NaN, 1 inf of"
    with pytest.raises(ck.NonFiniteError) as info:
        save_checkpoint(final, model, opt, None, step=3)
    msg = str(info.value)
    assert name in msg and "nothing was written" in msg and "\n" not in msg
    assert _files(final) == before and sorted(os.listdir(tmp_path)) == ["latest"]
    assert isinstance(info.value, CheckpointError)


def _poke(folder, name, value, index=0):
    """Write ``value`` into tensor ``name`` of model.safetensors with safetensors' own writer and
    record the new file in state.json, so that only the value itself is wrong."""
    from safetensors.numpy import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    tensors[name].reshape(-1)[index] = value
    save_file(tensors, str(f), metadata={"format": ck.FORMAT})
    s = folder / "state.json"
    state = json.loads(s.read_text())
    state["files"]["model.safetensors"] = {"bytes": f.stat().st_size,
                                           "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    s.write_text(json.dumps(state))


@pytest.mark.parametrize("value", [np.nan, -np.inf])
def test_load_refuses_non_finite_weights(tmp_path, value):
    model, opt = _trained()
    folder = save_checkpoint(tmp_path / "latest", model, opt, CharTokenizer(list("abcdefg")), step=2)
    _poke(folder, "tok_emb.weight", value, index=9)
    with pytest.raises(ck.NonFiniteError) as info:
        load_checkpoint(folder)
    msg = str(info.value)
    kind = "1 NaN, 0 inf" if np.isnan(value) else "0 NaN, 1 inf"
    assert f"tok_emb.weight ({kind} of 56 values)" in msg and str(folder) in msg and "\n" not in msg
    assert info.value.counts == {"tok_emb.weight": (1, 0) if np.isnan(value) else (0, 1)}


def test_sample_on_a_checkpoint_with_a_nan_is_one_error_line(tmp_path, capsys):
    """Before: a NaN weight made `pedestrian sample` print a page of newlines (id 0), exit 0."""
    from pedestrian.cli import main

    model, opt = _trained()
    folder = save_checkpoint(tmp_path / "ckpt", model, opt, CharTokenizer(list("abcdefg")), step=2)
    _poke(folder, "blocks.0.ln1.weight", np.nan)
    assert main(["sample", "--checkpoint", str(folder), "--prompt", "abc", "--max-new-tokens", "20"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    err = err.strip()
    assert err.startswith("error: checkpoint file") and "blocks.0.ln1.weight (1 NaN" in err and "\n" not in err


def test_train_whose_weights_turn_non_finite_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    """A weight that becomes NaN while the loss is still finite: the next save is refused, the
    run ends with one line naming the tensor, the last good checkpoint and the resume command."""
    from pedestrian.training import loop as train_module
    from pedestrian.cli import main

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"line {i}: the quick brown fox" for i in range(100)), encoding="utf-8")
    real = train_module.train_step
    steps = []

    def step(model, optimizer, *a, **k):
        out = real(model, optimizer, *a, **k)
        steps.append(1)
        if len(steps) == 6:                  # after the loss of step 6, before its save
            model.params["ln_final.bias"][0] = np.nan
        return out

    monkeypatch.setattr(train_module, "train_step", step)
    out = tmp_path / "run"
    code = main(["train", "--data", str(corpus), "--out", str(out), "--max-steps", "9", "--context-length", "8",
                 "--d-model", "8", "--n-heads", "2", "--n-blocks", "1", "--batch-size", "2",
                 "--eval-interval", "3", "--eval-batches", "1", "--warmup-steps", "1", "--no-progress",
                 "--no-plot"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith("error: refusing to save a checkpoint")
    assert "ln_final.bias (1 NaN, 0 inf of 8 values)" in err
    assert f"the checkpoint of step 3 in {out / 'latest'} is kept" in err and "--resume" in err
    assert load_checkpoint(out).step == 3


def test_moments_of_a_checkpoint_with_gate_and_up_apart_are_read_in_the_fused_layout(tmp_path):
    """Checkpoints written before SwiGLU's gate and up weights became one region (layout 1: each
    ``(d, m)`` region apart) hold the base moments in that order; reading them gives the moments
    of every parameter by name, in today's layout, so a resumed run goes on exactly."""
    from safetensors.numpy import load_file, save_file

    from pedestrian.checkpoint import _file_record
    from pedestrian.config import preset
    from pedestrian.model.buffers import FlatParams, base_regions
    from pedestrian.training.optim import AdamW

    model = GPT(preset("llama-char", vocab_size=17, n_blocks=2, context_length=8), seed=0)
    opt = AdamW(model, lr=1e-2)
    x = np.random.default_rng(0).integers(0, 17, (2, 9))
    model.loss(x[:, :-1], x[:, 1:])
    model.backward()
    opt.step()
    want = {k: np.array(v) for k, v in opt.state_dict().items() if k.startswith("base.")}
    folder = save_checkpoint(tmp_path / "ckpt", model, opt)
    regions = base_regions(model.config, model.parameters.specs)
    old_regions = base_regions(model.config, model.parameters.specs, fuse_gate_up=False)
    assert regions != old_regions                               # the layouts differ
    # layout 1 as written before the change (commit 09e17a0): every parameter its own contiguous
    # region in spec order, but q, k, v (columns of attn.qkv)
    layout1 = FlatParams(np, np.float32, old_regions)
    assert all(v.flags.c_contiguous for n, v in layout1.views.items() if ".attn." not in n)
    assert [n for n in layout1.regions if ".attn." not in n] == [
        s.name for s in model.parameters.specs if ".attn." not in s.name and s.decay] + [
        s.name for s in model.parameters.specs if ".attn." not in s.name and not s.decay]
    tensors = load_file(str(folder / "optimizer.safetensors"))
    for key in ("base.m", "base.v"):                          # write the moments as layout 1 did
        new, old = FlatParams(np, np.float32, regions), FlatParams(np, np.float32, old_regions)
        new.flat[...] = tensors[key]
        for name, view in new.views.items():
            old.views[name][...] = view
        assert not np.array_equal(old.flat, tensors[key])
        tensors[key] = old.flat
    save_file(tensors, str(folder / "optimizer.safetensors"))
    state = json.loads((folder / "state.json").read_text())
    del state["optimizer"]["layout"]
    state["files"]["optimizer.safetensors"] = _file_record(folder / "optimizer.safetensors")
    (folder / "state.json").write_text(json.dumps(state))
    got = load_checkpoint(folder).optimizer_state()
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)

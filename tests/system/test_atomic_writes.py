"""Every file pedestrian writes goes through pedestrian.atomic: an OS failure while writing (no
space, file too large, no permission, read-only file system) -- simulated at each low-level step
(creating the temporary file or folder, writing, fsync, the final rename) and inside safetensors'
own writer -- leaves what was there before byte for byte, leaves no temporary file behind, and
ends the command line with one `error:` line that says what failed, what was kept and how to go
on."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from safetensors import SafetensorError

import safetensors.numpy as stn
from pedestrian import atomic
from pedestrian.atomic import AppendLog, WriteError, atomic_dir, write_file
from pedestrian.checkpoint import copy_checkpoint, load_checkpoint, save_checkpoint
from pedestrian.cli import main
from pedestrian.config import GPTConfig
from pedestrian.text.tokens import encode_to_token_file
from pedestrian.interop.hf import load_hf_model, save_pretrained
from pedestrian.interop.peft import save_peft_adapter
from pedestrian.model import GPT
from pedestrian.training.optim import AdamW
from pedestrian.text.tokenizer import CharTokenizer
from pedestrian.training import plot_loss_curve

from cli_helpers import write_fox_corpus

ERRNOS = [errno.ENOSPC, errno.EFBIG, errno.EACCES, errno.EROFS]
NAMES = {errno.ENOSPC: "ENOSPC", errno.EFBIG: "EFBIG", errno.EACCES: "EACCES", errno.EROFS: "EROFS"}
CFG = GPTConfig(vocab_size=7, context_length=6, d_model=8, n_heads=2, n_blocks=1)


def os_error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def safetensors_error(code: int) -> SafetensorError:
    """What safetensors' Rust writer raises for an io::Error (not an OSError)."""
    return SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too), path -> bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def fail_at(monkeypatch, stage: str, code: int, *, nth: int = 1) -> None:
    """Make the ``nth`` call of one low-level step raise the OSError ``code`` (from then on)."""
    calls = {"n": 0}

    def failing(real, *, only=lambda *a: True):
        def f(*a, **k):
            if only(*a):
                calls["n"] += 1
                if calls["n"] >= nth:
                    raise os_error(code)
            return real(*a, **k)
        return f

    if stage == "write":            # file data, by file descriptor (not stdout / stderr)
        monkeypatch.setattr(os, "write", failing(os.write, only=lambda fd, *a: fd > 2))
    elif stage == "fsync":
        monkeypatch.setattr(os, "fsync", failing(os.fsync))
    elif stage == "replace":
        monkeypatch.setattr(os, "replace", failing(os.replace))
    elif stage == "rename":
        monkeypatch.setattr(os, "rename", failing(os.rename))
    elif stage == "mkstemp":
        monkeypatch.setattr(tempfile, "mkstemp", failing(tempfile.mkstemp))
    elif stage == "mkdtemp":
        monkeypatch.setattr(tempfile, "mkdtemp", failing(tempfile.mkdtemp))
    elif stage == "safetensors":
        real = stn.save_file

        def save_file(*a, **k):
            calls["n"] += 1
            if calls["n"] >= nth:
                raise safetensors_error(code)
            return real(*a, **k)
        monkeypatch.setattr(stn, "save_file", save_file)
    else:  # pragma: no cover
        raise ValueError(stage)


def assert_one_line(exc: WriteError, path: Path, code: int) -> str:
    msg = str(exc)
    assert "\n" not in msg
    assert msg.startswith("could not write ") and str(path) in msg and NAMES[code] in msg
    assert exc.errno == code and isinstance(exc, OSError)
    return msg


# ------------------------------------------------------------------------------------ files
@pytest.mark.parametrize("code", ERRNOS, ids=NAMES.get)
@pytest.mark.parametrize("stage", ["mkstemp", "write", "fsync", "replace"])
def test_write_file_keeps_the_old_file(tmp_path, monkeypatch, stage, code):
    f = tmp_path / "notes.txt"
    f.write_bytes(b"old content\n")
    fail_at(monkeypatch, stage, code)
    with pytest.raises(WriteError) as info:
        write_file(f, "new content, much longer than the old one\n" * 100, what="the notes")
    monkeypatch.undo()
    msg = assert_one_line(info.value, f, code)
    assert "the notes" in msg and "the previous one there is unchanged" in msg
    assert snapshot(tmp_path) == {"notes.txt": b"old content\n"}      # no temporary left either


@pytest.mark.parametrize("stage", ["write", "replace"])
def test_write_file_creating_a_new_file_leaves_nothing(tmp_path, monkeypatch, stage):
    fail_at(monkeypatch, stage, errno.ENOSPC)
    with pytest.raises(WriteError, match="nothing was left there"):
        write_file(tmp_path / "new.bin", [b"a" * 10, b"b" * 10])
    assert list(tmp_path.iterdir()) == []


def test_write_file_streams_chunks_and_callables(tmp_path):
    write_file(tmp_path / "a", [b"ab", "cé", memoryview(b"d")])
    assert (tmp_path / "a").read_bytes() == b"abc\xc3\xa9d"
    write_file(tmp_path / "b", lambda p: p.write_bytes(b"by path"))
    assert (tmp_path / "b").read_bytes() == b"by path"
    assert oct((tmp_path / "b").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_write_error_messages_say_why_and_what_to_do(tmp_path):
    for code, words in [(errno.ENOSPC, "Free some disk space"), (errno.EFBIG, "allows larger files"),
                        (errno.EACCES, "you may write to"), (errno.EROFS, "writable file system"),
                        (errno.EDQUOT, "quota")]:
        exc = WriteError(tmp_path / "x", "the thing", os_error(code), ["the previous one there is unchanged"])
        assert words in str(exc) and "then run the command again" in str(exc)
        more = exc.advise("the checkpoint of step 3 is kept", "continue with: X")
        assert str(more).endswith("then continue with: X") and "step 3 is kept" in str(more)
    # the SafetensorError of a full disk is translated; other exceptions pass through
    with pytest.raises(WriteError, match="ENOSPC"):
        with atomic.reporting(tmp_path / "x", "the thing"):
            raise safetensors_error(errno.ENOSPC)
    with pytest.raises(KeyError):
        with atomic.reporting(tmp_path / "x", "the thing"):
            raise KeyError("not an OS error")


def test_append_log_keeps_earlier_records(tmp_path, monkeypatch):
    path = tmp_path / "log.jsonl"
    log = AppendLog(path, "the training log")
    log.write('{"step": 1}\n')
    fail_at(monkeypatch, "write", errno.ENOSPC)
    with pytest.raises(WriteError) as info:
        log.write('{"step": 2}\n')
    monkeypatch.undo()
    log.close()
    assert "its earlier records are kept" in assert_one_line(info.value, path, errno.ENOSPC)
    assert path.read_text() == '{"step": 1}\n'
    with pytest.raises(WriteError, match="EACCES"):            # cannot even open it
        fail_at(monkeypatch, "write", errno.EACCES)
        monkeypatch.setattr(os, "open", lambda *a, **k: (_ for _ in ()).throw(os_error(errno.EACCES)))
        AppendLog(tmp_path / "other.jsonl")


@pytest.mark.parametrize("code", ERRNOS, ids=NAMES.get)
@pytest.mark.parametrize("stage", ["mkstemp", "write", "replace"])
def test_loss_curve_png_keeps_the_old_one(tmp_path, monkeypatch, stage, code):
    png = plot_loss_curve([{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}], tmp_path / "loss_curve.png")
    before = snapshot(tmp_path)
    fail_at(monkeypatch, stage, code)
    with pytest.raises(WriteError) as info:
        plot_loss_curve([{"step": 1, "loss": 3.0}, {"step": 2, "val_loss": 2.0}], png)
    monkeypatch.undo()
    assert "the loss curve" in assert_one_line(info.value, png, code)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("code", ERRNOS, ids=NAMES.get)
def test_tokenizer_file_keeps_the_old_one(tmp_path, monkeypatch, code):
    CharTokenizer(list("abc")).save(tmp_path / "tok.json")
    before = snapshot(tmp_path)
    fail_at(monkeypatch, "fsync", code)
    with pytest.raises(WriteError, match="the tokenizer file"):
        CharTokenizer(list("abcd")).save(tmp_path / "tok.json")
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------------ checkpoints
def _trained(seed=0):
    model = GPT(CFG, seed=seed)
    opt = AdamW(model, lr=1e-2)
    x = np.array([[0, 1, 2, 3, 4, 5]])
    model.loss(x, (x + 1) % 7)
    model.backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("code", ERRNOS, ids=NAMES.get)
@pytest.mark.parametrize("stage", ["mkdtemp", "safetensors", "fsync", "rename"])
def test_checkpoint_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, stage, code):
    m1, o1 = _trained(1)
    m2, o2 = _trained(2)
    final = save_checkpoint(tmp_path / "latest", m1, o1, CharTokenizer(list("abcdefg")), step=1)
    before = snapshot(tmp_path)
    fail_at(monkeypatch, stage, code, nth=2 if stage == "safetensors" else 1)   # the optimizer file
    with pytest.raises(WriteError) as info:
        save_checkpoint(final, m2, o2, None, step=2)
    monkeypatch.undo()
    msg = assert_one_line(info.value, final, code)
    assert "the checkpoint" in msg and "the previous one there is unchanged" in msg
    assert snapshot(tmp_path) == before                    # byte for byte, no temporary folder
    assert load_checkpoint(final).step == 1


def test_an_error_between_the_two_renames_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    """`latest -> .latest.old` succeeded, `.tmp -> latest` failed: the old folder is renamed
    back at once (a kill at that moment is recovered by the next save; test_checkpoint.py)."""
    m1, o1 = _trained(1)
    final = save_checkpoint(tmp_path / "latest", m1, o1, None, step=1)
    before = snapshot(tmp_path)
    real = os.rename

    def rename(src, dst):
        if Path(dst) == final and ".latest.tmp-" in str(src):
            raise os_error(errno.EACCES)
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(WriteError, match="EACCES"):
        save_checkpoint(final, *_trained(2), None, step=2)
    monkeypatch.undo()
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("stage", ["write", "fsync", "rename"])
def test_copy_checkpoint_keeps_the_old_best(tmp_path, monkeypatch, stage):
    m1, o1 = _trained(1)
    save_checkpoint(tmp_path / "latest", m1, o1, None, step=1)
    copy_checkpoint(tmp_path / "latest", tmp_path / "best")
    save_checkpoint(tmp_path / "latest", *_trained(2), None, step=2)
    before = snapshot(tmp_path)
    if stage == "write":        # shutil.copyfile writes through the OS's copy call: fail it there
        monkeypatch.setattr(atomic.shutil, "copyfile", lambda *a, **k: (_ for _ in ()).throw(
            os_error(errno.ENOSPC)))
    else:
        fail_at(monkeypatch, stage, errno.ENOSPC)
    with pytest.raises(WriteError, match=str(tmp_path / "best")):
        copy_checkpoint(tmp_path / "latest", tmp_path / "best")
    monkeypatch.undo()
    assert snapshot(tmp_path) == before
    assert load_checkpoint(tmp_path / "best").step == 1


def test_atomic_dir_passes_other_errors_through_and_cleans_up(tmp_path):
    with pytest.raises(KeyError):
        with atomic_dir(tmp_path / "d") as tmp:
            (tmp / "x").write_text("half")
            raise KeyError("boom")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------ exports
def _gpt2_like(seed=0):
    return GPT(GPTConfig(vocab_size=7, context_length=8, d_model=8, n_heads=2, n_blocks=1), seed=seed)


@pytest.mark.parametrize("code", ERRNOS, ids=NAMES.get)
@pytest.mark.parametrize("stage", ["safetensors", "fsync", "replace"])
def test_hf_export_over_an_existing_directory_keeps_it(tmp_path, monkeypatch, stage, code):
    out = save_pretrained(_gpt2_like(0), tmp_path / "hf", CharTokenizer(list("abcdefg")))
    (out / "README.md").write_text("mine")
    before = snapshot(tmp_path)
    fail_at(monkeypatch, stage, code)
    with pytest.raises(WriteError) as info:
        save_pretrained(_gpt2_like(1), out, CharTokenizer(list("abcdefg")), overwrite=True)
    monkeypatch.undo()
    assert "the model directory" in assert_one_line(info.value, out, code)
    assert snapshot(tmp_path) == before
    np.testing.assert_array_equal(load_hf_model(out).params["tok_emb.weight"],
                                  _gpt2_like(0).params["tok_emb.weight"])


def test_hf_export_to_a_new_directory_leaves_nothing(tmp_path, monkeypatch):
    fail_at(monkeypatch, "safetensors", errno.ENOSPC)
    with pytest.raises(WriteError, match="nothing was left there"):
        save_pretrained(_gpt2_like(0), tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


class _FullDiskTokenizer:
    """A ``tokenizers.Tokenizer`` whose ``save`` fails as the Rust library does on a full disk:
    a plain ``Exception("No space left on device (os error 28)")``, not an ``OSError``."""

    def __init__(self, real, code):
        self._real, self._code = real, code

    def save(self, *args, **kwargs):
        raise Exception(f"{os.strerror(self._code)} (os error {self._code})")

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.mark.parametrize("code", ERRNOS, ids=NAMES.get)
def test_hf_export_with_a_bpe_tokenizer_whose_writer_fails(tmp_path, monkeypatch, code):
    """``tokenizer.json`` is written by the ``tokenizers`` library, whose I/O errors are plain
    Exceptions naming the OS error: one WriteError, the old directory kept."""
    from pedestrian.text.tokenizer import BPETokenizer

    tok = BPETokenizer.train("abc abd abe " * 30, vocab_size=262)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=6, d_model=8, n_heads=2, n_blocks=1))
    out = save_pretrained(model, tmp_path / "hf", tok)
    before = snapshot(tmp_path)
    monkeypatch.setattr(tok, "hf", _FullDiskTokenizer(tok.hf, code))
    with pytest.raises(WriteError) as info:
        save_pretrained(model, out, tok, overwrite=True)
    monkeypatch.undo()
    assert_one_line(info.value, out, code)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("code", ERRNOS, ids=NAMES.get)
def test_peft_export_keeps_the_old_adapter(tmp_path, monkeypatch, code):
    model = _gpt2_like(0)
    model.add_lora(["q", "v"], rank=2, seed=1)
    out = save_peft_adapter(model, tmp_path / "peft")
    before = snapshot(tmp_path)
    model.params["blocks.0.attn.q.lora_U"][...] = 1.0
    fail_at(monkeypatch, "safetensors", code)
    with pytest.raises(WriteError) as info:
        save_peft_adapter(model, out, overwrite=True)
    monkeypatch.undo()
    assert "the PEFT adapter directory" in assert_one_line(info.value, out, code)
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------------ token cache
@pytest.mark.parametrize("code", ERRNOS, ids=NAMES.get)
@pytest.mark.parametrize("stage", ["mkstemp", "write", "fsync", "replace"])
def test_token_cache_failure_leaves_no_partial_file(tmp_path, monkeypatch, stage, code):
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 50, encoding="utf-8")
    cache = tmp_path / "cache"
    encode_to_token_file(corpus, CharTokenizer(sorted(set("hello world\n"))), cache_dir=cache)
    before = snapshot(tmp_path)
    fail_at(monkeypatch, stage, code)
    with pytest.raises(WriteError) as info:     # another tokenizer: another cache file
        encode_to_token_file(corpus, CharTokenizer(sorted(set("hello world\nxyz"))), cache_dir=cache)
    monkeypatch.undo()
    assert "the token cache" in str(info.value) and NAMES[code] in str(info.value)
    assert "\n" not in str(info.value)
    assert snapshot(tmp_path) == before                    # the old cache file and the corpus


# ------------------------------------------------------------------------------------ command line
TINY = ["--context-length", "16", "--d-model", "16", "--n-heads", "2", "--n-blocks", "1", "--batch-size", "4",
        "--eval-interval", "3", "--eval-batches", "2", "--warmup-steps", "1", "--max-minutes", "0",
        "--no-progress", "--no-plot"]
RESUME = ["--no-progress", "--no-plot"]


@pytest.fixture
def corpus(tmp_path):
    return write_fox_corpus(tmp_path / "corpus.txt", 100)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("code", ERRNOS, ids=NAMES.get)
def test_train_with_a_full_disk_names_the_last_good_checkpoint(corpus, tmp_path, monkeypatch, capsys, code):
    out = tmp_path / "run"
    real = stn.save_file
    seen = {"saves": 0, "at_failure": None}

    def save_file(tensors, filename, *a, **k):
        if Path(filename).name == "model.safetensors" and ".latest.tmp-" in filename:
            seen["saves"] += 1
        if seen["saves"] == 2:                 # the second checkpoint (step 6): the disk is full
            seen["at_failure"] = snapshot(out / "latest")
            raise safetensors_error(code)
        return real(tensors, filename, *a, **k)

    monkeypatch.setattr(stn, "save_file", save_file)
    assert main(["train", "--data", str(corpus), "--out", str(out), "--max-steps", "9", *TINY]) == 2
    monkeypatch.undo()
    err = one_error_line(capsys)
    assert f"could not write the checkpoint {out / 'latest'}" in err and NAMES[code] in err
    assert f"the checkpoint of step 3 in {out / 'latest'} is kept" in err
    assert f"pedestrian train --out {out} --resume" in err
    assert snapshot(out / "latest") == seen["at_failure"]
    assert load_checkpoint(out).step == 3
    assert not [p for p in out.iterdir() if p.name.startswith(".")]      # no temporary folder
    # and the advertised command works once there is space again
    assert main(["train", "--out", str(out), "--resume", *RESUME]) == 0
    assert load_checkpoint(out).step == 9


def test_train_first_checkpoint_failing_says_start_again(corpus, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    fail_at(monkeypatch, "safetensors", errno.ENOSPC)
    assert main(["train", "--data", str(corpus), "--out", str(out), "--max-steps", "3", *TINY]) == 2
    err = one_error_line(capsys)
    assert "no checkpoint was written" in err and err.endswith("then start again")
    assert not (out / "latest").exists()


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS], ids=NAMES.get)
def test_train_into_a_folder_it_cannot_create(corpus, tmp_path, monkeypatch, capsys, code):
    out = tmp_path / "ro" / "run"
    real = Path.mkdir

    def mkdir(self, *a, **k):
        if self == out:
            raise os_error(code)
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    assert main(["train", "--data", str(corpus), "--out", str(out), "--max-steps", "3", *TINY]) == 2
    err = one_error_line(capsys)
    assert f"could not write the run folder {out}" in err and NAMES[code] in err


def test_train_log_and_plot_failures_are_one_line(corpus, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = ["train", "--data", str(corpus), "--out", str(out), "--max-steps", "3", *TINY]
    assert main(args) == 0
    capsys.readouterr()
    before = snapshot(out)
    # the log rewrite on --resume
    fail_at(monkeypatch, "replace", errno.ENOSPC)
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "6", *RESUME]) == 2
    monkeypatch.undo()
    assert "could not write the training log" in one_error_line(capsys)
    assert snapshot(out) == before
    # a record of the log, mid-run
    real = os.write

    def write(fd, data):
        if b'"step": 5' in bytes(data):
            raise os_error(errno.ENOSPC)
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "6", *RESUME]) == 2
    monkeypatch.undo()
    err = one_error_line(capsys)
    assert "the training log" in err and "its earlier records are kept" in err
    assert f"the checkpoint of step 3 in {out / 'latest'} is kept" in err and "--resume" in err
    # the loss curve at the end of a run
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).name == "loss_curve.png":
            raise os_error(errno.EROFS)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    plot = [a for a in args if a != "--no-plot"]
    assert main([*plot, "--overwrite", "--max-steps", "3"]) == 2
    monkeypatch.undo()
    err = one_error_line(capsys)
    assert "could not write the loss curve" in err and "the run itself is saved" in err
    assert load_checkpoint(out).step == 3


def test_token_cache_failure_on_the_command_line(corpus, tmp_path, monkeypatch, capsys):
    fail_at(monkeypatch, "write", errno.ENOSPC)
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "run"), "--max-steps", "3", *TINY]) == 2
    err = one_error_line(capsys)
    assert "could not write the token cache" in err and "ENOSPC" in err
    assert [p.name for p in (tmp_path / ".pedestrian_cache").iterdir()] == []


@pytest.mark.parametrize("code", ERRNOS, ids=NAMES.get)
def test_export_hf_on_the_command_line(tmp_path, monkeypatch, capsys, code):
    ckpt = save_checkpoint(tmp_path / "ckpt", _gpt2_like(0), None, CharTokenizer(list("abcdefg")))
    out = tmp_path / "hf"
    assert main(["export-hf", "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    assert "AutoTokenizer cannot" in capsys.readouterr().out       # a character tokenizer: said so
    before = snapshot(tmp_path)
    fail_at(monkeypatch, "safetensors", code)
    assert main(["export-hf", "--checkpoint", str(ckpt), "--out", str(out), "--overwrite"]) == 2
    err = one_error_line(capsys)
    assert f"could not write the model directory {out}" in err and "unchanged" in err
    assert snapshot(tmp_path) == before


def test_an_untranslated_os_error_is_still_one_line(monkeypatch, capsys):
    """The command line's safety net: a raw ENOSPC / EROFS OSError from anywhere is one line."""
    import pedestrian.commands.params as params

    for code in (errno.ENOSPC, errno.EROFS):
        monkeypatch.setattr(params, "run", lambda args: (_ for _ in ()).throw(os_error(code)))
        assert main(["params", "--preset", "gpt2"]) == 2
        assert os.strerror(code) in one_error_line(capsys)


def test_token_cache_failure_names_the_variable_that_moves_it(tmp_path, monkeypatch):
    # a read-only install and home (docs/guide.md, Deployment): the default folder cannot be
    # written, and the one line says which variable chooses another
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 50, encoding="utf-8")
    monkeypatch.setenv("PEDESTRIAN_CACHE", str(tmp_path / "cache"))
    fail_at(monkeypatch, "write", errno.EROFS)
    with pytest.raises(WriteError) as info:
        encode_to_token_file(str(corpus.read_text()), CharTokenizer(sorted(set("hello world\n"))))
    monkeypatch.undo()
    assert "PEDESTRIAN_CACHE=FOLDER" in str(info.value) and "\n" not in str(info.value)

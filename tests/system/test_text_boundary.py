"""The corpus / tokenizer boundary: byte-order marks, lone surrogates, the content-keyed token
cache, BPE trained on a stream of the training split, and no import cycle between data.py and
tokenizer.py."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import numpy as np
import pytest

import pedestrian
from pedestrian.checkpoint import save_checkpoint
from pedestrian.cli import main
from pedestrian.config import GPTConfig
from pedestrian.text.data import (CorpusError, corpus_digest, iter_corpus_pieces, iter_train_pieces, load_corpus,
                             split_train_val)
from pedestrian.text.tokens import encode_to_token_file
from pedestrian.model import GPT
from pedestrian.text.tokenizer import BPETokenizer, CharTokenizer, LoneSurrogateError, find_lone_surrogate

BOM = b"\xef\xbb\xbf"
SRC = Path(pedestrian.__file__).parent


# ------------------------------------------------------------------------------------ byte-order marks
def test_a_byte_order_mark_is_dropped_per_file(tmp_path):
    (tmp_path / "a.txt").write_bytes(BOM + "first file\n".encode())
    (tmp_path / "b.txt").write_bytes(BOM + "second \ufeff file\n".encode())   # a U+FEFF inside stays
    (tmp_path / "c.txt").write_bytes(b"no mark\n")
    assert load_corpus(tmp_path) == "first file\n\nsecond \ufeff file\n\nno mark\n"
    assert load_corpus(tmp_path / "a.txt") == "first file\n"
    # the same rule as Python's utf-8-sig codec, file by file
    for f in sorted(tmp_path.glob("*.txt")):
        assert load_corpus(f) == f.read_bytes().decode("utf-8-sig")
    # so a character vocabulary built from the corpus has no U+FEFF from the marks
    chars = set()
    for piece in iter_corpus_pieces(tmp_path / "a.txt"):
        chars.update(piece)
    assert "\ufeff" not in chars
    # and the token cache holds the text without them
    tok = CharTokenizer.from_text(load_corpus(tmp_path))
    np.testing.assert_array_equal(encode_to_token_file(tmp_path, tok), tok.encode(load_corpus(tmp_path)))


def test_a_file_that_is_only_a_byte_order_mark_is_empty(tmp_path):
    (tmp_path / "a.txt").write_bytes(BOM)
    with pytest.raises(CorpusError, match="contains no text"):
        load_corpus(tmp_path / "a.txt")


def test_utf8_errors_after_a_byte_order_mark_give_the_file_offset(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(BOM + b"ok\xffbad\n")
    with pytest.raises(CorpusError, match="byte offset 5"):            # counted from the file start
        load_corpus(f)


# ------------------------------------------------------------------------------------ lone surrogates
def test_encoded_surrogates_in_a_file_are_a_utf8_error_naming_file_and_offset(tmp_path):
    f = tmp_path / "c.txt"
    f.write_bytes(b"ok\xed\xa0\x80bad\n")                 # "\ud800" as CESU-8: not UTF-8
    with pytest.raises(CorpusError) as info:
        load_corpus(f)
    assert str(f) in str(info.value) and "byte offset 2" in str(info.value)


@pytest.mark.parametrize("text, index", [("ok\ud800bad", 2), ("\udcff", 0), ("aé\U0001F642\udfff", 3)])
def test_find_lone_surrogate(text, index):
    assert find_lone_surrogate(text) == index
    assert find_lone_surrogate("valid \U0001F642 text") is None


def _surrogate_message(info, index: int, code: str = "U+D800") -> str:
    msg = str(info.value)
    assert f"{code} at character {index}" in msg and "UTF-8" in msg and "\n" not in msg
    assert info.value.position == index
    return msg


def test_char_tokenizer_names_the_surrogate():
    tok = CharTokenizer.from_text("okbad")
    for unknown in ("error", "skip"):
        with pytest.raises(LoneSurrogateError) as info:
            tok.encode("ok\ud800bad", unknown=unknown)
        _surrogate_message(info, 2)
    with pytest.raises(LoneSurrogateError) as info:
        CharTokenizer.from_text("ok\ud800bad")
    _surrogate_message(info, 2)
    with pytest.raises(LoneSurrogateError):
        CharTokenizer(["a", "\ud800"])


def test_bpe_tokenizer_names_the_surrogate():
    tok = BPETokenizer.train("ok bad ok bad " * 20, vocab_size=270)
    with pytest.raises(LoneSurrogateError) as info:
        tok.encode("ok\ud800bad")
    _surrogate_message(info, 2)
    with pytest.raises(LoneSurrogateError) as info:
        tok.encode_batch(["fine", "ok\ud800bad"])
    assert "text 1 of the batch" in _surrogate_message(info, 2)
    # in training, the index counts through all the texts given
    with pytest.raises(LoneSurrogateError) as info:
        BPETokenizer.train(iter(["abcd", "ok\ud800bad"]), vocab_size=270)
    _surrogate_message(info, 6)


def test_token_cache_of_a_text_with_a_surrogate(tmp_path):
    tok = CharTokenizer.from_text("okbad")
    with pytest.raises(LoneSurrogateError) as info:
        encode_to_token_file("ok\ud800bad", tok, cache_dir=tmp_path)
    assert "the corpus text" in _surrogate_message(info, 2)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_sample_prompt_with_a_surrogate_is_one_error_line(tmp_path, capsys, kind):
    """A prompt of bytes that are not UTF-8 reaches Python as surrogate escapes (e.g. \\xff ->
    U+DCFF): one line that names --prompt and the position, nothing printed."""
    text = "hello world, okay then.\n" * 10
    tok = CharTokenizer.from_text(text) if kind == "char" else BPETokenizer.train(text, vocab_size=270)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=16, d_model=8, n_heads=2, n_blocks=1))
    save_checkpoint(tmp_path / "ckpt", model, tokenizer=tok)
    prompt = b"ok\xffbad".decode("utf-8", "surrogateescape")
    assert main(["sample", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", prompt]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    err = err.strip()
    assert err.startswith("error: the --prompt has a lone surrogate U+DCFF at character 2") and "\n" not in err


def test_sample_stop_text_with_a_surrogate_is_one_error_line(tmp_path, capsys):
    """A --stop of bytes that are not UTF-8 could never match decoded text (a lone surrogate is
    no character): refused like a prompt, naming --stop and the position, before any output."""
    text = "hello world, okay then.\n" * 10
    tok = CharTokenizer.from_text(text)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=16, d_model=8, n_heads=2, n_blocks=1))
    save_checkpoint(tmp_path / "ckpt", model, tokenizer=tok)
    stop = b"lo\xff".decode("utf-8", "surrogateescape")
    assert main(["sample", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "hel", "--stop", "\n",
                 "--stop", stop]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    err = err.strip()
    assert err.startswith("error: --stop 2 has a lone surrogate U+DCFF at character 2") and "\n" not in err


# ------------------------------------------------------------------------------------ token cache key
def test_token_cache_is_keyed_by_content_not_size_and_time(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("abcabc\n" * 100, encoding="utf-8")
    tok = CharTokenizer(list("abc\n"))
    first = encode_to_token_file(f, tok)
    np.testing.assert_array_equal(first, tok.encode("abcabc\n" * 100))
    st = f.stat()
    f.write_text("cbacba\n" * 100, encoding="utf-8")         # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))          # same modification time
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    second = encode_to_token_file(f, tok)
    assert second.filename != first.filename
    np.testing.assert_array_equal(second, tok.encode("cbacba\n" * 100))


def test_token_cache_survives_a_move_and_digest_follows_content(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "x.txt").write_text("one\n", encoding="utf-8")
    (a / "y.txt").write_text("two\n", encoding="utf-8")
    b.mkdir()
    (b / "p.txt").write_text("one\n", encoding="utf-8")
    (b / "q.txt").write_text("two\n", encoding="utf-8")
    assert corpus_digest(a) == corpus_digest(b)               # names play no part
    (b / "q.txt").write_text("one\n", encoding="utf-8")
    assert corpus_digest(a) != corpus_digest(b)
    (b / "q.txt").write_text("two\n", encoding="utf-8")
    (b / "p.txt").write_bytes(b"one\ntwo\n")                  # the same text, other file boundaries
    (b / "q.txt").unlink()
    assert corpus_digest(a) != corpus_digest(b)
    tok = CharTokenizer(list("eonwt\n"))
    cache = tmp_path / "cache"
    first = encode_to_token_file(a, tok)                      # cached beside it, in a/.pedestrian_cache
    (tmp_path / "elsewhere").mkdir()
    a.rename(tmp_path / "elsewhere" / "a")                     # moved, cache and all: still valid
    again = encode_to_token_file(tmp_path / "elsewhere" / "a", tok)
    assert Path(again.filename).name == Path(first.filename).name
    assert os.path.dirname(again.filename) == str(tmp_path / "elsewhere" / "a" / ".pedestrian_cache")
    assert len(list((tmp_path / "elsewhere" / "a" / ".pedestrian_cache").iterdir())) == 1


# ------------------------------------------------------------------------------------ streaming BPE
@pytest.mark.parametrize("val_fraction", [0.1, 0.37])
def test_iter_train_pieces_is_the_training_split(tmp_path, val_fraction):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text("".join(f"line {j} of file {i} 🙂\n" for j in range(300)),
                                           encoding="utf-8")
    pieces = list(iter_train_pieces(tmp_path, val_fraction, piece_chars=500))
    assert len(pieces) > 10
    assert "".join(pieces) == split_train_val(load_corpus(tmp_path), val_fraction)[0]
    with pytest.raises(ValueError, match="val_fraction"):
        list(iter_train_pieces(tmp_path, 1.5))


def test_build_tokenizer_streams_the_training_split(tmp_path, monkeypatch):
    from pedestrian.training import TrainSettings, build_tokenizer

    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"the line number {j} says hello\n" for j in range(2000)), encoding="utf-8")
    settings = TrainSettings(data=str(corpus), tokenizer="bpe", bpe_vocab_size=300)
    given = []
    real = BPETokenizer.train.__func__

    def spy(cls, texts, *a, **k):
        given.append(type(texts))
        return real(cls, texts, *a, **k)

    monkeypatch.setattr(BPETokenizer, "train", classmethod(spy))
    tok = build_tokenizer(settings, corpus)
    assert given and given[0] is not str                     # an iterator, not the whole text
    monkeypatch.undo()
    whole = BPETokenizer.train(split_train_val(load_corpus(corpus), 0.1)[0], vocab_size=300)
    assert tok == whole


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth of its code (``.data`` -> ``pedestrian.text.data``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            out.add(f"pedestrian.{base}" if node.level == 1 else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_tokenizer_does_not_import_data_and_atomic_imports_nothing_of_ours():
    assert "pedestrian.text.data" not in _imports(SRC / "text" / "tokenizer.py")
    assert not {m for m in _imports(SRC / "atomic.py") if m.startswith("pedestrian")}

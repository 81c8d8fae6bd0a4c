"""Tests for pedestrian.text.data: corpus loading, split, token files, batches."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pedestrian.text.data as data
from pedestrian.text.data import (
    BUNDLED_CORPUS,
    CorpusError,
    bundled_corpus,
    iter_corpus_pieces,
    load_corpus,
    split_train_val,
)
from pedestrian.text.tokens import TokenDataset, encode_to_token_file
from pedestrian.text.tokenizer import BPETokenizer, CharTokenizer

# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


def test_load_corpus_file_is_exact_bytes(tmp_path):
    text = "line one\r\nligne deux — é\n日本語 🙂\n"
    f = tmp_path / "c.txt"
    f.write_bytes(text.encode("utf-8"))
    assert load_corpus(f) == text  # no newline translation
    assert load_corpus(str(f)) == text


def test_load_corpus_folder_sorted_joined_txt_only(tmp_path):
    (tmp_path / "b.txt").write_text("BBB", encoding="utf-8")
    (tmp_path / "a.txt").write_text("AAA\n", encoding="utf-8")
    (tmp_path / "c.md").write_text("not me", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.txt").write_text("nor me", encoding="utf-8")
    assert load_corpus(tmp_path) == "AAA\n\nBBB"


def test_load_corpus_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nope.txt"))):
        load_corpus(tmp_path / "nope.txt")


@pytest.mark.parametrize("content", [b"", b"  \n\t\n"])
def test_load_corpus_empty_file(tmp_path, content):
    f = tmp_path / "empty.txt"
    f.write_bytes(content)
    with pytest.raises(CorpusError, match="contains no text"):
        load_corpus(f)


def test_load_corpus_folder_of_empty_files(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"")
    (tmp_path / "b.txt").write_bytes(b"\n")
    with pytest.raises(CorpusError, match=r"contains no text.*"):
        load_corpus(tmp_path)


def test_load_corpus_folder_without_txt(tmp_path):
    (tmp_path / "notes.md").write_text("hi", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"no \*\.txt files"):
        load_corpus(tmp_path)
    assert issubclass(CorpusError, ValueError)


def test_load_corpus_not_utf8_names_file_and_offset(tmp_path):
    f = tmp_path / "latin1.txt"
    good = "Sant\u00e9 ok\ncaf".encode("utf-8")
    f.write_bytes(good + b"\xe9\n")  # a Latin-1 "é" right after the valid part
    with pytest.raises(CorpusError) as ei:
        load_corpus(f)
    msg = str(ei.value)
    assert str(f) in msg and f"byte offset {len(good)} " in msg and "UTF-8" in msg


def test_load_corpus_small_read_blocks(tmp_path, monkeypatch):
    """Block-wise reading never splits a character and reports absolute offsets."""
    monkeypatch.setattr(data, "_READ_BLOCK", 5)
    text = "ab\ncé日本語🙂🙂 long line without newline\nx\n\ny"
    f = tmp_path / "t.txt"
    f.write_bytes(text.encode("utf-8"))
    assert load_corpus(f) == text
    bad = text.encode("utf-8") + b"\nzz\xff"
    f.write_bytes(bad)
    with pytest.raises(CorpusError, match=f"byte offset {len(bad) - 1}"):
        load_corpus(f)


def test_bundled_corpus_facts():
    """The numbers stated in src/pedestrian/text/corpus/shakespeare/PROVENANCE.md."""
    assert bundled_corpus() == BUNDLED_CORPUS
    files = sorted(BUNDLED_CORPUS.glob("*.txt"))
    assert len(files) == 42
    assert sum(f.stat().st_size for f in files) == 5_057_198
    text = load_corpus()  # None = bundled
    assert len(text) == 5_057_239
    assert text.isascii() and "\r" not in text
    assert len(set(text)) == 84
    train, val = split_train_val(text)
    assert (len(train), len(val)) == (4_551_515, 505_724)
    assert "PROVENANCE" not in text


def test_bundled_corpus_missing_message(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "BUNDLED_CORPUS", tmp_path / "gone")
    for call in (bundled_corpus, load_corpus):
        with pytest.raises(FileNotFoundError) as ei:
            call()
        assert "pip install -e ." in str(ei.value) and "--data" in str(ei.value)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab \n\t🙂", max_size=200),
    cuts=st.lists(st.integers(0, 200), max_size=6),
    piece_chars=st.integers(1, 30),
)
def test_pieces_cut_only_at_single_newlines(text, cuts, piece_chars):
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    blocks = iter([text[a:b] for a, b in zip(bounds, bounds[1:])])
    pieces = list(data._cut_pieces(blocks, piece_chars))
    assert "".join(pieces) == text
    for p, nxt in zip(pieces, pieces[1:]):
        assert len(p) >= piece_chars
        assert p.endswith("\n") and not p[-2].isspace() and not nxt[0].isspace()
    assert all(pieces)


def test_iter_corpus_pieces_join_equals_load(tmp_path):
    for name, body in (("a.txt", "x\n y\nz\n" * 50), ("b.txt", "\n\nw🙂\n" * 50)):
        (tmp_path / name).write_text(body, encoding="utf-8")
    pieces = list(iter_corpus_pieces(tmp_path, piece_chars=40))
    assert len(pieces) > 5
    assert "".join(pieces) == load_corpus(tmp_path)


# --------------------------------------------------------------------------------------------
# Split
# --------------------------------------------------------------------------------------------


def test_split_is_deterministic_tail():
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    train, val = split_train_val(text, 0.1)
    assert train + val == text
    assert len(val) == 100 and val == text[-100:]
    assert split_train_val(text, 0.1) == (train, val)
    train2, val2 = split_train_val(text, 0.25)
    assert len(val2) == 250 and len(train2) == 750
    assert split_train_val(text, 0.0) == (text, "")
    assert len(split_train_val("x" * 7, 0.5)[1]) == round(3.5)


@pytest.mark.parametrize("frac", [-0.1, 1.0, 1.5])
def test_split_rejects_bad_fraction(frac):
    with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\)"):
        split_train_val("abcdef", frac)


def test_split_rejects_too_short_text():
    with pytest.raises(ValueError, match="too short"):
        split_train_val("abc", 0.1)


# --------------------------------------------------------------------------------------------
# Token files
# --------------------------------------------------------------------------------------------


@pytest.fixture
def corpus_dir(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("To be, or not to be: that is the question.\n" * 40, encoding="utf-8")
    (d / "b.txt").write_text("Whether 'tis nobler in the mind to suffer 🙂\n" * 40, encoding="utf-8")
    return d


class CountingChar(CharTokenizer):
    calls = 0

    def encode(self, text, unknown="error"):
        type(self).calls += 1
        return super().encode(text, unknown)


def test_token_file_contents_dtype_and_memmap(corpus_dir):
    text = load_corpus(corpus_dir)
    tok = CharTokenizer.from_text(text)
    arr = encode_to_token_file(corpus_dir, tok)
    assert isinstance(arr, np.memmap)
    assert arr.dtype == np.uint16 and arr.ndim == 1
    np.testing.assert_array_equal(arr, tok.encode(text))
    assert os.path.dirname(arr.filename) == str(corpus_dir / ".pedestrian_cache")
    assert str(arr.filename).endswith(".tokens.npy")
    with pytest.raises(ValueError):  # read-only map
        arr[0] = 1
    leftovers = [p.name for p in (corpus_dir / ".pedestrian_cache").iterdir()]
    assert leftovers == [os.path.basename(arr.filename)]  # no temporary files left


def test_token_file_uint32_for_large_vocab(tmp_path):
    text = "".join(chr(0x20000 + i) for i in range(70_000))  # 70 000 distinct characters
    tok = CharTokenizer.from_text(text)
    assert tok.vocab_size > 65536
    arr = encode_to_token_file(text, tok, cache_dir=tmp_path)
    assert arr.dtype == np.uint32
    np.testing.assert_array_equal(arr, np.arange(70_000))


def test_token_cache_hit_does_not_reencode(corpus_dir):
    tok = CountingChar.from_text(load_corpus(corpus_dir))
    CountingChar.calls = 0
    first = encode_to_token_file(corpus_dir, tok)
    assert CountingChar.calls > 0
    calls, mtime = CountingChar.calls, os.stat(first.filename).st_mtime_ns
    second = encode_to_token_file(corpus_dir, tok)
    assert CountingChar.calls == calls  # not encoded again
    assert second.filename == first.filename
    assert os.stat(second.filename).st_mtime_ns == mtime
    np.testing.assert_array_equal(first, second)


def test_token_cache_invalidated_by_tokenizer_change(corpus_dir):
    text = load_corpus(corpus_dir)
    tok_a = CountingChar.from_text(text)
    tok_b = CountingChar(list(reversed(tok_a.chars)))  # same size, different ids
    CountingChar.calls = 0
    a = encode_to_token_file(corpus_dir, tok_a)
    calls = CountingChar.calls
    b = encode_to_token_file(corpus_dir, tok_b)
    assert CountingChar.calls > calls
    assert a.filename != b.filename
    np.testing.assert_array_equal(b, tok_b.encode(text))
    np.testing.assert_array_equal(a, tok_a.encode(text))


def test_token_cache_invalidated_by_corpus_change(corpus_dir):
    tok = CharTokenizer.from_text(load_corpus(corpus_dir) + "!")
    a = encode_to_token_file(corpus_dir, tok)
    f = corpus_dir / "b.txt"
    f.write_text(f.read_text(encoding="utf-8") + "!", encoding="utf-8")
    b = encode_to_token_file(corpus_dir, tok)
    assert a.filename != b.filename
    assert len(b) == len(a) + 1 and b[-1] == tok.encode("!")[0]


def test_token_cache_explicit_dir_and_fallback(corpus_dir, tmp_path, monkeypatch):
    tok = CharTokenizer.from_text(load_corpus(corpus_dir))
    explicit = tmp_path / "explicit" / "deep"
    arr = encode_to_token_file(corpus_dir, tok, cache_dir=explicit)
    assert os.path.dirname(arr.filename) == str(explicit)
    # beside-the-corpus location unusable (a file is in the way) -> user cache dir
    (corpus_dir / ".pedestrian_cache").write_text("in the way", encoding="utf-8")
    user = tmp_path / "usercache"
    monkeypatch.setenv("PEDESTRIAN_CACHE", str(user))
    arr = encode_to_token_file(corpus_dir, tok)
    assert os.path.dirname(arr.filename) == str(user)
    # a str is text, cached in the user cache dir too
    arr = encode_to_token_file("To be", tok)
    assert os.path.dirname(arr.filename) == str(user)
    np.testing.assert_array_equal(arr, tok.encode("To be"))


def test_token_file_bpe_piecewise_equals_whole(tmp_path, monkeypatch):
    """Encoding in pieces (cut before line starts) gives exactly the ids of one encode()."""
    text = load_corpus(BUNDLED_CORPUS)[:60_000] + "\n  indented\n\n\nWith 🙂 and 日本語\n"
    bpe = BPETokenizer.train(text, vocab_size=1000)
    assert {"ĊĊ", "ĊĠĠ"} <= set(bpe.hf.get_vocab())  # merges a bad cut would break
    monkeypatch.setattr(data, "_PIECE_CHARS", 500)  # force many pieces
    arr = encode_to_token_file(text, bpe, cache_dir=tmp_path)
    assert arr.dtype == np.uint16
    np.testing.assert_array_equal(arr, bpe.encode(text))


def test_token_file_errors(tmp_path):
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(CorpusError, match="empty"):
        encode_to_token_file("   ", tok, cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError):
        encode_to_token_file(tmp_path / "missing", tok)
    with pytest.raises(ValueError, match="not in the CharTokenizer vocabulary"):
        encode_to_token_file("abcd", tok, cache_dir=tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    with pytest.raises(TypeError, match="os.PathLike"):
        encode_to_token_file(b"abc", tok, cache_dir=tmp_path)


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


@pytest.fixture
def stream():
    # unique values, so each window's start can be recovered from its first token
    return np.random.default_rng(0).permutation(5000).astype(np.uint16)


def test_get_batch_shapes_and_shift(stream):
    ds = TokenDataset(stream)
    assert len(ds) == 5000
    where = np.argsort(stream)
    x, y = ds.get_batch(np.random.default_rng(1), batch_size=16, context_length=32)
    assert x.shape == y.shape == (16, 32)
    assert x.dtype == y.dtype == np.int64
    assert x.flags.c_contiguous and y.flags.c_contiguous
    for b in range(16):
        s = where[x[b, 0]]
        np.testing.assert_array_equal(x[b], stream[s : s + 32])
        np.testing.assert_array_equal(y[b], stream[s + 1 : s + 33])
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])


def test_get_batch_from_token_file_memmap(tmp_path):
    text = "abcdefghij" * 30
    tok = CharTokenizer.from_text(text)
    ds = TokenDataset(encode_to_token_file(text, tok, cache_dir=tmp_path))
    x, y = ds.get_batch(np.random.default_rng(0), 4, 8)
    assert x.dtype == np.int64
    np.testing.assert_array_equal((x + 1) % 10, y)  # next letter


def test_get_batch_reaches_every_start_and_end():
    ds = TokenDataset(np.arange(7))
    x, y = ds.get_batch(np.random.default_rng(0), 400, 4)
    assert set(x[:, 0].tolist()) == {0, 1, 2}  # starts 0 .. n - T - 1
    assert y.max() == 6  # last token is a target


def test_get_batch_exactly_one_window():
    ds = TokenDataset(np.arange(9))
    x, y = ds.get_batch(np.random.default_rng(0), 3, 8)
    np.testing.assert_array_equal(x, np.tile(np.arange(8), (3, 1)))
    np.testing.assert_array_equal(y, np.tile(np.arange(1, 9), (3, 1)))


def test_get_batch_seeded_reproducibility(stream):
    ds = TokenDataset(stream)
    a = ds.get_batch(np.random.default_rng(42), 8, 16)
    b = ds.get_batch(np.random.default_rng(42), 8, 16)
    c = ds.get_batch(np.random.default_rng(43), 8, 16)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])


def test_fixed_batches_deterministic(stream):
    ds = TokenDataset(stream)
    one = ds.fixed_batches(seed=7, n_batches=3, batch_size=4, context_length=8)
    two = ds.fixed_batches(seed=7, n_batches=3, batch_size=4, context_length=8)
    assert len(one) == 3
    for (x1, y1), (x2, y2) in zip(one, two):
        assert x1.shape == (4, 8)
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
    assert not np.array_equal(one[0][0], one[1][0])  # the batches differ from each other
    with pytest.raises(ValueError, match="n_batches"):
        ds.fixed_batches(seed=7, n_batches=0, batch_size=4, context_length=8)


def test_too_short_stream_error():
    ds = TokenDataset(np.arange(10))
    with pytest.raises(ValueError, match=r"has 10 tokens .* needs context_length \+ 1 = 11"):
        ds.get_batch(np.random.default_rng(0), 2, 10)
    with pytest.raises(ValueError, match="has 10 tokens"):
        ds.fixed_batches(0, 2, 2, 10)


def test_dataset_input_validation():
    with pytest.raises(ValueError, match="1-D"):
        TokenDataset(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="integer"):
        TokenDataset(np.zeros(5, dtype=np.float32))
    ds = TokenDataset(np.arange(50))
    with pytest.raises(TypeError, match="Generator"):
        ds.get_batch(np.random.RandomState(0), 2, 4)
    with pytest.raises(ValueError, match="batch_size"):
        ds.get_batch(np.random.default_rng(0), 0, 4)
    with pytest.raises(ValueError, match="context_length"):
        ds.get_batch(np.random.default_rng(0), 2, 0)

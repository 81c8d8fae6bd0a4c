"""Tests for pedestrian.text.tokenizer: CharTokenizer, BPETokenizer, StreamDecoder, load_tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from pedestrian.text.data import BUNDLED_CORPUS, iter_corpus_pieces, load_corpus
from pedestrian.text.tokenizer import (
    BPETokenizer,
    CharTokenizer,
    StreamDecoder,
    UnknownCharacterError,
    bytes_to_unicode,
    load_tokenizer,
)

MIXED = "héllo wörld — 日本語 🙂"
# multi-byte characters that a small byte-level vocabulary must split over several tokens
HARD = "🙂🎉 日本語のテキスト 👩‍👩‍👧 Ünïcødé ∮ E⋅da = Q 𝔘𝔫𝔦"
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def corpus_head() -> str:
    return load_corpus(BUNDLED_CORPUS)[:200_000]


@pytest.fixture(scope="module")
def bpe(corpus_head: str) -> BPETokenizer:
    return BPETokenizer.train(corpus_head, vocab_size=400)


# --------------------------------------------------------------------------------------------
# CharTokenizer
# --------------------------------------------------------------------------------------------


def test_char_vocab_is_sorted_set_of_training_text():
    tok = CharTokenizer.from_text("banana!")
    assert tok.chars == ["!", "a", "b", "n"]
    assert tok.vocab_size == 4
    assert tok.encode("banana") == [2, 1, 3, 1, 3, 1]


def test_char_round_trip_non_ascii():
    tok = CharTokenizer.from_text(MIXED)
    ids = tok.encode(MIXED)
    assert len(ids) == len(MIXED)  # one id per code point
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == MIXED
    assert tok.decode(np.asarray(ids, dtype=np.int64)) == MIXED


@SETTINGS
@given(st.text(min_size=1))
def test_char_round_trip_property(text):
    tok = CharTokenizer.from_text(text)
    assert tok.decode(tok.encode(text)) == text


def test_char_unknown_character_error_names_char_position_and_origin():
    tok = CharTokenizer.from_text("abc ")
    with pytest.raises(UnknownCharacterError) as ei:
        tok.encode("ab cé a🙂")
    msg = str(ei.value)
    assert "'é' (U+00E9) at position 4" in msg
    assert "'🙂' (U+1F642) at position 7" in msg
    assert "training text" in msg
    assert 'unknown="skip"' in msg
    assert ei.value.unknown == {"é": 4, "🙂": 7}
    assert isinstance(ei.value, ValueError)


def test_char_unknown_skip_drops_them():
    tok = CharTokenizer.from_text("abc ")
    assert tok.decode(tok.encode("ab cé a🙂", unknown="skip")) == "ab c a"
    with pytest.raises(ValueError, match="unknown must be"):
        tok.encode("a", unknown="ignore")


def test_char_decode_rejects_bad_ids():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"token id 3 at position 1 is outside the vocabulary \[0, 3\)"):
        tok.decode([0, 3])
    with pytest.raises(ValueError, match="outside"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="integers"):
        tok.decode([0.5])
    with pytest.raises(ValueError, match="1-D"):
        tok.decode([[0, 1]])
    assert tok.decode([]) == ""


def test_char_constructor_validation():
    with pytest.raises(ValueError, match="empty"):
        CharTokenizer.from_text("")
    with pytest.raises(ValueError, match="single character"):
        CharTokenizer(["a", "bc"])
    with pytest.raises(ValueError, match="duplicate"):
        CharTokenizer(["a", "b", "a"])


def test_char_dict_and_file_round_trip(tmp_path):
    tok = CharTokenizer.from_text(MIXED)
    d = tok.to_dict()
    assert d["kind"] == "char"
    assert CharTokenizer.from_dict(json.loads(json.dumps(d))) == tok  # JSON-serialisable
    path = tmp_path / "sub" / "tok.json"
    tok.save(path)
    assert CharTokenizer.load(path) == tok
    assert load_tokenizer(path) == tok
    assert load_tokenizer(d) == tok
    assert load_tokenizer(tok) is tok
    assert CharTokenizer.load(path).encode(MIXED) == tok.encode(MIXED)


def test_char_from_dict_rejects_other_kinds():
    with pytest.raises(ValueError, match='"kind": "char"'):
        CharTokenizer.from_dict({"kind": "bpe", "chars": ["a"]})
    with pytest.raises(ValueError, match="version"):
        CharTokenizer.from_dict({"kind": "char", "version": 99, "chars": ["a"]})


# --------------------------------------------------------------------------------------------
# BPETokenizer
# --------------------------------------------------------------------------------------------


def test_bpe_train_vocab(bpe):
    assert bpe.vocab_size == 400
    assert bpe.special_tokens == {"<|endoftext|>": 0}
    assert bpe.is_special(0) and not bpe.is_special(1)


def test_bpe_round_trip_non_ascii_and_emoji(bpe, corpus_head):
    for text in (MIXED, HARD, corpus_head[:5000], "", "\n\n  \t x"):
        ids = bpe.encode(text)
        assert all(0 <= i < bpe.vocab_size for i in ids)
        assert bpe.decode(ids) == text
    # the learned merges compress English: fewer tokens than bytes
    assert len(bpe.encode(corpus_head[:5000])) < 0.7 * 5000


@SETTINGS
@given(st.text())
def test_bpe_round_trip_property(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


@SETTINGS
@given(st.text())
def test_bpe_token_bytes_spell_the_utf8(bpe, text):
    ids = bpe.encode(text)
    assert b"".join(bpe.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_bpe_special_token_is_one_id(bpe):
    ids = bpe.encode("a<|endoftext|>b")
    assert 0 in ids
    assert bpe.decode(ids) == "a<|endoftext|>b"
    assert bpe.decode(ids, skip_special_tokens=True) == "ab"


def test_bpe_encode_batch_matches_encode(bpe):
    texts = [MIXED, HARD, "", "to be or not"]
    assert bpe.encode_batch(texts) == [bpe.encode(t) for t in texts]


def test_bpe_decode_rejects_out_of_range(bpe):
    with pytest.raises(ValueError, match=r"token id 400 at position 0 is outside the vocabulary \[0, 400\)"):
        bpe.decode([400])


def test_bpe_train_rejects_tiny_vocab():
    with pytest.raises(ValueError, match="256 byte tokens"):
        BPETokenizer.train("hello", vocab_size=200)


def test_bpe_train_streamed_pieces_equals_whole_text(tmp_path, corpus_head):
    f = tmp_path / "c.txt"
    f.write_text(corpus_head[:50_000], encoding="utf-8")
    pieces = list(iter_corpus_pieces(f, piece_chars=2_000))
    assert len(pieces) > 20                               # really streamed in many pieces
    streamed = BPETokenizer.train(iter(pieces), vocab_size=300)
    from_text = BPETokenizer.train(corpus_head[:50_000], vocab_size=300)
    assert streamed == from_text


def test_bpe_train_takes_texts_not_paths(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("hello world\n" * 50, encoding="utf-8")
    for wrong in (f, [f]):
        with pytest.raises(TypeError, match="iter_corpus_pieces"):
            BPETokenizer.train(wrong, vocab_size=300)
    with pytest.raises(ValueError, match="no training text"):
        BPETokenizer.train(iter([]), vocab_size=300)


def test_bpe_save_load_equality(tmp_path, bpe):
    path = tmp_path / "tok.json"
    bpe.save(path)
    loaded = BPETokenizer.load(path)
    assert loaded == bpe
    assert loaded.to_dict() == bpe.to_dict()
    assert load_tokenizer(path) == bpe
    assert load_tokenizer(json.loads(path.read_text(encoding="utf-8"))) == bpe
    assert loaded.encode(HARD) == bpe.encode(HARD)


def test_bpe_inequality(bpe, corpus_head):
    other = BPETokenizer.train(corpus_head, vocab_size=300)
    assert other != bpe
    assert other.encode(corpus_head[:2000]) != bpe.encode(corpus_head[:2000])


def test_load_plain_hf_tokenizer_json(tmp_path, bpe):
    path = tmp_path / "tokenizer.json"
    bpe.hf.save(str(path))
    assert "kind" not in json.loads(path.read_text(encoding="utf-8"))
    for tok in (load_tokenizer(path), BPETokenizer.from_file(path), load_tokenizer(tmp_path)):
        assert isinstance(tok, BPETokenizer)
        assert tok.encode(HARD) == bpe.encode(HARD)
        assert tok.decode(tok.encode(HARD)) == HARD


def test_from_vocab_merges_matches_trained(tmp_path, bpe, corpus_head):
    vocab, merges = bpe.hf.model.save(str(tmp_path))
    tok = BPETokenizer.from_vocab_merges(vocab, merges)
    assert tok.vocab_size == bpe.vocab_size
    text = corpus_head[:3000] + HARD + "x<|endoftext|>y"
    assert tok.encode(text) == bpe.encode(text)
    assert tok.special_tokens == {"<|endoftext|>": 0}
    with pytest.raises(ValueError, match="not in"):
        BPETokenizer.from_vocab_merges(vocab, merges, special_tokens=["<|nope|>"])
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        BPETokenizer.from_vocab_merges(vocab, tmp_path / "missing.txt")


def test_non_byte_level_tokenizer_rejected(tmp_path):
    hf = HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    with pytest.raises(ValueError, match="byte-level"):
        load_tokenizer(path)
    with pytest.raises(ValueError, match="byte-level"):
        BPETokenizer.from_file(path)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.json"):
        load_tokenizer(tmp_path / "nothere.json")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match='"kind"'):
        load_tokenizer({"kind": "wordpiece"})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="not a valid UTF-8 JSON"):
        load_tokenizer(bad)
    with pytest.raises(TypeError):
        load_tokenizer(42)


def test_bytes_to_unicode_is_the_byte_level_alphabet():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("A")] == "A"


# --------------------------------------------------------------------------------------------
# StreamDecoder
# --------------------------------------------------------------------------------------------


def _stream(tok, ids, **kw):
    dec = StreamDecoder(tok, **kw)
    pieces = [dec.push(i) for i in ids]
    return pieces, dec.flush()


def test_stream_decoder_holds_back_split_characters(bpe):
    ids = bpe.encode(HARD)
    pieces, tail = _stream(bpe, ids)
    # the test is only meaningful if some character really is split across tokens
    assert any(p == "" for p in pieces)
    assert len(ids) > len(HARD)
    assert all("\ufffd" not in p for p in pieces)
    assert tail == ""
    assert "".join(pieces) == HARD == bpe.decode(ids)
    # every emitted piece is whole characters of the text, in order
    pos = 0
    for p in pieces:
        assert HARD.startswith(p, pos)
        pos += len(p)


@SETTINGS
@given(st.text())
def test_stream_decoder_equals_full_decode(bpe, text):
    ids = bpe.encode(text)
    pieces, tail = _stream(bpe, ids)
    assert "".join(pieces) + tail == bpe.decode(ids) == text
    assert tail == ""
    if "\ufffd" not in text:
        assert all("\ufffd" not in p for p in pieces)


def test_stream_decoder_truncated_character_matches_decode(bpe):
    ids = bpe.encode("ok🙂")
    cut = ids[:-1]  # last byte(s) of the emoji missing
    pieces, tail = _stream(bpe, cut)
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + tail == bpe.decode(cut)
    assert tail.endswith("\ufffd")


def test_stream_decoder_flush_resets(bpe):
    dec = StreamDecoder(bpe)
    first = bpe.encode("🙂")
    for i in first[:-1]:
        assert dec.push(i) == ""
    assert dec.flush() == "\ufffd"
    out = "".join(dec.push(i) for i in bpe.encode("日本")) + dec.flush()
    assert out == "日本"


def test_stream_decoder_skip_special(bpe):
    ids = bpe.encode("a<|endoftext|>b")
    pieces, tail = _stream(bpe, ids, skip_special_tokens=True)
    assert "".join(pieces) + tail == "ab"
    pieces, tail = _stream(bpe, ids)
    assert "".join(pieces) + tail == "a<|endoftext|>b"


def test_stream_decoder_char_tokenizer_returns_each_char():
    tok = CharTokenizer.from_text(MIXED)
    pieces, tail = _stream(tok, tok.encode(MIXED))
    assert pieces == list(MIXED)
    assert tail == ""


def test_stream_decoder_rejects_bad_id(bpe):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        StreamDecoder(bpe).push(10_000)


def test_bpe_vocabulary_with_a_gap_in_its_ids_is_refused(tmp_path):
    """A tokenizer.json whose ids skip a number: ``tokenizers`` counts 269 ids but the largest is
    269, so an id of the gap decodes to '' (silently) and the largest is 'outside the vocabulary'.
    Refused when loaded, naming the gap (issue 13, part 2: ids, tokens and text must agree)."""
    tok = BPETokenizer.train("hello world hello there " * 50, vocab_size=270)
    d = json.loads(tok.hf.to_str())
    vocab = d["model"]["vocab"]
    del vocab[next(t for t, i in vocab.items() if i == 100)]
    path = tmp_path / "gap.json"
    path.write_text(json.dumps(d), encoding="utf-8")
    with pytest.raises(ValueError, match=r"ids are not 0 \.\. 269 without gaps: missing \[100\]"):
        BPETokenizer.from_file(path)

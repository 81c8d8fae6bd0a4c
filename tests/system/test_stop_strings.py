"""Stop strings are text: `pedestrian sample --stop TEXT` matches the decoded output however it is
split into tokens, prints everything before the first match and not the match itself, and holds
back only the tail that could still begin a stop string.

The tokenizer is a byte-level BPE trained here in which "\\n" and "\\n\\n" are distinct tokens (as in
GPT-2); the model is forced to emit a chosen token chain (tests/sample_helpers.py).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pedestrian.commands import sample as sample_cmd
from pedestrian.text.tokenizer import BPETokenizer, StopText, bytes_to_unicode
from sample_helpers import Chunks, forced_model, parse

CORPUS = "one line\nanother line\n\n\npara two: the end\n\n\n" * 30
WORDS = ["one", " line", "\n", "para", " two", ":", " the", " end", "\n\n"]


@pytest.fixture(scope="module")
def bpe():
    tok = BPETokenizer.train(CORPUS, vocab_size=320)
    # the premise of the issue: "\n" and "\n\n" are different single tokens
    assert len(tok.encode("\n")) == 1 and len(tok.encode("\n\n")) == 1
    assert tok.encode("\n") != tok.encode("\n\n")
    for w in WORDS:
        assert len(tok.encode(w)) == 1, w
    return tok


def ids(tok, *words):
    return [tok.encode(w)[0] for w in words]


def run(tok, chain, *argv, prompt="one", out=None, err=None):
    out = Chunks() if out is None else out
    err = io.StringIO() if err is None else err
    code = sample_cmd.run_sample(forced_model(tok, chain), tok,
                                 parse("--prompt", prompt, "--temperature", "0", "--stats", *argv),
                                 out=out, err=err)
    assert code == 0
    n_new = int(err.getvalue().split("[")[1].split(" new tokens")[0])
    return out, n_new


CHAIN = ["one", " line", "\n", "para", " two", ":", " the", " end", "\n\n"]


def test_without_a_stop_the_whole_chain_is_printed(bpe):
    out, n_new = run(bpe, ids(bpe, *CHAIN), "--max-new-tokens", "8")
    assert out.getvalue() == "one line\npara two: the end\n\n" + "\n"
    assert n_new == 8


def test_newline_stop_ends_inside_a_double_newline_token(bpe):
    # issue 13: with --stop '\n' the model emits the "\n\n" token; the old id comparison never stopped
    chain = ids(bpe, "one", " line", "\n\n", "para", " two")
    out, n_new = run(bpe, chain, "--max-new-tokens", "4", "--stop", "\n")
    assert out.getvalue() == "one line" + "\n"                   # the final "\n" ends the sample
    assert n_new == 2                                            # generation stopped at once


def test_stop_string_spanning_two_tokens(bpe):
    out, n_new = run(bpe, ids(bpe, *CHAIN), "--max-new-tokens", "8", "--stop", "para two")
    assert out.getvalue() == "one line\n" + "\n"
    assert n_new == 4                                            # " line", "\n", "para", " two"
    assert not any("para" in chunk for chunk in out.chunks)      # held back, never printed


def test_stop_string_split_across_a_token_boundary(bpe):
    out, n_new = run(bpe, ids(bpe, *CHAIN), "--max-new-tokens", "8", "--stop", "ara tw")
    assert out.getvalue() == "one line\np" + "\n"
    assert n_new == 4


def test_text_that_could_begin_a_stop_is_held_back_then_printed(bpe):
    out, n_new = run(bpe, ids(bpe, *CHAIN), "--max-new-tokens", "8", "--stop", "para three")
    assert out.getvalue() == "one line\npara two: the end\n\n" + "\n"
    assert n_new == 8
    # "para" could begin "para three": it waits for " two", which decides it
    assert "para two" in out.chunks and "para" not in out.chunks


def test_first_of_several_stops_wins(bpe):
    for order in ((" end", "two"), ("two", " end")):
        out, _ = run(bpe, ids(bpe, *CHAIN), "--max-new-tokens", "8", "--stop", order[0], "--stop", order[1])
        assert out.getvalue() == "one line\npara " + "\n"


def test_stop_is_matched_on_generated_text_only(bpe):
    out, n_new = run(bpe, ids(bpe, *CHAIN), "--max-new-tokens", "8", "--stop", "one")
    assert out.getvalue() == "one line\npara two: the end\n\n" + "\n"   # "one" is only the prompt
    assert n_new == 8


def test_stop_completed_by_the_last_token(bpe):
    out, n_new = run(bpe, ids(bpe, *CHAIN), "--max-new-tokens", "7", "--stop", "the end")
    assert out.getvalue() == "one line\npara two: " + "\n"
    assert n_new == 7


def test_stop_inside_a_multibyte_character(bpe):
    # "é" is two byte tokens: the stop matches once the character is complete
    table = bytes_to_unicode()
    chain = ids(bpe, "one", " line") + [bpe.hf.token_to_id(table[b]) for b in "é".encode()] + ids(bpe, " end")
    out, n_new = run(bpe, chain, "--max-new-tokens", "6", "--stop", "é")
    assert out.getvalue() == "one line" + "\n"
    assert n_new == 3


def test_several_samples_are_each_cut(bpe):
    out = io.StringIO()
    run(bpe, ids(bpe, *CHAIN), "--max-new-tokens", "8", "--stop", ":", "--num-samples", "3", out=out)
    assert out.getvalue() == "".join(f"--- sample {i} ---\none line\npara two\n" for i in (1, 2, 3))


def test_empty_stop_is_an_error(bpe):
    with pytest.raises(ValueError, match="--stop needs a non-empty text"):
        run(bpe, ids(bpe, *CHAIN), "--stop", "")


# ------------------------------------------------------------------ StopText, any split
class PieceTokenizer:
    """Token i is the text pieces[i] (what StreamDecoder needs: token_bytes, is_special)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def token_bytes(self, i):
        return self.pieces[i].encode("utf-8")

    def is_special(self, i):
        return False


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc\n", max_size=40), data=st.data(),
       stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_text_cuts_before_the_first_match_for_any_split(text, data, stops):
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=len(text))))
    bounds = [0] + [c for c in cuts if c < len(text)] + [len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    expected, found = text, False                                # read character by character
    for end in range(1, len(text) + 1):
        done = [len(s) for s in stops if text[:end].endswith(s)]
        if done:
            expected, found = text[:end - max(done)], True
            break
    stop = StopText(PieceTokenizer(pieces), stops)
    printed = ""
    for i in range(len(pieces)):
        printed += stop.push(i)
        assert expected.startswith(printed)                      # never past the stop
        assert len(stop.pending) < max(map(len, stops))          # holds back less than a stop
        if stop.stopped:
            break
    printed += stop.finish()
    assert printed == expected
    assert stop.stopped == found

"""Preference pairs (training/preference.py): a batch's rows and targets, the truncation rule,
and every refusal naming its line (TRL's own tokens: tests/system/test_dpo_trl.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pedestrian.text.tokenizer import BPETokenizer
from pedestrian.training.preference import Pair, common_prefix_length, encode_record, pair_batch, read_pairs

TOKENIZER = BPETokenizer.train("the quick brown fox jumps over the lazy dog. " * 10, vocab_size=280)


def test_a_batch_holds_the_chosen_rows_then_the_rejected_with_answer_targets_only():
    pairs = [Pair((1, 2, 3), (4, 5), (6,)), Pair((7,), (8, 9, 10, 11), (12, 13))]
    tokens, targets = pair_batch(pairs, window=16, pad_id=0)
    # rows: [1 2 3 4 5], [7 8 9 10 11], [1 2 3 6], [7 12 13]; width = longest - 1 = 4
    np.testing.assert_array_equal(tokens, [[1, 2, 3, 4], [7, 8, 9, 10], [1, 2, 3, 0], [7, 12, 0, 0]])
    np.testing.assert_array_equal(targets, [[-100, -100, 4, 5], [8, 9, 10, 11], [-100, -100, 6, -100],
                                            [12, 13, -100, -100]])


def test_sequences_keep_their_first_window_plus_one_tokens():
    tokens, targets = pair_batch([Pair((1, 2), (3, 4, 5, 6, 7), (8,))], window=4)
    np.testing.assert_array_equal(tokens, [[1, 2, 3, 4], [1, 2, 0, 0]])
    np.testing.assert_array_equal(targets, [[-100, 3, 4, 5], [-100, 8, -100, -100]])


def test_plain_text_answers_end_with_the_eos_token_and_split_at_the_common_prefix():
    pair = encode_record({"prompt": "the quick", "chosen": " fox", "rejected": " dog<|endoftext|>"}, TOKENIZER,
                         eos_token="<|endoftext|>")
    whole = TOKENIZER.encode("the quick fox<|endoftext|>")
    assert pair.prompt + pair.chosen == tuple(whole) and pair.chosen[-1] == 0 and pair.rejected[-1] == 0
    assert pair.rejected.count(0) == 1                              # (not appended twice)
    assert len(pair.prompt) == min(common_prefix_length(TOKENIZER.encode("the quick"), whole),
                                   common_prefix_length(TOKENIZER.encode("the quick"),
                                                        TOKENIZER.encode("the quick dog<|endoftext|>")))


def _write(tmp_path, lines):
    p = tmp_path / "pairs.jsonl"
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    return p


GOOD = {"prompt": "the quick", "chosen": " fox", "rejected": " dog"}
MSGS = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}],
        "rejected": [{"role": "assistant", "content": "b"}]}


@pytest.mark.parametrize("lines,message", [
    ([GOOD, "{not json"], "pairs.jsonl line 2 is not JSON"),
    ([GOOD, {"prompt": "x", "chosen": "y"}], "line 2: a preference record needs the fields prompt, chosen and rejected"),
    ([{"prompt": "x", "chosen": ["y"], "rejected": "z"}], "line 1: prompt, chosen and rejected must be three strings"),
    ([GOOD, MSGS], "line 2: records of messages are rendered with the folder's chat template"),
    ([{"prompt": "the quick", "chosen": "", "rejected": " dog"}], "line 1: an answer adds no token"),
    ([], "holds no preference pair"),
])
def test_bad_records_are_named_by_their_line(tmp_path, lines, message):
    with pytest.raises(ValueError, match=message):
        read_pairs(_write(tmp_path, lines), TOKENIZER, 32, eos_token=None)


def test_a_file_mixing_the_two_forms_is_refused(tmp_path):
    with pytest.raises(ValueError, match="line 2: the file mixes plain-text records and records of messages"):
        read_pairs(_write(tmp_path, [GOOD, MSGS]), TOKENIZER, 32, eos_token=None,
                   render=lambda messages, gen: [1, 2, 3] + [4] * (not gen))


def test_pairs_whose_prompt_fills_the_window_are_left_out_and_counted(tmp_path):
    long = {"prompt": "the quick brown fox jumps over the lazy dog " * 3, "chosen": " a", "rejected": " b"}
    read = read_pairs(_write(tmp_path, [GOOD, long, "", GOOD]), TOKENIZER, 8, eos_token=None)
    assert (len(read.pairs), read.dropped, read.form) == (2, 1, "text")
    with pytest.raises(ValueError, match="1 left out: their prompt alone fills the window of 8 tokens"):
        read_pairs(_write(tmp_path, [long]), TOKENIZER, 8, eos_token=None)
    with pytest.raises(FileNotFoundError, match="is not a file"):
        read_pairs(tmp_path / "missing.jsonl", TOKENIZER, 8, eos_token=None)

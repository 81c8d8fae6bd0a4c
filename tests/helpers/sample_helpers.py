"""Helpers for the `pedestrian sample` tests: a model that emits a chosen token chain, a stream
that records each write, and argument parsing."""

from __future__ import annotations

import io

from pedestrian import cli
from pedestrian.config import GPTConfig
from pedestrian.model import GPT


class Chunks(io.StringIO):
    """A text stream that also records every write (one write per streamed token)."""

    def __init__(self):
        super().__init__()
        self.chunks: list[str] = []

    def write(self, s):
        self.chunks.append(s)
        return super().write(s)


def parse(*argv: str):
    """``pedestrian sample`` arguments (the model source is not used by ``run_sample``)."""
    return cli.build_parser().parse_args(["sample", "--checkpoint", "unused", *argv])


def forced_model(tokenizer, chain: list[int], context_length: int = 32) -> GPT:
    """A GPT that deterministically emits ``chain[i+1]`` after ``chain[i]`` (greedy).

    All blocks are zeroed (the residual stream carries ``W_tok[x]``), each chain token gets its
    own embedding axis, and the untied logits weight maps that axis to the successor. The
    tokens of ``chain[:-1]`` must be distinct (each has one successor).
    """
    assert len(set(chain[:-1])) == len(chain) - 1, "a token may occur only once before the end"
    V = tokenizer.vocab_size
    d = len(chain) + 2
    model = GPT(GPTConfig(vocab_size=V, context_length=context_length, d_model=d, n_heads=1,
                          n_blocks=1, tie_weights=False), dtype="float64")
    for name, p in model.params.items():
        p[...] = 1.0 if ("ln" in name and name.endswith("weight")) else 0.0
    for slot, token in enumerate(chain[:-1]):
        model.params["tok_emb.weight"][token, slot] = 10.0
        model.params["logits.weight"][slot, chain[slot + 1]] = 10.0
    return model

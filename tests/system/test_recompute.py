"""``model.recompute`` (``--recompute``): the forward keeps only each block's input, the backward
runs each block's forward again just before its backward -- and every number is the same.

The claim is exact: the recomputed block sees the same input, the same weights, the same kernels
on the same shapes and threads (whose bits depend on those only, docs/kernels.md) and the same
dropout draws (the generator is put back to where the block's first draw started, and after the
backward to where the forward left it). So the tests compare bit for bit (``array_equal``), not
within a tolerance: losses, every gradient, every kept ``Δ``, over two steps so that a generator
left in the wrong place shows in the second. A recompute that forgot the adapters' dropout masks
or restored the generator to before the logits' LoRA draw failed here (both seen while writing
it). Less memory is a claim too: the pool of a recomputing forward holds the blocks' inputs and one
block's arrays, not every block's.
"""

from __future__ import annotations

import numpy as np
import pytest

from pedestrian.cli import main
from pedestrian.config import GPTConfig
from pedestrian.model import GPT

from cli_helpers import write_fox_corpus

GPT2 = dict(vocab_size=29, context_length=300, d_model=16, n_heads=2, n_blocks=3)
LLAMA = dict(GPT2, norm="rmsnorm", mlp="swiglu", n_kv_heads=1, position_encoding="rope", bias=False)
CASES = {   # name: (config fields, T (from 256: the tiled attention), dtype, LoRA)
    "gpt2-dropout-lora": (dict(GPT2, dropout=0.1), 40, "float64", True),
    "gpt2-tiled-f32": (GPT2, 300, "float32", False),
    "llama-gqa-dropout-lora": (dict(LLAMA, dropout=0.1), 33, "float64", True),
    "llama-tiled-f32-lora": (LLAMA, 260, "float32", True),
}


def _steps(fields: dict, T: int, dtype: str, lora: bool, recompute: bool, kernels: str = "fast") -> list:
    """Two (loss, gradients, Δs) of a model built the same way every call."""
    model = GPT(GPTConfig(**fields), seed=3, dtype=dtype, kernels=kernels)
    if lora:                                # the adapters' own dropout draws too (logits' after the blocks)
        model.add_lora(["blocks.0.attn.q", "blocks.1.mlp_expand", "logits"], rank=2, dropout=0.2,
                       freeze_base=False)
    model.recompute = recompute
    rng = np.random.default_rng(0)
    out = []
    for _ in range(2):
        x, y = rng.integers(0, fields["vocab_size"], (2, 2, T))
        loss = model.loss(x, y)
        grads = {k: np.array(v) for k, v in model.backward(keep_deltas=True).items()}
        out.append((loss, grads, {k: np.array(v) for k, v in model.deltas().items()}))
    return out


@pytest.mark.parametrize("recompute", [True, 1])         # every block; the first of three (the others lean)
@pytest.mark.parametrize("kernels", ["fast", "reference"])
@pytest.mark.parametrize("case", list(CASES))
def test_recompute_gives_the_same_bits(case, kernels, recompute):
    if kernels == "reference" and CASES[case][1] > 256:
        pytest.skip("the reference path has no tiled attention to reach")
    plain, again = (_steps(*CASES[case], recompute=r, kernels=kernels) for r in (False, recompute))
    for (l0, g0, d0), (l1, g1, d1) in zip(plain, again):
        assert l0 == l1
        assert g0.keys() == g1.keys() and d0.keys() == d1.keys()
        for name in g0:
            assert np.array_equal(g0[name], g1[name]), name
        for name in d0:
            assert np.array_equal(d0[name], d1[name]), name


@pytest.mark.parametrize("mlp", ["standard", "swiglu"])
def test_recompute_keeps_only_the_blocks_inputs(mlp):
    """What a forward leaves allocated (``tracemalloc``: NumPy reports its arrays' memory): with
    ``recompute`` the blocks' inputs and the logits, not every block's arrays; with the first 2 of 4
    blocks recomputed, the other two keep less than a plain forward's blocks (no ``a4``, ``a5``,
    ``a8``, ``a9``, ``a10``). 4 blocks of d 64, T 260, float32, measured (GELU and SwiGLU alike):
    all 0.30 of the plain forward's, half 0.46; bounds 0.5 and 0.58 (half the blocks kept whole
    would be 0.30 + 0.70 / 2 = 0.65). And the backward of a recomputing :meth:`GPT.loss` lets go of
    each block's arrays once its backward has read them, so the first blocks, recomputed last, take
    theirs from the pool: with half the blocks recomputed, what the backward adds at its peak to
    what the forward left is about what it adds with all of them (measured 0.94 of it; 1.53-1.66
    when every kept block was held to the end of the backward); bound 1.2."""
    import tracemalloc

    fields = dict(GPT2, d_model=64, n_heads=4, n_blocks=4, context_length=260, mlp=mlp)
    x = np.random.default_rng(0).integers(0, fields["vocab_size"], (2, 260))
    GPT(GPTConfig(**fields), seed=3).loss(x, x)           # the kernels compiled (or loaded) first
    held, added = [], []
    for recompute in (False, True, 2):
        model = GPT(GPTConfig(**fields), seed=3)
        model.recompute = recompute
        tracemalloc.start()
        model.loss(x, x)
        held.append(tracemalloc.get_traced_memory()[0])
        tracemalloc.reset_peak()
        model.backward()
        added.append(tracemalloc.get_traced_memory()[1] - held[-1])
        tracemalloc.stop()
    assert held[1] < 0.5 * held[0] and held[2] < 0.58 * held[0], [h / held[0] for h in held]
    assert added[2] < 1.2 * added[1], added[2] / added[1]


@pytest.mark.parametrize("bad", [-1, 4, 1.5, "all"])
def test_a_recompute_setting_out_of_range_is_refused_in_one_line(bad):
    model = GPT(GPTConfig(**dict(GPT2, context_length=8)), seed=0)
    model.recompute = bad
    with pytest.raises(ValueError, match=r"model.recompute = .*from 0 to 3"):
        model.loss(np.zeros((1, 8), dtype=np.int64), np.zeros((1, 8), dtype=np.int64))


def test_delta12_over_the_logits_only_when_no_caller_holds_them():
    """A recomputing :meth:`GPT.loss` lets its backward write ``Δ12`` over the logits (then a
    second backward is refused in one line); logits returned by :meth:`GPT.forward` stay as they were."""
    model = GPT(GPTConfig(**dict(GPT2, context_length=8)), seed=0)
    model.recompute = True
    x = np.arange(8).reshape(1, 8)
    logits = model.forward(x, x)
    before = logits.copy()
    model.backward()
    assert np.array_equal(logits, before)
    model.backward()                           # the logits are intact, so a second backward is fine
    model.loss(x, x)
    model.backward()
    with pytest.raises(ValueError, match="run model.loss"):
        model.backward()
    model.loss(x, x)                           # a signal of one's own: the blocks were let go all the same
    model.backward(delta_logits=np.ones_like(before))
    with pytest.raises(ValueError, match="run model.loss"):
        model.backward(delta_logits=np.ones_like(before))


def test_inspection_after_a_recomputing_forward_is_refused_in_one_line():
    model = GPT(GPTConfig(**dict(GPT2, context_length=8)), seed=0)
    model.recompute = True
    x = np.zeros((1, 8), dtype=np.int64)
    model.loss(x, x)
    for call in (model.activations, model.attention_weights):
        with pytest.raises(ValueError, match="model.recompute = False"):
            call()
    model.backward()                           # the backward itself is fine
    model.forward(x)                           # generation-style forward without targets: kept as well
    with pytest.raises(ValueError, match="recompute"):
        model.activations()


def test_train_with_recompute_writes_the_same_run(tmp_path, capsys):
    """``pedestrian train --recompute`` (with dropout) ends with the same weights and losses."""
    from pedestrian.checkpoint import load_checkpoint
    from pedestrian.training import read_log

    corpus = write_fox_corpus(tmp_path / "fox.txt", 200)
    tiny = ["--data", str(corpus), "--context-length", "16", "--d-model", "16", "--n-heads", "2", "--n-blocks",
            "2", "--batch-size", "4", "--eval-interval", "3", "--eval-batches", "2", "--max-steps", "4",
            "--dropout", "0.1", "--max-minutes", "0", "--no-progress", "--no-plot", "--no-sample"]
    runs = [tmp_path / "plain", tmp_path / "recompute"]
    assert main(["train", "--out", str(runs[0]), *tiny]) == 0
    assert main(["train", "--out", str(runs[1]), "--recompute", *tiny]) == 0
    capsys.readouterr()
    logs = [[(r["step"], r["loss"]) for r in read_log(run / "log.jsonl") if "loss" in r] for run in runs]
    assert logs[0] == logs[1] and len(logs[0]) == 4
    models = [load_checkpoint(run).model for run in runs]
    for name, value in models[0].params.items():
        assert np.array_equal(value, models[1].params[name]), name

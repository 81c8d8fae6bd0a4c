"""AdamW inside the backward (``--update-in-backward``, :mod:`pedestrian.training.blockwise`): the
same update as a backward followed by ``AdamW.step``, without a whole-model gradient.

Exact claims, so exact comparisons (``array_equal``): every block's gradient comes from the same
kernels on the same inputs (only the buffer it is written into differs), and AdamW updates each
entry on its own, so updating a buffer region by region gives the bits of one ``step``. Compared
over three steps (the moments and the bias corrections move), with dropout (the masks keyed as
the trainer keys them), tied and untied logits, GPT-2 and Llama blocks, float32 and float64, with
and without ``recompute``. The loss is the same number; the gradient norm is assembled from the
blocks' norms, so it agrees to rounding only (1e-12 relative in float64: a sum of 3-10 squares).
"""

from __future__ import annotations

import numpy as np
import pytest

from pedestrian.checkpoint import NonFiniteError
from pedestrian.cli import main
from pedestrian.config import GPTConfig
from pedestrian.model import GPT
from pedestrian.training.blockwise import blockwise_step, check_blockwise
from pedestrian.training.optim import AdamW
from pedestrian.training.step import TrainingError, train_step

from cli_helpers import write_fox_corpus

SMALL = dict(vocab_size=31, context_length=40, d_model=16, n_heads=2, n_blocks=3)
LLAMA = dict(SMALL, norm="rmsnorm", mlp="swiglu", n_kv_heads=1, position_encoding="rope", bias=False,
             tie_weights=False)


def _run(fields, dtype, blockwise, recompute=False, steps=3):
    model = GPT(GPTConfig(**fields), seed=2, dtype=dtype)
    model.recompute = recompute
    optimizer = AdamW(model, lr=1e-2, weight_decay=0.1)
    rng = np.random.default_rng(0)
    out = []
    for s in range(steps):
        x, y = rng.integers(0, fields["vocab_size"], (2, 3, fields["context_length"]))
        step = blockwise_step if blockwise else train_step
        out.append(step(model, optimizer, [(x, y)], 1e-2, 0.0, None, None, (7, s)))
    return model, optimizer, out


@pytest.mark.parametrize("recompute", [False, True, 2])   # the blockwise side's; the plain step keeps all
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("fields", [dict(SMALL, dropout=0.1), LLAMA], ids=["gpt2-tied-dropout", "llama-untied"])
def test_blockwise_step_is_the_step(fields, dtype, recompute):
    (m0, o0, r0), (m1, o1, r1) = _run(fields, dtype, False), _run(fields, dtype, True, recompute)
    for (loss0, norm0), (loss1, norm1) in zip(r0, r1):
        assert loss0 == loss1
        assert norm1 == pytest.approx(norm0, rel=1e-12 if dtype == "float64" else 1e-6)
    for name in m0.params:
        assert np.array_equal(m0.params[name], m1.params[name]), name
    for a, b in zip(o0.m + o0.v, o1.m + o1.v):
        assert np.array_equal(a, b)
    assert o0.step_count == o1.step_count == 3


def test_the_whole_model_gradient_of_the_blocks_is_never_written():
    """The memory claim: the blocks' regions of the whole-model gradient buffer stay as allocated
    (zeros, never written: untouched pages of a fresh buffer take no memory), and the blocks' own
    gradients live in one block-sized buffer."""
    model, _, _ = _run(SMALL, "float32", True)
    base, flat = model.parameters.base, model.parameters.base_grads.flat
    blocks = [span for name, span in base.spans.items() if name.startswith("blocks.")]
    assert blocks and all(not flat[lo:hi].any() for lo, hi in blocks)
    rest = [span for name, span in base.spans.items() if not name.startswith("blocks.")]
    assert any(flat[lo:hi].any() for lo, hi in rest)                  # the embeddings' own were
    one = model.parameters.block_grads().flat
    assert one.shape[0] * SMALL["n_blocks"] == sum(hi - lo for lo, hi in blocks) and one.any()


def test_a_non_finite_block_gradient_stops_the_step_naming_the_block(monkeypatch):
    """Block 1's layer-norm gradient made NaN: block 2 (the last, whose backward ran first) is
    updated, block 1, block 0 and the embeddings are not, and the error names blocks.1."""
    model = GPT(GPTConfig(**SMALL), seed=2, dtype="float64")
    optimizer = AdamW(model, lr=1e-2)
    before = {k: v.copy() for k, v in model.params.items()}
    # The chain calls a layer norm's backward in two ways: the final norm alone
    # (layernorm_backward), each block's two norms with the skip they feed (add_layernorm_backward).
    # Both are spied on, one count of norm backwards in the order the chain makes them.
    calls, real, real_add = [], model.kernels.layernorm_backward, model.kernels.add_layernorm_backward

    def spoil(dweight) -> None:
        calls.append(1)
        if len(calls) == 4:                 # final norm, block 2's two, then block 1's second norm
            dweight[0] = np.nan

    def broken(delta, cache, *, dweight=None, dbias=None):
        out = real(delta, cache, dweight=dweight, dbias=dbias)
        spoil(dweight)
        return out

    def broken_add(delta, cache, delta_skip, *, dweight=None, dbias=None):
        out = real_add(delta, cache, delta_skip, dweight=dweight, dbias=dbias)
        spoil(dweight)
        return out

    monkeypatch.setattr(model.kernels, "layernorm_backward", broken)
    monkeypatch.setattr(model.kernels, "add_layernorm_backward", broken_add)
    x = np.random.default_rng(0).integers(0, 31, (2, 40))
    with pytest.raises(NonFiniteError, match=r"gradient of blocks\.1 .*blocks after it were updated"):
        blockwise_step(model, optimizer, [(x, x)], 1e-2)
    assert len(calls) == 5                  # block 1 finished, then the step stopped: block 0 never ran
    changed = {k for k in before if not np.array_equal(before[k], model.params[k])}
    assert changed and all(k.startswith("blocks.2.") for k in changed)


def test_a_non_finite_loss_skips_the_step_before_the_backward():
    model = GPT(GPTConfig(**SMALL), seed=2)
    model.params["ln_final.weight"][0] = np.inf
    optimizer = AdamW(model, lr=1e-2)
    before = {k: v.copy() for k, v in model.params.items()}
    x = np.zeros((1, 40), dtype=np.int64)
    loss, norm = blockwise_step(model, optimizer, [(x, x)], 1e-2)
    assert not np.isfinite(loss) and np.isnan(norm) and optimizer.step_count == 0
    assert all(np.array_equal(before[k], model.params[k], equal_nan=True) for k in before)


def test_what_it_cannot_do_is_refused_in_one_line():
    model = GPT(GPTConfig(**SMALL), seed=2)
    optimizer = AdamW(model)
    with pytest.raises(TrainingError, match=r"cannot do global-norm clipping \(pass --grad-clip 0\), gradient "
                                            r"accumulation \(pass --grad-accum 1\)"):
        check_blockwise(model, optimizer, k=2, grad_clip=1.0)
    model.add_lora(["blocks.0.attn.q"], rank=2)
    with pytest.raises(TrainingError, match="LoRA adapters"):
        check_blockwise(model, AdamW(model))


@pytest.mark.parametrize("recompute", [["--recompute"], ["--recompute-blocks", "1"]])
def test_train_update_in_backward_writes_the_same_run(tmp_path, capsys, recompute):
    """``pedestrian train --update-in-backward --recompute --grad-clip 0`` (or ``--recompute-blocks
    1`` of 2) ends with the weights and losses of ``--grad-clip 0`` without them, and the resume
    command it prints repeats them; with clipping on, or accumulation, it is refused in one line
    naming what to change; so is ``--recompute-blocks`` above the model's blocks."""
    from pedestrian.checkpoint import load_checkpoint
    from pedestrian.training import read_log

    corpus = write_fox_corpus(tmp_path / "fox.txt", 200)
    tiny = ["--data", str(corpus), "--context-length", "16", "--d-model", "16", "--n-heads", "2", "--n-blocks",
            "2", "--batch-size", "4", "--eval-interval", "2", "--eval-batches", "2", "--max-steps", "4",
            "--dropout", "0.1", "--grad-clip", "0", "--max-minutes", "0", "--no-progress", "--no-plot",
            "--no-sample"]
    runs = [tmp_path / "plain", tmp_path / "in_backward"]
    assert main(["train", "--out", str(runs[0]), *tiny]) == 0
    assert main(["train", "--out", str(runs[1]), "--update-in-backward", *recompute, *tiny]) == 0
    said = capsys.readouterr().out       # the resume command it prints repeats the per-run switches
    assert (f"--out {runs[1]} --resume --no-progress --no-plot {' '.join(recompute)} --update-in-backward "
            "--grad-clip 0") in said
    assert ("memory: " + ("every block" if recompute == ["--recompute"] else "the first 1 of 2 blocks")
            + " recomputed in the backward") in said and "AdamW applied block by block" in said
    logs = [[(r["step"], r["loss"]) for r in read_log(run / "log.jsonl") if "loss" in r] for run in runs]
    assert logs[0] == logs[1] and len(logs[0]) == 4
    models = [load_checkpoint(run).model for run in runs]
    for name, value in models[0].params.items():
        assert np.array_equal(value, models[1].params[name]), name
    # a resume takes --grad-clip 0 from its checkpoint: --update-in-backward alone switches it on there
    assert main(["train", "--out", str(runs[0]), "--resume", "--update-in-backward", "--max-steps", "6",
                 "--no-progress", "--no-plot", "--no-sample"]) == 0
    assert "on the 2 fixed validation batches" in capsys.readouterr().out      # its own --eval-batches
    clipped = [("1" if a == "0" and b == "--grad-clip" else a) for b, a in zip(["", *tiny], tiny)]
    assert main(["train", "--out", str(tmp_path / "clipped"), "--update-in-backward", *clipped]) != 0
    err = capsys.readouterr().err
    assert "--update-in-backward" in err and "--grad-clip 0" in err and len(err.strip().splitlines()) == 1
    assert main(["train", "--out", str(tmp_path / "accum"), "--update-in-backward", "--grad-accum", "2", *tiny]) != 0
    err = capsys.readouterr().err                         # names what is wrong, not what is right already
    assert err.strip().endswith("it needs --grad-accum 1") and len(err.strip().splitlines()) == 1
    assert main(["train", "--out", str(tmp_path / "many"), "--recompute-blocks", "3", *tiny]) != 0
    err = capsys.readouterr().err
    assert "--recompute-blocks 3: the model has 2 blocks" in err and len(err.strip().splitlines()) == 1

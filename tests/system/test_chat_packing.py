"""Short conversations packed into one window (text/chat.pack_windows): the rows hold each
conversation's inputs and targets in file order, first fit, with nondecreasing segment ids; with
the attention's packed-segment mask (``GPT.loss(..., segments=)``) a packed window gives the loss
and every gradient of the conversations run one by one (float64)."""

from __future__ import annotations


import numpy as np
import pytest

from pedestrian import GPT, GPTConfig
from pedestrian.text.chat import IGNORE_INDEX, pack_windows


def pieces(lengths, seed=0, V=13):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        x = rng.integers(0, V, n)
        y = rng.integers(0, V, n)
        y[: n // 3] = IGNORE_INDEX                        # the prompt's targets do not count
        out.append((x, y, i + 1))
    return out


def test_first_fit_rows_and_segments():
    p = pieces([5, 7, 4, 3])
    rows = pack_windows(p, 12, pad_id=9)
    assert rows.lines == [[1, 2], [3, 4]]                  # 5 + 7 = 12 fill row 0; 4 + 3 go to row 1
    np.testing.assert_array_equal(rows.x[0], np.concatenate([p[0][0], p[1][0]]))
    np.testing.assert_array_equal(rows.y[1], np.concatenate([p[2][1], p[3][1], [IGNORE_INDEX] * 5]))
    np.testing.assert_array_equal(rows.x[1, 7:], [9] * 5)
    np.testing.assert_array_equal(rows.segments, [[0] * 5 + [1] * 7, [0] * 4 + [1] * 3 + [2] * 5])
    x, y, seg = rows.get_batch(np.random.default_rng(0), 3, 12)
    assert x.shape == y.shape == seg.shape == (3, 12)


@pytest.mark.parametrize("llama", [True, False], ids=["rope-rmsnorm-swiglu", "gpt2-learned"])
def test_packed_windows_give_the_loss_and_gradients_of_the_conversations_one_by_one(llama):
    kw = dict(position_encoding="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2) if llama else {}
    model = GPT(GPTConfig(vocab_size=13, context_length=16, d_model=12, n_heads=4, n_blocks=2, **kw),
                dtype="float64", seed=2)
    p = pieces([5, 7, 4, 3, 9, 6], seed=1)
    rows = pack_windows(p, 16)
    packed = model.loss(rows.x, rows.y, segments=rows.segments)
    packed_grads = {k: np.array(v, np.float64) for k, v in model.backward().items()}
    n_total = sum(int((y != IGNORE_INDEX).sum()) for _, y, _ in p)
    loss, grads = 0.0, {}
    for x, y, _ in p:                                  # each alone, weighted by its share of the targets
        loss += model.loss(x[None], y[None], n_total=n_total)
        for k, g in model.backward().items():
            grads[k] = grads.get(k, 0.0) + np.array(g, np.float64)
    # float64, the same products summed in another order over a few dozen terms: a few ulps
    assert packed == pytest.approx(loss, rel=1e-12)
    scale = max(np.max(np.abs(g)) for g in grads.values())
    for k, g in grads.items():
        if k.endswith(".attn.k.bias"):   # identically 0 (paper section 3.1: a key bias shifts a query's
            # scores by one constant, which softmax ignores): rounding noise only, ~1e-21 here
            assert max(np.max(np.abs(packed_grads[k])), np.max(np.abs(g))) <= 1e-12 * scale, k
        else:
            assert np.max(np.abs(packed_grads[k] - g)) <= 1e-11 * max(np.max(np.abs(g)), 1e-300), k

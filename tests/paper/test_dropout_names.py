"""With dropout on, the paper's names still mean what they say: ``a1``, ``a4`` and ``a9`` are the
values before dropout (``a4 = FC_attProj(a3)``), and ``Δ_i = ∂L/∂a_i`` for them -- checked by
central finite differences with the same dropout masks in every evaluation (the generator is
reset before each loss). A bias, or a position-table row with ``B = 1``, shifts ``a_i`` alone, so
its finite difference is ``Σ Δ_i`` over the positions it shifts.
"""

from __future__ import annotations

import numpy as np
import pytest

from pedestrian.config import GPTConfig
from pedestrian.model import GPT

CFG = GPTConfig(vocab_size=11, context_length=8, d_model=8, n_heads=2, n_blocks=2, dropout=0.4)
TOKENS = np.array([[1, 4, 4, 7, 2, 9]])
TARGETS = np.array([[4, 4, 7, 2, 9, 3]])
SEED, H = 9, 1e-5


def loss(model) -> float:
    model.dropout_rng = np.random.default_rng(SEED)         # the same masks every time
    return model.loss(TOKENS, TARGETS)


def central_difference(model, name, index) -> float:
    p, old = model.params[name], model.params[name][index]
    p[index] = old + H
    up = loss(model)
    p[index] = old - H
    down = loss(model)
    p[index] = old
    return (up - down) / (2 * H)


@pytest.mark.parametrize("kernels", ["reference", "fast"])
def test_a_i_before_dropout_and_delta_i_their_gradient(kernels):
    model = GPT(CFG, seed=3, dtype="float64", kernels=kernels)
    loss(model)
    model.backward(keep_deltas=True)
    acts, deltas, P = model.activations(), model.deltas(), model.params
    T = TOKENS.shape[1]
    assert np.array_equal(acts["a1"], P["tok_emb.weight"][TOKENS] + P["pos_emb.weight"][:T])
    for i in range(CFG.n_blocks):
        b = f"blocks.{i}"
        np.testing.assert_allclose(acts[f"{b}.a4"], acts[f"{b}.a3"] @ P[f"{b}.attn_proj.weight"]
                                   + P[f"{b}.attn_proj.bias"], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(acts[f"{b}.a9"], acts[f"{b}.a8"] @ P[f"{b}.mlp_contract.weight"]
                                   + P[f"{b}.mlp_contract.bias"], rtol=1e-12, atol=1e-14)
    model.training = False
    no_dropout = model.loss(TOKENS, TARGETS)
    model.training = True
    assert abs(loss(model) - no_dropout) > 1e-6                             # dropout really is on

    for t, j in [(0, 0), (3, 5), (5, 7)]:                                     # Δ1 = ∂L/∂a1
        assert central_difference(model, "pos_emb.weight", (t, j)) == pytest.approx(deltas["Δ1"][0, t, j],
                                                                                   rel=1e-6, abs=1e-9)
    for i in range(CFG.n_blocks):
        for n, layer in ((4, "attn_proj"), (9, "mlp_contract")):            # Δ4, Δ9
            delta = deltas[f"blocks.{i}.Δ{n}"]
            for j in (1, 6):
                fd = central_difference(model, f"blocks.{i}.{layer}.bias", j)
                assert fd == pytest.approx(float(delta[..., j].sum()), rel=1e-6, abs=1e-9), (i, n, j)


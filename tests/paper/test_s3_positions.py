"""The paper's statements about positions (sections 2-3), each a test with the bound it uses.

- With no position encoding and no mask, the whole model is permutation-equivariant: permuting
  the input tokens permutes every row of the logits (and leaves the loss and every gradient
  unchanged when the targets are permuted alike). Bound 1e-12 relative in float64: both passes
  sum the same terms in another order, a few roundings per entry through two blocks.
- RoPE, learned positions or the causal mask each break it: the deviation exceeds 1e-3 (a real
  difference, not rounding).
- RoPE attention weights depend only on the query-key offset: the same tokens at positions
  ``s … s+T-1`` get the same ``P`` in every block as at ``0 … T-1`` (bound 1e-10: angles of up
  to ~10³ radians carry ~10³·eps of rounding); learned positions do not (> 1e-3).
- ``pedestrian demo --properties`` prints each of these with its deviation and bound.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradcheck import model_key_bias_bounds

from pedestrian.cli import main as cli_main
from pedestrian.model.kv_cache import KVCache
from torch_reference import default_cfg, random_params

EQUAL, SHIFT, BROKEN = 1e-12, 1e-10, 1e-3


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def case(build_model, token_batch, encoding, causal):
    cfg = default_cfg(position_encoding=encoding, causal=causal, rope_fraction=0.5, d_qk=4)
    model = build_model(cfg, random_params(cfg, seed=21), dtype="float64")
    tokens, targets = token_batch(cfg, 3, cfg["context_length"], seed=21)
    perm = np.random.default_rng(0).permutation(tokens.shape[1])
    assert np.any(tokens[:, perm] != tokens)
    return model, tokens, targets, perm


def test_no_positions_no_mask_is_permutation_equivariant(build_model, token_batch):
    model, tokens, targets, perm = case(build_model, token_batch, "none", causal=False)
    logits = np.asarray(model.forward(tokens))
    assert rel_err(model.forward(tokens[:, perm]), logits[:, perm]) <= EQUAL
    loss = model.loss(tokens, targets)
    grads = {k: np.array(v) for k, v in model.backward(keep_deltas=True).items()}
    delta1 = np.array(model.deltas()["Δ1"])
    assert abs(model.loss(tokens[:, perm], targets[:, perm]) - loss) <= EQUAL * loss
    for name, g in model.backward(keep_deltas=True).items():
        if name.endswith("attn.k.bias"):                   # identically 0 (section 3): no relative error,
            bound = model_key_bias_bounds(model)[int(name.split(".")[1])]   # rounding noise within its bound
            assert np.all(np.abs(np.asarray(g)) <= bound)
            continue
        assert rel_err(g, grads[name]) <= EQUAL, name      # the same sums in another order
    assert rel_err(model.deltas()["Δ1"], delta1[:, perm]) <= EQUAL   # error signals follow the tokens


@pytest.mark.parametrize("encoding,causal", [("rope", False), ("learned", False), ("none", True),
                                             ("rope", True)])
def test_rope_learned_positions_or_the_mask_break_equivariance(encoding, causal, build_model, token_batch):
    model, tokens, _, perm = case(build_model, token_batch, encoding, causal)
    logits = np.asarray(model.forward(tokens))
    assert rel_err(model.forward(tokens[:, perm]), logits[:, perm]) > BROKEN


@pytest.mark.parametrize("causal", [True, False])
def test_rope_attention_depends_only_on_the_offset(causal, build_model, token_batch):
    """Non-causal models cannot use a KV cache, so shift by rotating with explicit positions: the
    model with every position moved by s (the causal case through ``first_position``)."""
    model, tokens, _, _ = case(build_model, token_batch, "rope", causal)
    model.forward(tokens)
    plain = [np.array(p) for p in model.attention_weights()]
    logits = np.array(model.activations()["a12"])
    for s in (1, 37, 1000):
        if causal:
            cache = KVCache(model, tokens.shape[0])
            cache.reset(first_position=s)
            shifted = model.forward(tokens, kv_cache=cache)
        else:
            shifted = _forward_at_positions(model, tokens, s)
        for block, (p, q) in enumerate(zip(model.attention_weights(), plain)):
            assert rel_err(p, q) <= SHIFT, (s, block)
        assert rel_err(shifted, logits) <= SHIFT


def _forward_at_positions(model, tokens, s):
    """The RoPE model's forward with positions s … s+T-1: the rope step is given the positions a
    KV cache would give, without a cache (non-causal models have none)."""
    from pedestrian import layers

    calls = {}
    real = model.kernels

    class Shifted:                                          # the model's kernels, RoPE shifted by s
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def rope_forward(qkv, n_heads, d_qk, positions=None, **kw):
            calls["n"] = calls.get("n", 0) + 1
            return layers.rope_forward(qkv, n_heads, d_qk, np.arange(s, s + qkv.shape[1]), **kw)

    model.kernels = Shifted()
    try:
        return model.forward(tokens)
    finally:
        model.kernels = real
        assert calls["n"] == model.config.n_blocks


def test_learned_positions_are_absolute(build_model, token_batch):
    model, tokens, _, _ = case(build_model, token_batch, "learned", True)
    T = 5
    model.forward(tokens[:, :T])
    plain = [np.array(p) for p in model.attention_weights()]
    cache = KVCache(model, tokens.shape[0])
    cache.reset(first_position=3)                           # positions 3 … 7 exist in the table
    model.forward(tokens[:, :T], kv_cache=cache)
    assert max(rel_err(p, q) for p, q in zip(model.attention_weights(), plain)) > BROKEN


def test_demo_properties_prints_every_property_with_its_bound(capsys):
    assert cli_main(["demo", "--properties"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.rstrip().endswith(("holds", "broken, as stated"))]
    assert len(rows) == 9
    for line in rows:
        assert ("<= 1e-" in line) or (">  1e-03" in line)
    assert "9 of 9 properties as the paper states -> OK" in out

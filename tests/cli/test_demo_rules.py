"""What ``pedestrian demo`` states beside its gradient lines holds for the model it checks
(``pedestrian.paper.gradients``):

- ``∂L/∂b_k (≡ 0, §3)`` only where the rule is true -- learned positions or none, where ``b_k``
  shifts a whole row of scores by ``q_α · b_k`` and the softmax cancels it -- and there the line is
  verified as rounding noise. Under RoPE (a Qwen2-style model: RMS norm, SwiGLU, GQA, RoPE, q/k/v
  biases) the key bias is rotated by each key's position, its gradient is real, and the demo
  neither claims ``≡ 0`` nor fails the line: it says why, and checks it like any other, by finite
  differences and against autograd;
- an RMS-norm model's norm weights are labelled ``w_RMS1``, ``w_RMS2``, ``w_RMSfinal``, not
  layer norm's ``w_LN…``.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

from pedestrian import GPT, GPTConfig
from pedestrian.cli import main
from pedestrian.paper.demo import LLAMA_DEMO
from pedestrian.paper.gradients import (AUTOGRAD_RTOL, KEY_BIAS_ROPE_NOTE, check_model_gradients,
                                        gradients_text, key_bias_vanishes)
from torch_reference import reference_loss_and_grads


def demo_like(position_encoding: str, **fields) -> tuple:
    """A float64 two-block model with the demo's larger random weights, and a batch of 4 × 16."""
    widths = dict(d_model=24, n_heads=3, d_qk=6, d_head=8)
    config = GPTConfig(vocab_size=20, context_length=16, n_blocks=2, position_encoding=position_encoding,
                       **{**widths, **fields})
    model = GPT(config, seed=0, dtype="float64", kernels="reference")
    rng = np.random.default_rng(0)
    for name, p in model.params.items():
        if name.endswith("bias"):
            p[...] = rng.normal(0, 0.1, p.shape)
        elif p.ndim == 2:
            p[...] = rng.normal(0, 0.3, p.shape)
    x, y = rng.integers(0, 20, (4, 16)), rng.integers(0, 20, (4, 16))
    return model, x, y


def k_bias_lines(text: str) -> list[str]:
    return [r for r in text.split("\n\n")[1].splitlines() if r.startswith("∂L/∂b_k")]   # the table only


@pytest.mark.parametrize("check", ["fd", "autograd"])
def test_under_rope_the_key_bias_is_checked_not_claimed_zero(check):
    qwen2 = {**LLAMA_DEMO, "position_encoding": "rope", "qkv_bias": True}
    model, x, y = demo_like(**qwen2)
    assert not key_bias_vanishes(model.config)
    loss, lines, oracle_loss = check_model_gradients(model, x, y, check)
    text, ok = gradients_text(loss, lines, 20, check, oracle_loss=oracle_loss)
    rows = k_bias_lines(text)
    assert len(rows) == 2 and all("(RoPE: ≢ 0)" in r for r in rows)
    assert "≡ 0, §3" not in text and "NOT ZERO" not in text
    assert ok and "0 gradients fail the check -> OK" in text and text.endswith(KEY_BIAS_ROPE_NOTE)
    grads = model.backward()
    for i in range(2):                             # a real gradient, far above rounding
        g, gq = (np.max(np.abs(grads[f"blocks.{i}.attn.{n}.bias"])) for n in ("k", "q"))
        assert g > 1e-3 * gq, (i, g, gq)
    if check == "autograd":                        # the printed difference is within the bound
        cfg = {k: getattr(model.config, k) for k in ("vocab_size", "context_length", "d_model", "n_heads",
               "n_blocks", "d_head", "d_qk", "mlp_ratio", "activation", "ln_eps", "bias", "tie_weights", "causal",
               "qkv_bias", "d_mlp", "position_encoding", "rope_base", "rope_fraction", "norm", "mlp", "n_kv_heads")}
        cfg["rope_scaling"] = model.config.rope_scaling.to_hf()
        truth = reference_loss_and_grads(model.state_dict(), cfg, x, y)[2]
        for i, r in zip((1, 0), rows):             # block 1's line comes first
            expected = truth[f"blocks.{i}.attn.k.bias"]
            assert float(r.split()[-1]) <= AUTOGRAD_RTOL * np.max(np.abs(expected)), r
    else:                                          # a relative error from finite differences
        assert all(float(r.split()[-1]) < 1e-4 for r in rows), rows


@pytest.mark.parametrize("position_encoding", ["learned", "none"])
def test_without_rope_the_rule_is_stated_and_verified(position_encoding):
    model, x, y = demo_like(position_encoding)
    assert key_bias_vanishes(model.config)
    loss, lines, _ = check_model_gradients(model, x, y, "fd")
    text, ok = gradients_text(loss, lines, 20, "fd")
    rows = k_bias_lines(text)
    assert ok and len(rows) == 2
    assert all(r.startswith("∂L/∂b_k (≡ 0, §3)") and r.split()[-1] == "rounding" for r in rows), rows
    assert KEY_BIAS_ROPE_NOTE not in text


def demo_out(*args) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["demo", "--kernels", "reference", *args]) == 0
    return buf.getvalue()


def test_rms_norm_weights_carry_rms_names():
    out = demo_out("--arch", "llama")
    labels = [r[:37].split()[0] for r in out.splitlines() if r.startswith("∂L/∂w_")]
    assert sorted(labels) == ["∂L/∂w_RMS1"] * 2 + ["∂L/∂w_RMS2"] * 2 + ["∂L/∂w_RMSfinal"]
    assert "LN" not in out.split("gradient", 1)[1]


def test_layer_norm_weights_keep_their_names():
    out = demo_out()
    labels = {r[:37].split()[0] for r in out.splitlines() if r.startswith("∂L/∂w_") or r.startswith("∂L/∂b_LN")}
    assert labels == {"∂L/∂w_LN1", "∂L/∂w_LN2", "∂L/∂w_LNfinal", "∂L/∂b_LN1", "∂L/∂b_LN2", "∂L/∂b_LNfinal"}
    assert "RMS" not in out

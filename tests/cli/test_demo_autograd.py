"""``pedestrian demo --check autograd``: the paper's verification printout, one line per tensor.

The command runs the suite's own oracle, ``tests/oracles/torch_reference.py`` (an independent
PyTorch model that imports nothing from pedestrian; the library runs no autograd). Checked here:

- the set of tensors printed is complete: every parameter of the oracle's model, every error
  signal Δ1 … Δ12 and each block's Δcausal, each exactly once;
- every line passes, and the size it prints is the oracle's (2 significant digits);
- the demo model's own tensors (the ones the lines describe) agree with the oracle to 1e-9, the
  project's autograd bound -- Δcausal against autograd of the oracle's heads, from its a2 and Δ3;
- a wrong backward (layer-norm weight gradient off by 0.1 %) fails exactly its lines;
- outside a source checkout (no oracle) the command says so in one error line.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cli_helpers import break_layernorm_backward, one_line_error
from pedestrian.cli import main
from pedestrian.paper.demo import demo_model
from pedestrian.paper import gradients
from pedestrian.paper.gradients import RMS_SYMBOLS, SWIGLU_SYMBOLS, SYMBOLS
from torch_reference import delta_names, param_shapes, reference_forward, reference_loss_and_grads

RTOL = 1e-9
SYMBOL_TO_PARAM = {v: k for table in (SYMBOLS, SWIGLU_SYMBOLS, RMS_SYMBOLS)   # GPT-2's, SwiGLU's, RMS norm's
                   for k, v in table.items()}


def lines_of(out: str) -> list[str]:
    body = out.split("autograd\n", 1)[1].split("\n\n", 1)[0]
    return body.splitlines()


def key_of(line: str) -> str:
    """The tensor a printed line is about, in the oracle's names (``blocks.{i}.Δ3``, ``tok_emb.weight``)."""
    label = line[:37]
    block = f"blocks.{label.split('block ')[1].split()[0]}." if "block " in label else ""
    name = label.split()[0]
    if name.startswith("Δcausal"):
        return block + "Δcausal"
    if name.startswith("Δ"):
        return block + name
    return block + SYMBOL_TO_PARAM[name.removeprefix("∂L/∂")]


def oracle_cfg(config) -> dict:
    return dict(vocab_size=config.vocab_size, context_length=config.context_length, d_model=config.d_model,
                n_heads=config.n_heads, n_blocks=config.n_blocks, d_head=config.d_head, d_qk=config.d_qk,
                mlp_ratio=config.mlp_ratio, activation=config.activation, ln_eps=config.ln_eps, bias=config.bias,
                tie_weights=config.tie_weights, causal=config.causal, qkv_bias=config.qkv_bias,
                d_mlp=config.d_mlp, position_encoding=config.position_encoding, rope_base=config.rope_base,
                rope_fraction=config.rope_fraction)


def oracle_delta_causal(params: dict, cfg: dict, x, d3: dict) -> dict:
    """Each block's Δcausal = ∂L/∂ρ_causal by autograd: the oracle's a2 (its forward), the block's
    heads rebuilt in torch with the masked scores kept, and the oracle's Δ3 sent back through them."""
    P = {k: torch.tensor(v, dtype=torch.float64) for k, v in params.items()}
    _, acts = reference_forward(P, cfg, x, return_activations=True)
    H, dqk, dh = cfg["n_heads"], cfg["d_qk"], cfg["d_head"]
    out = {}
    for i in range(cfg["n_blocks"]):
        p = f"blocks.{i}"
        a2 = acts[f"{p}.a2"].detach()
        B, T, _ = a2.shape
        split = lambda t, w: t.reshape(B, T, H, w).transpose(1, 2)           # noqa: E731
        q = split(a2 @ P[f"{p}.attn.q.weight"] + P[f"{p}.attn.q.bias"], dqk)
        k = split(a2 @ P[f"{p}.attn.k.weight"] + P[f"{p}.attn.k.bias"], dqk)
        v = split(a2 @ P[f"{p}.attn.v.weight"] + P[f"{p}.attn.v.bias"], dh)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(dqk)).detach().requires_grad_(True)
        future = torch.arange(T)[None, :] > torch.arange(T)[:, None]
        causal = scores.masked_fill(future, float("-inf"))
        causal.retain_grad()
        a3 = (torch.softmax(causal, dim=-1) @ v).transpose(1, 2).reshape(B, T, H * dh)
        a3.backward(torch.tensor(d3[f"{p}.Δ3"]))
        out[f"{p}.Δcausal"] = causal.grad.numpy()
    return out


@pytest.fixture(scope="module")
def printed():
    """``(exit status, stdout)`` of ``pedestrian demo --check autograd`` (seed 0, fast kernels)."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        status = main(["demo", "--check", "autograd", "--kernels", "fast"])
    return status, buf.getvalue()


@pytest.fixture(scope="module")
def oracle():
    """The demo's model and batch, its own backward, and the oracle's loss, gradients and Δ's."""
    model, x, y, _, _ = demo_model(None, 0, "fast")
    model.fused_head = False                       # as the demo runs it: Δ12 kept whole (model/head.py)
    model.loss(x, y)
    grads = {k: np.array(v) for k, v in model.backward(keep_deltas=True).items()}
    deltas = {k: np.array(v) for k, v in model.deltas().items()}
    cfg = oracle_cfg(model.config)
    params = model.state_dict()
    loss, _, o_grads, o_deltas = reference_loss_and_grads(params, cfg, x, y)
    o_deltas.update(oracle_delta_causal(params, cfg, x, o_deltas))
    return dict(model=model, cfg=cfg, ours={**grads, **deltas}, truth={**o_grads, **o_deltas}, loss=loss)


def test_every_tensor_once_and_every_line_passes(printed, oracle):
    status, out = printed
    assert status == 0 and "0 gradients fail the check -> OK" in out
    rows = lines_of(out)
    keys = [key_of(r) for r in rows]
    cfg = oracle["cfg"]
    expected = (set(param_shapes(cfg)) | set(delta_names(cfg))
                | {f"blocks.{i}.Δcausal" for i in range(cfg["n_blocks"])})
    assert len(keys) == len(set(keys)), "a tensor printed twice"
    assert set(keys) == expected
    assert sum(k.endswith("Δcausal") for k in keys) == cfg["n_blocks"]
    assert not any(r.endswith("<- FAILED") for r in rows)
    for r in rows:
        diff = float(r.split()[-1])                     # max |ours − autograd|, printed
        truth = oracle["truth"][key_of(r)]
        if key_of(r).endswith("attn.k.bias"):           # ≡ 0: both sides are rounding noise
            assert diff <= 1e-15, r
            continue
        assert diff <= RTOL * np.max(np.abs(truth)), r
        size = float(r[51:61])                          # max |·|, 2 significant digits
        assert size == pytest.approx(np.max(np.abs(truth)), rel=0.06), r


def test_the_lines_describe_tensors_equal_to_the_oracle(oracle):
    for key, truth in oracle["truth"].items():
        ours = oracle["ours"][key]
        assert ours.shape == truth.shape, key
        if key.endswith("attn.k.bias"):
            assert np.max(np.abs(ours)) <= 1e-15 and np.max(np.abs(truth)) <= 1e-15, key
            continue
        err = np.max(np.abs(ours - truth)) / np.max(np.abs(truth))
        assert err <= RTOL, f"{key}: {err:.1e}"


def test_a_wrong_gradient_fails_its_lines(monkeypatch, capsys):
    break_layernorm_backward(monkeypatch)
    assert main(["demo", "--check", "autograd", "--kernels", "fast"]) == 1
    out = capsys.readouterr().out
    failing = [r for r in lines_of(out) if r.endswith("<- FAILED")]
    assert sorted(key_of(r) for r in failing) == sorted(
        k for k in param_shapes(demo_cfg()) if k.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")))
    assert "5 gradients fail the check -> FAILED" in out


def demo_cfg() -> dict:
    model, *_ = demo_model(None, 0, "fast")
    return oracle_cfg(model.config)


def test_without_the_oracle_one_error_line(monkeypatch, tmp_path, capsys):
    """An installed package has no tests/oracles/: one error line, status 2, nothing printed."""
    monkeypatch.setattr(gradients, "ORACLE", tmp_path / "torch_reference.py")
    assert main(["demo", "--check", "autograd"]) == 2
    assert "only a source checkout has" in one_line_error(capsys)

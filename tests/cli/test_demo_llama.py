"""``pedestrian demo --arch llama``: every gradient of a Llama-style model (RMS norm, SwiGLU,
grouped-query attention 4:2, RoPE with Llama 3's frequency scaling, no biases, tied logits)
checked by finite differences and against the suite's autograd oracle
(``tests/oracles/torch_reference.py``, which states those layers on its own in plain torch).

- every tensor is printed once (the oracle's parameters, Δ1 … Δ12 with Δ7_gate and Δ7_up in place
  of Δ7, each block's Δcausal) and every line passes, with fd and with autograd;
- the oracle sees what makes the model Llama-style: dropping its RoPE scaling or its key/value
  head sharing changes its loss far beyond the autograd bound, so a line cannot pass by accident;
- a wrong RMS-norm backward (weight gradient off by 0.1 %) fails exactly its five lines.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

from pedestrian.cli import main
from pedestrian.paper.demo import demo_model
from cli_helpers import break_norm_backward
from test_demo_autograd import key_of
from torch_reference import delta_names, param_shapes, reference_loss_and_grads



def run(*args) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        status = main(["demo", "--arch", "llama", *args])
    return status, buf.getvalue()


def lines_of(out: str, column: str) -> list[str]:
    return out.split(column + "\n", 1)[1].split("\n\n", 1)[0].splitlines()


def oracle_cfg(config) -> dict:
    cfg = {k: getattr(config, k) for k in ("vocab_size", "context_length", "d_model", "n_heads", "n_blocks",
                                           "d_head", "d_qk", "mlp_ratio", "activation", "ln_eps", "bias",
                                           "tie_weights", "causal", "qkv_bias", "d_mlp", "position_encoding",
                                           "rope_base", "rope_fraction", "norm", "mlp", "n_kv_heads")}
    cfg["rope_scaling"] = config.rope_scaling.to_hf()
    return cfg


@pytest.fixture(scope="module")
def llama():
    model, x, y, _, _ = demo_model(None, 0, "fast", arch="llama")
    return model, x, y, oracle_cfg(model.config)


def expected_keys(cfg) -> set:
    return (set(param_shapes(cfg)) | set(delta_names(cfg))
            | {f"blocks.{i}.Δcausal" for i in range(cfg["n_blocks"])})


def test_the_demo_model_is_llama_style(llama):
    c = llama[0].config
    assert (c.norm, c.mlp, c.activation, c.position_encoding, c.bias, c.tie_weights) == \
        ("rmsnorm", "swiglu", "silu", "rope", False, True)
    assert (c.n_heads, c.n_kv_heads) == (4, 2) and c.rope_scaling is not None


@pytest.mark.parametrize("check", ["fd", "autograd"])
def test_every_tensor_once_and_every_line_passes(llama, check):
    status, out = run("--check", check, "--kernels", "fast")
    assert status == 0 and "0 gradients fail the check -> OK" in out
    rows = lines_of(out, "autograd" if check == "autograd" else "check")
    keys = [key_of(r) for r in rows]
    cfg = llama[3]
    assert len(keys) == len(set(keys)), "a tensor printed twice"
    assert set(keys) == expected_keys(cfg)
    assert {"blocks.0.Δ7_gate", "blocks.0.Δ7_up", "blocks.1.mlp_gate.weight"} <= set(keys)
    assert not any(k.endswith(".Δ7") for k in keys)
    assert not any(r.endswith("<- FAILED") for r in rows)
    columns = [r.split()[-1] for r in rows]
    if check == "autograd":                        # max |ours − autograd| <= 1e-9 · max |autograd|
        assert all(float(v) <= 1e-9 * float(r[51:61]) * 1.06 for v, r in zip(columns, rows))
    else:                                          # every parameter has a relative error printed
        params = [v for v, k in zip(columns, keys) if "Δ" not in k]
        assert params and all(float(v) < 1e-6 for v in params)


def test_the_reference_kernels_pass_too():
    status, out = run("--check", "autograd", "--kernels", "reference")
    assert status == 0 and "0 gradients fail the check -> OK" in out


@pytest.mark.parametrize("change", [dict(rope_scaling=None), dict(n_kv_heads=None)])
def test_the_oracle_sees_the_llama_layers(llama, change):
    """Without the frequency scaling, or with k and v read per query head (their shapes kept by
    widening nothing: n_kv_heads=None needs 4 key heads, so the oracle refuses the parameters),
    the oracle is another model: its loss moves, or it says the parameters do not fit."""
    model, x, y, cfg = llama
    params = model.state_dict()
    loss = float(model.loss(x, y))
    same = reference_loss_and_grads(params, cfg, x, y)[0]
    assert abs(same - loss) <= 1e-12 * abs(loss)
    if "n_kv_heads" in change:
        with pytest.raises(ValueError, match="parameter shapes mismatch"):
            reference_loss_and_grads(params, {**cfg, **change}, x, y)
        return
    other = reference_loss_and_grads(params, {**cfg, **change}, x, y)[0]
    assert abs(other - loss) > 1e-6 * abs(loss)


def test_a_wrong_rmsnorm_backward_fails_its_lines(monkeypatch, llama):
    break_norm_backward(monkeypatch, "rmsnorm")
    status, out = run("--check", "autograd", "--kernels", "fast")
    assert status == 1
    failing = sorted(key_of(r) for r in lines_of(out, "autograd") if r.endswith("<- FAILED"))
    assert failing == sorted(k for k in param_shapes(llama[3])
                             if k.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")))
    assert "5 gradients fail the check -> FAILED" in out


def test_arch_belongs_to_the_whole_model_check(capsys):
    assert main(["demo", "--head", "--arch", "llama"]) == 2
    assert "--arch belongs to the whole-model check" in capsys.readouterr().err

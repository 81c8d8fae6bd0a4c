"""``pedestrian demo``: every gradient on one line in the paper's notation, with its check
(finite differences here; ``--check autograd``: tests/cli/test_demo_autograd.py), for the kernels chosen by ``--kernels``."""

from __future__ import annotations


import pytest

from cli_helpers import break_layernorm_backward
from pedestrian.cli import main


def lines_of(out: str) -> list[str]:
    """The gradient lines: between the column header and the summary."""
    body = out.split("check\n", 1)[1].split("\n\n", 1)[0]
    return body.splitlines()


@pytest.mark.parametrize("kernels", ["fast", "reference"])
def test_demo_checks_every_gradient(kernels, capsys):
    assert main(["demo", "--kernels", kernels]) == 0
    out = capsys.readouterr().out
    assert f"kernels: {kernels}" in out and "central finite differences" in out
    assert "the bundled Shakespeare" in out                 # real text
    rows = lines_of(out)
    labels = [r[:37].strip() for r in rows]
    # one line per gradient, in backward order, named as the paper names them
    assert labels[0] == "Δ12 = ∂L/∂a12           (logits)"
    assert labels[-3:] == ["Δ1 = ∂L/∂a1", "∂L/∂W_tok  (embedding + tied logits)", "∂L/∂W_pos"]
    for block in (0, 1):
        for name in ("∂L/∂W_q", "∂L/∂b_q", "∂L/∂W_k", "∂L/∂W_v", "∂L/∂b_v", "∂L/∂W_attProj",
                     "∂L/∂w_LN1", "∂L/∂W_expand", "∂L/∂W_contract", "Δcausal = ∂L/∂S",
                     "Δ10 = ∂L/∂a10", "Δ2 = ∂L/∂a2"):
            assert sum(1 for lab in labels if lab.startswith(name) and lab.endswith(f"block {block}")) == 1, \
                (name, block)
        k_bias = [r for r in rows if r.startswith("∂L/∂b_k (≡ 0, §3)") and f"block {block}" in r]
        assert len(k_bias) == 1 and k_bias[0].split()[-1] == "rounding"
    assert len(rows) == 2 * (10 + 16) + 7          # per block: Δ10…Δ2, Δcausal and 16 parameters
    assert not any(r.endswith("<- FAILED") for r in rows)
    assert "0 gradients fail the check -> OK" in out


def test_demo_with_finite_differences(capsys):
    assert main(["demo", "--check", "fd", "--entries", "2", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "central finite differences, h = 1e-05, 2 entries per parameter" in out
    rows = lines_of(out)
    deltas = [r for r in rows if r.startswith("Δ")]
    assert deltas and all(r.split()[-1] == "-" for r in deltas)   # Δ's are no parameters
    params = [r for r in rows if r.startswith("∂L/∂") and "b_k" not in r]
    # the pass rule is |numeric − analytic| <= 1e-8 + 1e-6·|numeric| per entry (central
    # differences with h = 1e-5 are good to ~1e-10 absolute: h²·|L'''|/6 + ε·|L|/h); the column,
    # a relative error, may pass 1e-6 on an entry near 1e-8 on some CPUs and the entry still pass
    assert params and not any(r.endswith("<- FAILED") for r in rows)
    assert all(r.split()[-1] == "-" or float(r.split()[-1]) < 1e-2 for r in params)   # 1e-10 / 1e-8
    assert "-> OK" in out


def test_demo_fails_on_a_wrong_gradient(capsys, monkeypatch):
    """A layer-norm backward off by 0.1 %: the demo names the gradients it breaks and exits 1."""
    break_layernorm_backward(monkeypatch)
    assert main(["demo", "--kernels", "fast"]) == 1
    out = capsys.readouterr().out
    assert "-> FAILED" in out
    rows = lines_of(out)
    failing = [r for r in rows if r.endswith("<- FAILED")]     # the demo's own verdict per line
    assert failing and all(r.startswith(("∂L/∂w_LN", "∂L/∂w_LNfinal")) for r in failing), failing
    # every layer-norm weight is caught: 0.1 % is 1e-3 relative, far above the finite differences' bound
    assert len(failing) == len([r for r in rows if r.startswith("∂L/∂w_LN")]) == 5


def test_demo_runs_without_pytorch(capsys, monkeypatch):
    """The demo needs no PyTorch (the library runs no autograd); ``--check autograd``, the one
    mode that does, is one error line that names it and says how to install it."""
    import builtins

    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("No module named 'torch'", name="torch")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    assert main(["demo", "--entries", "1"]) == 0
    assert "central finite differences" in capsys.readouterr().out
    assert main(["demo", "--check", "autograd"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--check" in err[0], err
    assert 'pip install -e ".[torch]"' in err[0] and not captured.out        # nothing ran
    for mode in ("--head", "--mask"):                                      # NumPy only
        assert main(["demo", mode]) == 0

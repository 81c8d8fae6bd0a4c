"""``pedestrian demo --head`` and ``--mask`` (paper section 3, Table 1): one attention head on numbers.

The oracle is PyTorch autograd, float64, rebuilt from nothing but what the command prints: the
JSON's inputs (x, the six parameters, the upstream Δ) go into a plain torch head (causal −∞ mask,
scale 1/√d_ρ) and every printed matrix is compared with autograd's, to 1e-10 (the entries are
O(1); the two sides differ by rounding, ~1e-16). The three input branches come from three
separate copies of x, so autograd itself splits Δ_{i-1}^h into them. ``--mask`` is checked the
same way against a torch head with the paper's literal 0/1 Hadamard mask.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from cli_helpers import one_line_error
from pedestrian.cli import main

TOL = 1e-10

KEYS = ("x w_q b_q w_k b_k w_v b_v delta q k v rho_raw rho_scaled rho_causal rho a delta_v delta_rho "
        "delta_causal delta_raw delta_q delta_k delta_in_q delta_in_k delta_in_v delta_in dw_q db_q "
        "dw_k db_k dw_v db_v").split()


def run_json(capsys, *argv) -> dict:
    assert main(["demo", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def as_array(value) -> np.ndarray:
    """JSON nested lists -> float64 array, ``null`` (a masked score) -> ``-inf``."""
    a = np.array(value, dtype=object)
    return np.where(a == None, -math.inf, a).astype(np.float64)   # noqa: E711 (elementwise)


def torch_head(printed: dict, causal: bool, mask: str = "neg_inf") -> dict:
    """The head in torch from the printed inputs, every intermediate ``retain_grad``-ed; autograd
    of ``Σ a ∘ Δ`` (so the error signal at ``a`` is the printed upstream ``Δ``)."""
    t = {k: torch.tensor(np.asarray(printed[k], dtype=np.float64), requires_grad=True)
         for k in ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v")}
    xs = {b: torch.tensor(np.asarray(printed["x"], dtype=np.float64), requires_grad=True) for b in "qkv"}
    delta = torch.tensor(np.asarray(printed["delta"], dtype=np.float64))
    q = xs["q"] @ t["w_q"] + t["b_q"]
    k = xs["k"] @ t["w_k"] + t["b_k"]
    v = xs["v"] @ t["w_v"] + t["b_v"]
    raw = q @ k.T
    scaled = raw / math.sqrt(q.shape[1])
    T = q.shape[0]
    future = torch.arange(T)[None, :] > torch.arange(T)[:, None]
    if not causal:
        causal_ = scaled * 1.0
    elif mask == "neg_inf":
        causal_ = scaled.masked_fill(future, float("-inf"))
    else:                                                          # the paper, literally: m ∘ S
        causal_ = (~future).to(scaled.dtype) * scaled
    rho = torch.softmax(causal_, dim=-1)
    a = rho @ v
    for n in (q, k, v, raw, scaled, causal_, rho):
        n.retain_grad()
    a.backward(delta)
    g = lambda n: n.grad.detach().numpy()                          # noqa: E731
    out = dict(q=q, k=k, v=v, rho_raw=raw, rho_scaled=scaled, rho_causal=causal_, rho=rho, a=a)
    out = {key: val.detach().numpy() for key, val in out.items()}
    out.update(delta_v=g(v), delta_rho=g(rho), delta_causal=g(causal_), delta_scaled=g(scaled),
               delta_raw=g(raw), delta_q=g(q), delta_k=g(k),
               delta_in_q=g(xs["q"]), delta_in_k=g(xs["k"]), delta_in_v=g(xs["v"]),
               delta_in=g(xs["q"]) + g(xs["k"]) + g(xs["v"]))
    out.update({"d" + key: g(val) for key, val in t.items()})
    return out


def assert_close(ours, theirs, name):
    ours, theirs = as_array(ours), np.asarray(theirs, dtype=np.float64)
    assert ours.shape == theirs.shape, (name, ours.shape, theirs.shape)
    assert np.array_equal(np.isneginf(ours), np.isneginf(theirs)), name   # the same entries masked
    finite = np.isfinite(theirs)
    err = float(np.max(np.abs(ours[finite] - theirs[finite]), initial=0.0))
    assert err <= TOL, f"{name}: {err:.2e} from autograd"


@pytest.mark.parametrize("argv,causal", [
    ([], True),
    (["--T", "5", "--d", "4", "--d-rho", "3", "--d-h", "2", "--seed", "7"], True),
    (["--T", "3", "--d", "2", "--d-rho", "1", "--d-h", "4", "--seed", "2", "--no-causal"], False),
    (["--T", "1", "--seed", "5"], True),
])
def test_head_json_is_autograd_of_its_own_inputs(argv, causal, capsys):
    printed = run_json(capsys, "--head", *argv)
    assert list(printed) == KEYS                                   # exactly these keys, in order
    T, d = np.asarray(printed["x"]).shape
    want = dict(T=4, d=3, d_rho=2, d_h=2)
    for flag, name in (("--T", "T"), ("--d", "d"), ("--d-rho", "d_rho"), ("--d-h", "d_h")):
        if flag in argv:
            want[name] = int(argv[argv.index(flag) + 1])
    assert (T, d) == (want["T"], want["d"])
    assert np.asarray(printed["w_q"]).shape == (d, want["d_rho"]) and np.asarray(printed["w_v"]).shape == (d, want["d_h"])
    oracle = torch_head(printed, causal)
    for key in KEYS[8:]:
        assert_close(printed[key], oracle[key], key)
    masked = [v is None for row in printed["rho_causal"] for v in row]
    assert sum(masked) == (T * (T - 1) // 2 if causal else 0)    # null exactly above the diagonal
    # what the paper proves, on these numbers
    assert np.max(np.abs(np.sum(printed["delta_causal"], axis=1))) <= 1e-12
    assert np.max(np.abs(printed["db_k"])) <= 1e-12


def matrices_in(text: str) -> dict:
    """``label -> array`` of every printed block: a header line ``LABEL  (shape) ...`` and its rows."""
    out, lines = {}, text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\S.*?)  \(([\d × ]+)\)", line)
        if not m or i + 1 >= len(lines) or not lines[i + 1].startswith("    ["):
            continue
        rows = []
        for row in lines[i + 1:]:
            if not row.startswith("    ["):
                break
            rows.append([-math.inf if s == "−∞" else float(s) for s in row.strip("[] ").split()])
        shape = tuple(int(n) for n in m.group(2).split(" × "))
        out[m.group(1)] = np.array(rows).reshape(shape)
    return out


def test_head_text_shows_every_matrix_with_name_and_shape(capsys):
    printed = run_json(capsys, "--head", "--seed", "3")
    assert main(["demo", "--head", "--seed", "3"]) == 0
    text = capsys.readouterr().out
    shown = matrices_in(text)
    labels = {"x": "x = a_{i-1}", "delta": "Δ = Δ_i^h", "rho_raw": "ρ_raw", "rho_scaled": "ρ_scaled",
              "rho_causal": "ρ_causal", "rho": "ρ", "a": "a_i^h", "delta_v": "Δv", "delta_rho": "Δρ",
              "delta_causal": "Δcausal", "delta_raw": "Δraw", "delta_q": "Δq", "delta_k": "Δk",
              "delta_in_q": "Δq w_qᵀ", "delta_in_k": "Δk w_kᵀ", "delta_in_v": "Δv w_vᵀ",
              "delta_in": "Δ_{i-1}^h"}
    labels.update({k: k for k in ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "q", "k", "v")})
    labels.update({f"d{p}": f"∂L/∂{p}" for p in ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v")})
    assert set(labels) == set(KEYS)
    for key, label in labels.items():
        assert label in shown, label
        value = as_array(printed[key])
        assert shown[label].shape == value.shape, label
        assert np.array_equal(np.isneginf(shown[label]), np.isneginf(value)), label
        finite = np.isfinite(value)
        # 4 decimals (∂L/∂b_k: 2 significant digits of a rounding-size number)
        assert np.max(np.abs(shown[label][finite] - value[finite]), initial=0) <= 5.1e-5, label
    sums = text.split("row sums of Δcausal")[1].splitlines()[1]
    assert all(abs(float(s)) <= 1e-12 for s in sums.strip("[] ").split())
    assert "agree to" in text and "(<= 1e-12)" in text


def test_mask_numbers_are_autograd_of_both_masks(capsys):
    """--mask against torch: the paper's literal m ∘ ρ_scaled and the −∞ mask, on the inputs
    --head prints for the same seed."""
    printed = run_json(capsys, "--head", "--seed", "4", "--T", "5")
    cmp = run_json(capsys, "--mask", "--seed", "4", "--T", "5")
    assert set(cmp) == {"mask", "rho_scaled", "delta_rho", "hadamard", "neg_inf"}
    T = 5
    assert np.array_equal(cmp["mask"], np.tril(np.ones((T, T))))
    for name in ("hadamard", "neg_inf"):
        oracle = torch_head(printed, True, mask=name)
        got = cmp[name]
        for key in ("rho_causal", "rho", "a", "delta_causal", "delta_scaled"):
            assert_close(got[key], oracle[key], f"{name}.{key}")
        future = np.sum(oracle["rho"] * np.triu(np.ones((T, T)), 1), axis=1)
        assert np.max(np.abs(np.asarray(got["future_weight"]) - future)) <= TOL
        gap = float(np.max(np.abs(oracle["delta_scaled"] - oracle["delta_causal"])))
        assert abs(got["max_scaled_minus_causal"] - gap) <= TOL
    # the −∞ mask: no weight on the future, Δscaled = Δcausal exactly; the 0/1 mask: neither
    assert max(cmp["neg_inf"]["future_weight"]) == 0.0 and cmp["neg_inf"]["max_scaled_minus_causal"] == 0.0
    assert min(cmp["hadamard"]["future_weight"][:-1]) > 0.0         # every query but the last leaks
    assert cmp["hadamard"]["max_scaled_minus_causal"] > 1e-3


def test_mask_text_states_the_result(capsys):
    cmp = run_json(capsys, "--mask")
    assert main(["demo", "--mask"]) == 0
    text = capsys.readouterr().out
    assert "holds with −∞ only: as stated" in text
    table = text.split("Σ_{β>α} ρ_αβ:")[1].splitlines()[2:6]
    for alpha, line in enumerate(table):
        a, had, inf = line.split()
        assert int(a) == alpha
        assert abs(float(had) - cmp["hadamard"]["future_weight"][alpha]) <= 5e-5
        assert float(inf) == 0.0


@pytest.mark.parametrize("argv,fragment", [
    (["--head", "--T", "0"], "--T must be a positive integer"),
    (["--head", "--d", "-2"], "--d must be a positive integer"),
    (["--mask", "--d-rho", "0"], "--d-rho must be a positive integer"),
    (["--head", "--mask"], "cannot be combined"),
    (["--head", "--properties"], "cannot be combined"),
    (["--head", "--check", "autograd"], "--check belongs to the whole-model check"),
    (["--mask", "--entries", "3"], "--entries belongs to the whole-model check"),
    (["--mask", "--no-causal"], "--no-causal"),
    (["--json"], "--json belongs to --head / --mask"),
    (["--T", "3"], "--T belongs to --head / --mask"),
    (["--check", "autograd", "--step", "1e-6"], "--check autograd takes none of them"),
])
def test_bad_flags_are_one_error_line(argv, fragment, capsys):
    assert main(["demo", *argv]) == 2
    assert fragment in one_line_error(capsys)


def test_head_example_uses_the_library_layers():
    """The worked example, computed step by step, equals the one-call reference layer
    (layers/attention.py) on a larger example; bad shapes are named."""
    from pedestrian.paper import walkthrough
    from pedestrian.layers import attention_head_backward, attention_head_forward

    ex = walkthrough.head_example(T=6, d=4, d_rho=3, d_h=5, seed=11)
    out, cache = attention_head_forward(ex["x"][None], *(ex[k] for k in walkthrough.HEAD_INPUTS[1:-1]))
    delta_in, grads, delta_causal = attention_head_backward(ex["delta"][None], cache)
    assert np.allclose(out[0], ex["a"], rtol=0, atol=1e-14)
    assert np.allclose(delta_in[0], ex["delta_in"], rtol=0, atol=1e-14)
    assert np.allclose(delta_causal[0], ex["delta_causal"], rtol=0, atol=1e-14)
    assert np.allclose(grads["wq"], ex["dw_q"], rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="w_k must have shape"):
        walkthrough.head_example({**ex, "w_k": np.zeros((2, 2))})

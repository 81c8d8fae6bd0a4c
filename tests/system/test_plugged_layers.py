"""Layers you plug in (issue 34, item 3): a NumPy module in the GPT's norm, activation or MLP slot
runs in the chain and in its backward, has named parameters in the flat buffers, trains, is
checkpointed with its source and resumes bit for bit; a broken one is stopped before the first
step, and every bad input is one line that names the fix."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

import pedestrian
from pedestrian import GPT, GPTConfig
from pedestrian.checkpoint import load_checkpoint
from pedestrian.cli import main
from pedestrian.model.slots import LayerError
from pedestrian.training import TrainSettings, read_log, train
from pedestrian.training.files import gradient_record
from pedestrian.training.step import TrainingError

from cli_helpers import write_fox_corpus
from gradcheck import EPS64, H_STEP, numerical_grad, token_batch

REPO = Path(__file__).resolve().parents[2]
DYT = REPO / "docs" / "examples" / "dyt.py"
TINY = dict(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_blocks=2)

#: layer norm again, in plain NumPy (paper section 5): the norm slot with the built-in's names
LAYERNORM = '''
import numpy as np

SLOT = "norm"
EPS = 1e-5
SEEN = []                                   # the dtypes the model fed it


def init(d_model, d_mlp):
    return {"weight": np.ones(d_model), "bias": np.zeros(d_model)}


def forward(inputs, params):
    x = inputs["x"]
    SEEN.append((x.dtype, params["weight"].dtype))
    xc = x - x.mean(axis=-1, keepdims=True)
    r = 1 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + EPS)
    xhat = xc * r
    return xhat * params["weight"] + params["bias"], (xhat, r, params["weight"])


def backward(delta, cache):
    xhat, r, w = cache
    d = xhat.shape[-1]
    g = delta * w
    dx = r * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return {"x": dx}, {"weight": (delta * xhat).reshape(-1, d).sum(0), "bias": delta.reshape(-1, d).sum(0)}
'''

#: ReLU in the activation slot, and the whole MLP (expand, ReLU, contract) in the mlp slot
RELU = '''
import numpy as np

def init(d_model, d_mlp):
    return {}

def forward(inputs, params):
    x = inputs["x"]
    return x * (x > 0), x > 0

def backward(delta, cache):
    return {"x": delta * cache}, {}
'''
MLP = '''
import numpy as np

def init(d_model, d_mlp):
    rng = np.random.default_rng(0)
    return {"W1": 0.02 * rng.standard_normal((d_model, d_mlp)), "b1": np.zeros(d_mlp),
            "W2": 0.02 * rng.standard_normal((d_mlp, d_model)), "b2": np.zeros(d_model)}

def forward(inputs, params):
    x = inputs["x"]
    h = x @ params["W1"] + params["b1"]
    a = h * (h > 0)
    return a @ params["W2"] + params["b2"], (x, h, a, params["W1"], params["W2"])

def backward(delta, cache):
    x, h, a, W1, W2 = cache
    d_h = (delta @ W2.T) * (h > 0)
    flat = lambda t: t.reshape(-1, t.shape[-1])
    return {"x": d_h @ W1.T}, {"W1": flat(x).T @ flat(d_h), "b1": flat(d_h).sum(0),
                               "W2": flat(a).T @ flat(delta), "b2": flat(delta).sum(0)}
'''


def _module(tmp_path, name, text, **replace):
    for old, new in replace.items():
        text = text.replace(old, new)
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def _grads(model, x, y):
    loss = model.loss(x, y)
    return loss, {k: np.array(v) for k, v in model.backward().items()}


# ---------------------------------------------------------------------------------------- the chain
def test_numpy_layernorm_in_the_norm_slot_equals_the_builtin(tmp_path):
    """A NumPy re-implementation of layer norm plugged into the norm slot gives the built-in
    model's loss and gradients: same parameter names, same initial values, the same numbers up to
    the order of the sums. Float64: each norm's output differs by a few ε·d (d = 12 terms summed in
    another order) relative; the loss and gradients of this 2-block model carry that with O(1..10)
    gains, so 1e-11 relative leaves a margin of ~10^3 over 2·12·ε·10 ≈ 5e-14."""
    ln = pedestrian.load_layer(_module(tmp_path, "ln", LAYERNORM))
    cfg = GPTConfig(**TINY, ln_eps=1e-5)
    x, y = token_batch(TINY, 2, 8, seed=1, n_ignored=2)
    for kernels in ("reference", "fast"):
        built_in = GPT(cfg, seed=3, dtype="float64", kernels=kernels)
        plugged = GPT(cfg, seed=3, dtype="float64", kernels=kernels, layers={"norm": ln})
        assert list(plugged.params) == list(built_in.params)
        for k, v in built_in.params.items():
            np.testing.assert_array_equal(plugged.params[k], v)
        (l0, g0), (l1, g1) = _grads(built_in, x, y), _grads(plugged, x, y)
        assert abs(l1 - l0) <= 1e-11 * abs(l0)
        for k in g0:
            if k.endswith("attn.k.bias"):                  # ≡ 0 (paper §3): both hold rounding noise ~1e-21
                continue
            scale = np.max(np.abs(g0[k]))
            assert np.max(np.abs(g1[k] - g0[k])) <= 1e-11 * scale, k
    # a float32 model hands the layer float32 arrays
    ln.SEEN.clear()
    GPT(cfg, kernels="reference", layers={"norm": ln}).loss(x, y)
    assert set(ln.SEEN) == {(np.dtype(np.float32), np.dtype(np.float32))}


def test_relu_in_the_activation_slot_equals_the_builtin_relu(tmp_path):
    """ReLU in the activation slot equals ``activation="relu"`` bit for bit (the same operations)."""
    relu = pedestrian.load_layer(_module(tmp_path, "relu", RELU))
    cfg = GPTConfig(**TINY, activation="relu")
    x, y = token_batch(TINY, 2, 8, seed=2)
    l0, g0 = _grads(GPT(cfg, seed=0, dtype="float64", kernels="reference"), x, y)
    l1, g1 = _grads(GPT(cfg, seed=0, dtype="float64", kernels="reference", layers={"activation": relu}), x, y)
    assert l1 == l0 and list(g1) == list(g0) and all(np.array_equal(g1[k], g0[k]) for k in g0)


def test_a_numpy_mlp_in_the_mlp_slot_equals_the_builtin_mlp(tmp_path):
    """A whole NumPy MLP (expand, ReLU, contract) in the mlp slot, given the built-in weights,
    gives the built-in MLP's loss and gradients to the rounding of its products (float64, sums
    of ≤ 48 terms in another order: ~48·ε relative per product, 1e-11 with a margin of 10^3);
    its block keeps a6 and a9 but no a7, a8."""
    mlp = pedestrian.load_layer(_module(tmp_path, "mlp", MLP))
    cfg = GPTConfig(**TINY, activation="relu")
    x, y = token_batch(TINY, 2, 8, seed=2)
    built_in = GPT(cfg, seed=0, dtype="float64", kernels="reference")
    l0, g0 = _grads(built_in, x, y)
    model = GPT(cfg, seed=0, dtype="float64", kernels="reference", layers={"mlp": mlp})
    names = {"W1": "mlp_expand.weight", "b1": "mlp_expand.bias", "W2": "mlp_contract.weight", "b2": "mlp_contract.bias"}
    assert not any("mlp_expand" in k for k in model.params)
    decayed = {s.name for s in model.parameters.specs if s.decay and ".mlp." in s.name}   # AdamW: 2-D only
    assert decayed == {f"blocks.{i}.mlp.{n}" for i in range(cfg.n_blocks) for n in ("W1", "W2")}
    for i in range(cfg.n_blocks):
        for mine, theirs in names.items():
            model.params[f"blocks.{i}.mlp.{mine}"][...] = built_in.params[f"blocks.{i}.{theirs}"]
    l1, g1 = _grads(model, x, y)
    assert abs(l1 - l0) <= 1e-11 * abs(l0)
    for k, g in g1.items():
        if k.endswith("attn.k.bias"):                      # ≡ 0 (paper §3): rounding noise on both sides
            continue
        block, _, rest = k.partition(".mlp.")
        ref = g0[f"{block}.{names[rest]}"] if rest else g0[k]
        assert np.max(np.abs(g - ref)) <= 1e-11 * np.max(np.abs(ref)), k
    keys = set(model.activations())
    assert {"blocks.0.a6", "blocks.0.a9"} <= keys and "blocks.0.a7" not in keys and "blocks.0.a8" not in keys


def test_plugged_norm_gradients_against_finite_differences():
    """The dynamic-tanh norm in every norm of a tiny float64 model: the backward's gradient of
    its parameters (and of a built-in weight behind it) equals central differences of the loss.
    Bound: rounding ε·|L|/h ≈ 6e-10 plus truncation h²·|L‴| ≪ that, so 1e-8 absolute + 1e-7
    relative; each tensor's gradient is ≥ 1e-4, so an O(1) mistake could not hide under it."""
    model = GPT(GPTConfig(**TINY), seed=5, dtype="float64", layers={"norm": str(DYT)})
    rng = np.random.default_rng(0)
    for name, p in model.params.items():                 # weights of O(0.3): signals of O(1) reach every
        p[...] += (0.3 if p.ndim != 1 or ".ln" in name else 0.1) * rng.standard_normal(p.shape)   # tensor
    x, y = token_batch(TINY, 2, 8, seed=3, n_ignored=1)
    grads = {k: np.array(v) for k, v in (model.loss(x, y), model.backward())[1].items()}
    for name in ("blocks.0.ln1.alpha", "blocks.1.ln2.w", "blocks.0.ln2.b", "ln_final.alpha", "blocks.0.attn.q.weight"):
        p = model.params[name]
        entries = None if p.size <= 12 else rng.choice(p.size, 12, replace=False)
        numeric = numerical_grad(lambda: model.loss(x, y), p, H_STEP, entries)
        mask = ~np.isnan(numeric)
        scale = np.max(np.abs(numeric[mask]))
        assert scale >= 1e-4, f"{name}: gradient ~0, the check would prove nothing"
        assert np.max(np.abs(grads[name][mask] - numeric[mask])) <= 1e-8 + 1e-7 * scale, name
    assert EPS64 * 2.5 / H_STEP < 1e-9                   # the rounding term of the bound above


@pytest.mark.parametrize("slot", ["norm", "activation", "mlp"])
def test_the_papers_gradient_lines_list_and_check_a_plugged_layer(tmp_path, slot):
    """paper/gradients.py (``pedestrian demo``'s table): every parameter of a model with a plugged
    layer has its line, in backward order, and passes its finite-difference check; a plugged MLP
    has no Δ8, Δ7 lines. Float64, h = 1e-5: the table's own tolerances."""
    from pedestrian.paper.gradients import check_model_gradients, gradient_lines

    layer = {"norm": str(DYT), "activation": _module(tmp_path, "relu", RELU), "mlp": _module(tmp_path, "mlp", MLP)}
    model = GPT(GPTConfig(**TINY, activation="relu"), seed=1, dtype="float64", layers={slot: layer[slot]})
    lines = gradient_lines(model)
    assert sorted(k for _, kind, k in lines if kind == "param") == sorted(model.params)
    assert any(label.startswith("∂L/∂ln1.alpha") for label, _, _ in lines) == (slot == "norm")
    assert any(k.endswith("Δ8") for _, _, k in lines) == (slot != "mlp")
    x, y = token_batch(TINY, 2, 8, seed=4)
    _, checked, _ = check_model_gradients(model, x, y, "fd", entries=2)
    assert len(checked) == len(lines) and not [c.label for c in checked if c.failed]


def test_lora_beside_a_plugged_norm_trains_only_the_adapters():
    """LoRA on q beside a plugged norm: the frozen base (the plugged norm's parameters included)
    gets no gradient, the adapters get theirs, and the plugged norm still runs in the chain."""
    model = GPT(GPTConfig(**TINY), seed=2, dtype="float64", layers={"norm": str(DYT)})
    x, y = token_batch(TINY, 2, 8, seed=5)
    before = model.loss(x, y)
    model.add_lora("q", rank=2)
    assert model.loss(x, y) == before                   # U = 0: a new adapter is a no-op
    grads = model.backward()
    assert sorted(grads) == sorted(k for k in model.params if ".lora_" in k)
    assert np.max(np.abs(grads["blocks.0.attn.q.lora_U"])) > 0


# ---------------------------------------------------------------------------------------- training
def _settings(corpus, out, **kw):
    base = dict(data=str(corpus), out=str(out), model=dict(context_length=16, d_model=16, n_heads=2, n_blocks=2),
                batch_size=4, max_steps=8, warmup_steps=2, lr=1e-2, min_lr=1e-3, eval_interval=4,
                eval_batches=2, max_minutes=None, progress=False, plot=False, layer=[f"norm={DYT}"])
    base.update(kw)
    return TrainSettings(**base)


@pytest.fixture
def corpus(tmp_path):
    return write_fox_corpus(tmp_path / "corpus.txt", 200)


def test_dyt_trains_and_resumes_bit_exactly(corpus, tmp_path):
    """docs/examples/dyt.py as the norm: the loss falls; 8 steps straight equal 4 + resume 4 bit
    for bit (weights, moments); the checkpoint records the layer's slot, path and source, and
    rebuilds it from there for eval and sample, even after the file is gone."""
    r = train(_settings(corpus, tmp_path / "one"))
    losses = [rec["loss"] for rec in read_log(tmp_path / "one" / "log.jsonl") if "loss" in rec]
    assert len(losses) == 8 and np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.05
    train(_settings(corpus, tmp_path / "two", stop_step=4))
    train(_settings(corpus, tmp_path / "two", layer=[]), resume=True, explicit={"out"})
    ca, cb = load_checkpoint(tmp_path / "one"), load_checkpoint(tmp_path / "two")
    assert ca.step == cb.step == 8 and list(ca.model.slots.plugged) == ["norm"]
    assert ca.state["layers"] == [{"slot": "norm", "path": str(DYT), "source": DYT.read_text(encoding="utf-8")}]
    for k, v in ca.model.params.items():
        np.testing.assert_array_equal(v, cb.model.params[k])
    np.testing.assert_array_equal(ca.optimizer_state()["base.v"], cb.optimizer_state()["base.v"])
    assert "blocks.1.ln2.alpha" in ca.model.params and r.model.params["ln_final.alpha"].shape == ()
    # the gradient picture's record groups the plugged parameters by their place
    ids = np.zeros((1, 4), dtype=np.int64)
    record = gradient_record(ca.model, ids, ids, 8)
    assert {"ln1", "ln2"} <= set(record["grad_norms"]["blocks.0"]) and record["grad_norms"]["ln_final"] > 0


def test_resume_refuses_another_layer_file(corpus, tmp_path):
    """--layer given again on resume must be the recorded source: a changed file is one line; the
    same file resumes, and so does no --layer after the file is gone (the recorded source runs)."""
    mine = _module(tmp_path, "mine", DYT.read_text(encoding="utf-8"))
    train(_settings(corpus, tmp_path / "run", stop_step=2, max_steps=6, layer=[f"norm={mine}"]))
    other = _module(tmp_path, "dyt2", DYT.read_text(encoding="utf-8") + "\n# changed\n")
    with pytest.raises(TrainingError, match="differs from the norm layer the checkpoint") as exc:
        train(_settings(corpus, tmp_path / "run", max_steps=6, layer=[f"norm={other}"]), resume=True,
              explicit={"out", "layer"})
    assert "\n" not in str(exc.value)
    r = train(_settings(corpus, tmp_path / "run", max_steps=6, stop_step=4, layer=[f"norm={mine}"]), resume=True,
              explicit={"out", "layer"})
    assert r.step == 4
    mine.unlink()
    r = train(_settings(corpus, tmp_path / "run", max_steps=6, layer=None), resume=True, explicit={"out"})
    assert r.step == 6 and "ln_final.alpha" in r.model.params


# ---------------------------------------------------------------------------------------- the command line
CLI = ["--context-length", "16", "--d-model", "16", "--n-heads", "2", "--n-blocks", "2", "--batch-size", "4",
       "--eval-interval", "2", "--eval-batches", "2", "--warmup-steps", "1", "--max-steps", "2",
       "--max-minutes", "0", "--no-progress", "--no-plot", "--no-sample"]


def test_cli_checks_the_layer_before_the_first_step(corpus, tmp_path, capsys):
    """A backward with a wrong α gradient: exit 1 before any step, the report names ``alpha``;
    --no-check-layers trains anyway; a correct layer trains, and eval and sample read its run."""
    broken = _module(tmp_path, "broken", DYT.read_text(encoding="utf-8"),
                     **{'"alpha": np.sum(g * x)': '"alpha": -np.sum(g * x)'})
    out = tmp_path / "broken_run"
    assert main(["train", "--data", str(corpus), "--out", str(out), "--layer", f"norm={broken}", *CLI]) == 1
    text = capsys.readouterr()
    err = text.err + text.out
    assert "alpha" in err and "FAIL" in err and "--no-check-layers" in err
    assert not (out / "latest").exists()
    assert main(["train", "--data", str(corpus), "--out", str(out), "--layer", f"norm={broken}", "--no-check-layers",
                 *CLI]) == 0
    good = tmp_path / "good_run"
    assert main(["train", "--data", str(corpus), "--out", str(good), "--layer", f"norm={DYT}", *CLI]) == 0
    text = capsys.readouterr()
    assert "norm layer" in text.out + text.err and "agrees with the numbers" in text.out + text.err
    assert main(["eval", str(good), "--no-progress"]) == 0
    assert main(["explain", "--checkpoint", str(good)]) == 0
    table = capsys.readouterr().out
    n_params = load_checkpoint(good).model.num_params()
    assert "dyt(a5) [plugged]" in table and "Δ5 += dytᵀ(Δ6)" in table and f"× {n_params:,} parameters" in table
    assert main(["sample", "--checkpoint", str(good), "--prompt", "the", "--max-new-tokens", "5", "--seed", "0"]) == 0


@pytest.mark.parametrize("flag, words", [
    ("nrom={dyt}", "unknown slot 'nrom'"),
    ("norm", "must be SLOT=FILE.py"),
    ("norm={missing}", "no file"),
])
def test_cli_bad_layer_flags_are_one_line(corpus, tmp_path, capsys, flag, words):
    flag = flag.format(dyt=DYT, missing=tmp_path / "nope.py")
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "r"), "--layer", flag, *CLI]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and words in err, err


# ---------------------------------------------------------------------------------------- bad input
def test_bad_layers_are_one_line_naming_the_fix(tmp_path):
    from pedestrian.interop.hf import save_pretrained

    cfg = GPTConfig(**TINY)
    relu = _module(tmp_path, "relu", RELU)
    no_backward = _module(tmp_path, "half", "def init(d, m):\n    return {}\ndef forward(i, p):\n    return i['x'], None\n")
    cases = [
        (lambda: pedestrian.load_layer(no_backward), ValueError, "defines no backward()"),
        (lambda: GPT(cfg, layers={"nrom": str(DYT)}), ValueError, "unknown layer slot 'nrom'"),
        (lambda: GPT(GPTConfig(**TINY, mlp="swiglu"), layers={"activation": relu}), ValueError,
         "activation slot needs mlp='standard'"),
        (lambda: GPT(cfg, layers={"mlp": str(DYT)}), ValueError, "says SLOT = 'norm'; plug it into 'norm'"),
        (lambda: GPT(cfg, backend="torch", layers={"norm": str(DYT)}), ValueError, "backend='numpy'"),
        (lambda: GPT(cfg, layers={"mlp": _module(tmp_path, "mlp", MLP)}).add_lora("q"), ValueError,
         "plug norm/activation only"),
        (lambda: save_pretrained(GPT(cfg, layers={"norm": str(DYT)}), tmp_path / "hf"), ValueError,
         "keep it as a pedestrian checkpoint"),
    ]
    for make, error, words in cases:
        with pytest.raises(error) as exc:
            make()
        assert words in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


@pytest.mark.parametrize("old, new, words", [
    ('"b": np.sum(delta.reshape(-1, d), axis=0),', "", "expected one for every parameter init() made, "
     "['alpha', 'b', 'w']; add ['b']"),
    ('return y, (x, t', 'return y[..., :-1], (x, t', "output has shape (2, 8, 11), expected (2, 8, 12)"),
    ('return {"x": g * alpha}', 'return {"x": (g * alpha)[:, :1]}', "input delta 'x' has shape (2, 1, 12), "
     "expected (2, 8, 12)"),
    ('y = params["w"] * t + params["b"]', 'y = params["w"] * t + params["b"] / 0', "holds 192 NaN and 0 inf "
     "values, expected finite numbers"),
    ("x, t, w, alpha = cache", "x, t, w, alpha, extra = cache", "backward raised ValueError"),
])
def test_a_broken_plugged_layer_stops_in_one_line(tmp_path, old, new, words):
    """A backward without a parameter's gradient, a wrong output or input-delta shape, a
    non-finite output, a backward that raises: one :class:`LayerError` line naming the slot, the
    place and what was expected."""
    source = DYT.read_text(encoding="utf-8")
    assert old in source
    module = pedestrian.load_layer(_module(tmp_path, "bad", source.replace(old, new)))
    model = GPT(GPTConfig(**TINY), dtype="float64", layers={"norm": module})
    x, y = token_batch(TINY, 2, 8, seed=0)
    with np.errstate(all="ignore"), pytest.raises(LayerError) as exc:
        model.loss(x, y)
        model.backward()
    message = str(exc.value)
    assert message.startswith("norm slot (bad.py)") and words in message and "\n" not in message, message

"""bfloat16 mixed precision (``GPT(..., precision="bf16")``, ``pedestrian train --precision bf16``;
src/pedestrian/model/precision.py) on CPU torch tensors: the gradients against PyTorch autocast's on
the same model (tests/oracles/autocast_oracle.py), the dtypes of what is kept, a short run's loss
curve against the float32 run's, the float32 checkpoint, and the refusals.

Tolerance of the gradients: tests/helpers/bf16_bound.py (derived there from bf16's ε = 2⁻⁸ and
the number of roundings on a gradient's path; 0.127 of a tensor's norm for two blocks). That bound
admits any bf16 computation; two more checks make it bite: pedestrian's gradient is at least as
accurate as autocast's (against the float64 gradient, at most twice autocast's error over the
whole gradient: it rounds fewer intermediates), and it is a bf16 computation (its distance from the
float32 gradient is at least u/8 of its norm; float32 everywhere would give ~2⁻²⁴).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from autocast_oracle import autocast_loss_and_grads  # noqa: E402
from bf16_bound import U, gradient_bound, relative_errors, whole_error  # noqa: E402
from cli_helpers import fox_text, one_line_error, write_fox_corpus  # noqa: E402
from torch_reference import default_cfg  # noqa: E402

from pedestrian import GPT  # noqa: E402
from pedestrian.backend import to_numpy  # noqa: E402
from pedestrian.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from pedestrian.cli import main  # noqa: E402
from pedestrian.config import GPTConfig  # noqa: E402
from pedestrian.model.precision import KINDS  # noqa: E402
from pedestrian.layers import MODEL_FUNCTIONS  # noqa: E402
from pedestrian.training.optim import AdamW  # noqa: E402
from pedestrian.training.step import train_step  # noqa: E402

LLAMA = dict(norm="rmsnorm", mlp="swiglu", activation="silu", position_encoding="rope", bias=False)
CONFIGS = {
    "gpt2-untied-bias": dict(n_heads=3, tie_weights=False, bias=True, activation="gelu_tanh"),
    "gpt2-tied-gelu": dict(n_heads=2, d_model=16, tie_weights=True, activation="gelu"),
    "llama-gqa-tied": dict(LLAMA, n_heads=4, n_kv_heads=2, tie_weights=True),
}


def _config(fields: dict) -> GPTConfig:
    return GPTConfig(**{**dict(vocab_size=13, context_length=8, d_model=12, n_heads=2, n_blocks=2, d_mlp=20), **fields})


def _cfg(config: GPTConfig) -> dict:
    """The oracle's cfg of ``config``."""
    keys = set(default_cfg()) - {"mlp_ratio", "rope_scaling"}
    return default_cfg(**{k: getattr(config, k) for k in keys})


def _batch(config: GPTConfig, seed: int = 5, B: int = 2):
    x = np.random.default_rng(seed).integers(0, config.vocab_size, (B, config.context_length + 1))
    y = x[:, 1:].copy()
    y[0, 2] = -100                                                   # one ignored target
    return x[:, :-1], y


def _grads(model, x, y, fused: bool = True):
    model.fused_head = fused
    loss = model.loss(x, y)
    return loss, {k: to_numpy(v).astype(np.float64) for k, v in model.backward().items()}


@pytest.mark.parametrize("fused", [True, False], ids=["fused-head-chunks-of-5", "unfused-head"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_gradients_match_autocast(name, fused, monkeypatch):
    """The fused head runs 16 rows in chunks of 5, 5, 5, 1 (its budget made 5 rows of float32
    logits), each chunk's dW partial rounded to bf16 once more than autocast's: counted in R."""
    import pedestrian.layers.head_loss as head_loss

    config = _config(CONFIGS[name])
    monkeypatch.setattr(head_loss, "HEAD_CHUNK_BYTES", 5 * config.vocab_size * 4)
    x, y = _batch(config)
    mixed = GPT(config, seed=3, backend="torch", precision="bf16")
    f32 = GPT(config, seed=3, backend="torch", kernels="reference")
    f64 = GPT(config, seed=3, dtype="float64")
    for k, v in f64.params.items():                                  # the same float32 weights, widened
        v[...] = to_numpy(mixed.params[k]).astype(np.float64)
    loss, got = _grads(mixed, x, y, fused)
    loss32, want32 = _grads(f32, x, y)
    loss64, want64 = _grads(f64, x, y)
    params = {k: to_numpy(v) for k, v in mixed.params.items()}
    loss_ac, ac = autocast_loss_and_grads(params, _cfg(config), x, y)
    ac = {k: v.double().numpy() for k, v in ac.items()}
    assert set(ac) == set(got)
    tol = gradient_bound(config.n_blocks)
    worst = relative_errors(got, ac, want32)
    assert max(worst.values()) <= tol, {k: f"{v:.3g}" for k, v in worst.items() if v > tol}
    assert abs(loss - loss_ac) <= tol * loss32, (loss, loss_ac)
    # at least as accurate as autocast (it rounds fewer intermediates), and a bf16 computation
    assert whole_error(got, want64) <= 2 * whole_error(ac, want64), (whole_error(got, want64), whole_error(ac, want64))
    norm32 = math.sqrt(sum(float(np.sum(v * v)) for v in want32.values()))
    assert whole_error(got, want32) >= U / 8 * norm32
    for k, v in mixed.grads.items():                                 # float32 master gradients
        assert v.dtype == torch.float32, k


def test_what_a_bf16_step_keeps_and_returns():
    """Products' outputs and the activation's are bfloat16; the residual stream, the norms and the
    logits float32; parameters and gradients float32."""
    config = _config(CONFIGS["gpt2-untied-bias"])
    model = GPT(config, seed=3, backend="torch", precision="bf16")
    x, y = _batch(config)
    logits = model.forward(x, y)
    acts = model.activations()
    assert logits.dtype == torch.float32
    for name in ("blocks.0.a4", "blocks.0.a7", "blocks.0.a8", "blocks.0.a9"):
        assert acts[name].dtype == torch.bfloat16, name
    for name in ("a1", "blocks.0.a5", "blocks.0.a6", "blocks.0.a10", "a11"):
        assert acts[name].dtype == torch.float32, name
    model.backward()
    assert all(v.dtype == torch.float32 for v in list(model.params.values()) + list(model.grads.values()))
    assert model.kernels.precision == "bf16" and model.kernels_name == "reference"


def test_every_contract_function_has_a_kind():
    assert set(KINDS) == set(MODEL_FUNCTIONS)


def test_float32_models_keep_their_table():
    """``precision="float32"`` (the default) builds the table it built before: no wrapper."""
    config = _config(CONFIGS["gpt2-untied-bias"])
    for backend in ("numpy", "torch"):
        model = GPT(config, backend=backend, precision="float32")
        assert not hasattr(model.kernels, "precision")
        assert model.kernels.linear_forward is GPT(config, backend=backend).kernels.linear_forward


def _run(model, steps: int, data: np.ndarray, B: int, T: int):
    opt = AdamW(model, lr=3e-3, weight_decay=0.0)
    rng, losses = np.random.default_rng(0), []
    for _ in range(steps):
        starts = rng.integers(0, len(data) - T - 1, B)
        xs = np.stack([data[s:s + T + 1] for s in starts])
        loss, _ = train_step(model, opt, [(xs[:, :-1], xs[:, 1:])], 3e-3, grad_clip=1.0)
        losses.append(loss)
    return np.array(losses), opt


def test_a_short_bf16_run_follows_the_float32_run():
    """60 steps on the same batches from the same weights. The noise: a step's loss varies from
    batch to batch by σ, the standard deviation of the float32 run's losses about their own
    moving average (9 steps) over the last 30 steps; a mean of the last n = 20 losses is known to
    σ/√n. The bf16 run's mean over them must lie within 3σ/√n of the float32 run's (both runs see
    the same batches, so this compares the precisions, not the data), and both must have learned
    (the mean of the last 20 below the first loss by more than 10σ)."""
    text = fox_text(300)
    vocab = sorted(set(text))
    data = np.array([vocab.index(c) for c in text], dtype=np.int64)
    config = GPTConfig(vocab_size=len(vocab), context_length=16, d_model=32, n_heads=2, n_blocks=2, d_mlp=64)
    l32, _ = _run(GPT(config, seed=1, backend="torch", kernels="reference"), 60, data, 8, 16)
    l16, _ = _run(GPT(config, seed=1, backend="torch", precision="bf16"), 60, data, 8, 16)
    tail = l32[-30:]
    trend = np.convolve(tail, np.ones(9) / 9, mode="valid")
    sigma = float(np.std(tail[4:-4] - trend))
    n = 20
    assert abs(l16[-n:].mean() - l32[-n:].mean()) <= 3 * sigma / math.sqrt(n), (l16[-n:].mean(), l32[-n:].mean(), sigma)
    for losses in (l32, l16):
        assert losses[-n:].mean() < losses[0] - 10 * sigma


def test_the_checkpoint_is_float32_and_loads_in_a_numpy_model(tmp_path):
    config = _config(CONFIGS["llama-gqa-tied"])
    model = GPT(config, seed=2, backend="torch", precision="bf16")
    opt = AdamW(model, lr=1e-2)
    x, y = _batch(config)
    train_step(model, opt, [(x, y)], 1e-2, grad_clip=1.0)
    save_checkpoint(tmp_path / "ck", model, opt, step=1)
    back = load_checkpoint(tmp_path / "ck").model                   # NumPy, float32
    assert back.backend == "numpy" and back.dtype == np.float32
    for k, v in model.params.items():
        np.testing.assert_array_equal(back.params[k], to_numpy(v), err_msg=k)
    again = GPT(config, seed=9, backend="torch", precision="bf16")
    again.load_state_dict(back.state_dict())
    assert again.loss(x, y) == model.loss(x, y)


@pytest.mark.parametrize("kwargs, words", [
    (dict(precision="bf16"), "NumPy has no bfloat16 products"),
    (dict(precision="fp16", backend="torch"), "use precision='bf16'"),
    (dict(precision="float16"), "use precision='bf16'"),
    (dict(precision="bf16", backend="torch", dtype="float64"), "float32 master weights"),
    (dict(precision="int8"), "choose 'float32' or 'bf16'"),
])
def test_refusals_in_python(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")) as info:
        GPT(_config({}), **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("flags, words", [
    (["--precision", "fp16"], "float16 needs a loss scale, which pedestrian does not have: use --precision bf16"),
    (["--precision", "bf16"], "NumPy has no bfloat16 products"),
    (["--precision", "bf16", "--backend", "torch", "--dtype", "float64"], "--dtype float32"),
])
def test_refusals_on_the_command_line(tmp_path, capsys, flags, words):
    corpus = write_fox_corpus(tmp_path / "c.txt", 50)
    try:
        rc = main(["train", "--data", str(corpus), "--out", str(tmp_path / "o"), "--max-steps", "1", "--no-progress",
                   "--no-plot", *flags])
    except SystemExit as exc:                                         # (a flag argparse refuses)
        rc = exc.code
    assert rc == 2
    assert words in one_line_error(capsys)
    assert not (tmp_path / "o").exists()


def test_a_bf16_training_run_goes_on_in_float32(tmp_path, capsys):
    """``pedestrian train --precision bf16`` on CPU tensors: 3 steps with a validation, a gradient
    record and a checkpoint; then ``--resume --precision float32`` finishes the run from that
    float32 checkpoint (the model rebuilt in the other precision)."""
    from pedestrian.training import read_log

    corpus = write_fox_corpus(tmp_path / "c.txt", 200)
    tiny = ["--context-length", "16", "--d-model", "16", "--n-heads", "2", "--n-blocks", "2", "--batch-size", "4",
            "--eval-interval", "3", "--eval-batches", "2", "--warmup-steps", "2", "--lr", "1e-2", "--max-minutes", "0",
            "--no-progress", "--no-plot"]
    out = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(out), "--max-steps", "6", "--stop-step", "3",
                 "--backend", "torch", "--precision", "bf16", *tiny]) == 0
    state = load_checkpoint(out / "latest")
    assert state.step == 3 and state.meta["settings"]["precision"] == "bf16"
    assert all(v.dtype == np.float32 for v in state.model.params.values())
    assert main(["train", "--out", str(out), "--resume", "--precision", "float32", "--no-progress", "--no-plot"]) == 0
    assert load_checkpoint(out / "latest").step == 6
    losses = {r["step"]: r["loss"] for r in read_log(out / "log.jsonl") if "loss" in r}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in losses.values())
    assert any("grad_norms" in r for r in read_log(out / "log.jsonl"))                  # (the gradient record)

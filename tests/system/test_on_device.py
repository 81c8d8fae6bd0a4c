"""The float64 gradient grid on the torch backend's device path: what a model with
``backend="torch", device="cuda"`` computes -- loss, logits, every parameter gradient, three
AdamW updates, greedy KV-cache generation -- against the NumPy model on the CPU (itself checked
against autograd and finite differences: tests/paper/), over GPT-2- and Llama-style configs
(grouped-query and multi-query attention, an explicit head width, Qwen2's q/k/v biases, Llama 3's
RoPE scaling, tied and untied logits, LoRA on every projection) and contexts on both sides of the
tiled attention's threshold on a GPU (512 tokens).

Two devices:

- ``"cuda"``, where PyTorch sees a GPU (skipped here: these machines have none; run on one with
  ``pytest tests/system/test_on_device.py``);
- ``"cpu-as-gpu"``: torch CPU tensors through the kernel table a GPU gets (the reference layers
  with the attention's on-device functions, :func:`pedestrian.kernels.kernels_for`), so that
  machines without a GPU run the same code, all but the CUDA kernels under it.

Tolerance: float64 throughout; the sides differ only in the order of rounded additions (cuBLAS's
blocking of the products, reductions in another order), over chains of a few hundred operations
on O(1) values: ~1e-14 relative; bound 1e-10 of each tensor's largest entry (as
tests/system/test_distributed.py's GPU test). TF32 never applies to float64.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pedestrian.generation.sampling import Sampling
from pedestrian import GPT  # noqa: E402
from pedestrian.backend import to_numpy  # noqa: E402
from pedestrian.config import GPTConfig, RopeScaling  # noqa: E402
from pedestrian.generation.generate import generate  # noqa: E402
from pedestrian.generation.sampling import NonFiniteLogitsError  # noqa: E402
from pedestrian.kernels import attention, kernels_for  # noqa: E402
from pedestrian.training.optim import AdamW  # noqa: E402
from pedestrian.training.step import skip_reason, train_step  # noqa: E402

RTOL = 1e-10
DEVICES = ["cpu-as-gpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none here; cpu-as-gpu runs the same layers)"))]

LLAMA = dict(norm="rmsnorm", mlp="swiglu", activation="silu", position_encoding="rope", bias=False)
#: name -> (config fields, LoRA targets or None)
GRID = {
    "gpt2-untied": (dict(n_heads=3), None),
    "gpt2-tied-relu-dqk5": (dict(n_heads=3, tie_weights=True, activation="relu", d_qk=5, d_head=3), None),
    "gpt2-lora": (dict(n_heads=3), ["q", "v", "mlp_contract", "logits"]),
    "llama-gqa-4:2-untied": (dict(LLAMA, n_heads=4, n_kv_heads=2, tie_weights=False), None),
    "llama-multi-query-tied": (dict(LLAMA, n_heads=4, n_kv_heads=1), None),
    "llama-head-dim-10": (dict(LLAMA, n_heads=4, n_kv_heads=2, d_head=10, d_qk=10), None),
    "qwen2-biases-llama3-rope": (dict(LLAMA, n_heads=2, n_kv_heads=1, qkv_bias=True, rope_base=500_000.0,
                                      rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8)), None),
    "llama-lora-seven": (dict(LLAMA, n_heads=4, n_kv_heads=2),
                         ["q", "k", "v", "attn_proj", "mlp_gate", "mlp_expand", "mlp_contract"]),
}


def _config(fields: dict, T: int) -> GPTConfig:
    return GPTConfig(**{**dict(vocab_size=13, context_length=T, d_model=12, n_blocks=2, d_mlp=20,
                               tie_weights=True), **fields})


def _pair(fields, lora, T, device):
    """The NumPy CPU model and the device's torch model, holding the same random weights."""
    config = _config(fields, T)
    ref = GPT(config, seed=3, dtype="float64")
    if lora:
        ref.add_lora(lora, rank=2, alpha=0.7)
        for k, (name, p) in enumerate(ref.params.items()):          # LoRA's U away from 0
            if name.endswith("lora_U"):
                p[...] = np.random.default_rng(k).normal(0.0, 0.2, p.shape)
    if device == "cpu-as-gpu":
        dev = GPT(config, dtype="float64", backend="torch", kernels="reference")
        table = kernels_for("fast", "cuda", "float64")          # what a GPU's model gets
        dev.kernels.multi_head_attention_forward = table.multi_head_attention_forward
        dev.kernels.multi_head_attention_backward = table.multi_head_attention_backward
        dev.kernels.attention_weights = table.attention_weights
    else:
        dev = GPT(config, dtype="float64", backend="torch", device=device, kernels="fast")
        assert dev.kernels.multi_head_attention_forward is attention.on_device_forward
    if lora:
        dev.add_lora(ref.lora_targets, rank=2, alpha=0.7)
    dev.load_state_dict({k: np.array(v) for k, v in ref.params.items()}, strict=True)
    return ref, dev


def _close(got, want, name, scale=None):
    got = to_numpy(got.cpu()) if hasattr(got, "cpu") else np.asarray(got)
    scale = max(float(np.max(np.abs(want))) if scale is None else float(scale), 1e-300)
    assert float(np.max(np.abs(got - want))) <= RTOL * scale, name


@pytest.mark.parametrize("T", [9, 520])
@pytest.mark.parametrize("case", list(GRID))
@pytest.mark.parametrize("device", DEVICES)
def test_loss_logits_and_every_gradient_equal_the_cpu(device, case, T):
    fields, lora = GRID[case]
    ref, dev = _pair(fields, lora, T, device)
    rng = np.random.default_rng(T)
    x, y = rng.integers(0, 13, (2, T)), rng.integers(0, 13, (2, T))
    y[0, :3] = -100
    loss_ref, loss_dev = ref.loss(x, y), dev.loss(x, y)
    # the loss, one float64 mean of B·T terms at the end of the same chains (as in
    # test_distributed.py's GPU test): rounding ~1e-15 relative, bound 1e-12
    assert abs(loss_dev - loss_ref) <= 1e-12 * abs(loss_ref)
    g_ref, g_dev = ref.backward(), dev.backward()
    assert set(g_dev) == set(g_ref) and g_ref
    assert {str(g.device.type) for g in g_dev.values()} == {"cpu" if device == "cpu-as-gpu" else "cuda"}
    for name, g in g_ref.items():
        if name.endswith(".attn.k.bias") and ref.config.position_encoding != "rope":
            # 0 in exact arithmetic (every row of Δcausal sums to 0; RoPE rotates the key bias by
            # position, so it has a gradient there): rounding noise of sums as large as the query
            # bias's gradient, on both sides
            _close(g_dev[name], np.zeros_like(g), name, scale=np.abs(g_ref[name.replace(".k.", ".q.")]).max())
        else:
            _close(g_dev[name], g, name)
    _close(dev.forward(x), np.asarray(ref.forward(x)), "logits")      # (model.loss fuses the head: no a12)


@pytest.mark.parametrize("case", ["gpt2-untied", "llama-gqa-4:2-untied", "qwen2-biases-llama3-rope"])
@pytest.mark.parametrize("device", DEVICES)
def test_adamw_steps_and_kv_cache_generation_equal_the_cpu(device, case):
    fields, lora = GRID[case]
    ref, dev = _pair(fields, lora, 24, device)
    x = np.random.default_rng(5).integers(0, 13, (3, 24))
    dev.recompute = 1                        # the first block recomputed in the backward: same numbers
    opts = AdamW(ref, lr=1e-2), AdamW(dev, lr=1e-2)
    for _ in range(3):
        for model, opt in zip((ref, dev), opts):
            model.loss(x[:, :-1], x[:, 1:])
            model.backward()
            opt.step()
    for name, p in ref.params.items():
        if not (name.endswith(".attn.k.bias") and ref.config.position_encoding != "rope"):
            _close(dev.params[name], np.asarray(p), name)   # (AdamW scales that bias's rounding-noise
            #                                               gradient to steps of ±lr: sign of noise)
    ref.training = dev.training = False
    prompt = x[:, :5]
    want = generate(ref, prompt, 12, Sampling(temperature=0))
    got = generate(dev, prompt, 12, Sampling(temperature=0))
    np.testing.assert_array_equal(to_numpy(got.cpu()) if hasattr(got, "cpu") else got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_a_nan_weight_on_the_device_is_caught_not_trained_on_or_sampled(device):
    """No silent numbers on a GPU: a NaN weight makes the step's loss NaN, the step is skipped
    (weights unchanged), and generation stops with an error naming non-finite weights."""
    _, dev = _pair(GRID["llama-gqa-4:2-untied"][0], None, 16, device)
    opt = AdamW(dev, lr=1e-2)
    dev.params["blocks.1.mlp_contract.weight"][3, 5] = float("nan")
    before = {k: to_numpy(v.cpu()).copy() for k, v in dev.params.items()}
    x = np.random.default_rng(6).integers(0, 13, (2, 17))
    loss, norm = train_step(dev, opt, [(x[:, :-1], x[:, 1:])], 1e-2, grad_clip=1.0)
    assert not np.isfinite(loss) and skip_reason(loss, norm, 1.0, opt) is not None
    for k, v in dev.params.items():
        np.testing.assert_array_equal(to_numpy(v.cpu()), before[k], err_msg=k)
    dev.training = False
    with pytest.raises(NonFiniteLogitsError, match="non-finite weights"):
        generate(dev, x[:, :3], 4, Sampling(temperature=0))

"""A whole model through the GPU's kernel table (:func:`pedestrian.gpu.table`): its loss, logits
and every parameter gradient equal the NumPy reference model's, over the GPT-2- and Llama-style
configs of tests/system/test_on_device.py (grouped and multi-query heads, odd head widths, Qwen2's
biases with Llama 3's RoPE scaling, tied and untied logits, LoRA on every projection), float64,
torch tensors on the CPU under Triton's interpreter (or on the GPU where there is one).

Tolerance: as tests/system/test_on_device.py (whose cpu-as-gpu grid this is, run with the Triton
kernels): float64 throughout, the sides differing only in the order of rounded additions over
chains of a few hundred operations on O(1) values, ~1e-14 relative; bound 1e-10 of each tensor's
largest entry.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import DEVICE, numpy, table

from pedestrian import GPT
from pedestrian.config import GPTConfig, RopeScaling

RTOL = 1e-10
LLAMA = dict(norm="rmsnorm", mlp="swiglu", activation="silu", position_encoding="rope", bias=False)
GRID = {
    "gpt2-untied-gelu-tanh": (dict(n_heads=3, activation="gelu_tanh"), None),
    "gpt2-tied-relu-dqk5": (dict(n_heads=3, tie_weights=True, activation="relu", d_qk=5, d_head=3), None),
    "gpt2-lora": (dict(n_heads=3), ["q", "v", "mlp_contract", "logits"]),
    "llama-gqa-4:2-untied": (dict(LLAMA, n_heads=4, n_kv_heads=2, tie_weights=False), None),
    "llama-multi-query-tied": (dict(LLAMA, n_heads=4, n_kv_heads=1), None),
    "qwen2-biases-llama3-rope": (dict(LLAMA, n_heads=2, n_kv_heads=1, qkv_bias=True, rope_base=500_000.0,
                                      rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8)), None),
    "llama-lora-seven": (dict(LLAMA, n_heads=4, n_kv_heads=2),
                         ["q", "k", "v", "attn_proj", "mlp_gate", "mlp_expand", "mlp_contract"]),
}


def _pair(fields, lora, T):
    config = GPTConfig(**{**dict(vocab_size=13, context_length=T, d_model=12, n_blocks=2, d_mlp=20,
                                 tie_weights=True), **fields})
    ref = GPT(config, seed=3, dtype="float64")
    if lora:
        ref.add_lora(lora, rank=2, alpha=0.7)
        for k, (name, p) in enumerate(ref.params.items()):                # LoRA's U away from 0
            if name.endswith("lora_U"):
                p[...] = np.random.default_rng(k).normal(0.0, 0.2, p.shape)
    dev = GPT(config, dtype="float64", backend="torch", device=DEVICE, kernels="reference")
    vars(dev.kernels).update({k: v for k, v in vars(table("float64")).items() if k != "name"})
    if lora:
        dev.add_lora(ref.lora_targets, rank=2, alpha=0.7)
    dev.load_state_dict({k: np.array(v) for k, v in ref.params.items()}, strict=True)
    return ref, dev


def _close(got, want, name, scale=None):
    scale = max(float(np.max(np.abs(want))) if scale is None else float(scale), 1e-300)
    err = float(np.max(np.abs(numpy(got) - want)))
    assert err <= RTOL * scale, f"{name}: {err:.3g} > {RTOL * scale:.3g}"


@pytest.mark.parametrize("case", list(GRID))
def test_loss_logits_and_every_gradient_through_the_gpu_table_equal_the_reference(case):
    fields, lora = GRID[case]
    T = 9
    ref, dev = _pair(fields, lora, T)
    from pedestrian.gpu import norms

    assert dev.kernels.add_layernorm_forward is norms.add_layernorm_forward       # the Triton table runs
    rng = np.random.default_rng(T)
    x, y = rng.integers(0, 13, (2, T)), rng.integers(0, 13, (2, T))
    y[0, :3] = -100
    loss_ref, loss_dev = ref.loss(x, y), dev.loss(x, y)
    assert abs(loss_dev - loss_ref) <= 1e-12 * abs(loss_ref)
    g_ref, g_dev = ref.backward(), dev.backward()
    assert set(g_dev) == set(g_ref) and g_ref
    for name, g in g_ref.items():
        if name.endswith(".attn.k.bias") and ref.config.position_encoding != "rope":
            # 0 in exact arithmetic (test_on_device.py): rounding noise of sums as large as the q bias's
            _close(g_dev[name], np.zeros_like(g), name, scale=np.abs(g_ref[name.replace(".k.", ".q.")]).max())
        else:
            _close(g_dev[name], g, name)
    _close(dev.forward(x), np.asarray(ref.forward(x)), "logits")      # (model.loss fuses the head: no a12)

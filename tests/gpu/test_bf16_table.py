"""bfloat16 mixed precision over the GPU's kernel table (:func:`pedestrian.model.precision.mixed_table`
over :func:`pedestrian.gpu.table`: the Triton norms, activations, SwiGLU gate, RoPE, attention and
embedding in float32 between bfloat16 products), on CPU tensors under Triton's interpreter (or on
the GPU where there is one): the loss and every gradient against the same model on the reference
layers' mixed table (tests/system/test_bf16.py checks that one against PyTorch autocast).

Tolerance: tests/helpers/bf16_bound.py. The two sides run the same casts; their float32 parts
differ in the order of rounded additions (2⁻²⁴-scale), which can flip a downstream bfloat16
rounding by one ulp: a perturbation of the kind that bound counts, at most as many of them.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bf16_bound import gradient_bound, relative_errors  # noqa: E402
from gpu_helpers import DEVICE, numpy, table  # noqa: E402

from pedestrian import GPT  # noqa: E402
from pedestrian.config import GPTConfig  # noqa: E402
from pedestrian.model.precision import mixed_table  # noqa: E402

LLAMA = dict(norm="rmsnorm", mlp="swiglu", activation="silu", position_encoding="rope", bias=False)
GRID = {
    "gpt2-untied-gelu-tanh": dict(n_heads=3, activation="gelu_tanh", tie_weights=False),
    "llama-gqa-tied": dict(LLAMA, n_heads=4, n_kv_heads=2, tie_weights=True),
}


@pytest.mark.parametrize("name", list(GRID))
def test_bf16_through_the_gpu_table_matches_the_reference_layers(name):
    config = GPTConfig(**{**dict(vocab_size=13, context_length=8, d_model=12, n_blocks=2, d_mlp=20), **GRID[name]})
    ref = GPT(config, seed=3, backend="torch", precision="bf16")                 # CPU: the reference layers
    dev = GPT(config, seed=3, backend="torch", device=DEVICE, precision="bf16")
    if DEVICE == "cpu":                                                          # the table a GPU's model gets
        vars(dev.kernels).update({k: v for k, v in vars(mixed_table(table("float32"))).items() if k != "name"})
    x = np.random.default_rng(4).integers(0, 13, (2, 9))
    got_loss, want_loss = dev.loss(x[:, :-1], x[:, 1:]), ref.loss(x[:, :-1], x[:, 1:])
    got = {k: numpy(v) for k, v in dev.backward().items()}
    want = {k: numpy(v) for k, v in ref.backward().items()}
    tol = gradient_bound(config.n_blocks)
    errors = relative_errors(got, want, want)
    assert max(errors.values()) <= tol, {k: f"{v:.3g}" for k, v in errors.items() if v > tol}
    assert abs(got_loss - want_loss) <= tol * abs(want_loss)
    assert all(v.dtype == torch.float32 for v in dev.grads.values())

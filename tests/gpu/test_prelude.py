"""The attention's prelude (q/k norms, RoPE per block; model/prelude.py) on the GPU's kernel table:
Triton's RMS norm on the reshaped q and k views and its RoPE, against the prelude on the reference
layers (float64, tiny shapes: under Triton's interpreter on CPU tensors without a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from gpu_helpers import numpy, table, tensor

import pedestrian.layers as reference
from pedestrian.config import GPTConfig
from pedestrian.model import prelude
from pedestrian.model.params import Norm

pytest.importorskip("triton")


@pytest.mark.parametrize("mode", ["head", "proj"])
def test_prelude_on_the_gpu_table_equals_the_reference(mode):
    c = GPTConfig(vocab_size=5, context_length=8, d_model=8, n_heads=2, n_kv_heads=1, d_qk=4, d_head=3, n_blocks=1,
                  norm="rmsnorm", mlp="swiglu", position_encoding="rope", bias=False, qk_norm=mode)
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((1, 3, 2 * 4 + 4 + 3))
    wq, wk = (1 + 0.3 * rng.standard_normal(n) for n in ((4, 4) if mode == "head" else (8, 4)))
    delta = rng.standard_normal(qkv.shape)
    K = table("float64")

    def run(K, arr, to):
        w = SimpleNamespace(q_norm=Norm(to(wq), None), k_norm=Norm(to(wk), None))
        g = SimpleNamespace(q_norm=Norm(to(np.zeros_like(wq)), None), k_norm=Norm(to(np.zeros_like(wk)), None))
        y, cache = prelude.forward(K, c, 0, to(arr.copy()), w, None)
        d = prelude.backward(K, c, to(delta.copy()), cache, g)
        return [np.asarray(numpy(a) if hasattr(a, "detach") else a) for a in (y, d, g.q_norm.weight, g.k_norm.weight)]

    got = run(K, qkv, tensor)
    want = run(reference, qkv, lambda a: a)
    for a, b, what in zip(got, want, ("y", "Δ_qkv", "dw_q", "dw_k")):
        # the same float64 formulas, sums in another order: a few dozen ε64 of values of order 1
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12, err_msg=what)

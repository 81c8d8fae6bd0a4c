"""The GPU's RoPE (:mod:`pedestrian.gpu.rope`) against the reference layer: grouped-query and
multi-query heads, odd head widths and a partial rotation, default and explicit (per-row)
positions, Llama 3's frequency scaling, float32 and float64; the kernel turns ``qkv`` in place
and leaves the value columns untouched.

Tolerance: each output is ``x_a cos − x_b sin`` (two products and a sum: 3 roundings on each side,
``≤ 3u(|x_a| + |x_b|)``), and the angles are the reference's float64 angles rounded once, where
torch's and NumPy's ``cos``, ``sin`` of one float64 angle may differ by an ulp of float64 (and so,
rarely, by an ulp of the rounded float32): ``bound(0, 8, 2·max|x|)``.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import DTYPES, assert_close, bound, numpy, table, tensor

from pedestrian import layers
from pedestrian.config import RopeScaling

CASES = {                      # n_heads, n_kv_heads, d_qk, d_head, rotated
    "mha-even": (2, 2, 8, 8, None),
    "gqa-4:2-odd-width": (4, 2, 5, 3, None),
    "mqa-4:1-partial": (4, 1, 10, 6, 4),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("positions", ["default", "per-row", "scaled"])
def test_rope_forward_and_backward_equal_the_reference(case, positions, dtype):
    K = table(dtype)
    H, H_kv, d_qk, d_head, rotated = CASES[case]
    B, T = (3, 7) if positions == "per-row" else (1, 19)
    width = H * d_qk + H_kv * (d_qk + d_head)
    rng = np.random.default_rng(width)
    qkv = rng.normal(0.0, 1.0, (B, T, width)).astype(dtype)
    delta = rng.normal(0.0, 1.0, (B, T, width)).astype(dtype)
    kwargs = dict(base=10_000.0, rotated=rotated, n_kv_heads=H_kv)
    pos = None
    if positions == "per-row":
        pos = np.stack([np.arange(T) + k for k in (0, 5, 300)])             # left-padded rows, a cache
    if positions == "scaled":
        kwargs.update(base=500_000.0, scaling=RopeScaling(8.0, 1.0, 4.0, 8))
    want, _ = layers.rope_forward(qkv, H, d_qk, pos, **kwargs)
    given = tensor(qkv)
    got, cache = K.rope_forward(given, H, d_qk, None if pos is None else tensor(pos), **kwargs)
    assert got.data_ptr() == given.data_ptr()                               # turned in place
    v = H * d_qk + H_kv * d_qk
    np.testing.assert_array_equal(numpy(got)[..., v:], qkv[..., v:])         # values untouched
    tol = bound(0, 8, 2 * np.abs(qkv).max(), dtype)
    assert_close(got, want, tol, "y")
    _, cache_ref = layers.rope_forward(qkv, H, d_qk, pos, **kwargs)
    want_in = layers.rope_backward(delta, cache_ref)
    got_in = K.rope_backward(tensor(delta), cache)
    assert_close(got_in, want_in, bound(0, 8, 2 * np.abs(delta).max(), dtype), "Δ_in")


def test_odd_rotation_is_refused_by_name():
    K = table("float32")
    with pytest.raises(ValueError, match="RoPE rotates an even number"):
        K.rope_forward(tensor(np.zeros((1, 2, 12), np.float32)), 1, 4, rotated=3)

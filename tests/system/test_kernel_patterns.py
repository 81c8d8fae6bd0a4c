"""Patterns the fast kernels avoid (docs/kernels.md, "Patterns the fast kernels avoid"; issue 22).

The fault the fast path shipped with was not in a formula: the tiled attention wrote ``−ℓ`` into
the spare column of an augmented array with ``np.negative(column, out=other_column)``, and
NumPy 2.4.6's ``negative`` loop (x86-64 wheel) returns wrong numbers for an input of stride 64
bytes (float64) or 16 bytes (float32) when the output is strided too -- heads of width 7
(float64) or 3 (float32) made those strides, and the backward came out wrong by up to 10^100.
The smallest reproduction is :func:`_numpy_negative_is_wrong`.

The fast kernels' arithmetic now runs in numba loops, not in NumPy's SIMD loops; what they
still hand NumPy is copies (``np.copyto`` of heads into contiguous arrays) and elementwise
operations on contiguous arrays. The test below runs the shapes that met the fault.
"""

from __future__ import annotations

import numpy as np
import pytest



def _numpy_negative_is_wrong(dtype) -> bool:
    """The reproduction: 37 numbers 8 (float64) / 4 (float32) elements apart, negated into every
    other element of another array. NumPy 2.4.6 on x86-64 (AVX2 dispatch) gets 36 of them wrong."""
    step = 64 // np.dtype(dtype).itemsize
    a = np.arange(1.0, step * 37 + 1, dtype=dtype)[::step]
    out = np.zeros(2 * 37, dtype=dtype)[::2]
    np.negative(a, out=out)
    return not np.array_equal(out, -a)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_tiled_attention_right_where_numpy_negative_is_wrong(dtype):
    """The shapes that met the NumPy fault (``d_head + 1`` = 64 bytes of ``dtype``) give the
    full-matrix kernel's results, whether or not this NumPy has the fault (it is reported in
    the test's output, ``pytest -s``). Tolerances: float64 as tests/paper/test_s4_attention_tiled.py
    (same sums in another order, 1e-12); float32 ``1e-4`` (its float32 bound)."""
    from pedestrian.kernels.attention_tiled import tiled_attention_backward, tiled_attention_forward
    from pedestrian.layers import attention as reference

    print(f"NumPy {np.__version__}: np.negative into a strided output wrong for {dtype}: "
          f"{_numpy_negative_is_wrong(dtype)}")
    d_head = 64 // np.dtype(dtype).itemsize - 1                 # 7 (float64) or 15 (float32)
    n_heads, d_qk, T = 2, 5, 300
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((1, T, n_heads * (2 * d_qk + d_head))).astype(dtype)
    out, cache = tiled_attention_forward(qkv, n_heads, d_qk, d_head, causal=True)
    delta = rng.standard_normal(out.shape).astype(dtype)
    dqkv, _ = tiled_attention_backward(delta, cache)
    ref_out, ref_cache = reference.multi_head_attention_forward(qkv.astype(np.float64), n_heads, d_qk, d_head)
    ref_dqkv, _ = reference.multi_head_attention_backward(delta.astype(np.float64), ref_cache)
    tol = 1e-12 if dtype == "float64" else 1e-4
    for got, ref in ((out, ref_out), (dqkv, ref_dqkv)):
        assert np.max(np.abs(got - ref)) <= tol * np.max(np.abs(ref))

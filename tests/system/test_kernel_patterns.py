"""Patterns the fast kernels avoid (docs/kernels.md, "Patterns the fast kernels avoid"; issue 22).

The fault the fast path shipped with was not in a formula: the tiled attention wrote ``−ℓ`` into
the spare column of an augmented array with ``np.negative(column, out=other_column)``, and
NumPy 2.4.6's ``negative`` loop (x86-64 wheel) returns wrong numbers for an input of stride 64
bytes (float64) or 16 bytes (float32) when the output is strided too -- heads of width 7
(float64) or 3 (float32) made those strides, and the backward came out wrong by up to 10^100.
The smallest reproduction is :func:`_numpy_negative_is_wrong`.

The kernels now hand NumPy's arithmetic loops (``elementwise_lib``: add, subtract, multiply,
divide, exp, log, sqrt, tanh, reductions) only arrays whose innermost loop is unit-stride
(:func:`unit_inner_stride`); a column of an augmented array, or a head of
width 1 seen across its rows, is written by a plain copy (``copy_into``) from a contiguous
array. :func:`test_kernels_never_loop_over_a_column` checks every call over shapes that make
such views (head widths 1, 3, 7; tiled and full attention; a KV-cache step; batch 1 on the
kernels' threads), whatever NumPy version is installed.
"""

from __future__ import annotations

import numpy as np
import pytest

import pedestrian.kernels.blas as blas
from gradcheck import build_model, token_batch
from pedestrian.kv_cache import KVCache
from torch_reference import default_cfg, random_params


def unit_inner_stride(a: np.ndarray) -> bool:
    """Whether the innermost loop an elementwise function runs over ``a`` is unit-stride: the last
    axis longer than 1 has a stride of one element (or 0, a broadcast), or ``a`` holds one element."""
    axes = [st for n, st in zip(a.shape, a.strides) if n > 1]
    return not axes or axes[-1] in (a.itemsize, 0)


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


class _ColumnChecker:
    """NumPy's elementwise namespace (``blas._NUMPY_LIB``) with every call checked: each array
    argument and ``out=`` must have a unit-stride innermost loop."""

    def __init__(self, inner):
        self._inner = inner
        self.calls = 0

    def __getattr__(self, name):
        func = getattr(self._inner, name)
        if not callable(func):
            return func

        def checked(*args, **kwargs):
            out = kwargs.get("out")
            for a in (*args, *(out if isinstance(out, tuple) else (out,))):
                if isinstance(a, np.ndarray):
                    assert unit_inner_stride(a), (f"{name}: an array of shape {a.shape}, strides {a.strides} "
                                                  "(a strided innermost loop)")
            self.calls += 1
            return func(*args, **kwargs)

        return checked


#: (B, T, n_heads, d_head, d_qk): widths 1, 3, 7 (the views that become columns), full and tiled
SHAPES = [(1, 5, 1, 1, 1), (3, 70, 2, 3, 7), (2, 300, 3, 1, 1), (1, 300, 2, 7, 3), (1, 257, 1, 3, 7)]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("B,T,n_heads,d_head,d_qk", SHAPES)
@pytest.mark.parametrize("loops", [True, False], ids=["numba", "numpy"])
def test_kernels_never_loop_over_a_column(B, T, n_heads, d_head, d_qk, dtype, loops, monkeypatch):
    """With numba most of the attention is loops (few or no NumPy calls to check); without it
    (``attention_loops.USE = False``, as where numba is missing) the NumPy code runs, and the
    checker must have seen it."""
    from pedestrian.kernels import attention_loops

    monkeypatch.setattr(attention_loops, "USE", loops and attention_loops.USE)
    checker = _ColumnChecker(blas._NUMPY_LIB)
    monkeypatch.setattr(blas, "_NUMPY_LIB", checker)
    cfg = default_cfg(vocab_size=13, context_length=T + 2, d_model=8, n_heads=n_heads, n_blocks=1,
                      d_head=d_head, d_qk=d_qk, ln_eps=0.0)
    model = build_model(cfg, random_params(cfg, seed=1), dtype=dtype, kernels="fast")
    tokens, targets = token_batch(cfg, B, T, n_ignored=1)
    model.loss(tokens, targets)
    model.backward(keep_deltas=True)
    model.attention_weights()
    cache = KVCache(model, batch_size=B)                        # a prompt, then one generated token
    model.forward(tokens[:, :3], kv_cache=cache)
    model.forward(tokens[:, 3:4], kv_cache=cache)
    assert checker.calls > 0 or loops

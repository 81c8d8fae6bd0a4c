"""The numba loops of the fast attention (`pedestrian.kernels.attention_loops`, sections 3-4).

The fast attention runs its softmax, the tiles' ``exp`` and a KV-cache step as numba loops.
They must give the reference's numbers:

- the vectorised ``exp`` against ``np.exp`` over the whole float range (subnormals, ±∞, NaN);
- the full-matrix attention, forward, backward, ``Δcausal`` and ``P``, against the reference
  layer; the tiled one against the kernel's torch loop (what a GPU runs) (float64: 1e-12 of
  the largest entry; float32: a few ε32);
- the KV-cache step (one to :data:`DECODE_MAX_T` new tokens, padded rows, causal or not) against
  the reference layer, cache contents included;
- the parallel head loops against their serial twin, and a NaN still reaching the output.
"""

from __future__ import annotations

import numpy as np
import pytest

from pedestrian.backend import to_numpy
from pedestrian.kernels import attention as fast_attention
from pedestrian.kernels import attention_loops
from pedestrian.kernels.schedule import DECODE_MAX_T
from pedestrian.kernels.jit import AVAILABLE
from pedestrian.kernels.attention_tiled import tiled_attention_backward, tiled_attention_forward
from pedestrian.layers import KVBlock
from pedestrian.layers import attention as reference_attention

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")

DTYPES = pytest.mark.parametrize("dtype", [np.float64, np.float32])


def _tol(dtype) -> float:
    """Relative to the largest entry: two orders of the same float64 sums (RTOL_ROUNDING), or a
    float32 softmax with sums of up to a few hundred terms."""
    return 1e-12 if dtype == np.float64 else 2e-5


def _close(a, b, dtype, name) -> None:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, name
    scale = max(float(np.max(np.abs(b))), 1e-30)
    err = float(np.max(np.abs(a - b))) if a.size else 0.0
    assert err <= _tol(dtype) * scale, f"{name}: {err:.2e} > {_tol(dtype):.0e} × {scale:.2e}"


if AVAILABLE:
    from pedestrian.kernels.jit import kernel

    @kernel
    def _exp_in_place(y):
        for i in range(y.shape[0]):
            y[i] = attention_loops.exp(y[i])


@DTYPES
def test_exp_matches_numpy_over_the_whole_range(dtype):
    info = np.finfo(dtype)
    rng = np.random.default_rng(0)
    edges = [-np.inf, np.inf, np.nan, 0.0, -0.0, 1e-30, -1e-30, np.log(info.max) * 0.999,
             np.log(info.max) * 1.001, np.log(info.tiny), np.log(info.tiny) - 5, np.log(info.tiny) - 50]
    x = np.concatenate([edges, rng.uniform(-800, 800, 20_000), rng.standard_normal(20_000) * 5]).astype(dtype)
    y = x.copy()
    _exp_in_place(y)
    with np.errstate(over="ignore"):
        ref = np.exp(x)
        exact = np.exp(x.astype(np.longdouble))                           # the truth, to a few bits more
    assert np.array_equal(np.isnan(y), np.isnan(ref)) and np.array_equal(np.isinf(y), np.isinf(ref))
    finite = np.isfinite(ref)
    normal = finite & (ref >= info.tiny)
    rel = np.abs(y[normal].astype(np.longdouble) - exact[normal]) / exact[normal]
    assert rel.max() <= 2 * info.eps                                    # measured 1.5 ε32, 1.0 ε64
    assert np.abs(y[finite & ~normal] - ref[finite & ~normal]).max() <= info.smallest_subnormal
    assert y[0] == 0.0 and y[1] == np.inf


def _qkv(B, T, H, d_qk, d_head, dtype, seed=0):
    rng = np.random.default_rng(seed)
    qkv = (rng.standard_normal((B, T, H * (2 * d_qk + d_head))) * 2).astype(dtype)
    delta = rng.standard_normal((B, T, H * d_head)).astype(dtype)
    return qkv, delta


@DTYPES
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("shape", [(2, 7, 3, 4, 5), (1, 33, 2, 1, 3), (3, 64, 4, 8, 8)])
def test_full_matrix_loops_match_reference(shape, causal, dtype):
    B, T, H, d_qk, d_head = shape
    qkv, delta = _qkv(B, T, H, d_qk, d_head, dtype)
    out, cache = fast_attention.multi_head_attention_forward(qkv, H, d_qk, d_head, causal=causal)
    dqkv, kept = fast_attention.multi_head_attention_backward(delta, cache, keep_delta_causal=True)
    dqkv_only, _ = fast_attention.multi_head_attention_backward(delta, cache)
    ours = [a.copy() for a in (out, fast_attention.attention_weights(cache), dqkv, kept, dqkv_only)]
    ref_out, ref_cache = reference_attention.multi_head_attention_forward(qkv, H, d_qk, d_head, causal=causal)
    ref_dqkv, ref_kept = reference_attention.multi_head_attention_backward(delta, ref_cache, keep_delta_causal=True)
    refs = (ref_out, ref_cache["p"], ref_dqkv, ref_kept, ref_dqkv)
    for name, a, b in zip(("out", "P", "dqkv", "Δcausal", "dqkv (Δcausal not kept)"), ours, refs):
        _close(a, b, dtype, name)
    if causal:                                                          # masked entries exactly 0
        upper = np.triu(np.ones((T, T), bool), 1)
        assert not ours[1][..., upper].any() and not ours[3][..., upper].any()


@DTYPES
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("T, blocks", [(100, (16, 32)), (70, (32, 16)), (256, (128, 256))])
def test_tiled_loops_match_the_torch_loop(T, blocks, causal, dtype):
    import torch

    H, d_qk, d_head = 2, 3, 5
    qkv, delta = _qkv(2, T, H, d_qk, d_head, dtype, seed=1)

    def run(qkv, delta):
        out, cache = tiled_attention_forward(qkv, H, d_qk, d_head, causal=causal,
                                             block_q=blocks[0], block_k=blocks[1])
        dqkv, kept = tiled_attention_backward(delta, cache, keep_delta_causal=True)
        return [to_numpy(a).copy() for a in (out, dqkv, kept)]

    loops, torch_loop = run(qkv, delta), run(torch.from_numpy(qkv), torch.from_numpy(delta))
    for name, a, b in zip(("out", "dqkv", "Δcausal"), loops, torch_loop):
        _close(a, b, dtype, name)


@DTYPES
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("T", [1, 3, DECODE_MAX_T, DECODE_MAX_T + 1])
@pytest.mark.parametrize("padded", [False, True], ids=["", "padded"])
def test_kv_cache_step_matches_reference(T, causal, padded, dtype):
    B, H, d_qk, d_head, L0, capacity = 3, 2, 4, 6, 11, 32
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((B, H, capacity, d_qk)).astype(dtype)
    values = rng.standard_normal((B, H, capacity, d_head)).astype(dtype)
    qkv, _ = _qkv(B, T, H, d_qk, d_head, dtype, seed=3)
    key_start = np.array([0, 4, L0 + 1]) if padded else None              # row 2: its new tokens' own keys
    fast_block = KVBlock(keys.copy(), values.copy(), L0, key_start)
    ref_block = KVBlock(keys.copy(), values.copy(), L0, key_start)
    out, cache = fast_attention.multi_head_attention_forward(qkv, H, d_qk, d_head, causal=causal, kv_cache=fast_block)
    ref, ref_cache = reference_attention.multi_head_attention_forward(qkv, H, d_qk, d_head, causal=causal,
                                                                      kv_cache=ref_block)
    _close(out, ref, dtype, "out")
    _close(fast_attention.attention_weights(cache), ref_cache["p"], dtype, "P")
    assert np.array_equal(fast_block.keys, ref_block.keys) and np.array_equal(fast_block.values, ref_block.values)
    with pytest.raises(ValueError, match="KV-cache"):
        fast_attention.multi_head_attention_backward(out, cache)


class _Serial:
    """A parallel kernel whose every call runs its serial compilation."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, *args):
        return self.kernel.serial(*args)


def test_parallel_loops_match_their_serial_twin(monkeypatch):
    qkv, delta = _qkv(4, 50, 3, 4, 4, np.float64, seed=4)
    out, cache = fast_attention.multi_head_attention_forward(qkv, 3, 4, 4)
    dqkv, _ = fast_attention.multi_head_attention_backward(delta, cache)
    out, dqkv = out.copy(), dqkv.copy()
    for name in ("heads_forward", "heads_backward"):                    # the serial versions
        monkeypatch.setattr(attention_loops, name, _Serial(getattr(attention_loops, name)))
    out_1, cache_1 = fast_attention.multi_head_attention_forward(qkv, 3, 4, 4)
    dqkv_1, _ = fast_attention.multi_head_attention_backward(delta, cache_1)
    _close(out_1, out, np.float64, "out")
    _close(dqkv_1, dqkv, np.float64, "dqkv")


@pytest.mark.parametrize("T", [20, 300], ids=["full", "tiled"])
def test_nan_reaches_the_output(T):
    qkv, delta = _qkv(1, T, 2, 4, 4, np.float32, seed=5)
    qkv[0, T // 2, 3] = np.nan                                           # one query entry
    with np.errstate(invalid="ignore"):
        out, cache = fast_attention.multi_head_attention_forward(qkv, 2, 4, 4)
        dqkv, _ = fast_attention.multi_head_attention_backward(delta, cache)
    assert np.isnan(out[0, T // 2]).any() and np.isnan(dqkv).any()

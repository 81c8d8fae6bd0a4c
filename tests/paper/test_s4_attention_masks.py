"""The attention's masks and scores beyond the causal mask (EQUATIONS.md "Exact zeros", "Packed
segments", "Sliding window", "Score scale and soft-cap"), on every CPU path:

- exact causal zeros: a loss at query ``t`` only sends exactly ``0.0`` (``==``) to ``q``, ``k``, ``v``
  after ``t`` (reference, fast full-matrix, tiled loops, tiled torch loop; float64 and float32),
  and a loss on one packed segment exactly 0 to the others;
- the reference forward and backward against PyTorch autograd (float64, 1e-12 of the largest
  entry: the same sums in another order) for every mask, window, segments, soft-cap and scale,
  and against central finite differences;
- the fast and tiled paths against the reference over the shape space (odd/even widths, batch
  1-3, grouped heads, float64 and float32), with masked entries of ``P`` and ``Δcausal`` exactly 0;
- the KV-cache step of a sliding-window block (a ring of ``w`` slots) against the full recompute.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pedestrian.backend import to_numpy
from pedestrian.kernels import attention as fast_attention
from pedestrian.kernels.attention_tiled import tiled_attention_backward, tiled_attention_forward
from pedestrian.kernels.jit import AVAILABLE
from pedestrian.layers import KVBlock
from pedestrian.layers import attention as reference_attention

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")

DTYPES = pytest.mark.parametrize("dtype", [np.float64, np.float32])

#: name -> (window, segments maker or None, softcap, scale factor or None)
MASKS = {
    "causal": (None, None, None, None),
    "window": (3, None, None, None),
    "segments": (None, "segments", None, None),
    "window+segments": (2, "segments", None, None),
    "softcap": (None, None, 1.5, None),
    "scale": (None, None, None, 0.37),
    "all": (3, "segments", 0.8, 1.3),
}


def _segments(B: int, T: int, seed: int = 0) -> np.ndarray:
    """``(B, T)`` nondecreasing ids, 1 to 3 segments per row, one row with a single segment."""
    rng = np.random.default_rng(seed)
    rows = []
    for b in range(B):
        cuts = sorted(rng.choice(np.arange(1, T), size=min(b % 3, T - 1), replace=False)) if T > 1 else []
        rows.append(np.searchsorted(cuts, np.arange(T), side="right") + 5 * b)
    return np.stack(rows).astype(np.int64)


def _kwargs(name: str, B: int, T: int, d_qk: int) -> dict:
    window, seg, cap, scale = MASKS[name]
    return dict(window=window, segments=None if seg is None else _segments(B, T),
                softcap=cap, scale=None if scale is None else scale / math.sqrt(d_qk))


def _qkv(B, T, H, H_kv, d_qk, d_head, dtype, seed=0):
    rng = np.random.default_rng(seed)
    qkv = (rng.standard_normal((B, T, H * d_qk + H_kv * (d_qk + d_head))) * 2).astype(dtype)
    delta = rng.standard_normal((B, T, H * d_head)).astype(dtype)
    return qkv, delta


def _allowed(B, T, causal, window, segments) -> np.ndarray:
    """The rule written out per entry: query ``i`` sees key ``j`` iff ``j <= i`` (causal),
    ``i − w < j`` (window) and ``segments[b, j] == segments[b, i]``; ``(B, T, T)``."""
    ok = np.ones((B, T, T), bool)
    for b in range(B):
        for i in range(T):
            for j in range(T):
                ok[b, i, j] = ((not causal or j <= i) and (window is None or i - window < j)
                               and (segments is None or segments[b, j] == segments[b, i]))
    return ok


def _autograd(qkv, delta, H, H_kv, d_qk, d_head, causal, window=None, segments=None, softcap=None, scale=None):
    """PyTorch autograd of ``Σ out ∘ Δ`` with the mask of :func:`_allowed`, float64."""
    B, T, _ = qkv.shape
    x = torch.tensor(qkv, dtype=torch.float64, requires_grad=True)
    q = x[..., :H * d_qk].reshape(B, T, H, d_qk).transpose(1, 2)
    k = x[..., H * d_qk:(H + H_kv) * d_qk].reshape(B, T, H_kv, d_qk).transpose(1, 2)
    v = x[..., (H + H_kv) * d_qk:].reshape(B, T, H_kv, d_head).transpose(1, 2)
    k, v = k.repeat_interleave(H // H_kv, dim=1), v.repeat_interleave(H // H_kv, dim=1)
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(d_qk) if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    ok = torch.from_numpy(_allowed(B, T, causal, window, segments))[:, None]
    p = torch.softmax(s.masked_fill(~ok, -math.inf), dim=-1)
    out = (p @ v).transpose(1, 2).reshape(B, T, H * d_head)
    (out * torch.tensor(delta, dtype=torch.float64)).sum().backward()
    return out.detach().numpy(), x.grad.numpy()


def _close(a, b, tol, name) -> None:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, name
    scale = max(float(np.max(np.abs(b))), 1e-30)
    err = float(np.max(np.abs(a - b))) if a.size else 0.0
    assert err <= tol * scale, f"{name}: {err:.2e} > {tol:.0e} × {scale:.2e}"


def _tol(dtype) -> float:
    """Relative to the largest entry: the same float64 sums in another order, or a float32
    softmax of a few dozen terms (as tests/paper/test_s4_attention_loops.py)."""
    return 1e-12 if dtype == np.float64 else 2e-5


# ---------------------------------------------------------------------------------------------- oracles
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)], ids=["mha", "gqa"])
def test_reference_matches_autograd(mask, heads):
    H, H_kv = heads
    B, T, d_qk, d_head = 3, 9, 3, 4
    kw = _kwargs(mask, B, T, d_qk)
    qkv, delta = _qkv(B, T, H, H_kv, d_qk, d_head, np.float64, seed=1)
    out, cache = reference_attention.multi_head_attention_forward(qkv, H, d_qk, d_head, n_kv_heads=H_kv, **kw)
    dqkv, _ = reference_attention.multi_head_attention_backward(delta, cache)
    ref_out, ref_dqkv = _autograd(qkv, delta, H, H_kv, d_qk, d_head, True, **kw)
    _close(out, ref_out, 1e-12, "out")
    _close(dqkv, ref_dqkv, 1e-12, "dqkv")


@pytest.mark.parametrize("mask", ["window+segments", "softcap", "all"])
def test_reference_matches_finite_differences(mask):
    """Central differences of ``f = Σ out ∘ R`` at 12 entries of ``qkv`` (float64): step
    ``h = 1e-5`` leaves a truncation error ``h²/6·|f'''| ~ 1e-10`` and a rounding error
    ``ε·|f|/h ~ 1e-11`` (``|f|, |f'''| = O(1..10)``): within 1e-7 of the largest gradient entry."""
    B, T, H, d_qk, d_head = 2, 7, 2, 3, 2
    kw = _kwargs(mask, B, T, d_qk)
    qkv, delta = _qkv(B, T, H, H, d_qk, d_head, np.float64, seed=2)

    def f(x):
        return float(np.sum(reference_attention.multi_head_attention_forward(x, H, d_qk, d_head, **kw)[0] * delta))

    _, cache = reference_attention.multi_head_attention_forward(qkv, H, d_qk, d_head, **kw)
    grad, _ = reference_attention.multi_head_attention_backward(delta, cache)
    rng, h = np.random.default_rng(3), 1e-5
    for _ in range(12):
        idx = tuple(int(rng.integers(n)) for n in qkv.shape)
        up, down = qkv.copy(), qkv.copy()
        up[idx] += h
        down[idx] -= h
        numeric = (f(up) - f(down)) / (2 * h)
        assert abs(numeric - grad[idx]) <= 1e-7 * np.max(np.abs(grad)), (idx, numeric, grad[idx])


# ---------------------------------------------------------------------------------------------- fast paths
@DTYPES
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("shape", [(2, 7, 3, 3, 4, 5), (1, 33, 2, 1, 1, 3), (3, 20, 4, 2, 8, 8)],
                         ids=["B2-odd", "B1-mqa", "B3-gqa"])
def test_full_matrix_loops_match_reference(shape, mask, dtype):
    B, T, H, H_kv, d_qk, d_head = shape
    kw = _kwargs(mask, B, T, d_qk)
    qkv, delta = _qkv(B, T, H, H_kv, d_qk, d_head, dtype, seed=4)
    out, cache = fast_attention.multi_head_attention_forward(qkv, H, d_qk, d_head, n_kv_heads=H_kv, **kw)
    dqkv, kept = fast_attention.multi_head_attention_backward(delta, cache, keep_delta_causal=True)
    p = fast_attention.attention_weights(cache)
    ref_out, ref_cache = reference_attention.multi_head_attention_forward(qkv, H, d_qk, d_head, n_kv_heads=H_kv, **kw)
    ref_dqkv, ref_kept = reference_attention.multi_head_attention_backward(delta, ref_cache, keep_delta_causal=True)
    for name, a, b in (("out", out, ref_out), ("P", p, reference_attention.attention_weights(ref_cache)),
                       ("dqkv", dqkv, ref_dqkv), ("Δcausal", kept, ref_kept)):
        _close(a, b, _tol(dtype), name)
    masked = ~_allowed(B, T, True, kw["window"], kw["segments"])[:, None]   # (B, 1, T, T)
    assert not np.broadcast_to(masked, p.shape)[p != 0].any() and not np.broadcast_to(masked, kept.shape)[kept != 0].any()


@DTYPES
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("T, blocks", [(37, (8, 16)), (50, (16, 8))])
def test_tiled_matches_reference(T, blocks, mask, dtype):
    """The tiled numba loops and the tiled torch loop (what a GPU runs) against the reference."""
    B, H, H_kv, d_qk, d_head = 2, 4, 2, 3, 5
    kw = _kwargs(mask, B, T, d_qk)
    qkv, delta = _qkv(B, T, H, H_kv, d_qk, d_head, dtype, seed=5)
    ref_out, ref_cache = reference_attention.multi_head_attention_forward(qkv, H, d_qk, d_head, n_kv_heads=H_kv, **kw)
    ref_dqkv, ref_kept = reference_attention.multi_head_attention_backward(delta, ref_cache, keep_delta_causal=True)
    ref_p = reference_attention.attention_weights(ref_cache)
    for wrap in (np.asarray, torch.from_numpy):
        seg = kw["segments"]
        out, cache = tiled_attention_forward(wrap(qkv), H, d_qk, d_head, n_kv_heads=H_kv, block_q=blocks[0],
                                             block_k=blocks[1], **dict(kw, segments=None if seg is None else wrap(seg)))
        dqkv, kept = tiled_attention_backward(wrap(delta), cache, keep_delta_causal=True)
        p = fast_attention.attention_weights(cache)
        for name, a, b in (("out", out, ref_out), ("dqkv", dqkv, ref_dqkv), ("Δcausal", kept, ref_kept), ("P", p, ref_p)):
            _close(to_numpy(a), b, _tol(dtype), f"{wrap.__name__} {name}")


# ---------------------------------------------------------------------------------------------- exact zeros
def _paths():
    def reference(qkv, H, d, **kw):
        return reference_attention.multi_head_attention_forward(qkv, H, d, d, **kw), \
            reference_attention.multi_head_attention_backward

    def fast(qkv, H, d, **kw):
        return fast_attention.multi_head_attention_forward(qkv, H, d, d, **kw), fast_attention.multi_head_attention_backward

    def tiled(qkv, H, d, **kw):
        return tiled_attention_forward(qkv, H, d, d, block_q=4, block_k=8, **kw), tiled_attention_backward

    def tiled_torch(qkv, H, d, **kw):
        seg = kw.get("segments")
        kw = dict(kw, segments=None if seg is None else torch.from_numpy(seg))
        return tiled_attention_forward(torch.from_numpy(qkv), H, d, d, block_q=4, block_k=8, **kw), \
            tiled_attention_backward
    return {"reference": reference, "fast": fast, "tiled": tiled, "tiled-torch": tiled_torch}


PATHS = _paths()


@DTYPES
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("t", [0, 5, 10])
def test_loss_at_t_sends_exactly_zero_after_t(path, t, dtype):
    """Δ at query ``t`` only: ``dq``, ``dk``, ``dv`` of every position after ``t`` are ``== 0``.
    The keys share a mean 100x their spread (the float32 correction's case, where a mean over
    every key would put ``−mean(dk)`` on them)."""
    B, T, H, d = 2, 13, 2, 4
    qkv, delta = _qkv(B, T, H, H, d, d, dtype, seed=6)
    qkv[..., H * d:2 * H * d] += np.asarray(100.0, dtype)
    delta[:, np.arange(T) != t] = 0.0
    (out, cache), backward = PATHS[path](qkv, H, d)
    dqkv = to_numpy(backward(torch.from_numpy(delta) if path == "tiled-torch" else delta, cache)[0])
    assert np.all(dqkv[:, t + 1:] == 0.0), np.abs(dqkv[:, t + 1:]).max()
    assert np.any(dqkv[:, :t + 1] != 0.0)


@DTYPES
@pytest.mark.parametrize("path", list(PATHS))
def test_loss_on_one_segment_sends_exactly_zero_to_the_others(path, dtype):
    B, T, H, d = 2, 12, 2, 3
    seg = np.array([[0] * 4 + [1] * 5 + [2] * 3, [7] * 12])
    qkv, delta = _qkv(B, T, H, H, d, d, dtype, seed=7)
    qkv[..., H * d:2 * H * d] += np.asarray(50.0, dtype)
    delta[0, seg[0] != 1] = 0.0                                          # row 0: a loss on segment 1 only
    (out, cache), backward = PATHS[path](qkv, H, d, segments=seg)
    dqkv = to_numpy(backward(torch.from_numpy(delta) if path == "tiled-torch" else delta, cache)[0])
    assert np.all(dqkv[0, seg[0] != 1] == 0.0)
    assert np.any(dqkv[0, seg[0] == 1] != 0.0) and np.any(dqkv[1] != 0.0)


# ---------------------------------------------------------------------------------------------- KV cache
@DTYPES
@pytest.mark.parametrize("kernels", ["fast", "reference"])
@pytest.mark.parametrize("steps", [(5, 1, 1, 1, 3, 1, 6), (2, 7, 1), (9,)], ids=["prompt-tokens", "chunks", "one"])
def test_ring_cache_steps_match_the_full_recompute(kernels, steps, dtype):
    """A sliding-window block's cache is a ring of ``w`` slots; the steps' outputs equal the
    rows of one windowed forward over the whole sequence (float64 1e-12; float32 2e-5)."""
    module = fast_attention if kernels == "fast" else reference_attention
    B, H, H_kv, d_qk, d_head, w = 2, 4, 2, 3, 5, 4
    T = sum(steps)
    qkv, _ = _qkv(B, T, H, H_kv, d_qk, d_head, dtype, seed=8)
    full, _ = reference_attention.multi_head_attention_forward(qkv, H, d_qk, d_head, n_kv_heads=H_kv, window=w)
    keys, values = np.zeros((B, H_kv, w, d_qk), dtype), np.zeros((B, H_kv, w, d_head), dtype)
    at = 0
    for n in steps:
        block = KVBlock(keys, values, at, None, w, 0)
        out, _ = module.multi_head_attention_forward(qkv[:, at:at + n], H, d_qk, d_head, n_kv_heads=H_kv,
                                                     kv_cache=block, window=w)
        _close(out, full[:, at:at + n], _tol(dtype), f"step at {at}")
        at += n


def test_bad_mask_arguments_are_refused():
    qkv, _ = _qkv(2, 5, 2, 2, 3, 3, np.float64)
    for kw, match in ((dict(window=0), "window"), (dict(softcap=-1.0), "softcap"),
                      (dict(segments=np.zeros((2, 4), np.int64)), "segments"),
                      (dict(segments=np.array([[0, 1, 0, 1, 1]] * 2)), "nondecreasing")):
        with pytest.raises(ValueError, match=match):
            fast_attention.multi_head_attention_forward(qkv, 2, 3, 3, **kw)
    block = KVBlock(np.zeros((2, 2, 8, 3)), np.zeros((2, 2, 8, 3)), 0)
    for module in (fast_attention, reference_attention):
        with pytest.raises(ValueError, match="KV cache"):
            module.multi_head_attention_forward(qkv, 2, 3, 3, kv_cache=block, segments=np.zeros((2, 5), np.int64))

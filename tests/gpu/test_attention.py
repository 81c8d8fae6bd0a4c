"""The Triton flash attention (pedestrian.gpu.attention) against the reference layer.

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set below
before the kernels are defined) on CPU torch tensors, at tiny shapes and small tiles (the
interpreter is about a thousand times slower); on a GPU the same tests run the compiled kernels
with tiles of at least 16 (``tl.dot``'s minimum) and longer sequences.

Tolerances (:func:`_bounds`) are the first-order rounding bounds of the kernel's arithmetic
(Higham's ``|fl(Σ_i x_i y_i) − Σ_i x_i y_i| <= γ_n Σ_i |x_i y_i|``, ``γ_n = n u / (1 − n u)``, ``u``
the unit roundoff of the kernel's dtype), evaluated in float64 on the absolute values of the
same products, plus the reference's own bound in float64. Per query row ``α``:

- ``S = q kᵀ s`` (``s = 1/√d_qk``): ``|δS_αβ| <= γ_{d_qk+2} (|q||k|ᵀ s)_αβ`` (the product, the scale
  and its rounding).
- ``P = exp(S − ℓ)``: a perturbation ``δS`` moves ``S − ℓ`` by at most ``2 max_β |δS_αβ|`` (``ℓ``
  is the log-sum-exp of the same row); the row sum over ``T`` keys rescaled once per tile, the
  log, the subtraction and ``exp`` (on a GPU ``ex2.approx`` of ``x·log₂e``: 2 ulp and ``|x| u``)
  add ``(2T + 8) u + 3 (max_β |S_αβ| + |ℓ_α|) u``. So ``|δP_αβ| <= ρ_α P_αβ`` with
  ``ρ_α = 2 γ_{d_qk+2} max_β (|q||k|ᵀ s)_αβ + (2T + 8) u + 3 (max_β |S_αβ| + |ℓ_α|) u``.
- ``out = P v / l``: ``(ρ_α + (2T + 4) u) (P |v|)_αc``;
  ``dv = Σ_group Pᵀ Δ``: ``Σ_group ((ρ ∘ P)ᵀ |Δ| + (gT + 1) u Pᵀ |Δ|)``.
- ``dP = Δ vᵀ``: ``γ_{d_head} |Δ||v|ᵀ``; ``D = rowsum(Δ ∘ out)``:
  ``γ_{d_head} Σ_c |Δ||out| + Σ_c |Δ| δout``.
- ``Δcausal = P ∘ (dP − D)``: ``E = P ∘ ((ρ + 2u) |dP − D| + γ_{d_head} |Δ||v|ᵀ + δD)``.
- ``dq = Δcausal (k − k_0) s`` (key 0 subtracted, module gpu.attention): ``(E |k − k_0| +
  (T + 3) u |Δcausal||k − k_0|) s``;
  ``dk = Σ_group Δcausalᵀ q s``: ``Σ_group (Eᵀ |q| + (gT + 2) u |Δcausal|ᵀ |q|) s``.

The reference (float64, full matrices) has the same bound with ``u = 2⁻⁵³``, its ``dq`` taken
from ``k − k̄`` (in place of ``k − k_0``) and its ``dk`` less its mean row (plus that
mean's bound and ``(T + 1) u`` of the mean of ``|dk|``). float64 kernels: both bounds, each
about ``1e-14`` of the entries' scale at these sizes. float32 kernels against the float64
reference on the same (exactly widened) inputs: the float32 bound, about ``(T + d) · 6e-8``
relative to the same absolute-value products, plus the reference's. Second-order terms
(``(n u)²``) are below ``1e-9`` of the bound at these sizes and are not written.
"""

from __future__ import annotations

import math
import os

import pytest

torch = pytest.importorskip("torch", reason="the Triton kernels take torch tensors")
CUDA = torch.cuda.is_available()
if not CUDA:                                    # before the kernels are defined (Triton reads it then)
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install 'pedestrian[gpu]' or triton)")

from pedestrian import layers                   # noqa: E402
from pedestrian.gpu import attention as gpu     # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = (torch.float32, torch.float64)
EPS = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}


def _sizes(T: int, block_m: int, block_n: int) -> tuple:
    """The case's sequence and tiles: as given under the interpreter; on a GPU tiles of at least
    16 and 37 more tokens, so that T still spans several tiles and ends inside one."""
    if not CUDA:
        return T, block_m, block_n
    return T + 37, max(16, block_m), max(16, block_n)


def _forward(qkv, *args, block_m=None, block_n=None, **kwargs):
    """The kernel's forward with tiles of ``block_m`` query rows, ``block_n`` key columns (set as
    :data:`pedestrian.gpu.attention.TILES` for the call; ``None``: the default's)."""
    before = gpu.TILES
    if block_m is not None or block_n is not None:
        bm, bn = gpu.default_tiles(args[1], args[2], qkv.dtype)
        gpu.TILES = (bm if block_m is None else block_m, bn if block_n is None else block_n)
    try:
        return gpu.multi_head_attention_forward(qkv, *args, **kwargs)
    finally:
        gpu.TILES = before


def _qkv(B, T, H, KV, d_qk, d_head, dtype, seed, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H * d_qk + KV * (d_qk + d_head), generator=g, dtype=torch.float64) + shift
    return x.to(dtype).to(DEVICE)


def _delta(B, T, H, d_head, dtype, seed):
    """``Δ3`` ``(B, T, H·d_head)``, standard normal."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, H * d_head, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)


def _heads(a, heads):
    """``(B, T, heads·w)`` -> ``(B, heads, T, w)``."""
    B, T, _ = a.shape
    return a.reshape(B, T, heads, -1).transpose(1, 2)


def _merge(a):
    """``(B, heads, T, w)`` -> ``(B, T, heads·w)``."""
    B, h, T, w = a.shape
    return a.transpose(1, 2).reshape(B, T, h * w)


def _bounds(qkv, delta, H, KV, d_qk, d_head, causal, u, reference=False):
    """The rounding bounds of the module docstring for unit roundoff ``u`` (float64, from the exact
    inputs): ``(a3, dq, dk, dv)`` bounds, ``(B, H, T, ·)`` / ``(B, n_kv_heads, T, ·)``. With
    ``reference``, the reference's: ``dq`` from ``k − k̄``, ``dk`` less its mean row."""
    qkv, delta = qkv.double().cpu(), delta.double().cpu()
    B, T, _ = qkv.shape
    grp = H // KV
    gamma = lambda n: n * u / (1 - n * u)                                     # noqa: E731
    q = _heads(qkv[..., :H * d_qk], H)
    k = _heads(qkv[..., H * d_qk:(H + KV) * d_qk], KV).repeat_interleave(grp, dim=1)   # per query head
    v = _heads(qkv[..., (H + KV) * d_qk:], KV).repeat_interleave(grp, dim=1)
    d = _heads(delta, H)
    s = 1.0 / math.sqrt(d_qk)
    allowed = torch.ones(T, T, dtype=torch.bool)
    if causal:
        allowed = torch.tril(allowed)
    S = (q @ k.mT * s).masked_fill(~allowed, -math.inf)
    ell = torch.logsumexp(S, -1)                                              # (B, H, T)
    P = torch.exp(S - ell[..., None])
    s_abs = (q.abs() @ k.abs().mT * s).masked_fill(~allowed, 0.0)
    s_max = S.abs().masked_fill(~allowed, 0.0).amax(-1)
    rho = 2 * gamma(d_qk + 2) * s_abs.amax(-1) + (2 * T + 8) * u + 3 * (s_max + ell.abs()) * u   # (B, H, T)
    out = P @ v
    b_out = (rho + (2 * T + 4) * u)[..., None] * (P @ v.abs())
    b_dv = (rho[..., None] * P).mT @ d.abs() + (grp * T + 1) * u * (P.mT @ d.abs())   # one sum of gT terms
    dP = d @ v.mT
    D = (d * out).sum(-1)
    b_D = gamma(d_head) * (d.abs() * out.abs()).sum(-1) + (d.abs() * b_out).sum(-1)
    dS = P * (dP - D[..., None])
    E = P * ((rho + 2 * u)[..., None] * (dP - D[..., None]).abs() + gamma(d_head) * (d.abs() @ v.abs().mT)
             + b_D[..., None])
    k_abs = (k - k.mean(-2, keepdim=True) if reference else k - k[..., :1, :]).abs()   # k − k̄ / k − k_0
    b_dq = (E @ k_abs + (T + 3) * u * (dS.abs() @ k_abs)) * s                # (+1: the subtraction)
    b_dk = (E.mT @ q.abs() + (grp * T + 2) * u * (dS.abs().mT @ q.abs())) * s
    if reference:                                                             # its mean row: bound and rounding
        b_dk = b_dk + b_dk.mean(-2, keepdim=True) + (T + 1) * u * (dS.mT @ q * s).abs().mean(-2, keepdim=True)
    group_sum = lambda a: a.reshape(B, KV, grp, T, -1).sum(2)                 # noqa: E731
    return b_out, b_dq, group_sum(b_dk), group_sum(b_dv)                     # (gT covers T, then g, terms too)


def _tolerances(qkv, delta, H, KV, d_qk, d_head, causal):
    """Kernel bound (its dtype) plus the reference's (float64), as ``(a3_tol, d_qkv_tol)``."""
    b_out, b_dq, b_dk, b_dv = _bounds(qkv, delta, H, KV, d_qk, d_head, causal, EPS[qkv.dtype])
    r_out, r_dq, r_dk, r_dv = _bounds(qkv, delta, H, KV, d_qk, d_head, causal, EPS[torch.float64], reference=True)
    tol_out = _merge(b_out + r_out)
    tol_qkv = torch.cat([_merge(b_dq + r_dq), _merge(b_dk + r_dk), _merge(b_dv + r_dv)], dim=-1)
    return tol_out, tol_qkv


def _reference(qkv, delta, H, d_qk, d_head, causal, KV):
    """The reference layer in float64 on the same (exactly widened) inputs."""
    a3, cache = layers.multi_head_attention_forward(qkv.double().cpu(), H, d_qk, d_head, causal=causal, n_kv_heads=KV)
    d_qkv, _ = layers.multi_head_attention_backward(delta.double().cpu(), cache)
    return a3, d_qkv


def _assert_within(got, want, tol, what):
    """``|got − want| <= tol`` everywhere (``tol`` 0: exactly equal)."""
    err = (got.double().cpu() - want).abs()
    worst = (err / tol.clamp_min(1e-300)).max().item()
    assert torch.isfinite(got).all() and bool((err <= tol).all()), \
        f"{what}: error {worst:.3g} × its bound (max error {err.max():.3g})"


# (B, T, n_heads, n_kv_heads, d_qk, d_head, causal, block_m, block_n): GQA 1, 2 and n_heads; causal
# and not; widths 8, 16, 32 and odd ones (5, 12 against 6); T never a multiple of both tiles
CASES = [
    (2, 13, 4, 2, 8, 8, True, 8, 4),
    (1, 11, 2, 1, 16, 16, False, 4, 8),
    (3, 7, 3, 3, 5, 6, True, 4, 4),
    (1, 19, 2, 2, 32, 32, True, 8, 16),
    (2, 9, 4, 1, 12, 6, False, 8, 8),
    (1, 17, 4, 4, 16, 8, True, 16, 8),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}kv{}dqk{}dh{}{}{}x{}".format(
    *c[:6], "causal" if c[6] else "full", *c[7:]))
def test_forward_and_backward_match_the_reference(case, dtype):
    B, T, H, KV, d_qk, d_head, causal, bm, bn = case
    T, bm, bn = _sizes(T, bm, bn)
    qkv = _qkv(B, T, H, KV, d_qk, d_head, dtype, seed=sum(case[:6]))
    delta = _delta(B, T, H, d_head, dtype, seed=7)
    a3, cache = _forward(qkv, H, d_qk, d_head, causal=causal, n_kv_heads=KV,
                                                 block_m=bm, block_n=bn)
    d_qkv, kept = gpu.multi_head_attention_backward(delta, cache)
    assert a3.dtype == dtype and d_qkv.dtype == dtype and d_qkv.shape == qkv.shape and kept is None
    want_a3, want_d_qkv = _reference(qkv, delta, H, d_qk, d_head, causal, KV)
    tol_a3, tol_qkv = _tolerances(qkv, delta, H, KV, d_qk, d_head, causal)
    _assert_within(a3, want_a3, tol_a3, "a3")
    hq, hk = H * d_qk, KV * d_qk
    for name, cols in (("dq", slice(0, hq)), ("dk", slice(hq, hq + hk)), ("dv", slice(hq + hk, None))):
        _assert_within(d_qkv[..., cols], want_d_qkv[..., cols], tol_qkv[..., cols], name)


def test_the_bound_is_not_loose_enough_to_hide_a_wrong_scale():
    """The float32 tolerance is far below the change a wrong factor makes: scaling ``dk`` by
    ``1 + 1e-3`` (as a missed ``√d`` rounding or a dropped key would, and more) breaks it."""
    B, T, H, KV, d_qk, d_head, causal, bm, bn = CASES[0]
    T, bm, bn = _sizes(T, bm, bn)
    qkv = _qkv(B, T, H, KV, d_qk, d_head, torch.float32, seed=3)
    delta = _delta(B, T, H, d_head, torch.float32, seed=4)
    _, want = _reference(qkv, delta, H, d_qk, d_head, causal, KV)
    _, tol = _tolerances(qkv, delta, H, KV, d_qk, d_head, causal)
    with pytest.raises(AssertionError):
        _assert_within((want * (1 + 1e-3)).float(), want, tol, "d_qkv scaled")


def test_against_autograd_in_float64():
    """The kernels against PyTorch autograd of the same function (the test's oracle), grouped and causal."""
    B, T, H, KV, d_qk, d_head = 2, 10, 4, 2, 8, 8
    T, bm, bn = _sizes(T, 4, 8)
    qkv = _qkv(B, T, H, KV, d_qk, d_head, torch.float64, seed=11)
    delta = _delta(B, T, H, d_head, torch.float64, seed=12)
    a3, cache = _forward(qkv, H, d_qk, d_head, causal=True, n_kv_heads=KV,
                                                 block_m=bm, block_n=bn)
    d_qkv, _ = gpu.multi_head_attention_backward(delta, cache)
    x = qkv.detach().clone().requires_grad_(True)
    q = _heads(x[..., :H * d_qk], H)
    k = _heads(x[..., H * d_qk:(H + KV) * d_qk], KV).repeat_interleave(H // KV, dim=1)
    v = _heads(x[..., (H + KV) * d_qk:], KV).repeat_interleave(H // KV, dim=1)
    future = ~torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
    s = (q @ k.mT / math.sqrt(d_qk)).masked_fill(future, -math.inf)
    want = _merge(torch.softmax(s, -1) @ v)
    (want * delta).sum().backward()
    tol_a3, tol_qkv = _tolerances(qkv, delta, H, KV, d_qk, d_head, True)     # autograd: the reference's order
    _assert_within(a3, want.detach().cpu(), tol_a3, "a3")
    _assert_within(d_qkv, x.grad.cpu(), tol_qkv, "d_qkv")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_a_loss_at_t_sends_exactly_zero_to_later_positions(dtype):
    """Issue 49, item 5: with the causal mask, a loss at position ``t`` (``Δ`` nonzero on row ``t``
    only) gives ``q``, ``k``, ``v`` after ``t`` exactly 0, and ``a3`` up to ``t`` does not change
    by a bit when ``qkv`` after ``t`` does. ``t`` ends inside a tile; grouped heads."""
    B, T, H, KV, d_qk, d_head = 2, 13, 4, 2, 8, 8
    T, bm, bn = _sizes(T, 8, 4)
    qkv = _qkv(B, T, H, KV, d_qk, d_head, dtype, seed=5, shift=3.0)         # (a key mean, as the reference's k̄)
    for t in (0, 5, T - 2):
        delta = torch.zeros(B, T, H * d_head, dtype=dtype, device=DEVICE)
        delta[:, t] = _delta(B, 1, H, d_head, dtype, seed=t)[:, 0]
        a3, cache = _forward(qkv, H, d_qk, d_head, n_kv_heads=KV, block_m=bm, block_n=bn)
        d_qkv, _ = gpu.multi_head_attention_backward(delta, cache)
        assert torch.count_nonzero(d_qkv[:, t + 1:]) == 0, f"a loss at {t} reached a later position"
        assert torch.count_nonzero(d_qkv[:, t]) > 0                          # (the test can fail)
        later = qkv.clone()
        later[:, t + 1:] = _qkv(B, T - t - 1, H, KV, d_qk, d_head, dtype, seed=99 + t)
        changed, _ = _forward(later, H, d_qk, d_head, n_kv_heads=KV, block_m=bm, block_n=bn)
        assert torch.equal(changed[:, :t + 1], a3[:, :t + 1])
        assert not torch.equal(changed[:, t + 1:], a3[:, t + 1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_two_runs_are_bitwise_equal(dtype):
    """No atomics: every number is written by one program in a fixed order (grouped dk, dv too)."""
    B, T, H, KV, d_qk, d_head = 3, 11, 4, 1, 16, 8
    T, bm, bn = _sizes(T, 4, 4)
    qkv = _qkv(B, T, H, KV, d_qk, d_head, dtype, seed=21)
    delta = _delta(B, T, H, d_head, dtype, seed=22)
    runs = []
    for _ in range(2):
        a3, cache = _forward(qkv, H, d_qk, d_head, n_kv_heads=KV, block_m=bm, block_n=bn)
        runs.append((a3, gpu.multi_head_attention_backward(delta, cache)[0]))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_weights_and_delta_causal_on_request_from_the_tiled_loop():
    """``attention_weights`` (``P``) and ``keep_delta_causal`` recompute from this cache (the tiled
    torch loop) and equal the reference's ``P`` and ``Δcausal``; ``d_qkv`` as without them (within
    the bounds: another order of the same sums)."""
    B, T, H, KV, d_qk, d_head = 2, 9, 4, 2, 8, 8
    T, bm, bn = _sizes(T, 4, 8)
    qkv = _qkv(B, T, H, KV, d_qk, d_head, torch.float64, seed=31)
    delta = _delta(B, T, H, d_head, torch.float64, seed=32)
    a3, cache = _forward(qkv, H, d_qk, d_head, n_kv_heads=KV, block_m=bm, block_n=bn)
    ref_a3, ref_cache = layers.multi_head_attention_forward(qkv.cpu(), H, d_qk, d_head, n_kv_heads=KV)
    ref_d, ref_causal = layers.multi_head_attention_backward(delta.cpu(), ref_cache, keep_delta_causal=True)
    p = gpu.attention_weights(cache)
    assert p.shape == (B, H, T, T)
    torch.testing.assert_close(p.cpu(), layers.attention_weights(ref_cache), rtol=0, atol=1e-13)
    d_qkv, kept = gpu.multi_head_attention_backward(delta, cache, keep_delta_causal=True)
    torch.testing.assert_close(kept.cpu(), ref_causal, rtol=0, atol=1e-13)
    _, tol = _tolerances(qkv, delta, H, KV, d_qk, d_head, True)
    _assert_within(d_qkv, ref_d, tol * 2, "d_qkv (tiled loop)")             # (two orders: twice the bound)


def test_unsupported_calls_run_the_existing_path(monkeypatch):
    """A KV-cache step and a tensor Triton cannot run (here: CPU without the interpreter) take the
    GPU fallback of :mod:`pedestrian.kernels.attention` (reference / tiled torch loop), whose cache
    the backward and ``attention_weights`` recognise."""
    B, T, H, KV, d_qk, d_head = 1, 6, 2, 1, 8, 8
    qkv = _qkv(B, T, H, KV, d_qk, d_head, torch.float64, seed=41).cpu()
    cache_k = torch.zeros(B, KV, 8, d_qk, dtype=torch.float64)
    cache_v = torch.zeros(B, KV, 8, d_head, dtype=torch.float64)
    block = layers.KVBlock(cache_k, cache_v, 0)
    a3, cache = _forward(qkv, H, d_qk, d_head, kv_cache=block, n_kv_heads=KV)
    want, _ = layers.multi_head_attention_forward(qkv, H, d_qk, d_head, n_kv_heads=KV)
    torch.testing.assert_close(a3, want, rtol=0, atol=1e-14)
    assert not cache.get("gpu_flash") and torch.equal(cache_k[:, :, :T], _heads(qkv[..., H * d_qk:(H + KV) * d_qk], KV))
    here = qkv.to(DEVICE)
    assert gpu.supported(here, d_qk, d_head, n_heads=H)                       # and each change below is not:
    assert not gpu.supported(here.half(), d_qk, d_head) and not gpu.supported(here, d_qk, gpu.MAX_WIDTH + 1)
    assert not gpu.supported(here[:, :0], d_qk, d_head) and not gpu.supported(here, d_qk, d_head, n_heads=70_000)
    assert not gpu.supported(here.cpu().numpy(), d_qk, d_head)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not CUDA:
        assert not gpu.supported(qkv, d_qk, d_head)
        a3, cache = _forward(qkv, H, d_qk, d_head, n_kv_heads=KV)
        assert not cache.get("gpu_flash")
        delta = torch.ones_like(a3)
        d_qkv, _ = gpu.multi_head_attention_backward(delta, cache)
        _, ref_cache = layers.multi_head_attention_forward(qkv, H, d_qk, d_head, n_kv_heads=KV)
        torch.testing.assert_close(d_qkv, layers.multi_head_attention_backward(delta, ref_cache)[0], rtol=0, atol=1e-14)
        torch.testing.assert_close(gpu.attention_weights(cache), layers.attention_weights(ref_cache),
                                   rtol=0, atol=1e-14)


def test_bad_arguments_are_named():
    qkv = _qkv(1, 5, 2, 1, 8, 8, torch.float32, seed=51)
    with pytest.raises(ValueError, match="block_m=6 must be a power of two"):
        _forward(qkv, 2, 8, 8, n_kv_heads=1, block_m=6)
    with pytest.raises(ValueError, match="n_kv_heads=3 must divide n_heads=2"):
        _forward(qkv, 2, 8, 8, n_kv_heads=3)
    with pytest.raises(ValueError, match="qkv has 32 columns"):
        _forward(qkv, 2, 8, 8, n_kv_heads=2)


def test_score_scale_window_and_segments_in_the_kernels_softcap_in_the_fallback():
    """``scale=``, a sliding window and packed segments run in the Triton kernels (the reference
    with the same arguments, float64, 1e-12 of the largest entry: the same sums in another order);
    a soft-cap runs the tiled torch loop (the module's explicit fallback), whose results are the
    reference's and whose backward is recognised (EQUATIONS.md "Sliding window", "Packed
    segments", "Score scale and soft-cap")."""
    B, T, H, KV, d_qk, d_head = 2, 9, 4, 2, 8, 8
    T, bm, bn = _sizes(T, 4, 8)
    qkv = _qkv(B, T, H, KV, d_qk, d_head, torch.float64, seed=61)
    delta = _delta(B, T, H, d_head, torch.float64, seed=62)
    segments = torch.tensor([[0] * 4 + [1] * (T - 4), [3] * T], device=DEVICE)
    for kw in (dict(scale=0.7), dict(window=3), dict(segments=segments), dict(window=2, segments=segments),
               dict(softcap=1.5, scale=0.5)):
        a3, cache = _forward(qkv, H, d_qk, d_head, n_kv_heads=KV, block_m=bm, block_n=bn, **kw)
        assert bool(cache.get("gpu_flash")) == ("softcap" not in kw)
        d_qkv, _ = gpu.multi_head_attention_backward(delta, cache)
        ref_kw = dict(kw, segments=None if "segments" not in kw else segments.cpu())
        want_a3, ref_cache = layers.multi_head_attention_forward(qkv.cpu(), H, d_qk, d_head, n_kv_heads=KV, **ref_kw)
        want_d, _ = layers.multi_head_attention_backward(delta.cpu(), ref_cache)
        for got, want, what in ((a3, want_a3, "a3"), (d_qkv, want_d, "d_qkv")):
            err = (got.cpu() - want).abs().max().item()
            assert err <= 1e-12 * want.abs().max().item(), f"{kw}: {what} errs by {err:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_a_loss_on_one_segment_sends_exactly_zero_to_the_others(dtype):
    """Packed segments (and a window) in the Triton kernels: a loss on segment 1 of row 0 gives
    every other token ``q``, ``k``, ``v`` gradients of exactly 0; the weights on request equal
    the reference's."""
    B, T, H, KV, d_qk, d_head = 2, 11, 4, 2, 8, 8
    T, bm, bn = _sizes(T, 4, 4)
    seg = torch.tensor([[0] * 3 + [1] * 5 + [2] * (T - 8), [5] * T], device=DEVICE)
    qkv = _qkv(B, T, H, KV, d_qk, d_head, dtype, seed=71, shift=3.0)
    delta = _delta(B, T, H, d_head, dtype, seed=72)
    delta[0, seg[0] != 1] = 0.0
    delta[1] = 0.0
    a3, cache = _forward(qkv, H, d_qk, d_head, n_kv_heads=KV, block_m=bm, block_n=bn, segments=seg, window=4)
    assert cache.get("gpu_flash")
    d_qkv, _ = gpu.multi_head_attention_backward(delta, cache)
    assert torch.count_nonzero(d_qkv[0, seg[0] != 1]) == 0 and torch.count_nonzero(d_qkv[1]) == 0
    assert torch.count_nonzero(d_qkv[0, seg[0] == 1]) > 0
    _, ref_cache = layers.multi_head_attention_forward(qkv.double().cpu(), H, d_qk, d_head, n_kv_heads=KV,
                                                       segments=seg.cpu(), window=4)
    p = gpu.attention_weights(cache).double().cpu()
    assert (p - layers.attention_weights(ref_cache)).abs().max().item() <= (1e-12 if dtype == torch.float64 else 1e-5)

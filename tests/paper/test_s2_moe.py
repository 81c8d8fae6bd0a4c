"""The mixture-of-experts layer (EQUATIONS.md, "Mixture of experts"): the reference layer and the
fast kernels against PyTorch autograd (float64), finite differences, each other over the shape
space (float64 and float32, ties), and transformers' load-balancing loss.

The torch oracle is written independently of the layer: every expert runs on every token (no
grouping), and a one-hot mask of ``torch.topk``'s choice keeps the chosen ones, weighted by the
(renormalised) probabilities -- what transformers' ``MixtralSparseMoeBlock`` computes. Inputs are
drawn so that no two of a row's probabilities tie near the ``k``-th place (:func:`draw`), so
``torch.topk``'s choice is the layer's; ties are tested on their own (:func:`test_ties`).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pedestrian.kernels as fast
import pedestrian.layers as reference

torch = pytest.importorskip("torch")

NAMES = ("router", "gate", "up", "down")


def draw(B, T, d, E, m, k, seed, dtype=np.float64, gap=1e-3):
    """Inputs ``x (B, T, d)``, ``W_r (d, E)``, ``W_gate``, ``W_up (E, d, m)``, ``W_down (E, m, d)``,
    ``Δ (B, T, d)``; redrawn until every row's ``k``-th and ``k+1``-th probabilities differ by more
    than ``gap`` (relative) -- far above any rounding of the router (its logits err by about
    ``d·u``), so every computation routes alike."""
    rng = np.random.default_rng(seed)
    while True:
        x = rng.standard_normal((B, T, d))
        w = [rng.standard_normal((d, E)), rng.standard_normal((E, d, m)) / np.sqrt(d),
             rng.standard_normal((E, d, m)) / np.sqrt(d), rng.standard_normal((E, m, d)) / np.sqrt(m)]
        x, w = x.astype(dtype).astype(np.float64), [a.astype(dtype).astype(np.float64) for a in w]
        r = x.reshape(-1, d) @ w[0]
        p = np.sort(np.exp(r - r.max(-1, keepdims=True)), axis=-1)[:, ::-1]
        if k == E or np.all(p[:, k - 1] - p[:, k] > gap * p[:, k - 1]):
            return x, w, rng.standard_normal((B, T, d))


def run(K, x, w, delta, k, renorm, d_pi=None):
    """Forward and backward of ``K``'s layer: ``{"y", "dx", "router", "gate", "up", "down"}``."""
    y, cache = K.moe_forward(x, *w, k, renorm)
    grads = [np.full(a.shape, np.nan, x.dtype) for a in w]
    dx = K.moe_backward(delta, cache, *w, d_pi=d_pi, dw_router=grads[0], dw_gate=grads[1], dw_up=grads[2],
                        dw_down=grads[3])
    return {"y": y, "dx": dx, **dict(zip(NAMES, grads))}


def torch_moe(x, w_router, w_gate, w_up, w_down, k, renorm):
    """``Σ_{e ∈ topk} g_e SwiGLU_e(x)`` in plain torch, every expert on every row, masked."""
    rows = x.reshape(-1, x.shape[-1])
    p = torch.softmax(rows @ w_router, dim=-1)                                # (N, E)
    top_p, top = torch.topk(p, k, dim=-1)
    g = top_p / top_p.sum(-1, keepdim=True) if renorm else top_p
    weight = torch.zeros_like(p).scatter(1, top, g)                           # (N, E), zero off the top k
    h = torch.nn.functional.silu(torch.einsum("nd,edm->enm", rows, w_gate)) * torch.einsum("nd,edm->enm", rows, w_up)
    out = torch.einsum("enm,emd->end", h, w_down)                             # (E, N, d)
    return torch.einsum("ne,end->nd", weight, out).reshape(x.shape), p


CASES = [(1, 5, 6, 1, 4, 1), (2, 7, 6, 4, 5, 2), (3, 4, 9, 5, 3, 3), (1, 9, 8, 6, 7, 6), (2, 3, 5, 8, 4, 2)]


@pytest.mark.parametrize("K", [reference, fast], ids=["reference", "fast"])
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}T{c[1]}d{c[2]}E{c[3]}m{c[4]}k{c[5]}" for c in CASES])
@pytest.mark.parametrize("renorm", [False, True], ids=["probs", "renormalised"])
def test_against_autograd(K, case, renorm):
    """float64, relative 1e-9 of each quantity's scale: the layer and autograd compute the same
    sums in other orders (errors ~1e-15 relative); a wrong term is off by O(1)."""
    B, T, d, E, m, k = case
    x, w, delta = draw(B, T, d, E, m, k, seed=sum(case))
    d_pi = np.linspace(-0.5, 0.7, E)                                          # a load-balancing signal on π
    got = run(K, x, w, delta, k, renorm, d_pi)
    tx, *tw = [torch.tensor(a, requires_grad=True) for a in (x, *w)]
    y, p = torch_moe(tx, *tw, k, renorm)
    ((y * torch.tensor(delta)).sum() + (p.sum(0) * torch.tensor(d_pi)).sum()).backward()
    want = {"y": y.detach().numpy(), "dx": tx.grad.numpy(), **{n: t.grad.numpy() for n, t in zip(NAMES, tw)}}
    for name, value in want.items():
        scale = max(np.max(np.abs(value)), 1e-300)
        assert np.max(np.abs(got[name] - value)) <= 1e-9 * scale, name
    unchosen = [e for e in range(E) if e not in set(np.asarray(K.moe_router_forward(x, w[0], k, renorm)[1].top).ravel())]
    for e in unchosen:                                                        # an expert nobody chose
        assert not np.any(got["gate"][e]) and not np.any(got["down"][e])     # gets nothing


@pytest.mark.parametrize("renorm", [False, True])
def test_finite_differences(renorm):
    """Central differences, h = 1e-6, of ``L = ⟨Δ, y⟩`` on entries of every input: truncation
    ``h² L'''/6`` ~ 1e-12, cancellation ``u |L| / h`` ~ 1e-10; 1e-7 relative to the gradient's scale
    covers both with room and catches any wrong term. The routing stays put (its gap is 1e-3)."""
    B, T, d, E, m, k = 2, 5, 6, 5, 4, 2
    x, w, delta = draw(B, T, d, E, m, k, seed=3)
    got = run(reference, x, w, delta, k, renorm)
    rng = np.random.default_rng(0)
    for name, a in zip(("dx", *NAMES), (x, *w)):
        scale = np.max(np.abs(got[name]))
        for idx in [tuple(int(rng.integers(s)) for s in a.shape) for _ in range(6)]:
            old, h, sides = a[idx], 1e-6, []
            for step in (h, -h):
                a[idx] = old + step
                sides.append(float(np.sum(reference.moe_forward(x, *w, k, renorm)[0] * delta)))
            a[idx] = old
            assert abs((sides[0] - sides[1]) / (2 * h) - got[name][idx]) <= 1e-7 * scale, (name, idx)


def test_ties():
    """Exact ties (integer inputs: every product and sum exact, so equal logits are equal bits on any
    BLAS): both implementations take the lower expert index first (a stable descending sort), and
    group the same rows. ``torch.topk`` picks among tied values in an order of its own (measured on
    the CPU: neither the lower nor the higher index first), so tied routers are compared with the
    layers, not with torch."""
    rng = np.random.default_rng(1)
    x = rng.integers(-2, 3, size=(2, 6, 4)).astype(np.float64)
    w_router = rng.integers(-1, 2, size=(4, 3)).astype(np.float64)
    w_router = np.concatenate([w_router, w_router[:, :2], np.zeros((4, 1))], axis=1)   # experts 3, 4 tie 0, 1
    for dtype in (np.float64, np.float32):
        for k in (1, 2, 3):
            R = reference.moe_router_forward(x.astype(dtype), w_router.astype(dtype), k, True)[1]
            F = fast.moe_router_forward(x.astype(dtype), w_router.astype(dtype), k, True)[1]
            assert np.array_equal(R.top, F.top) and np.array_equal(R.order, F.order) and R.offsets == F.offsets
            p = R.pi
            for n, chosen in enumerate(R.top):                                 # lower index first among equals
                want = sorted(range(p.shape[1]), key=lambda e: (-p[n, e], e))[:k]
                assert list(chosen) == want


# ------------------------------------------------------------------ fast = reference over the shape space
settings.register_profile("moe-ci", max_examples=40, derandomize=True, database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(settings.get_profile("moe-ci"))
@given(B=st.integers(1, 3), T=st.sampled_from([1, 2, 7, 16, 33, 64]), d=st.sampled_from([1, 2, 7, 8, 17]),
       E=st.integers(1, 8), m=st.sampled_from([1, 3, 8, 13]), k_frac=st.floats(0, 1), renorm=st.booleans(),
       dtype=st.sampled_from(["float64", "float32"]), seed=st.integers(0, 2**16))
def test_fast_equals_reference(B, T, d, E, m, k_frac, renorm, dtype, seed):
    """The fast kernels equal the reference (forward, input delta, every weight gradient) over the
    shape space: ``B`` 1-3, short and longer ``T``, odd and even widths, ``E`` 1-8, ``k`` 1-``E``,
    both weightings, float64 and float32 (the routing kept away from ties, :func:`draw`; ties:
    :func:`test_ties`). Bound, per quantity: each entry is a sum of at most
    ``n = d + m + E + k + B·T`` rounded terms (the products, the softmax, the weighted sum, the
    weight gradients' rows), each term at most ``c`` times the quantity's largest entry on these
    unit-scale draws (``c = 8``, the conditioning ``Σ|terms| / |Σ terms|`` of the random products,
    times 8 for the exp and silu evaluations): ``2 · 64 · n · u · max|q|`` for the two computations."""
    k = 1 + int(k_frac * (E - 1))
    x, w, delta = draw(B, T, d, E, m, k, seed, dtype=np.dtype(dtype))
    args = [a.astype(dtype) for a in (x, *w, delta)]
    d_pi = np.linspace(-0.3, 0.4, E).astype(dtype)
    with np.errstate(under="ignore"):
        got_r = run(reference, args[0], args[1:5], args[5], k, renorm, d_pi)
        got_f = run(fast, args[0], args[1:5], args[5], k, renorm, d_pi)
    u = float(np.finfo(dtype).eps) / 2
    n = d + m + E + k + B * T
    for name in got_r:
        assert got_f[name].dtype == np.dtype(dtype) and got_f[name].shape == got_r[name].shape
        scale = max(float(np.max(np.abs(got_r[name].astype(np.float64)))), 1e-30)
        err = float(np.max(np.abs(got_f[name].astype(np.float64) - got_r[name])))
        assert err <= 2 * 64 * n * u * scale, (name, err / (u * n * scale))


def test_load_balancing_loss_is_transformers():
    """``moe_load_balancing_loss`` over two layers' routes against transformers'
    ``load_balancing_loss_func`` (no attention mask), which sums in float32 whatever the logits'
    dtype: relative 1e-6 (a float32 sum of at most 60 terms, ``60 u32`` = 4e-6 at worst, ~1e-7
    in practice), and against its formula in float64 at 1e-13; its gradient against autograd."""
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    E, k = 6, 2
    x, w, _ = draw(2, 15, 8, E, 3, k, seed=5)
    x2, w2, _ = draw(2, 15, 8, E, 3, k, seed=6)
    routes = [reference.moe_router_forward(a, b[0], k, True)[1] for a, b in ((x, w), (x2, w2))]
    aux, d_pi = reference.moe_load_balancing_loss(routes, E, k)
    logits = tuple(torch.tensor(a.reshape(-1, 8) @ b[0]) for a, b in ((x, w), (x2, w2)))
    hf = float(mixtral.load_balancing_loss_func(logits, E, k, None))
    assert abs(float(aux) - hf) <= 1e-6 * abs(hf)
    pis = [torch.tensor(r.pi, requires_grad=True) for r in routes]
    n = sum(p.shape[0] for p in pis)
    f = sum(torch.nn.functional.one_hot(torch.tensor(r.top), E).sum((0, 1)) for r in routes).double() / n
    aux_t = E * (f * (sum(p.sum(0) for p in pis) / n)).sum()
    aux_t.backward()
    assert abs(float(aux) - aux_t.item()) <= 1e-13 * aux_t.item()
    # ∂aux/∂π = E f_e / N: a few rounded float64 products and one division on each side, no sum
    # (≤ 4u = 4.4e-16 relative on any IEEE CPU, any thread count); 1e-13 leaves a wide margin
    for p in pis:                                                             # the same (E,) on every row
        assert np.allclose(p.grad.numpy(), np.broadcast_to(d_pi, p.shape), rtol=1e-13, atol=0)
    assert 0.9 * k < float(aux) < E                                           # about k when balanced

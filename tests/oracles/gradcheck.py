"""Shared checking helpers of the gradient tests: the two kernel modules, errors, finite
differences, autograd of one layer, and the rounding bounds the tolerances come from.

Nothing here imports a layer function by name: a test asks for the module (``pedestrian.layers``,
the paper's reference, or ``pedestrian.kernels``, the fast path) and calls ``K.<function>``, so
every check runs against both implementations of the seam.

Tolerances (issue 13, part 4) follow from the arithmetic compared:

- *against autograd* (an independent float64 computation): ``RTOL_AUTOGRAD = 1e-9`` relative per
  tensor, the project's bound for the gradient grid; the two sides differ only by rounding
  (a few hundred ulps at most for these shapes), so the bound is loose on purpose and cannot be
  met by a wrong formula (those err by O(1)).
- *finite differences*: central differences with step ``h`` err by ``h²/6·|f'''|`` (truncation,
  ~1e-12 here) plus ``c·ε·|f|/h`` (the rounding of ``f``, ``c`` a few); with ``h = 1e-6`` and
  ``|f| <= F_MAX = 10`` (asserted at every evaluation) that is <= ``c``·2.2e-9 absolute, under
  ``RTOL_FD = 1e-7`` of a gradient whose largest entry is >= 0.1 (asserted too, so a vanishing
  check cannot pass silently) for any ``c <= 4``. Observed: <= 5e-10 absolute.
- *same mathematics, two orders of operations* (reference vs fast, NumPy vs torch, fused vs
  per-head, cached vs full): :func:`assert_rounding_close` -- the difference is bounded by the
  number of rounded operations along the longest chain times ``ε`` times the *absolute* terms
  (the value the computation would have with every term's sign made positive), so cancellation
  cannot make the check flaky. With at most ~100 rounded operations per chain here, that is
  <= 100·2.2e-16 = 2.2e-14; ``RTOL_ROUNDING = 1e-12`` keeps a 45× margin on any IEEE-754 machine.
- *sums and norms in two orders* (NumPy's and torch's dot, per-tensor norms): Higham's
  :func:`sum_rounding_bound`, :func:`norm_rounding_rel`.
- *optimizer steps* (NumPy vs torch backend, ours vs ``torch.optim.AdamW``, micro-batches, threads):
  :func:`adamw_rounding_bounds`, per entry -- each operation's rounding against its absolute
  terms, plus AdamW's own sensitivity to a gradient difference (``lr/ε'`` where ``√v`` is tiny:
  the key bias, whose gradient is rounding noise). A comparison of training runs starts each
  step from one state, so the bound is one step's, not 50 steps' amplification.
- *the key bias* (gradient ≡ 0, paper section 3): :func:`key_bias_bound` on both sides.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import pedestrian.kernels as fast_kernels
import pedestrian.layers as reference_layers
from pedestrian.config import GPTConfig
from pedestrian.model import GPT

#: both implementations of the seam; ids used in test names
KERNEL_MODULES = (reference_layers, fast_kernels)
KERNEL_IDS = ("reference", "fast")

RTOL_AUTOGRAD = 1e-9
RTOL_FD = 1e-7
H_STEP = 1e-6
F_MAX = 10.0
RTOL_ROUNDING = 1e-12
EPS64 = float(np.finfo(np.float64).eps)


def kernels_param():
    """``pytest.mark.parametrize`` over the two kernel modules, as argument ``K``."""
    params = [pytest.param(m, id=i) for m, i in zip(KERNEL_MODULES, KERNEL_IDS)]
    return pytest.mark.parametrize("K", params)


def kernels_name(K) -> str:
    """``"reference"`` or ``"fast"`` (the ``GPT(kernels=...)`` name of a kernel module)."""
    return "reference" if K is reference_layers else "fast"


# --------------------------------------------------------------------------- models and batches
def build_model(cfg: dict, params: dict, *, dtype: str = "float64", backend: str = "numpy",
                lora: dict | None = None, lora_alpha: float = 1.0, freeze_base: bool = False,
                dropout: float = 0.0, kernels: str = "fast") -> GPT:
    """A GPT from a torch_reference ``cfg`` dict and parameters from ``random_params``.

    ``lora`` is the reference's ``{"targets": [...full FC names...], "rank": r}``; ``kernels``
    is ``"fast"`` or ``"reference"`` (``GPT(kernels=...)``).
    """
    model = GPT(GPTConfig(**cfg, dropout=dropout), dtype=dtype, backend=backend, kernels=kernels)
    if lora is not None:
        model.add_lora(lora["targets"], rank=lora["rank"], alpha=lora_alpha, freeze_base=freeze_base)
    model.load_state_dict(params, strict=True)
    return model


def token_batch(cfg: dict, B: int, T: int, *, seed: int = 0, n_ignored: int = 0,
                repeats: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, targets)`` of shape ``(B, T)``, int64.

    ``repeats``: the first row repeats one id at several positions (the embedding backward
    must accumulate them). ``n_ignored`` targets are set to the ignore index -100.
    """
    rng = np.random.default_rng(10_000 + seed)
    V = cfg["vocab_size"]
    tokens = rng.integers(0, V, size=(B, T))
    if repeats and T > 1:
        tokens[0, ::2] = tokens[0, 0]
        tokens[-1, -1] = tokens[0, 0]
    targets = rng.integers(0, V, size=(B, T))
    if n_ignored:
        flat = targets.reshape(-1)
        flat[rng.choice(flat.size, size=min(n_ignored, flat.size), replace=False)] = -100
    return tokens.astype(np.int64), targets.astype(np.int64)


# --------------------------------------------------------------------------- errors
def as_np(a) -> np.ndarray:
    """A float64 NumPy copy of a NumPy array or torch tensor."""
    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    return np.array(a, dtype=np.float64)


def max_rel_err(a, b, floor: float = 1e-15) -> float:
    """``max|a − b| / max(max|b|, floor)`` -- one number per tensor (``b`` is the reference).

    The tiny ``floor`` only matters when the reference is (all but) zero; then the bound asks
    for ``a`` to be zero as well, to within ``tolerance · floor``.
    """
    a, b = as_np(a), as_np(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    if b.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), floor))


def assert_autograd_close(ours, oracle, name: str, rtol: float = RTOL_AUTOGRAD) -> None:
    err = max_rel_err(ours, oracle)
    assert err <= rtol, f"{name}: relative error {err:.2e} against autograd > {rtol:.0e}"


def assert_rounding_close(a, b, scale, name: str, rtol: float = RTOL_ROUNDING) -> None:
    """``max|a − b| <= rtol · max(scale)``: two computations of the same value that differ only in
    the order of their rounded operations. ``scale`` is the magnitude of the absolute terms (see
    the module docstring; ``|b|`` itself when no cancellation can occur) and must be nonzero."""
    a, b = as_np(a), as_np(b)
    assert a.shape == b.shape, (name, a.shape, b.shape)
    s = float(np.max(np.abs(as_np(scale)))) if np.size(scale) else 0.0
    assert s > 0, f"{name}: zero scale, the comparison would prove nothing"
    err = float(np.max(np.abs(a - b))) if a.size else 0.0
    assert err <= rtol * s, f"{name}: |difference| {err:.2e} > {rtol:.0e} × scale {s:.2e}"


def sum_rounding_bound(n_terms: int, abs_sum, dtype=np.float64):
    """Higham's bound for two sums of the same ``n_terms`` terms in any two orders:
    ``|fl(Σx) − fl'(Σx)| <= 2·γ_n·Σ|x|``, ``γ_n = nε/(1 − nε)``; ``abs_sum`` is ``Σ|x|``."""
    eps = float(np.finfo(dtype).eps)
    gamma = n_terms * eps / (1 - n_terms * eps)
    return 2.0 * gamma * np.asarray(abs_sum)


def norm_rounding_rel(n_terms: int, dtype=np.float64) -> float:
    """Relative bound on the difference of two computed L2 norms of the same ``n_terms`` numbers
    (any two summation orders of the squares, e.g. NumPy's and torch's dot, or per-tensor norms
    then the norm of the norms): the sums of squares differ by ``<= 2·γ_n·Σx²``
    (:func:`sum_rounding_bound`; the squares' own rounding is inside ``γ_n`` with ``n`` + 1), the
    square root halves that, and each side's square root adds ``ε/2``."""
    eps = float(np.finfo(dtype).eps)
    return float(sum_rounding_bound(n_terms + 1, 1.0, dtype)) / 2 + eps


def adamw_rounding_bounds(params, grads, lrs, *, betas, eps, weight_decay, n_decay,
                          g_rel: float = 0.0, g_err=None, m0=None, v0=None, t0: int = 0,
                          dtype=np.float64) -> dict:
    """Per-entry bounds on how far two computations of the same AdamW steps may end apart.

    Two sources, added (first order):

    *Rounding.* The two sides (NumPy's separate operations, torch's ``lerp_``/``addcmul_``/
    ``addcdiv_`` with FMA where the CPU has it, ``torch.optim.AdamW``'s own order) round each
    step's operations differently. In the style of :func:`assert_rounding_close`: each rounded
    operation errs by at most ``ε`` (twice the unit roundoff, a 2x margin) relative to its
    *absolute terms*, computed here with every sign made positive (``|g|``, ``|θ|``, ``|m|``, the
    update added), and errors from earlier steps are carried with the factors the update
    multiplies them by (``β1``, ``β2``, the decay, ``1/denominator``):

    - ``m ← m + (1 − β1)(g − m)``: 3 operations, plus ``g_rel`` (the relative error of the
      gradient itself on each side, e.g. after clipping with a computed norm);
    - ``v ← β2 v + (1 − β2) g²``: 4 operations, ``2·g_rel`` (a square);
    - the denominator ``√v + ε'``: half of ``v``'s relative error, plus 3 operations (torch
      divides ``√v`` by ``√(1 − β2ᵗ)`` first);
    - the update ``step · m / denominator``: 2 operations plus 4 for the scalar factors
      (``lr / (1 − β1ᵗ)``, ``√(1 − β2ᵗ)``, computed once in either order, and ``lr`` itself,
      which may arrive rounded: LambdaLR's ``base · (s / base)``);
    - ``θ ← θ·decay − update``: 2 operations, plus 2 for the decay factor ``1 − lr·λ``.

    *Different gradients* (the condition of AdamW). When the sides' gradients differ by up to
    ``δ`` per entry (``g_err``: the same gradient summed in other orders), the moments differ by
    ``Δm ← β1 Δm + (1 − β1) δ`` and ``Δv ← β2 Δv + (1 − β2)(2|g|δ + δ²)``, the denominator by
    ``Δden <= min(√Δv, Δv/√v)``, and the update by ``step · (Δm + |m| Δden/den') / den'`` with
    ``den' = max(den − Δden, ε')``: an entry whose ``√v`` is tiny (a gradient that is rounding
    noise, like the key bias's) amplifies ``δ`` by up to ``lr/ε'`` -- AdamW's own sensitivity,
    not the implementations'.

    Args:
        params: ``(n,)`` parameters before the first step; grads: a list of ``(n,)`` gradients
            (as applied, after clipping), one per step; lrs: one learning rate per step.
        betas, eps, weight_decay: the optimizer's; n_decay: the first entries decayed.
        g_rel: relative error of each side's gradients (0 when both get the same numbers).
        g_err: ``None`` or one ``(n,)`` bound (or a number) per step on ``|g_a − g_b|``.
        m0, v0, t0: the moments and step count both sides start from (default: a fresh AdamW).

    Returns:
        ``{"m": ..., "v": ..., "params": ...}``: ``(n,)`` bounds on ``|a − b|`` (both sides).
    """
    e = float(np.finfo(dtype).eps)
    b1, b2 = betas
    p_abs = np.abs(np.asarray(params, np.float64))
    m_abs = np.zeros_like(p_abs) if m0 is None else np.abs(np.asarray(m0, np.float64))
    v = np.zeros_like(p_abs) if v0 is None else np.asarray(v0, np.float64).copy()
    err_m, err_v, err_p = np.zeros_like(p_abs), np.zeros_like(p_abs), np.zeros_like(p_abs)
    dm, dv, dp = np.zeros_like(p_abs), np.zeros_like(p_abs), np.zeros_like(p_abs)
    decay = np.ones_like(p_abs)
    g_err = [0.0] * len(grads) if g_err is None else g_err
    for t, (g, lr, delta) in enumerate(zip(grads, lrs, g_err), start=t0 + 1):
        g = np.abs(np.asarray(g, np.float64))
        delta = np.asarray(delta, np.float64)
        decay[:n_decay] = 1 - lr * weight_decay
        m_abs = b1 * m_abs + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        err_m = b1 * err_m + (g_rel + 3 * e) * m_abs
        err_v = b2 * err_v + (2 * g_rel + 4 * e) * v
        dm = b1 * dm + (1 - b1) * delta
        dv = b2 * dv + (1 - b2) * (2 * g * delta + delta * delta)
        bc2_sqrt = math.sqrt(1 - b2 ** t)
        floor = eps * bc2_sqrt
        den = np.sqrt(v) + floor
        rel_den = np.divide(err_v, v, out=np.zeros_like(v), where=v > 0) / 2 + 3 * e
        scale = lr / (1 - b1 ** t) * bc2_sqrt
        update = scale * m_abs / den
        err_update = scale * (err_m + m_abs * (rel_den + 6 * e)) / den
        err_p = decay * err_p + err_update + 4 * e * decay * p_abs + 2 * e * update
        p_abs = decay * p_abs + update
        d_den = np.minimum(np.sqrt(dv), np.divide(dv, np.sqrt(v), out=np.full_like(v, np.inf), where=v > 0))
        den_low = np.maximum(den - d_den, floor)
        dp = decay * dp + scale * (dm + m_abs * d_den / den_low) / den_low
    return {"m": 2 * err_m + dm, "v": 2 * err_v + dv, "params": 2 * err_p + dp}


def flat_layout(model, per_name: dict) -> list:
    """``per_name`` (parameter name -> array of its shape) laid out as the model's flat buffers
    (:meth:`GPT.trainable_buffers` order), NumPy backend: written through the gradient views,
    read back from the flat gradient buffers, which are restored after."""
    buffers = model.trainable_buffers()
    saved = [b.grads.copy() for b in buffers]
    try:
        for name, view in model.grads.items():
            view[...] = per_name[name]
        return [b.grads.copy() for b in buffers]
    finally:
        for b, s in zip(buffers, saved):
            b.grads[...] = s


def gradient_rounding_err(model, key_bias_bounds=None, rtol: float = RTOL_ROUNDING) -> dict:
    """How far another computation of the model's current gradient (the same mathematics in
    another order: micro-batches, threads, another library) may be from it, per entry:
    ``rtol · max|g|`` of each tensor (module docstring), and for each key bias -- ``≡ 0``, rounding
    noise on both sides -- twice its :func:`key_bias_bound` (``key_bias_bounds``: the list of
    :func:`model_key_bias_bounds`; required when the model has key biases among its gradients)."""
    out = {}
    for name, g in model.grads.items():
        g = as_np(g)
        if name.endswith(".attn.k.bias"):
            out[name] = 2 * np.asarray(key_bias_bounds[int(name.split(".")[1])])
        else:
            out[name] = np.full(g.shape, rtol * float(np.max(np.abs(g))) if g.size else 0.0)
    return out


# --------------------------------------------------------------------------- finite differences
def numerical_grad(f, arr: np.ndarray, h: float = H_STEP, entries=None) -> np.ndarray:
    """Central differences of the scalar ``f()`` w.r.t. entries of ``arr`` (perturbed in place,
    restored): all of them, or only the flat indices in ``entries`` (others left NaN)."""
    grad = np.full(arr.shape, np.nan) if entries is not None else np.zeros(arr.shape)
    indices = np.ndindex(arr.shape) if entries is None else (np.unravel_index(i, arr.shape) for i in entries)
    for idx in indices:
        old = arr[idx]
        arr[idx] = old + h
        f_plus = f()
        arr[idx] = old - h
        f_minus = f()
        arr[idx] = old
        assert max(abs(f_plus), abs(f_minus)) <= F_MAX, "scale the objective down: |f| > F_MAX voids RTOL_FD"
        grad[idx] = (f_plus - f_minus) / (2 * h)
    return grad


def assert_fd_close(analytic, numeric, name: str, rtol: float = RTOL_FD) -> None:
    analytic, numeric = as_np(analytic), np.asarray(numeric)
    assert analytic.shape == numeric.shape, name
    scale = np.max(np.abs(numeric))
    assert scale >= 0.1, f"{name}: the finite-difference gradient is ~0 ({scale:.1e}), the check would prove nothing"
    err = np.max(np.abs(analytic - numeric)) / scale
    assert err <= rtol, f"{name}: relative error {err:.2e} against finite differences > {rtol:.0e}"


def projection(out, R) -> float:
    """The scalar test objective ``f = Σ out ∘ R`` (its error signal at ``out`` is ``R``)."""
    return float(np.sum(as_np(out) * R))


# --------------------------------------------------------------------------- autograd
def autograd(fn, inputs: dict, upstream=None):
    """Run ``fn(**tensors)`` in float64 torch with every input requiring grad, then backward.

    Args:
        fn: a function of torch tensors returning one tensor.
        inputs: ``name -> np.ndarray`` (``None`` values are passed through).
        upstream: the error signal at the output (``None``: the output is a scalar loss).

    Returns:
        ``(output, grads)``: NumPy copies; ``grads[name]`` zero where autograd gave none.
    """
    import torch

    tensors = {k: None if v is None else torch.tensor(np.asarray(v, dtype=np.float64), requires_grad=True)
               for k, v in inputs.items()}
    out = fn(**tensors)
    if upstream is None:
        out.backward()
    else:
        out.backward(torch.tensor(np.asarray(upstream, dtype=np.float64)))
    grads = {k: (np.zeros(t.shape) if t.grad is None else t.grad.numpy().copy())
             for k, t in tensors.items() if t is not None}
    return out.detach().numpy().copy(), grads


def torch_head(x, wq, bq, wk, bk, wv, bv, causal: bool):
    """One attention head in plain torch (paper section 3): the oracle of the head tests."""
    import torch

    q, k, v = x @ wq + bq, x @ wk + bk, x @ wv + bv
    S = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        T = x.shape[-2]
        S = S.masked_fill(torch.arange(T)[None, :] > torch.arange(T)[:, None], float("-inf"))
    return torch.softmax(S, dim=-1) @ v


# --------------------------------------------------------------------------- the key bias
def key_bias_bound(q, dP, delta_causal, dtype=np.float64) -> np.ndarray:
    """How far from 0 a computed key-bias gradient may be, per entry (paper section 3: ``dbk ≡ 0``).

    ``dbk_j = Σ_{b,β} dk_{bβj} = Σ_{b,α} q_{bαj} Σ_β Δraw_{bαβ}`` is zero because every row of
    ``Δcausal`` sums to zero; computed, it is rounding only:

    - a computed row of ``Δcausal = P ∘ (dP − rowsum(dP ∘ P))`` sums to at most
      ``(2L + 6)·ε·max_β|dP_αβ|`` (the row sum, the normalisation of ``P`` and two products);
    - ``dk = Δrawᵀ q`` (sums of ``T`` terms) and the sum over ``B·L`` rows of ``dk`` add at most
      ``(T + B·L)·ε·Σ_{b,α,β}|Δraw_{bαβ}||q_{bαj}|``.

    Twice the sum of the two (first-order bounds; the two paths of a comparison) is returned.

    Args:
        q: ``(B, H, T, d_qk)`` queries (unscaled); dP: ``(B, H, T, L)`` ``= Δ vᵀ``;
        delta_causal: ``(B, H, T, L)``.

    Returns:
        ``(H·d_qk,)`` bounds, in the fused column order (head 0's ``d_qk`` columns first).
    """
    eps = float(np.finfo(dtype).eps)
    q, dP, dc = np.abs(as_np(q)), np.abs(as_np(dP)), np.abs(as_np(delta_causal))
    B, H, T, d_qk = q.shape
    L = dP.shape[-1]
    row_sums = (2 * L + 6) * eps * np.max(dP, axis=-1)                              # (B, H, T)
    t1 = np.einsum("bht,bhtj->hj", row_sums, q)
    t2 = (T + B * L) * eps * np.einsum("bhts,bhtj->hj", dc, q)
    return (2.0 * (t1 + t2) / math.sqrt(d_qk)).reshape(H * d_qk)


def split_heads(a, n_heads: int) -> np.ndarray:
    """``(B, T, H·w)`` -> ``(B, H, T, w)`` (head ``h`` owns columns ``h·w …``), as NumPy."""
    a = as_np(a)
    B, T, width = a.shape
    return a.reshape(B, T, n_heads, width // n_heads).transpose(0, 2, 1, 3)


def model_key_bias_bounds(model) -> list:
    """:func:`key_bias_bound` of every block of the last ``backward(keep_deltas=True)`` of a GPT
    (``q``, ``v`` recomputed from the block's ``a2`` and the parameters, LoRA included)."""
    c, acts, deltas, P = model.config, model.activations(), model.deltas(), model.params
    out = []
    for i in range(c.n_blocks):
        a2 = as_np(acts[f"blocks.{i}.a2"])

        def fc(name):
            y = a2 @ as_np(P[f"{name}.weight"])
            if f"{name}.bias" in P:
                y = y + as_np(P[f"{name}.bias"])
            if f"{name}.lora_D" in P:
                y = y + model.lora_alpha * (a2 @ as_np(P[f"{name}.lora_D"])) @ as_np(P[f"{name}.lora_U"])
            return y

        q = split_heads(fc(f"blocks.{i}.attn.q"), c.n_heads)
        v = split_heads(fc(f"blocks.{i}.attn.v"), c.n_heads)
        d3 = split_heads(deltas[f"blocks.{i}.Δ3"], c.n_heads)
        dP = d3 @ v.transpose(0, 1, 3, 2)
        out.append(key_bias_bound(q, dP, deltas[f"blocks.{i}.Δcausal"], model.dtype_name))
    return out


def model_one_key_bounds(model) -> list:
    """Rounding bounds for the attention quantities that are ``≡ 0`` when every query sees exactly
    one key (``T = 1``: the softmax of one score is 1 whatever the score), after the last
    ``backward(keep_deltas=True)`` of a GPT: per block, ``{"Δcausal": (B, H, 1, 1),
    "attn.q.weight", "attn.q.bias", "attn.k.weight": gradient-shaped}``.

    A relative error means nothing for a tensor that is 0 in exact arithmetic (one CPU's BLAS
    kernel gives exact zeros, another 5e-17), so each is bounded by its own rounding:

    - ``Δcausal = P ∘ (dP − D)`` with one key is its own row sum: ``<= (2L + 2·d_head + 6)·ε·|dP|``
      (:func:`key_bias_bound`'s row term, plus the ``d_head``-term ``D = rowsum(Δ ∘ out)`` a
      tiled kernel uses), ``L = 1``;
    - ``dq = Δcausal · k / √d_qk`` and ``dk = Δcausalᵀ · q / √d_qk`` (one term each);
    - ``dW = a2ᵀ d·`` and ``db = Σ_rows d·`` over ``B·T`` rows: ``(1 + B·T·ε)`` times the sums of
      the absolute values.

    Twice these (the two paths of a comparison) must hold each side.
    """
    c, acts, deltas, P = model.config, model.activations(), model.deltas(), model.params
    eps = float(np.finfo(model.dtype_name).eps)
    out = []
    for i in range(c.n_blocks):
        a2 = as_np(acts[f"blocks.{i}.a2"])
        B, T, _ = a2.shape
        assert T == 1, "only for one key per query"

        def fc(name):
            y = a2 @ as_np(P[f"{name}.weight"])
            return y + as_np(P[f"{name}.bias"]) if f"{name}.bias" in P else y

        q, k, v = (np.abs(split_heads(fc(f"blocks.{i}.attn.{x}"), c.n_heads)) for x in "qkv")
        d3 = split_heads(deltas[f"blocks.{i}.Δ3"], c.n_heads)
        dP = np.abs(d3 @ v.transpose(0, 1, 3, 2))                                    # (B, H, 1, 1)
        d_qk, d_head = q.shape[-1], v.shape[-1]
        dc = (2 + 2 * d_head + 6) * eps * dP
        merge = lambda a: a.transpose(0, 2, 1, 3).reshape(B * T, -1)                  # noqa: E731
        dq, dk = merge(dc * k / math.sqrt(d_qk)), merge(dc * q / math.sqrt(d_qk))
        grow = 1 + B * T * eps
        a2 = np.abs(a2.reshape(B * T, -1))
        out.append({"Δcausal": dc, "attn.q.weight": grow * a2.T @ dq, "attn.q.bias": grow * dq.sum(0),
                    "attn.k.weight": grow * a2.T @ dk})
    return out

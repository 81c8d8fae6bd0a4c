"""Fast kernels for the pointwise non-linearities (reference: :mod:`pedestrian.layers.activations`).

NumPy arrays: one numba pass per direction. The forward computes ``g(x)`` and ``g'(x)`` together
(they share ``Φ``, ``φ`` or ``tanh u``) and keeps ``g'(x)``, so the backward is ``Δ ∘ g'``; ``Φ``,
``φ`` and ``exp`` are polynomials the compiler vectorises (:mod:`.vecmath`), so the exact GELU
costs what the tanh one does; the GELU tanh approximation goes through the identity
``½(1 + tanh u) = σ(2u)`` (one ``exp``, no ``tanh``). SiLU's ``σ(x)`` and ``1 − σ(x)`` come from
one ``exp(−|x|)`` (:func:`silu_parts`, shared with :mod:`.swiglu`).
"""

from __future__ import annotations

import math

import numpy as np

from ..layers.activations import SILU_SATURATE, check_activation
from ..layers.checks import check_float
from .jit import kernel, prange
from .linear import linear_backward, linear_forward
from .vecmath import exp, normal_cdf_pdf
from .workspace import empty_array

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715
_MINUS_2K = -2.0 * _SQRT_2_OVER_PI                 # −2u = x(_MINUS_2K_C·x² + _MINUS_2K)
_MINUS_2K_C = -2.0 * _SQRT_2_OVER_PI * _GELU_C


@kernel(parallel=True)
def _relu_forward(x, y):
    """``y = max(x, 0)`` (NaN kept)."""
    zero = x.dtype.type(0.0)
    for i in prange(x.shape[0]):
        y[i] = x[i] if not x[i] <= zero else zero


@kernel(parallel=True)
def _relu_backward(delta, x, out):
    """``Δ_in = Δ ∘ [x > 0]`` (``[x > 0]`` is NaN at a NaN ``x``: the signal stays NaN)."""
    one, zero = x.dtype.type(1.0), x.dtype.type(0.0)
    for i in prange(x.shape[0]):
        xi = x[i]
        out[i] = delta[i] * (one if xi > zero else (zero if xi <= zero else xi))


@kernel(parallel=True)
def _gelu_forward(x, y, dg):
    """``y = x Φ(x)``, ``g'(x) = Φ(x) + x φ(x)``; a product with a factor rounded to 0 is 0
    (its exact value underflows; ``x = −∞`` would make it ``−∞ · 0 = NaN``)."""
    zero = x.dtype.type(0.0)
    for i in prange(x.shape[0]):
        xi = x[i]
        cdf, pdf = normal_cdf_pdf(xi)
        y[i] = xi * cdf if cdf != zero else zero
        dg[i] = cdf + (xi * pdf if pdf != zero else zero)


@kernel
def gelu_tanh_parts(xi, k):
    """``(g(x), g'(x))`` of the tanh GELU for one number, ``k`` = :func:`gelu_tanh_constants` in
    ``x``'s dtype: ``s = ½(1 + tanh u) = 1/(1 + e^{−2u})``, ``y = x s``, ``g'(x) = s (1 + 2(1 − s) A)``,
    ``A = x √(2/π)(1 + 3·0.044715 x²)`` (``1 − tanh² u = 4 s (1 − s)``). In the tails ``s`` or
    ``s (1 − s)`` rounds to 0 while ``x`` or ``A`` overflows: the product is then 0, its exact
    value's rounding (not ``0 · ∞ = NaN``), so ``g(−∞) = 0``, ``g'(−∞) = 0``, ``g'(+∞) = 1``."""
    one, zero, c1, c0, a1, a0 = k
    x2 = xi * xi
    s = one / (one + exp(xi * (c1 * x2 + c0)))                      # e^{−2u} = inf -> s = 0
    w = s * (one - s)
    return (xi * s if s != zero else zero), s + (w * xi * (a1 * x2 + a0) if w != zero else zero)


@kernel
def gelu_tanh_constants(T):
    """The constants of :func:`gelu_tanh_parts` in the dtype ``T`` (``x.dtype.type``)."""
    return (T(1.0), T(0.0), T(_MINUS_2K_C), T(_MINUS_2K), T(6.0 * _GELU_C * _SQRT_2_OVER_PI),
            T(2.0 * _SQRT_2_OVER_PI))


@kernel(parallel=True)
def _gelu_tanh_forward(x, y, dg):
    """``y = ½x(1 + tanh u)`` and ``g'(x)`` (:func:`gelu_tanh_parts`)."""
    k = gelu_tanh_constants(x.dtype.type)
    for i in prange(x.shape[0]):
        y[i], dg[i] = gelu_tanh_parts(x[i], k)


@kernel
def silu_parts(x, one, lo, hi):
    """``(silu(x), silu'(x))`` of one number, ``one, lo, hi`` = ``1, −SILU_SATURATE, SILU_SATURATE``
    in ``x``'s dtype: ``e = exp(−|x|)``, ``σ(|x|) = 1/(1 + e)``, ``σ(−|x|) = e σ(|x|)`` (no
    overflow, no ``1 − σ`` cancellation), ``x`` clipped where ``σ`` is exactly 0 or 1 (so
    ``silu(−inf) = −0``, ``silu'(±inf) = 0, 1``); NaN passes every comparison through."""
    xc = lo if x < lo else (hi if x > hi else x)
    e = exp(-abs(xc))
    p = one / (one + e)                                    # σ(|x|)
    q = e * p                                              # σ(−|x|) = 1 − σ(|x|)
    pos = x >= 0.0
    s = p if pos else q                                    # σ(x)
    s_bar = q if pos else p                                # 1 − σ(x)
    return (lo if x < lo else x) * s, s * (one + xc * s_bar)


@kernel(parallel=True)
def _silu_forward(x, y, dg):
    """``y = x σ(x)``, ``g'(x) = σ(x)(1 + x(1 − σ(x)))`` (:func:`silu_parts`)."""
    T = x.dtype.type
    one, lo, hi = T(1.0), T(-SILU_SATURATE), T(SILU_SATURATE)
    for i in prange(x.shape[0]):
        y[i], dg[i] = silu_parts(x[i], one, lo, hi)


@kernel(parallel=True)
def _times(delta, dg, out):
    """``Δ_in = Δ ∘ g'``."""
    for i in prange(dg.shape[0]):
        out[i] = delta[i] * dg[i]


def _flat(a):
    return np.ascontiguousarray(a).reshape(-1)


def activation_forward(x, name: str):
    """``a8 = g(a7)`` entry by entry, keeping ``g'(a7)``: ReLU ``max(x, 0)``, GELU ``x Φ(x)``,
    GELU-tanh ``½x(1 + tanh u)``, ``u = √(2/π)(x + 0.044715x³)``, SiLU ``x σ(x)`` (EQUATIONS.md, "Fully
    connected (FC), activations, residual").

    Args:
        x: float array of any shape (the paper's ``a7``, ``(B, T, d_mlp)``).
        name: ``"relu"``; ``"gelu"`` (exact, ``x Φ(x)``); ``"gelu_tanh"`` (GPT-2's
            ``½x(1 + tanh(√(2/π)(x + 0.044715x³)))``, HF ``gelu_new``); ``"silu"`` (``x σ(x)``;
            ``silu(−inf) = −0``).

    Returns:
        ``(y, cache)``: ``cache = x`` for ReLU, ``(x, g'(x))`` for the GELUs and SiLU.
        :func:`activation_backward` takes the cache, or ``x`` alone.

    Raises:
        ValueError: unknown activation name.
    """
    check_activation(name)
    check_float(x, "the activation's input")
    y = empty_array(x.shape, x)
    if name == "relu":
        _relu_forward(_flat(x), y.reshape(-1))
        return y, x
    dg = empty_array(x.shape, x)
    forward = {"gelu": _gelu_forward, "gelu_tanh": _gelu_tanh_forward, "silu": _silu_forward}[name]
    forward(_flat(x), y.reshape(-1), dg.reshape(-1))
    return y, (x, dg)


def activation_backward(delta, cache, name: str):
    """``Δ_in = Δ ∘ g'(x)`` (EQUATIONS.md, "Fully connected (FC), activations, residual").

    - ReLU: ``g'(x) = [x > 0]``.
    - GELU exact: ``g'(x) = Φ(x) + x φ(x)``.
    - GELU tanh: ``g'(x) = ½(1 + tanh u) + ½x(1 − tanh² u)√(2/π)(1 + 3·0.044715x²)``.
    - SiLU: ``g'(x) = σ(x)(1 + x(1 − σ(x)))`` (``0`` at ``−inf``, ``1`` at ``+inf``).

    Args:
        delta: error signal, same shape as ``x``.
        cache: from :func:`activation_forward`, or the forward input ``x``.
        name: as in :func:`activation_forward`.
    """
    check_activation(name)
    x, s = cache if isinstance(cache, tuple) else (cache, None)
    out = empty_array(x.shape, x)
    if name == "relu":
        _relu_backward(_flat(delta), _flat(x), out.reshape(-1))
        return out
    if s is None:                                      # x alone: g' from a forward pass
        s = activation_forward(x, name)[1][1]
    _times(_flat(delta), _flat(s), out.reshape(-1))
    return out


def linear_activation_forward(x, weight, bias, name: str):
    """``a7 = a6 W + b``, ``a8 = g(a7)``: fast :func:`pedestrian.layers.activations.linear_activation_forward`.

    On the CPU the two stay two kernels, the product with the bias in its loop
    (:func:`.linear.linear_forward`) and the activation's pass (:func:`activation_forward`): the
    same bits as calling them one after the other. The seam exists for the GPU, where the bias
    moves out of the product into the activation's one pass (:mod:`pedestrian.gpu.activations`)."""
    a7, _ = linear_forward(x, weight, bias)
    a8, act = activation_forward(a7, name)
    return (a7, a8), (x, act)


def linear_activation_backward(delta, cache, weight, name: str, *, dweight=None, dbias=None):
    """``Δ7 = Δ8 ∘ g'(a7)``, ``dW = a6ᵀ Δ7``, ``db = Σ Δ7``, ``Δ6 = Δ7 Wᵀ``: fast
    :func:`pedestrian.layers.activations.linear_activation_backward` (two kernels, as the forward)."""
    x, act = cache
    d7 = activation_backward(delta, act, name)
    return linear_backward(d7, x, weight, dweight=dweight, dbias=dbias), d7

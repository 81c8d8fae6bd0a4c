"""``exp`` and the normal distribution's ``Φ``, ``φ`` as polynomials numba's compiler vectorises.

The llvmlite on PyPI has no vector math library, so ``math.exp`` inside a numba loop is one
scalar call per element and ``math.erf`` too. These are written as the arithmetic a SIMD loop
can run (``2^n`` by putting ``n`` into the exponent bits), for float32 and float64 separately
(a float32 loop never touches a float64; timings in docs/kernels.md). Called from inside
kernels only (``@overload``, inlined into the calling loop; registered by
:func:`register_overloads`, which :mod:`.jit` calls when it imports numba, before the first compile).

- :func:`exp`: Cody and Waite's reduction ``x = k ln 2 + f``, ``|f| <= ln 2 / 2``; float64 a
  degree-13 Taylor polynomial, float32 Cephes' ``expf`` polynomial; ``2^k`` from the exponent bits
  in two halves so that neither overflows: at most 1.5 ulp (float32) / 1 ulp (float64) from the
  exact value over the whole range, subnormal results included (tests/paper/test_s4_attention_loops.py);
  ``exp(−∞) = 0``, ``exp(+∞) = ∞``, NaN -> NaN.
- :func:`normal_cdf_pdf`: ``(Φ(x), φ(x))``. float64: ``Φ(x) = ½ erfc(−x/√2)`` by W. J. Cody's
  rational Chebyshev approximations of ``erf``/``erfc`` (Math. Comp. 23, 1969; the coefficients
  of SPECFUN's ``CALERF``), all three intervals evaluated and one selected (a branch would stop
  the vectorisation), ``φ`` sharing its ``exp(−x²/2)``; error ≤ 2e-16 absolute. float32: Eigen's
  clamped rational ``erf(x) ≈ x P(x²)/Q(x²)`` (a few float32 ulp) and the float32 ``exp``.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["exp", "normal_cdf_pdf"]

_LOG2E = 1.4426950408889634
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_INV_SQRT_PI = 1.0 / math.sqrt(math.pi)

# Cody (1969): erf(y) = y A(y²)/B(y²) for y <= 0.46875; erfc(y) = e^{-y²} C(y)/D(y) for y <= 4;
# erfc(y) = e^{-y²}/y (1/√π − y⁻² P(y⁻²)/Q(y⁻²)) above (highest degree first, leading 1 in B, D, Q)
_A = (1.85777706184603153e-1, 3.16112374387056560e0, 1.13864154151050156e2, 3.77485237685302021e2,
      3.20937758913846947e3)
_B = (1.0, 2.36012909523441209e1, 2.44024637934444173e2, 1.28261652607737228e3, 2.84423683343917062e3)
_C = (2.15311535474403846e-8, 5.64188496988670089e-1, 8.88314979438837594e0, 6.61191906371416295e1,
      2.98635138197400131e2, 8.81952221241769090e2, 1.71204761263407058e3, 2.05107837782607147e3,
      1.23033935479799725e3)
_D = (1.0, 1.57449261107098347e1, 1.17693950891312499e2, 5.37181101862009858e2, 1.62138957456669019e3,
      3.29079923573345963e3, 4.36261909014324716e3, 3.43936767414372164e3, 1.23033935480374942e3)
_P = (1.63153871373020978e-2, 3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1,
      1.60837851487422766e-2, 6.58749161529837803e-4)
_Q = (1.0, 2.56852019228982242e0, 1.87295284992346047e0, 5.27905102951428412e-1, 6.05183413124413191e-2,
      2.33520497626869185e-3)
# Eigen's float erf on [-4, 4]: x (odd polynomial) / (even polynomial), highest degree first
_ERF32_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
            -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF32_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
            -1.42647390514189e-02)


def exp(x):
    """``e^x`` (inside a numba kernel: the vectorisable polynomial; here, for Python: math.exp)."""
    return math.exp(x)


def normal_cdf_pdf(x):
    """``(Φ(x), φ(x))`` of the standard normal distribution (Python fallback)."""
    return 0.5 * math.erfc(-x * _INV_SQRT_2), _INV_SQRT_2PI * math.exp(-0.5 * x * x)


def _horner(c, t):
    """A polynomial in ``t`` (coefficients ``c``, highest degree first): unrolled Horner."""
    p = c[0]
    for k in c[1:]:
        p = p * t + k
    return p


def register_overloads() -> None:
    """Register the kernels' versions of :func:`exp`, :func:`normal_cdf_pdf` (and
    :func:`_horner`) with numba; imports numba. Called once, by :mod:`.jit`."""
    from numba.core import types
    from numba.extending import overload, register_jitable

    register_jitable(_horner)

    @overload(exp)
    def _exp_overload(x):
        if x == types.float32:
            def exp32(x):
                lo, hi = np.float32(-104.0), np.float32(88.8)                # e^x = 0 below, ∞ above
                xc = lo if x < lo else (hi if x > hi else x)                 # (NaN passes through)
                k = np.floor(xc * np.float32(1.4426950408889634) + np.float32(0.5))
                f = xc - k * np.float32(0.693359375) + k * np.float32(2.12194440e-4)
                p = np.float32(1.9875691500e-4)                              # Cephes expf
                p = p * f + np.float32(1.3981999507e-3)
                p = p * f + np.float32(8.3334519073e-3)
                p = p * f + np.float32(4.1665795894e-2)
                p = p * f + np.float32(1.6666665459e-1)
                p = p * f + np.float32(5.0000001201e-1)
                p = p * f * f + f + np.float32(1.0)
                ki = np.int32(k)
                h = ki >> np.int32(1)
                y = (p * np.int32((h + np.int32(127)) << np.int32(23)).view(np.float32)
                     * np.int32((ki - h + np.int32(127)) << np.int32(23)).view(np.float32))
                return np.float32(0.0) if x < lo else y
            return exp32
        if x == types.float64:
            def exp64(x):
                lo, hi = -746.0, 709.9
                xc = lo if x < lo else (hi if x > hi else x)
                k = np.floor(xc * 1.4426950408889634 + 0.5)
                f = (xc - k * 6.93147180369123816490e-01) - k * 1.90821492927058770002e-10
                p = 1.0 / 6227020800.0                                       # Taylor to f^13
                for c in (479001600.0, 39916800.0, 3628800.0, 362880.0, 40320.0, 5040.0, 720.0,
                          120.0, 24.0, 6.0, 2.0):
                    p = p * f + 1.0 / c
                p = p * f * f + f + 1.0
                ki = np.int64(k)
                h = ki >> np.int64(1)
                y = (p * np.int64((h + np.int64(1023)) << np.int64(52)).view(np.float64)
                     * np.int64((ki - h + np.int64(1023)) << np.int64(52)).view(np.float64))
                return 0.0 if x < lo else y
            return exp64
        return None

    @overload(normal_cdf_pdf)
    def _normal_cdf_pdf(x):
        if x == types.float64:
            def impl(x):
                y = abs(x) * _INV_SQRT_2                                    # erf argument |x|/√2
                e = exp(-0.5 * x * x)                                       # e^{-y²} = √(2π) φ(x)
                t = y * y
                erf_small = y * _horner(_A, t) / _horner(_B, t)             # y <= 0.46875
                erfc_mid = e * _horner(_C, y) / _horner(_D, y)              # y <= 4
                u = 1.0 / t
                erfc_big = e * (_INV_SQRT_PI - u * _horner(_P, u) / _horner(_Q, u)) / y
                half_erfc = 0.5 * (1.0 - erf_small if y <= 0.46875 else (erfc_mid if y <= 4.0 else erfc_big))
                cdf = half_erfc if x < 0.0 else 1.0 - half_erfc             # Φ(x) = ½ erfc(−x/√2)
                return cdf, _INV_SQRT_2PI * e
            return impl
        if x == types.float32:
            f = np.float32
            p, q = tuple(f(v) for v in _ERF32_P), tuple(f(v) for v in _ERF32_Q)
            four, minus_four, half, one = f(4.0), f(-4.0), f(0.5), f(1.0)
            inv_sqrt_2, minus_half, inv_sqrt_2pi = f(_INV_SQRT_2), f(-0.5), f(_INV_SQRT_2PI)

            def impl(x):
                z = x * inv_sqrt_2
                z = four if z > four else (minus_four if z < minus_four else z)   # NaN stays NaN
                t = z * z
                erf = z * _horner(p, t) / _horner(q, t)
                return half * (one + erf), inv_sqrt_2pi * exp(minus_half * x * x)
            return impl

"""Fast kernels for the SwiGLU MLP and Gemma's GeGLU (reference: :mod:`pedestrian.layers.swiglu`).

NumPy arrays: the three products on BLAS (:mod:`.linear`), the gated product in one numba pass
each way. The forward keeps no ``σ``: the backward recomputes ``g`` and ``g'`` (``silu`` or the
tanh GELU, a number :data:`GATES` passes into the loops) from ``a7_gate`` in the same pass that
writes ``Δ7_gate`` and ``Δ7_up`` (one ``exp`` per entry, vectorised: :mod:`.vecmath`), so the
cache is the arrays the reference keeps and nothing more.
"""

from __future__ import annotations

import numpy as np

from ..layers.activations import SILU_SATURATE
from ..layers.swiglu import SwiGLUCache, check_gate, check_swiglu_shapes, split_cache
from .activations import gelu_tanh_constants, gelu_tanh_parts, silu_parts
from .jit import kernel, prange
from .linear import linear_backward, linear_forward
from .workspace import empty_array


#: the gate's activation -> its number in the compiled loops
GATES = {"silu": 0, "gelu_tanh": 1}


@kernel
def gate_parts(x, kind, s, k):
    """``(g(x), g'(x))`` of one number: ``kind`` 0 SiLU (``s`` = ``(1, −SILU_SATURATE,
    SILU_SATURATE)``, :func:`.activations.silu_parts`), 1 the tanh GELU (``k`` =
    :func:`.activations.gelu_tanh_constants`), both in ``x``'s dtype."""
    if kind == 0:
        return silu_parts(x, s[0], s[1], s[2])
    return gelu_tanh_parts(x, k)


@kernel(parallel=True)
def _gate_forward(gate, up, out, kind):
    """``a8 = g(a7_gate) ∘ a7_up``."""
    T = gate.dtype.type
    s, k = (T(1.0), T(-SILU_SATURATE), T(SILU_SATURATE)), gelu_tanh_constants(T)
    for i in prange(gate.shape[0]):
        out[i] = gate_parts(gate[i], kind, s, k)[0] * up[i]


@kernel(parallel=True)
def _gate_backward(delta, gate, up, d_gate, d_up, kind):
    """``Δ7_up = Δ8 ∘ g(a7_gate)``, ``Δ7_gate = Δ8 ∘ a7_up ∘ g'(a7_gate)``."""
    T = gate.dtype.type
    s, k = (T(1.0), T(-SILU_SATURATE), T(SILU_SATURATE)), gelu_tanh_constants(T)
    for i in prange(gate.shape[0]):
        g, dg = gate_parts(gate[i], kind, s, k)
        d_up[i] = delta[i] * g
        d_gate[i] = delta[i] * up[i] * dg


@kernel(parallel=True)
def _gate_forward_fused(a7, out, kind):
    """``a8 = g(a7_gate) ∘ a7_up`` from the fused gate/up layer's ``(rows, 2m)`` output
    ``a7 = [a7_gate | a7_up]``, row by row (contiguous halves: vectorised)."""
    T = a7.dtype.type
    s, k = (T(1.0), T(-SILU_SATURATE), T(SILU_SATURATE)), gelu_tanh_constants(T)
    m = out.shape[1]
    for r in prange(a7.shape[0]):
        gate, up, o = a7[r, :m], a7[r, m:], out[r]
        for j in range(m):
            o[j] = gate_parts(gate[j], kind, s, k)[0] * up[j]


#: ``out = g(a7_gate) ∘ a7_up`` of a fused ``(rows, 2m)`` ``a7``, into ``out`` ``(rows, m)``; ``kind``: :data:`GATES`
gate_fused_into = _gate_forward_fused


@kernel(parallel=True)
def _gate_backward_fused(a7, delta, d7, kind):
    """:func:`_gate_backward` from and into the fused layout: ``a7``, ``d7`` ``(rows, 2m)``."""
    T = a7.dtype.type
    s, k = (T(1.0), T(-SILU_SATURATE), T(SILU_SATURATE)), gelu_tanh_constants(T)
    m = delta.shape[1]
    for r in prange(a7.shape[0]):
        gate, up, dl, d_gate, d_up = a7[r, :m], a7[r, m:], delta[r], d7[r, :m], d7[r, m:]
        for j in range(m):
            g, dg = gate_parts(gate[j], kind, s, k)
            d_up[j] = dl[j] * g
            d_gate[j] = dl[j] * up[j] * dg


def _flat(a):
    return np.ascontiguousarray(a).reshape(-1)


def _fused(gate, up):
    """The ``(rows, 2m)`` array whose two halves ``gate`` and ``up`` are (the fused gate/up layer's
    output, read in place), or ``None`` if they are not the halves of one C-contiguous array."""
    if gate.ndim < 2:                                          # (one row: contiguous, never here)
        return None
    m, size = gate.shape[-1], gate.itemsize
    rows, strides = gate.size // max(m, 1), [size]
    for n in (2 * m, *gate.shape[-2:0:-1]):                   # C order of (..., 2m), last axis first
        strides.insert(0, strides[0] * n)
    strides = tuple(strides)
    if (gate.shape != up.shape or gate.dtype != up.dtype or gate.strides != strides
            or up.strides != strides or up.ctypes.data != gate.ctypes.data + m * size):
        return None
    return np.lib.stride_tricks.as_strided(gate, (rows, 2 * m), (2 * m * size, size), writeable=False)


def swiglu_forward(gate, up, activation: str = "silu"):
    """``a8 = g(a7_gate) ∘ a7_up``, ``g`` SiLU (SwiGLU) or the tanh GELU (GeGLU) (EQUATIONS.md, "SiLU
    and the SwiGLU MLP", "Gemma").

    Fast :func:`pedestrian.layers.swiglu.swiglu_forward` (same arguments and results; ``gate``,
    ``up`` may be the halves of the fused gate/up layer's output, read in place)."""
    check_gate(activation)
    out = empty_array(gate.shape, gate)
    a7 = None if gate.flags.c_contiguous else _fused(gate, up)
    if a7 is not None:
        _gate_forward_fused(a7, out.reshape(-1, gate.shape[-1]), GATES[activation])
    else:
        _gate_forward(_flat(gate), _flat(up), out.reshape(-1), GATES[activation])
    return out, (gate, up, activation)


def swiglu_backward(delta, cache, *, fused: bool = False):
    """``Δ7_gate = Δ8 ∘ a7_up ∘ g'(a7_gate)``, ``Δ7_up = Δ8 ∘ g(a7_gate)`` (EQUATIONS.md, "SiLU and
    the SwiGLU MLP").

    Fast :func:`pedestrian.layers.swiglu.swiglu_backward` (same arguments and results; with
    ``fused`` both halves of ``Δ7`` are written straight into it)."""
    gate, up, activation = split_cache(cache)
    kind = GATES[activation]
    m = gate.shape[-1]
    a7 = None if gate.flags.c_contiguous else _fused(gate, up)
    if fused and a7 is not None:
        d7 = empty_array((*gate.shape[:-1], 2 * m), gate)
        _gate_backward_fused(a7, np.ascontiguousarray(delta).reshape(-1, m), d7.reshape(-1, 2 * m), kind)
        return d7
    d_gate, d_up = empty_array(gate.shape, gate), empty_array(gate.shape, gate)
    _gate_backward(_flat(delta), _flat(gate), _flat(up), d_gate.reshape(-1), d_up.reshape(-1), kind)
    if fused:
        return np.concatenate((d_gate, d_up), axis=-1)
    return d_gate, d_up


def swiglu_mlp_forward(x, w_gate, w_up, w_down, *, activation: str = "silu"):
    """``a9 = (g(a6 W_gate) ∘ a6 W_up) W_down`` (EQUATIONS.md, "SiLU and the SwiGLU MLP").

    Fast :func:`pedestrian.layers.swiglu.swiglu_mlp_forward` (same arguments and results)."""
    check_swiglu_shapes(x, w_gate, w_up, w_down)
    a7_gate, _ = linear_forward(x, w_gate)
    a7_up, _ = linear_forward(x, w_up)
    a8, _ = swiglu_forward(a7_gate, a7_up, activation)
    a9, _ = linear_forward(a8, w_down)
    return a9, SwiGLUCache(x, a7_gate, a7_up, a8, activation)


def swiglu_mlp_backward(delta, cache, w_gate, w_up, w_down, *, dw_gate=None, dw_up=None, dw_down=None,
                        need_input=True):
    """``dW_down = a8ᵀ Δ9``, ``Δ8 = Δ9 W_downᵀ``, ``Δ7_*`` as :func:`swiglu_backward`,
    ``dW_gate = a6ᵀ Δ7_gate``, ``dW_up = a6ᵀ Δ7_up``, ``Δ6 = Δ7_gate W_gateᵀ + Δ7_up W_upᵀ`` (EQUATIONS.md,
    "SiLU and the SwiGLU MLP").

    Fast :func:`pedestrian.layers.swiglu.swiglu_mlp_backward` (same arguments and result; the
    two halves of ``Δ6`` are added in place)."""
    d8 = linear_backward(delta, cache.a8, w_down, dweight=dw_down)
    d7_gate, d7_up = swiglu_backward(d8, (cache.a7_gate, cache.a7_up, cache.activation))
    d6 = linear_backward(d7_gate, cache.a6, w_gate, dweight=dw_gate, need_input=need_input)
    d6_up = linear_backward(d7_up, cache.a6, w_up, dweight=dw_up, need_input=need_input)
    if need_input:
        np.add(d6, d6_up, out=d6)
    return d6

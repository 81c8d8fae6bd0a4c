"""Fast kernels for the SwiGLU MLP (reference: :mod:`pedestrian.layers.swiglu`).

NumPy arrays: the three products on BLAS (:mod:`.linear`), the gated product in one numba pass
each way. The forward keeps no ``σ``: the backward recomputes ``silu`` and ``silu'`` from
``a7_gate`` in the same pass that writes ``Δ7_gate`` and ``Δ7_up`` (one ``exp`` per entry,
vectorised: :mod:`.vecmath`), so the cache is the arrays the reference keeps and nothing more.
"""

from __future__ import annotations

import numpy as np

from ..layers.activations import SILU_SATURATE
from ..layers.swiglu import SwiGLUCache, check_swiglu_shapes
from .activations import silu_parts
from .jit import kernel, prange
from .linear import linear_backward, linear_forward
from .workspace import empty_array


@kernel(parallel=True)
def _gate_forward(gate, up, out):
    """``a8 = silu(a7_gate) ∘ a7_up``."""
    T = gate.dtype.type
    one, lo, hi = T(1.0), T(-SILU_SATURATE), T(SILU_SATURATE)
    for i in prange(gate.shape[0]):
        out[i] = silu_parts(gate[i], one, lo, hi)[0] * up[i]


#: ``out = silu(gate) ∘ up`` of flat arrays, written into ``out`` (serial or threaded by size)
gate_into = _gate_forward


@kernel(parallel=True)
def _gate_backward(delta, gate, up, d_gate, d_up):
    """``Δ7_up = Δ8 ∘ silu(a7_gate)``, ``Δ7_gate = Δ8 ∘ a7_up ∘ silu'(a7_gate)``."""
    T = gate.dtype.type
    one, lo, hi = T(1.0), T(-SILU_SATURATE), T(SILU_SATURATE)
    for i in prange(gate.shape[0]):
        silu, dsilu = silu_parts(gate[i], one, lo, hi)
        d_up[i] = delta[i] * silu
        d_gate[i] = delta[i] * up[i] * dsilu


def _flat(a):
    return np.ascontiguousarray(a).reshape(-1)


def swiglu_forward(gate, up):
    """``a8 = silu(a7_gate) ∘ a7_up`` (EQUATIONS.md, "SiLU and the SwiGLU MLP").

    Fast :func:`pedestrian.layers.swiglu.swiglu_forward` (same arguments and results)."""
    out = empty_array(gate.shape, gate)
    _gate_forward(_flat(gate), _flat(up), out.reshape(-1))
    return out, (gate, up)


def swiglu_backward(delta, cache):
    """``Δ7_gate = Δ8 ∘ a7_up ∘ silu'(a7_gate)``, ``Δ7_up = Δ8 ∘ silu(a7_gate)`` (EQUATIONS.md, "SiLU and
    the SwiGLU MLP").

    Fast :func:`pedestrian.layers.swiglu.swiglu_backward` (same arguments and results)."""
    gate, up = cache
    d_gate, d_up = empty_array(gate.shape, gate), empty_array(gate.shape, gate)
    _gate_backward(_flat(delta), _flat(gate), _flat(up), d_gate.reshape(-1), d_up.reshape(-1))
    return d_gate, d_up


def swiglu_mlp_forward(x, w_gate, w_up, w_down):
    """``a9 = (silu(a6 W_gate) ∘ a6 W_up) W_down`` (EQUATIONS.md, "SiLU and the SwiGLU MLP").

    Fast :func:`pedestrian.layers.swiglu.swiglu_mlp_forward` (same arguments and results)."""
    check_swiglu_shapes(x, w_gate, w_up, w_down)
    a7_gate, _ = linear_forward(x, w_gate)
    a7_up, _ = linear_forward(x, w_up)
    a8, _ = swiglu_forward(a7_gate, a7_up)
    a9, _ = linear_forward(a8, w_down)
    return a9, SwiGLUCache(x, a7_gate, a7_up, a8)


def swiglu_mlp_backward(delta, cache, w_gate, w_up, w_down, *, dw_gate=None, dw_up=None, dw_down=None,
                        need_input=True):
    """``dW_down = a8ᵀ Δ9``, ``Δ8 = Δ9 W_downᵀ``, ``Δ7_*`` as :func:`swiglu_backward`,
    ``dW_gate = a6ᵀ Δ7_gate``, ``dW_up = a6ᵀ Δ7_up``, ``Δ6 = Δ7_gate W_gateᵀ + Δ7_up W_upᵀ`` (EQUATIONS.md,
    "SiLU and the SwiGLU MLP").

    Fast :func:`pedestrian.layers.swiglu.swiglu_mlp_backward` (same arguments and result; the
    two halves of ``Δ6`` are added in place)."""
    d8 = linear_backward(delta, cache.a8, w_down, dweight=dw_down)
    d7_gate, d7_up = swiglu_backward(d8, (cache.a7_gate, cache.a7_up))
    d6 = linear_backward(d7_gate, cache.a6, w_gate, dweight=dw_gate, need_input=need_input)
    d6_up = linear_backward(d7_up, cache.a6, w_up, dweight=dw_up, need_input=need_input)
    if need_input:
        np.add(d6, d6_up, out=d6)
    return d6

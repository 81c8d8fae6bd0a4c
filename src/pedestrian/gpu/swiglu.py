"""The SwiGLU gate (and Gemma's GeGLU: the tanh GELU in place of SiLU) on the GPU (reference:
:func:`pedestrian.layers.swiglu.swiglu_forward`, :func:`~pedestrian.layers.swiglu.swiglu_backward`;
EQUATIONS.md "SiLU and the SwiGLU MLP"). The gate's ``g`` is a compile-time switch, the
activations' own :func:`~.activations.activation_value` / :func:`~.activations.activation_slope`.

One kernel per direction over rows of ``m`` features, reading ``a7_gate`` and ``a7_up`` where they
lie (the two halves of the fused ``mlp_gate_up`` product: rows ``2m`` apart, no copy): the
forward writes ``a8 = silu(g) ∘ u``; the backward writes ``Δ7_gate = (Δ8 ∘ u) ∘ silu'(g)`` and
``Δ7_up = Δ8 ∘ silu(g)`` side by side into one ``(N, 2m)`` array (``fused``, the signal of the
fused product) in one pass. The two products (``W_gate_up``, ``W_down``) stay on cuBLAS:
:func:`~pedestrian.layers.swiglu.swiglu_mlp_forward` runs as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layers.swiglu import check_gate, split_cache
from .activations import activation_slope, activation_value

#: the gate's activation -> its ``KIND`` in :func:`~.activations.activation_value`
GATES = {"silu": 3, "gelu_tanh": 2}


@triton.jit
def _forward_kernel(G, U, Y, m, stride_g, stride_u, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``pid(0)``, columns block ``pid(1)``: ``y = g(x) ∘ u`` (SiLU ``x σ(x)``, ``x`` clipped at
    −1000 as the reference; or the tanh GELU)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < m
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0)
    tl.store(Y + row * m + cols, activation_value(g, KIND) * u, mask=mask)


@triton.jit
def _backward_kernel(DY, G, U, DG, DU, m, stride_g, stride_u, stride_d, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """``Δ_up = Δ ∘ g(x)``, ``Δ_gate = (Δ ∘ u) ∘ g'(x)`` (SiLU: ``σ(x)(1 + x(1 − σ(x)))``)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < m
    dy = tl.load(DY + row * m + cols, mask=mask, other=0.0)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0)
    tl.store(DU + row * stride_d + cols, dy * activation_value(g, KIND), mask=mask)
    tl.store(DG + row * stride_d + cols, (dy * u) * activation_slope(g, KIND), mask=mask)


def _row_view(a, m: int):
    """``a`` ``(..., m)`` as ``(N, m)`` rows of unit column stride (a view where it can be: the
    halves of ``a7``), and the distance between its rows."""
    rows = a.reshape(-1, m)
    rows = rows if m <= 1 or rows.stride(1) == 1 else rows.contiguous()
    return rows, rows.stride(0)


def _grid(n: int, m: int):
    block = min(1024, max(16, triton.next_power_of_2(m)))
    return (max(n, 1), triton.cdiv(m, block)), block


def swiglu_forward(gate, up, activation: str = "silu"):
    """``a8 = g(a7_gate) ∘ a7_up``, elementwise (``g``: SiLU, or GeGLU's tanh GELU).

    GPU :func:`pedestrian.layers.swiglu.swiglu_forward` (same arguments, result and cache
    ``(gate, up, activation)``)."""
    check_gate(activation)
    m = gate.shape[-1]
    g, sg = _row_view(gate, m)
    u, su = _row_view(up, m)
    y = torch.empty((g.shape[0], m), dtype=gate.dtype, device=gate.device)
    grid, block = _grid(g.shape[0], m)
    if g.shape[0]:
        _forward_kernel[grid](g, u, y, m, sg, su, KIND=GATES[activation], BLOCK=block)
    return y.reshape(gate.shape), (gate, up, activation)


def swiglu_backward(delta, cache, *, fused: bool = False):
    """``Δ7_up = Δ8 ∘ g(a7_gate)``, ``Δ7_gate = Δ8 ∘ a7_up ∘ g'(a7_gate)``.

    GPU :func:`pedestrian.layers.swiglu.swiglu_backward` (same arguments and results; with
    ``fused`` the two are written side by side, ``[Δ7_gate | Δ7_up]``, by the kernel itself)."""
    gate, up, activation = split_cache(cache)
    m = gate.shape[-1]
    g, sg = _row_view(gate, m)
    u, su = _row_view(up, m)
    dy = delta.contiguous().reshape(-1, m)
    n = dy.shape[0]
    out = torch.empty((n, 2 * m), dtype=delta.dtype, device=delta.device)
    grid, block = _grid(n, m)
    if n:
        _backward_kernel[grid](dy, g, u, out, out[:, m:], m, sg, su, 2 * m, KIND=GATES[activation], BLOCK=block)
    if fused:
        return out.reshape(*delta.shape[:-1], 2 * m)
    return out[:, :m].reshape(delta.shape), out[:, m:].reshape(delta.shape)

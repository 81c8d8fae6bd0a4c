"""The SwiGLU gate on the GPU (reference: :func:`pedestrian.layers.swiglu.swiglu_forward`,
:func:`~pedestrian.layers.swiglu.swiglu_backward`; EQUATIONS.md "SiLU and the SwiGLU MLP").

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

from .activations import sigmoid_pair


@triton.jit
def _forward_kernel(G, U, Y, m, stride_g, stride_u, BLOCK: tl.constexpr):
    """Row ``pid(0)``, columns block ``pid(1)``: ``y = x σ(x) ∘ u`` (``x`` clipped at −1000 as the reference)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < m
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0)
    s, _ = sigmoid_pair(g)
    tl.store(Y + row * m + cols, tl.maximum(g, -1000.0) * s * u, mask=mask)


@triton.jit
def _backward_kernel(DY, G, U, DG, DU, m, stride_g, stride_u, stride_d, BLOCK: tl.constexpr):
    """``Δ_up = Δ ∘ silu(g)``, ``Δ_gate = (Δ ∘ u) ∘ σ(g)(1 + g(1 − σ(g)))``."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < m
    dy = tl.load(DY + row * m + cols, mask=mask, other=0.0)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0)
    s, s_bar = sigmoid_pair(g)
    tl.store(DU + row * stride_d + cols, dy * (tl.maximum(g, -1000.0) * s), mask=mask)
    slope = s * (1.0 + tl.minimum(tl.maximum(g, -1000.0), 1000.0) * s_bar)
    tl.store(DG + row * stride_d + cols, (dy * u) * slope, mask=mask)


def _row_view(a, m: int):
    """``a`` ``(..., m)`` as ``(N, m)`` rows of unit column stride (a view where it can be: the
    halves of ``a7``), and the distance between its rows."""
    rows = a.reshape(-1, m)
    rows = rows if m <= 1 or rows.stride(1) == 1 else rows.contiguous()
    return rows, rows.stride(0)


def _grid(n: int, m: int):
    block = min(1024, max(16, triton.next_power_of_2(m)))
    return (max(n, 1), triton.cdiv(m, block)), block


def swiglu_forward(gate, up):
    """``a8 = silu(a7_gate) ∘ a7_up``, elementwise.

    GPU :func:`pedestrian.layers.swiglu.swiglu_forward` (same arguments, result and cache ``(gate, up)``)."""
    m = gate.shape[-1]
    g, sg = _row_view(gate, m)
    u, su = _row_view(up, m)
    y = torch.empty((g.shape[0], m), dtype=gate.dtype, device=gate.device)
    grid, block = _grid(g.shape[0], m)
    if g.shape[0]:
        _forward_kernel[grid](g, u, y, m, sg, su, BLOCK=block)
    return y.reshape(gate.shape), (gate, up)


def swiglu_backward(delta, cache, *, fused: bool = False):
    """``Δ7_up = Δ8 ∘ silu(a7_gate)``, ``Δ7_gate = Δ8 ∘ a7_up ∘ silu'(a7_gate)``.

    GPU :func:`pedestrian.layers.swiglu.swiglu_backward` (same arguments and results; with
    ``fused`` the two are written side by side, ``[Δ7_gate | Δ7_up]``, by the kernel itself)."""
    gate, up = cache
    m = gate.shape[-1]
    g, sg = _row_view(gate, m)
    u, su = _row_view(up, m)
    dy = delta.contiguous().reshape(-1, m)
    n = dy.shape[0]
    out = torch.empty((n, 2 * m), dtype=delta.dtype, device=delta.device)
    grid, block = _grid(n, m)
    if n:
        _backward_kernel[grid](dy, g, u, out, out[:, m:], m, sg, su, 2 * m, BLOCK=block)
    if fused:
        return out.reshape(*delta.shape[:-1], 2 * m)
    return out[:, :m].reshape(delta.shape), out[:, m:].reshape(delta.shape)

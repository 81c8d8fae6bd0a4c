"""The output head fused with its loss on the GPU (reference: :mod:`pedestrian.layers.head_loss`;
EQUATIONS.md, "The head fused with its loss").

Per chunk of rows::

    z_c = h_c W + b                                   (torch matmul: cuBLAS)
    L  += Σ_counted (logsumexp z_t − z_{t,y_t}) / C   Δ12_c = (softmax z_c − onehot y_c) / C   (Triton, in place)
    Δ11_c = Δ12_c Wᵀ      dW += h_cᵀ Δ12_c      db += Σ_rows Δ12_c              (torch matmul)

The Triton kernel takes one row per program and walks it in blocks of ``BLOCK`` logits twice:
a running maximum and sum (``s ← s·e^{m_old − m_new} + Σ e^{z − m_new}``, the flash attention's
rescaling), then ``Δ12`` written over the logits. Its statistics are float32 whatever the logits'
dtype (float64 logits: float64). The loss of the chunk's rows is one number per row (no host read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import array_namespace
from ..layers.checks import check_float, check_ids
from ..layers.head_loss import HeadLossCache, head_chunk_rows
from ..layers.loss import IGNORE_INDEX, count_divisor
from ..layers.softcap import check_softcap
from .softcap import cap_rows

#: logits one program reads at a time along a row
BLOCK = 1024


@triton.jit
def _softmax_loss_delta(Z, T, NLL, SCALE, V, stride, GRAD: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``r``: ``nll[r] = logsumexp(z_r) − z_r[t_r]`` (0 when ``t_r < 0``); with ``GRAD``,
    ``z_r ← scale_r (softmax(z_r) − onehot(t_r))`` in place (``scale_r = 1/C`` counted, else 0;
    ``1/C`` read from ``SCALE``, a one-element tensor: a float argument would be float32).
    Statistics in float32 (``F64``: float64 logits, in float64)."""
    r = tl.program_id(0)
    row = Z + r * stride
    t = tl.load(T + r)
    offs = tl.arange(0, BLOCK)
    z = tl.load(row + offs, mask=offs < V, other=float("-inf"))
    if not F64:
        z = z.to(tl.float32)
    m = tl.max(z, axis=0)
    s = tl.sum(tl.exp(z - m), axis=0)
    for j0 in range(BLOCK, V, BLOCK):
        offs = j0 + tl.arange(0, BLOCK)
        z = tl.load(row + offs, mask=offs < V, other=float("-inf"))
        if not F64:
            z = z.to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    z_t = tl.load(row + tl.maximum(t, 0))
    if not F64:
        z_t = z_t.to(tl.float32)
    lse = m + tl.log(s)
    tl.store(NLL + r, tl.where(t >= 0, lse - z_t, 0.0))
    if GRAD:
        c = tl.where(t >= 0, tl.load(SCALE), 0.0)
        for j0 in range(0, V, BLOCK):
            offs = j0 + tl.arange(0, BLOCK)
            z = tl.load(row + offs, mask=offs < V, other=0.0)
            if not F64:
                z = z.to(tl.float32)
            delta = c * tl.exp(z - m) / s - tl.where(offs == t, c, 0.0)
            tl.store(row + offs, delta.to(Z.dtype.element_ty), mask=offs < V)


def head_loss_forward(h, weight, bias, targets, ignore_index: int = IGNORE_INDEX, *, n_total=None,
                      grad: bool = True, grad_weight: bool = True, chunk_rows: int | None = None,
                      softcap: float | None = None):
    """:func:`pedestrian.layers.head_loss.head_loss_forward` (same arguments, result, errors) on
    torch tensors of one device: products on torch, each chunk's softmax rows in Triton (with
    ``softcap``, the chunk capped in place first and ``Δ12_c`` multiplied by the slope kept,
    :func:`.softcap.cap_rows`). The count ``C`` stays on the device (no host read)."""
    if softcap is not None:
        check_softcap(softcap)
    d, V = weight.shape
    check_float(h, "the head's input")
    check_float(weight, "the head's weight")
    check_ids(targets, V, "target", ignore_index=ignore_index)
    rows = head_chunk_rows(V, h.element_size()) if chunk_rows is None else int(chunk_rows)
    if rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    h_rows = h.reshape(-1, d)                                                # (N, d)
    t = targets.reshape(-1)
    N = h_rows.shape[0]
    counted = t != ignore_index
    xp = array_namespace(h)
    n_counted = xp.sum(xp.astype(counted, xp.int64)) if n_total is None else n_total
    C = count_divisor(xp, n_counted, h_rows)                                 # 0-d, never read
    C_t = torch.as_tensor(C, device=h.device)
    t = torch.where(counted, t, -1).to(torch.int64).contiguous()
    stat = torch.float64 if h.dtype == torch.float64 else torch.float32
    nll = torch.empty(N, dtype=stat, device=h.device)
    dh = torch.empty_like(h_rows) if grad else None
    dW = torch.zeros_like(weight) if grad and grad_weight else None
    db = torch.zeros_like(bias) if grad and grad_weight and bias is not None else None
    scale = (1.0 / torch.as_tensor(C, device=h.device, dtype=torch.float64)).to(stat).reshape(1)   # (no read)
    for lo in range(0, N, rows):
        hi = min(lo + rows, N)
        z = h_rows[lo:hi] @ weight                                           # (n, V)
        if bias is not None:
            z += bias
        z = z.contiguous()
        slope = None if softcap is None else cap_rows(z, softcap, grad)     # z_c = c tanh(z_c / c)
        _softmax_loss_delta[(hi - lo,)](z, t[lo:hi], nll[lo:hi], scale, V,
                                        z.stride(0), GRAD=grad, F64=h.dtype == torch.float64, BLOCK=min(BLOCK, triton.next_power_of_2(V)))
        if not grad:
            continue
        if slope is not None:
            z *= slope                                                       # Δ12_c ∘ (1 − tanh²)
        dh[lo:hi] = z @ weight.T                                             # Δ11_c = Δ12_c Wᵀ
        if dW is not None:
            dW += h_rows[lo:hi].T @ z                                        # dW += h_cᵀ Δ12_c
        if db is not None:
            db += z.sum(0)
    loss = (nll.sum() / C_t).to(h.dtype)
    return loss, HeadLossCache(dh.reshape(h.shape) if grad else None, dW, db, C, (*h.shape[:-1], V))


def head_loss_backward(cache: HeadLossCache, *, dweight=None, dbias=None):
    """:func:`pedestrian.layers.head_loss.head_loss_backward` (the gradients made by the forward)."""
    from ..layers.head_loss import head_loss_backward as reference

    return reference(cache, dweight=dweight, dbias=dbias)

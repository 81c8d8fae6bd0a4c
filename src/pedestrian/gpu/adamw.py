"""AdamW on the GPU: one Triton kernel over a flat parameter buffer (reference: the NumPy kernel
of :mod:`pedestrian.training.optim`, whose docstring derives the update; torch.optim.AdamW's)::

    g ← s·g                                  the clipping scale, applied as g is read
    θ ← θ · decay                            decay = 1 − lr·λ (1 where no decay applies)
    m ← m + (1 − β1)(g − m)
    v ← β2 v + (1 − β2) g²
    θ ← θ − step · m / (√v + eps)            step, eps carrying the bias corrections

Each element is read once (``θ, g, m, v``) and written once (``θ, m, v``): one pass where the
torch path makes five, in the buffer's dtype (float32 buffers: float32 arithmetic, as torch's).
The coefficients travel in a small tensor of the buffer's dtype (a float argument would be
rounded to float32 by Triton, which a float64 buffer must not see); the gradient is not written
(``s`` scales what the update reads, so a clipped step needs no pass over the gradient).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import ELEMENTS, programs


@triton.jit
def _adamw_kernel(P, G, M, V, C, n, BLOCK: tl.constexpr):
    """One block of the update; ``C = [decay, 1 − β1, β2, 1 − β2, step, eps, s]``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    decay, c1, b2, c3 = tl.load(C), tl.load(C + 1), tl.load(C + 2), tl.load(C + 3)
    step, eps, scale = tl.load(C + 4), tl.load(C + 5), tl.load(C + 6)
    g = tl.load(G + offs, mask=mask, other=0.0) * scale
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    p = tl.load(P + offs, mask=mask, other=0.0)
    m = m + c1 * (g - m)
    v = b2 * v + c3 * (g * g)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    tl.store(P + offs, p * decay - step * (m / (tl.sqrt(v) + eps)), mask=mask)


def adamw_update(p, g, m, v, decay: float, b1: float, b2: float, step: float, eps: float,
                 grad_scale: float = 1.0) -> None:
    """``θ ← θ·decay``, ``m ← m + (1 − β1)(s·g − m)``, ``v ← β2 v + (1 − β2)(s·g)²``,
    ``θ ← θ − step · m / (√v + eps)`` in place, over 1-D contiguous tensors of one dtype and device.

    Args:
        p, g, m, v: the parameters, their gradient, the two moments (``g`` is only read).
        decay, b1, b2, step, eps: as :func:`pedestrian.training.optim._adamw` takes them (``step``
            and ``eps`` carrying the bias corrections).
        grad_scale: ``s``, the clipping scale (``min(1, max_norm / (norm + 1e-6))``), or 1: a
            float, or a 0-d tensor on ``p``'s device (computed there from the step's sums of
            squares, :func:`pedestrian.training.optim.clip_scale`: never read on the host).
    """
    n = p.numel()
    if n == 0:
        return
    scalars = torch.tensor([decay, 1.0 - b1, b2, 1.0 - b2, step, eps], dtype=p.dtype).to(p.device, non_blocking=True)
    scale = torch.as_tensor(grad_scale, dtype=p.dtype, device=p.device).reshape(1)     # (a tensor: no read)
    _adamw_kernel[(programs(n, ELEMENTS),)](p, g, m, v, torch.cat([scalars, scale]), n, BLOCK=ELEMENTS)

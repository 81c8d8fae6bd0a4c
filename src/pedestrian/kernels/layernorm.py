"""Fast kernels for layer normalization (reference: :mod:`pedestrian.layers.layernorm`, paper section 5)."""

from __future__ import annotations

from ..backend import is_torch_array
from ..layers.layernorm import check_eps
from .blas import colsum, elementwise_lib, rowdot
from .threads import for_row_blocks
from .workspace import empty_array, scratch


def layernorm_forward(x, weight, bias, eps: float):
    """Per token: ``x̂ = (x − μ)/σ``, ``σ = sqrt(var_f(x) + eps)`` (biased variance), ``y = x̂ ∘ w + b``.

    Args:
        x: ``(..., d)`` float array.
        weight: ``(d,)``; bias: ``(d,)`` or ``None``.
        eps: ``>= 0``. The paper uses 0 (a constant row then divides by zero: ``nan``);
            PyTorch and GPT-2 use ``1e-5``.

    Returns:
        ``(y, cache)`` with ``cache = (x̂, 1/σ, weight)``; ``x̂`` is ``(..., d)``, ``1/σ`` is ``(..., 1)``.

    Raises:
        ValueError: ``eps < 0``.
    """
    check_eps(eps)
    if is_torch_array(x):
        # the same formulas in fewer operations (torch's per-operation cost dominates small
        # inputs). A few rows (one token while generating): torch.var_mean gives both
        # statistics in one call (1 row: 25 vs 38 µs). More rows: its last-axis reduction is
        # slow, mean + square + mean is faster ((12, 64, 128): 1005 vs 145 µs, one thread)
        import torch

        xhat, y = empty_array(x.shape, x), empty_array(x.shape, x)
        if x.numel() <= 8 * x.shape[-1]:
            var, mean = torch.var_mean(x, dim=-1, correction=0, keepdim=True)
            rstd = torch.rsqrt(var.add_(eps))
            torch.sub(x, mean, out=xhat)
        else:
            torch.sub(x, x.mean(-1, keepdim=True), out=xhat)                # x − μ
            sq = scratch(x.shape, x, "layernorm.sq")
            torch.mul(xhat, xhat, out=sq)
            rstd = sq.mean(-1, keepdim=True).add_(eps).rsqrt_()             # 1/σ
        xhat.mul_(rstd)
        if bias is None:
            torch.mul(xhat, weight, out=y)
        else:
            torch.addcmul(bias, xhat, weight, out=y)
        return y, (xhat, rstd, weight)
    lib = elementwise_lib(x)
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    xhat, y = empty_array(x.shape, x), empty_array(x.shape, x)
    rstd = empty_array((*x.shape[:-1], 1), x)
    xhat2, y2, rstd2 = xhat.reshape(-1, d), y.reshape(-1, d), rstd.reshape(-1, 1)
    inv_d = 1.0 / d

    def kernel(lo: int, hi: int) -> None:                  # rows lo:hi
        xb, hb, yb, rb = x2[lo:hi], xhat2[lo:hi], y2[lo:hi], rstd2[lo:hi]
        mean = lib.sum(xb, axis=-1, keepdims=True)
        lib.multiply(mean, inv_d, out=mean)
        lib.subtract(xb, mean, out=hb)                                     # x − μ
        lib.multiply(rowdot(hb, hb), inv_d, out=rb)                        # biased variance
        lib.add(rb, eps, out=rb)
        lib.sqrt(rb, out=rb)
        lib.reciprocal(rb, out=rb)                                         # 1/σ
        lib.multiply(hb, rb, out=hb)                                       # x̂
        lib.multiply(hb, weight, out=yb)
        if bias is not None:
            lib.add(yb, bias, out=yb)

    for_row_blocks(x, kernel, x2.shape[0], d)
    return y, (xhat, rstd, weight)


def layernorm_backward(delta, cache, *, dweight=None, dbias=None):
    """``Δ_in = (1/σ)(g − mean_f(g) − x̂ ∘ mean_f(g ∘ x̂))`` with ``g = Δ ∘ w``.

    Also ``dw = Σ_tokens x̂ ∘ Δ`` and ``db = Σ_tokens Δ``. Exact for any ``eps``.

    Args:
        delta: ``(..., d)`` error signal at the output.
        cache: from :func:`layernorm_forward`.
        dweight, dbias: ``(d,)`` arrays the gradients are written into, or ``None`` (frozen).

    Returns:
        ``Δ_in``.
    """
    xhat, rstd, weight = cache
    lib = elementwise_lib(delta)
    d = delta.shape[-1]
    delta2, xhat2, rstd2 = delta.reshape(-1, d), xhat.reshape(-1, d), rstd.reshape(-1, 1)
    delta_in = empty_array(delta.shape, delta)
    out2 = delta_in.reshape(-1, d)
    inv_d = 1.0 / d
    partial_w: dict = {}                                   # block start -> Σ_block x̂ ∘ Δ

    def kernel(lo: int, hi: int) -> None:
        db, hb, rb, ob = delta2[lo:hi], xhat2[lo:hi], rstd2[lo:hi], out2[lo:hi]
        t = scratch(hb.shape, hb, "layernorm.t")
        if dweight is not None:
            lib.multiply(hb, db, out=t)
            partial_w[lo] = colsum(t)
        lib.multiply(db, weight, out=ob)                   # g = Δ ∘ w
        mean_g = lib.sum(ob, axis=-1, keepdims=True)
        lib.multiply(mean_g, inv_d, out=mean_g)
        mean_gx = rowdot(ob, hb)
        lib.multiply(mean_gx, inv_d, out=mean_gx)
        lib.subtract(ob, mean_g, out=ob)
        lib.multiply(hb, mean_gx, out=t)
        lib.subtract(ob, t, out=ob)
        lib.multiply(ob, rb, out=ob)

    for_row_blocks(delta, kernel, delta2.shape[0], d)
    if dweight is not None:
        dweight[...] = partial_w.pop(0)
        for lo in sorted(partial_w):                       # fixed order: same sum every run
            dweight += partial_w[lo]
    if dbias is not None:
        colsum(delta2, out=dbias)
    return delta_in

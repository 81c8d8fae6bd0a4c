"""Fused kernels of a generated token's forward (:mod:`pedestrian.model.decode`): one numba call
where the chain makes two or three.

Each is the fast kernels' own loops called one after the other inside one compiled function
(the callees are compiled as they are for their own calls, ``exact`` or not, so the numbers are
theirs): what is saved is the Python around each call -- the checks, the reshapes, the pool, the
angle lookup -- which at one token per step costs more than the arithmetic (docs/kernels.md,
"One generated token at SmolLM2-135M's shape").
"""

from __future__ import annotations

from .attention_loops import decode_attention
from .jit import kernel
from .rmsnorm import forward_rows as rmsnorm_rows
from .rope import turn_rows

__all__ = ["add_rmsnorm", "rmsnorm_rows", "rope_decode_attention"]


@kernel
def add_rmsnorm(x, branch, weight, eps, y, xhat, rrms):
    """The skip ``x ← x + branch`` (in place, ``(N, d)``), then ``y = x/r ∘ w`` of the new rows
    (EQUATIONS.md "Fully connected (FC), activations, residual", "RMS normalization"; vLLM's
    ``fused_add_rms_norm``); ``xhat``, ``rrms`` as :func:`pedestrian.kernels.rmsnorm.rmsnorm_forward`."""
    n, d = x.shape
    for i in range(n):
        for j in range(d):
            x[i, j] = x[i, j] + branch[i, j]
    rmsnorm_rows(x, weight, eps, y, xhat, rrms)


@kernel
def rope_decode_attention(qkv, cos, sin, n_qk, d_qk, r, turned, keys, values, length, start, key_start, causal,
                          window, cap, scale, q_out, p_out, out):
    """RoPE on the q and k heads of ``qkv`` ``(B, T, width)`` into ``turned`` ``(B·T, width)``
    (:func:`pedestrian.kernels.rope._turn`; ``r = 0``: a copy, no RoPE), then the KV-cache step of
    :func:`pedestrian.kernels.attention_loops.decode_attention` on ``turned`` (EQUATIONS.md "RoPE",
    "KV cache")."""
    B, T, width = qkv.shape
    flat = qkv.reshape((B * T, width))
    if r > 0:
        turn_rows(flat, cos, sin, n_qk, d_qk, r, turned)
    else:
        turned[:, :] = flat
    decode_attention(turned.reshape((B, T, width)), keys, values, length, start, key_start, causal, window, cap,
                     scale, q_out, p_out, out)

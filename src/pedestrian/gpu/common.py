"""What the GPU kernels share: rows of a tensor as Triton sees them, block widths, launch sizes.

Every kernel here walks rows of the last axis (a token's features), ``ROWS`` rows per program, a
whole row in one block of ``block_width(d)`` lanes (a power of two, the tail masked).
"""

from __future__ import annotations

import triton

#: rows one program of a row-wise kernel handles (its weight-gradient partial covers them)
ROWS = 16
#: elements one program of an elementwise kernel handles
ELEMENTS = 1024


def rows(x):
    """``x`` ``(..., d)`` as a C-contiguous 2-D tensor ``(N, d)`` (a view where it already is one)."""
    return (x if x.is_contiguous() else x.contiguous()).reshape(-1, x.shape[-1])


def flat(x):
    """``x`` as a C-contiguous 1-D tensor (a view where it already is contiguous)."""
    return (x if x.is_contiguous() else x.contiguous()).reshape(-1)


def block_width(d: int) -> int:
    """The power of two ``>= d`` lanes a row takes (at least 16)."""
    return max(16, triton.next_power_of_2(int(d)))


def programs(n: int, per: int) -> int:
    """Programs for ``n`` items, ``per`` each (at least one)."""
    return max(1, triton.cdiv(int(n), per))


def write_sum(partials, out) -> None:
    """``out[...] = Σ_p partials[p]`` in a fixed order (torch's reduction: no atomics), into the
    caller's gradient array (a view of a flat buffer may be given); ``None`` writes nothing."""
    if out is not None:
        out.copy_(partials.sum(dim=0).reshape(out.shape))

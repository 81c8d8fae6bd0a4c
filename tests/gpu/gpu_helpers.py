"""What the GPU kernels' tests share: the device they run on, the GPU table, and the tolerance.

Tolerance (``bound``): a kernel and the reference layer compute the same formula in the same
dtype; they differ only in the order of rounded additions (Triton sums a row as a tree, NumPy or
torch pairwise) and in a few operations fused or reordered by the compiler. By the standard bound
on recursive summation (Higham, *Accuracy and Stability of Numerical Algorithms*, eq. 4.4), a sum
of ``n`` terms carries an error of at most ``(n − 1)·u·Σ|terms|`` on either side, ``u`` the unit
roundoff (``eps / 2``); each of the ``k`` elementwise operations around it adds at most ``u``
relative. So two implementations differ by at most ``2·(n + k)·u·S`` where ``S`` bounds the sum of
magnitudes that enter (the test states its ``S``): ``bound(n, k, S, dtype) = (n + k)·eps·S``.
This holds on any IEEE-754 machine, in any summation order.
"""

from __future__ import annotations

import numpy as np
import pytest

triton = pytest.importorskip("triton")
torch = pytest.importorskip("torch")

import pedestrian.gpu as gpu  # noqa: E402
from pedestrian.kernels import kernels_for  # noqa: E402

#: where the kernels run: the GPU, or the CPU under Triton's interpreter (tests/gpu/conftest.py)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = ["float32", "float64"]


def table(dtype: str = "float64"):
    """The kernel table a model on a GPU gets (the Triton kernels, the rest the fallback's)."""
    return gpu.table(kernels_for("fast", "cuda", dtype), interpret_ok=DEVICE == "cpu")


def tensor(a, dtype=None):
    """``a`` (NumPy) as a torch tensor on :data:`DEVICE`."""
    t = torch.as_tensor(np.ascontiguousarray(a))
    return t.to(device=DEVICE, dtype=getattr(torch, dtype) if dtype else t.dtype)


def numpy(t):
    """A torch tensor (any device) as a float64 NumPy array."""
    return t.detach().cpu().double().numpy()


def eps(dtype: str) -> float:
    return float(np.finfo(dtype).eps)


def bound(n: int, k: int, scale: float, dtype: str) -> float:
    """``(n + k)·eps·S``: two evaluations of a sum of ``n`` terms whose magnitudes add up to at
    most ``S``, wrapped in ``k`` rounded elementwise operations (module docstring)."""
    return (n + k) * eps(dtype) * scale


def assert_close(got, want, tol: float, what: str) -> None:
    got, want = numpy(got) if hasattr(got, "detach") else np.asarray(got), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = float(np.max(np.abs(got - want))) if want.size else 0.0
    assert err <= tol, f"{what}: max |got − want| = {err:.3g} > {tol:.3g}"

"""The GPU kernels' tests: Triton's kernels on CUDA tensors where torch sees a GPU, else on CPU
tensors under Triton's interpreter.

Triton reads ``TRITON_INTERPRET`` when a kernel is *defined* (``@triton.jit`` at the import of a
``pedestrian.gpu`` module), so it is set here, at collection, before any test imports them; the
interpreter then runs every kernel of this process (it is about a thousand times slower than a
GPU: the shapes of these tests are tiny). Without Triton every test here is skipped.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

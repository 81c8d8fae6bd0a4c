"""The edge of a torch-CPU model that runs the fast kernels (``GPT.numpy_chain``).

The fast kernels take NumPy arrays. A model whose tensors live on the CPU hands them NumPy views
of its memory (``to_numpy`` of a CPU tensor is a view, no copy): its parameter and gradient
buffers (:class:`~pedestrian.model.params.Parameters` with ``numpy_views``), the tokens, targets
and upstream signal it is given, and its KV cache's arrays (:class:`NumpyCache`); what it hands
out -- logits, activations, attention weights, error signals -- becomes torch tensors again
(:func:`to_torch`). So the arrays cross the backend once per call of the model, not once per
kernel call (the per-call conversion of :func:`pedestrian.kernels._seam`, about 25 µs a call).
"""

from __future__ import annotations

import numpy as np

from ..backend import to_numpy
from ..layers.attention import KVBlock

__all__ = ["NumpyCache", "resolve_device", "to_torch"]


class NumpyCache:
    """What the chain reads of a torch-CPU :class:`~pedestrian.model.kv_cache.KVCache` -- its
    positions and a block's arrays -- as NumPy views: the attention writes the new keys and
    values into the cache's own tensors. ``length`` is counted by the cache itself."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def positions(self, T: int) -> np.ndarray:
        """``cache.positions(T)`` as a NumPy array."""
        return to_numpy(self.cache.positions(T))

    def block(self, i: int) -> KVBlock:
        """``cache.block(i)`` with NumPy views of its arrays."""
        b = self.cache.block(i)
        return KVBlock(to_numpy(b.keys), to_numpy(b.values), b.length,
                       None if b.key_start is None else to_numpy(b.key_start), b.window, b.first)


def to_torch(values):
    """``values`` -- a NumPy array, or a dict or list of them (``None`` kept) -- as torch tensors
    sharing their memory (a read-only array is copied). A tensor keeps its array alive, so the
    model's memory pool (:class:`~pedestrian.kernels.workspace.Workspace`) does not hand that
    array out again while the caller holds the tensor."""
    if values is None:
        return None
    if isinstance(values, dict):                           # (an inspection dictionary keeps its kind)
        out = {k: to_torch(v) for k, v in values.items()}
        return values.like(out) if hasattr(values, "like") else out
    if isinstance(values, list):
        return [to_torch(v) for v in values]
    import torch

    return torch.from_numpy(values if values.flags.writeable else values.copy())


def resolve_device(backend: str, device):
    """``None`` (the backend's default: the CPU) or a torch device; the NumPy backend has only the CPU."""
    if device is None or (backend == "numpy" and str(device) == "cpu"):
        return None
    if backend != "torch":
        raise ValueError(f"device {device!r} needs backend='torch' (NumPy arrays live on the CPU)")
    import torch

    return torch.device(device)

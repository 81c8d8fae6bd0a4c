"""The GPU fast path: Triton kernels under the model's kernel contract (``layers.MODEL_FUNCTIONS``).

:mod:`pedestrian.layers` is the paper's math; :mod:`pedestrian.kernels` the CPU fast path (numba
and BLAS); this package the GPU's: one module per layer, forward and backward kernels side by
side, the same names and signatures, each docstring opening with its formula from
``docs/EQUATIONS.md``. Products stay on cuBLAS (torch's ``matmul``); what is between them --
norms with the skip fused in, activations, the SwiGLU gate, RoPE, the loss, AdamW -- is Triton.

:data:`GPU_KERNELS` is the one table: ``contract name -> "module:function"``. A function of the
contract that is not in it runs what the GPU ran before (the reference layers, and the attention's
tiled torch loop, :func:`pedestrian.kernels.kernels_for`). Adding a kernel is its own module here
and one line in the table (docs/kernels.md, "On a GPU"). A model chooses its table with
:func:`kernels_for` (this package sits above :mod:`pedestrian.kernels`: it may fall back on them).

Nothing here imports Triton until a table is built: ``import pedestrian`` (and this package)
stays free of it. The kernels run on CUDA tensors, and on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before the first table is built: Triton reads it when a kernel is
defined), which is how the tests run them on machines without a GPU (``tests/gpu/``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import SimpleNamespace

from ..kernels import FAST_DTYPES
from ..kernels import kernels_for as cpu_kernels_for

__all__ = ["GPU_KERNELS", "available", "interpreting", "kernels_for", "table"]

#: contract name -> ``"module:function"`` of this package (imported when a table is built)
GPU_KERNELS = {
    "layernorm_forward": "norms:layernorm_forward",
    "layernorm_backward": "norms:layernorm_backward",
    "rmsnorm_forward": "norms:rmsnorm_forward",
    "rmsnorm_backward": "norms:rmsnorm_backward",
    "add_layernorm_forward": "norms:add_layernorm_forward",
    "add_layernorm_backward": "norms:add_layernorm_backward",
    "add_rmsnorm_forward": "norms:add_rmsnorm_forward",
    "add_rmsnorm_backward": "norms:add_rmsnorm_backward",
    "multi_head_attention_forward": "attention:multi_head_attention_forward",
    "multi_head_attention_backward": "attention:multi_head_attention_backward",
    "attention_weights": "attention:attention_weights",
    "activation_forward": "activations:activation_forward",
    "activation_backward": "activations:activation_backward",
    "linear_activation_forward": "activations:linear_activation_forward",
    "linear_activation_backward": "activations:linear_activation_backward",
    "swiglu_forward": "swiglu:swiglu_forward",
    "swiglu_backward": "swiglu:swiglu_backward",
    "rope_forward": "rope:rope_forward",
    "rope_backward": "rope:rope_backward",
    "embedding_backward": "embedding:embedding_backward",
    "lora_forward": "lora:lora_forward",
    "lora_backward": "lora:lora_backward",
    "head_loss_forward": "head_loss:head_loss_forward",
    "head_loss_backward": "head_loss:head_loss_backward",
    "softcap_forward": "softcap:softcap_forward",
    "softcap_backward": "softcap:softcap_backward",
}


def available() -> bool:
    """Whether Triton is installed (found without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's interpreter (kernels on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def table(fallback, *, interpret_ok: bool = False) -> SimpleNamespace:
    """The kernel table a model on a GPU calls: ``fallback``'s functions (a table of every
    contract function, its ``name`` included), each one of :data:`GPU_KERNELS` replaced by its
    Triton kernel.

    Args:
        fallback: the table the GPU's kernels stand in for (a ``SimpleNamespace`` or a dict).
        interpret_ok: allow building it with no CUDA device, under Triton's interpreter (the tests:
            the kernels then take CPU tensors).

    Raises:
        ModuleNotFoundError: Triton is not installed (``pip install "pedestrian[gpu]"``).
        RuntimeError: no CUDA device and not ``interpret_ok`` with ``TRITON_INTERPRET=1``.
    """
    if not available():
        raise ModuleNotFoundError("the GPU kernels need Triton: pip install 'pedestrian[gpu]' (or triton>=3.6)")
    if interpret_ok and not interpreting():
        raise RuntimeError("the GPU kernels run on CPU tensors only under Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before the first table is built")
    if not interpret_ok:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("the GPU kernels need a CUDA device (none is visible to torch); for CPU "
                               "tensors use table(..., interpret_ok=True) with TRITON_INTERPRET=1")
    functions = dict(fallback if isinstance(fallback, dict) else vars(fallback))
    for name, where in GPU_KERNELS.items():
        module, function = where.split(":")
        functions[name] = getattr(importlib.import_module(f".{module}", __name__), function)
    return SimpleNamespace(**functions)


_warned_no_triton: list = []


def kernels_for(name: str | None = None, device=None, dtype=None) -> SimpleNamespace:
    """The kernel table a model calls (:func:`pedestrian.kernels.kernels_for`, same arguments
    and result), and on a CUDA device, for ``"fast"`` in float32 or float64, :func:`table` over it:
    the Triton kernels. Where Triton is not installed that device keeps the reference layers (and
    the tiled attention's torch loop), after one warning per process."""
    base = cpu_kernels_for(name, device, dtype)
    on_cuda = device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda"
    if base.name != "fast" or not on_cuda or _dtype_name(dtype) not in FAST_DTYPES:
        return base
    if not available():
        if not _warned_no_triton:
            import warnings

            warnings.warn("pedestrian: triton is not installed, so the GPU kernels cannot run; running the "
                          "reference layers on the GPU instead (slower, same results). Install it with "
                          "pip install 'pedestrian[gpu]'", RuntimeWarning, stacklevel=2)
            _warned_no_triton.append(True)
        return base
    import torch

    return table(base) if torch.cuda.is_available() else base      # (no device: the model's own error)


def _dtype_name(dtype) -> str:
    """``"float32"`` for ``None``, else the name of a dtype (a string, a NumPy or torch dtype)."""
    if dtype is None:
        return "float32"
    return dtype if isinstance(dtype, str) else str(dtype).rsplit(".", 1)[-1]

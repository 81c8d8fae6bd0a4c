"""The fast path: the reference layers' functions, same names and signatures, tuned for speed.

:mod:`pedestrian.layers` is the paper's math, one screen per layer. This package computes the
same things faster, and every difference from the reference earns its lines by a measurement
(``docs/kernels.md`` lists each one and what it buys):

- :mod:`.jit` -- numba, the compiler of the kernels' loops (``@kernel``; IEEE semantics kept,
  compiled on first use and cached on disk), and :mod:`.vecmath` -- ``exp``, ``Φ``, ``φ`` as
  polynomials the compiler vectorises;
- :mod:`.layernorm`, :mod:`.activations`, :mod:`.loss`, :mod:`.embedding` -- numba loops over
  rows (llm.c's layout); :mod:`.head_loss` -- the output head fused with its loss, chunk by chunk;
- :mod:`.rmsnorm` (rows, as the layer norm) and :mod:`.swiglu` (products on BLAS, the gate in numba loops);
- :mod:`.rope` -- RoPE's angles from a table kept per model shape, the turn written in place (NumPy);
- :mod:`.decode` -- a generated token's fused calls (the skip with the next RMS norm; RoPE, the
  cache append and the attention), run by :mod:`pedestrian.model.decode`;
- :mod:`.attention`, :mod:`.linear` -- products on BLAS, the softmax in numba loops;
- :mod:`.workspace` -- a memory pool: a step's arrays are handed out again once nothing uses
  them, so memory is not returned to the OS and faulted in again every step;
- :mod:`.blas` -- products and reductions written into preallocated arrays, shared over the
  same threads as the loops (:func:`.jit.num_threads`, a BLAS held to one thread).

Dropout and LoRA gain nothing measurable from a second version (docs/kernels.md): the
reference ones are used.
A model chooses with ``GPT(..., kernels="fast" | "reference")``, once, when it is built:
:func:`kernels_for` gives it a *kernel table* (every function it calls, and its ``name``) for
its device and dtype. Importing this package imports no numba: the kernels load it at their
first call (:mod:`.jit`).

The kernels are written for NumPy arrays of float32 or float64, and the fast table holds them
as they are. Called directly, this package's functions also take PyTorch tensors (one wrapper,
:func:`_seam`): on the CPU through zero-copy NumPy views of the same memory (results are tensors
again, sharing the kernels' arrays; writes into the caller's tensors, such as ``dweight=``, go
through the views and so past torch's version counter and autograd's in-place checks:
pedestrian runs no autograd); tensors on any other device (a GPU) run the reference layers, and
from :data:`.attention_tiled.TILED_MIN_T` tokens on the tiled attention's torch loop (``O(T)``
memory). The first array among a call's arguments decides, so one call takes one backend's
arrays. Data of another dtype than float32 / float64 (the first array that is not ids) runs the
reference layers too: they compute float16 and bfloat16 tensors, and refuse integer and complex
data by name.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import numpy as np

from .. import layers
from ..backend import is_torch_array, to_numpy
from ..layers import IGNORE_INDEX, KVBlock
from ..layers.dropout import dropout_backward, dropout_forward
from . import activations, attention, embedding, head_loss, layernorm, linear, loss
from . import lora, moe, residual, rmsnorm, rope, swiglu

#: the two implementations a model can run
KERNELS = ("fast", "reference")

__all__ = [
    "IGNORE_INDEX", "KERNELS", "KVBlock", "kernels_for", "default_kernels",
    "activation_backward", "activation_forward", "add", "attention_weights",
    "add_layernorm_backward", "add_layernorm_forward", "add_rmsnorm_backward", "add_rmsnorm_forward",
    "cross_entropy_backward", "cross_entropy_forward", "dropout_backward", "dropout_forward",
    "embedding_backward", "embedding_forward", "head_loss_backward", "head_loss_forward",
    "layernorm_backward", "layernorm_forward", "linear_activation_backward", "linear_activation_forward",
    "linear_backward", "linear_forward", "lora_backward", "lora_forward",
    "multi_head_attention_backward", "multi_head_attention_forward", "rope_backward", "rope_forward",
    "rmsnorm_backward", "rmsnorm_forward", "swiglu_backward", "swiglu_forward", "swiglu_mlp_backward", "swiglu_mlp_forward",
    "moe_backward", "moe_combine_backward", "moe_combine_forward", "moe_forward", "moe_gather",
    "moe_load_balancing_loss", "moe_router_backward", "moe_router_forward", "moe_scatter",
]


def _tree(obj, leaf):
    """``obj`` with ``leaf`` applied to every array inside its tuples (named too), lists and dicts."""
    if isinstance(obj, tuple):
        items = [_tree(o, leaf) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [_tree(o, leaf) for o in obj]
    if isinstance(obj, dict):
        return {k: _tree(v, leaf) for k, v in obj.items()}
    return leaf(obj)


def _first_array(obj, data: bool = False):
    """The first NumPy array or torch tensor in ``obj`` (depth first), else ``None``; with
    ``data``, the first whose dtype is not an integer or boolean one (not ids, not a mask)."""
    if isinstance(obj, (tuple, list)):
        return next((a for a in (_first_array(o, data) for o in obj) if a is not None), None)
    if isinstance(obj, dict):
        return _first_array(list(obj.values()), data)
    if not (isinstance(obj, np.ndarray) or is_torch_array(obj)):
        return None
    return obj if not data or _holds_data(obj) else None


def _holds_data(a) -> bool:
    """``a`` is not ids or a mask: its dtype is not an integer or boolean one."""
    return a.dtype.kind not in "biu" if isinstance(a, np.ndarray) else (a.is_floating_point() or a.is_complex())


#: the dtypes the kernels are compiled for; the others go to the reference layers, which
#: compute half precision (float16, bfloat16) and refuse integers and complex numbers by name
FAST_DTYPES = frozenset({"float32", "float64"})
_FAST_NUMPY = frozenset(np.dtype(d) for d in FAST_DTYPES)


def _runs_fast(a) -> bool:
    """``a``'s dtype is one of :data:`FAST_DTYPES`."""
    return a.dtype in _FAST_NUMPY if isinstance(a, np.ndarray) else str(a.dtype).rsplit(".", 1)[-1] in FAST_DTYPES


def _seam(fast, other):
    """This package's function of a kernel, for direct calls (a model calls the kernel itself,
    from its table): ``fast`` (written for NumPy arrays) for NumPy arrays and, through zero-copy NumPy views,
    torch tensors on the CPU; ``other`` for torch tensors on any other device, and for data of
    a dtype the kernels are not compiled for (:data:`FAST_DTYPES`: float16 and bfloat16 run in
    the reference layers). Which one runs follows the first array among the arguments (one
    backend per call) and the first one holding data (not ids). An input returned as it came (a
    cache holding ``x``) is the caller's own tensor again."""
    @functools.wraps(fast)
    def call(*args, **kwargs):
        if args and type(args[0]) is np.ndarray and args[0].dtype in _FAST_NUMPY:   # (no search)
            return fast(*args, **kwargs)
        like = _first_array((args, kwargs))
        data = like if like is None or _holds_data(like) else _first_array((args, kwargs), data=True)
        if like is not None and (data is None or not _runs_fast(data)):
            return other(*args, **kwargs)
        if like is None or type(like) is np.ndarray or not is_torch_array(like):
            return fast(*args, **kwargs)
        if like.device.type != "cpu":
            return other(*args, **kwargs)
        import torch

        given: dict = {}                                   # id(view) -> (view, its tensor)

        def as_numpy(x):
            if not is_torch_array(x):
                return x
            view = to_numpy(x)                             # (a CPU tensor: a view, no copy)
            given[id(view)] = (view, x)
            return view

        def as_torch(x):
            if isinstance(x, np.ndarray):
                view, tensor = given.get(id(x), (None, None))
                return tensor if view is x else torch.from_numpy(x if x.flags.writeable else x.copy())
            return torch.from_numpy(np.asarray(x)) if isinstance(x, np.floating) else x

        return _tree(fast(*_tree(args, as_numpy), **_tree(kwargs, as_numpy)), as_torch)
    return call


activation_forward = _seam(activations.activation_forward, layers.activation_forward)
activation_backward = _seam(activations.activation_backward, layers.activation_backward)
linear_activation_forward = _seam(activations.linear_activation_forward, layers.linear_activation_forward)
linear_activation_backward = _seam(activations.linear_activation_backward, layers.linear_activation_backward)
multi_head_attention_forward = _seam(attention.multi_head_attention_forward, attention.on_device_forward)
multi_head_attention_backward = _seam(attention.multi_head_attention_backward, attention.on_device_backward)
attention_weights = _seam(attention.attention_weights, attention.on_device_weights)
embedding_forward = _seam(embedding.embedding_forward, layers.embedding_forward)
embedding_backward = _seam(embedding.embedding_backward, layers.embedding_backward)
layernorm_forward = _seam(layernorm.layernorm_forward, layers.layernorm_forward)
layernorm_backward = _seam(layernorm.layernorm_backward, layers.layernorm_backward)
rmsnorm_forward = _seam(rmsnorm.rmsnorm_forward, layers.rmsnorm_forward)
rmsnorm_backward = _seam(rmsnorm.rmsnorm_backward, layers.rmsnorm_backward)
swiglu_forward = _seam(swiglu.swiglu_forward, layers.swiglu_forward)
swiglu_backward = _seam(swiglu.swiglu_backward, layers.swiglu_backward)
swiglu_mlp_forward = _seam(swiglu.swiglu_mlp_forward, layers.swiglu_mlp_forward)
swiglu_mlp_backward = _seam(swiglu.swiglu_mlp_backward, layers.swiglu_mlp_backward)
linear_forward = _seam(linear.linear_forward, layers.linear_forward)
linear_backward = _seam(linear.linear_backward, layers.linear_backward)
add = _seam(linear.add, layers.add)
add_layernorm_forward = _seam(residual.add_layernorm_forward, layers.add_layernorm_forward)
add_layernorm_backward = _seam(residual.add_layernorm_backward, layers.add_layernorm_backward)
add_rmsnorm_forward = _seam(residual.add_rmsnorm_forward, layers.add_rmsnorm_forward)
add_rmsnorm_backward = _seam(residual.add_rmsnorm_backward, layers.add_rmsnorm_backward)
cross_entropy_forward = _seam(loss.cross_entropy_forward, layers.cross_entropy_forward)
cross_entropy_backward = _seam(loss.cross_entropy_backward, layers.cross_entropy_backward)
head_loss_forward = _seam(head_loss.head_loss_forward, layers.head_loss_forward)
head_loss_backward = layers.head_loss_backward             # (it only hands over what the forward made)
rope_forward = _seam(rope.rope_forward, layers.rope_forward)
lora_forward = _seam(lora.lora_forward, layers.lora_forward)
lora_backward = _seam(lora.lora_backward, layers.lora_backward)
rope_backward = _seam(rope.rope_backward, layers.rope_backward)
moe_router_forward = _seam(moe.moe_router_forward, layers.moe_router_forward)
moe_router_backward = _seam(moe.moe_router_backward, layers.moe_router_backward)
moe_gather = _seam(moe.moe_gather, layers.moe_gather)
moe_scatter = _seam(moe.moe_scatter, layers.moe_scatter)
moe_combine_forward = _seam(moe.moe_combine_forward, layers.moe_combine_forward)
moe_combine_backward = _seam(moe.moe_combine_backward, layers.moe_combine_backward)
moe_load_balancing_loss = layers.moe_load_balancing_loss   # (E-sized sums over the routes: one version)
moe_forward = _seam(moe.moe_forward, layers.moe_forward)
moe_backward = _seam(moe.moe_backward, layers.moe_backward)


def default_kernels() -> str:
    """``PEDESTRIAN_KERNELS`` if set (``fast`` or ``reference``), else ``"fast"``."""
    return os.environ.get("PEDESTRIAN_KERNELS", "fast")


_warned_no_numba: list = []

#: a GPU's (and a dtype's the kernels are not compiled for) kernels: the reference layers, the
#: attention from :data:`.attention_tiled.TILED_MIN_T` tokens on the tiled kernel's torch loop
_ON_DEVICE = {"multi_head_attention_forward": attention.on_device_forward,
              "multi_head_attention_backward": attention.on_device_backward,
              "attention_weights": attention.on_device_weights}


def kernels_for(name: str | None = None, device=None, dtype=None) -> SimpleNamespace:
    """The kernel table a model calls: every function of ``layers.MODEL_FUNCTIONS`` (dropout,
    LoRA and RoPE included) as an attribute, and ``name``, ``"fast"`` or ``"reference"``.

    Args:
        name: ``"fast"`` (this package's functions) or ``"reference"`` (:mod:`pedestrian.layers`);
            ``None``: :func:`default_kernels`. ``"fast"`` where numba is not installed (found
            without importing it): the reference table, after one warning per process.
        device: where the model's arrays live: ``None`` / ``"cpu"`` / a torch CPU device, or a
            torch device elsewhere (a GPU: ``"fast"`` is then the reference layers with the tiled
            attention's torch loop, :func:`.attention.on_device_forward`; a model on a CUDA
            device gets the Triton kernels over this table, :func:`pedestrian.gpu.kernels_for`).
        dtype: the model's dtype (a name, a NumPy or torch dtype; ``None``: float32). ``"fast"``
            of another dtype than :data:`FAST_DTYPES` is the table a GPU gets.

    The table is built at each call from the modules' attributes as they are then. The fast
    CPU table holds the kernels themselves, which take NumPy arrays only (no per-call dispatch
    or conversion: a torch-CPU model hands them NumPy views of its tensors and converts at its
    edge, :class:`pedestrian.model.GPT`); this package's attributes of the same names also take
    torch tensors.

    Raises:
        ValueError: any other name (also a bad ``PEDESTRIAN_KERNELS``).
    """
    name = default_kernels() if name is None else name
    if name not in KERNELS:
        raise ValueError(f"unknown kernels {name!r}; choose one of {KERNELS} "
                         "(PEDESTRIAN_KERNELS or GPT(..., kernels=...))")
    if name == "fast":
        from .jit import AVAILABLE

        if not AVAILABLE:
            if not _warned_no_numba:
                import warnings

                warnings.warn("pedestrian: numba cannot be imported, so the fast kernels cannot be "
                              "compiled; running the reference kernels instead (slower, same "
                              "results). Install numba (pip install numba) for the fast path",
                              RuntimeWarning, stacklevel=2)
                _warned_no_numba.append(True)
            name = "reference"
    table = SimpleNamespace(name=name, **{f: getattr(layers, f) for f in layers.MODEL_FUNCTIONS})
    if name == "reference":
        return table
    on_cpu = device is None or str(device) == "cpu"
    if not on_cpu or _dtype_name(dtype) not in FAST_DTYPES:
        return SimpleNamespace(**{**vars(table), **_ON_DEVICE, "name": name})
    return SimpleNamespace(name=name, **{f: _numpy_only(globals()[f]) for f in layers.MODEL_FUNCTIONS})


def _numpy_only(function):
    """The kernel a :func:`_seam` wrapper calls (a function put in its place, a test's spy, as it is)."""
    return getattr(function, "__wrapped__", function)


def _dtype_name(dtype) -> str:
    """``"float32"`` for ``None``, a name as given, else the name of a NumPy or torch dtype."""
    if dtype is None or isinstance(dtype, str):
        return dtype or "float32"
    text = str(dtype)
    return text[len("torch."):] if text.startswith("torch.") else np.dtype(dtype).name

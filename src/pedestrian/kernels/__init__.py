"""The fast path: the reference layers' functions, same names and signatures, tuned for speed.

:mod:`pedestrian.layers` is the paper's math, one screen per layer. This package computes the
same things faster, and every difference from the reference earns its lines by a measurement
(``docs/kernels.md`` lists each one and what it buys):

- :mod:`.jit` -- numba, the compiler of the kernels' loops (``@kernel``; IEEE semantics kept,
  compiled on first use and cached on disk), and :mod:`.vecmath` -- ``exp``, ``Φ``, ``φ`` as
  polynomials the compiler vectorises;
- :mod:`.layernorm`, :mod:`.activations`, :mod:`.loss`, :mod:`.embedding` -- numba loops over
  rows (llm.c's layout) for NumPy arrays; torch tensors keep NumPy-style ``out=`` chains;
- :mod:`.attention`, :mod:`.linear` -- products on BLAS, the softmax in place;
- :mod:`.workspace` -- a memory pool: a step's arrays are handed out again once nothing uses
  them, so memory is not returned to the OS and faulted in again every step;
- :mod:`.blas` -- products and reductions written into preallocated arrays, shared over the
  same threads as the loops (:func:`.jit.num_threads`, a BLAS held to one thread).

Dropout, LoRA and RoPE gain nothing measurable from a second version: the reference ones are
used (RoPE on char-small's (16, 64, 384) float32 q/k/v: 0.49 ms forward per block; the same
arithmetic written into preallocated arrays with ``out=`` took 0.55 ms).
A model chooses with ``GPT(..., kernels="fast" | "reference")``; :func:`kernels_for` maps the
name to the module (the reference where numba cannot be imported).
"""

from __future__ import annotations

import os

from ..layers import IGNORE_INDEX, KVBlock
from ..layers.dropout import dropout_backward, dropout_forward
from ..layers.lora import lora_backward, lora_forward
from ..layers.rope import rope_backward, rope_forward
from .activations import activation_backward, activation_forward
from .attention import attention_weights, multi_head_attention_backward, multi_head_attention_forward
from .embedding import embedding_backward, embedding_forward
from .layernorm import layernorm_backward, layernorm_forward
from .linear import add, linear_backward, linear_forward
from .loss import cross_entropy_backward, cross_entropy_forward

#: the two implementations a model can run
KERNELS = ("fast", "reference")

__all__ = [
    "IGNORE_INDEX", "KERNELS", "KVBlock", "kernels_for", "default_kernels",
    "activation_backward", "activation_forward", "add", "attention_weights",
    "cross_entropy_backward", "cross_entropy_forward", "dropout_backward", "dropout_forward",
    "embedding_backward", "embedding_forward", "layernorm_backward", "layernorm_forward",
    "linear_backward", "linear_forward", "lora_backward", "lora_forward",
    "multi_head_attention_backward", "multi_head_attention_forward", "rope_backward", "rope_forward",
]


def default_kernels() -> str:
    """``PEDESTRIAN_KERNELS`` if set (``fast`` or ``reference``), else ``"fast"``."""
    return os.environ.get("PEDESTRIAN_KERNELS", "fast")


_warned_no_numba: list = []


def kernels_for(name: str | None = None):
    """The module whose functions a model calls: :mod:`pedestrian.kernels` for ``"fast"``,
    :mod:`pedestrian.layers` for ``"reference"`` (``None``: :func:`default_kernels`).
    ``"fast"`` where numba cannot be imported: the reference, after one warning per process.

    Raises:
        ValueError: any other name (also a bad ``PEDESTRIAN_KERNELS``).
    """
    import sys

    name = default_kernels() if name is None else name
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
            from .. import layers

            return layers
        return sys.modules[__name__]
    if name == "reference":
        from .. import layers

        return layers
    raise ValueError(f"unknown kernels {name!r}; choose one of {KERNELS} "
                     "(PEDESTRIAN_KERNELS or GPT(..., kernels=...))")

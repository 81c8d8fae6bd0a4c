"""The GPT: :class:`GPT` (``gpt.py``, the paper's chain a0 … a12 and back) holding its
:class:`~pedestrian.model.params.Parameters` (``params.py``: flat buffers and views, gradients, the
layer table), which own the flat buffers (``buffers.py``) and the LoRA adapters (``adapters.py``),
laid out from the config alone by ``layout.py`` (every parameter's name and shape, the LoRA targets);
the checks of its inputs (``inputs.py``, ``finite.py``) and the KV cache its attention reads and
extends (``kv_cache.py``); the edge of a torch-CPU model that runs the NumPy kernels (``edge.py``).
"""

from .gpt import GPT

__all__ = ["GPT", "eval_mode"]


def eval_mode(model):
    """``with eval_mode(model):`` runs its body without dropout in the calling thread
    (:meth:`GPT.inference`): evaluation, the gradient-norm record and generation. ``model.training``
    itself is left as it is, also when the body raises (other threads may be training)."""
    return model.inference()

"""The GPT: :class:`GPT` (``gpt.py``, the paper's chain a0 … a12 and back), its parameters in
flat buffers (``params.py``), its LoRA adapters (``adapters.py``), the checks of its inputs
(``inputs.py``, ``finite.py``) and the KV cache its attention reads and extends (``kv_cache.py``).
"""

from .gpt import GPT, eval_mode

__all__ = ["GPT", "eval_mode"]

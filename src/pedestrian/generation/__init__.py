"""Generation: the decoding loop (``generate.py``) and the sampling rules it applies to each
step's logits (``sampling.py``: temperature, top-k, top-p, min-p, repetition penalty).
"""

from .sampling import Sampling

__all__ = ["Sampling"]

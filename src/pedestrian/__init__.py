"""pedestrian: a GPT whose every backward pass is derived and written by hand.

From "Deep learning for pedestrians: backpropagation in Transformers" (L. Boué, 2025).
"""

from .config import PRESETS, GPTConfig, count_params, preset
from .model import GPT

__all__ = ["GPT", "GPTConfig", "PRESETS", "count_params", "preset"]
__version__ = "0.1.0"

"""pedestrian: a GPT whose every backward pass is derived and written by hand.

From "Deep learning for pedestrians: backpropagation in Transformers" (L. Boué, 2025).
"""

from .config import PRESETS, GPTConfig, count_params, preset
from .model import GPT

__all__ = ["GPT", "GPTConfig", "PRESETS", "check_gradients", "count_params", "preset"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``pedestrian.check_gradients`` is imported on first use (:mod:`pedestrian.paper.check`)."""
    if name == "check_gradients":
        from .paper.check import check_gradients

        return check_gradients
    raise AttributeError(f"module 'pedestrian' has no attribute {name!r}")

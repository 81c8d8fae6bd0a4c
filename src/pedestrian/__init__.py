"""pedestrian: a GPT whose every backward pass is derived and written by hand.

From "Deep learning for pedestrians: backpropagation in Transformers" (L. Boué, 2025).
"""

from .config import PRESETS, GPTConfig, preset
from .model.layout import count_params
from .model import GPT

__all__ = ["GPT", "GPTConfig", "PRESETS", "check_gradients", "count_params", "load_layer", "preset"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``pedestrian.check_gradients`` (:mod:`pedestrian.paper.check`) and ``pedestrian.load_layer``
    (:mod:`pedestrian.model.slots`) are imported on first use."""
    if name == "check_gradients":
        from .paper.check import check_gradients

        return check_gradients
    if name == "load_layer":
        from .model.slots import load_layer

        return load_layer
    raise AttributeError(f"module 'pedestrian' has no attribute {name!r}")

"""One module per layer kind; each holds a ``*_forward`` / ``*_backward`` pair of pure functions.

Every backward is derived by hand (paper sections in each docstring; formulas restated in
EQUATIONS.md). Forward functions return ``(output, cache)`` where ``cache`` holds exactly what
the backward needs; backward functions take the incoming error signal ``Δ`` (same shape as
the forward output) and return the signal for the input plus the parameter gradients.
"""

from .activations import activation_backward, activation_forward
from .attention import (
    attention_head_backward,
    attention_head_forward,
    causal_mask,
    multi_head_attention_backward,
    multi_head_attention_forward,
    softmax_backward,
    softmax_rows,
)
from .dropout import dropout_backward, dropout_forward
from .embedding import embedding_backward, embedding_forward
from .layernorm import layernorm_backward, layernorm_forward
from .linear import linear_backward, linear_forward
from .lora import lora_backward, lora_forward
from .loss import IGNORE_INDEX, cross_entropy_backward, cross_entropy_forward

__all__ = [
    "IGNORE_INDEX",
    "activation_backward",
    "activation_forward",
    "attention_head_backward",
    "attention_head_forward",
    "causal_mask",
    "cross_entropy_backward",
    "cross_entropy_forward",
    "dropout_backward",
    "dropout_forward",
    "embedding_backward",
    "embedding_forward",
    "layernorm_backward",
    "layernorm_forward",
    "linear_backward",
    "linear_forward",
    "lora_backward",
    "lora_forward",
    "multi_head_attention_backward",
    "multi_head_attention_forward",
    "softmax_backward",
    "softmax_rows",
]

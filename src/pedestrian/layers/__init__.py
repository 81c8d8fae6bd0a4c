"""The reference layers: the paper's math, one module per layer, forward and backward side by side.

Every function is written against the array API standard (``xp = array_namespace(x)``), writing
into no preallocated output and with no backend branches, so a reader can hold the paper (and
``docs/EQUATIONS.md``) beside each one. Forward functions return ``(output, cache)`` where
``cache`` holds what the backward needs; backward functions take the incoming error signal
``Δ`` (same shape as the forward output) and return the signal for the input, writing parameter
gradients into the arrays they are given (``dweight=``, ``dbias=``; ``None`` = no gradient).

:mod:`pedestrian.kernels` holds the fast path: the same function names and signatures, tuned
for speed (memory reuse, row blocks, threads, fused operations). A model picks one of the two
with ``GPT(..., kernels="reference" | "fast")`` (``docs/kernels.md``).
"""

from .activations import (
    ACTIVATIONS,
    activation_backward,
    activation_forward,
    linear_activation_backward,
    linear_activation_forward,
)
from .attention import (
    KVBlock,
    attention_head_backward,
    attention_head_forward,
    attention_mask,
    attention_weights,
    multi_head_attention_backward,
    multi_head_attention_forward,
    scaled_dot_product_attention_backward,
    scaled_dot_product_attention_forward,
    softmax_backward,
    softmax_forward,
)
from .dropout import dropout_backward, dropout_forward
from .embedding import embedding_backward, embedding_forward
from .head_loss import HEAD_CHUNK_BYTES, head_chunk_rows, head_loss_backward, head_loss_forward
from .layernorm import layernorm_backward, layernorm_forward
from .linear import linear_backward, linear_forward
from .lora import lora_backward, lora_forward
from .loss import IGNORE_INDEX, cross_entropy_backward, cross_entropy_forward
from .residual import (
    add,
    add_layernorm_backward,
    add_layernorm_forward,
    add_rmsnorm_backward,
    add_rmsnorm_forward,
)
from .moe import (
    RouteCache,
    moe_backward,
    moe_combine_backward,
    moe_combine_forward,
    moe_forward,
    moe_gather,
    moe_load_balancing_loss,
    moe_router_backward,
    moe_router_forward,
    moe_scatter,
)
from .rope import rope_angles, rope_backward, rope_forward
from .rmsnorm import rmsnorm_backward, rmsnorm_forward
from .swiglu import SwiGLUCache, swiglu_backward, swiglu_forward, swiglu_mlp_backward, swiglu_mlp_forward

#: the functions a model calls; :mod:`pedestrian.kernels` defines each with the same signature
MODEL_FUNCTIONS = (
    "embedding_forward", "embedding_backward", "linear_forward", "linear_backward",
    "layernorm_forward", "layernorm_backward", "activation_forward", "activation_backward",
    "dropout_forward", "dropout_backward", "lora_forward", "lora_backward",
    "multi_head_attention_forward", "multi_head_attention_backward", "attention_weights",
    "cross_entropy_forward", "cross_entropy_backward", "head_loss_forward", "head_loss_backward", "add",
    "rope_forward", "rope_backward",
    "rmsnorm_forward", "rmsnorm_backward", "swiglu_forward", "swiglu_backward",
    "swiglu_mlp_forward", "swiglu_mlp_backward",
    "add_layernorm_forward", "add_layernorm_backward", "add_rmsnorm_forward", "add_rmsnorm_backward",
    "linear_activation_forward", "linear_activation_backward",
    "moe_router_forward", "moe_router_backward", "moe_gather", "moe_scatter", "moe_combine_forward",
    "moe_combine_backward", "moe_load_balancing_loss",
)

__all__ = [
    "ACTIVATIONS", "HEAD_CHUNK_BYTES", "IGNORE_INDEX", "KVBlock", "MODEL_FUNCTIONS",
    "activation_backward", "activation_forward", "add",
    "add_layernorm_backward", "add_layernorm_forward", "add_rmsnorm_backward", "add_rmsnorm_forward",
    "attention_head_backward", "attention_head_forward", "attention_mask", "attention_weights",
    "cross_entropy_backward", "cross_entropy_forward", "dropout_backward", "dropout_forward",
    "embedding_backward", "embedding_forward", "head_chunk_rows", "head_loss_backward", "head_loss_forward",
    "layernorm_backward", "layernorm_forward", "linear_activation_backward", "linear_activation_forward",
    "linear_backward", "linear_forward", "lora_backward", "lora_forward",
    "multi_head_attention_backward", "multi_head_attention_forward",
    "RouteCache", "moe_backward", "moe_combine_backward", "moe_combine_forward", "moe_forward", "moe_gather",
    "moe_load_balancing_loss", "moe_router_backward", "moe_router_forward", "moe_scatter",
    "rope_angles", "rope_backward", "rope_forward",
    "scaled_dot_product_attention_backward", "scaled_dot_product_attention_forward",
    "softmax_backward", "softmax_forward",
    "SwiGLUCache", "rmsnorm_backward", "rmsnorm_forward", "swiglu_backward", "swiglu_forward",
    "swiglu_mlp_backward", "swiglu_mlp_forward",
]

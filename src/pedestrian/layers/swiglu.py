"""The SwiGLU MLP of Llama, Qwen2 and Mistral: ``a9 = (silu(a6 W_gate) ∘ a6 W_up) W_down``, three
matrices, no biases (Shazeer 2020, "GLU variants improve Transformer"; EQUATIONS.md "SiLU and the
SwiGLU MLP"); with the tanh GELU in place of SiLU, Gemma's GeGLU (``activation="gelu_tanh"``, the
same paper's GEGLU): ``a8 = g(a7_gate) ∘ a7_up`` for the gate's activation ``g``.

The names follow the block's ``a6 … a9`` (GPT-2's ``a7 = FC_expand(a6)`` becomes two arrays):

    a7_gate = a6 W_gate   a7_up = a6 W_up     (..., m)      HF gate_proj, up_proj
    a8 = silu(a7_gate) ∘ a7_up                (..., m)
    a9 = a8 W_down                            (..., d)      HF down_proj

and backward ``Δ9 → Δ8 → (Δ7_gate, Δ7_up) → Δ6``. Reference implementation: the paper's math
only, written against the array API standard.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..backend import array_namespace
from .activations import activation_backward, activation_forward
from .linear import linear_backward, linear_forward

#: the activations a gate may take: SiLU (SwiGLU) and the tanh GELU (GeGLU)
GATE_ACTIVATIONS = ("silu", "gelu_tanh")


class SwiGLUCache(NamedTuple):
    """What :func:`swiglu_mlp_backward` needs, under the names a model's ``activations()`` uses."""

    a6: Any         #: the input ``(..., d)``
    a7_gate: Any    #: ``a6 W_gate`` ``(..., m)``
    a7_up: Any      #: ``a6 W_up`` ``(..., m)``
    a8: Any         #: ``g(a7_gate) ∘ a7_up`` ``(..., m)``
    activation: str = "silu"   #: the gate's ``g``: ``"silu"`` or ``"gelu_tanh"``


def check_gate(activation: str) -> None:
    """Raises ``ValueError`` unless ``activation`` is one of :data:`GATE_ACTIVATIONS`."""
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"a gated MLP gates with one of {GATE_ACTIVATIONS} (silu: SwiGLU, gelu_tanh: GeGLU), "
                         f"got {activation!r}")


def split_cache(cache) -> tuple:
    """``(gate, up, activation)`` of a :func:`swiglu_forward` cache (a pair ``(gate, up)``: SiLU)."""
    return (*cache, "silu") if len(cache) == 2 else tuple(cache)


def check_swiglu_shapes(x, w_gate, w_up, w_down) -> None:
    """Raises ``ValueError`` unless ``W_gate``, ``W_up`` are ``(d, m)`` and ``W_down`` is ``(m, ·)``."""
    d = x.shape[-1]
    if not (tuple(w_gate.shape) == tuple(w_up.shape) and w_gate.shape[0] == d and w_down.shape[0] == w_gate.shape[1]):
        raise ValueError(f"SwiGLU weights must be W_gate (d, m), W_up (d, m), W_down (m, d_out) for inputs of "
                         f"width d = {d}; got {tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)} "
                         "(Hugging Face nn.Linear stores (out, in): transpose gate_proj, up_proj, down_proj)")


def swiglu_forward(gate, up, activation: str = "silu"):
    """The gated product ``a8 = g(a7_gate) ∘ a7_up``, elementwise: ``g = silu`` (SwiGLU) or the
    tanh GELU (GeGLU, Gemma's ``gelu_pytorch_tanh``).

    Args:
        gate, up: ``(..., m)`` float arrays of one shape (``a7_gate``, ``a7_up``).
        activation: ``"silu"`` (default) or ``"gelu_tanh"`` (:data:`GATE_ACTIVATIONS`).

    Returns:
        ``(a8, cache)``, ``a8`` ``(..., m)``; ``cache = (gate, up, activation)``.

    Raises:
        ValueError: another activation.
    """
    check_gate(activation)
    return activation_forward(gate, activation)[0] * up, (gate, up, activation)   # (..., m)


def swiglu_backward(delta, cache, *, fused: bool = False):
    """``Δ7_up = Δ8 ∘ g(a7_gate)``, ``Δ7_gate = Δ8 ∘ a7_up ∘ g'(a7_gate)``.

    Args:
        delta: ``Δ8`` ``(..., m)``; cache: from :func:`swiglu_forward` (or the pair ``(gate, up)``:
            SiLU).
        fused: return the two side by side in one array, ``Δ7 = [Δ7_gate | Δ7_up]`` ``(..., 2m)``:
            the signal of the gate and up layers fused as one (``mlp_gate_up``, as ``qkv``).

    Returns:
        ``(Δ7_gate, Δ7_up)``, each ``(..., m)``; with ``fused``, ``Δ7`` ``(..., 2m)``.
    """
    gate, up, activation = split_cache(cache)
    d_up = delta * activation_forward(gate, activation)[0]                   # Δ8 ∘ g(a7_gate), (..., m)
    d_gate = activation_backward(delta * up, gate, activation)              # Δ8 ∘ u ∘ g'(a7_gate), (..., m)
    return array_namespace(delta).concat((d_gate, d_up), axis=-1) if fused else (d_gate, d_up)


def swiglu_mlp_forward(x, w_gate, w_up, w_down, *, activation: str = "silu"):
    """``a9 = (g(x W_gate) ∘ x W_up) W_down``, ``g`` = ``activation`` (SiLU, or GeGLU's tanh GELU).

    Args:
        x: ``(..., d)`` float array (``a6``).
        w_gate, w_up: ``(d, m)``; w_down: ``(m, d_out)`` (the ``(f_in, f_out)`` layout: the
            transposes of HF's ``gate_proj``, ``up_proj``, ``down_proj`` weights).
        activation: as in :func:`swiglu_forward`.

    Returns:
        ``(a9, cache)``: ``a9`` ``(..., d_out)``; ``cache`` a :class:`SwiGLUCache`.

    Raises:
        ValueError: weights of the wrong shapes.
    """
    check_swiglu_shapes(x, w_gate, w_up, w_down)
    a7_gate, _ = linear_forward(x, w_gate)                                   # (..., m)
    a7_up, _ = linear_forward(x, w_up)                                       # (..., m)
    a8, _ = swiglu_forward(a7_gate, a7_up, activation)                       # (..., m)
    a9, _ = linear_forward(a8, w_down)                                       # (..., d_out)
    return a9, SwiGLUCache(x, a7_gate, a7_up, a8, activation)


def swiglu_mlp_backward(delta, cache, w_gate, w_up, w_down, *, dw_gate=None, dw_up=None, dw_down=None,
                        need_input=True):
    """``dW_down = a8ᵀ Δ9``, ``Δ8 = Δ9 W_downᵀ``, ``(Δ7_gate, Δ7_up)`` by :func:`swiglu_backward`,
    ``dW_gate = a6ᵀ Δ7_gate``, ``dW_up = a6ᵀ Δ7_up``, ``Δ6 = Δ7_gate W_gateᵀ + Δ7_up W_upᵀ``.

    Args:
        delta: ``Δ9`` ``(..., d_out)``; cache: from :func:`swiglu_mlp_forward`.
        w_gate, w_up, w_down: as in :func:`swiglu_mlp_forward`.
        dw_gate, dw_up, dw_down: arrays of the weights' shapes the gradients are written into,
            or ``None`` (frozen).
        need_input: compute ``Δ6``.

    Returns:
        ``Δ6`` ``(..., d)``, or ``None`` when not asked for.
    """
    d8 = linear_backward(delta, cache.a8, w_down, dweight=dw_down)                        # Δ8 (..., m)
    d7_gate, d7_up = swiglu_backward(d8, (cache.a7_gate, cache.a7_up, cache.activation))  # (..., m) each
    d6_gate = linear_backward(d7_gate, cache.a6, w_gate, dweight=dw_gate, need_input=need_input)
    d6_up = linear_backward(d7_up, cache.a6, w_up, dweight=dw_up, need_input=need_input)
    return d6_gate + d6_up if need_input else None                                        # Δ6 (..., d)

"""The SwiGLU MLP of Llama, Qwen2 and Mistral: ``a9 = (silu(a6 W_gate) ∘ a6 W_up) W_down``, three
matrices, no biases (Shazeer 2020, "GLU variants improve Transformer"; EQUATIONS.md "SiLU and the
SwiGLU MLP").

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


class SwiGLUCache(NamedTuple):
    """What :func:`swiglu_mlp_backward` needs, under the names a model's ``activations()`` uses."""

    a6: Any         #: the input ``(..., d)``
    a7_gate: Any    #: ``a6 W_gate`` ``(..., m)``
    a7_up: Any      #: ``a6 W_up`` ``(..., m)``
    a8: Any         #: ``silu(a7_gate) ∘ a7_up`` ``(..., m)``


def check_swiglu_shapes(x, w_gate, w_up, w_down) -> None:
    """Raises ``ValueError`` unless ``W_gate``, ``W_up`` are ``(d, m)`` and ``W_down`` is ``(m, ·)``."""
    d = x.shape[-1]
    if not (tuple(w_gate.shape) == tuple(w_up.shape) and w_gate.shape[0] == d and w_down.shape[0] == w_gate.shape[1]):
        raise ValueError(f"SwiGLU weights must be W_gate (d, m), W_up (d, m), W_down (m, d_out) for inputs of "
                         f"width d = {d}; got {tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)} "
                         "(Hugging Face nn.Linear stores (out, in): transpose gate_proj, up_proj, down_proj)")


def swiglu_forward(gate, up):
    """The gated product ``a8 = silu(a7_gate) ∘ a7_up``, elementwise.

    Args:
        gate, up: ``(..., m)`` float arrays of one shape (``a7_gate``, ``a7_up``).

    Returns:
        ``(a8, cache)``, ``a8`` ``(..., m)``; ``cache = (gate, up)``.
    """
    return activation_forward(gate, "silu")[0] * up, (gate, up)             # (..., m)


def swiglu_backward(delta, cache, *, fused: bool = False):
    """``Δ7_up = Δ8 ∘ silu(a7_gate)``, ``Δ7_gate = Δ8 ∘ a7_up ∘ silu'(a7_gate)``.

    Args:
        delta: ``Δ8`` ``(..., m)``; cache: from :func:`swiglu_forward`.
        fused: return the two side by side in one array, ``Δ7 = [Δ7_gate | Δ7_up]`` ``(..., 2m)``:
            the signal of the gate and up layers fused as one (``mlp_gate_up``, as ``qkv``).

    Returns:
        ``(Δ7_gate, Δ7_up)``, each ``(..., m)``; with ``fused``, ``Δ7`` ``(..., 2m)``.
    """
    gate, up = cache
    d_up = delta * activation_forward(gate, "silu")[0]                       # Δ8 ∘ silu(g), (..., m)
    d_gate = activation_backward(delta * up, gate, "silu")                  # Δ8 ∘ u ∘ silu'(g), (..., m)
    return array_namespace(delta).concat((d_gate, d_up), axis=-1) if fused else (d_gate, d_up)


def swiglu_mlp_forward(x, w_gate, w_up, w_down):
    """``a9 = (silu(x W_gate) ∘ x W_up) W_down``.

    Args:
        x: ``(..., d)`` float array (``a6``).
        w_gate, w_up: ``(d, m)``; w_down: ``(m, d_out)`` (the ``(f_in, f_out)`` layout: the
            transposes of HF's ``gate_proj``, ``up_proj``, ``down_proj`` weights).

    Returns:
        ``(a9, cache)``: ``a9`` ``(..., d_out)``; ``cache`` a :class:`SwiGLUCache`.

    Raises:
        ValueError: weights of the wrong shapes.
    """
    check_swiglu_shapes(x, w_gate, w_up, w_down)
    a7_gate, _ = linear_forward(x, w_gate)                                   # (..., m)
    a7_up, _ = linear_forward(x, w_up)                                       # (..., m)
    a8, _ = swiglu_forward(a7_gate, a7_up)                                   # (..., m)
    a9, _ = linear_forward(a8, w_down)                                       # (..., d_out)
    return a9, SwiGLUCache(x, a7_gate, a7_up, a8)


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
    d7_gate, d7_up = swiglu_backward(d8, (cache.a7_gate, cache.a7_up))                    # (..., m) each
    d6_gate = linear_backward(d7_gate, cache.a6, w_gate, dweight=dw_gate, need_input=need_input)
    d6_up = linear_backward(d7_up, cache.a6, w_up, dweight=dw_up, need_input=need_input)
    return d6_gate + d6_up if need_input else None                                        # Δ6 (..., d)

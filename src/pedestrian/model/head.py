"""The chain's last step, ``a12 = FC_logits(a11)`` and the loss, fused into one layer or not
(:mod:`pedestrian.layers.head_loss`; docs/guide.md, "The head fused with its loss").

When the fused head runs:

- :meth:`GPT.loss <pedestrian.model.gpt.GPT.loss>` (training steps, ``pedestrian eval``, the
  validation loss) runs it whenever :attr:`GPT.fused_head` is ``True`` (the default) and the
  logits layer carries no LoRA adapter: the logits and ``Δ12`` are made a chunk of rows at a time
  and never kept whole. With ``keep_activations=True`` (a training step) the same pass makes
  ``Δ11`` and the head's gradients, handed over by the backward; with ``False`` (an evaluation)
  the loss only.
- :meth:`GPT.forward` (which returns the logits), ``fused_head = False`` and a head with adapters
  keep ``a12`` and compute the cross-entropy on it as before (demos, :meth:`GPT.activations`,
  :meth:`GPT.deltas` with ``Δ12``, ``backward(delta_logits=)`` of a loss of your own).

After a fused loss, :meth:`GPT.activations` has no ``"a12"`` and :meth:`GPT.deltas` no ``"Δ12"``;
asking for them raises a ``KeyError`` that says so and how to keep them (:data:`NOT_KEPT`).
"""

from __future__ import annotations

__all__ = ["NOT_KEPT", "backward", "forward", "logits_shape"]

#: why a fused loss's record has no ``a12`` / ``Δ12`` (the inspection dictionaries' message)
NOT_KEPT = ("not kept: model.loss fuses the output head with its loss (the logits and Δ12 are made a "
            "chunk of rows at a time, never whole); run model.forward(tokens, targets) or set "
            "model.fused_head = False before model.loss to keep them")


def forward(model, f, fc, targets, n_total, fuse: bool, fc_forward) -> None:
    """Record on ``f`` the head's output: ``f.a12`` (with ``config.logit_softcap`` ``c``, the capped
    ``c · tanh(z / c)`` of the product ``z``, its cache ``f.softcap``) and the cross-entropy's ``f.loss``, or when
    ``fuse`` (a :meth:`GPT.loss` with :attr:`GPT.fused_head`; targets given, no adapter on the
    head) ``f.head``, the fused layer's cache (``f.a12 = None``); ``f.loss_value`` the loss and
    ``f.logits_shape`` ``(B, T, V)`` either way. ``fc_forward``: the model's FC forward."""
    K, cap = model.kernels, model.config.logit_softcap
    f.head, f.softcap = None, None
    if fuse and targets is not None and not fc.adapters:
        grad_weight = f.kept and not model.freeze_base
        f.loss_value, f.head = K.head_loss_forward(f.a11, fc.weight, fc.bias, targets, n_total=n_total,
                                                   grad=f.kept, grad_weight=grad_weight,
                                                   **({} if cap is None else {"softcap": cap}))
        f.a12, f.loss, f.logits_shape = None, f.head, f.head.logits_shape
        return
    f.a12 = fc_forward(fc, f.a11, f.lora)                                            # (B, T, V)
    if getattr(K, "precision", None) == "bf16":                                     # bfloat16 product: the
        f.a12 = f.a12.float()                                                        # loss, the caller in float32
    if cap is not None:                                                              # Gemma 2: a12 = c tanh(z / c)
        f.a12, f.softcap = K.softcap_forward(f.a12, cap)                             # (B, T, V)
    f.logits_shape = tuple(f.a12.shape)
    if targets is not None:
        f.loss_value, f.loss = K.cross_entropy_forward(f.a12, targets, n_total=n_total)


def backward(model, f, fc, grad, delta_logits, fc_backward):
    """``(Δ12, Δ11)`` of the record ``f``: the fused head's ``Δ11`` (``Δ12 = None``: never made
    whole), its gradients written into ``grad``'s arrays; else ``Δ12`` (``delta_logits``, or the
    cross-entropy's) through the logits layer's backward ``fc_backward`` (the model's)."""
    from .recompute import loss_delta

    if f.head is not None and delta_logits is None:
        return None, model.kernels.head_loss_backward(f.head, dweight=grad.weight, dbias=grad.bias)
    d12 = loss_delta(model.kernels, f) if delta_logits is None else delta_logits
    dz = d12 if f.softcap is None else model.kernels.softcap_backward(d12, f.softcap)  # through the cap
    return d12, fc_backward(fc, grad, dz, f.a11, f.lora)


def logits_shape(f) -> tuple:
    """``(B, T, V)`` of the record ``f``'s logits, kept or not."""
    return f.logits_shape

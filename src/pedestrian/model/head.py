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

Per-sequence log-probabilities (:func:`sequence_logprobs`, DPO's ``ℓ``; docs/EQUATIONS.md, "DPO"):
``ℓ_b = Σ_t log p(y_bt)`` over row ``b``'s counted targets, one fused head call per row (``C = 1``:
its loss is ``−ℓ_b``, its ``Δ11`` row ``b``'s ``−∂ℓ_b/∂a11``). The objective's weights
``w_b = ∂J/∂ℓ_b`` are known only once every ``ℓ`` is (:func:`weigh_sequences`); the backward then
scales row ``b``'s ``Δ11`` by ``−w_b``. A frozen head (LoRA) makes the unweighted ``Δ11`` in the
forward's one pass; a trained head makes ``Δ11``, ``dW``, ``db`` again in the backward, row by
row, weighted (one more product ``h W``: ``dW = Σ_b −w_b h_bᵀ (p_b − onehot_b)`` needs ``w``).
With ``fused_head = False`` or an adapter on the head: the logits are kept and
``Δ12_b = −w_b (p_b − onehot_b)``.
"""

from __future__ import annotations

import threading
import weakref

from numpy import shape as np_shape

from ..backend import array_namespace, is_torch_array, to_numpy
from .edge import to_torch

__all__ = ["NOT_KEPT", "Rows", "backward", "forward", "logits_shape", "sequence_logprobs", "weigh_sequences"]

#: :func:`forward`'s ``fuse`` for :func:`sequence_logprobs`
SEQUENCES = "sequences"

#: why a fused loss's record has no ``a12`` / ``Δ12`` (the inspection dictionaries' message)
NOT_KEPT = ("not kept: model.loss fuses the output head with its loss (the logits and Δ12 are made a "
            "chunk of rows at a time, never whole); run model.forward(tokens, targets) or set "
            "model.fused_head = False before model.loss to keep them")


def forward(model, f, fc, targets, n_total, fuse: bool, fc_forward) -> None:
    """Record on ``f`` the head's output: ``f.a12`` and the cross-entropy's ``f.loss``, or when
    ``fuse`` (a :meth:`GPT.loss` with :attr:`GPT.fused_head`; targets given, no adapter on the
    head) ``f.head``, the fused layer's cache (``f.a12 = None``); ``f.loss_value`` the loss and
    ``f.logits_shape`` ``(B, T, V)`` either way. ``fc_forward``: the model's FC forward."""
    K = model.kernels
    f.head, f.adapters_off = None, bool(model.lora_targets) and model.parameters.adapters_off
    if fuse == SEQUENCES and targets is not None:
        return _sequences_forward(model, f, fc, targets, fc_forward)
    if fuse and targets is not None and not fc.adapters:
        grad_weight = f.kept and not model.freeze_base
        f.loss_value, f.head = K.head_loss_forward(f.a11, fc.weight, fc.bias, targets, n_total=n_total,
                                                   grad=f.kept, grad_weight=grad_weight)
        f.a12, f.loss, f.logits_shape = None, f.head, f.head.logits_shape
        return
    f.a12 = fc_forward(fc, f.a11, f.lora)                                            # (B, T, V)
    if getattr(K, "precision", None) == "bf16":                                     # bfloat16 product: the
        f.a12 = f.a12.float()                                                        # loss, the caller in float32
    f.logits_shape = tuple(f.a12.shape)
    if targets is not None:
        f.loss_value, f.loss = K.cross_entropy_forward(f.a12, targets, n_total=n_total)


def backward(model, f, fc, grad, delta_logits, fc_backward):
    """``(Δ12, Δ11)`` of the record ``f``: the fused head's ``Δ11`` (``Δ12 = None``: never made
    whole), its gradients written into ``grad``'s arrays; else ``Δ12`` (``delta_logits``, or the
    cross-entropy's) through the logits layer's backward ``fc_backward`` (the model's)."""
    from .recompute import loss_delta

    if getattr(f, "adapters_off", False):
        raise ValueError("the last forward ran without the LoRA adapters (model.without_adapters()), a "
                         "frozen reference: it has no backward; run the forward again with the adapters on")
    if isinstance(f.head, Rows) and delta_logits is None:
        return _sequences_backward(model, f, fc, grad, fc_backward)
    if f.head is not None and delta_logits is None:
        return None, model.kernels.head_loss_backward(f.head, dweight=grad.weight, dbias=grad.bias)
    d12 = loss_delta(model.kernels, f) if delta_logits is None else delta_logits
    return d12, fc_backward(fc, grad, d12, f.a11, f.lora)


def logits_shape(f) -> tuple:
    """``(B, T, V)`` of the record ``f``'s logits, kept or not."""
    return f.logits_shape


# ---------------------------------------------------------------------------- per-sequence log-probs
def sequence_logprobs(model, tokens, targets, *, keep_activations: bool = True):
    """``ℓ_b = Σ_t log p(targets[b, t] | tokens[b, :t+1])`` over row ``b``'s counted targets
    (those not ``-100``; a row with none has ``ℓ_b = 0``), for DPO (module docstring).

    Args:
        model: a :class:`~pedestrian.model.GPT`.
        tokens, targets: ``(B, T)`` ids, as :meth:`GPT.loss <pedestrian.model.GPT.loss>` takes them.
        keep_activations: keep what a backward needs (``False``: the reference's forward).

    Returns:
        ``(B,)`` array of the model's dtype and backend (unread on a device). A backward of
        ``J(ℓ)`` follows with :func:`weigh_sequences` then ``model.backward()``.

    Raises:
        as :meth:`GPT.forward <pedestrian.model.GPT.forward>` (bad ids or shapes).
    """
    values = model.loss(tokens, targets, keep_activations=keep_activations, read=False, per_row=True)
    return to_torch(values) if model.numpy_chain else values


def weigh_sequences(model, weights) -> None:
    """Give the calling thread's last :func:`sequence_logprobs` the weights ``w_b = ∂J/∂ℓ_b``
    ``(B,)`` of the objective ``J`` that its ``model.backward()`` differentiates.

    Raises:
        ValueError: the model's last forward in this thread was not a :func:`sequence_logprobs`
            with activations kept, or ``weights`` is not ``(B,)``.
    """
    last = getattr(_LAST, "rows", {}).get(model)
    h = None if last is None else last()
    if h is None or not h.kept:
        raise ValueError("weigh_sequences needs the calling thread's last forward to be "
                         "sequence_logprobs(model, tokens, targets) with keep_activations=True (a forward "
                         "run after it, such as the reference's, replaces it: run the reference first)")
    B = h.targets.shape[0]
    shape = tuple(weights.shape) if hasattr(weights, "shape") else np_shape(weights)    # (a tensor: not read)
    if shape != (B,):
        raise ValueError(f"the sequence weights must have shape ({B},), one per row, got {shape}")
    xp = array_namespace(h.like)                           # (the chain's: NumPy on a torch CPU model)
    w = xp.asarray(to_numpy(weights) if xp is not model.xp or not is_torch_array(weights) else weights,
                   dtype=h.dtype, device=h.like.device)
    h.weights = w


class Rows:
    """What a per-row head keeps for its backward (:func:`_sequences_forward`)."""

    def __init__(self, fused, targets, kept, again, like):
        self.fused, self.targets, self.kept, self.again, self.like = fused, targets, kept, again, like
        self.rows, self.weights, self.dtype = [], None, None


#: per thread: ``{model: weakref to the Rows of its last forward}`` (dead once that record is let go)
_LAST = threading.local()


def _sequences_forward(model, f, fc, targets, fc_forward) -> None:
    """Record ``f.loss_value`` ``(B,)`` = ``ℓ`` and ``f.head``, what the backward reads."""
    K, xp = model.kernels, array_namespace(f.a11)
    B = targets.shape[0]
    fused = model.fused_head and not fc.adapters
    trained = f.kept and not model.freeze_base             # the head's own gradients: made in the backward
    f.head = Rows(fused, targets, f.kept, fused and trained, f.a11)
    if fused:
        for b in range(B):                                 # −ℓ_b and (frozen head) −∂ℓ_b/∂a11
            nll, cache = K.head_loss_forward(f.a11[b:b + 1], fc.weight, fc.bias, targets[b:b + 1], n_total=1,
                                             grad=f.kept and not trained, grad_weight=False)
            f.head.rows.append((nll, cache))
        f.a12, f.logits_shape = None, (*targets.shape, fc.weight.shape[1])
    else:
        f.a12 = fc_forward(fc, f.a11, f.lora)                                       # (B, T, V)
        if getattr(K, "precision", None) == "bf16":
            f.a12 = f.a12.float()
        f.logits_shape = tuple(f.a12.shape)
        f.head.rows = [K.cross_entropy_forward(f.a12[b:b + 1], targets[b:b + 1], n_total=1) for b in range(B)]
    nll = [xp.asarray(loss, device=f.a11.device) for loss, _ in f.head.rows]     # 0-d each, unread
    f.loss = f.head
    f.loss_value = -xp.stack(nll)                                                   # (B,) ℓ
    f.head.dtype = f.loss_value.dtype
    if not hasattr(_LAST, "rows"):
        _LAST.rows = weakref.WeakKeyDictionary()
    _LAST.rows[model] = weakref.ref(f.head)


def _sequences_backward(model, f, fc, grad, fc_backward):
    """``(Δ12 or None, Δ11)`` of ``J``: row ``b``'s cross-entropy gradient times ``−w_b``."""
    h, K, w, xp = f.head, model.kernels, f.head.weights, array_namespace(f.a11)
    if w is None:
        raise ValueError("the last forward was sequence_logprobs: give its weights dJ/dℓ with "
                         "weigh_sequences(model, weights) before model.backward()")
    scale = [-w[b] for b in range(w.shape[0])]                                      # ∂ℓ_b/∂z = −(p − onehot)
    if not h.fused:
        d12 = xp.concat([K.cross_entropy_backward(cache) * s for (_, cache), s in zip(h.rows, scale)])
        return d12, fc_backward(fc, grad, d12, f.a11, f.lora)
    if not h.again:                                                                 # frozen head: Δ11 made
        return None, xp.concat([cache.dh * s for (_, cache), s in zip(h.rows, scale)])
    d11 = []
    for b, s in enumerate(scale):                                                   # trained head: again,
        _, c = K.head_loss_forward(f.a11[b:b + 1], fc.weight, fc.bias, h.targets[b:b + 1], n_total=1,
                                   grad=True, grad_weight=grad.weight is not None)  # row by row, weighted
        d11.append(c.dh * s)                                                        # (1, T, d)
        for given, made in ((grad.weight, c.dweight), (grad.bias, c.dbias)):
            if given is not None:
                if b == 0:
                    given[...] = made * s                                           # (d, V) / (V,)
                else:
                    given += made * s
    return None, xp.concat(d11)

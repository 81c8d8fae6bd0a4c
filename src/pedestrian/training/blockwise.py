"""AdamW applied block by block inside the backward, so that no whole-model gradient is held
(``pedestrian train --update-in-backward``).

A training step usually holds four copies of the weights' size: the weights, their gradient and
AdamW's two moments. Here the backward hands each block's gradients to AdamW as soon as they are
written (:meth:`GPT.backward <pedestrian.model.GPT.backward>`'s ``after_block``), AdamW updates that
block's weights and moments, and the next block writes its gradients into the same one-block
buffer (:meth:`Parameters.block_grads <pedestrian.model.params.Parameters.block_grads>`). Only the
parameters outside the blocks (the embeddings, the last norm, untied logits) have gradient
buffers of their own size; the whole-model gradient buffer's block regions are never written. The
update of every entry is AdamW's own (:meth:`AdamW.update <pedestrian.training.optim.AdamW.update>`),
so a step gives the same bits as a backward followed by :meth:`AdamW.step` without clipping
(``tests/system/test_blockwise.py``).

What this costs, by construction:

- **No global-norm clipping**: the whole gradient's norm is known only when the backward ends,
  after most blocks were updated (``grad_clip`` must be 0).
- **A non-finite gradient cannot skip the step**: each block's gradient is checked before its
  update, but the blocks after it (nearer the logits) are already updated. Such a step raises
  :class:`~pedestrian.checkpoint.NonFiniteError` naming the block, and the run stops without
  writing a checkpoint (its last one is kept). A non-finite loss is found before the backward and
  skips the step as usual.
- Gradient accumulation, several ranks, LoRA and plugged layers need whole gradients: refused
  (:func:`check_blockwise`).

(Optimizer-in-backward: LOMO, Lv et al., "Full parameter fine-tuning for large language models
with limited resources", 2023; PyTorch's ``register_post_accumulate_grad_hook`` recipe.)
"""

from __future__ import annotations

import math

import numpy as np

from ..checkpoint import NonFiniteError
from ..layers import IGNORE_INDEX
from ..model.layout import in_block
from .distributed import RowKeyedRNG
from .optim import AdamW, global_grad_norm
from .step import TrainingError, count_targets

__all__ = ["blockwise_step", "check_blockwise"]


def check_blockwise(model, optimizer: AdamW, k: int = 1, world_size: int = 1, grad_clip: float = 0.0) -> None:
    """Raise :class:`~pedestrian.training.step.TrainingError` naming what an update inside the
    backward cannot do: clipping (``grad_clip > 0``), accumulation (``k > 1``), several ranks, a
    frozen base or LoRA adapters, plugged layers, or arrays other than NumPy's."""
    problems = [what for bad, what in (
        (grad_clip > 0, "global-norm clipping (pass --grad-clip 0)"),
        (k > 1, "gradient accumulation (pass --grad-accum 1)"),
        (world_size > 1, "several processes"),
        (model.freeze_base or model.lora_targets, "LoRA adapters"),
        (bool(model.slots.plugged), "plugged layers"),
        (model.config.n_experts and model.config.moe_layers is not None,
         "blocks of two kinds (moe_layers: experts in some blocks, a dense MLP in others)"),
        (model.backend != "numpy", "the torch backend (use --backend numpy)"),
        (len(optimizer.groups) != 1, "more than one parameter buffer")) if bad]
    if problems:
        raise TrainingError("--update-in-backward updates each block before the whole gradient exists, "
                            "so it cannot do " + ", ".join(problems))


def blockwise_step(model, optimizer: AdamW, batches, lr: float, grad_clip: float = 0.0,
                   accum_buffers=None, group=None, dropout_key: tuple | None = None) -> tuple[float, float]:
    """One training update, AdamW applied to each block inside the backward: the step of
    :func:`pedestrian.training.step.train_step` (same arguments; one micro-batch, one process, no
    clipping) without a whole-model gradient buffer (module docstring).

    Returns:
        ``(loss, grad_norm)``: the mean loss (nats per counted token) and the norm of the whole
        gradient (assembled from the blocks' norms). A non-finite loss returns ``(loss, nan)``
        before the backward: nothing changed (a skipped step).

    Raises:
        TrainingError: what :func:`check_blockwise` refuses; every target is ``-100``.
        NonFiniteError: a block's gradient (or the rest's) is not finite or too large for AdamW;
            the blocks after it were updated already, the others not (the run must stop).
    """
    check_blockwise(model, optimizer, len(batches), 1 if group is None else group.world_size, grad_clip)
    (x, y), = batches
    if count_targets(y) == 0:
        raise TrainingError(f"every target of the step's batch is the ignore index {IGNORE_INDEX}, so there "
                            "is no loss to train on")
    if dropout_key is not None:
        model.dropout_rng = RowKeyedRNG((*dropout_key, 0))
    loss = model.loss(x, y)
    if not math.isfinite(loss):
        return loss, math.nan
    base, coefficients, norms = model.parameters.base, optimizer.advance(lr), []

    def apply(where: str, grads, spans) -> None:          # spans: (region lo, hi in `grads`, in base.flat)
        norms.append(global_grad_norm([grads]))
        if not norms[-1] <= optimizer.max_grad_norm:
            raise NonFiniteError(f"step {optimizer.step_count}: the gradient of {where} has norm {norms[-1]:g} (not "
                                 "a finite number AdamW can take); with --update-in-backward the blocks after it "
                                 "were updated already, so the step cannot be skipped and the run stops",
                                 {where: (int(np.isnan(grads).sum()), int(np.isinf(grads).sum()))})
        for lo, hi, p_lo, p_hi in spans:
            optimizer.update(0, p_lo, p_hi, grads[lo:hi], coefficients)

    def after_block(i: int, grads) -> None:
        apply(f"blocks.{i}", grads.flat, [(lo, hi, *base.spans[in_block(name, i)])
                                          for name, (lo, hi) in grads.spans.items()])

    model.backward(after_block=after_block)
    flat = model.parameters.base_grads.flat
    for name, (lo, hi) in base.spans.items():
        if not name.startswith("blocks."):                # embeddings, last norm, untied logits
            apply(name, flat[lo:hi], [(0, hi - lo, lo, hi)])
    return loss, math.hypot(*norms)

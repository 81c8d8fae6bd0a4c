"""One training step (accumulation, the sum over ranks, clipping, AdamW), the validation loss,
and the rule for numbers that are not finite.

One step (:func:`train_step`)::

    n = Σ_i n_i                             the counted targets of all k micro-batches
    for each of k micro-batches:  loss_i = model.loss(x_i[rows], y_i[rows], n_total=n)
                                  model.backward()                      (hand-derived)
    g = Σ_i g_i;  loss = Σ_i loss_i         gradient accumulation (see below)
    g ← Σ_ranks g;  loss ← Σ_ranks loss     one all_reduce of the flat buffer (nothing on one process)
    N = ‖g‖                                 overflow-safe (optim.global_grad_norm)
    if the loss or N is not finite: skip    θ, the AdamW moments and its step count untouched
    g ← g · min(1, clip / (N + 1e-6))       global-norm clipping (torch's convention)
    θ ← AdamW(θ, g, lr = schedule(step))    optim.py

Gradient accumulation: the step's loss is the token mean over *every* counted target of its
``k`` micro-batches (those not the ignore index ``-100``; ``n_i`` of them in micro-batch ``i``),
as if they were one batch ``k`` times larger. Each micro-batch divides its summed token losses by
the step's ``n`` (not by its own ``n_i``), so the micro-batches' losses and gradients simply add
up to that mean and its gradient -- whatever mix of ignored targets they hold, one of them with
none counted included (``transformers``' ``num_items_in_batch`` does the same since 2024). A
step where no target counts at all (``n = 0``) has no loss to train on: :func:`train_step`
refuses it (:class:`TrainingError`) before any forward. The backward overwrites the model's
gradient buffers, so the running sum lives in a separate buffer.

Non-finite numbers (one rule, for train and finetune alike):

- A step whose training loss or gradient norm is NaN or ±inf is **skipped**: no AdamW update, so
  the weights, the moments and AdamW's step count are exactly as before. A warning names the
  step, and ``log.jsonl`` records it with ``"skipped": true``. The step counter, the learning-rate
  schedule and the data still move on (the next step sees other batches).
- After ``max_skipped_steps`` skipped steps **in a row** (default 5) the run stops with an error
  that names the last good checkpoint; nothing is saved after it.
- The gradient norm is computed without overflow (float32 gradients of 1e20 have a finite norm
  and are clipped, not skipped); a gradient whose norm is finite but too large for AdamW in the
  dtype (above ``√max / 2``, 9.2e18 in float32, possible only with clipping off) is skipped too.
- A non-finite validation loss is warned about, is never the "best", and is recorded as ``null``.
- Before every checkpoint the weights and AdamW moments are checked; if one is not finite the run
  stops with an error naming the last good checkpoint, and nothing is written.

On a device (a model whose chain runs on torch tensors: ``backend="torch"`` on a GPU, or the
reference layers), a step waits for the device once: the forwards and backwards of its
micro-batches, the accumulation and the sums of squares of the gradient norm are queued with
nothing read, their input checks kept as flags on the device
(:func:`~pedestrian.model.device_checks.deferred_checks`: the token and target ids, and -- for targets
given as tensors -- whether any counts); then the loss, the sums of squares and one flag of every
check come to the host together, as one small tensor (:func:`_read_step`). A set flag raises the
error the check raises at once elsewhere (same text, value and position, found again on the host)
and nothing is updated; otherwise the skip rule above decides and the clipping and the AdamW
update are queued with numbers the host now knows. Where the AdamW update is the GPU's one
Triton pass, the clipping scale is not among them: it is computed on the device from the unread
sums of squares and applied by that pass as it reads the gradient (no pass of its own, nothing
read). NumPy arrays are checked at once, as ever.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from ..backend import is_torch_array
from ..model.device_checks import deferred_checks
from ..model.finite import non_finite_counts, non_finite_report
from .distributed import RowKeyedRNG, SingleProcess
from ..layers.loss import IGNORE_INDEX
from ..model import eval_mode
from .optim import AdamW, ParamGroup, clip_grad_norm, clip_scale, global_grad_norm, squared_sums

class TrainingError(ValueError):
    """Training cannot start or continue (bad settings, non-finite numbers, an existing run)."""



# ---------------------------------------------------------------------------------------- one step
def _copy_into(dst, src) -> None:
    if is_torch_array(dst):
        dst.copy_(src)
    else:
        np.copyto(dst, src)


def _add_into(dst, src) -> None:
    if is_torch_array(dst):
        dst.add_(src)
    else:
        np.add(dst, src, out=dst)


def empty_like(a):
    """An uninitialised array like ``a`` (NumPy or torch)."""
    if is_torch_array(a):
        import torch

        return torch.empty_like(a)
    return np.empty_like(a)


def skip_reason(loss: float, grad_norm: float, grad_clip: float, optimizer: AdamW) -> str | None:
    """Why a step with this loss and gradient norm gets no update (``None``: it gets one).

    The one test of the non-finite rule (module docstring): the loss and the norm must be finite,
    and the gradient AdamW receives -- clipped when ``grad_clip > 0`` -- must be within
    :attr:`AdamW.max_grad_norm <pedestrian.training.optim.AdamW>`.
    """
    if not math.isfinite(loss):
        return f"the training loss is {loss}"
    if not math.isfinite(grad_norm):
        return f"the gradient norm is {grad_norm}"
    after = grad_norm * min(1.0, grad_clip / (grad_norm + 1e-6)) if grad_clip > 0 else grad_norm
    if after > optimizer.max_grad_norm:
        return (f"the gradient norm {grad_norm:.3g} is too large for AdamW in this dtype (its square "
                "overflows); turn on --grad-clip")
    return None


def count_targets(targets) -> int:
    """Targets that count in a loss: those that are not the ignore index ``-100``."""
    return int((targets != IGNORE_INDEX).sum())


def _no_target_counts(k: int) -> TrainingError:
    return TrainingError(f"every target of the step's {k} micro-batch(es) is the ignore index {IGNORE_INDEX}, "
                         "so there is no loss to train on (an update would only apply momentum and weight "
                         f"decay); leave out the windows whose targets are all {IGNORE_INDEX}")


def _counted_on_device(batches, flags):
    """The step's count of targets that count: a Python int when every micro-batch's targets are
    NumPy arrays (counted on the host, nothing to wait for), else a 0-d int64 tensor on their
    device, with a flag in ``flags`` for a count of 0 (its host check raises
    :func:`_no_target_counts`' error)."""
    if all(isinstance(b[1], np.ndarray) for b in batches):
        return sum(count_targets(b[1]) for b in batches)
    import torch

    device = next(b[1].device for b in batches if is_torch_array(b[1]))
    n = sum((torch.as_tensor(np.asarray(y) != IGNORE_INDEX, device=device) if isinstance(y, np.ndarray)
             else y != IGNORE_INDEX).sum() for _, y, *_ in batches)
    flags.add(n == 0, lambda: _refuse_empty(batches))
    return n


def _refuse_empty(batches) -> None:
    if sum(count_targets(b[1]) for b in batches) == 0:
        raise _no_target_counts(len(batches))


def _on_device(model, groups) -> bool:
    """Whether ``model``'s chain runs on torch tensors (a GPU, or the reference layers on the
    CPU): its step then reads the device once (module docstring). A torch model on the CPU with
    the fast kernels computes on NumPy views and reads nothing from a device."""
    return is_torch_array(groups[0].grads) and not getattr(model, "numpy_chain", False)


def _read_step(total, groups, flags) -> tuple[float, list[float], list]:
    """The step's one read from the device: its summed loss (float64 on the device), each
    gradient buffer's ``Σ g²`` (:func:`~pedestrian.training.optim.squared_sums`) and whether any
    check's flag is set, as one float64 tensor brought to the host. A set flag raises the first
    failing check's error (:meth:`~pedestrian.model.device_checks.DeviceFlags.raise_first`).

    Returns:
        ``(loss, sums, on_device)``: the loss and the sums of squares as Python floats, and the
        sums as the 0-d tensors they are on the device (for :func:`_device_clip_scale`).
    """
    import torch

    sums = squared_sums([g.grads for g in groups])
    bad = flags.any()
    parts = [total, *sums] + ([] if bad is None else [bad])
    values = torch.stack([torch.as_tensor(v, device=sums[0].device).to(torch.float64) for v in parts]).tolist()
    if bad is not None and values[-1]:
        flags.raise_first()
    return values[0], values[1:1 + len(sums)], sums


def _device_clip_scale(optimizer: AdamW, groups, sums, device_sums, grad_clip: float):
    """The clipping scale as a 0-d tensor on the device (:func:`~pedestrian.training.optim.clip_scale`),
    for the AdamW kernel to apply as it reads the gradient -- no pass over the gradient, nothing
    read -- or ``None`` where :func:`~pedestrian.training.optim.clip_grad_norm` clips instead: no
    kernel (:meth:`AdamW.kernel_pass <pedestrian.training.optim.AdamW.kernel_pass>`), or a sum of
    squares that overflowed or is subnormal (the norm then comes from the overflow-safe pass)."""
    if device_sums is None or not optimizer.kernel_pass():
        return None
    for s, g in zip(sums, groups):
        tiny = float(np.finfo(np.float64 if "64" in str(g.grads.dtype) else np.float32).tiny)
        if not math.isfinite(s) or 0.0 < s < tiny * 2.0 ** 24:
            return None
    return clip_scale(device_sums, grad_clip)


#: one process, for the functions below when no group is given
_ONE = SingleProcess()


def train_step(model, optimizer: AdamW, batches, lr: float, grad_clip: float = 0.0,
               accum_buffers: list | None = None, group=None, dropout_key: tuple | None = None
               ) -> tuple[float, float]:
    """One optimizer update from ``k = len(batches)`` micro-batches (module docstring).

    Args:
        model: a :class:`~pedestrian.model.GPT` in training mode (or not: dropout follows ``model.training``).
        optimizer: an :class:`~pedestrian.training.optim.AdamW` over the model's flat buffers.
        batches: list of ``(x, y)`` int arrays ``(B_i, T_i)`` (or ``(x, y, segments)``: packed rows,
            ``GPT.loss(..., segments=)``), the *global* micro-batches (every
            rank passes the same ones and computes its rows, ``group.rows(B_i)``); targets may
            be ``-100`` (ignored) anywhere: the update is that of one batch made of them all
            (module docstring).
        lr: learning rate of this update.
        grad_clip: global-norm threshold (``0`` = no clipping).
        accum_buffers: optional preallocated arrays shaped like each group's gradients (saves
            an allocation per step when ``k > 1``).
        group: the process group (:mod:`pedestrian.training.distributed`); ``None``: one process.
        dropout_key: ``(seed, step)``: micro-batch ``i`` draws its dropout masks from a
            :class:`~pedestrian.training.distributed.RowKeyedRNG` keyed ``(seed, step, i)`` (``None``:
            from the model's own ``dropout_rng``).

    Returns:
        ``(loss, grad_norm)``: the mean loss over every counted target of the step's
        micro-batches (nats per token) and the global gradient norm of that mean before
        clipping, the same on every rank. When :func:`skip_reason` gives a reason for them no
        update was made: parameters, moments and ``optimizer.step_count`` are unchanged.

    Raises:
        ValueError: no micro-batch.
        TrainingError: every target of every micro-batch is ``-100`` (nothing to train on;
            raised before any forward, on every rank alike, and nothing is changed; for targets
            given as tensors on a device, at the step's read, before any update).
        ValueError, TypeError: bad token or target ids (:meth:`GPT.forward
            <pedestrian.model.GPT.forward>`); on a device, a bad id's at the step's read, before
            any update.
        CommunicationError: another rank failed (:mod:`pedestrian.training.distributed`).
    """
    group = _ONE if group is None else group
    groups: list[ParamGroup] = optimizer.groups
    k = len(batches)
    if k < 1:
        raise ValueError("train_step needs at least one micro-batch")
    if k > 1 and accum_buffers is None:
        accum_buffers = [empty_like(g.grads) for g in groups]
    on_device = _on_device(model, groups)
    with deferred_checks() if on_device else contextlib.nullcontext() as flags:
        if on_device:                                          # a tensor: its 0 is a flag
            n_total = _counted_on_device(batches, flags)
        else:
            n_total = sum(count_targets(b[1]) for b in batches)      # global: every rank sees every row
        if isinstance(n_total, int) and n_total == 0:
            raise _no_target_counts(k)
        total = 0.0
        for i, (x, y, *segments) in enumerate(batches):
            rows = group.rows(x.shape[0])
            packed = {"segments": segments[0][rows]} if segments else {}     # packed rows (x, y, segments)
            if dropout_key is not None:
                model.dropout_rng = RowKeyedRNG((*dropout_key, i), first_row=rows.start)
            if on_device:           # its share of the step's mean, unread; summed in float64 as Python sums
                total = total + model.loss(x[rows], y[rows], n_total=n_total, read=False, **packed).double()
            else:
                total += model.loss(x[rows], y[rows], n_total=n_total, **packed)     # its share of the step's mean
            model.backward()
            if k == 1:
                break
            for g, acc in zip(groups, accum_buffers):
                if i == 0:
                    _copy_into(acc, g.grads)
                elif i < k - 1:
                    _add_into(acc, g.grads)
                else:                                   # last one: g ← g + Σ previous
                    _add_into(g.grads, acc)
        group.sum_buffers([g.grads for g in groups], "the gradients")
        sums = device_sums = None
        if on_device:                                  # the step's one read (module docstring)
            total, sums, device_sums = _read_step(total, groups, flags)
    loss = group.sum([total], "the loss")[0]
    norm = global_grad_norm([g.grads for g in groups], sums=sums)
    if skip_reason(loss, norm, grad_clip, optimizer) is not None:
        return loss, norm
    after, scale = norm, None
    if grad_clip > 0:
        after = norm * min(1.0, grad_clip / (norm + 1e-6))
        scale = _device_clip_scale(optimizer, groups, sums, device_sums, grad_clip)   # the kernel clips, or
        if scale is None:
            clip_grad_norm(groups, grad_clip, norm=norm)                              # a pass over g does
    optimizer.step(lr, grad_norm=after, grad_scale=scale)
    return loss, norm


def estimate_loss(model, batches, group=None) -> float:
    """Mean loss over every counted target of fixed global ``(x, y)`` batches (the loss of their
    concatenation, as a training step's), with dropout off (``model.training`` restored); with a
    process group each rank computes its rows and the sums are exchanged once.

    Raises:
        TrainingError: every target of every batch is ``-100`` (no loss to measure).
        CommunicationError: another rank failed.
    """
    group = _ONE if group is None else group
    n_total = sum(count_targets(b[1]) for b in batches)
    if n_total == 0:
        raise TrainingError(f"every target of the {len(batches)} validation batch(es) is the ignore index "
                            f"{IGNORE_INDEX}, so there is no validation loss; give validation windows with "
                            "targets that count")
    with eval_mode(model):
        parts = []
        for x, y, *segments in batches:
            rows = group.rows(x.shape[0])
            packed = {"segments": segments[0][rows]} if segments else {}     # packed rows (x, y, segments)
            loss = model.loss(x[rows], y[rows], n_total=n_total, keep_activations=False, **packed)    # its share
            parts.append(getattr(model, "loss_parts", {}).get("ce", loss))          # (a mixture of experts: without the aux loss)
    return float(sum(group.sum(parts, "the validation loss")))


def state_is_finite(optimizer: AdamW) -> bool:
    """Whether every trained parameter and every AdamW moment is finite (one overflow-safe
    pass over each buffer; the weights are finite iff their norm is)."""
    buffers = [g.params for g in optimizer.groups] + list(optimizer.m) + list(optimizer.v)
    return math.isfinite(global_grad_norm(buffers))


def non_finite_tensors(model, optimizer: AdamW) -> str:
    """``"ln_final.bias (1 NaN, 0 inf of 8 values), ..."``: the parameters and AdamW moments
    that hold a NaN or an infinity (the first five; for messages, after
    :func:`state_is_finite` said no)."""
    tensors = dict(model.params) if model is not None else {g.name: g.params for g in optimizer.groups}
    for g, m, v in zip(optimizer.groups, optimizer.m, optimizer.v):
        tensors.update({f"optimizer {g.name}.m": m, f"optimizer {g.name}.v": v})
    return non_finite_report(non_finite_counts(tensors), tensors)


"""What a forward keeps when :attr:`GPT.recompute <pedestrian.model.gpt.GPT.recompute>` trades
arithmetic for memory (``--recompute``, ``--recompute-blocks N``; docs/guide.md, "Training").

- The first ``n`` blocks (every block for ``True``) keep only their input ``x`` and where their
  dropout draws start; the backward runs each of them again just before its backward.
- The other blocks keep only what their backward reads: ``a4``, ``a5``, ``a9``, ``a10`` are let go
  (the skips' backward reads nothing, the norms keep their own ``x̂``), and ``a8`` is made again
  from ``a7`` in the backward (elementwise, the same kernel: the same bits).
- A loss computed by :meth:`GPT.loss` (whose logits nobody outside the model holds) gets its
  ``Δ12`` written over the logits (fast kernels): one ``(B, T, V)`` array less; and its backward
  lets go of each block's arrays as soon as that block's backward has read them, so the blocks
  recomputed later (the first ones) take their arrays from the pool instead of new memory.

None of this changes a number: losses, gradients and ``Δ``s are the bits of ``recompute = False``
(tests/system/test_recompute.py). What is let go cannot be inspected: :meth:`GPT.activations`
refuses such a forward.
"""

from __future__ import annotations

import numbers

__all__ = ["recomputed_blocks", "keep_only_what_backward_reads", "loss_delta", "take_block"]


def recomputed_blocks(setting, n_blocks: int) -> int:
    """How many blocks (the first ones) a forward recomputes: ``True`` all ``n_blocks``,
    ``False`` none, an integer ``0 … n_blocks`` that many.

    Raises:
        ValueError: anything else (a negative number, more blocks than the model has).
    """
    if isinstance(setting, bool):
        return n_blocks if setting else 0
    if isinstance(setting, numbers.Integral) and 0 <= setting <= n_blocks:      # (NumPy's integers too)
        return int(setting)
    raise ValueError(f"model.recompute = {setting!r}: give True (every block), False, or a number of "
                     f"blocks from 0 to {n_blocks} (the first ones are recomputed)")


def keep_only_what_backward_reads(b):
    """Let go of a kept block's ``a4``, ``a5``, ``a9``, ``a10`` and ``a8`` (made again by the MLP's
    backward, :class:`~pedestrian.model.slots.BuiltinMLP`); returns ``b``."""
    b.a4 = b.a5 = b.a9 = b.a10 = None
    if hasattr(b, "a8"):                                   # (a plugged whole MLP has none)
        b.a8 = None
    return b


def loss_delta(kernels, f):
    """The cross-entropy's ``Δ12`` of the forward record ``f``, written over its logits when ``f``
    recomputes and came from :meth:`GPT.loss` (nobody else holds those logits); ``f.a12`` is
    then ``None``, so that a second backward is refused instead of reading ``Δ12`` as logits."""
    over = _spent_by_backward(f)
    delta = kernels.cross_entropy_backward(f.loss, over_logits=over)
    f.a12 = None if over else f.a12
    return delta


def take_block(f, i: int):
    """Block ``i``'s record in the forward record ``f`` for its backward; the record lets go of it
    when ``f`` recomputes and came from :meth:`GPT.loss` (whose second backward is refused)."""
    b = f.blocks[i]
    if _spent_by_backward(f):                              # (f.a12, f.head None: a second backward is
        f.blocks[i] = f.a12 = f.head = None                # refused, also after a backward(delta_logits=))
    return b


def _spent_by_backward(f) -> bool:
    """Whether the backward of ``f`` may write over what it reads and let it go: ``f`` recomputes
    and came from :meth:`GPT.loss`, so nobody outside the model holds its logits."""
    return bool(f.recomputed) and not getattr(f, "logits_held", True)

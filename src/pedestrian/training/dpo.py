"""Direct preference optimisation (Rafailov et al., 2023) with its gradient derived by hand
(docs/EQUATIONS.md, "DPO"; TRL's ``DPOTrainer`` with its default ``loss_type="sigmoid"``).

For a prompt and two answers, chosen ``c`` and rejected ``r``, the sequence log-probabilities
``ℓ(a) = Σ_{answer tokens t} log p(a_t | a_<t)`` under the policy (the model with its LoRA
adapters) and ``ℓ_ref(a)`` under the frozen reference (the same model with its adapters off:
:meth:`GPT.without_adapters <pedestrian.model.params.Parameters.without_adapters>`, no second copy of
the weights) give, for each of the ``n`` pairs of a step::

    m = β [(ℓ(c) − ℓ_ref(c)) − (ℓ(r) − ℓ_ref(r))]        L = (1/n) Σ_pairs −log σ(m)
    ∂L/∂m = −σ(−m) / n        ∂L/∂ℓ(c) = −β σ(−m) / n        ∂L/∂ℓ(r) = +β σ(−m) / n

and, through ``∂ℓ(a)/∂z_t = onehot(a_t) − p_t`` on each answer token's logits (prompt and padding
tokens: 0), ``Δ12_t = ∓ β σ(−m) (onehot(a_t) − p_t) / n`` (− chosen, + rejected), which the
fused head turns into ``Δ11`` without keeping the logits (:func:`pedestrian.model.head.sequence_logprobs`).

A batch holds ``P`` pairs as ``2P`` rows, the chosen answers first, then the rejected ones in the
same order: ``tokens`` ``(2P, T)``, ``targets`` ``(2P, T)`` with ``-100`` on the prompt and the
padding (:func:`pedestrian.training.preference.pair_batch`). Logged per step: the loss, the
rewards' margin ``mean(m)`` (TRL's ``rewards/margins``; the rewards are ``β (ℓ − ℓ_ref)``) and the
accuracy ``mean(m > 0)`` (``rewards/accuracies``).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np

from ..backend import array_namespace, to_numpy
from ..model import eval_mode
from ..model.head import sequence_logprobs, weigh_sequences
from .distributed import RowKeyedRNG
from .optim import AdamW, clip_grad_norm, global_grad_norm
from .step import TrainingError, empty_like, skip_reason

__all__ = ["DPOLoss", "dpo_loss", "dpo_step", "estimate_dpo_loss", "reference_logprobs"]


class DPOLoss(NamedTuple):
    """:func:`dpo_loss`'s result (arrays of the inputs' namespace; ``P`` pairs).

    Attributes:
        loss: 0-d ``Σ_pairs −log σ(m) / n_pairs``.
        dlogp: ``(2P,)`` ``∂L/∂ℓ`` of the policy's log-probabilities (chosen rows, then rejected).
        margins: ``(P,)`` ``m = β[(ℓ(c) − ℓ_ref(c)) − (ℓ(r) − ℓ_ref(r))]``, the rewards' margins.
        chosen_rewards, rejected_rewards: ``(P,)`` ``β (ℓ − ℓ_ref)`` of each answer.
    """

    loss: object
    dlogp: object
    margins: object
    chosen_rewards: object
    rejected_rewards: object


def dpo_loss(logp, ref_logp, beta: float, n_pairs: int | None = None) -> DPOLoss:
    """DPO's sigmoid loss of ``P`` pairs and its gradient with respect to the policy's ``ℓ``.

    Args:
        logp: ``(2P,)`` the policy's ``ℓ``: the ``P`` chosen answers, then the ``P`` rejected ones.
        ref_logp: ``(2P,)`` the reference's ``ℓ_ref``, in the same order.
        beta: DPO's ``β`` (> 0).
        n_pairs: divide by this many pairs instead of ``P`` (one micro-batch of a larger step:
            the micro-batches' losses and gradients then add up to the step's mean).

    Returns:
        a :class:`DPOLoss`. ``−log σ(m) = log(1 + e^{−m})`` and ``σ(−m) = e^{−log(1 + e^{m})}``
        are computed with ``logaddexp`` (finite for any finite ``m``).

    Raises:
        ValueError: shapes that are not ``(2P,)`` alike, ``β <= 0``.
    """
    xp = array_namespace(logp)
    if logp.ndim != 1 or logp.shape[0] % 2 or tuple(ref_logp.shape) != tuple(logp.shape):
        raise ValueError(f"logp and ref_logp must both be (2P,) (the chosen answers, then the rejected ones), "
                         f"got {tuple(logp.shape)} and {tuple(ref_logp.shape)}")
    if not beta > 0:
        raise ValueError(f"beta must be positive, got {beta}")
    P = logp.shape[0] // 2
    n = P if n_pairs is None else n_pairs
    rewards = beta * (logp - xp.astype(ref_logp, logp.dtype))                  # (2P,) β (ℓ − ℓ_ref)
    chosen, rejected = rewards[:P], rewards[P:]                               # (P,), (P,)
    m = chosen - rejected                                                     # (P,) margins
    zero = xp.zeros_like(m)
    with np.errstate(invalid="ignore"):                                       # (a NaN ℓ: a NaN loss, skipped
        loss = xp.sum(xp.logaddexp(zero, -m)) / n                             # by the step; no warning)
        dm = -xp.exp(-xp.logaddexp(zero, m)) / n                              # ∂L/∂m = −σ(−m) / n
    dlogp = xp.concat([beta * dm, -beta * dm])                                # ∂m/∂ℓ(c) = β, ∂m/∂ℓ(r) = −β
    return DPOLoss(loss, dlogp, m, chosen, rejected)


def reference_logprobs(model, tokens, targets, reference=None):
    """``ℓ_ref`` ``(2P,)`` of a batch: ``reference``'s (a model, evaluated) or, by default, the
    policy's own with its adapters off and dropout off (no backward; nothing kept).

    Raises:
        TrainingError: no ``reference`` and a model without LoRA adapters (it would be the policy itself).
    """
    if reference is not None:
        with eval_mode(reference):
            return sequence_logprobs(reference, tokens, targets, keep_activations=False)
    if not model.lora_targets:
        raise TrainingError("DPO's reference is the base without the LoRA adapters, and this model has none; "
                            "add adapters (pedestrian finetune does) or give a separate reference model")
    with model.without_adapters(), model.inference():
        return sequence_logprobs(model, tokens, targets, keep_activations=False)


def _pairs(x) -> int:
    if x.shape[0] % 2:
        raise ValueError(f"a DPO batch holds 2P rows (P chosen answers, then their P rejected ones), got {x.shape[0]}")
    return x.shape[0] // 2


def dpo_step(model, optimizer: AdamW, batches, lr: float, grad_clip: float = 0.0, accum_buffers=None,
             group=None, dropout_key=None, *, beta: float = 0.1, reference=None):
    """One optimizer update of DPO over ``k = len(batches)`` micro-batches of pairs, with the
    rule of :func:`pedestrian.training.step.train_step` (accumulation: each micro-batch divides by
    the step's pairs; clipping; a non-finite loss or gradient norm skips the update).

    Args:
        model, optimizer, lr, grad_clip, accum_buffers, dropout_key: as ``train_step``'s.
        batches: ``[(tokens, targets), ...]``, each ``(2P_i, T_i)`` (module docstring).
        group: one process only (``None``).
        beta: DPO's ``β``; reference: as :func:`reference_logprobs`.

    Returns:
        ``(loss, grad_norm, metrics)``: the mean loss over the step's pairs, the gradient norm
        before clipping, and ``{"margin": mean m, "accuracy": mean(m > 0)}`` over its pairs.

    Raises:
        ValueError: no micro-batch, an odd number of rows, several processes.
        TrainingError: a model without adapters and no ``reference``.
    """
    if group is not None and getattr(group, "world_size", 1) != 1:
        raise ValueError("DPO runs in one process")
    groups = optimizer.groups
    k = len(batches)
    if k < 1:
        raise ValueError("dpo_step needs at least one micro-batch")
    if k > 1 and accum_buffers is None:
        accum_buffers = [empty_like(g.grads) for g in groups]
    n_pairs = sum(_pairs(x) for x, _ in batches)
    loss, margins = 0.0, []
    for i, (x, y) in enumerate(batches):
        ref = reference_logprobs(model, x, y, reference)                        # (2P,) no backward
        if dropout_key is not None:
            model.dropout_rng = RowKeyedRNG((*dropout_key, i), first_row=0)
        out = dpo_loss(sequence_logprobs(model, x, y), ref, beta, n_pairs)     # policy: kept for the backward
        weigh_sequences(model, out.dlogp)
        model.backward()
        loss += float(out.loss)
        margins.append(to_numpy(out.margins).astype(np.float64))
        if k == 1:
            break
        for g, acc in zip(groups, accum_buffers):        # (the backward writes the gradients: sum aside)
            if i == 0:
                acc[...] = g.grads
            elif i < k - 1:
                acc += g.grads
            else:
                g.grads[...] += acc
    m = np.concatenate(margins)
    metrics = {"margin": float(m.mean()), "accuracy": float((m > 0).mean())}
    norm = global_grad_norm([g.grads for g in groups])
    if skip_reason(loss, norm, grad_clip, optimizer) is not None:
        return loss, norm, metrics
    after = norm
    if grad_clip > 0:
        after = norm * min(1.0, grad_clip / (norm + 1e-6))
        clip_grad_norm(groups, grad_clip, norm=norm)
    optimizer.step(lr, grad_norm=after)
    return loss, norm, metrics


def estimate_dpo_loss(model, batches, group=None, *, beta: float = 0.1, reference=None) -> float:
    """Mean DPO loss over the pairs of fixed ``batches`` with dropout off (no update)."""
    n_pairs = sum(_pairs(x) for x, _ in batches)
    total = 0.0
    with eval_mode(model):
        for x, y in batches:
            ref = reference_logprobs(model, x, y, reference)
            total += float(dpo_loss(sequence_logprobs(model, x, y, keep_activations=False), ref, beta, n_pairs).loss)
    return total



# ---------------------------------------------------------------------------- pedestrian finetune --dpo
def read_preference_data(settings, tokenizer, window: int):
    """The :class:`~pedestrian.training.loop.Batches` of ``finetune --dpo``: the pairs of
    ``settings.dpo`` (:func:`pedestrian.training.preference.read_pairs`), the last
    ``val_fraction`` of them (at least one) held out for validation, ``grad_accum`` micro-batches
    of ``batch_size`` pairs drawn at random (with the generator seeded by ``seed``) a step, and
    up to ``eval_batches`` fixed validation batches; with the pairs' SHA-256 and a line for the log.

    Raises:
        FileNotFoundError, ValueError: as :func:`~pedestrian.training.preference.read_pairs`;
            fewer than 2 pairs (one is held out for validation).
    """
    from .loop import Batches
    from .preference import pair_batch, pairs_fingerprint, read_pairs

    eos_text, pad_id = folder_eos(settings.hf_dir, tokenizer)
    read = read_pairs(settings.dpo, tokenizer, window, eos_token=eos_text,
                      render=chat_renderer(settings.hf_dir, tokenizer))
    pairs = read.pairs
    if len(pairs) < 2:
        raise ValueError(f"{settings.dpo} holds {len(pairs)} pair(s) to train on; DPO needs at least 2 (the last "
                         f"--val-fraction {settings.val_fraction:g} of them, at least one, is held out for validation)")
    n_val = min(len(pairs) - 1, max(1, round(len(pairs) * settings.val_fraction)))
    train, val = pairs[:len(pairs) - n_val], pairs[len(pairs) - n_val:]
    B, k = settings.batch_size, settings.grad_accum
    rng = np.random.default_rng(settings.seed)
    validation = [pair_batch(val[i:i + B], window, pad_id) for i in range(0, len(val), B)][:settings.eval_batches]
    tokens_per_step = B * k * 2 * int(np.mean([len(p.prompt) + (len(p.chosen) + len(p.rejected)) / 2
                                               for p in train]))

    def draw():
        return [pair_batch([train[i] for i in rng.integers(0, len(train), B)], window, pad_id) for _ in range(k)]

    batches = Batches(draw, tokens_per_step=tokens_per_step, validation=validation,
                      eval_interval=settings.eval_interval, dropout_seed=settings.seed, rng=rng)
    dropped = f", {read.dropped} left out (their prompt fills the window)" if read.dropped else ""
    line = (f"preference pairs: {settings.dpo} ({read.form}): {len(train):,} training / {len(val):,} validation"
            f"{dropped}; beta {settings.dpo_beta:g}")
    return batches, pairs_fingerprint(pairs), line


def dpo_training(trainer, beta: float) -> None:
    """Make ``trainer`` (built on :func:`read_preference_data`'s batches) take DPO steps and
    validate with the DPO loss, the reference being its model without the adapters."""
    trainer.optimization.step = lambda *args: dpo_step(*args, beta=beta)
    trainer.data.estimate = lambda model, batches, group: estimate_dpo_loss(model, batches, group, beta=beta)


def folder_eos(hf_dir, tokenizer) -> tuple[str | None, int]:
    """``(text, id)`` of a Hugging Face folder's end-of-sequence token, as TRL takes it: the
    ``eos_token`` of ``tokenizer_config.json``, else ``config.json``'s ``eos_token_id`` (the
    first of a list), else the tokenizer's end-of-text token; ``(None, 0)`` without one (the
    answers then get no end token; padding uses id 0, never a counted target)."""
    import json
    from pathlib import Path

    from ..text.bpe_tokenizer import EOS_TOKENS

    d = Path(hf_dir).expanduser()
    vocab = tokenizer.hf.get_vocab() if hasattr(tokenizer, "hf") else {}
    text = None
    with contextlib.suppress(OSError, ValueError):
        text = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8")).get("eos_token")
    text = text.get("content") if isinstance(text, dict) else text
    if isinstance(text, str) and text in vocab:
        return text, vocab[text]
    eos_id = None
    with contextlib.suppress(OSError, ValueError):
        eos_id = json.loads((d / "config.json").read_text(encoding="utf-8")).get("eos_token_id")
    eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
    if not isinstance(eos_id, int):
        special = getattr(tokenizer, "special_tokens", {})
        eos_id = next((special[t] for t in EOS_TOKENS if t in special), None)
    if eos_id is None or not hasattr(tokenizer, "hf"):
        return None, 0
    return tokenizer.hf.id_to_token(eos_id), eos_id


def chat_renderer(hf_dir, tokenizer):
    """``render(messages, add_generation_prompt) -> ids`` with the folder's chat template
    (:func:`pedestrian.text.chat.render`: transformers' ``apply_chat_template``), or ``None`` when
    the folder has no template (records of messages are then refused by line)."""
    from ..interop.hf_chat import chat_template, folder_chat_template
    from ..text.chat import render

    if chat_template(hf_dir) is None:
        return None
    template = folder_chat_template(hf_dir)
    return lambda messages, add_generation_prompt: list(
        render(messages, tokenizer, template, add_generation_prompt=add_generation_prompt)[0])

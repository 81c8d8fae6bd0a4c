"""``pedestrian finetune --resume``: what a resumed run takes from its record and from the command
line, and the checks that it continues the very run it names (settings; the base weights,
:func:`pedestrian.load.adapters_on_base`; the text is checked by
:func:`pedestrian.training.finetune.finetune` once tokenized)."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import read_state
from ..load import HFFolder, adapter_checkpoint_dir, adapters_on_base, check_base
from .settings import absolute_path, resume_settings
from .specs import specs

__all__ = ["is_train_run", "resumed"]


def _same(name: str, a, b) -> bool:
    """Whether two values of setting ``name`` mean the same (layer kinds by either name, in any order)."""
    if name == "lora_targets":
        from ..model.layout import HF_LORA_KINDS

        return sorted(HF_LORA_KINDS.get(t, t) for t in a) == sorted(HF_LORA_KINDS.get(t, t) for t in b)
    if name == "dpo" and None not in (a, b):                     # (recorded as an absolute path)
        return absolute_path(a) == absolute_path(b)
    return a == b


def is_train_run(out: Path) -> bool:
    """Whether ``out`` holds a ``pedestrian train`` run (its ``latest/`` checkpoint)."""
    return (out / "latest" / "state.json").is_file()


def resumed(settings, out: Path, given: frozenset):
    """The settings to go on with (:func:`~pedestrian.training.settings.resume_settings`: the run's
    recorded ones, with those of ``settings``, a :class:`~pedestrian.training.finetune.FinetuneSettings`,
    that may change) and
    the adapter checkpoint in ``out/adapter``, loaded onto its base (the same weights: SHA-256). Raises ``ValueError`` naming what does not match or cannot be
    resumed. Returns ``(settings, checkpoint, tokenizer, base fingerprint)``."""
    if settings.overwrite:
        raise ValueError("--resume continues the run in --out and --overwrite replaces it: pass one of them")
    if not out.is_dir():
        raise ValueError(f"--resume: {out} does not exist; start the run without --resume")
    folder = adapter_checkpoint_dir(out)
    if folder is None:
        raise ValueError(f"--resume: {out} holds no adapter checkpoint (adapter/state.json) to continue"
                         + ("; it holds a `pedestrian train` run: choose another --out" if is_train_run(out)
                            else "; start the run without --resume"))
    folder, state = read_state(folder)
    meta = state.get("meta") or {}
    if meta.get("finetune") is None or meta.get("data_rng") is None:
        raise ValueError(f"{folder} does not record its settings and batch order (written by an older pedestrian), "
                         "so it cannot be resumed exactly; start again with --overwrite")
    names = specs(settings)
    saved = type(settings)(**{k: v for k, v in meta["finetune"].items() if k in names})
    saved = resume_settings(settings, saved, given, run=f"{out} was fine-tuned", same=_same)
    saved.data = settings.data and absolute_path(settings.data)  # (recorded so; the same text: checked later)
    saved.dpo = settings.dpo and absolute_path(settings.dpo)
    saved.validate()
    base, fix = HFFolder(saved.hf_dir), "pass the base they were trained on with --hf-dir"
    check_base(folder, state, base, fix)                          # (first: the wrong base is the problem)
    if int(state.get("step", 0)) >= saved.max_steps:
        raise ValueError(f"the run in {out} is at step {state.get('step')}, which already reaches --max-steps "
                         f"{saved.max_steps}; pass a larger --max-steps to fine-tune on")
    ckpt, tokenizer = adapters_on_base(folder, state, base, dtype=saved.dtype, backend=saved.backend, fix=fix)
    return saved, ckpt, tokenizer, base.fingerprint()

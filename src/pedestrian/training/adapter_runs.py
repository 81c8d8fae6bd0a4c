"""A fine-tuning run's record: where its adapter checkpoint is, the fingerprint of the base it was
trained on, and ``pedestrian finetune --resume`` -- what a resumed run takes from its record and
from the command line, and the checks that it continues the very run it names (settings, base
weights; the text is checked by :func:`pedestrian.training.finetune.finetune` once tokenized)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..checkpoint import read_state
from .corpus import absolute_path
from .specs import flag as flag_name
from .specs import specs

__all__ = ["RESUMABLE", "adapter_checkpoint_dir", "base_fingerprint", "is_train_run", "resumed"]


def base_fingerprint(hf_dir) -> dict:
    """``{"hf_dir", "weights", "sha256"}`` of a base model directory: which weight file holds
    its tensors (see :func:`pedestrian.interop.hf.open_hf_weights`) and that file's SHA-256, so
    an adapter can later be matched against the very weights it was trained on."""
    from ..interop.hf import open_hf_weights

    source = Path(open_hf_weights(hf_dir).source)
    h = hashlib.sha256()
    with open(source, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return {"hf_dir": str(Path(hf_dir).expanduser().resolve()), "weights": source.name,
            "sha256": h.hexdigest()}


def adapter_checkpoint_dir(path) -> Path | None:
    """The adapter-only checkpoint ``path`` stands for, or ``None`` if it is not one.

    Accepts a ``pedestrian finetune`` run folder (its ``adapter/``), the adapter checkpoint
    folder itself, or one of its files. Never raises for a path that is something else
    (a full checkpoint, a train run folder, nothing at all): it returns ``None`` then.
    """
    p = Path(path).expanduser()
    if p.is_file():
        p = p.parent
    for candidate in (p, p / "adapter"):
        if (candidate / "state.json").is_file():
            try:
                folder, state = read_state(candidate)
            except (OSError, ValueError):
                return None
            return folder if state.get("params") == "lora" else None
    return None


#: what ``--resume`` takes from the command line rather than from the run's record
RESUMABLE = frozenset({"max_steps", "eval_interval", "max_skipped_steps", "progress", "plot", "backend",
                       "resume", "out", "recompute", "recompute_blocks"})   # (the same numbers)


def _same(name: str, a, b) -> bool:
    """Whether two values of setting ``name`` mean the same (layer kinds by either name, in any order)."""
    if name == "lora_targets":
        from ..model.layout import HF_LORA_KINDS

        return sorted(HF_LORA_KINDS.get(t, t) for t in a) == sorted(HF_LORA_KINDS.get(t, t) for t in b)
    return a == b


def is_train_run(out: Path) -> bool:
    """Whether ``out`` holds a ``pedestrian train`` run (its ``latest/`` checkpoint)."""
    return (out / "latest" / "state.json").is_file()


def _shown(value) -> str:
    """A setting's value as a command line would give it (a list as its words)."""
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else repr(value)


def resumed(settings, out: Path, given: frozenset):
    """The settings to go on with (the run's recorded ones, with the :data:`RESUMABLE` ones of
    ``given`` taken from ``settings``, a :class:`~pedestrian.training.finetune.FinetuneSettings`) and
    the adapter checkpoint in ``out/adapter``, loaded onto its base (the same weights: SHA-256). Raises ``ValueError`` naming what does not match or cannot be
    resumed. Returns ``(settings, checkpoint, tokenizer, base fingerprint)``."""
    from ..checkpoint import load_checkpoint
    from ..interop.hf import load_pretrained

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
    conflicts = [f"{flag_name(k)} {_shown(getattr(saved, k))} (you gave {_shown(getattr(settings, k))})"
                 for k in sorted(given - RESUMABLE - {"hf_dir", "data"})
                 if not _same(k, getattr(settings, k), getattr(saved, k))]
    if absolute_path(settings.data) != absolute_path(saved.data):
        conflicts.append(f"--data {saved.data!r} (you gave {settings.data!r})")
    if conflicts:
        raise ValueError(f"the run in {out} was fine-tuned with " + "; ".join(conflicts)
                         + ". Resume with the run's own settings (leave those flags out), or start a new run "
                         "with --out NEW_DIR")
    for name in RESUMABLE & given:
        setattr(saved, name, getattr(settings, name))
    saved.hf_dir, saved.data, saved.resume = settings.hf_dir, absolute_path(settings.data), True   # (the base
    #                                                                  may have moved: checked below)
    saved.validate()
    recorded, base_now = (state.get("base") or {}).get("sha256"), base_fingerprint(saved.hf_dir)
    if recorded and base_now["sha256"] != recorded:             # (first: the wrong base is the problem)
        raise ValueError(f"the adapters in {folder} were trained on other weights than those in {saved.hf_dir}; "
                         "pass the base they were trained on with --hf-dir")
    if int(state.get("step", 0)) >= saved.max_steps:
        raise ValueError(f"the run in {out} is at step {state.get('step')}, which already reaches --max-steps "
                         f"{saved.max_steps}; pass a larger --max-steps to fine-tune on")
    base, tokenizer = load_pretrained(saved.hf_dir, dtype=saved.dtype, backend=saved.backend)
    ckpt = load_checkpoint(folder, backend=saved.backend, base_model=base)
    return saved, ckpt, ckpt.tokenizer or tokenizer, base_now

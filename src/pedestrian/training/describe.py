"""The model ``pedestrian explain`` and ``pedestrian params`` describe, read from the one source their
flags name -- a checkpoint, a settings file, a Hugging Face folder's config.json, a preset -- without
its weights."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..checkpoint import read_state
from ..config import CONFIG_FIELDS, GPTConfig
from ..load import HFFolder
from .settings import config_from_args

__all__ = ["Described", "described_model"]


@dataclass(frozen=True)
class Described:
    """A model's description without its weights (what ``pedestrian explain`` and ``params``
    print): its config, and where a run recorded them its batch size, dtype, plugged layers and a
    ``pedestrian finetune`` run's settings."""

    config: GPTConfig
    batch_size: int | None = None
    dtype: str = "float32"
    layers: list | None = None
    finetune: dict = dataclasses.field(default_factory=dict)


def described_model(args, default: str = "train") -> Described:
    """The model the one source among ``args`` names: ``checkpoint`` (a checkpoint or run folder),
    ``config`` (a ``pedestrian train`` settings file), ``hf_dir`` (a Hugging Face folder's
    config.json), ``preset`` with the model field flags; else ``default``: ``"train"`` (``pedestrian
    train``'s model on the bundled plays, 84 characters) or a preset's name. ``args.dtype`` (if any)
    overrides the recorded dtype. Nothing is allocated.

    Raises:
        ValueError: two sources, or a field flag beside a source that brings its own model.
    """
    named = [n for n in ("checkpoint", "config", "hf_dir", "preset") if getattr(args, n, None)]
    if len(named) > 1:
        raise ValueError("give at most one of --checkpoint, --config, --hf-dir, --preset (got "
                         + ", ".join("--" + n.replace("_", "-") for n in named) + ")")
    dtype = getattr(args, "dtype", None)
    flags = [f for f in CONFIG_FIELDS if getattr(args, f, None) is not None and f != "vocab_size"]
    if named and named[0] != "preset" and flags:
        raise ValueError(f"--{flags[0].replace('_', '-')} changes a preset's model; --checkpoint, --config and "
                         "--hf-dir bring their own (drop the flag, or use --preset)")
    if getattr(args, "hf_dir", None):
        return Described(HFFolder(args.hf_dir).config, dtype=dtype or "float32")
    if getattr(args, "checkpoint", None):
        _, state = read_state(args.checkpoint)
        meta = state.get("meta") or {}
        finetune = meta.get("finetune") or {}                # (a finetune run's settings are there)
        return Described(GPTConfig.from_dict(state["config"]), (meta.get("settings") or finetune).get("batch_size"),
                         dtype or state.get("dtype", "float32"), state.get("layers"), finetune)
    if getattr(args, "config", None):
        from .settings import config_file_model

        config, settings = config_file_model(args.config, args.vocab_size or None)
        return Described(config, settings.batch_size, dtype or settings.dtype)
    if args.preset or args.vocab_size:
        return Described(config_from_args(args), dtype=dtype or "float32")
    if default != "train":
        args.preset = default
        return Described(config_from_args(args), dtype=dtype or "float32")
    from . import DEFAULT_MODEL, TrainSettings

    return Described(config_from_args(args, {**DEFAULT_MODEL, "vocab_size": 84}), TrainSettings().batch_size,
                     dtype or "float32")

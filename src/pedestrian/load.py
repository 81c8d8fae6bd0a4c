"""Model folders, each read once: what ``pedestrian sample``, ``eval``, ``export-hf``, ``finetune``
and the Python API load.

Three kinds of folder hold a model:

- a Hugging Face directory (:class:`~pedestrian.interop.hf.HFFolder`: ``config.json`` read once,
  the family and shapes decided once, the weights' SHA-256 only when a run needs it);
- a ``pedestrian train`` checkpoint or run folder (:func:`pedestrian.checkpoint.load_checkpoint`);
- a ``pedestrian finetune`` run: an adapter-only checkpoint (``RUN/adapter``) on its base, a Hugging
  Face directory recorded in it (the directory and the SHA-256 of its weight file, checked here,
  in :func:`adapters_on_base`, for every reader: sample, eval, export, ``finetune --resume``).

Usage::

    loaded = load_model("runs/ft")                    # base + adapters; or a checkpoint; or hf_dir=
    loaded.model, loaded.tokenizer, loaded.base
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import Checkpoint, load_checkpoint, read_state
from .interop.hf import HFFolder

__all__ = ["HFFolder", "LoadedModel", "load_model", "load_finetuned", "adapters_on_base", "check_base", "adapter_state",
           "adapter_base", "adapter_checkpoint_dir", "base_fingerprint"]


def base_fingerprint(hf_dir) -> dict:
    """``{"hf_dir", "weights", "sha256"}`` of a base model directory (:meth:`HFFolder.fingerprint`)."""
    return HFFolder(hf_dir).fingerprint()


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


def adapter_state(adapter_dir) -> tuple[Path, dict]:
    """``(folder, state.json)`` of an adapter-only checkpoint (``RUN/adapter`` or the run ``RUN``).

    Raises:
        ValueError: a full checkpoint; the errors of :func:`pedestrian.checkpoint.read_state`.
    """
    p = Path(adapter_dir).expanduser()
    if not (p / "state.json").is_file() and (p / "adapter" / "state.json").is_file():
        p = p / "adapter"
    folder, state = read_state(p)
    if state.get("params") != "lora":
        raise ValueError(f"{folder} is a full checkpoint, not an adapter-only one; use --checkpoint "
                         "(pedestrian.checkpoint.load_checkpoint) for it")
    return folder, state


def adapter_base(adapter_dir) -> dict:
    """The base recorded in an adapter-only checkpoint: ``{"config", "hf_dir", "weights",
    "sha256"}`` (whatever was recorded; see :meth:`HFFolder.fingerprint`)."""
    return dict(adapter_state(adapter_dir)[1].get("base") or {})


def check_base(folder: Path, state: dict, base: HFFolder, fix: str = "pass the right base with --hf-dir") -> None:
    """Raise ``ValueError`` (ending with ``fix``) unless the base ``base`` holds the very weights the
    adapters of the checkpoint ``folder`` (its ``state.json``: ``state``) were trained on: the SHA-256
    recorded (a checkpoint without one is not checked; the base's hash is computed once)."""
    recorded = (state.get("base") or {}).get("sha256")
    if recorded:
        now = base.fingerprint()
        if now["sha256"] != recorded:
            raise ValueError(f"the adapters in {folder} were trained on other weights than those in "
                             f"{base.path} ({state['base'].get('weights')} SHA-256 {recorded[:12]}..., "
                             f"found {now['weights']} {now['sha256'][:12]}...); {fix}")


def adapters_on_base(folder: Path, state: dict, base: HFFolder, *, dtype: str, backend: str = "numpy",
                     fix: str = "pass the right base with --hf-dir") -> tuple[Checkpoint, object]:
    """The adapter checkpoint ``folder`` (its ``state.json``: ``state``) loaded onto the base
    ``base``, once :func:`check_base` has found the weights the adapters were trained on. Returns
    ``(checkpoint, tokenizer)``: the checkpoint's model is the base with the adapters attached; the
    tokenizer is the checkpoint's, else the base's.

    Raises:
        ValueError: other weights (the message ends with ``fix``); the errors of
            :meth:`HFFolder.model` and :func:`pedestrian.checkpoint.load_checkpoint`.
    """
    check_base(folder, state, base, fix)
    tokenizer = base.tokenizer()
    ckpt = load_checkpoint(folder, backend=backend, base_model=base.model(dtype=dtype, backend=backend))
    return ckpt, ckpt.tokenizer or tokenizer


def _base_of(folder: Path, state: dict, hf_dir) -> HFFolder:
    """The base directory of an adapter checkpoint: ``hf_dir``, else the one recorded."""
    recorded = (state.get("base") or {}).get("hf_dir")
    base_dir = hf_dir if hf_dir is not None else recorded
    if base_dir is None:
        raise ValueError(f"{folder} does not record its base model directory; pass --hf-dir BASE_DIR")
    if hf_dir is None and not (Path(base_dir) / "config.json").is_file():
        raise FileNotFoundError(f"the base model of the adapters in {folder}, {base_dir}, is gone; "
                                "pass --hf-dir BASE_DIR (the Hugging Face directory they were "
                                "trained on)")
    return HFFolder(base_dir)


def load_finetuned(adapter_dir, hf_dir=None, *, dtype: str | None = None, backend: str = "numpy"):
    """A fine-tuned model: the base model with the adapters of an adapter-only checkpoint.

    Args:
        adapter_dir: the checkpoint (``RUN/adapter``, or the run folder ``RUN``).
        hf_dir: the base directory (default: the one recorded in the checkpoint).
        dtype: default: the checkpoint's.

    Returns:
        ``(model, tokenizer)``, adapters attached (unmerged), the model in inference mode
        (``model.training = False``: no dropout on the adapters, as PEFT's
        ``PeftModel.from_pretrained`` leaves its model); set ``model.training = True`` to train on.

    Raises:
        FileNotFoundError: no checkpoint or no base directory.
        ValueError: not an adapter-only checkpoint, or a base whose weights differ from the
            ones the adapters were trained on (SHA-256 of the weight file) or whose config
            differs.
    """
    loaded = load_model(adapter_dir, hf_dir, dtype=dtype, backend=backend, adapters=True)
    return loaded.model, loaded.tokenizer


@dataclass
class LoadedModel:
    """What :func:`load_model` read: the model, its tokenizer (``None`` if none was saved), the
    checkpoint folder (``None`` for a Hugging Face directory) and its step, the run's recorded
    settings (``pedestrian train``'s, or a fine-tune's), and the base directory of a fine-tune
    (or the Hugging Face directory itself; ``None`` for a full checkpoint), with its
    ``config.json`` as read (``hf_config``; ``None`` for a full checkpoint)."""

    model: object
    tokenizer: object
    path: Path | None = None
    step: int = 0
    settings: dict = dataclasses.field(default_factory=dict)
    base: str | None = None
    hf_config: dict | None = None


def load_model(checkpoint=None, hf_dir=None, *, dtype: str | None = None, backend: str = "numpy",
               adapters: bool | None = None) -> LoadedModel:
    """The model a command samples, evaluates or exports: a ``pedestrian train`` checkpoint (or
    run folder), a ``pedestrian finetune`` run (its base plus the adapters, :func:`adapters_on_base`;
    ``hf_dir`` overrides the recorded base), or a Hugging Face directory ``hf_dir`` alone.

    Args:
        dtype: default: the checkpoint's, float32 for a Hugging Face directory.
        adapters: ``True``: ``checkpoint`` must be a fine-tune's (else the error of
            :func:`adapter_state`); ``None``: whichever it is.

    Raises:
        ValueError: neither source given; ``hf_dir`` with a full checkpoint; the errors of
            :func:`load_finetuned` and :func:`pedestrian.checkpoint.load_checkpoint`.
    """
    if checkpoint is None:
        if hf_dir is None:
            raise ValueError("pass a checkpoint (a train or finetune run: sample's --checkpoint CKPT, eval's CKPT) "
                             "or --hf-dir DIR (a Hugging Face GPT-2, Llama, Qwen2, Qwen3, Mistral, Gemma 2/3, SmolLM3, "
                             "OLMo 2, Mixtral, Qwen3-MoE or OLMoE directory)")
        folder = HFFolder(hf_dir)
        tokenizer = folder.tokenizer()                 # cheap: fail before reading the weights
        return LoadedModel(folder.model(dtype=dtype or "float32", backend=backend), tokenizer, base=str(hf_dir),
                           hf_config=folder.hf_config)
    adapter = checkpoint if adapters else adapter_checkpoint_dir(checkpoint)
    if adapter is None:
        if hf_dir is not None:
            raise ValueError(f"--hf-dir names the base model of a fine-tune run; {checkpoint} is not one, "
                             "so leave --hf-dir out")
        ckpt = load_checkpoint(checkpoint, backend=backend, dtype=dtype)
        return LoadedModel(ckpt.model, ckpt.tokenizer, ckpt.path, ckpt.step, ckpt.meta.get("settings") or {})
    folder, state = adapter_state(adapter)
    base = _base_of(folder, state, hf_dir)
    ckpt, tokenizer = adapters_on_base(folder, state, base, dtype=dtype or state.get("dtype", "float32"),
                                       backend=backend)
    ckpt.model.training = False
    return LoadedModel(ckpt.model, tokenizer, folder, int(state.get("step", 0)),
                       (state.get("meta") or {}).get("finetune") or {},
                       hf_dir or (state.get("base") or {}).get("hf_dir"), base.hf_config)

"""Checkpoints: parameters and optimizer moments in safetensors, everything else in JSON.

A checkpoint is a folder (``runs/NAME/latest``, ``runs/NAME/best``)::

    model.safetensors       parameters by name (all of them, or only the LoRA adapters)
    optimizer.safetensors   AdamW moments "base.m", "base.v" (and "lora.m", "lora.v")
    state.json              format/version, model config, dtype, step, tokenizer, the state of
                            the model's dropout generator (``null`` when training drew masks
                            keyed by step and row: pedestrian.training.distributed.RowKeyedRNG needs no
                            state), optimizer step (its hyper-parameters are the run's settings,
                            in "meta"; older checkpoints repeat them here, unread), LoRA settings, which
                            base model an adapter-only checkpoint belongs to, the plugged
                            layers (slot, file path, source text: pedestrian.model.slots), the
                            byte size and SHA-256 of both .safetensors files, and a free-form
                            "meta" dict (the training loop keeps its settings, data RNG state,
                            metrics there)

Atomic writes (:func:`pedestrian.atomic.atomic_dir`): the new checkpoint is written and
fsync-ed into a hidden sibling folder ``.NAME.tmp-XXXX``; then ``NAME`` is renamed to
``.NAME.old``, the new folder renamed to ``NAME``, and ``.NAME.old`` deleted. A kill at any
moment leaves a complete checkpoint at ``NAME`` or -- only between the two renames -- at
``.NAME.old``, which :func:`load_checkpoint` and the next :func:`save_checkpoint` pick up
automatically. An OS error while saving (no space, file too large, no permission, read-only)
is one :class:`~pedestrian.atomic.WriteError` and leaves the previous checkpoint as it was.
Truncated or corrupted files are detected by the sizes and hashes in ``state.json`` (and by
safetensors' own checks) and reported as one clear :class:`CheckpointError`.

No non-finite numbers: :func:`save_checkpoint` refuses (:class:`NonFiniteError`, before
writing anything) a parameter or AdamW moment holding a NaN or an infinity, and
:func:`load_checkpoint` refuses weights that hold one, so a checkpoint never carries them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import atomic_dir, interrupted_copy
from .config import GPTConfig
from .model.finite import non_finite_counts, non_finite_report

__all__ = ["Checkpoint", "CheckpointError", "NonFiniteError", "save_checkpoint", "load_checkpoint",
           "copy_checkpoint", "resolve_checkpoint_dir", "read_state", "FORMAT", "VERSION"]

FORMAT = "pedestrian-checkpoint"
VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
#: how the base buffer's moments are laid out (2: SwiGLU's gate and up weights one region, 2026-12-04;
#: 1, or no record: apart, converted on reading)
FLAT_LAYOUT = 2
STATE_FILE = "state.json"
_HINT = "re-run training, or use another checkpoint (e.g. the run's best/ or latest/ folder)"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: truncated, corrupted, or of an unknown format."""


class NonFiniteError(CheckpointError):
    """A tensor to be saved, or a loaded weight, holds a NaN or an infinity.

    Attributes:
        counts: ``{tensor name: (number of NaN, number of +-inf)}`` for every such tensor.
    """

    def __init__(self, message: str, counts: dict[str, tuple[int, int]]):
        super().__init__(message)
        self.counts = counts


@dataclass
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        path: the checkpoint folder (the one holding ``state.json``).
        model: the :class:`~pedestrian.model.GPT`, parameters loaded, dropout RNG restored,
            ``training`` left ``True``.
        tokenizer: the saved tokenizer (``CharTokenizer`` / ``BPETokenizer``) or ``None``.
        config: the :class:`~pedestrian.config.GPTConfig`.
        step: optimizer updates done when it was saved.
        meta: the free-form dict given to :func:`save_checkpoint` (training settings, data RNG
            state, metrics for checkpoints written by ``pedestrian train``).
        state: the whole parsed ``state.json``.
    """

    path: Path
    model: Any
    tokenizer: Any
    config: GPTConfig
    step: int
    meta: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)

    def optimizer_state(self) -> dict:
        """The AdamW state saved with it, for :meth:`AdamW.load_state_dict`.

        Returns:
            ``{"step": int, "base.m": ndarray, ...}``.

        Raises:
            CheckpointError: no optimizer state was saved, or the file is damaged.
            NonFiniteError (a ``CheckpointError``): a moment holds a NaN or an infinity.
        """
        if OPTIMIZER_FILE not in self.state.get("files", {}):
            raise CheckpointError(f"checkpoint {self.path} holds no optimizer state (it was saved "
                                  "for inference only); it cannot be resumed, only evaluated or sampled")
        tensors = _read_safetensors(self.path, OPTIMIZER_FILE, self.state)
        if self.state["optimizer"].get("layout", 1) < 2 and self.config.mlp == "swiglu" and "base.m" in tensors:
            tensors = _gate_up_fused(tensors, self.model)
        return {"step": int(self.state["optimizer"]["step"]), **tensors}


def _gate_up_fused(tensors: dict, model) -> dict:
    """The base buffer's moments of a checkpoint written before SwiGLU's gate and up weights were
    one region (layout 1: each ``(d, m)`` apart), in the layout ``model`` has, by parameter name."""
    from .model.buffers import FlatParams, base_regions

    specs = model.parameters.specs
    out = dict(tensors)
    for key in ("base.m", "base.v"):
        old = FlatParams(np, tensors[key].dtype, base_regions(model.config, specs, fuse_gate_up=False))
        new = FlatParams(np, tensors[key].dtype, base_regions(model.config, specs))
        old.flat[...] = tensors[key]
        for name, view in old.views.items():
            new.views[name][...] = view
        out[key] = new.flat
    return out


# ---------------------------------------------------------------------------------------- paths
def resolve_checkpoint_dir(path) -> Path:
    """Find the checkpoint folder a user path stands for.

    Accepts a checkpoint folder (holding ``state.json``), one of its files, or a run folder
    (``runs/NAME``, meaning its ``latest/``; a fine-tuning run's: its ``adapter/``). A folder
    missing only because a save was killed between its two renames is found at ``.NAME.old``.

    Raises:
        FileNotFoundError: nothing loadable there (the message says what was expected; a Hugging
            Face model folder, holding ``config.json``, is named as one, with the commands that take it).
    """
    p = Path(path).expanduser()
    if p.is_file() and p.name in (STATE_FILE, MODEL_FILE, OPTIMIZER_FILE):
        p = p.parent
    for candidate in (p, p / "latest", p / "adapter"):
        if (candidate / STATE_FILE).is_file():
            return candidate
        old = interrupted_copy(candidate)
        if not candidate.exists() and (old / STATE_FILE).is_file():
            return old
    if (p / "config.json").is_file():           # a Hugging Face model folder: say where it goes
        raise FileNotFoundError(
            f"no checkpoint at {p}: it holds config.json, a Hugging Face model folder, which the commands "
            f"take as --hf-dir {p} (`pedestrian sample --hf-dir`, `pedestrian explain --hf-dir`, "
            "`pedestrian finetune --hf-dir`, whose `step 0: val loss` line is the model's own loss on --data)")
    if (p / "adapter_config.json").is_file():   # a PEFT adapter folder (a finetune run's peft/)
        run = p.parent if (p.parent / "adapter" / STATE_FILE).is_file() else None
        raise FileNotFoundError(
            f"no checkpoint at {p}: it holds adapter_config.json, a PEFT adapter, which the commands do "
            f"not take; " + (f"pass its fine-tuning run, --checkpoint {run}" if run is not None else
                             "load it in Python with pedestrian.interop.peft.load_peft_adapter"))
    raise FileNotFoundError(
        f"no checkpoint at {p}: expected a folder holding {STATE_FILE} (e.g. runs/NAME/latest or "
        "runs/NAME/best) or a run folder holding latest/ (a fine-tuning run's: adapter/); train one with "
        "`pedestrian train`")


def read_state(path) -> tuple[Path, dict]:
    """``(checkpoint folder, parsed state.json)`` without loading any tensor.

    Raises:
        FileNotFoundError: see :func:`resolve_checkpoint_dir`.
        CheckpointError: ``state.json`` is not valid JSON or not a pedestrian checkpoint.
    """
    folder = resolve_checkpoint_dir(path)
    file = folder / STATE_FILE
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint file {file} is truncated or corrupted ({exc}); {_HINT}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a pedestrian checkpoint (no \"format\": \"{FORMAT}\"); {_HINT}")
    if state.get("version") != VERSION:
        raise CheckpointError(f"{file} has checkpoint format version {state.get('version')!r}; this "
                              f"pedestrian reads version {VERSION}. Use the matching pedestrian version.")
    return folder, state


# ---------------------------------------------------------------------------------------- save
def save_checkpoint(directory, model, optimizer=None, tokenizer=None, step: int = 0,
                    meta: dict | None = None, *, params: str = "all", base: dict | None = None) -> Path:
    """Write a checkpoint folder atomically (see the module docstring).

    Args:
        directory: the checkpoint folder to create or replace, e.g. ``runs/NAME/latest``.
            Its parent is created if needed.
        model: a :class:`~pedestrian.model.GPT`.
        optimizer: an :class:`~pedestrian.training.optim.AdamW` whose moments and step are saved, or
            ``None`` (an inference-only checkpoint that cannot be resumed).
        tokenizer: saved as its ``to_dict()`` (or ``None``).
        step: optimizer updates done.
        meta: JSON-serialisable dict stored as is (training settings, RNG states, metrics).
        params: ``"all"`` (every parameter) or ``"lora"`` (only the ``X.lora_D`` /
            ``X.lora_U`` adapters: a small file that needs its base model to be loaded).
        base: for ``params="lora"``, a JSON-serialisable description of the base model the
            adapters belong to (e.g. ``{"source": "path/to/gpt2", "sha256": ...}``); the base
            config is always recorded.

    Returns:
        the checkpoint folder.

    Raises:
        ValueError: ``params`` unknown, or ``"lora"`` for a model without adapters; a plugged
            layer not loaded from a file (its source cannot be recorded).
        TypeError: ``meta`` not JSON-serialisable (nothing is written then).
        NonFiniteError (a ``CheckpointError``): a parameter or optimizer moment holds a NaN or
            an infinity; the message names each such tensor with its counts. Nothing is
            written, so the previous checkpoint stays.
        WriteError (an ``OSError``, :mod:`pedestrian.atomic`): the OS refused the write (no
            space, file too large, no permission, read-only); the previous checkpoint is left
            intact.
    """
    from safetensors.numpy import save_file

    from .backend import to_numpy

    if params not in ("all", "lora"):
        raise ValueError(f"params must be 'all' or 'lora', got {params!r}")
    tensors = model.state_dict()
    if params == "lora":
        tensors = {k: v for k, v in tensors.items() if ".lora_" in k}
        if not tensors:
            raise ValueError("params='lora' but the model has no LoRA adapters")
    lora = None
    if model.lora_targets:
        lora = {"targets": list(model.lora_targets), "rank": int(model.lora_rank),
                "alpha": float(model.lora_alpha), "freeze_base": bool(model.freeze_base),
                "ranks": {k: int(v) for k, v in model.lora_ranks.items()},
                "alphas": {k: float(v) for k, v in model.lora_alphas.items()},
                "dropout": float(model.lora_dropout)}
    state = {
        "format": FORMAT,
        "version": VERSION,
        "config": model.config.to_dict(),
        "dtype": model.dtype_name,
        "params": params,
        "lora": lora,
        "layers": model.slots.records() or None,
        "base": ({"config": model.config.to_dict(), **(base or {})} if params == "lora" else None),
        "step": int(step),
        "tokenizer": None if tokenizer is None else tokenizer.to_dict(),
        "dropout_rng": _rng_state(model.dropout_rng) if isinstance(model.dropout_rng, np.random.Generator) else None,
        "optimizer": None,
        "files": {},
        "meta": meta or {},
    }
    opt_tensors = None
    if optimizer is not None:
        opt_state = optimizer.state_dict()
        state["optimizer"] = {"step": int(opt_state["step"]),      # (its hyper-parameters: the run's settings)
                              "groups": [g.name for g in optimizer.groups], "layout": FLAT_LAYOUT}
        opt_tensors = {k: v for k, v in opt_state.items() if k != "step"}
        if params == "lora":
            opt_tensors = {k: v for k, v in opt_tensors.items() if k.startswith("lora.")}
    json.dumps(state)  # fail early (TypeError) if meta is not serialisable
    tensors = {k: np.asarray(to_numpy(v), order="C") for k, v in tensors.items()}     # (0-d stays 0-d)
    if opt_tensors is not None:
        opt_tensors = {k: np.asarray(to_numpy(v), order="C") for k, v in opt_tensors.items()}
    everything = {**tensors, **{f"optimizer {k}": v for k, v in (opt_tensors or {}).items()}}
    bad = non_finite_counts(everything)
    if bad:
        raise NonFiniteError(
            f"refusing to save a checkpoint in {Path(directory).expanduser()}: "
            f"{non_finite_report(bad, everything)}; nothing was "
            "written (the previous checkpoint there, if any, is unchanged); the model or the "
            "optimizer diverged (e.g. a learning rate too high for it)", bad)

    final = Path(directory).expanduser()
    with atomic_dir(final, what="the checkpoint") as tmp:
        save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": FORMAT})
        files = [MODEL_FILE]
        if opt_tensors is not None:
            save_file(opt_tensors, str(tmp / OPTIMIZER_FILE), metadata={"format": FORMAT})
            files.append(OPTIMIZER_FILE)
        for name in files:
            state["files"][name] = _file_record(tmp / name)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1), encoding="utf-8")
    return final


def copy_checkpoint(src, dst) -> Path:
    """Copy checkpoint folder ``src`` to ``dst`` atomically (e.g. ``latest`` -> ``best``).

    Raises:
        FileNotFoundError: no checkpoint at ``src``.
        WriteError (an ``OSError``): the OS refused the write; ``dst`` is left as it was.
    """
    src = resolve_checkpoint_dir(src)
    final = Path(dst).expanduser()
    with atomic_dir(final, what="the checkpoint") as tmp:
        for f in src.iterdir():
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)
    return final


def _file_record(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _rng_state(rng: np.random.Generator) -> dict:
    return rng.bit_generator.state


def _restore_rng(rng: np.random.Generator, state: dict) -> None:
    """Put a saved ``bit_generator.state`` back into ``rng``."""
    rng.bit_generator.state = state


# ---------------------------------------------------------------------------------------- load
def _read_safetensors(folder: Path, name: str, state: dict, verify: bool = True) -> dict:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    file = folder / name
    record = state.get("files", {}).get(name)
    if not file.is_file():
        raise CheckpointError(f"checkpoint {folder} is incomplete: {name} is missing; {_HINT}")
    if record is not None:
        size = file.stat().st_size
        if size != record.get("bytes"):
            raise CheckpointError(f"checkpoint file {file} is truncated or corrupted ({size} bytes, "
                                  f"{record.get('bytes')} expected); {_HINT}")
        if verify and _sha256(file) != record.get("sha256"):
            raise CheckpointError(f"checkpoint file {file} is corrupted (its SHA-256 differs from the "
                                  f"one recorded in {STATE_FILE}); {_HINT}")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {file} is truncated or corrupted ({exc}); {_HINT}") from None
    bad = non_finite_counts(tensors)
    if bad:
        raise NonFiniteError(f"checkpoint file {file} holds non-finite values: "
                             f"{non_finite_report(bad, tensors)}; "
                             f"it cannot be used. Use an earlier checkpoint (e.g. the run's best/ "
                             f"folder) or re-run training", bad)
    return tensors


def load_checkpoint(path, *, backend: str = "numpy", dtype: str | None = None, base_model=None,
                    verify: bool = True, device=None) -> Checkpoint:
    """Load a checkpoint written by :func:`save_checkpoint`.

    Args:
        path: a checkpoint folder, one of its files, or a run folder (its ``latest/``, or a
            fine-tuning run's ``adapter/``).
        backend: ``"numpy"`` or ``"torch"`` for the rebuilt model.
        dtype: ``"float32"`` / ``"float64"``; ``None`` keeps the saved dtype.
        base_model: for an adapter-only checkpoint (``params="lora"``), the
            :class:`~pedestrian.model.GPT` the adapters belong to (same config, no adapters
            yet); they are added to it and it is returned as ``Checkpoint.model``.
        verify: check the SHA-256 of ``model.safetensors`` against ``state.json`` (one pass
            over the file).
        device: where the rebuilt model's arrays live (``GPT(..., device=)``; torch backend).

    Returns:
        a :class:`Checkpoint`. The optimizer state is read on demand
        (:meth:`Checkpoint.optimizer_state`).

    Raises:
        FileNotFoundError: no checkpoint there.
        CheckpointError (a ``ValueError``): truncated/corrupted files, an unknown format, tensors
            that do not match the recorded config, or an adapter-only checkpoint without (or
            with a mismatching) ``base_model``.
        ValueError: a recorded plugged layer that no longer runs, or ``backend="torch"`` for a
            model with plugged layers.

    A checkpoint that records plugged layers runs their recorded source (as importing a file
    does): load only checkpoints you trust.
        NonFiniteError (a ``CheckpointError``): a weight holds a NaN or an infinity (the
            message names the tensors and counts).
    """
    from .model import GPT
    from .text.tokenizer import load_tokenizer

    folder, state = read_state(path)
    try:
        config = GPTConfig.from_dict(state["config"])
        step = int(state["step"])
        params = state.get("params", "all")
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{folder / STATE_FILE} has an invalid model config ({exc}); {_HINT}") from None
    tensors = _read_safetensors(folder, MODEL_FILE, state, verify=verify)
    lora = state.get("lora")
    if params == "lora":
        if base_model is None:
            base_dir = (state.get("base") or {}).get("hf_dir")
            raise CheckpointError(
                f"{folder} holds only LoRA adapters (base model: {base_dir or 'not recorded'}); load it "
                "with base_model=<its base GPT> or pedestrian.training.finetune.load_finetuned (on the command line: "
                "pass it as is, with --hf-dir BASE_DIR if the base moved)")
        if base_model.config != config:
            raise CheckpointError(f"the adapters in {folder} belong to a base model with config {config}, "
                                  f"not {base_model.config}")
        model = base_model
    else:
        model = GPT(config, dtype=dtype or state.get("dtype", "float32"), backend=backend, device=device,
                    layers=recorded_layers(state))
    try:
        if lora is not None:
            # "ranks", "alphas", "dropout": per-layer settings; checkpoints older than them have
            # one rank and one alpha for every adapter and no adapter dropout
            model.add_lora(lora["targets"], lora["rank"], lora["alpha"], rank_pattern=lora.get("ranks"),
                           alpha_pattern=lora.get("alphas"), dropout=lora.get("dropout", 0.0),
                           freeze_base=lora["freeze_base"])
        if params == "lora":
            missing = [k for k in model.params if ".lora_" in k and k not in tensors]
            if missing:
                raise ValueError(f"missing adapters {missing}")
        model.load_state_dict(tensors, strict=(params == "all"))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"the tensors in {folder / MODEL_FILE} do not match the config in its "
                              f"{STATE_FILE} ({exc}); {_HINT}") from None
    if state.get("dropout_rng") is not None:      # written by a model holding a plain generator
        _restore_rng(model.dropout_rng, state["dropout_rng"])
    tokenizer = load_tokenizer(state["tokenizer"]) if state.get("tokenizer") is not None else None
    return Checkpoint(path=folder, model=model, tokenizer=tokenizer, config=config, step=step,
                      meta=state.get("meta") or {}, state=state)


def recorded_layers(state: dict) -> dict:
    """``{slot: module}`` of the plugged layers a checkpoint's ``state.json`` records, rebuilt
    from their recorded source (:func:`pedestrian.model.slots.layer_from_source`); ``{}`` if none."""
    from .model.slots import layer_from_source

    return {r["slot"]: layer_from_source(r["source"], r["path"]) for r in state.get("layers") or []}

"""The plugged layers of a training run (``pedestrian train --layer SLOT=FILE.py``): read from the
setting, checked by numbers before the first step, and matched against a resumed checkpoint.

A run plugs each file into its slot (:mod:`pedestrian.model.slots`); its checkpoints record the
slot, the path and the source text, so ``--resume``, ``sample`` and ``eval`` rebuild the layer from
the recorded source (the file may have moved or changed since). Before the first step --
resumed runs included -- every plugged layer is checked with :func:`pedestrian.check_gradients`
in float64; a failure logs the checker's report and stops the run (:class:`LayerCheckFailed`,
exit status 1 on the command line); ``--no-check-layers`` skips the check.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .step import TrainingError

__all__ = ["LayerCheckFailed", "layer_paths", "check_layers", "match_recorded", "check_inputs"]

log = logging.getLogger("pedestrian.train")
#: entries per tensor the pre-run check compares (sampled; all of them in a smaller tensor)
CHECK_ENTRIES = 64


class LayerCheckFailed(TrainingError):
    """A plugged layer's backward disagrees with the numbers (the report was logged); the command
    line exits with status 1, as ``pedestrian check`` does for a failed check."""

    exit_status = 1


def layer_paths(values) -> dict[str, str]:
    """``{slot: path}`` from the ``layer`` setting, ``["norm=my_norm.py", ...]``.

    Raises:
        TrainingError: a value without ``=``, an unknown slot, a slot given twice, no such file.
    """
    from ..model.slots import SLOTS

    out = {}
    for value in values or []:
        slot, sep, path = value.partition("=")
        if not sep or not path:
            raise TrainingError(f"--layer {value!r} must be SLOT=FILE.py, e.g. --layer norm=my_norm.py")
        if slot not in SLOTS:
            raise TrainingError(f"--layer {value!r}: unknown slot {slot!r}; plug a layer into one of {SLOTS}")
        if slot in out:
            raise TrainingError(f"--layer gives the {slot} slot twice ({out[slot]}, {path}); give each slot once")
        if not Path(path).expanduser().is_file():
            raise TrainingError(f"--layer {value!r}: no file {path}")
        out[slot] = str(Path(path).expanduser())
    return out


def check_inputs(layer, seed: int = 0) -> tuple[dict, dict]:
    """``(inputs, params)`` the pre-run check uses for a :class:`~pedestrian.model.slots.Plugged`
    layer: its module's ``example()`` when it has one, else ``x`` ``(2, 3, width)`` standard normal
    and ``init``'s parameters, each moved by ``0.1·(1 + |p|)·N(0, 1)`` (a weight of exactly 1 or a
    bias of 0 would hide a missing factor or term)."""
    example = getattr(layer.module, "example", None)
    if callable(example):
        return example()
    rng = np.random.default_rng(seed)
    width = layer.config.d_mlp if layer.slot == "activation" else layer.config.d_model
    params = {n: p + 0.1 * (1 + np.abs(p)) * rng.standard_normal(p.shape) for n, p in layer.initial().items()}
    return {"x": rng.standard_normal((2, 3, width))}, params


def check_layers(model, *, quiet: bool = False) -> None:
    """Check every plugged layer of ``model`` with :func:`pedestrian.check_gradients` (float64,
    :func:`check_inputs`, at most :data:`CHECK_ENTRIES` entries per tensor); log one line per
    layer that passes, the whole report of one that fails (``quiet``: nothing).

    Raises:
        LayerCheckFailed: a layer failed; the message names it, the failed tensors and the fix.
    """
    from ..paper.check import check_gradients

    for slot, layer in model.slots.plugged.items():
        inputs, params = check_inputs(layer)
        report = check_gradients(layer.module.forward, layer.module.backward, inputs, params,
                                 max_entries=CHECK_ENTRIES, quiet=True)
        name = layer.path or layer.label
        if report.passed:
            if not quiet:
                log.info(f"{slot} layer {name}: its backward agrees with the numbers on {len(report.tensors)} "
                         "tensor(s) (pedestrian.check_gradients)")
            continue
        if not quiet:
            log.error(f"gradient check of the {slot} layer {name}:\n{report}")
        failed = ", ".join(report.failed) or "; ".join(report.problems)
        raise LayerCheckFailed(f"the {slot} layer {name} failed its gradient check ({failed}; the report is "
                               f"above): fix its backward (`pedestrian check {name}` shows the same), or pass "
                               "--no-check-layers to train with it anyway")


def match_recorded(given, ckpt) -> None:
    """On resume: the ``--layer`` files given again must be those the checkpoint recorded, slot
    for slot and byte for byte (``given`` empty: nothing to match; the recorded source is used).

    Raises:
        TrainingError: another set of slots, or a file whose text differs from the recorded source.
    """
    paths = layer_paths(given)
    if not paths:
        return
    recorded = {r["slot"]: r for r in ckpt.state.get("layers") or []}
    if set(paths) != set(recorded):
        then = ", ".join(f"{s}={r['path']}" for s, r in recorded.items()) or "none"
        raise TrainingError(f"the checkpoint in {ckpt.path} was trained with plugged layers {then}, not "
                            f"{', '.join(f'{s}={p}' for s, p in paths.items())}; resume without --layer (the "
                            "recorded source is used), or start a new run with --out NEW_DIR")
    for slot, path in paths.items():
        if Path(path).read_text(encoding="utf-8") != recorded[slot]["source"]:
            raise TrainingError(f"--layer {slot}={path} differs from the {slot} layer the checkpoint in {ckpt.path} "
                                f"recorded (from {recorded[slot]['path']}); resume without --layer to use the "
                                "recorded source, or start a new run with --out NEW_DIR")

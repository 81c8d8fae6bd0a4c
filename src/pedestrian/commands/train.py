"""Train a GPT on a text corpus with the hand-derived backward and a hand-written AdamW.

With no arguments: the bundled Shakespeare plays, a character tokenizer and a small default
model sized to reach a validation loss <= 1.75 nats per character within 10 minutes on two CPU
cores. Checkpoints, the step log (log.jsonl), the loss curve (loss_curve.png) and the norms of
every block's error signals Δ2 … Δ10 and gradients at each validation (gradients.png) go to
runs/<corpus>_<tokenizer> (or --out).

Settings come from, in increasing priority: the defaults, a TOML file (--config), the flags.
TOML keys are the flag names with underscores (tables [data] [model] [optim] [train]); their
values must have the flag's type (e.g. bias = false, not "no").

At the end it prints two short samples of the best checkpoint (temperature 0.8, top-k 40,
seed 0; --no-sample to skip) and where the checkpoints, log and loss curve are.
Ctrl-C (or SIGTERM) finishes the current step, saves a checkpoint and says how to resume
(--resume continues exactly); a second Ctrl-C stops at once.
--warmup-steps >= --max-steps is allowed but warned about: the peak lr is never reached.

Examples:
  pedestrian train
  pedestrian train --resume                                # continue runs/shakespeare_char
  pedestrian train --config configs/shakespeare_char.toml
  pedestrian train --data my_texts/ --tokenizer bpe --bpe-vocab-size 2048 --out runs/mine
  pedestrian train --preset char-small --max-steps 500 --lr 1e-3 --max-minutes 0
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ..config import PRESETS
from ..parallel import DATA_PARALLEL_MODES
from .params import CONFIG_FIELDS, add_config_arguments

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: flag destination -> TrainSettings field (flags not listed here map to the same name)
_TRAIN_FIELDS = ("data", "tokenizer", "bpe_vocab_size", "val_fraction", "dtype", "backend", "batch_size",
                 "grad_accum", "max_steps", "lr", "min_lr", "warmup_steps", "weight_decay", "beta1", "beta2",
                 "eps", "grad_clip", "seed", "eval_interval", "eval_batches", "checkpoint_interval",
                 "max_minutes", "stop_step", "out", "progress", "plot", "data_parallel")
_MODEL_KEYS = tuple(f for f in CONFIG_FIELDS if f != "vocab_size") + ("dropout", "preset")
_TABLES = ("data", "model", "optim", "train")
#: the type every TOML value must have (that of its flag); floats also accept integers
_INT_KEYS = {"bpe_vocab_size", "batch_size", "grad_accum", "max_steps", "warmup_steps", "seed", "eval_interval",
             "eval_batches", "checkpoint_interval", "stop_step", "context_length", "d_model", "n_heads",
             "n_blocks", "d_head", "d_qk", "mlp_ratio"}
_FLOAT_KEYS = {"val_fraction", "lr", "min_lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip",
               "max_minutes", "dropout", "ln_eps", "rope_base", "rope_fraction"}
_BOOL_KEYS = {"bias", "tie_weights", "causal", "progress", "plot"}
_STR_KEYS = {"data", "tokenizer", "dtype", "backend", "out", "activation", "preset", "data_parallel",
             "position_encoding"}


def _check_toml_type(path, key: str, value):
    """``value`` converted to its flag's type, or a ValueError naming the key and the type."""
    def bad(expected: str):
        return ValueError(f"config file {path}: {key} = {value!r} must be {expected}")

    if key in _BOOL_KEYS:
        if not isinstance(value, bool):
            raise bad("true or false (a TOML boolean, no quotes)")
    elif key in _INT_KEYS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
    elif key in _FLOAT_KEYS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        value = float(value)
        if not math.isfinite(value):
            raise bad("a finite number")
    elif key in _STR_KEYS:
        if not isinstance(value, str):
            raise bad('a string (in quotes, e.g. "text")')
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.toml", help="settings file (TOML; flags override it)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its latest checkpoint, exactly")
    parser.add_argument("--overwrite", action="store_true",
                        help="start a new run even if --out already holds a checkpoint")
    g = parser.add_argument_group("data")
    g.add_argument("--data", metavar="PATH", help="UTF-8 text file or folder of *.txt files "
                   "(default: the bundled Shakespeare plays)")
    g.add_argument("--tokenizer", choices=["char", "bpe"], help="character-level (default) or byte-level BPE")
    g.add_argument("--bpe-vocab-size", type=int, metavar="N", help="vocabulary of a new BPE tokenizer (1024)")
    g.add_argument("--val-fraction", type=float, metavar="F", help="last fraction of tokens held out (0.1)")
    add_config_arguments(parser)
    m = [a for a in parser._action_groups if a.title == "model"][0]
    m.add_argument("--dropout", type=float, help="dropout probability (0)")
    m.add_argument("--dtype", choices=["float32", "float64"], help="parameter dtype (float32)")
    m.add_argument("--backend", choices=["numpy", "torch"], help="array library (numpy)")
    o = parser.add_argument_group("optimisation")
    o.add_argument("--batch-size", type=int, metavar="B", help="windows per micro-batch")
    o.add_argument("--grad-accum", type=int, metavar="K", help="micro-batches per update (1)")
    o.add_argument("--max-steps", type=int, metavar="N", help="optimizer updates; the schedule spans them")
    o.add_argument("--lr", type=float, help="peak learning rate")
    o.add_argument("--min-lr", type=float, help="learning rate at the end of the cosine decay")
    o.add_argument("--warmup-steps", type=int, metavar="N", help="linear warm-up updates")
    o.add_argument("--weight-decay", type=float, help="decoupled weight decay of the 2-D weights")
    o.add_argument("--beta1", type=float)
    o.add_argument("--beta2", type=float)
    o.add_argument("--eps", type=float)
    o.add_argument("--grad-clip", type=float, metavar="NORM", help="global gradient-norm clip (0 = off)")
    t = parser.add_argument_group("loop")
    t.add_argument("--seed", type=int, help="model init, dropout and batch sampling seed")
    t.add_argument("--eval-interval", type=int, metavar="N", help="steps between validations")
    t.add_argument("--eval-batches", type=int, metavar="N", help="fixed validation batches")
    t.add_argument("--checkpoint-interval", type=int, metavar="N",
                   help="steps between checkpoints (0 = at every validation)")
    t.add_argument("--max-minutes", type=float, metavar="M",
                   help="wall-clock budget: stop early, validate, save and plot (0 = none)")
    t.add_argument("--stop-step", type=int, metavar="N",
                   help="stop after step N as if interrupted (the schedule still spans --max-steps)")
    t.add_argument("--out", metavar="DIR", help="run folder (default runs/<corpus>_<tokenizer>)")
    t.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                   help="no progress bar")
    t.add_argument("--no-plot", dest="plot", action="store_false", default=None, help="no loss_curve.png or gradients.png")
    t.add_argument("--data-parallel", choices=list(DATA_PARALLEL_MODES),
                   help="split each batch into slices, one per core, each run with single-threaded BLAS "
                        "(default auto: NumPy models under 20M parameters; slices: PEDESTRIAN_NUM_THREADS "
                        "or the cores), each slice on its own thread")
    t.add_argument("--no-sample", dest="sample", action="store_false", default=True,
                   help="do not print samples of the trained model at the end")


def read_config_file(path) -> dict:
    """Flatten a TOML settings file into ``{setting: value}`` (tables data/model/optim/train).

    Raises:
        FileNotFoundError: no such file. ValueError: invalid TOML, an unknown key, or a value
            whose type is not that of its flag (the message names the key and the type).
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"config file not found: {p}")
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"config file {p} is not valid TOML: {exc}") from None
    flat: dict = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            if key not in _TABLES:
                raise ValueError(f"config file {p}: unknown table [{key}]; use {list(_TABLES)} or none")
            items = value.items()
        else:
            items = [(key, value)]
        for k, v in items:
            if k == "vocab_size":
                raise ValueError(f"config file {p}: vocab_size is set by the tokenizer; remove it")
            if k not in _TRAIN_FIELDS and k not in _MODEL_KEYS:
                raise ValueError(f"config file {p}: unknown setting {k!r}; known: "
                                 f"{sorted(set(_TRAIN_FIELDS) | set(_MODEL_KEYS))}")
            if k in flat:
                raise ValueError(f"config file {p}: {k!r} is given twice")
            flat[k] = _check_toml_type(p, k, v)
    return flat


def settings_from_args(args: argparse.Namespace):
    """``(TrainSettings, explicit setting names)`` from defaults < --config file < flags."""
    from ..train import DEFAULT_MODEL, TrainingError, TrainSettings

    given = read_config_file(args.config) if args.config else {}
    for name in _TRAIN_FIELDS + _MODEL_KEYS:
        value = getattr(args, name, None)
        if value is not None:
            given[name] = value
    if getattr(args, "vocab_size", None) is not None or given.get("vocab_size") is not None:
        raise TrainingError("--vocab-size is set by the tokenizer; leave it out")
    preset = given.pop("preset", None)
    model_given = {k: given.pop(k) for k in list(given) if k in _MODEL_KEYS}
    if preset is not None and preset not in PRESETS:
        raise TrainingError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    model = dict(DEFAULT_MODEL)
    if preset is not None:
        model = {k: v for k, v in PRESETS[preset].items() if k != "vocab_size"}
        model.setdefault("dropout", 0.0)
    model.update(model_given)
    if given.get("max_minutes") == 0:
        given["max_minutes"] = None
    settings = TrainSettings(**given, model=model)
    # model fields count as given one by one ("model.d_model"); a preset gives all of its fields
    model_keys = set(model_given) | (set(model) - {"dropout"} if preset is not None else set())
    explicit = set(given) | {f"model.{k}" for k in model_keys}
    return settings, explicit


def _print_samples(out: Path, n: int = 2, chars: int = 200) -> None:
    """``n`` samples of about ``chars`` characters from ``out/best`` (or ``out/latest``):
    temperature 0.8, top-k 40, seed 0 (:func:`pedestrian.generate.generate`)."""
    import numpy as np

    from ..checkpoint import load_checkpoint
    from ..generate import generate

    folder = out / "best" if (out / "best" / "state.json").is_file() else out / "latest"
    ckpt = load_checkpoint(folder)
    model, tok = ckpt.model, ckpt.tokenizer
    model.training = False
    start = getattr(tok, "special_tokens", {}).get("<|endoftext|>")
    if start is None:
        try:
            start = tok.encode("\n")[0]
        except (ValueError, IndexError):
            start = 0
    per_token = 1 if tok.to_dict().get("kind") == "char" else 3       # BPE: ~3-4 characters a token
    ids = generate(model, np.full((n, 1), start, dtype=np.int64), max(1, chars // per_token),
                   temperature=0.8, top_k=min(40, model.config.vocab_size), seed=0)
    print(f"samples from {folder} (temperature 0.8, top-k 40; --no-sample to skip):")
    for i, row in enumerate(ids):
        text = tok.decode([int(t) for t in row[1:] if int(t) != start or per_token == 1])[:chars]
        print(f"--- sample {i + 1} ---\n{text.strip()}")


def run(args: argparse.Namespace) -> int:
    from ..train import train

    settings, explicit = settings_from_args(args)
    result = train(settings, resume=args.resume, explicit=explicit, overwrite=args.overwrite)
    out = result.out
    if result.stop_reason == "interrupted":
        print(f"interrupted: a checkpoint of step {result.step} is saved in {out / 'latest'}; continue "
              f"with: pedestrian train --out {out} --resume", file=sys.stderr)
        return 130
    print(f"final validation loss {result.val_loss:.4f} nats/token at step {result.step} "
          f"({result.seconds / 60:.1f} min); latest checkpoint {out / 'latest'}", file=sys.stdout)
    if args.sample:
        _print_samples(out)
    files = [f"checkpoints {out / 'latest'} and {out / 'best'}", f"log {out / 'log.jsonl'}"]
    if (out / "loss_curve.png").is_file() and settings.plot:
        files.append(f"loss curve {out / 'loss_curve.png'}")
    if (out / "gradients.png").is_file() and settings.plot:
        files.append(f"error signals and gradients {out / 'gradients.png'}")
    print("files: " + ", ".join(files))
    print(f"sample: pedestrian sample --checkpoint {out / 'best'} --prompt \"...\" --temperature 0.8 --top-k 40")
    if result.stop_reason == "max_steps":
        print(f"train on: pedestrian train --out {out} --resume --max-steps {2 * result.step}")
    else:
        print(f"resume: pedestrian train --out {out} --resume")
    return 0

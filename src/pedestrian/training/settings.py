"""The settings of a training run: :class:`TrainSettings`, each ``pedestrian train`` flag and TOML
key declared once (type, default, help, valid values; :mod:`pedestrian.training.specs`), and which of
them a resumed run may change.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

from ..config import (ARCHS, CONFIG_CHOICES, CONFIG_FIELDS, CONFIG_HELP, CONFIG_SWITCHES, PRESETS, GPTConfig,
                      merge_config)
from ..text.data import BUNDLED_CORPUS
from .distributed import DEVICES
from .specs import (HALF_OPEN_UNIT, NON_NEGATIVE, NON_NEGATIVE_INT, OPEN_UNIT, POSITIVE, POSITIVE_INT, at_most,
                    add_field_flags, check, config_value, kind_of, setting, specs)
from .specs import flag as flag_name
from .step import TrainingError

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: The default model of ``pedestrian train`` (vocab_size comes from the tokenizer): 812,288
#: parameters with the 84-character Shakespeare vocabulary, sized so that the default
#: TrainSettings reach 1.75 nats per character or better within ``max_minutes`` on two cores
#: (what it measured: docs/performance.md).
DEFAULT_MODEL: dict = dict(context_length=64, d_model=128, n_heads=4, n_blocks=4, mlp_ratio=4,
                           activation="gelu_tanh", ln_eps=1e-5, bias=True, tie_weights=True,
                           causal=True, dropout=0.0)

#: tags of TrainSettings fields: "per_run" settings belong to one invocation (on resume they
#: come from the command, not the checkpoint); "resumable" ones may differ from the
#: checkpoint's when resuming (they do not change what the first N steps computed): given
#: explicitly they win, otherwise the checkpoint's are kept.
TAG_PER_RUN, TAG_RESUMABLE = {"per_run"}, {"resumable"}
_PER_RUN, _RESUMABLE = TAG_PER_RUN, TAG_RESUMABLE
_DATA, _MODEL, _OPTIM, _LOOP = "data", "model", "optimisation", "loop"


#: settings of earlier versions, and what replaced them: a checkpoint that still holds one loads
#: (the setting is ignored); a flag or config-file key naming one is refused with this reason
RETIRED_SETTINGS = {
    "data_parallel": "the fast kernels share the cores themselves; PEDESTRIAN_NUM_THREADS sets how many",
}



def training_window(context_length: int | None, model_context: int) -> int:
    """A fine-tuning window's tokens: ``context_length`` (``--context-length``), by default
    ``min(256, the model's context)``."""
    return context_length or min(256, model_context)

@dataclass
class RunSettings:
    """The settings a training run and a fine-tuning run share, declared once: the optimisation
    (batch, steps, AdamW, the schedule, clipping, recompute) and the loop (validation, seed,
    progress). :class:`TrainSettings` and :class:`~pedestrian.training.finetune.FinetuneSettings`
    are made of it (the latter with its own defaults, :func:`~pedestrian.training.specs.with_defaults`);
    the same loop runs both (:mod:`pedestrian.training.job`).
    """

    val_fraction: float = setting(0.1, "last fraction of the tokens held out for validation", rule=OPEN_UNIT,
                                  metavar="F", group=_DATA)
    dtype: str = setting("float32", "dtype of the parameters and of the arithmetic", choices=("float32", "float64"),
                         group=_MODEL)
    backend: str = setting("numpy", "array library", choices=("numpy", "torch"), group=_MODEL, tags=_RESUMABLE)
    batch_size: int = setting(16, "windows (each the training window + 1 tokens) per micro-batch", rule=POSITIVE_INT,
                              metavar="B", group=_OPTIM)
    grad_accum: int = setting(1, "micro-batches per update", rule=POSITIVE_INT, metavar="K", group=_OPTIM)
    max_steps: int = setting(3000, "optimizer updates; the cosine schedule spans them", rule=POSITIVE_INT,
                             metavar="N", group=_OPTIM, tags=_RESUMABLE)
    lr: float = setting(2e-3, "peak learning rate, reached after the linear warm-up", rule=POSITIVE,
                        group=_OPTIM)
    min_lr: float = setting(2e-4, "learning rate at the end of the cosine decay", rule=at_most("lr"),
                            group=_OPTIM)
    warmup_steps: int = setting(100, "linear warm-up updates", rule=NON_NEGATIVE_INT, metavar="N", group=_OPTIM)
    weight_decay: float = setting(0.1, "decoupled weight decay of the trained 2-D weights (adapters included), "
                                  "not of biases or norms", rule=NON_NEGATIVE, group=_OPTIM)
    beta1: float = setting(0.9, "AdamW's first-moment decay", rule=HALF_OPEN_UNIT, group=_OPTIM)
    beta2: float = setting(0.99, "AdamW's second-moment decay", rule=HALF_OPEN_UNIT, group=_OPTIM)
    grad_clip: float = setting(1.0, "global gradient-norm clip; 0 = off", rule=NON_NEGATIVE, metavar="NORM",
                               group=_OPTIM)
    max_skipped_steps: int = setting(5, "stop after this many steps in a row whose loss or gradient is not "
                                     "finite (each is skipped: no update)", rule=POSITIVE_INT, metavar="K",
                                     group=_OPTIM, tags=_RESUMABLE)
    recompute: bool = setting(False, "keep only each block's input in the forward and recompute the rest in the "
                              "backward: less memory, about a third more arithmetic, the same numbers",
                              group=_OPTIM, tags=_PER_RUN)
    recompute_blocks: int = setting(0, "recompute only the first N blocks (as Megatron-LM's --recompute-num-layers); "
                                    "the others keep only what their backward reads; 0 = as --recompute says",
                                    rule=NON_NEGATIVE_INT, metavar="N", group=_OPTIM, tags=_PER_RUN)
    seed: int = setting(1337, "seed of the initialisation (model or adapters), dropout and batch sampling",
                        rule=NON_NEGATIVE_INT, group=_LOOP)
    eval_interval: int = setting(250, "steps between validations", rule=POSITIVE_INT, metavar="N", group=_LOOP,
                                 tags=_RESUMABLE)
    eval_batches: int = setting(20, "fixed validation batches", rule=POSITIVE_INT, metavar="N", group=_LOOP)
    progress: bool = setting(True, "no progress bar", group=_LOOP, tags=_PER_RUN)
    plot: bool = setting(True, "no loss_curve.png or gradients.png", group=_LOOP, tags=_PER_RUN)


@dataclass
class TrainSettings(RunSettings):
    """Every setting of a training run: the ``pedestrian train`` flags and TOML keys, each
    declared once (type, default, help, valid values; see :mod:`pedestrian.training.specs`): those
    a fine-tuning run shares in :class:`RunSettings`, the others below.

    ``model`` holds the :class:`GPTConfig` fields except ``vocab_size`` (set from the
    tokenizer). ``nproc`` > 1 starts that many ranks on this machine through PyTorch's launcher
    (``pedestrian train --nproc N``; see :mod:`pedestrian.training.distributed`). Resuming reproduces a run
    bit for bit when the number of ranks is the same. (The cores of one process are shared by the
    fast kernels themselves: ``PEDESTRIAN_NUM_THREADS``.)
    """

    data: str | None = setting(None, "UTF-8 text file or folder of *.txt files (default: the bundled "
                               "Shakespeare plays)", kind=str, metavar="PATH", group=_DATA)
    tokenizer: str = setting("char", "character-level or byte-level BPE", choices=("char", "bpe"), group=_DATA)
    bpe_vocab_size: int = setting(1024, "vocabulary of a new BPE tokenizer", rule=POSITIVE_INT, metavar="N",
                                  group=_DATA)
    model: dict = setting(DEFAULT_MODEL, "GPTConfig fields except vocab_size", kind=dict, flag=False)
    precision: str = setting("float32", "float32, or bf16: bfloat16 products on float32 master weights (needs "
                             "--backend torch; meant for --device cuda; float16 is not offered: it needs a loss scale)",
                             choices=("float32", "bf16"), group=_MODEL,
                             tags=_RESUMABLE)
    device: str = setting("cpu", "where the arrays live; cuda needs --backend torch (ranks on GPUs talk "
                          "through NCCL, on CPUs through gloo)", choices=DEVICES, group=_MODEL, tags=_PER_RUN)
    layer: list | None = setting(None, "your own layer in a slot: SLOT=FILE.py, SLOT one of norm, activation, mlp "
                                 "(repeat for several; docs/guide.md)", kind=list, metavar="SLOT=FILE.py", group=_MODEL,
                                 tags=_RESUMABLE)
    check_layers: bool = setting(True, "no gradient check of the --layer modules before the first step",
                                 group=_MODEL, tags=_PER_RUN)
    eps: float = setting(1e-8, "AdamW's epsilon, added to the root of the second moment", rule=POSITIVE,
                         group=_OPTIM)
    update_in_backward: bool = setting(False, "apply AdamW to each block inside the backward, so that no "
                                       "whole-model gradient is held (less memory; needs --grad-clip 0 and "
                                       "--grad-accum 1; a non-finite gradient stops the run)", group=_OPTIM,
                                       tags=_PER_RUN)
    checkpoint_interval: int = setting(0, "steps between checkpoints; 0 = at every validation",
                                       rule=NON_NEGATIVE_INT, metavar="N", group=_LOOP, tags=_RESUMABLE)
    max_minutes: float | None = setting(9.0, "wall-clock budget: stop early, validate, save and plot; 0 = none",
                                        rule=POSITIVE, optional=True, none_means=0, metavar="M", group=_LOOP,
                                        tags=_PER_RUN)
    stop_step: int | None = setting(None, "stop after step N as if interrupted (the schedule still spans "
                                    "--max-steps)", kind=int, rule=POSITIVE_INT, metavar="N", group=_LOOP,
                                    tags=_PER_RUN)
    out: str | None = setting(None, "run folder (default runs/<corpus>_<tokenizer>)", kind=str, metavar="DIR",
                              group=_LOOP, tags=_PER_RUN)
    nproc: int = setting(1, "processes (ranks) on this machine, each computing its share of every batch; "
                         "started through PyTorch's launcher (needs the torch extra); under torchrun "
                         "leave it out", rule=POSITIVE_INT, metavar="N", group=_LOOP, tags=_PER_RUN)
    dist_timeout: float = setting(300.0, "seconds a rank waits for the others in an exchange before the run "
                                  "stops with an error", rule=POSITIVE, metavar="S", group=_LOOP, tags=_PER_RUN)

    def validate(self, *, resuming: bool = False) -> None:
        """Raise :class:`TrainingError` naming the first bad setting (by its flag) and its valid
        values (:func:`pedestrian.training.specs.check`), or a bad model setting. ``resuming``: the
        flags of a ``--resume`` command, whose other settings come from the checkpoint (the run's
        own settings are validated once merged), so ``--update-in-backward``'s needs are not read here."""
        try:
            check(self)
        except ValueError as exc:
            raise TrainingError(str(exc)) from None
        if "vocab_size" in self.model:
            raise TrainingError("the model's vocab_size is set by the tokenizer; do not give it")
        if self.device == "cuda" and self.backend != "torch":
            raise TrainingError("--device cuda needs --backend torch (NumPy arrays live on the CPU)")
        if self.precision == "bf16" and (self.backend != "torch" or self.dtype != "float32"):
            raise TrainingError("--precision bf16 needs --backend torch and --dtype float32 (float32 master "
                                "weights): NumPy has no bfloat16 products")
        needs = [fix for bad, fix in ((self.grad_clip > 0, "--grad-clip 0"), (self.grad_accum > 1, "--grad-accum 1"),
                                      (self.nproc > 1, "one process"), (self.backend != "numpy", "--backend numpy"),
                                      (bool(self.layer), "no --layer")) if bad]
        if self.update_in_backward and needs and not resuming:
            raise TrainingError("--update-in-backward updates each block before the whole gradient exists: "
                                f"it needs {', '.join(needs)}")
        try:
            self.model_config(vocab_size=1)
        except (TypeError, ValueError) as exc:
            raise TrainingError(f"invalid model settings: {exc}") from None
        from ..kernels.jit import num_threads

        try:
            num_threads()                                  # a bad PEDESTRIAN_NUM_THREADS, before any file
        except ValueError as exc:
            raise TrainingError(str(exc)) from None

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The :class:`GPTConfig` for a tokenizer of ``vocab_size`` ids."""
        return GPTConfig(vocab_size=vocab_size, **self.model)

    @property
    def context_length(self) -> int:
        return int(self.model["context_length"])

    def window(self, model) -> int:
        """Tokens of a training window: the model's context length."""
        return self.context_length

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainSettings":
        """From :meth:`to_dict` (a checkpoint's); settings it lacks (added later) get their defaults."""
        known = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k not in RETIRED_SETTINGS}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TrainingError(f"unknown training setting(s) {unknown}")
        return cls(**data)

    def run_dir(self) -> Path:
        """``out``, or ``runs/<corpus name>_<tokenizer>`` (``runs/shakespeare_char``)."""
        if self.out:
            return Path(self.out).expanduser()
        corpus = Path(self.data).expanduser() if self.data else BUNDLED_CORPUS
        stem = corpus.stem if corpus.suffix else corpus.name
        return Path("runs") / f"{stem or 'corpus'}_{self.tokenizer}"


def per_run_flags(settings: TrainSettings) -> str:
    """The switches of this invocation that a printed ``--resume`` command must repeat, since on
    resume they come from the command, not the checkpoint (``" --no-progress --no-plot"``,
    ``" --recompute"``, ``" --recompute-blocks 12"``, or ``""``; ``--update-in-backward`` with the ``--grad-clip 0`` it needs)."""
    return "".join(f" {flag}" for flag, on in (("--no-progress", not settings.progress),
                                                 ("--no-plot", not settings.plot), ("--recompute", settings.recompute),
                                                 (f"--recompute-blocks {settings.recompute_blocks}", settings.recompute_blocks),
                                                 ("--update-in-backward --grad-clip 0", settings.update_in_backward))
                   if on)


def memory_plan(settings, n_blocks: int) -> str | None:
    """The run's opening line on its memory flags (``None``: none on); ``settings``: a
    :class:`TrainSettings` or a finetune's (which has no ``update_in_backward``)."""
    said = [what for on, what in (
        (settings.recompute_blocks, f"the first {settings.recompute_blocks} of {n_blocks} blocks recomputed in the "
                                    "backward (--recompute-blocks)"),
        (settings.recompute and not settings.recompute_blocks, "every block recomputed in the backward (--recompute)"),
        (getattr(settings, "update_in_backward", False), "AdamW applied block by block inside the backward "
                                                         "(--update-in-backward)")) if on]
    return "memory: " + "; ".join(said) + "; the same numbers as without" if said else None


def resume_rules(cls) -> tuple[frozenset, frozenset]:
    """``(per_run, may_change)`` of a settings class, from its declarations' tags: the settings of
    one invocation (on resume they come from the command, not the record), and those a resumed run
    may change -- the per-run ones and the "resumable" ones (they do not change what the first N
    steps computed), which win when given explicitly."""
    per_run = frozenset(n for n, s in specs(cls).items() if s.tags & _PER_RUN)
    return per_run, per_run | {n for n, s in specs(cls).items() if s.tags & _RESUMABLE}


#: settings of one invocation, and those a resumed training run may change (:func:`resume_rules`)
PER_RUN_SETTINGS, RESUMABLE_SETTINGS = resume_rules(TrainSettings)


def absolute_path(path) -> str:
    """``path`` (a corpus file or folder) as an absolute path, ``~`` expanded: what a run records,
    so that ``--resume`` and ``eval`` from another working folder find the same text."""
    return str(Path(path).expanduser().resolve())


def _shown(value) -> str:
    """A setting's value as a command line would give it (a list as its words)."""
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else repr(value)


def resume_settings(settings, recorded, explicit, *, run: str, config: dict | None = None, same=None):
    """The settings a resumed run goes on with -- the one resume rule of ``train`` and ``finetune``:
    the run's ``recorded`` settings, with this invocation's per-run settings and the may-change
    ones it gives explicitly (:func:`resume_rules`). Every other setting in ``explicit`` must equal
    the record: ``"model.<field>"`` (``"model"``: all of them) against ``config`` (the checkpoint's
    model), ``data`` as an absolute path, and ``same(name, given, recorded)`` where it is given.

    Args:
        run: the run's folder and what was done, for the message (``"runs/x was fine-tuned"``).

    Raises:
        ValueError: every explicit setting that differs from the record, by its flag, and how to go on.
    """
    per_run, may_change = resume_rules(type(settings))
    names = set(explicit) - may_change
    if "model" in names:
        names = (names - {"model"}) | {f"model.{k}" for k in settings.model}
    conflicts = []
    for name in sorted(names):
        key = name.removeprefix("model.")
        mine, theirs = ((settings.model.get(key), (config or {}).get(key)) if name != key
                        else (getattr(settings, key), getattr(recorded, key)))
        a, b = ((absolute_path(mine), absolute_path(theirs)) if key == "data" and None not in (mine, theirs)
                else (mine, theirs))
        if not (same(key, a, b) if same else a == b):
            conflicts.append(f"{flag_name(key)} {_shown(theirs)} (you gave {_shown(mine)})")
    if conflicts:
        raise ValueError(f"the run in {run} with a different config: " + "; ".join(conflicts) + ". Resume with "
                         "the run's own settings (leave those flags out), or start a new run with --out NEW_DIR")
    return dataclasses.replace(recorded, **{n: getattr(settings, n) for n in may_change
                                            if n in explicit or n in per_run})


# ---------------------------------------------------------------------------------------- the model's flags
#: GPTConfig fields with a flag in one command only (``pedestrian train``'s dropout, ``params``' q, k, v biases)
MODEL_EXTRA_HELP = {"dropout": "dropout probability (default 0)",
                    "qkv_bias": "q, k, v biases even with --no-bias (--no-qkv-bias: none, the others as --no-bias says)"}


def add_model_flags(parser, *extra: str):
    """The model flags of ``train``, ``params`` and ``explain``: ``--preset``, ``--arch`` and one
    flag per :data:`~pedestrian.config.CONFIG_HELP` field (and the ``extra`` ones of
    :data:`MODEL_EXTRA_HELP`), made from GPTConfig's fields. Returns their group ("model")."""
    g = parser.add_argument_group("model")
    g.add_argument("--preset", choices=sorted(PRESETS), help="start from a named config")
    g.add_argument("--arch", choices=list(ARCHS), help="gpt2 (default) or llama (RMS norm, SwiGLU, RoPE, "
                   "no biases, n_heads/2 key/value heads); fills the fields not given explicitly")
    add_field_flags(g, GPTConfig, {**CONFIG_HELP, **{k: MODEL_EXTRA_HELP[k] for k in extra}},
                    choices=CONFIG_CHOICES, aliases=CONFIG_SWITCHES)
    return g


def config_from_args(args, base: dict | None = None) -> GPTConfig:
    """A :class:`GPTConfig` from ``--preset``, ``--arch`` and the field flags, over ``base``
    (:func:`~pedestrian.config.merge_config`).

    Raises:
        ValueError: required widths missing (the message names them) or invalid values.
    """
    given = {f: getattr(args, f) for f in GPTConfig.__dataclass_fields__ if getattr(args, f, None) is not None}
    values, _ = merge_config(given, preset=getattr(args, "preset", None), arch=getattr(args, "arch", None), base=base)
    missing = [f for f in ("vocab_size", "context_length", "d_model", "n_heads", "n_blocks") if f not in values]
    if missing:
        raise ValueError("missing model settings: " + ", ".join("--" + m.replace("_", "-") for m in missing)
                         + " (or pass --preset)")
    return GPTConfig(**values)


# ---------------------------------------------------------------------------------------- a settings file
#: TrainSettings fields with a flag / config key (each declared once, above)
TRAIN_KEYS = tuple(name for name, spec in specs(TrainSettings).items() if spec.flag)
#: model keys: GPTConfig fields (their types come from GPTConfig) and a preset name
MODEL_KEYS = tuple(f for f in CONFIG_FIELDS if f != "vocab_size") + ("dropout", "preset", "arch")
_TABLES = ("data", "model", "optim", "train")
#: the type every TOML value must have (that of its flag)
_KINDS = {**{name: specs(TrainSettings)[name].kind for name in TRAIN_KEYS},
          **{name: kind_of(hint) for name, hint in typing.get_type_hints(GPTConfig).items()},
          "preset": str, "arch": str}


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
        # utf-8-sig: a byte-order mark (Windows editors) is dropped, as for corpus files
        raw = tomllib.loads(p.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"config file {p} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
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
            if k in RETIRED_SETTINGS:
                raise ValueError(f"config file {p}: {k!r} was removed ({RETIRED_SETTINGS[k]}); remove it")
            if k not in TRAIN_KEYS and k not in MODEL_KEYS:
                raise ValueError(f"config file {p}: unknown setting {k!r}; known: "
                                 f"{sorted(set(TRAIN_KEYS) | set(MODEL_KEYS))}")
            if k in flat:
                raise ValueError(f"config file {p}: {k!r} is given twice")
            flat[k] = config_value(p, k, v, _KINDS[k])
    return flat


# ---------------------------------------------------------------------------------------- the flag merge
def settings_from_args(args) -> tuple[TrainSettings, set[str]]:
    """``(TrainSettings, explicit setting names)`` from defaults < ``--config`` file < flags: the
    merge of ``pedestrian train``'s parsed arguments (``args``: an ``argparse.Namespace`` whose
    unset flags are ``None``). The explicit names are those :func:`pedestrian.training.train`
    checks against a checkpoint on resume: field names, and ``"model.<field>"`` per model field
    (a preset gives all of its fields).

    Raises:
        TrainingError: ``--vocab-size`` given, or an unknown preset.
        FileNotFoundError / ValueError: the config file (:func:`read_config_file`).
    """
    given = read_config_file(args.config) if getattr(args, "config", None) else {}
    for name in TRAIN_KEYS + MODEL_KEYS:
        value = getattr(args, name, None)
        if value is not None:
            given[name] = value
    if getattr(args, "vocab_size", None) is not None or given.get("vocab_size") is not None:
        raise TrainingError("--vocab-size is set by the tokenizer; leave it out")
    preset, arch = given.pop("preset", None), given.pop("arch", None)
    model_given = {k: given.pop(k) for k in list(given) if k in MODEL_KEYS}
    try:
        model, model_keys = merge_config(model_given, preset=preset, arch=arch, base=DEFAULT_MODEL)
    except ValueError as exc:
        raise TrainingError(str(exc)) from None
    model = {k: v for k, v in model.items() if k != "vocab_size"}
    model.setdefault("dropout", 0.0)                   # (a preset's model: GPTConfig's default)
    for name, spec in specs(TrainSettings).items():     # e.g. --max-minutes 0: no limit
        if spec.none_means is not None and name in given and given[name] == spec.none_means:
            given[name] = None
    settings = TrainSettings(**given, model=model)
    # model fields count as given one by one ("model.d_model"); a preset gives all of its fields
    explicit = set(given) | {f"model.{k}" for k in model_keys - {"vocab_size"}}
    return settings, explicit


def config_file_model(path, vocab_size: int | None = None) -> tuple[GPTConfig, TrainSettings]:
    """The model a ``pedestrian train --config path`` run would build, and the run's settings,
    without building anything: the default model, the file's preset, its model keys; the
    vocabulary ``vocab_size``, else BPE's size setting, else the corpus' characters.

    Raises:
        the errors of :func:`read_config_file`; FileNotFoundError: no corpus (char tokenizer).
    """
    settings, _ = settings_from_args(argparse.Namespace(config=path))
    if vocab_size is None and settings.tokenizer == "bpe":
        vocab_size = settings.bpe_vocab_size
    if vocab_size is None:
        from ..text.data import load_corpus
        from ..text.tokenizer import CharTokenizer

        vocab_size = CharTokenizer.from_text(load_corpus(settings.data)).vocab_size
    return settings.model_config(vocab_size), settings

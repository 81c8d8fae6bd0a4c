"""Each training setting is declared once (pedestrian.training.specs): the flag, the config-file key
and type, the validation message and the checkpointed value all follow from the declaration.
The tests walk every declared setting, so a new one is covered without a new test."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import pytest

from pedestrian.cli import build_parser
from pedestrian.training.settings import settings_from_args
from pedestrian.training.finetune import FinetuneSettings
from pedestrian.training.specs import OPEN_UNIT, POSITIVE_INT, add_flags, check, config_value, flag, setting, specs
from pedestrian.training import PER_RUN_SETTINGS, RESUMABLE_SETTINGS, TrainingError, TrainSettings, read_config_file


def _default(cls, name):
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    return None if f.default_factory is dataclasses.MISSING else f.default_factory()


def _valid_other_value(cls, name):
    """A valid value of the setting that is not its default (derived from the declaration)."""
    spec, default = specs(cls)[name], _default(cls, name)
    if spec.choices:
        candidates = [c for c in spec.choices if c != default]
    elif spec.kind is bool:
        candidates = [not default]
    elif spec.kind is int:
        candidates = [(default or 0) + 1, 2, 7]
    elif spec.kind is float:
        candidates = [(default or 1.0) * 0.5, 0.25, 3.0]
    elif spec.kind is list:
        candidates = [["q"], ["k", "v"]]
    else:
        candidates = ["some/path"]
    instance = cls(**_required(cls))
    for value in candidates:
        if value != default and spec.is_valid(value, instance):
            return value
    raise AssertionError(f"no valid value found for {name}")


def _required(cls):
    return {"hf_dir": "base", "data": "d.txt"} if cls is FinetuneSettings else {}


def _invalid_value(spec):
    return {int: -1, float: math.nan, str: 5, bool: "yes", list: "q", dict: 3}[spec.kind] \
        if not spec.choices else "nope"


def _cli_args(name, spec, value):
    if spec.kind is bool:
        return [flag(("no_" if not value else "") + name)]
    if spec.kind is list:
        return [flag(name), *value]
    return [flag(name), str(value)]


TRAIN_FLAGS = [n for n, s in specs(TrainSettings).items() if s.flag]


@pytest.mark.parametrize("name", TRAIN_FLAGS)
def test_each_train_setting_reaches_the_settings_from_its_flag_and_its_config_key(name, tmp_path, capsys):
    spec = specs(TrainSettings)[name]
    value = _valid_other_value(TrainSettings, name)
    parser = build_parser()
    settings, explicit = settings_from_args(parser.parse_args(["train", *_cli_args(name, spec, value)]))
    assert getattr(settings, name) == value and name in explicit
    assert all(getattr(settings, other) == _default(TrainSettings, other)
               for other in TRAIN_FLAGS if other != name)
    toml = tmp_path / "c.toml"
    literal = {bool: str(value).lower(), str: f'"{value}"'}.get(spec.kind, repr(value))
    toml.write_text(f"[train]\n{name} = {literal}\n", encoding="utf-8")
    assert read_config_file(toml) == {name: value}
    settings, explicit = settings_from_args(parser.parse_args(["train", "--config", str(toml)]))
    assert getattr(settings, name) == value and name in explicit
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    switch = flag(("no_" if spec.kind is bool and _default(TrainSettings, name) else "") + name)
    assert switch in help_text
    if spec.kind is not bool and _default(TrainSettings, name) is not None:
        default = _default(TrainSettings, name)
        text = f"{default:g}" if isinstance(default, float) else str(default)
        assert f"{spec.help} (default {text})" in help_text


@pytest.mark.parametrize("name", [n for n, s in specs(TrainSettings).items()])
def test_each_train_setting_is_validated_with_a_message_naming_its_flag(name):
    spec = specs(TrainSettings)[name]
    bad = _invalid_value(spec)
    with pytest.raises(TrainingError) as info:
        TrainSettings(**{name: bad}).validate()
    assert str(info.value) == f"{flag(name)} must be {spec.words(TrainSettings())}, got {bad!r}"


def test_validation_words_follow_the_rule():
    cases = {"batch_size": (0, "--batch-size must be a positive integer, got 0"),
             "warmup_steps": (-1, "--warmup-steps must be an integer >= 0, got -1"),
             "lr": (math.inf, "--lr must be a finite number > 0, got inf"),
             "min_lr": (0.01, "--min-lr must be in [0, lr=0.002], got 0.01"),
             "val_fraction": (1.0, "--val-fraction must be in (0, 1), got 1.0"),
             "beta2": (1.0, "--beta2 must be in [0, 1), got 1.0"),
             "eps": (0.0, "--eps must be a finite number > 0, got 0.0"),
             "tokenizer": ("words", "--tokenizer must be 'char' or 'bpe', got 'words'"),
             "max_minutes": (math.nan, "--max-minutes must be a finite number > 0, got nan"),
             "progress": (1, "--progress must be true or false, got 1")}
    for name, (bad, message) in cases.items():
        with pytest.raises(TrainingError, match="^" + re.escape(message) + "$"):
            TrainSettings(**{name: bad}).validate()
    TrainSettings(max_minutes=None, stop_step=None, data=None, out=None).validate()   # optional ones


def test_zero_max_minutes_on_the_command_line_and_in_a_config_file_means_no_limit(tmp_path):
    parser = build_parser()
    assert settings_from_args(parser.parse_args(["train", "--max-minutes", "0"]))[0].max_minutes is None
    toml = tmp_path / "c.toml"
    toml.write_text("max_minutes = 0\n")
    assert settings_from_args(parser.parse_args(["train", "--config", str(toml)]))[0].max_minutes is None


def test_checkpointed_settings_round_trip_and_older_checkpoints_get_new_defaults():
    s = TrainSettings(lr=1e-3, model=dict(TrainSettings().model, d_model=32), max_skipped_steps=2)
    assert TrainSettings.from_dict(s.to_dict()) == s
    old = s.to_dict()
    del old["max_skipped_steps"]                       # written before the setting existed
    assert TrainSettings.from_dict(old).max_skipped_steps == 5
    with pytest.raises(TrainingError, match=r"unknown training setting\(s\) \['learning_rate'\]"):
        TrainSettings.from_dict({**s.to_dict(), "learning_rate": 1})


def test_resumable_and_per_run_settings_are_the_declared_tags():
    """The sets the resume logic uses (before the declarations they were written out by hand,
    with the same members; max_skipped_steps is new and resumable; the ranks, the device and the
    exchange timeout belong to one invocation: a run may resume with others; so does recompute,
    which gives the same numbers, with its number of blocks; a run may go on with the other
    array library, --backend, as a fine-tuning run always could; and precision is resumable: a
    float32 run may go on in bf16 and back, its checkpoints being float32 either way)."""
    assert PER_RUN_SETTINGS == {"stop_step", "max_minutes", "progress", "plot", "out", "nproc",
                                "device", "dist_timeout", "check_layers", "recompute",
                                "recompute_blocks", "update_in_backward"}
    assert RESUMABLE_SETTINGS == PER_RUN_SETTINGS | {"max_steps", "eval_interval", "checkpoint_interval",
                                                     "max_skipped_steps", "layer", "backend",
                                                     "precision"}


def test_finetune_resumes_by_the_same_declared_tags():
    """One list of what may change on resume: the tags of the shared declarations (RunSettings)
    mean the same for a fine-tuning run, which adds its own per-run settings (the base folder,
    checked by its SHA-256 instead; --out, --resume, --overwrite). The hand-written list it had
    before held the same names but hf_dir and overwrite (taken from the command then too)."""
    from pedestrian.training.settings import RunSettings, resume_rules

    per_run, may_change = resume_rules(FinetuneSettings)
    shared = set(specs(RunSettings))
    assert per_run & shared == PER_RUN_SETTINGS & shared and may_change & shared == RESUMABLE_SETTINGS & shared
    assert per_run == {"progress", "plot", "recompute", "recompute_blocks", "hf_dir", "out", "resume", "overwrite"}
    assert may_change == per_run | {"max_steps", "eval_interval", "max_skipped_steps", "backend"}


FINETUNE_FLAGS = [n for n, s in specs(FinetuneSettings).items() if s.flag]
REQUIRED = ["--hf-dir", "base", "--data", "d.txt", "--lora-rank", "8"]


@pytest.mark.parametrize("name", FINETUNE_FLAGS)
def test_each_finetune_setting_reaches_the_settings_from_its_flag(name, monkeypatch):
    import pedestrian.training.finetune as finetune_module
    from pedestrian import cli

    spec = specs(FinetuneSettings)[name]
    value = _valid_other_value(FinetuneSettings, name)
    seen, given = [], []

    def fake_finetune(settings, explicit=None):
        seen.append(settings)
        given.append(explicit)
        raise ValueError("stop here")

    monkeypatch.setattr(finetune_module, "finetune", fake_finetune)
    argv = list(REQUIRED)
    if flag(name) in argv:                                   # a required flag: replace its value
        argv[argv.index(flag(name)) + 1] = str(value)
    else:
        argv += _cli_args(name, spec, value)
    assert cli.main(["finetune", *argv]) == 2
    assert seen == [dataclasses.replace(FinetuneSettings(hf_dir="base", data="d.txt", lora_rank=8),
                                        **{name: value})]
    assert given == [frozenset({"hf_dir", "data", "lora_rank", name})]      # what --resume checks


@pytest.mark.parametrize("name", [n for n in specs(FinetuneSettings) if n not in ("hf_dir", "data")])
def test_each_finetune_setting_is_validated_with_a_message_naming_its_flag(name):
    spec = specs(FinetuneSettings)[name]
    bad = _invalid_value(spec)
    settings = FinetuneSettings(hf_dir="b", data="d", **{name: bad})
    with pytest.raises(ValueError, match="^" + flag(name) + " must be "):
        settings.validate()


def test_a_new_setting_needs_only_its_declaration():
    """A settings class of its own: flags (with the default in the help, a --no- switch for a
    True boolean), validation and the config-file type all come from the fields."""
    import argparse

    @dataclass
    class Toy:
        rate: float = setting(0.5, "a rate", rule=OPEN_UNIT, metavar="R", group="g")
        mode: str = setting("a", "a mode", choices=("a", "b", "c"))
        on: bool = setting(True, "switch it off")
        limit: int | None = setting(None, "a limit", kind=int, rule=POSITIVE_INT)

    parser = argparse.ArgumentParser()
    groups = add_flags(parser, Toy)
    assert list(groups) == ["g"]
    args = parser.parse_args(["--rate", "0.25", "--no-on", "--mode", "c"])
    assert (args.rate, args.on, args.mode, args.limit) == (0.25, False, "c", None)
    assert "a rate (default 0.5)" in " ".join(parser.format_help().split())
    assert "--no-on switch it off" in " ".join(parser.format_help().split())
    check(Toy(rate=0.25, mode="c", on=False))
    with pytest.raises(ValueError, match=r"^--rate must be in \(0, 1\), got 2$"):
        check(Toy(rate=2))
    with pytest.raises(ValueError, match="^--mode must be one of a, b, c, got 'd'$"):
        check(Toy(mode="d"))
    assert config_value("t.toml", "rate", 1, float) == 1.0
    with pytest.raises(ValueError, match="^config file t.toml: rate = 'x' must be a number$"):
        config_value("t.toml", "rate", "x", float)
    with pytest.raises(ValueError, match="must be true or false"):
        config_value("t.toml", "on", "no", bool)

"""Settings declared once: name, type, default, help and valid values in one place.

A settings class (:class:`pedestrian.training.TrainSettings`,
:class:`pedestrian.training.finetune.FinetuneSettings`) is a dataclass whose fields are made with
:func:`setting`. Everything else follows from those declarations:

- :func:`check` -- the validation, whose messages name the flag (``--lr must be a finite
  number > 0, got -1``);
- :func:`add_flags` -- the ``argparse`` flags (``--batch-size B``, ``--no-progress``, choices,
  help with the default);
- :func:`config_value` -- the type check of a value read from a TOML settings file;
- ``dataclasses.asdict`` -- the settings a checkpoint records.

Example::

    @dataclass
    class S:
        lr: float = setting(2e-3, "peak learning rate", rule=POSITIVE, group="optimisation")

    check(S(lr=-1))       # ValueError: --lr must be a finite number > 0, got -1
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Rule", "Spec", "setting", "specs", "check", "add_flags", "add_field_flags", "config_value", "kind_of", "flag", "with_defaults",
           "POSITIVE_INT", "NON_NEGATIVE_INT", "POSITIVE", "NON_NEGATIVE", "OPEN_UNIT", "HALF_OPEN_UNIT",
           "NON_ZERO", "PROBABILITY", "at_most"]


@dataclass(frozen=True)
class Rule:
    """The valid values of a setting: ``test(value, settings) -> bool`` and the words that
    complete ``--flag must be ...`` (a string, or a function of the settings)."""

    test: Callable[[Any, Any], bool]
    words: str | Callable[[Any], str]

    def describe(self, settings) -> str:
        return self.words(settings) if callable(self.words) else self.words


POSITIVE_INT = Rule(lambda v, s: v >= 1, "a positive integer")
NON_NEGATIVE_INT = Rule(lambda v, s: v >= 0, "an integer >= 0")
POSITIVE = Rule(lambda v, s: v > 0, "a finite number > 0")
NON_NEGATIVE = Rule(lambda v, s: v >= 0, "a finite number >= 0")
OPEN_UNIT = Rule(lambda v, s: 0 < v < 1, "in (0, 1)")
HALF_OPEN_UNIT = Rule(lambda v, s: 0 <= v < 1, "in [0, 1)")
NON_ZERO = Rule(lambda v, s: v != 0, "a finite non-zero number")
PROBABILITY = Rule(lambda v, s: 0 <= v < 1, "a probability in [0, 1)")


def at_most(other: str) -> Rule:
    """``0 <= value <= settings.<other>`` (e.g. ``min_lr <= lr``)."""
    return Rule(lambda v, s: 0 <= v <= getattr(s, other), lambda s: f"in [0, {other}={getattr(s, other):g}]")


#: what a value of each kind must be, when no rule says more (also the TOML type messages)
_KIND_WORDS = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false",
               list: "a list of strings", dict: "a table"}


@dataclass(frozen=True)
class Spec:
    """One setting's declaration (the ``"spec"`` metadata of its dataclass field).

    Attributes:
        help: one line for ``--help``; the default is appended to it.
        kind: ``int``, ``float``, ``str``, ``bool`` or ``list`` (of strings).
        rule: valid values beyond the kind (``None``: any value of the kind).
        choices: the only valid values (strings).
        optional: ``None`` is valid.
        none_means: a flag / config-file value that stands for ``None`` (``--max-minutes 0``).
        metavar, group: of the flag in ``--help`` (group ``None``: among the general options).
        flag: the setting has a command-line flag and a config-file key.
        required: the flag must be given.
        tags: free labels for the settings class (e.g. ``"resumable"``).
    """

    help: str
    kind: type
    rule: Rule | None = None
    choices: tuple | None = None
    optional: bool = False
    none_means: Any = None
    metavar: str | None = None
    group: str | None = None
    flag: bool = True
    required: bool = False
    tags: frozenset = frozenset()

    def words(self, settings) -> str:
        """What a valid value is, for ``--flag must be <words>``."""
        if self.choices is not None:
            if len(self.choices) == 2:
                return f"{self.choices[0]!r} or {self.choices[1]!r}"
            return "one of " + ", ".join(map(str, self.choices))
        return self.rule.describe(settings) if self.rule else _KIND_WORDS[self.kind]

    def is_valid(self, value, settings) -> bool:
        if value is None:
            return self.optional
        if not _has_kind(value, self.kind):
            return False
        if self.choices is not None and value not in self.choices:
            return False
        return self.rule is None or bool(self.rule.test(value, settings))


def _has_kind(value, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, int)
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    if kind is list:
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    return isinstance(value, kind)


_MISSING = dataclasses.MISSING


def setting(default: Any = _MISSING, help: str = "", *, kind: type | None = None, rule: Rule | None = None,
            choices=None, optional: bool | None = None, none_means: Any = None, metavar: str | None = None,
            group: str | None = None, flag: bool = True, required: bool = False, tags=()) -> Any:
    """A dataclass field carrying its :class:`Spec` (see the module docstring).

    ``kind`` defaults to the type of ``default``; ``optional`` to ``default is None``. A list or
    dict default is copied for every instance. No ``default``: the field is required.
    """
    if kind is None:
        if default is None or default is _MISSING:
            raise TypeError("setting(): give kind= when the default is None or missing")
        kind = list if isinstance(default, (list, tuple)) else type(default)
    spec = Spec(help=help, kind=kind, rule=rule, choices=tuple(choices) if choices is not None else None,
                optional=(default is None) if optional is None else optional, none_means=none_means,
                metavar=metavar, group=group, flag=flag, required=required, tags=frozenset(tags))
    metadata = {"spec": spec}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    if default is _MISSING:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def with_defaults(base, **defaults):
    """A subclass of the settings dataclass ``base`` whose settings named in ``defaults`` default to
    these values instead: their declarations (help, kind, rule, group, tags) stay ``base``'s, and so
    does their place among the fields (``class FinetuneSettings(with_defaults(RunSettings, lr=1e-3))``)."""
    fields = base.__dataclass_fields__
    namespace = {"__annotations__": {name: fields[name].type for name in defaults}}
    for name, value in defaults.items():
        spec = fields[name].metadata["spec"]
        if value is not None and not _has_kind(value, spec.kind):
            raise TypeError(f"with_defaults(): {name} = {value!r} is not {_KIND_WORDS[spec.kind]}")
        namespace[name] = dataclasses.field(default=value, metadata=fields[name].metadata)
    return dataclass(type(base.__name__, (base,), namespace))


def specs(cls) -> dict[str, Spec]:
    """``{field name: Spec}`` of a settings class (or instance), in declaration order."""
    return {f.name: f.metadata["spec"] for f in dataclasses.fields(cls) if "spec" in f.metadata}


def flag(name: str) -> str:
    """``"batch_size"`` -> ``"--batch-size"``."""
    return "--" + name.replace("_", "-")


def check(settings) -> None:
    """Raise ``ValueError`` naming the first invalid setting (by its flag) and its valid values:
    ``--batch-size must be a positive integer, got 0``."""
    for name, spec in specs(settings).items():
        value = getattr(settings, name)
        if not spec.is_valid(value, settings):
            raise ValueError(f"{flag(name)} must be {spec.words(settings)}, got {value!r}")


def _default_text(f: dataclasses.Field) -> str | None:
    if f.default is not _MISSING:
        value = f.default
    elif f.default_factory is not _MISSING:
        value = f.default_factory()
    else:
        return None
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def add_flags(parser, cls, *, groups: dict | None = None, keep_defaults: bool = False) -> dict:
    """Add a flag for every setting of ``cls`` that has one, in groups named by ``Spec.group``
    (the required ones first, the others in declaration order).

    Booleans become switches: ``--no-NAME`` for a setting that defaults to ``True``, ``--NAME``
    for one that defaults to ``False``. A list takes one or more values, and may be repeated
    (the values add up) unless ``keep_defaults``. ``keep_defaults=False`` (the default) gives every flag the
    argparse default ``None``, so a caller can tell which were given; the help names the
    setting's own default either way.

    Args:
        parser: an ``argparse.ArgumentParser``.
        groups: ``{group name: argparse group}`` to add to (created as needed, and returned).

    Returns:
        the groups, by name.
    """
    groups = dict(groups or {})
    for f in sorted(dataclasses.fields(cls), key=lambda f: not getattr(f.metadata.get("spec"), "required", False)):
        spec = f.metadata.get("spec")
        if spec is None or not spec.flag:
            continue
        if spec.group is None:
            group = parser
        else:
            if spec.group not in groups:
                groups[spec.group] = parser.add_argument_group(spec.group)
            group = groups[spec.group]
        default = None if spec.required else _default_text(f)
        help_text = spec.help + (f" (default {default})" if default is not None else "")
        kw: dict = {"dest": f.name, "help": help_text}
        if spec.kind is bool:
            on = f.default is True
            kw.update(action="store_false" if on else "store_true", default=f.default if keep_defaults else None)
            group.add_argument(flag(("no_" if on else "") + f.name), **kw)
            continue
        if keep_defaults and f.default is not _MISSING:
            kw["default"] = f.default
        elif keep_defaults and f.default_factory is not _MISSING:
            kw["default"] = f.default_factory()
        if spec.kind is list:                          # --flag a b, and --flag a --flag b alike
            kw.update(nargs="+", action="extend" if kw.get("default") is None else "store")
        else:
            kw["type"] = spec.kind
        if spec.choices is not None:
            kw["choices"] = list(spec.choices)
        if spec.metavar:
            kw["metavar"] = spec.metavar
        if spec.required:
            kw["required"] = True
        group.add_argument(flag(f.name), **kw)
    return groups


def add_field_flags(group, cls, helps: dict, *, choices: dict | None = None, aliases: dict | None = None) -> None:
    """A flag for each field ``helps`` names (``{field: help}``) of the dataclass ``cls``, declared
    elsewhere (:class:`~pedestrian.config.GPTConfig`'s): the type from the field's type hint
    (:func:`kind_of`), ``choices`` by field; a bool is a switch -- ``--no-NAME`` for a field that
    defaults to ``True`` (with its ``aliases``, e.g. ``--untied``), ``--NAME`` for ``False``, both
    for ``None``. Every flag's argparse default is ``None`` (not given)."""
    hints, choices, aliases = typing.get_type_hints(cls), choices or {}, aliases or {}
    for name, help_text in helps.items():
        kind, default = kind_of(hints[name]), cls.__dataclass_fields__[name].default
        if kind is bool:
            if default is not True:
                group.add_argument(flag(name), dest=name, action="store_true", default=None, help=help_text)
            if default is not False:
                group.add_argument(flag("no_" + name), *[a for a in [aliases.get(name)] if a], dest=name,
                                   action="store_false", default=None,
                                   help=help_text if default else f"not {flag(name)}")
            continue
        group.add_argument(flag(name), dest=name, type=kind, help=help_text,
                           **({"choices": list(choices[name])} if name in choices else {}))


def kind_of(hint) -> type:
    """The kind (``int``, ``float``, ``str``, ``bool``, ``list``) of a type hint such as
    ``int | None`` (for fields declared elsewhere, e.g. :class:`~pedestrian.config.GPTConfig`'s)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args:
        return kind_of(args[0])
    origin = typing.get_origin(hint) or hint
    return list if origin in (list, tuple) else origin


def config_value(path, key: str, value, kind: type):
    """A value read from a settings file, checked to have ``kind`` (floats also accept integers
    and become floats); else ``ValueError``: ``config file PATH: KEY = VALUE must be a number``."""
    expected = {bool: "true or false (a TOML boolean, no quotes)", int: "an integer", float: "a number",
                str: 'a string (in quotes, e.g. "text")', list: "a list of strings"}[kind]
    if kind is float:
        valid = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        valid = _has_kind(value, kind)
    if not valid:
        raise ValueError(f"config file {path}: {key} = {value!r} must be {expected}")
    if kind is float:
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"config file {path}: {key} = {value!r} must be a finite number")
    return value

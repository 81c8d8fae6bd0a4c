"""The ``pedestrian`` command line: thin; parses, calls the library, prints.

Each subcommand lives in ``pedestrian/commands/<name>.py`` and exposes
``add_arguments(parser)`` and ``run(args) -> int``. Errors the user can fix (bad input, a
missing file) end with a one-line ``error: ...`` message and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand -> (module under pedestrian.commands, one-line help)
COMMANDS = {
    "params": ("params", "print the parameter table of a config or preset (no allocation)"),
    "demo": ("demo", "forward/backward on real text and a gradient check of every layer"),
    "train": ("train", "train a GPT on a text corpus (default: the bundled Shakespeare)"),
    "eval": ("evaluate", "validation loss of a checkpoint"),
    "sample": ("sample", "generate text from a checkpoint or a Hugging Face GPT-2 directory"),
    "finetune": ("finetune", "LoRA fine-tuning of a Hugging Face GPT-2 directory"),
    "export-hf": ("export_hf", "write a checkpoint as a Hugging Face GPT-2 directory"),
}


class UserError(Exception):
    """An error caused by the user's input; printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pedestrian",
        description="A GPT with hand-derived backpropagation (Deep learning for pedestrians).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        try:
            mod = importlib.import_module(f"pedestrian.commands.{module}")
        except ModuleNotFoundError as exc:
            if exc.name == f"pedestrian.commands.{module}":
                continue  # command not built yet
            raise
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pedestrian`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (UserError, ValueError, TypeError, FileNotFoundError, IsADirectoryError,
            NotADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The ``pedestrian`` command line: thin; parses, calls the library, prints.

Each subcommand lives in ``pedestrian/commands/<name>.py`` and exposes
``add_arguments(parser)`` and ``run(args) -> int``. Errors the user can fix (bad input, a
missing file) end with a one-line ``error: ...`` message and exit status 2, never a traceback.
The same holds for two environment problems: a missing optional dependency (``ImportError``,
e.g. ``--backend torch`` without PyTorch: the message says ``pip install -e ".[torch]"``) and a
model too large for memory (``MemoryError``: choose smaller widths). ``Ctrl-C`` / ``SIGTERM``
end with exit status 130 (``pedestrian train`` first saves a checkpoint; see its help).

Environment:
  PEDESTRIAN_DEBUG=1   re-raise those errors with their full traceback (for developers).
"""

from __future__ import annotations

import argparse
import importlib
import os
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
    "explain": ("explain", "the paper's table: every a_i and Δ_i with shape, formula, FLOPs and memory"),
    "attention": ("attention", "PNG of the attention weights of every block and head for a prompt"),
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


def _import_error_message(exc: ImportError) -> str:
    """One line for a missing module: PyTorch is the optional ``torch`` extra."""
    names = {exc.name or ""}
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, ImportError):
        names.add(cause.name or "")
    if any(n.split(".")[0] == "torch" for n in names) or "torch" in str(exc).lower():
        return ('PyTorch is not installed, and --backend torch (or this file) needs it: install it with '
                'pip install -e ".[torch]", or use the default --backend numpy')
    what = exc.name or str(exc)
    return f"a required module is missing ({what}): reinstall pedestrian with pip install -e ."


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pedestrian`` console script; returns the exit status.

    Errors the user can fix print one ``error: ...`` line and return 2 (see the module
    docstring); ``PEDESTRIAN_DEBUG=1`` in the environment re-raises them instead.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = os.environ.get("PEDESTRIAN_DEBUG", "") not in ("", "0")
    try:
        return int(args._run(args) or 0)
    except (UserError, ValueError, TypeError, FileNotFoundError, IsADirectoryError,
            NotADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        if debug:
            raise
        print(f"error: {_import_error_message(exc)}", file=sys.stderr)
        return 2
    except MemoryError as exc:
        if debug:
            raise
        detail = str(exc).splitlines()[0] if str(exc) else "out of memory"
        print(f"error: the model is too large for this machine's memory ({detail}); choose smaller "
              "widths (--d-model, --n-blocks, --context-length, --batch-size) or a smaller --preset",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

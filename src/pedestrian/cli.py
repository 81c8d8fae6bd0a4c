"""The ``pedestrian`` command line: thin; parses, calls the library, prints.

Each subcommand lives in ``pedestrian/commands/<name>.py`` and exposes
``add_arguments(parser)`` and ``run(args) -> int``. Errors the user can fix (bad input, a
missing file) end with a one-line ``error: ...`` message and exit status 2 (1: a failed gradient
check of a plugged layer, as `pedestrian check` exits), never a traceback.
The same holds for three environment problems: a missing optional dependency (``ImportError``,
e.g. ``--backend torch`` without PyTorch: the message says ``pip install -e ".[torch]"``), a
model too large for memory (``MemoryError``: choose smaller widths), and a write the OS refuses
(:class:`pedestrian.atomic.WriteError`, or any ``OSError`` for no space, disk quota, file too
large, no permission or a read-only file system: the message says what was kept and how to go
on; nothing written before is damaged, see :mod:`pedestrian.atomic`). ``Ctrl-C`` / ``SIGTERM``
end with exit status 130 (``pedestrian train`` first saves a checkpoint; see its help).
A closed stdout (``pedestrian sample | head``) ends any other command quietly with status 141,
what a shell reports for a command stopped by ``SIGPIPE``.

The library's messages (the ``logging`` loggers ``pedestrian.*``) are printed as plain lines:
information on stdout, warnings on stderr as ``warning: ...``, both through ``tqdm.write`` so a
progress bar stays whole. If stdout closes (``pedestrian train | head``), later lines are
dropped and a running training loop stops as on ``Ctrl-C`` (it saves a checkpoint first).

Environment:
  PEDESTRIAN_DEBUG=1   re-raise those errors with their full traceback (for developers).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import logging
import os
import sys

from .atomic import WriteError

#: subcommand -> (module under pedestrian.commands, one-line help)
COMMANDS = {
    "params": ("params", "print the parameter table of a config or preset (no allocation)"),
    "demo": ("demo", "forward/backward on real text and a gradient check of every layer; --head: one "
                     "attention head on numbers, every matrix"),
    "train": ("train", "train a GPT on a text corpus (default: the bundled Shakespeare)"),
    "eval": ("evaluate", "validation loss of a checkpoint"),
    "sample": ("sample", "generate text from a checkpoint or a Hugging Face directory"),
    "finetune": ("finetune", "LoRA (or DPO) fine-tuning of a Hugging Face directory"),
    "export-hf": ("export_hf", "write a checkpoint as a Hugging Face directory of its family, or adapters as PEFT files"),
    "explain": ("explain", "the paper's table: every a_i and Δ_i with shape, formula, FLOPs and memory"),
    "attention": ("attention", "PNG of the attention weights of every block and head for a prompt "
                               "(--gradients: beside Δcausal; --random: no checkpoint needed)"),
    "check": ("check", "check the hand-written backward of your own layer (a NumPy module) tensor by tensor"),
}


#: errno of an OSError that is the environment's doing (reported in one line, never a traceback)
_WRITE_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", -1), errno.EFBIG, errno.EACCES,
                           errno.EPERM, errno.EROFS})


class UserError(Exception):
    """An error caused by the user's input; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line errors: a flag it cannot parse (``--max-steps many``)
    prints ``error: ...`` naming the command and where its flags are listed, not the usage block."""

    def error(self, message: str):
        from .training.settings import RETIRED_SETTINGS

        for name, why in RETIRED_SETTINGS.items():        # a removed flag: say so, and what replaced it
            flag = "--" + name.replace("_", "-")
            if flag in message:
                message += f" ({flag} was removed: {why})"
        if "--precision" in message and any(f"'{half}'" in message for half in ("fp16", "float16", "half")):
            message += " (float16 needs a loss scale, which pedestrian does not have: use --precision bf16)"
        self.exit(2, f"error: {self.prog}: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pedestrian",
        description="A GPT with hand-derived backpropagation (Deep learning for pedestrians).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parser.commands = {}                           # name -> its parser (for errors that name it)
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
        p.set_defaults(run_command=mod.run)
        parser.commands[name] = p
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


class ConsoleHandler(logging.Handler):
    """Log records as plain lines: below WARNING to stdout, WARNING and above to stderr with a
    ``warning: `` (``error: ``) prefix, through ``tqdm.write`` (a progress bar on stderr is
    redrawn below them). A closed stdout (``BrokenPipeError``) points file descriptor 1 at
    ``/dev/null`` and calls :func:`pedestrian.training.loop.request_stop`."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            text = record.getMessage()
        except Exception:  # pragma: no cover - a malformed record
            self.handleError(record)
            return
        if record.levelno >= logging.WARNING:
            prefix = "error: " if record.levelno >= logging.ERROR else "warning: "
            tqdm.write(prefix + text, file=sys.stderr)
            return
        try:
            tqdm.write(text, file=sys.stdout)
            sys.stdout.flush()
        except BrokenPipeError:             # its reader went away: stop between steps, as Ctrl-C
            silence_stdout()
            from .training.loop import request_stop

            request_stop("stdout closed")


def silence_stdout() -> None:
    """Point file descriptor 1 at ``/dev/null`` (its reader went away: later writes, including
    the interpreter's final flush, must not raise ``BrokenPipeError``)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # pragma: no cover - no real stdout
        pass


@contextlib.contextmanager
def console_logging(level: int = logging.INFO):
    """While inside, the ``pedestrian`` loggers print through a :class:`ConsoleHandler` (and do
    not propagate further); the previous handlers, level and propagation come back after."""
    logger = logging.getLogger("pedestrian")
    handler = ConsoleHandler()
    saved = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _error(message: str, exc: BaseException) -> int:
    """Print ``error: message`` (exit status 2, or the exception's ``exit_status``). A rank of several (torchrun, ``--nproc``) also
    records it for the launcher, and prints it only as rank 0 of a torchrun job: under
    ``pedestrian train --nproc`` the launcher prints one line for the whole run."""
    from .training.distributed import CommunicationError, launched_rank, record_error, reports_to_launcher

    status = getattr(exc, "exit_status", 2)            # 1: a check that failed (pedestrian.training.plugged)
    if launched_rank():
        record_error(message, lost_contact=isinstance(exc.__cause__, CommunicationError))
        if reports_to_launcher() or os.environ.get("RANK") != "0":
            return status
    print(f"error: {message}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pedestrian`` console script; returns the exit status.

    Errors the user can fix print one ``error: ...`` line and return 2 (see the module
    docstring); ``PEDESTRIAN_DEBUG=1`` in the environment re-raises them instead. Any other
    exception propagates (a traceback); a rank of several records it for the launcher first.
    """
    try:
        return _main(argv)
    except Exception as exc:
        _record_crash(exc)
        raise


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:                                    # named by the command's parser: its --help lists the flags
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    args.argv = list(sys.argv[1:] if argv is None else argv)   # pedestrian train --nproc re-runs it per rank
    debug = os.environ.get("PEDESTRIAN_DEBUG", "") not in ("", "0")
    try:
        with console_logging():
            return int(args.run_command(args) or 0)
    except (UserError, ValueError, TypeError, FileNotFoundError, IsADirectoryError,
            NotADirectoryError, PermissionError, UnicodeDecodeError, WriteError) as exc:
        if debug:
            raise
        return _error(str(exc), exc)
    except BrokenPipeError:
        # stdout's reader went away (`pedestrian sample | head`): end quietly, with the status a
        # shell reports for a command stopped by SIGPIPE (`yes | head`); nothing to say or keep
        if debug:
            raise
        silence_stdout()
        return 128 + 13
    except OSError as exc:
        if debug or exc.errno not in _WRITE_ERRNOS:
            raise
        return _error(str(exc), exc)
    except ImportError as exc:
        if debug:
            raise
        return _error(_import_error_message(exc), exc)
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


def _record_crash(exc: Exception) -> None:
    """A rank of several that raises an unexpected exception writes it for the launcher before
    its traceback is printed: a rank killed while exiting (the launcher stops the others as soon
    as one ends) is then still reported by its real cause."""
    from .training.distributed import CommunicationError, launched_rank, record_error

    if not launched_rank():
        return
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    what = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
    record_error(f"rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')} raised {what[:300]} (its traceback "
                 "is printed above)", lost_contact=isinstance(exc, CommunicationError), crashed=True)


if __name__ == "__main__":
    sys.exit(main())

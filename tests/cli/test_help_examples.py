"""Every ``pedestrian ...`` example in a command's ``--help`` parses as written.

The examples are the first thing a new user copies; one that needs a flag it does not show (the
SmolLM2 fine-tuning example without the required ``--lora-rank``) fails on its first run.
"""

import importlib
import shlex

import pytest

from pedestrian.cli import COMMANDS, build_parser


def _examples():
    for name, (module, _) in COMMANDS.items():
        doc = importlib.import_module(f"pedestrian.commands.{module}").__doc__ or ""
        for line in doc.replace("\\\n", " ").splitlines():      # join continued lines
            line = line.strip()
            if line.startswith("pedestrian "):
                yield pytest.param(line, id=f"{name}: {line[:60]}")


@pytest.mark.parametrize("line", list(_examples()))
def test_help_example_parses(line):
    try:
        build_parser().parse_args(shlex.split(line, comments=True)[1:])
    except SystemExit as exc:                    # argparse's way of refusing the line
        pytest.fail(f"`{line}` does not parse (exit {exc.code})")


def test_there_are_examples():
    assert len(list(_examples())) >= 20          # the scan above reads every command's help


@pytest.mark.parametrize("argv", [["explain", "--data", "x"], ["params", "--preset", "gpt2", "--max-steps", "3"]])
def test_an_unknown_flag_points_at_its_command_help(argv, capsys):
    from pedestrian.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: pedestrian {argv[0]}: unrecognized arguments: ") and "\n" not in err
    assert err.endswith(f"see `pedestrian {argv[0]} --help`")      # not the top-level list of commands

"""``pedestrian check LAYER.py`` (issue 34): one line per tensor; exit status 0 when every
tensor passes, 1 when one fails, 2 on a usage error (one ``error: ...`` line)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import one_line_error

from pedestrian.cli import main

REPO = Path(__file__).resolve().parents[2]
LAYERS = Path(__file__).resolve().parent / "layers"


def test_documented_example_passes(capsys):
    assert main(["check", str(REPO / "docs" / "examples" / "dyt.py"), "--no-autograd"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:5]] == ["x", "w", "b", "alpha"]
    assert all(line.endswith("pass") for line in lines[1:5]) and lines[-1] == "all gradients agree"


def test_a_wrong_gradient_exits_1_and_names_it(capsys):
    assert main(["check", str(LAYERS / "dyt_wrong_alpha.py"), "--no-autograd"]) == 1
    lines = capsys.readouterr().out.splitlines()
    verdicts = {line.split()[0]: "FAIL" in line for line in lines[1:5]}
    assert verdicts == {"x": False, "w": False, "b": False, "alpha": True}
    assert lines[-1] == "FAILED: 1 of 4 tensor(s)"


def test_nan_in_a_backward_exits_1(capsys):
    assert main(["check", str(LAYERS / "nan_backward.py"), "--no-autograd", "--no-complex-step"]) == 1
    assert "FAIL: backward returned 1 NaN, 0 inf of 3 values" in capsys.readouterr().out


@pytest.mark.parametrize("args,expected", [
    (["no_backward.py"], "defines no backward()"),
    (["raises_on_import.py"], "raised AttributeError"),
    (["missing.py"], "no layer module"),
    (["dyt_wrong_alpha.py", "--max-entries", "0"], "--max-entries must be a positive integer"),
])
def test_usage_errors_exit_2(capsys, args, expected):
    assert main(["check", str(LAYERS / args[0]), *args[1:]]) == 2
    assert expected in one_line_error(capsys)

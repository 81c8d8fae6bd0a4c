"""Shared by the CLI tests: the one-line error rule of every command."""

from __future__ import annotations


def one_line_error(capsys) -> str:
    """The captured stderr, asserted to be exactly one ``error: ...`` line; returns it."""
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: "), err
    assert "\n" not in err, err
    return err

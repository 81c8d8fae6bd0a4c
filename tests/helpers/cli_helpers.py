"""Shared by the CLI tests: the one-line error rule of every command."""

from __future__ import annotations


def one_line_error(capsys) -> str:
    """The captured stderr, asserted to be exactly one ``error: ...`` line; returns it.

    The compile notice (``pedestrian: compiled N fast kernels ...``, kernels/jit.py) is left out:
    it comes from a timer a second after a first compile ends, so on a cold numba cache it can
    land in whichever call runs next in the same process."""
    err = "\n".join(line for line in capsys.readouterr().err.splitlines()
                     if not line.startswith("pedestrian: compiled ")).strip()
    assert err.startswith("error: "), err
    assert "\n" not in err, err
    return err


def break_layernorm_backward(monkeypatch) -> None:
    """Make the fast layer-norm backward wrong by 0.1 % in ``dw`` (a gradient the demo's checks
    must catch)."""
    import pedestrian.kernels as fast

    real = fast.layernorm_backward

    def wrong(delta, cache, *, dweight=None, dbias=None):
        out = real(delta, cache, dweight=dweight, dbias=dbias)
        if dweight is not None:
            dweight *= 1.001
        return out

    monkeypatch.setattr(fast, "layernorm_backward", wrong)

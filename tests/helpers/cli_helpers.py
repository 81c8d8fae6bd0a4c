"""Shared by the CLI tests: the one-line error rule of every command, and a tiny text corpus."""

from __future__ import annotations

from pathlib import Path


def fox_text(n_lines: int) -> str:
    """A tiny corpus: ``n_lines`` numbered lines of the pangram "the quick brown fox jumps over the
    lazy dog" (so a char tokenizer built from it knows every lowercase letter)."""
    return "\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(n_lines))


def write_fox_corpus(path: Path, n_lines: int) -> Path:
    """Write :func:`fox_text` ``(n_lines)`` to ``path`` (UTF-8); return ``path``."""
    path.write_text(fox_text(n_lines), encoding="utf-8")
    return path


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
    must catch): both entries of the kernel table that run it, the norm alone and the skip fused
    in front of it (``add_layernorm_backward``)."""
    break_norm_backward(monkeypatch, "layernorm")


def break_norm_backward(monkeypatch, norm: str) -> None:
    """``dweight`` of the fast ``<norm>_backward`` and ``add_<norm>_backward`` times 1.001."""
    import pedestrian.kernels as fast

    def wrong(real):
        def call(*args, dweight=None, **kwargs):
            out = real(*args, dweight=dweight, **kwargs)
            if dweight is not None:
                dweight *= 1.001
            return out
        return call

    for name in (f"{norm}_backward", f"add_{norm}_backward"):
        monkeypatch.setattr(fast, name, wrong(getattr(fast, name)))


def ctrl_c_at_step(monkeypatch, n: int) -> None:
    """Make the training loop receive SIGINT (Ctrl-C) during its ``n``-th step (1-based), as a user
    pressing Ctrl-C would: the loop finishes that step, saves and stops."""
    import os
    import signal

    import pedestrian.training.loop as loop_module

    real, calls = loop_module.train_step, [0]

    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop_module, "train_step", step)

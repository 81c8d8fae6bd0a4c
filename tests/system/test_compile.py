"""The fast kernels' compilation (numba): on first use only, once per machine, said once, and
never a requirement (issue 23, "Compilation a user never waits for twice").

- importing pedestrian compiles nothing (no numba dispatcher is made, numba is not imported);
- a first run in a fresh cache folder compiles and says so in one stderr line; a second run in
  the same folder loads the kernels from it and says nothing;
- a read-only copy of the package still runs the fast kernels (numba falls back to its
  user-wide cache folder);
- without numba, ``GPT(kernels="fast")`` runs the reference kernels after one clear warning.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import pedestrian

SRC = Path(pedestrian.__file__).resolve().parent.parent

#: one fast training step of a tiny model, float32 (every row kernel, both GELUs' one)
STEP = """
import numpy as np
from pedestrian.config import GPTConfig
from pedestrian.model import GPT
from pedestrian.training.optim import AdamW
m = GPT(GPTConfig(vocab_size=11, context_length=8, d_model=8, n_heads=2, n_blocks=1), kernels="fast")
tokens = np.arange(16).reshape(2, 8) % 11
loss = m.loss(tokens, (tokens + 1) % 11)
m.backward()
AdamW(m).step()
print("kernels", m.kernels_name, "loss", float(loss))
"""


def _run(code: str, env_extra: dict, pythonpath: Path = SRC) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env.update(PYTHONPATH=str(pythonpath), PEDESTRIAN_NUM_THREADS="1", **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


def test_import_compiles_nothing():
    """Not even a numba dispatcher is made (they are made at a kernel's first call); numba is
    not imported (tests/system/test_deploy.py checks that nothing is written either)."""
    code = ("import sys\n"
            "import pedestrian, pedestrian.kernels, pedestrian.training.optim, pedestrian.model\n"
            "from pedestrian.kernels import jit, layernorm\n"
            "assert isinstance(layernorm._forward, jit._Parallel), 'no kernels registered?'\n"
            "print(len(jit.dispatchers()), 'numba' in sys.modules)\n")
    r = _run(code, {})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "False"]


def test_first_run_says_once_that_it_compiles_and_later_runs_load_the_cache(tmp_path):
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    first = _run(STEP, env)
    assert first.returncode == 0, first.stderr
    lines = [line for line in first.stderr.splitlines() if "compiled" in line]
    assert len(lines) == 1 and lines[0].startswith("pedestrian: compiled ") and " s (first use" in lines[0], first.stderr
    assert "compiling" not in first.stderr                                 # (a terminal's line only)
    assert "kernels fast" in first.stdout
    assert any((tmp_path / "cache").rglob("*.nbi"))                       # numba's cache index
    second = _run(STEP, env)
    assert second.returncode == 0, second.stderr
    assert "compiled" not in second.stderr and "compiling" not in second.stderr, second.stderr
    assert second.stdout == first.stdout                                 # the same loss


#: root writes through permission bits: there the subprocess is refused writes into the copy the
#: way the OS refuses everyone else (numba probes a folder with a temporary file)
REFUSE_WRITES = """
import os, tempfile
_temporary_file = tempfile.TemporaryFile
def _refuse(*args, dir=None, **kwargs):
    if dir is not None and os.path.realpath(dir).startswith({copy!r}):
        raise PermissionError(13, "Permission denied", dir)
    return _temporary_file(*args, dir=dir, **kwargs)
tempfile.TemporaryFile = _refuse
"""


def test_a_read_only_package_folder_runs_from_numbas_user_wide_cache(tmp_path):
    copy = tmp_path / "site"
    shutil.copytree(SRC / "pedestrian", copy / "pedestrian", ignore=shutil.ignore_patterns("__pycache__"))
    for path in [copy, *copy.rglob("*")]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    code = (REFUSE_WRITES.format(copy=str(copy.resolve())) if os.geteuid() == 0 else "") + STEP
    try:
        r = _run(code, {"XDG_CACHE_HOME": str(tmp_path / "user-cache"), "PYTHONDONTWRITEBYTECODE": "1"},
                 pythonpath=copy)
        assert r.returncode == 0, r.stderr
        assert "kernels fast" in r.stdout
        assert any((tmp_path / "user-cache").rglob("*.nbi")), r.stderr
        assert not any(copy.rglob("*.nbi"))
    finally:
        for path in [copy, *copy.rglob("*")]:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)


def test_without_numba_the_fast_kernels_fall_back_to_the_reference_after_one_warning():
    code = ("import sys, warnings\n"
            "sys.modules['numba'] = None\n"
            "warnings.simplefilter('always')\n" + STEP +
            "m2 = GPT(m.config, kernels='fast')\n"
            "print('kernels2', m2.kernels_name)\n")
    r = _run(code, {})
    assert r.returncode == 0, r.stderr
    assert "kernels reference" in r.stdout and "kernels2 reference" in r.stdout
    warnings = [line for line in r.stderr.splitlines() if "numba cannot be imported" in line]
    assert len(warnings) == 1, r.stderr


def test_a_terminal_is_told_before_the_first_compile(monkeypatch):
    """On a terminal the first compile of our kernels is announced as it starts (the first step
    waits for it), once; numba's compiles of other code are not announced."""
    import io

    from pedestrian.kernels import jit

    if not jit.AVAILABLE:
        pytest.skip("numba is not installed")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    class Event:
        def __init__(self, dispatcher):
            self.data = {"dispatcher": dispatcher}

    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    notice = jit._CompileNotice()
    notice.on_start(Event(object()))                  # someone else's function: nothing said
    notice.on_end(Event(object()))
    assert term.getvalue() == ""
    ours = jit._touch.dispatcher()                    # (made, not compiled)
    for _ in range(2):
        notice.on_start(Event(ours))
        notice.depth = 0
    assert term.getvalue().count("pedestrian: compiling the fast kernels") == 1

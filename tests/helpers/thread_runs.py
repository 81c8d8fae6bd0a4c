"""A test run again in a fresh interpreter whose thread pools are those of a machine with a given
number of threads: the property tests' 1- and 2-thread runs (numba's threads, the BLAS's and
OpenMP's are set once per process, so each count needs a process of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def run_with_threads(test_file: str, test: str, threads: int, env: dict) -> subprocess.CompletedProcess:
    """``pytest test_file::test`` in a new interpreter with ``PEDESTRIAN_NUM_THREADS``,
    ``OPENBLAS_NUM_THREADS`` and ``OMP_NUM_THREADS`` = ``threads`` and the variables ``env``
    (the switch that makes ``test`` run); asserts that it ran and passed, and returns it."""
    env = dict(os.environ, **env, PEDESTRIAN_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               OMP_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-x",
                           f"{test_file}::{test}"], env=env, capture_output=True, text=True, timeout=1200,
                          cwd=str(SRC.parent))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout, proc.stdout[-2000:]
    return proc

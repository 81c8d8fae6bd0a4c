"""The package as a user installs it: ``python -m build`` makes the wheel, the wheel goes into a
fresh virtual environment, and ``pedestrian train`` runs there from another folder on the
corpus that ships inside the wheel.

Offline and quick: the fresh environment gets no downloads; a ``.pth`` file lists this
interpreter's site-packages folders, so numpy, numba, ... are found there. A path in a ``.pth``
file is added to ``sys.path`` without reading that folder's own ``.pth`` files, so an editable
install of pedestrian in the test environment stays invisible and the import must come from
the wheel (asserted).
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(cmd, cwd, env=None, timeout=300):
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``python -m build`` makes from a copy of the source tree (the checkout is left
    clean: no build/ or egg-info)."""
    src = tmp_path_factory.mktemp("source")
    ignore = shutil.ignore_patterns("__pycache__", ".pedestrian_cache", "*.egg-info")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=ignore)
    out = tmp_path_factory.mktemp("dist")
    # the build back end of this environment (no isolated environment: that would download)
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--skip-dependency-check",
          "--outdir", str(out)], cwd=src)
    (whl,) = out.glob("pedestrian-*.whl")
    return whl


def test_wheel_holds_the_corpus(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    texts = [n for n in names if n.startswith("pedestrian/text/corpus/shakespeare/") and n.endswith(".txt")]
    assert len(texts) == 42, texts
    assert "pedestrian/text/corpus/shakespeare/PROVENANCE.md" in names
    assert not [n for n in names if ".pedestrian_cache" in n or n.startswith("tests/")]


def test_installed_wheel_trains_from_another_folder(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    bin_dir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / ("python.exe" if os.name == "nt" else "python")
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=tmp_path).stdout.strip())
    outer = [p for p in site.getsitepackages() + [site.getusersitepackages()] if Path(p).is_dir()]
    (purelib / "outer_site_packages.pth").write_text("\n".join(outer) + "\n", encoding="utf-8")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
          "--no-index", str(wheel)], cwd=tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PEDESTRIAN_CACHE"] = str(tmp_path / "cache")
    where = _run([str(python), "-c", "import pedestrian; print(pedestrian.__file__)"], cwd=elsewhere, env=env)
    assert Path(where.stdout.strip()).resolve().is_relative_to(env_dir.resolve()), where.stdout

    script = bin_dir / ("pedestrian.exe" if os.name == "nt" else "pedestrian")
    run = _run([str(script), "train", "--max-steps", "3", "--batch-size", "2", "--context-length", "16",
                "--d-model", "16", "--n-heads", "2", "--n-blocks", "1", "--eval-interval", "3",
                "--eval-batches", "1", "--no-progress", "--no-plot", "--no-sample",
                "--out", "run"], cwd=elsewhere, env=env)
    assert (elsewhere / "run" / "log.jsonl").is_file(), run.stdout + run.stderr
    assert "shakespeare" in run.stdout + run.stderr

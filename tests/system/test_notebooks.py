"""The walkthrough notebooks (``notebooks/*.ipynb``, issue 25) run headless from top to bottom.

Each notebook is executed with ``nbclient`` on the ``python3`` kernel (ipykernel; jupyter_client
runs it with this interpreter), matplotlib on Agg, the kernel finding the same ``pedestrian`` as
the tests (its source folder put first on ``PYTHONPATH``). A cell that raises fails the test.
The copies in the repository must keep their outputs (they are read on the repository page), and
the code must use the library's public API only (no ``_private`` names).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import ipykernel  # noqa: F401  (the kernel; all three come with the test extra: a missing one fails)
import nbclient
import nbformat
import pytest

import pedestrian

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
#: per cell; the slowest (the KV-cache timing) takes a few seconds on two busy cores
CELL_TIMEOUT_S = 240


def test_the_walkthrough_exists():
    assert [p.name for p in NOTEBOOKS] == ["01_one_attention_head.ipynb", "02_the_whole_gpt.ipynb",
                                           "03_llama_blocks.ipynb", "04_your_own_layer.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_headless(path, monkeypatch):
    src = str(Path(pedestrian.__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()                                  # raises CellExecutionError on a failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_keeps_its_outputs_and_uses_the_public_api(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs for c in code[1:]), "execute the notebook and save it with its outputs"
    assert all(c.execution_count for c in code)
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    for c in code:
        assert not re.search(r"\bimport\s+_|\._[a-z]\w*", c.source), c.source
    assert nb.metadata["kernelspec"]["name"] == "python3"

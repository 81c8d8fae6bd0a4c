"""The walkthrough's documents link to things that exist (issue 25, item 6): every relative link of
docs/EQUATIONS.md, notebooks/README.md and the notebooks' markdown names a file of the repository
(none points outside it, as the old ``seed/`` link did), and every ``#anchor`` names a heading of
its page. The Rosetta stone's JSON keys are those ``pedestrian demo --head --json`` prints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def documents():
    yield REPO / "docs" / "EQUATIONS.md", (REPO / "docs" / "EQUATIONS.md").read_text(encoding="utf-8")
    yield REPO / "notebooks" / "README.md", (REPO / "notebooks" / "README.md").read_text(encoding="utf-8")
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        yield nb, "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


@pytest.mark.parametrize("path,text", list(documents()), ids=lambda v: v.name if isinstance(v, Path) else "")
def test_relative_links_resolve(path, text):
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{path.name}: {target}"
        assert REPO in dest.parents or dest == REPO, f"{path.name}: {target} leaves the repository"
        if anchor:
            assert anchor in anchors(dest.read_text(encoding="utf-8")), f"{path.name}: #{anchor}"


def test_equations_sheet_is_the_rosetta_stone():
    from pedestrian.paper.walkthrough import HEAD_KEYS

    text = (REPO / "docs" / "EQUATIONS.md").read_text(encoding="utf-8")
    assert "](seed/" not in text and "`seed/`" not in text.replace("`../shared/seed/`", "")
    stone = text.split("## Rosetta stone", 1)[1]
    for key in HEAD_KEYS:                           # every --json key is mapped to the paper
        if key in ("x", "delta") or key.startswith(("w_", "b_", "dw_", "db_")):
            continue                                 # named in the rows of their families
        assert f"`{key}`" in stone, key
    for section in ("### Where the code departs from the paper", "### Slips in the paper that the code corrects"):
        assert section in stone


def test_readme_tour_files_the_mlp_outside_section_2():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    tour = readme.split("## Tour of the code", 1)[1].split("\n## ", 1)[0]
    for row in tour.splitlines():
        if "fully connected layer" in row or "dropout" in row and row.startswith("|"):
            assert not row.startswith("| §2 |"), row
    assert "](notebooks/)" in readme and "pedestrian demo --head" in readme

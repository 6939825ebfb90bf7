"""The front door and the docs site: a README a newcomer reads, links that resolve, every page in the site's nav,
each generated table's markers once. (CI also builds the site with `mkdocs build --strict`: broken links and
anchors fail there.)"""

from __future__ import annotations

import re

import yaml

from tests.conftest import ROOT

DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_the_readme_is_a_front_page() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 260


def test_every_relative_link_of_the_readme_resolves() -> None:
    targets = [t for t in LINK.findall((ROOT / "README.md").read_text()) if not t.startswith(("http", "#"))]
    assert targets, "the README links to its docs"
    missing = [t for t in targets if not (ROOT / t.split("#")[0]).exists()]
    assert not missing, missing


def test_every_docs_page_is_in_the_nav() -> None:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    listed = {page for entry in nav for page in entry.values()}
    assert listed == {p.name for p in DOCS.glob("*.md")}


def test_each_generated_block_has_its_markers_once() -> None:
    text = "\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))
    names = set(re.findall(r"<!-- ([\w-]+):start -->", text))
    assert {"policy-table", "bench-table", "planner-table", "hf-families"} <= names
    for name in names:
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        assert text.count(start) == 1 and text.count(end) == 1, name
        assert text.index(start) < text.index(end), name

"""The front door and the docs site: a README a newcomer reads, links that resolve, every page in the site's nav,
each generated table's markers once. (CI also builds the site with `mkdocs build --strict`: broken links and
anchors fail there.)"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import yaml

from tests.conftest import ROOT

DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MARKER = re.compile(r"<!-- ([\w-]+):(start|end) -->")
GENERATED = {
    "policy-table",
    "bench-table",
    "bench-accuracy",
    "planner-table",
    "planner-accuracy",
    "hf-families",
    "step-time-table",
    "published-record",
    "data-first-step",
    "data-loader",
}
# the two tables the README carries (bench.published, bench.compiled), their whole text in docs/
README_GENERATED = {"published-summary", "compiled-summary"}


def _pages(nav: Any) -> Iterator[str]:
    """Every page a nav names, however deep its sections nest."""
    if isinstance(nav, str):
        yield nav
    elif isinstance(nav, list):
        for entry in nav:
            yield from _pages(entry)
    elif isinstance(nav, dict):
        for value in nav.values():
            yield from _pages(value)


def test_the_readme_is_a_front_door() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 260


def test_every_relative_link_of_the_readme_resolves() -> None:
    targets = [t for t in LINK.findall((ROOT / "README.md").read_text()) if not t.startswith(("http", "#", "mailto:"))]
    assert targets, "the README links to its docs"
    missing = [t for t in targets if not (ROOT / t.split("#")[0]).exists()]
    assert not missing, missing


def test_every_docs_page_is_in_the_nav() -> None:
    listed = set(_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - listed == set(), "pages the nav leaves out"
    assert listed - pages == set(), "nav entries without a page"


def test_each_marker_pair_appears_once_start_before_end() -> None:
    found: dict[str, list[tuple[str, str, int]]] = {}
    for page in sorted(DOCS.rglob("*.md")):
        for m in MARKER.finditer(page.read_text()):
            found.setdefault(m[1], []).append((page.name, m[2], m.start()))
    assert set(found) >= GENERATED, f"blocks a benchmark writes, missing: {GENERATED - set(found)}"
    readme = {m[1] for m in MARKER.finditer((ROOT / "README.md").read_text())}
    assert readme == README_GENERATED, "the generated tables live in docs/; the README carries two summaries"
    for name, marks in found.items():
        kinds = [kind for _, kind, _ in marks]
        assert sorted(kinds) == ["end", "start"], (name, marks)  # one start and one end, in all of docs/
        (page_a, first, at_a), (page_b, _, at_b) = marks
        assert page_a == page_b and first == "start" and at_a < at_b, (name, marks)

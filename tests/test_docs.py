"""The README stays a five-minute read, and the pages it points to resolve.

* README.md is at most 250 lines (the rest lives in docs/, by topic);
* every relative link in README.md and docs/*.md names a file or folder that exists, and every ``#anchor``
  names a heading of its target page, as GitHub renders it;
* the docs index (docs/README.md) links every page in docs/.

The README's two Quick start commands are checked in tests/cli/test_readme.py, the policy table in
docs/policies.md in tests/kv/test_registry.py, the Python names in tests/test_api.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ROOT

README_MAX_LINES = 250
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def prose(path: Path) -> str:
    """The page without its fenced code blocks (a bracket in code is not a link)."""
    return FENCE.sub("", path.read_text())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation dropped, spaces to hyphens."""
    text = LINK.sub(r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown page (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", prose(path), re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [target for _, target in LINK.findall(prose(path))]


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_there_are_docs_pages_and_the_readme_links_them():
    pages = {p.name for p in PAGES[1:]}
    assert {"README.md", "policies.md", "rescue.md", "bench.md", "finetune.md", "backends.md",
            "trust.md", "benchmarks.md"} <= pages, pages
    assert "docs/README.md" in links(ROOT / "README.md")


def test_the_docs_index_links_every_page():
    index = {t.split("#")[0] for t in links(ROOT / "docs" / "README.md")}
    missing = {p.name for p in PAGES[1:] if p.name != "README.md"} - index
    assert not missing, f"docs/README.md does not link {sorted(missing)}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_slug_matches_github():
    assert slug("KV policies (`--policy`)") == "kv-policies---policy"
    assert slug("torch.compile (`--compile`)") == "torchcompile---compile"
    assert slug("Measured: ZoomR's window and consensus") == "measured-zoomrs-window-and-consensus"
    assert slug("1. Augment") == "1-augment"

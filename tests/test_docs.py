"""The README and docs/ pages link to files and sections that exist (the measurement history lives in docs/, so a
moved results folder or a renamed heading would otherwise leave dead links where users click)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6} (.*)", line)):
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_anchor_rule_matches_githubs():
    page = ROOT / "README.md"
    assert "training-for-a-wall-clock-budget-and-on-a-short-gpu-lease" in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    assert page.exists()
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path) if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{page.name}: links to missing files or sections: {broken}"


def test_docs_index_lists_every_page():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in PAGES[1:] if f"](docs/{p.name})" not in readme]
    assert len(PAGES) > 1 and not missing, f"docs pages the README's index does not link: {missing}"

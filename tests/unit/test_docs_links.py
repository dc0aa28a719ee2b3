"""Every link between the README and docs/ that names a file or a section resolves: the file
exists and the section's heading is there (GitHub's anchors: lower case, punctuation dropped,
spaces as hyphens, repeats numbered)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)")


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings (those outside fenced code)."""
    seen: dict[str, int] = {}
    out, fenced = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not (m := re.match(r"#{1,6}\s+(.*)", line)):
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_anchors_follow_githubs_rules() -> None:
    text = ("# v15: tiles back (H200)\n```\n# not a heading\n```\n"
            "## Our MoE or Marlin's\n## Tests\n## Tests\n")
    assert anchors(text) == {"v15-tiles-back-h200", "our-moe-or-marlins", "tests", "tests-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_to_pages_and_sections_resolve(page: Path) -> None:
    broken = []
    for target, section in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif section and path.suffix == ".md" and section not in anchors(path.read_text()):
            broken.append(f"{target}#{section} (no such section)")
    assert not broken, f"{page.name}: {broken}"

"""Every link into a heading of the project's Markdown (README.md#..., BENCHMARKS.md#...)
lands on a heading that exists: a renamed section otherwise leaves a reader at the top of a
5,000-line file. Anchors as GitHub makes them: the heading in lower case, punctuation dropped,
spaces as hyphens, a repeated one numbered."""

from __future__ import annotations

import collections
import re

from tests.conftest import REPO_ROOT

LINK = re.compile(r"\(([\w./-]+\.md)#([\w-]+)\)")


def anchors(markdown: str) -> set[str]:
    seen: collections.Counter[str] = collections.Counter()
    found = set()
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#{1,6}\s+(.*)", line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        found.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return found


def test_anchors_follow_githubs_rule() -> None:
    text = (
        "# Session 30: the kernel (Zen 5, 14:55 to 16:15)\n"
        "```\n# not a heading\n```\n"
        "# A b\n# A b\n"
    )
    assert anchors(text) == {"session-30-the-kernel-zen-5-1455-to-1615", "a-b", "a-b-1"}


def test_every_link_to_a_heading_finds_it() -> None:
    files = sorted(REPO_ROOT.glob("*.md")) + sorted((REPO_ROOT / "docs").glob("*.md"))
    broken = []
    checked = 0
    for source in files:
        for target, anchor in LINK.findall(source.read_text()):
            path = (source.parent / target).resolve()
            if not path.is_relative_to(REPO_ROOT) or not path.exists():
                broken.append(f"{source.name}: {target} (no such file)")
                continue
            checked += 1
            if anchor not in anchors(path.read_text()):
                broken.append(f"{source.name}: {target}#{anchor}")
    assert checked >= 3, f"only {checked} links into a heading found: is LINK still right?"
    assert not broken, broken

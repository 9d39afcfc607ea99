"""The README stays short and every relative link in it and in ``docs/*.md`` resolves: the
file exists and, for a ``#anchor`` into a Markdown page, a heading of that page has that slug
(GitHub's rule: lower case, punctuation dropped, spaces as dashes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import ROOT

MAX_README_LINES = 250
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(path: Path) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lstrip("#").strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose(path):
        if line.startswith("#"):
            s = slug(line)
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def broken(path: Path) -> list[str]:
    bad = []
    for n, line in prose(path):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):          # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT)}:{n}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    return bad


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES})"


def test_docs_has_at_least_five_pages():
    got = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    assert len(got) >= 5, got


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    bad = broken(page)
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_checker_sees_a_broken_link_and_a_broken_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Title here\n\n[ok](#title-here) [x](b.md) [y](a.md#nope)\n"
                                   "```\n[in code](missing.md)\n```\n")
    got = broken(tmp_path / "a.md")
    assert got == ["a.md:3: b.md (no such file)", "a.md:3: a.md#nope (no heading #nope in a.md)"]

"""The documentation stays true to the repository: the README is short and names every command, every
relative link in README.md and docs/ leads to a file (and heading) inside the repository, and
docs/trace-format.md is exactly what tracekit/app/trace_format.py renders from tracekit/schema.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tracekit.app import trace_format
from tracekit.app.cli import cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
"""A Markdown inline link or image: [text](target) or ![alt](target)."""
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def links(page: Path) -> list[str]:
    """The targets of the inline links of `page`, code blocks and inline code left out."""
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of `page`: lower case, punctuation dropped, spaces to -."""
    text = FENCE.sub("", page.read_text())
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(slug)
    return found


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines (at most {README_MAX_LINES}): move the "
                                       "detail into a page under docs/ and link it")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve_inside_the_repository(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not the repository's
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: {file.relative_to(ROOT)} has no heading #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_trace_format_page_is_generated():
    page = trace_format.PAGE
    assert page.read_text() == trace_format.markdown(), (
        f"{page.relative_to(ROOT)} differs from what tracekit/schema.py renders: run "
        f"`{trace_format.COMMAND}` and commit the result")


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_readme_names_every_command(command: str):
    assert f"tracekit {command}" in README.read_text(), (
        f"README.md does not mention `tracekit {command}`: add a line for it to the commands table, "
        "linking the docs page that describes it")

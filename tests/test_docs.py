"""What users read: the README stays short and links every docs/ page, its links and the docs' resolve,
and no shipped text points at files users do not have or at the project's issue numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
SHIPPED = [README, *DOCS, *sorted((ROOT / "autofit").rglob("*.py")), *sorted((ROOT / "autofit").rglob("*.toml"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CITED_SECTION = re.compile(r"docs/([\w-]+\.md)#([\w-]+)")  # "docs/facts.md#adam-state", in code and docs


def test_readme_is_at_most_250_lines_and_links_every_docs_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert DOCS and all(f"docs/{page.name}" in text for page in DOCS), [p.name for p in DOCS if f"docs/{p.name}" not in text]


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    missing = [target for target in LINK.findall(page.read_text())
               if "://" not in target and not (page.parent / target).exists()]
    assert not missing, missing


def test_no_shipped_text_cites_a_file_users_lack_or_an_issue_number():
    offending = [f"{path.relative_to(ROOT)}:{n}" for path in SHIPPED
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if "FACTS.md" in line or re.search(r"\bissues? #?\d+", line, re.IGNORECASE)]
    assert not offending, offending


def _anchors(page: Path) -> set[str]:
    """The anchors a page's headings get on GitHub: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_cited_docs_section_exists():
    anchors = {page.name: _anchors(page) for page in DOCS}
    cited = [(path, page, anchor) for path in [*SHIPPED, *sorted((ROOT / "scripts").glob("*.py"))]
             for page, anchor in CITED_SECTION.findall(path.read_text())]
    assert len(cited) > 20  # the code cites its facts
    # and the docs' links between their pages: "](estimate.md#offload)", "](#adam-state)"
    cited += [(page, target or page.name, anchor) for page in DOCS
              for target, anchor in re.findall(r"\]\(([\w-]+\.md)?#([\w-]+)\)", page.read_text())]
    missing = [f"{path.relative_to(ROOT)}: docs/{page}#{anchor}" for path, page, anchor in cited
               if anchor not in anchors.get(page, ())]
    assert not missing, missing

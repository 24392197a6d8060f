"""The README's benchmark section, written from the committed ``summary.md`` so no figure is copied by hand.

``autofit bench`` (every suite, default output folder) rewrites the block between
:data:`START` and :data:`END` in the README of the directory it runs in; a test checks that the
committed README's block is what :func:`readme_block` makes of the committed summary.
"""

from __future__ import annotations

from pathlib import Path

START = "<!-- bench:start -->"
END = "<!-- bench:end -->"
SUITE_FILES = ("accuracy", "search", "cost")


def readme_block(summary_text: str, results_dir: str = "results/benchmarks") -> str:
    """The README block (markers included) for ``summary_text``, the contents of ``summary.md``.

    The summary's bullet lines are kept verbatim; its title and reproduce line become links.
    """
    bullets = [line for line in summary_text.splitlines() if line.startswith("- ")]
    links = ", ".join(f"[{name}.md]({results_dir}/{name}.md)" for name in SUITE_FILES)
    head = (f"Headline figures of the committed run, written by `autofit bench` from "
            f"[summary.md]({results_dir}/summary.md) (never edited by hand); every table is in {links}.")
    return "\n".join([START, head, "", *bullets, END])


def replace_block(readme_text: str, block: str) -> str:
    """``readme_text`` with its bench block replaced by ``block``.

    Raises ValueError when the README lacks the markers (or has them out of order).
    """
    start, end = readme_text.find(START), readme_text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the README has no benchmark block: expected a line {START} followed by a line {END}")
    return readme_text[:start] + block + readme_text[end + len(END):]


def update_readme(readme: Path, summary: Path) -> bool:
    """Rewrite ``readme``'s bench block from ``summary``; False (nothing written) when either is missing."""
    readme, summary = Path(readme), Path(summary)
    if not readme.is_file() or not summary.is_file():
        return False
    text = readme.read_text()
    if START not in text:
        return False
    new = replace_block(text, readme_block(summary.read_text()))
    if new != text:
        readme.write_text(new)
    return True


__all__ = ["END", "START", "readme_block", "replace_block", "update_readme"]

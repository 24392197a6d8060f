"""The README's benchmark section, written from the committed ``summary.md`` so no figure is copied by hand.

``autofit bench`` (every suite, default output folder) rewrites the block between
:data:`START` and :data:`END` in the README of the directory it runs in; a test checks that the
committed README's block is what :func:`readme_block` makes of the committed summary.

The block is a headline: at most :data:`MAX_LINES` lines between the markers. It keeps the
summary's bullets that start with one of :data:`HEADLINES` verbatim (the search's done-when criteria,
tallied over the cells, among them), folds the per-cell search bullets into one line (autofit against
the best other strategy in each cell), and links ``docs/benchmarks.md`` and the suites' tables for the rest.
"""

from __future__ import annotations

import re
from pathlib import Path

START = "<!-- bench:start -->"
END = "<!-- bench:end -->"
SUITE_FILES = ("accuracy", "search", "cost", "steady")
DOCS_PAGE = "docs/benchmarks.md"
MAX_LINES = 10  # lines between the markers: the link line, a blank line, the bullets
# Summary bullets kept verbatim, in this order (the first bullet starting with each).
HEADLINES = ("Peak memory, estimate vs measured", "At the search budgets:", "Time model prior error",
             "Search done-when criteria", "Estimator:", "Profiling ", "Trial runner:")
# Where the search digest goes among them (after this many verbatim bullets).
SEARCH_AFTER = 3

_SEARCH = re.compile(r"^- Search, (?P<cell>.+?) \(best found / optimum, median wall time\): (?P<runs>.*?)\.?$")
_RUN = re.compile(r"^(?P<label>[^(]+?)(?: \([^)]*\))? (?P<pct>\d+(?:\.\d+)?)% in (?P<s>\d+(?:\.\d+)?) s$")


def _search_digest(bullets: list[str]) -> str | None:
    """One line from the per-cell ``Search, ...`` bullets: autofit's median fraction of the optimum and
    median wall time in each cell, beside the best other strategy's (highest fraction, then least time)."""
    cells = []
    for line in bullets:
        m = _SEARCH.match(line)
        if m is None:
            continue
        runs = [r.groupdict() for r in map(_RUN.match, m["runs"].split("; ")) if r is not None]
        mine = [r for r in runs if r["label"] == "autofit"]
        others = sorted((r for r in runs if r["label"] != "autofit"), key=lambda r: (-float(r["pct"]), float(r["s"])))
        if not mine:
            continue
        text = f"{m['cell']} {mine[0]['pct']}% in {mine[0]['s']} s"
        if others:
            best = others[0]
            text += f" vs {best['pct']}% in {best['s']} s ({best['label']})"
        cells.append(text)
    if not cells:
        return None
    return ("- Search, best found / optimum and wall time (medians over the replayed seeds), autofit vs the best "
            "other strategy in each cell: " + "; ".join(cells) + ".")


def readme_block(summary_text: str, results_dir: str = "results/benchmarks") -> str:
    """The README block (markers included) for ``summary_text``, the contents of ``summary.md``.

    The bullets named in :data:`HEADLINES` are kept verbatim, the search's per-cell bullets are
    folded into one line, and the rest is left to the linked pages; at most :data:`MAX_LINES`
    lines between the markers.
    """
    bullets = [line for line in summary_text.splitlines() if line.startswith("- ")]
    kept = []
    for prefix in HEADLINES:
        first = next((line for line in bullets if line[2:].startswith(prefix)), None)
        if first is not None:
            kept.append(first)
    digest = _search_digest(bullets)
    search = [digest] if digest is not None else []
    split = sum(1 for line in kept if any(line[2:].startswith(p) for p in HEADLINES[:SEARCH_AFTER]))
    chosen = (kept[:split] + search + kept[split:])[:MAX_LINES - 2]
    links = ", ".join(f"[{name}.md]({results_dir}/{name}.md)" for name in SUITE_FILES)
    head = (f"Headline figures of the committed run, written by `autofit bench` from "
            f"[summary.md]({results_dir}/summary.md) (never edited by hand); what each suite measures is in "
            f"[{DOCS_PAGE}]({DOCS_PAGE}), every figure in {links}.")
    return "\n".join([START, head, "", *chosen, END])


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


__all__ = ["DOCS_PAGE", "END", "HEADLINES", "MAX_LINES", "START", "readme_block", "replace_block", "update_readme"]

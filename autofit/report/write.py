"""Writing a study's tables to its output directory: trials.csv, best.json, summary.md, calibration.json and, on request, the page."""

from __future__ import annotations

import json
from pathlib import Path

from autofit.core.files import write_atomic
from autofit.core.records import StudySnapshot
from autofit.report.summary import summary_markdown
from autofit.report.tables import (
    best_record,
    calibration_of,
    trials_table,
)


def write_reports(study: StudySnapshot, out_dir: str | Path, *, html: bool = False) -> dict[str, Path]:
    """Write ``trials.csv``, ``best.json``, ``summary.md`` and ``calibration.json`` to ``out_dir`` (atomically);
    with ``html``, also the pictures (``*.png``) and ``report.html`` (:mod:`autofit.report.page`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = trials_table(study)
    paths = {name: out_dir / name for name in ("trials.csv", "best.json", "summary.md", "calibration.json")}
    summary = summary_markdown(study, table)
    write_atomic(paths["trials.csv"], table.to_csv(index=False))
    write_atomic(paths["best.json"], json.dumps(best_record(study), indent=2) + "\n")
    write_atomic(paths["summary.md"], summary)
    write_atomic(paths["calibration.json"], json.dumps(calibration_of(study).to_dict(), indent=2) + "\n")
    if html:
        from autofit.report.page import write_page

        paths.update(write_page(study, table, summary, out_dir))
    return paths


"""``autofit report DIR``: a study's result tables again, rebuilt from its storage (works while it runs)."""

from __future__ import annotations

import argparse
import json
import sys

from autofit.cli._args import positive
from autofit.core.budget import format_bytes
from autofit.core.errors import ConfigError
from autofit.report.summary import summary_markdown
from autofit.report.tables import (
    STATUSES,
    best_record,
    counts,
    figure_basis,
    select,
    trials_table,
)
from autofit.report.write import write_reports
from autofit.study import load_snapshot


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "report", help="print a study's trials, best config and summary (from its storage)",
        description="Rebuild trials.csv, best.json and summary.md (with --html also the pictures and report.html) of a study from its storage and print the trials, "
                    "fastest first. Works on any study directory, including one whose search is still running.",
    )
    p.add_argument("dir", help="the study's output directory (autofit search --out)")
    p.add_argument("--top", type=positive(int), help="print only the first N rows")
    p.add_argument("--status", choices=STATUSES, help="only trials with this status")
    p.add_argument("--storage", help="the storage URL when the study is in a database (its password is not saved)")
    p.add_argument("--summary", action="store_true", help="print summary.md instead of the trials table")
    p.add_argument("--no-write", action="store_true", help="print only; do not rewrite the tables in DIR")
    p.add_argument("--html", action="store_true",
                   help="also rewrite the pictures (*.png) and report.html, one self-contained page")
    p.add_argument("--json", action="store_true", help="print JSON: the selected trials and the best config")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    study = load_snapshot(args.dir, storage=args.storage)
    table = trials_table(study)
    if args.html and args.no_write:
        raise ConfigError("--html writes report.html; it cannot go with --no-write")
    if not args.no_write:
        try:
            written = write_reports(study, args.dir, html=args.html)
            if args.html:
                sys.stderr.write(f"autofit: wrote {written['report.html']}\n")
        except OSError as exc:  # a read-only directory: still print
            sys.stderr.write(f"autofit: note: tables not rewritten ({exc})\n")
    shown = select(table, status=args.status, top=args.top)
    if args.json:
        rows = json.loads(shown.to_json(orient="records"))
        print(json.dumps({"study": study.study_name, "best": best_record(study), "counts": counts(table),
                          "trials": rows}, indent=2))
        return 0
    if args.summary:
        print(summary_markdown(study, table))
        return 0
    c = counts(table)
    print(f"study {study.study_name}: {c['real']} real trials, {c['pruned']} configs pruned by the estimate "
          f"(never ran)")
    # trial: real trials counted from 1 in the order they ran (a pruned config has none: '-')
    print(f"{'trial':>5} {'status':<11} {'precision':<9} {'mb':>4} {'ga':>4} {'ckpt':>4} {'split':>5} {'mode':>8} "
          f"{'pred peak':>11} {'peak':>11} {'err':>7} {'samples/s':>11} {'objective':>16} {'step':>9}  reason")
    for r in shown.itertuples():
        err = "" if r.peak_error is None or r.peak_error != r.peak_error else f"{100 * r.peak_error:+.1f}%"
        sps = "" if r.samples_per_s != r.samples_per_s or r.samples_per_s is None else f"{r.samples_per_s:,.2f}"
        step = "" if r.step_time_s != r.step_time_s or r.step_time_s is None else f"{r.step_time_s:.3f}s"
        goal = "" if _na(r.objective) else f"{r.objective:,.2f} ({r.basis})"
        peak = "" if _na(r.measured_peak_bytes) else format_bytes(r.measured_peak_bytes)
        pred = "" if _na(r.predicted_peak_bytes) else format_bytes(r.predicted_peak_bytes)
        reason = r.reason if isinstance(r.reason, str) else (r.error if isinstance(r.error, str) else "")
        trial = "-" if _na(r.trial) else str(r.trial)
        print(f"{trial:>5} {r.status:<11} {r.precision:<9} {r.micro_batch:>4} {r.grad_accum:>4} "
              f"{r.checkpoint_every:>4} {r.device_split:>5} {r.split_mode:>8} {pred:>11} {peak:>11} {err:>7} {sps:>11} "
              f"{goal:>16} {step:>9}  "
              f"{reason[:70]}")
    best = best_record(study)
    if best.get("config"):
        basis = figure_basis(len(best.get("samples") or []), best["median_samples_per_s"])
        print(f"best: {best['short']} (trial {best['trial']}): {best['measured']['samples_per_s']:,.2f} samples/s, "
              f"peak {format_bytes(best['measured']['peak_bytes'])}" + (f" ({basis})" if basis else ""))
        print(f"reproduce: {best['reproduce']}")
    else:
        print(f"best: none ({best.get('reason') or 'no trial ran ok under the budget yet'})")
    return 0


def _na(value) -> bool:
    try:
        return value is None or bool(value != value) or str(value) == "<NA>"
    except TypeError:
        return True

"""The time model's prior against measured step times, over the search suite's grids (reported by the accuracy suite).

The prior orders a search before any trial calibrates it, so its error is what the first trials
pay for. Each grid config's step time is measured here (a few untracked steps in a bench worker,
timed as a trial times them) and compared with two priors computed in the same run: the bare
device probe (square matmuls, :func:`autofit.probes.device_rates.probe_rates`) and the one a search uses,
rescaled by the workload's own layer timed for real (:func:`autofit.estimator.layer_prior.workload_prior`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass

from autofit.core.records import TrialStatus


@dataclass(frozen=True)
class PriorLabels:
    """The two priors compared, by name (their labels in the tables)."""

    bare: str = "bare matmul probe"       # the device probe alone
    layer: str = "workload's own layer"   # rescaled by the workload's own layer, as a search uses it


PRIOR = PriorLabels()
PRIORS = astuple(PRIOR)   # in the tables' order


def prior_rows(cells, progress: Callable[[str], None] = lambda _m: None) -> list[dict]:
    """One row per (grid config, prior): predicted and measured step time and the relative error
    (negative: predicted faster than measured), with what the layer probe cost and found."""
    from autofit.bench.search_cells import problem_for
    from autofit.bench.search_data import MiB
    from autofit.bench.worker import run_jobs
    from autofit.estimator.layer_prior import workload_prior
    from autofit.estimator.time_model import op_counts, predict_table
    from autofit.probes.device_rates import probe_rates
    from autofit.profiling.profile import profile_workload
    from autofit.workloads import param_count
    from autofit.workloads.load import load_workload

    rows = []
    rates = probe_rates("cpu")
    grids: dict[str, list] = {}  # per workload, its cells' single-device configs (a split's trial is another engine)
    for cell in cells:
        problem = problem_for(cell, cell.budgets_mib[0] * MiB, param_count(load_workload(cell.workload)))
        grids.setdefault(cell.workload, [])
        grids[cell.workload] += [c for c in problem.configs() if c.device_split == 1 and c not in grids[cell.workload]]
    for name, configs in grids.items():
        workload = load_workload(name)
        precisions = list(dict.fromkeys(c.precision.value for c in configs))
        profile = profile_workload(workload, precisions, device_type="cpu")
        start = time.perf_counter()
        layered = workload_prior(workload, profile, rates, precisions, use_cache=False)
        probe_s = time.perf_counter() - start
        measured = run_jobs([{"kind": "throughput", "workload": name, "config": c.to_dict(), "steps": 3}
                             for c in configs], job_timeout_s=300)
        for prior, counts in ((PRIOR.bare, op_counts(workload)), (PRIOR.layer, layered)):
            predicted = predict_table(profile, configs, rates, counts)["step_time_s"].tolist()
            scales = "; ".join(f"{p} x{c:.2f} per sample, x{f:.2f} fixed" for p, c, f in
                               (counts.layer_scales if counts else ()))
            for config, p, m in zip(configs, predicted, measured):
                t = m.get("step_time_s") if m.get("status") == TrialStatus.OK else None
                rows.append({"workload": name, "config": config.short(), "prior": prior,
                             "predicted_step_time_s": p, "measured_step_time_s": t,
                             "relative_error": (p - t) / t if t and math.isfinite(p) else None,
                             "layer_probe_s": probe_s if prior == PRIOR.layer else None, "layer_scales": scales})
            s = summary(rows, prior, name)
            progress(f"accuracy: time model prior ({prior}) on {name}: median {s['median_abs_error']}, "
                     f"max {s['max_abs_error']} over {s['configs']} configs")
    return rows


def summary(rows: list[dict], prior: str, workload: str | None = None) -> dict:
    """Configs compared, median / max absolute error and mean signed error of ``prior`` (on ``workload``, or all)."""
    signed = [r["relative_error"] for r in rows if r["prior"] == prior and r["relative_error"] is not None
              and (workload is None or r["workload"] == workload)]
    errors = [abs(e) for e in signed]
    return {"configs": len(errors), "median_abs_error": statistics.median(errors) if errors else None,
            "max_abs_error": max(errors) if errors else None,
            "mean_signed_error": statistics.fmean(signed) if signed else None}


def overall(rows: list[dict], prior: str) -> tuple[float, float] | None:
    """(median, max) absolute error of ``prior`` over every compared config; None without any."""
    s = summary(rows, prior)
    return (s["median_abs_error"], s["max_abs_error"]) if s["configs"] else None


def prior_section(rows: list[dict]) -> str:
    """The accuracy report's section: one line per workload and prior."""
    from autofit.bench.common import markdown_table, pct, seconds, signed_pct

    table = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        for prior in PRIORS:
            s = summary(rows, prior, workload)
            first = next((r for r in rows if r["workload"] == workload and r["prior"] == prior), None)
            if first is None:
                continue
            table.append([workload, prior, s["configs"], pct(s["median_abs_error"]), pct(s["max_abs_error"]),
                          signed_pct(s["mean_signed_error"], 1),
                          seconds(first["layer_probe_s"]) if first["layer_probe_s"] else "-", first["layer_scales"] or "-"])
    lines = []
    for prior in PRIORS:
        both = overall(rows, prior)
        if both:
            lines.append(f"- {prior}: median {pct(both[0])}, max {pct(both[1])}")
    return ("## Time model prior on the search grids\n\nThe step time the time model predicts before any trial "
            "calibrates it, against each grid config's step time measured in this run (3 untracked steps, timed as "
            "a trial times them), from the bare device probe (square matmuls) and with the workload's own first "
            "layer timed at micro-batches 2 and 8 (`autofit.probes.layer_timing`, what a search uses; its cold cost in "
            "the table). Time model prior error, median/max:\n\n" + "\n".join(lines) + "\n\n"
            + markdown_table(["workload", "prior", "configs", "median abs. error", "max", "mean signed",
                              "layer probe (s)", "layer factors"], table, "llrrrrrl"))


__all__ = ["PRIOR", "PRIORS", "PriorLabels", "overall", "prior_rows", "prior_section", "summary"]

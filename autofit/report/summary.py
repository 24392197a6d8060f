"""``summary.md``: a search's summary for a reader, section by section, always rebuilt from the study's
storage (:func:`summary_markdown`); the figures come from :mod:`autofit.report.tables`."""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from autofit.core.budget import format_budget, format_bytes
from autofit.core.config import FIELDS, TrainConfig
from autofit.core.records import PruneReason, StudySnapshot, TrialStatus
from autofit.estimator.advice import nothing_fits
from autofit.report.tables import (
    RAN,
    REASONS,
    WAITED_S,
    best_record,
    calibration_of,
    counts,
    duration_text,
    figure_basis,
    load_warning,
    model_flags,
    settings_of,
    space_size,
    top_configs,
    trials_table,
    wall_seconds,
)

_BEST_SAMPLE_WHY = "a config is ranked by its best sample: another process only ever slows a trial down"


def _md_table(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "(none)\n"
    cols = list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join("" if _missing(v) else str(v) for v in row) + " |")
    return "\n".join(lines) + "\n"


def _missing(value: Any) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def _pct(value: Any) -> str:
    return "" if _missing(value) else f"{100 * value:+.1f}%"


def _bytes(value: Any) -> str:
    return "" if _missing(value) else format_bytes(value)


def _seconds(value: Any) -> str:
    return "" if _missing(value) else (f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.3f} s")


def split_mode_comparison(table: pd.DataFrame) -> pd.DataFrame:
    """The best ok trial of each way to use the devices: ``one device`` (data-parallel replicas
    of an unsplit model), ``pipeline`` and ``fsdp``; with its objective and the margin the
    winner has over it. Ordered best first."""
    ok = table[table["status"] == TrialStatus.OK.value]
    kind = np.where(ok["device_split"] <= 1, "one device", ok["split_mode"])
    rows = []
    for name in ("one device", "pipeline", "fsdp"):
        group = ok[kind == name]
        if not group.empty:
            best = group.loc[group["objective"].idxmax()]
            rows.append({"mode": name, "trial": int(best["trial"]), "objective": float(best["objective"]),
                         "basis": best["basis"],
                         "config": TrainConfig.from_row(best).short()})
    frame = pd.DataFrame(rows, columns=["mode", "trial", "objective", "basis", "config"])
    frame = frame.sort_values("objective", ascending=False, kind="stable").reset_index(drop=True)
    if not frame.empty:
        frame["winner_ahead_by"] = frame["objective"].iloc[0] / frame["objective"] - 1.0
    return frame


def split_modes_markdown(table: pd.DataFrame, devices: int) -> list[str]:
    """The summary's section comparing split modes (empty when fewer than two modes ran ok)."""
    frame = split_mode_comparison(table)
    if len(frame) < 2:
        return []
    top = frame.iloc[0]
    lines = ["\n## Split modes\n",
             f"Objective: job samples/s on {devices} device(s) per worker -- one replica's samples/s times the "
             "replicas that fit (an unsplit model on every device, a pipeline per device_split devices, FSDP over "
             "its ranks); configs needing more devices than that are scored per device (autofit.core.objective).\n",
             f"**{top['mode']} won**: {top['objective']:.2f} samples/s ({top['config']}), "
             + ", ".join(f"{100 * r.winner_ahead_by:.1f}% ahead of {r.mode} ({r.objective:.2f})"
                         for r in frame.iloc[1:].itertuples()) + ".\n"]
    lines.append(_md_table(pd.DataFrame({
        "mode": frame["mode"], "best trial": frame["trial"], "config": frame["config"],
        "objective": [f"{v:.2f} ({b})" for v, b in zip(frame["objective"], frame["basis"])],
        "winner ahead by": frame["winner_ahead_by"].map(lambda v: f"{100 * v:.1f}%"),
    })))
    return lines


def summary_markdown(study: StudySnapshot, table: pd.DataFrame | None = None, *, top: int = 10) -> str:
    """``summary.md``: best and top configs, pruning, calibration, prediction errors, environment."""
    table = trials_table(study) if table is None else table
    settings = settings_of(study)
    c = counts(table)
    out = _header_lines(study, table, c)
    out.extend(_best_lines(study))
    out.extend(_top_lines(study, table, top))
    out.extend(split_modes_markdown(table, int(settings.get("devices") or 1)))
    out.append("\n## Pruned by the estimate (never ran)\n")
    out.append(_md_table(pd.DataFrame({
        "reason": list(c["pruned_by_reason"]), "configs": list(c["pruned_by_reason"].values()),
        "meaning": [REASONS[PruneReason(k)] for k in c["pruned_by_reason"]],
        "example": [c["pruned_examples"][k] for k in c["pruned_by_reason"]],
    })))
    out.extend(_calibration_lines(study))
    out.extend(_error_lines(table))
    out.extend(_environment_lines(study.versions))
    return "\n".join(out)


def _header_lines(study: StudySnapshot, table: pd.DataFrame, c: dict) -> list[str]:
    """The title and the search at a glance: workload, budget, device, space, trials, wall time."""
    settings = settings_of(study)
    budget = settings.get("budget_bytes")
    n_configs = space_size(settings)
    not_tried = max(0, n_configs - c["pruned"] - len({tuple(r) for r in table[table["status"].isin(
        [*RAN, TrialStatus.RUNNING.value])][list(FIELDS)].astype(str).to_numpy()}))
    out = [f"# Search summary: {study.study_name}\n"]
    source = settings.get("workload_source")
    out.append(f"- workload: `{settings.get('workload_name')}` (`{shlex.join(model_flags(source)) if source else '--model None'}`)")
    out.append(f"- budget: {format_budget(budget) if budget else '?'} per device")
    out.append(f"- device: {settings.get('device_type')}, {settings.get('devices')} per worker"
               + _rates_text(study.device_rates))
    out.append(f"- space: `{_shown_path((settings.get('space') or {}).get('source'))}`: {n_configs} configs")
    status_text = ", ".join(f"{v} {k}" for k, v in c["by_status"].items() if k != "pruned")
    out.append(f"- real trials: {c['real']} ({status_text or 'none'})")
    out.extend(_waited_lines(table))
    out.append(f"- pruned by the estimate: {c['pruned']} of {n_configs} configs"
               + (f" ({100 * c['pruned'] / n_configs:.0f}%)" if n_configs else ""))
    out.append(f"- not tried: {not_tried} (the search stopped first: {study.stop_reason or 'running'})")
    out.append(f"- wall time: {duration_text(wall_seconds(study))} over {len(study.runs)} search command(s)")
    if settings.get("command"):
        out.append(f"- command: `{settings['command']}`")
    out.append("")
    return out


def _best_lines(study: StudySnapshot) -> list[str]:
    """The best config, its figure and which sample that is, its peak, and how to measure it again;
    or, when nothing ran ok and the search is over, what would fit."""
    best = best_record(study)
    out = ["## Best config\n"]
    if best.get("config") is None:
        out.append("No trial ran ok under the budget.\n")
        if study.stop_reason:  # the search is over: say what would fit (the estimate's extremes)
            out.extend(["## What would fit\n", *(f"- {line}" for line in nothing_fits(settings_of(study))), ""])
        return out
    m, p = best["measured"], best["predicted"]
    out.append(f"`{best['short']}` (trial {best['trial']})\n")
    out.append(f"- throughput: {m.get('samples_per_s', 0):.2f} samples/s"
               + (f", {m['tokens_per_s']:,.0f} tokens/s" if m.get("tokens_per_s") else "")
               + f"; step {_seconds(m.get('step_time_s'))}")
    if len(best["samples"]) > 1:
        out.append(f"- measured {len(best['samples'])} times: "
                   + ", ".join(f"{x['samples_per_s']:.2f}" for x in best["samples"]) + " samples/s; the figure "
                   "above is " + figure_basis(len(best["samples"]), best["median_samples_per_s"]) + " ("
                   + _BEST_SAMPLE_WHY + ")")
    if (loaded := load_warning(m)) is not None:
        out.append(f"- **measured under load**: {loaded}")
    elif m.get("starved_steps"):
        out.append(f"- {m['starved_steps']} of its {m.get('timed_steps')} timed steps waited for a CPU (another "
                   "process was running) and were taken again; the figure is from a step that did not wait")
    out.append(f"- measured peak: {_bytes(m.get('peak_bytes'))} = {100 * best['peak_fraction_of_budget']:.1f}% of "
               f"the budget (predicted {_bytes(p.get('peak_bytes'))})")
    if best.get("changes_training"):
        out.append(f"- **changes the training**: {best['changes_training']}")
    out.append(f"- reproduce: `{best['reproduce']}`\n")
    return out


def _top_lines(study: StudySnapshot, table: pd.DataFrame, top: int) -> list[str]:
    """The top configs, one row each, by the sample each is ranked by (:func:`top_configs`)."""
    budget = settings_of(study).get("budget_bytes")
    ran = top_configs(study, table, top)
    return [f"## Top {top} configs\n", _md_table(pd.DataFrame({
        "trial": ran["trial"], "config": [TrainConfig.from_row(r).short() for _, r in ran.iterrows()],
        "samples/s": ran["samples_per_s"].map(lambda v: f"{v:.2f}"),
        "samples": ran["samples"], "spread": ran["spread"].map(lambda v: "" if _missing(v) else f"{100 * v:.1f}%"),
        "objective": [f"{v:.2f} ({b})" for v, b in zip(ran["objective"], ran["basis"])],
        "step": ran["step_time_s"].map(_seconds), "peak": ran["measured_peak_bytes"].map(_bytes),
        "of budget": ran["measured_peak_bytes"].map(lambda v: "" if _missing(v) else f"{100 * v / budget:.1f}%"),
    }))]


def _calibration_lines(study: StudySnapshot) -> list[str]:
    calibration = calibration_of(study)
    out = ["\n## Calibration\n",
           f"- peak: measured / predicted = {calibration.peak_ratio:.3f} (median); safety margin "
           f"{calibration.peak_margin:.1%}; a config fits when predicted x {calibration.peak_factor:.3f} <= budget"]
    if calibration.time_points:
        ratios = [p.ratio for p in calibration.time_points]
        out.append(f"- step time: measured / prior ratios {min(ratios):.2f} to {max(ratios):.2f}; later predictions "
                   "are corrected by a fit of these ratios (a precision effect plus a micro-batch effect)")
    out.append(f"- from {calibration.n_trials} real trials\n")
    return out


def _error_lines(table: pd.DataFrame) -> list[str]:
    real = table[table["status"].isin(RAN)]
    return ["## Prediction error of every real trial\n", _md_table(pd.DataFrame({
        "trial": real["trial"], "status": real["status"],
        "config": [TrainConfig.from_row(r).short() for _, r in real.iterrows()],
        "predicted peak": real["predicted_peak_bytes"].map(_bytes), "measured peak": real["measured_peak_bytes"].map(_bytes),
        "peak error": real["peak_error"].map(_pct),
        "predicted step": real["predicted_step_time_s"].map(_seconds), "measured step": real["step_time_s"].map(_seconds),
        "step error": real["step_time_error"].map(_pct), "prior step error": real["prior_step_time_error"].map(_pct),
    }))]


def _environment_lines(versions) -> list[str]:
    out = ["\n## Environment\n"]
    out.extend(f"- {key}: {versions[key]}" for key in ("autofit", "torch", "optuna", "python", "platform", "host",
                                                        "cpu_count") if key in versions)
    out.extend(f"- {key}={value}" for key, value in (versions.get("env") or {}).items())
    out.append("")
    return out


def _waited_lines(table: pd.DataFrame) -> list[str]:
    """A line naming the trials that waited for their device (another trial held it), if any did."""
    waited = table[pd.to_numeric(table["wait_s"], errors="coerce").fillna(0.0) >= WAITED_S]
    if waited.empty:
        return []
    shown = ", ".join(f"{int(n)} ({v:.0f} s)" for n, v in zip(waited["trial"], waited["wait_s"]))
    return [f"- waited for their device (another trial on this machine held it; wait_s in trials.csv, "
            f"not in their time): {len(waited)} trial(s): {shown}"]


def _rates_text(rates: dict | None) -> str:
    """`` (name, threads; the probe's rates)`` for the summary's device line."""
    if not rates:
        return ""
    flops = ", ".join(f"{name} {rate / 1e9:,.1f}" for name, rate in rates.get("matmul_flops_per_s", {}).items())
    return (f" ({rates.get('device_name')}, {rates.get('threads')} threads; probe: matmul GFLOP/s {flops}; "
            f"memory {rates.get('memory_bytes_per_s', 0) / 1e9:,.1f} GB/s; "
            f"{rates.get('op_latency_s', 0) * 1e6:,.1f} us per operator)")


def _shown_path(source: str | None) -> str | None:
    """A space file relative to the repository or the working directory when under one."""
    if not source or source.startswith("<"):
        return source
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        try:
            return str(Path(source).resolve().relative_to(root))
        except ValueError:
            continue
    return source

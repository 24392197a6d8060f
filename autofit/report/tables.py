"""Result tables of a search, always rebuilt from the study's storage (never edited by hand).

- ``trials.csv``: one row per trial: ``trial`` (real trials counted 1, 2, 3... in the order they
  started, :func:`autofit.core.records.trial_numbers`, the number every table, picture and progress
  line shows; empty for a pruned config), ``number`` (the trial's number in the Optuna storage,
  which pruned configs use up too), status (a :class:`autofit.core.records.TrialStatus`:
  ``ok``, ``oom``, ``error``, ``timeout``, ``pruned``; ``running`` and ``interrupted`` for a
  study in progress or interrupted), why it was pruned, the five config fields, predicted and measured peak bytes, samples/s,
  step time, the prediction errors, what the timed steps got from the machine (``starved_steps``:
  steps whose threads waited for a CPU, taken again; ``step_spread``, ``cpu_share``, ``threads``,
  ``cpus``, ``max_wait_share``), and ``wait_s``, how long it waited for its device (another trial held it);
- ``best.json``: the best config among configs that ran ok under the budget, each ranked by its best
  sample (load only ever slows a trial down) or, if it was timed head to head, by that sample
  (:func:`figure_basis`); that sample's measurements, every sample, their median and spread, and the
  command that measures it again;
- ``summary.md``: the top configs, what the estimate pruned and why, the calibration, the
  prediction error of every real trial, the device, versions and wall time;
- ``calibration.json``: the calibration the next planning step would use.

Since everything comes from the storage, ``autofit report DIR`` works on any study, including
one that is still running. Every function here reads a :class:`autofit.core.records.StudySnapshot`
(the study's :class:`autofit.core.records.TrialRecord` values and what the search stored beside them;
:func:`autofit.study.storage.snapshot` makes one), never the storage itself.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from autofit.core.budget import format_budget, format_bytes
from autofit.core.config import FIELDS, OptimizerChoice, TrainConfig
from autofit.core.errors import WorkloadError
from autofit.core.objective import basis, objective
from autofit.core.records import (
    PruneReason,
    StudySnapshot,
    TrialRecord,
    TrialStatus,
    best_of,
    best_sample,
    config_samples,
    head_to_head_of,
    median_value,
    trial_numbers,
)
from autofit.estimator.advice import nothing_fits
from autofit.estimator.calibration import (
    Calibration,
    calibrate,
    measured_peak,
    observations,
)
from autofit.study.planner import SLOW_FACTOR
from autofit.workloads.hf.spec import source_flags

STATUSES = tuple(s.value for s in TrialStatus)
# What trains in place of the workload's optimizer, per choice of the optimizer lever.
OPTIMIZER_CLASSES = {OptimizerChoice.ADAFACTOR: "torch.optim.Adafactor",
                     OptimizerChoice.ADAMW8BIT: "bitsandbytes' 8-bit AdamW"}
WAITED_S = 0.5             # a device lock taken within this is not a wait worth a line
RAN = tuple(s.value for s in TrialStatus if s.ran)  # real trials that finished
COLUMNS = (
    "trial", "number", "status", "sample", "head_to_head", "reason_kind", "reason", *FIELDS,
    "predicted_peak_bytes", "calibrated_peak_bytes", "measured_peak_bytes", "peak_error",
    "predicted_step_time_s", "step_time_s", "step_time_error", "prior_step_time_error",
    "predicted_samples_per_s", "samples_per_s", "objective", "basis", "tokens_per_s",
    "timed_steps", "starved_steps", "step_spread", "cpu_share", "threads", "cpus", "max_wait_share",
    "trial_wall_s", "wait_s", "error", "started", "finished",
)


# What each prune reason means, for the summary.
REASONS = {
    PruneReason.INVALID: "cannot run at all (e.g. more stages than layers)",
    PruneReason.DEVICES: "a device split over the devices a worker has: estimated, never run (more with --devices "
                         "or GPUs)",
    PruneReason.DUPLICATE: "a checkpoint interval of at least a stage's layers: the same run as a smaller interval",
    PruneReason.OVER_BUDGET: "the calibrated peak, with its safety margin, is over the budget",
    PruneReason.TOO_SLOW: f"predicted under 1/{SLOW_FACTOR:g} of the best predicted throughput, under the best "
                          "measured by more than the time model's measured error (wider where no trial of its precision, "
                          "layout and checkpointing ran), or a "
                          "trial longer than the trial limit",
    PruneReason.DOMINATED: "checkpointing the budget does not need: the same config with less of it fits and is faster",
    PruneReason.SLOW_PRECISION: "every config of its precision is predicted (calibrated by the trials so far) below "
                                "the best measured by more than the time model's measured error",
}


def _when(value) -> str | None:
    return value.isoformat(timespec="seconds") if value else None


def trials_table(study: StudySnapshot) -> pd.DataFrame:
    """One row per trial of ``study`` (columns :data:`COLUMNS`), in trial order.

    Errors are relative, ``(predicted - measured) / measured``: negative is an under-prediction.
    ``step_time_error`` is that of the calibrated prediction the trial was planned with;
    ``prior_step_time_error`` that of the uncalibrated time model.
    """
    rows = []
    devices = int(settings_of(study).get("devices") or 1)
    shown = trial_numbers(study.records)
    for r in study.records:
        predicted, measured, errors = r.prediction, r.measurement, r.errors
        rows.append({
            "trial": shown.get(r.number), "number": r.number, "status": r.status.value, "sample": r.sample,
            "head_to_head": shown.get(head_to_head_of(r)),  # timed beside other leaders: its first trial
            "reason_kind": None if r.prune_reason is None else r.prune_reason.value, "reason": r.reason,
            **r.config.to_dict(),
            "predicted_peak_bytes": predicted.get("peak_bytes"),
            "calibrated_peak_bytes": predicted.get("calibrated_peak_bytes"),
            "measured_peak_bytes": measured_peak(measured),  # on CUDA reserved + context, as predicted
            "peak_error": errors.get("peak"),
            "predicted_step_time_s": predicted.get("step_time_s"),
            "step_time_s": measured.get("step_time_s"),
            "step_time_error": errors.get("step_time"),
            "prior_step_time_error": errors.get("prior_step_time"),
            "predicted_samples_per_s": predicted.get("samples_per_s"),
            "samples_per_s": measured.get("samples_per_s"),
            # the search's value (autofit.core.objective): job samples/s on the worker's devices
            "objective": None if measured.get("samples_per_s") is None
            else objective(r.config, measured["samples_per_s"], devices),
            "basis": basis(r.config, devices),
            "tokens_per_s": measured.get("tokens_per_s"),
            # what the timed steps got from the machine: starved steps were taken again, never the figure
            **{k: measured.get(k) for k in ("timed_steps", "starved_steps", "step_spread", "cpu_share", "threads",
                                            "cpus", "max_wait_share")},
            "trial_wall_s": measured.get("wall_s"),
            "wait_s": measured.get("wait_s"),  # for its device: another trial held it (autofit.runtime.devicelock)
            "error": measured.get("error") or ("interrupted" if r.status is TrialStatus.INTERRUPTED else None),
            "started": _when(r.started), "finished": _when(r.finished),
        })
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    for name in ("trial", "head_to_head", "predicted_peak_bytes", "calibrated_peak_bytes", "measured_peak_bytes"):
        table[name] = table[name].astype("Int64")
    return table


def top_configs(study: StudySnapshot, table: pd.DataFrame, top: int | None = None) -> pd.DataFrame:
    """One row per config that ran ok under the budget (:func:`autofit.core.records.config_samples`),
    its best sample's, best first, with ``samples`` (how many feasible samples it has) and
    ``spread`` (its best over its median, less one): the ranking :func:`best_trial` crowns from."""
    by_config = config_samples(list(study.records))
    best = {best_sample(s).number: (len(s), best_sample(s).value / median_value(s) - 1.0 if median_value(s) else None)
            for s in by_config.values()}
    rows = table[table["number"].isin(list(best))]
    rows = rows.assign(samples=[best[n][0] for n in rows["number"]], spread=[best[n][1] for n in rows["number"]])
    return select(rows, top=top)


def select(table: pd.DataFrame, *, status: str | None = None, top: int | None = None) -> pd.DataFrame:
    """Rows of ``status`` (any when None), best objective first (then by number); the first ``top`` when given."""
    if status is not None:
        table = table[table["status"] == status]
    table = table.assign(_rank=table["objective"].fillna(-1.0)).sort_values(
        ["_rank", "number"], ascending=[False, True], kind="stable").drop(columns="_rank")
    return table.head(top) if top else table


def settings_of(study: StudySnapshot) -> dict:
    """The search settings stored on the study (workload, budget, device, space, command...)."""
    return dict(study.settings)


def calibration_of(study: StudySnapshot) -> Calibration:
    """The calibration from the study's real trials so far."""
    settings = study.settings
    return calibrate(observations(list(study.records), settings.get("budget_bytes") or 0),
                     settings.get("device_type", "cpu"))


def best_trial(study: StudySnapshot) -> TrialRecord | None:
    """The best sample of the best config (:func:`autofit.core.records.best_of`: the highest best sample
    among configs that ran ok under the budget), or None."""
    return best_of(list(study.records))


def best_samples(study: StudySnapshot) -> list[TrialRecord]:
    """Every sample (feasible real trial) of the best config, in trial order; empty when there is none."""
    best = best_trial(study)
    return [] if best is None else config_samples(list(study.records))[best.config]


def model_flags(source: str) -> list[str]:
    """``--model`` as a user types it: an ``hf:`` source's ``#seq_len=64#task=...`` options as the
    ``--seq-len`` and ``--task`` (and ``--lora``) flags; the source as it is when it cannot be split."""
    try:
        return source_flags(source)
    except WorkloadError:
        return ["--model", source]


def measure_command(settings: dict, config: TrainConfig) -> str:
    """The ``autofit measure`` command that runs ``config`` again under the study's budget (the
    workload in the command line's own flags: :func:`model_flags`)."""
    model = settings.get("workload_source") or settings.get("workload_name")
    config_text = config.to_text()
    parts = ["autofit", "measure", *model_flags(str(model)), "--config", config_text,
             "--budget", str(settings.get("budget_text") or f"{settings.get('budget_bytes')}B"),
             "--device", str(settings.get("device_type", "cpu"))]
    return shlex.join(parts)


def best_record(study: StudySnapshot) -> dict:
    """What ``best.json`` holds: the best config, its measurements and predictions, how to reproduce it."""
    settings = settings_of(study)
    budget = settings.get("budget_bytes")
    record: dict[str, Any] = {
        "study": study.study_name, "workload": settings.get("workload_name"),
        "device": settings.get("device_type"), "budget_bytes": budget,
        "budget": format_budget(budget) if budget else None,
        "search_command": settings.get("command"),
    }
    trial = best_trial(study)
    if trial is None:
        return {**record, "config": None, "reason": "no trial ran ok under the budget yet"}
    config = trial.config
    measured, predicted = dict(trial.measurement), dict(trial.prediction)
    samples = best_samples(study)
    shown = trial_numbers(study.records)
    return {
        # trial: its number among the real trials (as every table shows it); number: Optuna's, in the storage
        **record, "trial": shown[trial.number], "number": trial.number, "config": config.to_dict(),
        "short": config.short(), "measured": measured, "predicted": predicted,
        "samples": [{"trial": shown[r.number], "objective": r.value,
                     "samples_per_s": r.measurement.get("samples_per_s")} for r in samples],
        "median_objective": median_value(samples),
        "median_samples_per_s": float(np.median([r.measurement.get("samples_per_s") or 0.0 for r in samples])),
        # best sample over the median, less one: how much the config's samples disagreed
        "sample_spread": (trial.value / median_value(samples) - 1.0) if median_value(samples) else None,
        "peak_fraction_of_budget": measured_peak(measured) / budget if budget and measured_peak(measured) else None,
        "reproduce": measure_command(settings, config),
        "changes_training": changes_training(config),
    }


_BEST_SAMPLE_WHY = "a config is ranked by its best sample: another process only ever slows a trial down"
_HEAD_TO_HEAD_WHY = ("leaders of one build are timed in turn in one process, so each saw the machine as the others "
                     "did, and are ranked by that sample")


def figure_basis(measured: dict, n_samples: int, median_samples_per_s: float) -> str:
    """Which of the best config's samples its figure is, in words: every output that shows the best's
    figure (the headline, ``autofit report``, ``summary.md``) says it the same way. "" for one sample.

    A config timed head to head is ranked by that head-to-head's sample, which need not be its best
    (:func:`autofit.core.records.ranked_samples`); any other by its best sample."""
    if n_samples <= 1:
        return ""
    if measured.get("head_to_head") is not None:
        return (f"its sample timed head to head with the other leaders; {n_samples} samples in all, "
                f"median {median_samples_per_s:,.2f}")
    return f"best of {n_samples} samples; their median {median_samples_per_s:,.2f}"


def changes_training(config: TrainConfig) -> str | None:
    """What the best config changes in the training, in words (None: nothing): the ``optimizer`` lever's
    replacement of the workload's optimizer (the ``lean`` space's, opt-in)."""
    if not config.changes_optimizer:
        return None
    return (f"it trains with optimizer={config.optimizer.value} ({OPTIMIZER_CLASSES[config.optimizer]}) in place of "
            "the workload's own optimizer; its exports say so first")


# --- summary.md ---------------------------------------------------------------------------------


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


def duration_text(seconds: float) -> str:
    """``1m15s`` or ``42s``."""
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def wall_seconds(study: StudySnapshot) -> float:
    """The study's wall time: the sum over the search commands that ran it."""
    return float(sum(run.get("wall_s", 0.0) for run in study.runs))


def never_ran(table: pd.DataFrame) -> pd.DataFrame:
    """The pruned rows of configs that never ran (nor are running), one per config (its last prune):
    what the summary counts as pruned and the pictures draw as estimates."""
    ran = table[table["status"].isin([*RAN, TrialStatus.RUNNING.value])]
    ran_keys = set(map(tuple, ran[list(FIELDS)].astype(str).to_numpy()))
    pruned = table[table["status"] == TrialStatus.PRUNED.value]
    keys = pd.Series(list(map(tuple, pruned[list(FIELDS)].astype(str).to_numpy())), index=pruned.index, dtype=object)
    keep = ~keys.isin(ran_keys) & ~keys.duplicated(keep="last")
    return pruned[keep.to_numpy()]


def counts(table: pd.DataFrame) -> dict:
    """Real trials by status, configs pruned (never ran) by reason, configs not tried."""
    by_status = table["status"].value_counts().to_dict()
    pruned = never_ran(table)
    return {
        "real": int(sum(by_status.get(s, 0) for s in RAN)),
        "by_status": {s: int(by_status.get(s, 0)) for s in STATUSES if by_status.get(s)},
        "pruned": int(len(pruned)),
        "pruned_by_reason": {k: int(v) for k, v in pruned["reason_kind"].value_counts().reindex(
            [k.value for k in PruneReason if k.value in set(pruned["reason_kind"])]).items()},
        "pruned_examples": {k: str(g.iloc[0]["reason"]) for k, g in pruned.groupby("reason_kind")},
    }


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
    # Long on purpose: it is summary.md's layout, section by section in reading order; each section's figures come from helpers.
    table = trials_table(study) if table is None else table
    settings = settings_of(study)
    versions = study.versions
    budget = settings.get("budget_bytes")
    n_configs = _n_configs(settings)
    c = counts(table)
    not_tried = max(0, n_configs - c["pruned"] - len({tuple(r) for r in table[table["status"].isin(
        [*RAN, TrialStatus.RUNNING.value])][list(FIELDS)].astype(str).to_numpy()}))
    runs = study.runs
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
    out.append(f"- wall time: {duration_text(wall_seconds(study))} over {len(runs)} search command(s)")
    if settings.get("command"):
        out.append(f"- command: `{settings['command']}`")
    out.append("")
    best = best_record(study)
    out.append("## Best config\n")
    if best.get("config") is None:
        out.append("No trial ran ok under the budget.\n")
        if study.stop_reason:  # the search is over: say what would fit (the estimate's extremes)
            out.append("## What would fit\n")
            out.extend(f"- {line}" for line in nothing_fits(settings))
            out.append("")
    else:
        m, p = best["measured"], best["predicted"]
        out.append(f"`{best['short']}` (trial {best['trial']})\n")
        out.append(f"- throughput: {m.get('samples_per_s', 0):.2f} samples/s"
                   + (f", {m['tokens_per_s']:,.0f} tokens/s" if m.get("tokens_per_s") else "")
                   + f"; step {_seconds(m.get('step_time_s'))}")
        if len(best["samples"]) > 1:
            out.append(f"- measured {len(best['samples'])} times: "
                       + ", ".join(f"{x['samples_per_s']:.2f}" for x in best["samples"]) + " samples/s; the figure "
                       "above is " + figure_basis(m, len(best["samples"]), best["median_samples_per_s"]) + " ("
                       + (_HEAD_TO_HEAD_WHY if m.get("head_to_head") is not None else _BEST_SAMPLE_WHY) + ")")
        if m.get("starved_steps"):
            out.append(f"- {m['starved_steps']} of its {m.get('timed_steps')} timed steps waited for a CPU (another "
                       "process was running) and were taken again; the figure is from a step that did not wait")
        out.append(f"- measured peak: {_bytes(m.get('peak_bytes'))} = {100 * best['peak_fraction_of_budget']:.1f}% of "
                   f"the budget (predicted {_bytes(p.get('peak_bytes'))})")
        if best.get("changes_training"):
            out.append(f"- **changes the training**: {best['changes_training']}")
        out.append(f"- reproduce: `{best['reproduce']}`\n")
    out.append(f"## Top {top} configs\n")
    ran = top_configs(study, table, top)
    out.append(_md_table(pd.DataFrame({
        "trial": ran["trial"], "config": [TrainConfig.from_row(r).short()
                                           for _, r in ran.iterrows()],
        "samples/s": ran["samples_per_s"].map(lambda v: f"{v:.2f}"),
        "samples": ran["samples"], "spread": ran["spread"].map(lambda v: "" if _missing(v) else f"{100 * v:.1f}%"),
        "objective": [f"{v:.2f} ({b})" for v, b in zip(ran["objective"], ran["basis"])],
        "step": ran["step_time_s"].map(_seconds), "peak": ran["measured_peak_bytes"].map(_bytes),
        "of budget": ran["measured_peak_bytes"].map(lambda v: "" if _missing(v) else f"{100 * v / budget:.1f}%"),
    })))
    out.extend(split_modes_markdown(table, int(settings.get("devices") or 1)))
    out.append("\n## Pruned by the estimate (never ran)\n")
    out.append(_md_table(pd.DataFrame({
        "reason": list(c["pruned_by_reason"]), "configs": list(c["pruned_by_reason"].values()),
        "meaning": [REASONS[PruneReason(k)] for k in c["pruned_by_reason"]],
        "example": [c["pruned_examples"][k] for k in c["pruned_by_reason"]],
    })))
    calibration = calibration_of(study)
    out.append("\n## Calibration\n")
    out.append(f"- peak: measured / predicted = {calibration.peak_ratio:.3f} (median); safety margin "
               f"{calibration.peak_margin:.1%}; a config fits when predicted x {calibration.peak_factor:.3f} <= budget")
    if calibration.time_points:
        ratios = [p.ratio for p in calibration.time_points]
        out.append(f"- step time: measured / prior ratios {min(ratios):.2f} to {max(ratios):.2f}; later predictions "
                   "are corrected by a fit of these ratios (a precision effect plus a micro-batch effect)")
    out.append(f"- from {calibration.n_trials} real trials\n")
    out.append("## Prediction error of every real trial\n")
    real = table[table["status"].isin(RAN)]
    out.append(_md_table(pd.DataFrame({
        "trial": real["trial"], "status": real["status"],
        "config": [TrainConfig.from_row(r).short() for _, r in real.iterrows()],
        "predicted peak": real["predicted_peak_bytes"].map(_bytes), "measured peak": real["measured_peak_bytes"].map(_bytes),
        "peak error": real["peak_error"].map(_pct),
        "predicted step": real["predicted_step_time_s"].map(_seconds), "measured step": real["step_time_s"].map(_seconds),
        "step error": real["step_time_error"].map(_pct), "prior step error": real["prior_step_time_error"].map(_pct),
    })))
    out.append("\n## Environment\n")
    for key in ("autofit", "torch", "optuna", "python", "platform", "host", "cpu_count"):
        if key in versions:
            out.append(f"- {key}: {versions[key]}")
    for key, value in (versions.get("env") or {}).items():
        out.append(f"- {key}={value}")
    out.append("")
    return "\n".join(out)


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


def _n_configs(settings: dict) -> int:
    from autofit.core.space import space_from_dict

    space = dict(settings.get("space") or {})
    source = space.pop("source", "<inline>")
    try:
        return len(space_from_dict(space, source).configs())
    except Exception:  # noqa: BLE001 -- a summary of a study whose space cannot be rebuilt still prints
        return 0

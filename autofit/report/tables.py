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
  sample (load only ever slows a trial down; :func:`figure_basis`); that sample's measurements, every sample, their median and spread, and the
  command that measures it again;
- ``summary.md`` (written by :mod:`autofit.report.summary` from these tables);
- ``calibration.json``: the calibration the next planning step would use.

Since everything comes from the storage, ``autofit report DIR`` works on any study, including
one that is still running. Every function here reads a :class:`autofit.core.records.StudySnapshot`
(the study's :class:`autofit.core.records.TrialRecord` values and what the search stored beside them;
:func:`autofit.study.storage.snapshot` makes one), never the storage itself.
"""

from __future__ import annotations

import shlex
from typing import Any

import numpy as np
import pandas as pd

from autofit.core.budget import format_budget
from autofit.core.config import FIELDS, OptimizerChoice, TrainConfig
from autofit.core.errors import WorkloadError
from autofit.core.objective import basis, objective
from autofit.core.records import (
    PruneReason,
    StudySnapshot,
    TrialRecord,
    TrialStatus,
    best_of,
    config_samples,
    head_to_head_of,
    median_value,
    ranked_bests,
    trial_numbers,
)
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
    "predicted_peak_bytes", "calibrated_peak_bytes", "measured_peak_bytes", "peak_from_trial", "peak_error",
    "predicted_step_time_s", "step_time_s", "step_time_error", "prior_step_time_error",
    "predicted_samples_per_s", "samples_per_s", "objective", "basis", "tokens_per_s",
    "timed_steps", "starved_steps", "step_spread", "cpu_share", "threads", "cpus", "max_wait_share",
    "trial_wall_s", "wait_s", "error", "started", "finished",
)


# What each prune reason means, for the summary.
REASONS = {
    PruneReason.INVALID: "cannot run at all (e.g. more stages than layers)",
    PruneReason.DEVICES: "a device split over the devices a worker has: never run (more with --devices or GPUs); "
                         "estimated, except a pipeline split of a model with weights tied across its ends",
    PruneReason.DUPLICATE: "a checkpoint interval of at least a stage's layers: the same run as a smaller interval",
    PruneReason.OVER_BUDGET: "the calibrated peak, with its safety margin, is over the budget",
    PruneReason.TOO_SLOW: f"predicted under 1/{SLOW_FACTOR:g} of the best predicted throughput, under the best "
                          "measured by more than the time model's measured error (wider where no trial of its precision, "
                          "layout and checkpointing ran), or a "
                          "trial longer than the trial limit",
    PruneReason.DOMINATED: "checkpointing the budget does not need: the same config with less of it fits and is faster",
    PruneReason.SLOW_PRECISION: "every config of its precision is predicted (calibrated by the trials so far) below "
                                "the best measured by more than the time model's measured error (10x before its "
                                "error across precisions is measured)",
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
            # a re-measurement reads throughput only: its peak is that trial's
            "peak_from_trial": shown.get(measured.get("peak_from_trial")),
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
    for name in ("trial", "head_to_head", "predicted_peak_bytes", "calibrated_peak_bytes", "measured_peak_bytes",
                 "peak_from_trial"):
        table[name] = table[name].astype("Int64")
    return table


def top_configs(study: StudySnapshot, table: pd.DataFrame, top: int | None = None) -> pd.DataFrame:
    """One row per config that ran ok under the budget (:func:`autofit.core.records.config_samples`),
    the row of the sample it is ranked by (:func:`autofit.core.records.best_sample`), in the order
    :func:`best_trial` crowns from (:func:`autofit.core.records.ranked_bests`), with ``samples`` (how
    many feasible samples it has) and ``spread`` (that sample over its median, less one)."""
    by_config = config_samples(list(study.records))
    best = {}  # in ranked order: trial number -> (samples, spread)
    for r in ranked_bests(list(study.records)):
        median = median_value(by_config[r.config])
        best[r.number] = (len(by_config[r.config]), r.value / median - 1.0 if median else None)
    rank = {n: i for i, n in enumerate(best)}
    rows = table[table["number"].isin(best)].sort_values("number", key=lambda s: s.map(rank), kind="stable")
    rows = rows.assign(samples=[best[n][0] for n in rows["number"]], spread=[best[n][1] for n in rows["number"]])
    return rows.head(top) if top else rows


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
                     "samples_per_s": r.measurement.get("samples_per_s"),
                     "head_to_head": head_to_head_of(r) is not None} for r in samples],
        "median_objective": median_value(samples),
        "median_samples_per_s": float(np.median([r.measurement.get("samples_per_s") or 0.0 for r in samples])),
        # the ranked sample over the median, less one: how much the config's samples disagreed
        # (below 0 where a starved sample's reach ranked it by a slower sample)
        "sample_spread": (trial.value / median_value(samples) - 1.0) if median_value(samples) else None,
        "peak_fraction_of_budget": measured_peak(measured) / budget if budget and measured_peak(measured) else None,
        "reproduce": measure_command(settings, config),
        "changes_training": changes_training(config),
    }


def figure_basis(n_samples: int, median_samples_per_s: float) -> str:
    """Which of the best config's samples its figure is, in words: every output that shows the best's
    figure (the headline, ``autofit report``, ``summary.md``) says it the same way. "" for one sample.

    A config's figure is its best sample (:func:`autofit.core.records.best_sample`)."""
    if n_samples <= 1:
        return ""
    return f"best of {n_samples} samples; their median {median_samples_per_s:,.2f}"


def load_warning(measured: dict) -> str | None:
    """What to tell a user whose answer was measured while another process held a CPU for its whole run
    (every timed step of its figure waited), in words; None otherwise. The headline and ``summary.md`` say it.

    Such a figure is raised by its wait for ranking (:func:`autofit.core.records.reach`), but no raise can
    restore the order a quiet machine gives: with a core lost, configs that parallelise differently lose
    differently (docs/facts.md#run-queue-wait)."""
    steps, starved = measured.get("timed_steps"), measured.get("starved_steps")
    if not steps or starved != steps:
        return None
    return (f"all {steps} timed steps waited for a CPU (another process held one throughout): this is the fastest "
            "config beside that load, which may not be the fastest on a quiet machine; search again when it is quiet")


def changes_training(config: TrainConfig) -> str | None:
    """What the best config changes in the training, in words (None: nothing): the ``optimizer`` lever's
    replacement of the workload's optimizer (the ``lean`` space's, opt-in)."""
    if not config.changes_optimizer:
        return None
    return (f"it trains with optimizer={config.optimizer.value} ({OPTIMIZER_CLASSES[config.optimizer]}) in place of "
            "the workload's own optimizer; its exports say so first")


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


def space_size(settings: dict) -> int:
    from autofit.core.space import space_from_dict

    space = dict(settings.get("space") or {})
    source = space.pop("source", "<inline>")
    try:
        return len(space_from_dict(space, source).configs())
    except Exception:  # noqa: BLE001 -- a summary of a study whose space cannot be rebuilt still prints
        return 0

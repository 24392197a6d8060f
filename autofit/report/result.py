"""The result a launcher gets back from a search: :class:`SearchResult` (the best config, its measurement,
the trial table) and how it is built from a stored study.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from autofit.core.config import TrainConfig
from autofit.core.records import StudySnapshot, TrialRecord, trial_numbers
from autofit.estimator.advice import nothing_fits
from autofit.estimator.calibration import Calibration
from autofit.report.tables import (
    best_samples,
    best_trial,
    calibration_of,
    changes_training,
    counts,
    settings_of,
    space_size,
    trials_table,
    wall_seconds,
)
from autofit.study.settings import JOURNAL_NAME, redact

# --- the result of a search ----------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SearchResult:
    """What a search found. ``best`` is None when no trial ran ok under the budget.

    - ``best``: the fastest config measured under the budget (ranked by each config's best sample:
      load only slows a trial); ``best_measured``: that sample's measurements (``samples_per_s``,
      ``peak_bytes``, ``step_time_s``, ...), with ``samples`` (how many) and ``median_samples_per_s``;
      ``best_predicted``: what the estimate said before it ran; ``best_trial``: that sample's number among
      the study's real trials (1, 2, 3... in the order they started, as every table shows it),
      ``best_number``: its number in the Optuna storage (``optuna.load_study(...).trials[best_number]``).
    - ``table``: every trial (:func:`trials_table`); ``n_configs``, ``n_pruned`` (configs the
      estimate pruned and that never ran), ``n_real`` (real trials: ok, oom, error, timeout).
    - ``stop_reason``, ``wall_s`` (this search command), ``calibration``.
    - ``study_name``, ``storage`` (URL without password, or the journal path), ``out_dir``.
    - ``advice``: when no trial ran under the budget, what would fit (fewest devices, precision,
      checkpoint interval, or that the model state alone is over the budget).

    Apply ``best`` to your own training loop with :meth:`apply` or :meth:`plan`; hand it to your
    trainer with :meth:`export`.
    """

    study_name: str
    storage: str
    out_dir: Path
    workload: str
    device: str
    budget_bytes: int
    best: TrainConfig | None
    best_measured: dict | None
    best_predicted: dict | None
    best_trial: int | None
    n_configs: int
    n_pruned: int
    n_real: int
    pruned_by_reason: dict
    stop_reason: str
    wall_s: float
    calibration: Calibration
    table: pd.DataFrame
    workload_source: str | None = None
    advice: tuple[str, ...] = ()  # when nothing ran under the budget: what would fit
    best_number: int | None = None  # the best sample's number in the Optuna storage (best_trial: among real trials)

    @property
    def changes_training(self) -> str | None:
        """What ``best`` changes in the training, in words, for a launcher to print (None: nothing): the
        ``optimizer`` lever's replacement of the workload's optimizer (the ``lean`` space's)."""
        return None if self.best is None else changes_training(self.best)

    def export(self, target: str):
        """The best config in ``target``'s form (:func:`autofit.report.exports.export`: ``hf``, ``accelerate``,
        ``lightning``, ``deepspeed``, ``torchrun``, ``json``). Raises StudyError when there is none."""
        from autofit.core.errors import StudyError
        from autofit.report.exports import export

        if self.best is None:
            raise StudyError(f"study {self.study_name}: no config ran under the budget; nothing to export")
        return export(self.best, target, workload=self.workload_source, budget=self.budget_bytes, device=self.device,
                      extra={"study": self.study_name, "trial": self.best_trial, "measured": self.best_measured})

    def plan(self, device_type: str | None = None):
        """A :class:`autofit.trial.apply.TrainingPlan` of the best config. Raises StudyError when there is none."""
        from autofit.core.errors import StudyError
        from autofit.trial.apply import TrainingPlan

        if self.best is None:
            raise StudyError(f"study {self.study_name}: no config ran under the budget; nothing to apply")
        return TrainingPlan(self.best, device_type or self.device)

    def apply(self, model, optimizer, *, layers=None):
        """``with result.apply(model, optimizer) as run:`` -- the best config on your model (:class:`autofit.trial.apply.TrainingRun`)."""
        device_type = next((p.device.type for p in model.parameters()), self.device)
        return self.plan(device_type).run(model, optimizer, layers)


def _measured_with_samples(trial: TrialRecord, samples: list[TrialRecord]) -> dict:
    """The best sample's measurements, with how many samples the config has and their median samples/s."""
    values = [r.measurement.get("samples_per_s") or 0.0 for r in samples]
    return {**trial.measurement, "samples": len(samples), "median_samples_per_s": float(np.median(values))}


def search_result(study: StudySnapshot, out_dir: str | Path, wall_s: float | None = None) -> SearchResult:
    """The :class:`SearchResult` of a study, from its storage."""
    settings = settings_of(study)
    table = trials_table(study)
    c = counts(table)
    trial = best_trial(study)
    storage = settings.get("storage") or str(Path(out_dir) / JOURNAL_NAME)
    return SearchResult(
        study_name=study.study_name, storage=redact(storage), out_dir=Path(out_dir),
        workload=settings.get("workload_name", ""), device=settings.get("device_type", "cpu"),
        budget_bytes=settings.get("budget_bytes", 0),
        best=trial.config if trial else None,
        best_measured=_measured_with_samples(trial, best_samples(study)) if trial else None,
        best_predicted=dict(trial.prediction) if trial else None,
        best_trial=trial_numbers(study.records)[trial.number] if trial else None,
        best_number=trial.number if trial else None,
        n_configs=space_size(settings), n_pruned=c["pruned"], n_real=c["real"],
        pruned_by_reason=c["pruned_by_reason"], stop_reason=study.stop_reason or "running",
        wall_s=wall_seconds(study) if wall_s is None else wall_s, calibration=calibration_of(study), table=table,
        workload_source=settings.get("workload_source"),
        advice=nothing_fits(settings) if trial is None and study.stop_reason else (),
    )


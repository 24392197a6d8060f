"""The search: an Optuna study over a search space, pruned by the estimate, confirmed by real trials.

One planning step (every worker, before every trial, from what the storage holds):

1. **calibrate** from the real trials so far (:mod:`autofit.estimator.calibration`);
2. **prune**, with a reason, every config that should not run (recorded as a ``PRUNED`` trial
   whose user attrs hold the predicted breakdown): ``invalid`` (more stages than layers),
   ``devices`` (a device split larger than the devices a worker has: never run; estimated unless it
   is a pipeline split whose tied weights' ends were not profiled),
   ``duplicate`` (a checkpoint interval at least a stage's length is one segment per stage,
   the same config as the smallest such interval), ``over_budget`` (calibrated peak with its
   safety margin over the budget), ``too_slow`` (predicted throughput under 1/SLOW_FACTOR of
   the best predicted; or not above the best measured median by ``min_improvement`` even raised
   by the time model's measured error, see ``slow_precision``; or a trial predicted to
   outlast the trial time limit), ``dominated``
   (the same precision, micro-batch, accumulation and split with less recomputation -- none, or
   the same checkpoint policy -- fits and is predicted faster: checkpointing only trades time for
   memory; full and selective are left to the time rules), ``slow_precision`` (every
   config left of a calibration group -- a precision on one layout: one device, or a split of
   that many devices in that mode, :func:`~autofit.study.planner.calibration_group` -- is
   predicted, calibrated, so low that even raised by the time model's measured error it would
   not beat the best measured median by ``min_improvement``, below which a gain is noise, as for
   patience. The error depends on what the trials vouch for (:func:`~autofit.study.planner.vouch_key`:
   the group and whether it checkpoints): for a config of a kind that ran ok, the largest error of
   a step time predicted once its group had run (:func:`~autofit.study.planner.time_margin`); for
   the others, the largest error of a kind's first trial, predicted across kinds, at least
   CROSS_MARGIN_MIN (:func:`~autofit.study.planner.cross_margin`), and until one such trial has
   run they are not ruled out this way: across precisions the prior's error differs, across
   layouts each has costs of its own (a pipeline's bubble and sends, FSDP's gathers), and
   checkpointing's cost is one term fitted from whichever side ran). A prune is re-examined at
   every step: if its reason no longer holds (the config that dominated it ran out of memory,
   calibration shrank the margin), the config becomes a candidate again;
3. **stop** when the real-trial limit is reached, the time is up, ``patience`` real trials in a
   row did not improve the best by ``min_improvement``, the best remaining candidate is
   predicted below BOUND of the best measured (not while a kind no trial vouches for is left and
   the error across kinds is unmeasured), or no candidate is left; but first (unless the
   time is up) **re-measure the leaders** (:mod:`autofit.study.leaders`): one throughput sample
   is noisy, so the configs whose best sample, raised by the measured noise (the largest spread
   between two samples of one config so far, at least NOISE_MIN,
   :func:`~autofit.study.leaders.sample_noise`), beats the best's by ``min_improvement`` are measured
   again with it, up to
   REMEASURE_TOP of them, each to a second trial of its own (never head to head in one process,
   which reads configs of one build closer than they train); a config measured once whose calibrated prediction, raised by the
   noise, reaches the best is a leader too; then the top two get a third sample each while their
   own samples leave their order open (:func:`~autofit.study.leaders.undecided`); the best is the
   config with the highest best sample
   (:func:`autofit.core.records.best_of`). A re-measurement is a real trial of the same config with
   a higher ``sample`` number: it counts towards the trial limit (exploration leaves up to a
   quarter of the limit for them), not towards patience; one that fails or goes over the budget
   rules its config out. Running re-measurements count, so workers and resumed searches never
   take the same measurement twice;
4. otherwise **run** the candidate with the highest calibrated predicted throughput (the first
   trial is the search's best guess, not a calibration probe; what the measured error rules out
   is already pruned above); predictions within TIE of the best are a tie, won by the cheapest
   trial. It runs through the worker's trial runner (by default an
   isolated child, :func:`autofit.trial.run.run_trial` of :data:`autofit.runtime.schedule.DEFAULT_SCHEDULE`)
   under the budget and a time limit sized from its prediction and that schedule; the objective is measured samples/s, and ``trial.set_constraint`` records the
   measured peak minus the budget (and whether it failed), so a trial that went over, or
   failed, is never the best. ``oom``, ``error`` and ``timeout`` are recorded and the search
   goes on.

The sampler is this planner: each trial's params are the planned config (per-dimension
categoricals, so Optuna's tables and plots read naturally). No measurement (config and sample
number) is taken twice: a planning
step and the ask that follows it hold a lock shared by the workers of one output directory;
workers on other machines (an RDB ``--storage``) that pick the same config at the same moment
see the other's trial and prune theirs as a ``duplicate``.

Storage: by default an Optuna journal file, ``<out>/study.journal``, locked with ``flock``
(released by the kernel when a process dies, so ``kill -9`` never leaves a stale lock). Running
the same search again resumes it: finished trials are kept; a trial left ``RUNNING`` by a dead
worker (its process is gone, or its heartbeat is older than STALE_S) is marked ``FAIL``
(status ``interrupted``) and its config planned again.

One trial per device at a time: every trial holds its devices' locks (:mod:`autofit.runtime.devicelock`,
machine-wide), so workers of one search, and searches started side by side (on one directory,
where the second joins the study, or on two), take turns on a device instead of measuring each
other's load. On a CPU, one device, ``workers > 1`` overlaps only planning and process start-up.

Known limitations: a study's search space, budget, workload and device are fixed when it is created.

Modules: :mod:`~autofit.study.settings` (what defines a study), :mod:`~autofit.study.storage`
(the storage, its locks, and the record format: stored trial <-> :class:`autofit.core.records.TrialRecord`),
:mod:`~autofit.study.planner` (the rules above: records in, decisions out; no Optuna),
:mod:`~autofit.study.worker` (the loop each worker runs; its :class:`TrialRunner` is injectable),
:mod:`~autofit.study.launcher` (several local worker processes), :mod:`~autofit.study.progress`
(progress events); :func:`autofit.api.run_study.search` runs a whole study. The public names below are
imported lazily, so ``import autofit.study.planner`` (or the report) pulls in nothing else.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "autofit.core.records": ("PruneReason", "StudySnapshot", "TrialRecord", "TrialStatus"),
    "autofit.study.settings": ("MIN_IMPROVEMENT", "PATIENCE", "TRIAL_TIMEOUT_S", "StudySettings",
                               "default_study_name", "redact", "space_to_dict"),
    "autofit.study.locks": ("ClaimLock", "FlockLock"),
    "autofit.study.storage": ("JOURNAL_NAME", "META_NAME", "config_of", "create_or_load",
                              "distributions", "load_snapshot", "make_storage", "open_study", "read_records",
                              "record_of", "snapshot"),
    "autofit.study.planner": ("BOUND", "TIE", "SLOW_FACTOR", "TRIAL_STARTUP_S", "Planner", "Prune", "Step",
                              "StopReason"),
    "autofit.study.leaders": ("NOISE_MIN", "REMEASURE_SAMPLES", "REMEASURE_TOP", "TIED_SAMPLES",
                              "sample_noise", "undecided"),
    "autofit.study.progress": ("ProgressCallback", "ProgressPrinter", "SearchProgress", "progress_of"),
    "autofit.study.worker": ("HEARTBEAT_S", "ORPHAN_S", "STALE_S", "TrialRunner", "fail_stale_trials", "is_stale",
                             "process_start", "run_trial_isolated", "run_worker", "worker_identity"),
    "autofit.study.launcher": ("run_workers",),
}
_LAZY = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autofit.study' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

"""The worker loop: plan under the claim lock, record prunes, claim a config, run its trial, record it.

Several workers (processes, machines) may run on one study. The trial itself is run by a
:class:`TrialRunner`, by default :func:`run_trial_isolated` (an isolated child process,
:func:`autofit.trial.run.run_trial`); the bench passes its own to replay measured trials.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from pathlib import Path
from typing import Protocol

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.samplers import BaseSampler

from autofit.core.budget import format_bytes
from autofit.core.config import TrainConfig
from autofit.core.procstat import GONE_STATES, stat_fields
from autofit.core.records import (
    PruneReason,
    TrialRecord,
    TrialStatus,
    trial_number,
)
from autofit.estimator.calibration import relative_error
from autofit.estimator.layer_prior import workload_prior
from autofit.estimator.memory_model import needs_selective, needs_split_ends, optimizer_choices
from autofit.estimator.time_model import OpCounts
from autofit.probes.device_rates import DeviceRates, probe_rates
from autofit.probes.links import with_links
from autofit.profiling.data import Profile
from autofit.profiling.profile import profile_workload
from autofit.runtime.schedule import DEFAULT_SCHEDULE
from autofit.study import locks, storage
from autofit.study.planner import Planner
from autofit.study.progress import ProgressCallback, progress_of
from autofit.study.settings import StudySettings
from autofit.trial import host
from autofit.trial.run import TrialResult, run_trial
from autofit.workloads.base import Workload

HEARTBEAT_S = 30.0         # a running trial's worker writes a heartbeat this often
STALE_S = 600.0            # a RUNNING trial without a heartbeat for this long belongs to a dead worker
ORPHAN_S = 60.0            # a RUNNING trial no worker signed within this long was orphaned at birth
MEASURED_KEYS = ("peak_bytes", "per_device_peak_bytes", "peak_reserved_bytes", "context_bytes", "peak_card_bytes",
                 "breakdown", "samples_per_s",
                 "tokens_per_s", "step_time_s", "micro_step_time_s", "optimizer_step_time_s", "error", "wall_s",
                 "wait_s", "started_at",
                 # what the timed steps got from the machine (autofit.runtime.timing)
                 "timed_steps", "starved_steps", "step_samples_s", "step_spread", "cpu_share", "threads", "cpus",
                 "max_wait_share", "device_step_s")


class TrialRunner(Protocol):
    """Runs one trial of ``config`` and returns its :class:`autofit.trial.run.TrialResult` (never raises for
    the trial's sake). ``workload`` is a Workload or its ``--model`` spec. ``memory=False``: a
    re-measurement, whose config's first trial measured its memory: throughput is enough (a result
    without a peak gets the first trial's)."""

    def __call__(self, workload: Workload | str, config: TrainConfig, *, device: str, budget_bytes: int,
                 timeout_s: float, memory: bool = True) -> TrialResult: ...


def run_trial_isolated(workload: Workload | str, config: TrainConfig, *, device: str, budget_bytes: int,
                       timeout_s: float, memory: bool = True) -> TrialResult:
    """The default :class:`TrialRunner`: :func:`autofit.trial.run.run_trial` of the schedule the planner sizes
    time limits from (:data:`autofit.runtime.schedule.DEFAULT_SCHEDULE`; without ``memory``, its steps
    but the tracked ones)."""
    schedule = DEFAULT_SCHEDULE if memory else dataclasses.replace(DEFAULT_SCHEDULE, memory=False)
    return run_trial(workload, config, device=device, budget_bytes=budget_bytes, timeout_s=timeout_s,
                     schedule=schedule)


class PlannedSampler(BaseSampler):
    """Samples exactly the planned config: every field is a relative param set before ``ask``."""

    def __init__(self, dists: dict[str, CategoricalDistribution]) -> None:
        self.dists = dists
        self.pending: dict | None = None

    def infer_relative_search_space(self, study, trial):
        return dict(self.dists)

    def sample_relative(self, study, trial, search_space):
        return dict(self.pending or {})

    def sample_independent(self, study, trial, param_name, param_distribution):
        raise RuntimeError(f"autofit's planner sets every param; {param_name!r} was not planned")


# --- workers that died --------------------------------------------------------------------------


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks (``/proc``), or None when it is gone -- or dead
    and not reaped yet (a zombie: a worker killed under a search that reaps it only at the end)."""
    fields = stat_fields(pid)
    if not fields or fields[0] in GONE_STATES or len(fields) < 20:
        return None
    return fields[19].decode()  # field 22: start time in clock ticks


def worker_identity() -> dict:
    """This process as a trial's ``worker``: host, pid and start time (so a reused pid is told apart)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid())}


def is_stale(record: TrialRecord, now: float) -> bool:
    """Whether a running trial's worker is dead: gone from this host, silent for STALE_S
    elsewhere, or never signed it within ORPHAN_S."""
    worker = record.worker
    started = record.started.timestamp() if record.started else now
    if not worker:  # its worker died between creating it and signing it (a moment, under the lock)
        return now - started > ORPHAN_S
    if worker.get("host") == socket.gethostname() and worker.get("pid"):
        start = process_start(int(worker["pid"]))
        return start is None or (worker.get("start") is not None and start != worker["start"])
    beat = record.heartbeat or started
    return now - float(beat) > STALE_S


def fail_stale_trials(study: optuna.Study, records: list[TrialRecord]) -> list[int]:
    """Mark running trials of dead workers interrupted (FAIL); their configs are planned again."""
    now = time.time()
    failed = []
    for r in records:
        if r.status is TrialStatus.RUNNING and is_stale(r, now):
            try:
                storage.mark_interrupted(study, r.number)
                failed.append(r.number)
            except (RuntimeError, ValueError):
                pass  # finished by its worker meanwhile
    return failed


class _Heartbeat:
    """Writes ``heartbeat`` (time.time()) on the running trial every HEARTBEAT_S seconds."""

    def __init__(self, trial: optuna.Trial) -> None:
        self._trial = trial
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autofit-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                storage.heartbeat(self._trial, time.time())
            except Exception:  # noqa: BLE001 -- a missed heartbeat only delays recovery
                pass

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# --- recording a trial -----------------------------------------------------------------------------


def _errors(prediction: dict, result: TrialResult) -> dict:
    return {
        "peak": relative_error(prediction.get("peak_bytes"), result.judged_peak_bytes),
        "calibrated_peak": relative_error(prediction.get("calibrated_peak_bytes"), result.judged_peak_bytes),
        "step_time": relative_error(prediction.get("step_time_s"), result.step_time_s),
        "prior_step_time": relative_error(prediction.get("prior_step_time_s"), result.step_time_s),
    }


def _first_sample(records: list[TrialRecord], config: TrainConfig) -> TrialRecord | None:
    """The config's first trial that ran ok and read its peak, or None (then a re-measurement reads it)."""
    return next((r for r in sorted(records, key=lambda r: r.number) if r.config == config
                 and r.status is TrialStatus.OK and r.measurement.get("peak_bytes") is not None
                 and r.measurement.get("peak_from_trial") is None), None)


def _with_first_peak(result: TrialResult, first: TrialRecord | None) -> tuple[TrialResult, dict]:
    """``result`` and its measured keys; a throughput sample (no peak) gets the memory its config's first
    trial measured (``first``: a peak is deterministic for a config on one device), tagged
    ``peak_from_trial`` with that trial's number so calibration counts it once."""
    carried = first is not None and result.ok and result.peak_bytes is None
    if carried:
        m = first.measurement
        result = dataclasses.replace(
            result, peak_bytes=m.get("peak_bytes"), per_device_peak_bytes=list(m.get("per_device_peak_bytes") or []),
            peak_reserved_bytes=m.get("peak_reserved_bytes"), context_bytes=m.get("context_bytes"),
            peak_card_bytes=m.get("peak_card_bytes"), breakdown=dict(m.get("breakdown") or result.breakdown))
    data = result.to_dict()
    measured = {k: data.get(k) for k in MEASURED_KEYS}
    if carried:
        measured["peak_from_trial"] = first.number
    return result, measured


def _describe(number: int, config: TrainConfig, result: TrialResult) -> str:
    if result.ok:
        return (f"trial {number} {config.short()}: {result.samples_per_s:.2f} samples/s, peak "
                f"{format_bytes(result.peak_bytes)} ({result.wall_s:.0f} s)")
    return f"trial {number} {config.short()}: {result.status.value}: {result.error} ({result.wall_s:.0f} s)"


def _claimed_elsewhere(records: list[TrialRecord], number: int, config: TrainConfig, sample: int) -> int | None:
    """An earlier trial that took the same measurement (config and sample number), or None."""
    for r in records:
        if r.number < number and r.config == config and r.sample == sample and r.claimed:
            return r.number
    return None


def _prune_summary(prunes) -> str:
    kinds: dict[str, int] = {}
    for p in prunes:
        kinds[p.reason.value] = kinds.get(p.reason.value, 0) + 1
    return "pruned by the estimate: " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in kinds.items())


# --- the loop ------------------------------------------------------------------------------------


def run_worker(settings: StudySettings, workload: Workload, *, profile: Profile | None = None,
               rates: DeviceRates | None = None, counts: OpCounts | None = None,
               progress: ProgressCallback | None = None, started: float | None = None,
               runner: TrialRunner = run_trial_isolated) -> str:
    """Plan, prune and run trials of one study until a stop rule holds. Returns the stop reason.

    ``profile``, ``rates``, ``counts``: the workload's profile, the device's rates and the time
    model's prior (:func:`autofit.estimator.layer_prior.workload_prior`), computed (or read from the disk
    cache) when not given. ``runner`` runs each trial (default: an isolated child process).
    Several workers (processes, machines) may run on one study at once. Raises StudyError when
    the study cannot be opened; KeyboardInterrupt marks the running trial interrupted and propagates.
    """
    space = settings.search_space()
    profile = profile or profile_workload(workload, list(space.precision), device_type=settings.device_type,
                                          split_ends=needs_split_ends(space.configs(), settings.devices),
                                          optimizers=optimizer_choices(space.configs()),
                                          selective=needs_selective(space.configs()))
    rates = rates or probe_rates(settings.device_type, precisions=space.precision)
    if rates.links is None:  # a worker started on its own: the splits' link costs, from the cache the search filled
        rates = with_links(rates, space.configs(), settings.devices)
    # The prior's operator counts, rescaled by the workload's own layer timed in a child (cached).
    if counts is None:
        counts = workload_prior(workload, profile, rates, [p.value for p in space.precision])
    worker = _Worker(settings, Planner(settings, profile, rates, counts), progress,
                     time.monotonic() if started is None else started)
    if "device_rates" not in worker.study.user_attrs:
        worker.study.set_user_attr("device_rates", rates.to_dict())
    try:
        return _run_trials(worker, workload, runner)
    finally:
        host.release()  # an idle trial host holds its device (a CUDA context): not past the search


def _run_trials(worker: _Worker, workload: Workload, runner: TrialRunner) -> str:
    while True:
        step, trial = worker.plan_and_claim()
        if trial is None:  # the caller says why it stopped, once (SearchProgress.stop_reason)
            return step.stop
        config = storage.config_of(trial.params)  # the planned config, or one someone enqueued by hand
        records = storage.settled_records(worker.study, trial.number)
        duplicate = _claimed_elsewhere(records, trial.number, config, step.sample)
        if duplicate is not None:
            why = f"claimed at the same time by trial {trial_number(records, duplicate)} (another machine)"
            storage.prune_claimed(worker.study, trial, PruneReason.DUPLICATE, why)
            continue
        source = workload if workload.source is None else workload.source
        worker.run(trial, config, step.prediction, source, runner, step.sample)


class _Worker:
    """One worker's handle on the study: its planner, sampler, claim lock and progress callback."""

    def __init__(self, settings: StudySettings, planner: Planner, progress: ProgressCallback | None,
                 started: float) -> None:
        out_dir = Path(settings.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.settings, self.planner, self.started = settings, planner, started
        self.dists = storage.distributions(settings.search_space())
        self.sampler = PlannedSampler(self.dists)
        storage.quiet_optuna()
        self.study = optuna.load_study(study_name=settings.study_name, sampler=self.sampler,
                                       storage=storage.make_storage(out_dir, settings.storage))
        self.lock = locks.ClaimLock(out_dir)
        self.progress = progress
        self.calibrated_on: int | None = None

    def emit(self, message: str) -> None:
        if self.progress is not None:
            self.progress(progress_of(storage.read_records(self.study), message, self.started))

    def plan_and_claim(self):
        """Under the claim lock: fail dead workers' trials, plan, record the prunes, then claim the
        planned config. Returns the step and the claimed trial (None: stop)."""
        with self.lock:
            records = storage.read_records(self.study)
            if fail_stale_trials(self.study, records):
                records = storage.read_records(self.study)
            step = self.planner.step(records)
            if step.calibration.n_trials != self.calibrated_on:  # kept with the study as it is learned
                self.calibrated_on = step.calibration.n_trials
                self.study.set_user_attr("calibration", step.calibration.to_dict())
            for p in step.prunes:
                storage.add_pruned(self.study, self.planner.configs[p.index], self.dists, p.reason, p.text,
                                   p.prediction)
            if step.prunes:
                self.emit(_prune_summary(step.prunes))
            if step.run is None:
                self.study.set_user_attr("stop_reason", step.stop)
                return step, None
            return step, self._claim(step.run, step.prediction, step.sample)

    def _claim(self, index: int, prediction: dict, sample: int) -> optuna.Trial:
        self.sampler.pending = self.planner.configs[index].to_dict()
        trial = self.study.ask(fixed_distributions=self.dists)
        self.sampler.pending = None
        storage.sign_claim(trial, worker_identity(), prediction, sample)
        return trial

    def run(self, trial: optuna.Trial, config: TrainConfig, prediction: dict, workload: Workload | str,
            runner: TrialRunner, sample: int = 1) -> None:
        """Run the claimed trial (with a heartbeat) and record its result; an interrupt marks it interrupted."""
        records = storage.read_records(self.study)
        shown = trial_number(records, trial.number)  # real trials from 1, not Optuna's
        first = _first_sample(records, config) if sample > 1 else None
        what = "running" if sample == 1 else f"measuring again (sample {sample}, before the best is crowned)"
        self.emit(f"trial {shown} {config.short()}: {what} (predicted {prediction['samples_per_s']:.3g} "
                  f"samples/s, limit {prediction['trial_timeout_s']:.0f} s)")
        try:
            with _Heartbeat(trial):
                result = runner(workload, config, device=self.settings.device_type,
                                budget_bytes=self.settings.budget_bytes, timeout_s=prediction["trial_timeout_s"],
                                memory=first is None)
        except BaseException:
            try:
                storage.mark_interrupted(self.study, trial)
            finally:
                raise
        errors = _errors(prediction, result)  # before a carried peak: a prediction is judged on its own trial
        result, measured = _with_first_peak(result, first)
        storage.tell_result(self.study, trial, result, prediction, measured, errors, self.settings.budget_bytes,
                            self.settings.devices)
        self.emit(_describe(shown, config, result))

"""What a trial is, once it is recorded: one status vocabulary, prune reasons, and the frozen record.

Everything downstream of the study (the planner, calibration, progress, the report tables)
reads :class:`TrialRecord` values; only :mod:`autofit.study.storage` knows how a record is
stored (as an Optuna trial and its user attrs).
"""

from __future__ import annotations

import datetime
import enum
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from autofit.core.config import TrainConfig


class TrialStatus(str, enum.Enum):
    """How a trial stands. A real trial ends ``ok``, ``oom``, ``error`` or ``timeout``; only
    ``ok`` carries measurements. The planner records ``pruned`` configs (never run); a trial
    still being measured is ``running``; one whose worker died or was stopped is ``interrupted``."""

    OK = "ok"
    OOM = "oom"                  # over the memory budget (or the device's memory)
    ERROR = "error"              # the workload raised, crashed or exited without a result
    TIMEOUT = "timeout"          # past the wall-clock limit; killed
    PRUNED = "pruned"            # the estimate ruled it out; it never ran
    RUNNING = "running"          # claimed by a worker (or queued) and not finished
    INTERRUPTED = "interrupted"  # its worker died or was stopped; the config is planned again

    def __str__(self) -> str:
        return self.value

    @property
    def ran(self) -> bool:
        """A real trial that finished (whatever its outcome)."""
        return self in _RAN


_RAN = frozenset({TrialStatus.OK, TrialStatus.OOM, TrialStatus.ERROR, TrialStatus.TIMEOUT})


class PruneReason(str, enum.Enum):
    """Why the planner ruled a config out (see :mod:`autofit.study.planner`)."""

    INVALID = "invalid"          # cannot run at all (e.g. more stages than layers)
    DEVICES = "devices"          # a device split over the devices a worker has
    DUPLICATE = "duplicate"      # the same run as another config (or claimed twice)
    OVER_BUDGET = "over_budget"  # calibrated peak with its margin over the budget
    TOO_SLOW = "too_slow"        # predicted far slower than the best, or over the trial limit
    DOMINATED = "dominated"      # checkpointing the budget does not need
    SLOW_PRECISION = "slow_precision"  # every config of its precision predicted below the best measured

    def __str__(self) -> str:
        return self.value


def _frozen(mapping: Mapping | None) -> Mapping:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class TrialRecord:
    """One trial of a study, as every reader sees it.

    - ``number``: the trial's number in the storage (Optuna's: pruned configs use numbers up too, so
      a study's first real trial may be number 315); what a user reads is :func:`trial_numbers`'
      count of real trials; ``config``: what ran (or was pruned).
    - ``status``: a :class:`TrialStatus`; ``prune_reason`` and ``reason`` (one line) when pruned.
    - ``prediction``: the estimate and time model before it ran (``peak_bytes``,
      ``calibrated_peak_bytes``, ``step_time_s``, ``prior_step_time_s``, ``samples_per_s``,
      ``trial_timeout_s``, the breakdown...); ``measurement``: the trial's numbers
      (:meth:`autofit.trial.run.TrialResult.to_dict`'s measured keys), empty when it did not run;
      ``errors``: relative prediction errors (``peak``, ``calibrated_peak``, ``step_time``,
      ``prior_step_time``).
    - ``value``: the objective (measured samples/s; 0 for a failed trial, None when not run);
      ``constraints``: name -> value, feasible when all <= 0 (measured peak minus budget, failed).
    - ``started``/``finished``: wall-clock datetimes; ``worker``: who ran it (host, pid, start);
      ``heartbeat``: the worker's last sign of life (``time.time()``).
    - ``sample``: which measurement of its config this trial is: 1 the first, 2 and more a
      re-measurement the planner asked for before crowning the best (one throughput sample is
      noisy; a config is ranked by its best sample, which load inflates least, :func:`best_of`).
    """

    number: int
    config: TrainConfig
    status: TrialStatus
    prediction: Mapping[str, Any] = field(default_factory=dict)
    measurement: Mapping[str, Any] = field(default_factory=dict)
    errors: Mapping[str, Any] = field(default_factory=dict)
    prune_reason: PruneReason | None = None
    reason: str | None = None
    value: float | None = None
    constraints: Mapping[str, float] = field(default_factory=dict)
    started: datetime.datetime | None = None
    finished: datetime.datetime | None = None
    worker: Mapping[str, Any] = field(default_factory=dict)
    heartbeat: float | None = None
    sample: int = 1

    def __post_init__(self) -> None:
        for name in ("prediction", "measurement", "errors", "constraints", "worker"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    @property
    def feasible(self) -> bool:
        """Ran ok and met every constraint (its measured peak fits the budget): a candidate for the best."""
        return self.status is TrialStatus.OK and all(v <= 0 for v in self.constraints.values())

    @property
    def claimed(self) -> bool:
        """Ran, or is running: the config is taken (never planned again)."""
        return self.status.ran or self.status is TrialStatus.RUNNING


def started_a_run(record: TrialRecord) -> bool:
    """A trial a worker claimed to run: every status but ``pruned``, and a claim pruned afterwards
    (another machine took the same measurement at once: it keeps its worker's signature), so a
    trial's number never changes once shown."""
    return record.status is not TrialStatus.PRUNED or bool(record.worker)


def trial_numbers(records: Sequence[TrialRecord]) -> dict[int, int]:
    """The number a user reads for each real trial, by its storage number: real trials (those that
    :func:`started_a_run`) counted 1, 2, 3... in the order they started (their storage numbers'
    order). Pruned configs have none. Every table, picture, progress line and export shows these;
    the storage numbers stay in ``trials.csv``'s ``number`` column for Optuna's own tools."""
    ran = sorted(r.number for r in records if started_a_run(r))
    return {number: i for i, number in enumerate(ran, 1)}


def trial_number(records: Sequence[TrialRecord], number: int) -> int:
    """The user's number (:func:`trial_numbers`) of the real trial stored as ``number``: one more
    than the real trials stored before it (``records`` need not hold it yet)."""
    return 1 + sum(1 for r in records if r.number < number and started_a_run(r))


def config_samples(records: Sequence[TrialRecord]) -> dict[TrainConfig, list[TrialRecord]]:
    """Per config, its feasible real trials (the first and any re-measurements), in trial order.
    A config any of whose real trials failed or went over the budget is left out: it does not
    run reliably under the budget."""
    out: dict[TrainConfig, list[TrialRecord]] = {}
    failed = set()
    for r in sorted(records, key=lambda r: r.number):
        if r.feasible:
            out.setdefault(r.config, []).append(r)
        elif r.status.ran:
            failed.add(r.config)
    return {c: samples for c, samples in out.items() if c not in failed}


def median_value(samples: Sequence[TrialRecord]) -> float:
    """The median objective of a config's samples (:func:`config_samples`)."""
    return float(statistics.median(r.value for r in samples))


def head_to_head_of(record: TrialRecord) -> int | None:
    """The head-to-head a re-measurement was timed in (its first trial's number; studies of earlier
    versions timed leaders of one build together, :mod:`autofit.trial.head_to_head`), or None: a trial of
    its own."""
    value = record.measurement.get("head_to_head")
    return None if value is None else int(value)


# A sample whose every timed step waited for a CPU is a floor, not a figure: it is raised by its longest
# run-queue wait (a step of lock-step threads is late by about that share, docs/facts.md#run-queue-wait),
# with the share capped here so a sample that mostly waited still has a finite reach.
STARVED_SHARE_MAX = 0.9


def reach(record: TrialRecord) -> float:
    """The throughput a sample could have read without the load that starved it: its objective, or, where
    every timed step waited for a CPU, its objective over one less the longest wait's share of a step.

    Another process slows a trial by about the time its threads waited, and not every config alike: beside
    a busy core a step on two threads loses one, so a config that parallelises well loses more than one
    that does not (gpt-tiny, micro-batch 16 against 1: 56 against 35 samples/s quiet, 31 against 31
    beside a busy core, 55 against 49 raised). Ranked as it stands, a starved sample ranks by the load."""
    m = record.measurement
    steps, starved, share = m.get("timed_steps"), m.get("starved_steps"), m.get("max_wait_share")
    if not steps or starved != steps or share is None or record.value is None:
        return float(record.value or 0.0)
    return record.value / (1.0 - min(share, STARVED_SHARE_MAX))


def best_sample(samples: Sequence[TrialRecord]) -> TrialRecord:
    """The sample of a config with the highest :func:`reach` (the lowest trial number among equals),
    whether it ran on its own or head to head.

    Another process on the machine only ever slows a trial down, so a config's fastest sample is
    the one its load inflated least: the sample it is ranked and reported by. Where no sample was
    starved (every timed step waited for a CPU), reach is the objective itself."""
    return max(samples, key=lambda r: (reach(r), -r.number))


def ranked_bests(records: Sequence[TrialRecord]) -> list[TrialRecord]:
    """The best sample (:func:`best_sample`) of each config that ran ok under the budget
    (:func:`config_samples`), best first by :func:`reach` (the lowest trial number first among equals).
    A sample timed head to head (recorded by an earlier version) ranks as any other: timed beside another
    config in one process, it does not say which of them trains faster (docs/facts.md#throughput-noise)."""
    bests = [best_sample(samples) for samples in config_samples(records).values()]
    return sorted(bests, key=lambda r: (-reach(r), r.number))


def best_of(records: Sequence[TrialRecord]) -> TrialRecord | None:
    """The first of :func:`ranked_bests`, or None. Every table, the headline and the pictures report
    this record's figures."""
    ranked = ranked_bests(records)
    return ranked[0] if ranked else None


@dataclass(frozen=True)
class StudySnapshot:
    """A study as the report reads it: its records and what the search stored beside them.

    ``settings``: the search settings as stored (workload, budget, device, space, command...);
    ``runs``: one entry per search command (wall time, workers, stop reason); ``stop_reason``:
    why the last planning step stopped (None while running); ``versions``: the environment
    that created it; ``device_rates``: the device probe's rates; ``profile``: which cached profile
    the search estimated with (``{"key", "version"}``, :func:`autofit.profiling.cache.study_profile`).
    """

    study_name: str
    records: tuple[TrialRecord, ...]
    settings: Mapping[str, Any] = field(default_factory=dict)
    runs: tuple[Mapping[str, Any], ...] = ()
    stop_reason: str | None = None
    versions: Mapping[str, Any] = field(default_factory=dict)
    device_rates: Mapping[str, Any] | None = None
    profile: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "records", tuple(self.records))
        object.__setattr__(self, "runs", tuple(self.runs))
        object.__setattr__(self, "settings", _frozen(self.settings))
        object.__setattr__(self, "versions", _frozen(self.versions))

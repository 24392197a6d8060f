"""Progress events of a search, for a callback (the library never prints)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autofit.core.config import TrainConfig
from autofit.core.records import TrialRecord, TrialStatus, best_of


@dataclass(frozen=True)
class SearchProgress:
    """A progress event for a callback (the library never prints).

    ``real``: real trials finished; ``pruned``: configs pruned by the estimate; ``running``;
    ``best_samples_per_s``/``best_config``: the best config so far and its objective, its best sample's as
    in every table (:func:`autofit.core.records.best_of`; None before);
    ``message``: one line about what just happened; ``elapsed_s``; ``done``: the search ended, and
    ``stop_reason`` says why (one short line; None on every other event);
    ``starting``: the study is not open yet (profiling the workload): the counts are not read (zero).
    """

    real: int
    pruned: int
    running: int
    best_samples_per_s: float | None
    best_config: TrainConfig | None
    message: str
    elapsed_s: float
    done: bool = False
    starting: bool = False
    stop_reason: str | None = None


def starting_progress(message: str, started: float) -> SearchProgress:
    """An event from before the study is opened: no counts yet (``started``: a time.monotonic())."""
    return SearchProgress(0, 0, 0, None, None, message, time.monotonic() - started, starting=True)


ProgressCallback = Callable[[SearchProgress], None]


def progress_of(records: Sequence[TrialRecord], message: str, started: float, done: bool = False,
                stop_reason: str | None = None) -> SearchProgress:
    """Counts and the best feasible trial, from the study's records (``started``: a time.monotonic())."""
    ran = {r.config for r in records if r.status.ran}
    pruned = {r.config for r in records if r.status is TrialStatus.PRUNED} - ran
    running = sum(r.status is TrialStatus.RUNNING for r in records)
    real = sum(r.status.ran for r in records)
    best = best_of(list(records))
    return SearchProgress(real, len(pruned), running, None if best is None else best.value,
                          None if best is None else best.config, message, time.monotonic() - started, done,
                          stop_reason=stop_reason)

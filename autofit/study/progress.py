"""Progress events of a search, for a callback, and :class:`ProgressPrinter`, the callback that prints them.

The library prints only through a ProgressPrinter it is given: ``autofit search`` passes one, and
so does ``autofit.search(progress=True)``, its default (:mod:`autofit.api`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

from autofit.core.config import TrainConfig
from autofit.core.records import TrialRecord, TrialStatus, best_of


@dataclass(frozen=True)
class SearchProgress:
    """A progress event for a callback.

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


class ProgressPrinter:
    """The progress lines ``autofit search`` prints: on a terminal one live line (counts, best so far,
    the last event); otherwise a line per event, ``[  12s] message``. On ``stream`` (default: stderr,
    read when the printer is made). Call :meth:`close` at the end (a live line gets its newline)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        try:
            self.tty = self.stream.isatty()
        except (AttributeError, ValueError):  # a stream without a file behind it, or closed
            self.tty = False
        self.width = 0

    def __call__(self, event: SearchProgress) -> None:
        best = "-" if event.best_samples_per_s is None else f"{event.best_samples_per_s:,.2f} samples/s"
        if self.tty:
            counts = "" if event.starting else f"{event.real} real, {event.pruned} pruned, best {best} | "
            line = f"[{event.elapsed_s:5.0f}s] {counts}{event.message}"[:160]
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
            if event.done:
                self.stream.write("\n")
                self.width = 0
        else:
            self.stream.write(f"[{event.elapsed_s:5.0f}s] {event.message}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.width:
            self.stream.write("\n")
            self.stream.flush()
            self.width = 0

"""The two oracles the suite runs strategies through: :class:`ReplayOracle` answers trials from a
measured grid, :class:`LiveOracle` runs them for real (see :mod:`autofit.bench.search`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from autofit.bench.common import seconds
from autofit.bench.problem import Oracle, Outcome
from autofit.bench.search_data import Grid, GridPoint
from autofit.bench.search_grid import SCHEDULE, TRIAL_TIMEOUT_S
from autofit.core.config import TrainConfig
from autofit.core.records import TrialStatus


class ReplayOracle(Oracle):
    """Answers trials from a measured grid; charges each the grid's cost (see :mod:`autofit.bench.search`).

    A strategy sees what a real trial would have shown it, noise included: the first run of a
    config answers the grid trial's own throughput, a second run (a re-measurement) the grid's
    second sample, and further runs the grid's further samples in the order taken, then from the first
    again (a config that fits one of its cell's budgets has several; over all of them, its trial's
    sample only). The answer is still scored by the ground truth (the best sample). ``first_sample`` 1
    starts from the second sample: another draw of the noise, to see whether a strategy's answer
    holds under it."""

    def __init__(self, grid: Grid, budget_bytes: int, first_sample: int = 0) -> None:
        super().__init__()
        self.grid = grid
        self.budget_bytes = budget_bytes
        self.first_sample = first_sample
        self.runs: dict[TrainConfig, int] = {}

    def sample(self, point: GridPoint) -> float | None:
        """The throughput this run of ``point`` measures (see the class docstring)."""
        samples = point.samples() or [point.samples_per_s]
        k = self.runs.get(point.config, 0)
        self.runs[point.config] = k + 1
        return samples[(k + self.first_sample) % len(samples)]

    def _run(self, config: TrainConfig, memory: bool = True) -> Outcome:
        point = self.grid.points.get(config)
        if point is None:
            raise KeyError(f"{config.short()} is not in the measured grid")
        if point.status is not TrialStatus.OK:
            return Outcome(config, point.status, None, None, point.wall_s)
        if point.peak_bytes > self.budget_bytes:
            return Outcome(config, TrialStatus.OOM, None, None, self.grid.oom_floor_s + (point.step_time_s or 0.0))
        sample = self.sample(point)
        step = config.samples_per_step / sample if sample else point.step_time_s
        cost_s = point.wall_s if memory else throughput_sample_s(point)
        return Outcome(config, TrialStatus.OK, sample, point.peak_bytes if memory else None, cost_s, step)


def throughput_sample_s(point: GridPoint) -> float:
    """What a throughput sample of ``point`` (a re-measurement: no tracked steps) costs: its grid trial's wall
    time less the seconds it spent under the CPU memory tracker, plus the warm-up steps run bare instead
    (each charged a whole step of the config, at least what the trial's steps ran). A grid that did not
    record ``tracked_s`` (written before it, or measured on CUDA, which has no tracker) charges the whole trial."""
    if point.tracked_s is None or point.step_time_s is None:
        return point.wall_s
    return point.wall_s - point.tracked_s + SCHEDULE.warmup_steps * point.step_time_s


class LiveOracle(Oracle):
    """Runs each trial for real with :func:`autofit.trial.run.run_trial`, the budget enforced."""

    def __init__(self, workload: str, budget_bytes: int, progress: Callable[[str], None] = lambda _m: None,
                 label: str = "") -> None:
        super().__init__()
        self.workload = workload
        self.budget_bytes = budget_bytes
        self.progress = progress
        self.label = label

    def _run(self, config: TrainConfig, memory: bool = True) -> Outcome:
        from autofit.trial.run import run_trial

        schedule = SCHEDULE if memory else dataclasses.replace(SCHEDULE, memory=False)
        r = run_trial(self.workload, config, device="cpu", budget_bytes=self.budget_bytes, schedule=schedule,
                      timeout_s=TRIAL_TIMEOUT_S)
        self.progress(f"live {self.label}: {config.short()} {r.status.value} {seconds(r.samples_per_s)} samples/s "
                      f"({r.wall_s:.1f} s)")
        return Outcome(config, r.status, r.samples_per_s, r.peak_bytes, r.wall_s, r.step_time_s, r)

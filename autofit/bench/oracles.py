"""The two oracles the suite runs strategies through: :class:`ReplayOracle` answers trials from a
measured grid, :class:`LiveOracle` runs them for real (see :mod:`autofit.bench.search`)."""

from __future__ import annotations

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
        self.together_runs: dict[TrainConfig, int] = {}

    def sample(self, point: GridPoint) -> float | None:
        """The throughput this run of ``point`` measures (see the class docstring)."""
        samples = point.samples() or [point.samples_per_s]
        k = self.runs.get(point.config, 0)
        self.runs[point.config] = k + 1
        return samples[(k + self.first_sample) % len(samples)]

    def _run(self, config: TrainConfig) -> Outcome:
        point = self.grid.points.get(config)
        if point is None:
            raise KeyError(f"{config.short()} is not in the measured grid")
        if point.status is not TrialStatus.OK:
            return Outcome(config, point.status, None, None, point.wall_s)
        if point.peak_bytes > self.budget_bytes:
            return Outcome(config, TrialStatus.OOM, None, None, self.grid.oom_floor_s + (point.step_time_s or 0.0))
        sample = self.sample(point)
        step = config.samples_per_step / sample if sample else point.step_time_s
        return Outcome(config, TrialStatus.OK, sample, point.peak_bytes, point.wall_s, step)

    def _run_together(self, configs: list[TrainConfig]) -> list[Outcome]:
        """A head-to-head answers each member what the grid's head-to-head of its build measured it at (the
        members' order there is what a head-to-head of them measures: one process, steps interleaved), in the
        order taken, then from the first again. It costs each member's own trial, less a process start (the
        grid's OOM floor) for each after the first. A grid measured before head-to-heads were (no figures):
        each member runs on its own, one after another."""
        points = [self.grid.points.get(c) for c in configs]
        if not all(p is not None and p.together_samples_per_s and p.status is TrialStatus.OK
                   and p.peak_bytes is not None and p.peak_bytes <= self.budget_bytes for p in points):
            return super()._run_together(configs)
        outcomes = []
        for i, (config, point) in enumerate(zip(configs, points)):
            k = self.together_runs.get(config, 0)
            self.together_runs[config] = k + 1
            sample = point.together_samples_per_s[k % len(point.together_samples_per_s)]
            cost = point.wall_s if i == 0 else max(point.wall_s - self.grid.oom_floor_s, 0.0)
            outcomes.append(Outcome(config, TrialStatus.OK, sample, point.peak_bytes, cost,
                                    config.samples_per_step / sample))
        return outcomes


class LiveOracle(Oracle):
    """Runs each trial for real with :func:`autofit.trial.run.run_trial`, the budget enforced."""

    def __init__(self, workload: str, budget_bytes: int, progress: Callable[[str], None] = lambda _m: None,
                 label: str = "") -> None:
        super().__init__()
        self.workload = workload
        self.budget_bytes = budget_bytes
        self.progress = progress
        self.label = label

    def _run(self, config: TrainConfig) -> Outcome:
        from autofit.trial.run import run_trial

        r = run_trial(self.workload, config, device="cpu", budget_bytes=self.budget_bytes, schedule=SCHEDULE,
                      timeout_s=TRIAL_TIMEOUT_S)
        self.progress(f"live {self.label}: {config.short()} {r.status.value} {seconds(r.samples_per_s)} samples/s "
                      f"({r.wall_s:.1f} s)")
        return Outcome(config, r.status, r.samples_per_s, r.peak_bytes, r.wall_s, r.step_time_s, r)

    def _run_together(self, configs: list[TrainConfig]) -> list[Outcome]:
        """The search's own head-to-head (:func:`autofit.trial.run.run_head_to_head`), for real."""
        from autofit.trial.run import run_head_to_head

        results = run_head_to_head(self.workload, configs, device="cpu", timeout_s=TRIAL_TIMEOUT_S * len(configs),
                                   schedule=SCHEDULE)
        self.progress(f"live {self.label}: head to head " + ", ".join(
            f"{c.short()} {r.status.value} {seconds(r.samples_per_s)} samples/s" for c, r in zip(configs, results))
            + f" ({sum(r.wall_s for r in results):.1f} s)")
        return [Outcome(c, r.status, r.samples_per_s, r.peak_bytes, r.wall_s, r.step_time_s, r)
                for c, r in zip(configs, results)]

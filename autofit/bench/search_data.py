"""The search suite's data: a cell (workload, grid and budgets), its measured grid, one strategy's scored run,
and the suite's results, read by the driver, the replay and the tables."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path

from autofit.bench.problem import OracleRecord
from autofit.bench.strategies import Strategy
from autofit.core.config import (
    CheckpointPolicy,
    OptimizerChoice,
    Precision,
    SplitMode,
    TrainConfig,
)
from autofit.core.records import TrialStatus

MiB = 2**20


class BenchMode(str, enum.Enum):
    """How a strategy's run met its trials: each one real (``live``) or answered from the measured grid (``replay``)."""

    LIVE = "live"
    REPLAY = "replay"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Cell:
    """A workload's grid and the budgets that cut it (chosen from the estimate so that each binds)."""

    workload: str
    global_batch: int
    micro_batches: tuple[int, ...]
    precisions: tuple[Precision, ...]
    budgets_mib: tuple[int, ...]
    checkpoints: tuple[int, ...] = (0, 1)
    device_splits: tuple[int, ...] = (1,)        # with split_modes, as in autofit.core.space.SearchSpace
    split_modes: tuple[SplitMode, ...] = (SplitMode.PIPELINE,)
    # the lean levers (autofit's search is given them; the finders keep the workload's optimizer, full policy)
    optimizers: tuple[OptimizerChoice, ...] = (OptimizerChoice.AS_GIVEN,)
    checkpoint_policies: tuple[CheckpointPolicy, ...] = (CheckpointPolicy.FULL,)
    device: str = "cpu"   # where the grid is measured (``cuda``: scripts/gpu_grid.py on a GPU)

    @property
    def lean(self) -> bool:
        """Whether the grid has a lean lever (another optimizer or selective checkpointing)."""
        return self.optimizers != (OptimizerChoice.AS_GIVEN,) or self.checkpoint_policies != (CheckpointPolicy.FULL,)


# --------------------------------------------------------------------------------------
# The measured grid


@dataclass(frozen=True)
class GridPoint:
    """One measured config. ``samples_per_s`` is the ground truth: the best of its throughput samples
    (:meth:`samples`: the trial's own figure, then separate samples taken at other moments), since
    other processes' load only ever slows a step down."""

    config: TrainConfig
    status: TrialStatus
    peak_bytes: int | None
    samples_per_s: float | None
    step_time_s: float | None
    wall_s: float
    predicted_peak_bytes: float | None = None
    error: str | None = None
    trial_samples_per_s: float | None = None
    second_samples_per_s: float | None = None
    more_samples_per_s: tuple[float, ...] = ()   # samples after the second, in the order taken
    tracked_s: float | None = None  # the trial's seconds under the CPU memory tracker (None: not recorded)

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", TrialStatus(self.status))
        object.__setattr__(self, "more_samples_per_s", tuple(self.more_samples_per_s))

    def samples(self) -> list[float]:
        """Every throughput sample of this config, in the order taken (the trial's first)."""
        return [s for s in (self.trial_samples_per_s, self.second_samples_per_s, *self.more_samples_per_s) if s]

    def truth_noise(self) -> float | None:
        """How far the ground truth (the best sample) may sit from the config's quiet throughput: the gap
        between its two best samples, as a fraction of the best (None with fewer than two samples)."""
        return top_two_gap(self.samples())


def top_two_gap(samples: list[float]) -> float | None:
    """The gap between the two best of ``samples``, as a fraction of the best (None with fewer than two)."""
    top = sorted(samples, reverse=True)[:2]
    return 1.0 - top[1] / top[0] if len(top) == 2 else None


TRUTH_NOISE_TARGET = 0.03   # the verdicts compare answers at 98% of an optimum: the truth itself must be closer


@dataclass(frozen=True)
class TruthNoise:
    """How well a grid's ground truth is known: per config that has several samples, how many were taken
    and the gap between its two best (:meth:`GridPoint.truth_noise`)."""

    samples: tuple[int, ...]
    gaps: tuple[float, ...]

    @classmethod
    def of(cls, grids: list[Grid]) -> TruthNoise:
        points = [p for g in grids for p in g.points.values() if p.truth_noise() is not None]
        return cls(tuple(len(p.samples()) for p in points), tuple(p.truth_noise() for p in points))

    def over_target(self) -> int:
        return sum(g >= TRUTH_NOISE_TARGET for g in self.gaps)


def sample_spreads(grids: list[Grid]) -> list[float]:
    """Per config with both, how far its trial's throughput and its second sample differ (larger / smaller
    - 1, as :func:`autofit.study.leaders.sample_noise` measures a study's): what one sample's noise is."""
    return [max(a, b) / min(a, b) - 1.0 for g in grids for p in g.points.values()
            if (a := p.trial_samples_per_s) and (b := p.second_samples_per_s)]


@dataclass
class Grid:
    """Every config of a cell, measured once without a budget."""

    cell: Cell
    points: dict[TrainConfig, GridPoint]
    oom_floor_s: float          # wall time of a trial that goes over its budget at the first operator
    param_count: int
    wall_s: float = 0.0
    first_use_s: float = 0.0    # autofit's cold start: profiling on fake tensors, the device (and link) probes, no caches
    warm_use_s: float | None = None  # the same with every cache filled, in a new process (None: not measured)
    first_use_parts_s: dict[str, float] = field(default_factory=dict)  # the cold first use's parts, by name
    warm_server_ready_s: float | None = None  # that process's trial fork server, ready (None: not measured)

    def feasible(self, budget_bytes: int) -> list[GridPoint]:
        return [p for p in self.points.values()
                if p.status is TrialStatus.OK and p.peak_bytes is not None and p.peak_bytes <= budget_bytes]

    def optimum(self, budget_bytes: int) -> GridPoint | None:
        feasible = self.feasible(budget_bytes)
        return max(feasible, key=lambda p: p.samples_per_s) if feasible else None

    def lever_margins(self, budget_bytes: int) -> list[tuple[str, GridPoint | None]]:
        """Each lever the optimum uses, with the best config that fits without it (None: nothing fits).

        The levers: checkpointing (``checkpoint_every > 0``), accumulation (``grad_accum > 1`` at
        the cell's fixed global batch), a device split (``device_split > 1``) and the lean ones:
        another optimizer than the workload's own, selective checkpointing. The optimum's
        throughput over that config's is what the lever is worth in this cell, as measured.
        """
        best = self.optimum(budget_bytes)
        if best is None:
            return []
        levers = (("checkpointing", lambda c: c.checkpoint_every > 0), ("accumulation", lambda c: c.grad_accum > 1),
                  ("a device split", lambda c: c.device_split > 1),
                  ("another optimizer", lambda c: c.changes_optimizer),
                  ("selective checkpointing", lambda c: c.checkpoint_policy is CheckpointPolicy.SELECTIVE))
        out = []
        for name, uses in levers:
            if uses(best.config):
                without = [p for p in self.feasible(budget_bytes) if not uses(p.config)]
                out.append((name, max(without, key=lambda p: p.samples_per_s) if without else None))
        return out

    def fraction(self, config: TrainConfig | None, budget_bytes: int) -> float:
        """Grid throughput of ``config`` over the optimum; 0 for no answer or one that does not fit."""
        best = self.optimum(budget_bytes)
        point = self.points.get(config) if config is not None else None
        if best is None or point is None or point.status is not TrialStatus.OK or point.peak_bytes > budget_bytes:
            return 0.0
        return point.samples_per_s / best.samples_per_s


# --------------------------------------------------------------------------------------
# One strategy run, scored


@dataclass
class RunResult:
    strategy: str
    workload: str
    budget_bytes: int
    seed: int
    mode: BenchMode
    answer: TrainConfig | None
    fraction: float                  # grid throughput of the answer over the optimum
    wall_s: float
    trials: int
    oom_trials: int
    failed_trials: int               # error or timeout
    time_to_target_s: float | None   # clock when the incumbent first reached 95% of the optimum
    error: str | None = None
    live_samples_per_s: float | None = None
    history: list[OracleRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra_s: float = 0.0             # charged for work done elsewhere (autofit's first use)
    reached_98_at: int | None = None  # index in history of the trial after which the incumbent first reached 98%

    def __post_init__(self) -> None:
        self.mode = BenchMode(self.mode)

    @property
    def time_to_98_s(self) -> float | None:
        """The strategy's clock when the config it would answer first reached 98% of the optimum (None: never)."""
        return None if self.reached_98_at is None else self.history[self.reached_98_at].clock_s

    @property
    def trials_s(self) -> float:
        return sum(r.outcome.cost_s for r in self.history)

    def row(self) -> dict:
        return {
            "strategy": self.strategy, "workload": self.workload, "budget_mib": self.budget_bytes / MiB,
            "seed": self.seed, "mode": self.mode, "answer": self.answer.short() if self.answer else "",
            "fraction_of_optimum": self.fraction, "wall_s": self.wall_s, "trials": self.trials,
            "oom_trials": self.oom_trials, "failed_trials": self.failed_trials,
            "time_to_95pct_s": self.time_to_target_s, "time_to_98pct_s": self.time_to_98_s, "trials_s": self.trials_s, "charged_s": self.extra_s,
            "own_work_s": self.wall_s - self.trials_s - self.extra_s if self.history or self.extra_s else None,
            "error": self.error or "",
            "trial_sequence": " ; ".join(f"{r.outcome.config.short()}={r.outcome.status}" for r in self.history),
            "notes": " ; ".join(self.notes),
        }


def grids_by_cell(grids: list[Grid]) -> dict[tuple[str, int], Grid]:
    """Each grid under every cell it serves: ``(workload, budget_bytes)``, one key per budget."""
    return {(g.cell.workload, b * MiB): g for g in grids for b in g.cell.budgets_mib}


# --------------------------------------------------------------------------------------
# The suite


@dataclass
class SearchResults:
    grids: list[Grid]
    runs: list[RunResult]
    live_cell: tuple[str, int]
    seeds: int
    wall_s: float
    files: list[Path] = field(default_factory=list)
    strategies: tuple[Strategy, ...] = ()


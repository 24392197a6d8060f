"""What a search strategy is given and what it sees: a :class:`Problem` (a workload, a budget and a
small grid with a fixed global batch), an :class:`Oracle` that runs its trials and keeps its clock,
and an :class:`Outcome` per trial.

The oracles themselves (a measured grid replayed, or real trials) are in :mod:`autofit.bench.oracles`;
the strategies in :mod:`autofit.bench.strategies` and :mod:`autofit.bench.finders`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from autofit.core.config import (
    CheckpointPolicy,
    OptimizerChoice,
    Precision,
    SplitMode,
    TrainConfig,
)
from autofit.core.records import TrialStatus

ONE_DEVICE = (1, SplitMode.PIPELINE)   # a (device_split, split_mode) pair: one device, whatever the mode


@dataclass(frozen=True)
class Problem:
    """One search: a workload, a budget per device, and a small grid with a fixed global batch."""

    workload: str
    budget_bytes: int
    global_batch: int | None           # None: no accumulation, the batch is the micro-batch (the peers' own setting)
    precisions: tuple[Precision, ...]
    micro_batches: tuple[int, ...]     # ascending; each divides global_batch
    checkpoints: tuple[int, ...] = (0, 1)
    # What a batch-size finder leaves alone: the precision it runs at (the tools' own default is fp32:
    # HF Trainer without bf16/fp16, Lightning "32-true", DeepSpeed without a bf16 section; see
    # at_user_precision and precision_sweep) and checkpointing, which none of them turns on.
    default_precision: Precision = Precision.FP32
    default_checkpoint: int = 0
    param_count: int = 0               # for the DeepSpeed model-state formula
    # Devices the model may be split over and how (autofit.core.space.SearchSpace's rule: a split of 1
    # is one device whatever the mode; under fsdp each of the device_split ranks runs a micro-batch,
    # so grad_accum = global_batch / (micro_batch x ranks) and only micro-batches dividing it count).
    # A batch-size finder runs on one device: its configs are always split 1.
    device_splits: tuple[int, ...] = (1,)
    split_modes: tuple[SplitMode, ...] = (SplitMode.PIPELINE,)
    # The lean levers (autofit.core.space.SearchSpace's optimizer and checkpoint_policy). A finder keeps
    # the workload's own optimizer and full checkpointing, as the real tools do: config()'s defaults.
    optimizers: tuple[OptimizerChoice, ...] = (OptimizerChoice.AS_GIVEN,)
    checkpoint_policies: tuple[CheckpointPolicy, ...] = (CheckpointPolicy.FULL,)
    device: str = "cpu"                # what autofit's search estimates and probes for (the grid's device)

    def __post_init__(self) -> None:
        bad = [m for m in self.micro_batches if self.global_batch is not None and self.global_batch % m]
        if bad or list(self.micro_batches) != sorted(set(self.micro_batches)):
            raise ValueError(f"micro_batches must ascend and divide {self.global_batch}: {self.micro_batches}")
        if self.default_precision not in self.precisions or self.default_checkpoint not in self.checkpoints:
            raise ValueError("the peers' default precision and checkpointing must be in the grid")
        if 1 not in self.device_splits:
            raise ValueError(f"device_splits must include 1 (one device, the peers' setting): {self.device_splits}")
        if OptimizerChoice.AS_GIVEN not in self.optimizers or CheckpointPolicy.FULL not in self.checkpoint_policies:
            raise ValueError("the workload's own optimizer (as-given) and full checkpointing (the peers' setting) "
                             "must be in the grid")

    def config(self, micro_batch: int, precision: Precision | str | None = None,
               checkpoint_every: int | None = None, split: tuple[int, SplitMode] = ONE_DEVICE,
               optimizer: OptimizerChoice | str = OptimizerChoice.AS_GIVEN,
               checkpoint_policy: CheckpointPolicy | str = CheckpointPolicy.FULL) -> TrainConfig:
        precision = self.default_precision if precision is None else Precision(precision)
        checkpoint = self.default_checkpoint if checkpoint_every is None else checkpoint_every
        device_split, mode = split
        ranks = device_split if mode is SplitMode.FSDP else 1
        grad_accum = 1 if self.global_batch is None else self.global_batch // (micro_batch * ranks)
        return TrainConfig(precision, micro_batch, grad_accum, checkpoint, device_split, mode, optimizer,
                           checkpoint_policy)

    def splits(self) -> list[tuple[int, SplitMode]]:
        """The distinct (device_split, split_mode) pairs of the grid, one device first."""
        pairs = [(d, SplitMode(m) if d > 1 else SplitMode.PIPELINE) for d in self.device_splits for m in self.split_modes]
        return sorted(dict.fromkeys(pairs), key=lambda p: (p[0], p[1].value))

    def micro_batches_for(self, split: tuple[int, SplitMode]) -> tuple[int, ...]:
        """The micro-batches a split can run at the global batch (under fsdp, ranks x micro-batch must divide it)."""
        ranks = split[0] if split[1] is SplitMode.FSDP else 1
        return tuple(m for m in self.micro_batches if self.global_batch is None or self.global_batch % (m * ranks) == 0)

    def configs(self) -> list[TrainConfig]:
        """The whole grid, in a stable order (the same configs as autofit's SearchSpace for these values;
        no checkpointing is listed once, as full, as there)."""
        configs = [self.config(m, p, c, s, o, k) for p in self.precisions for m in self.micro_batches
                   for c in self.checkpoints for s in self.splits() if m in self.micro_batches_for(s)
                   for o in self.optimizers for k in self.checkpoint_policies]
        return list(dict.fromkeys(configs))

    def floor_micro_batch(self, n: float) -> int | None:
        """The largest allowed micro-batch <= n (None below the smallest)."""
        fitting = [m for m in self.micro_batches if m <= n]
        return fitting[-1] if fitting else None


@dataclass(frozen=True)
class Outcome:
    """What a strategy sees of one trial."""

    config: TrainConfig
    status: TrialStatus               # ok, oom, error, timeout ("ok" and the like are read as one)
    samples_per_s: float | None
    peak_bytes: int | None
    cost_s: float                     # what the trial cost (live: its wall time; replay: the grid's)
    step_time_s: float | None = None
    result: object = None             # the TrialResult, when the trial ran for real

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", TrialStatus(self.status))

    @property
    def ok(self) -> bool:
        return self.status is TrialStatus.OK


@dataclass
class OracleRecord:
    outcome: Outcome
    clock_s: float                    # the strategy's clock when the trial finished


class Oracle(ABC):
    """Runs trials for a strategy and keeps its clock.

    The clock is real time spent outside trials (the strategy's own work: profiling, Optuna's
    sampler) plus what each trial cost. Live, that is the wall clock; replayed, a trial costs
    what the measured grid says it took.
    """

    def __init__(self) -> None:
        self.history: list[OracleRecord] = []
        self.notes: list[str] = []
        self._started = time.perf_counter()
        self._in_trials_s = 0.0
        self._charged_s = 0.0
        self.extra_s = 0.0            # charged for work done elsewhere (see :meth:`charge`)
        # The strategy's own answer after each of its trials, where it says so (autofit: its study's best
        # then); None: the scoring reads it from what the strategy saw, by its criterion.
        self.answers: list[TrainConfig | None] | None = None

    def run(self, config: TrainConfig, memory: bool = True) -> Outcome:
        """One trial of ``config``; ``memory=False``: a throughput sample (a re-measurement) that reads no peak."""
        start = time.perf_counter()
        outcome = self._run(config, memory)
        self._in_trials_s += time.perf_counter() - start
        self._charged_s += outcome.cost_s
        self.history.append(OracleRecord(outcome, self.clock_s))
        return outcome

    def charge(self, seconds: float, why: str) -> None:
        """Add ``seconds`` of work done elsewhere (e.g. a cold profile measured once) to the clock."""
        self._charged_s += seconds
        self.extra_s += seconds
        self.notes.append(f"charged {seconds:.1f} s: {why}")

    @property
    def clock_s(self) -> float:
        return time.perf_counter() - self._started - self._in_trials_s + self._charged_s

    @abstractmethod
    def _run(self, config: TrainConfig, memory: bool = True) -> Outcome:
        ...


class Memo:
    """A strategy's memory of what it ran: a config is never run twice."""

    def __init__(self, oracle: Oracle) -> None:
        self.oracle = oracle
        self.seen: dict[TrainConfig, Outcome] = {}

    def __call__(self, config: TrainConfig) -> Outcome:
        if config not in self.seen:
            self.seen[config] = self.oracle.run(config)
        return self.seen[config]


def best_by_throughput(outcomes) -> TrainConfig | None:
    ok = [o for o in outcomes if o.ok and o.samples_per_s]
    return max(ok, key=lambda o: o.samples_per_s).config if ok else None

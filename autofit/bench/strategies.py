"""The search strategies compared by the search suite, written from their published behaviour.

None of the peers is imported: each is re-implemented here from its documentation and source
(FACTS.md, "Peers"), on the same problem autofit solves -- a fixed global batch, so a
micro-batch ``m`` always runs with ``grad_accum = global_batch / m`` -- and through the same
trial runner (an :class:`Oracle`). Where a peer's algorithm proposes a micro-batch that does not
divide the global batch, it is rounded down to the largest one that does (a user keeping the
global batch would have to do the same); a value already run is answered from memory, not run
again, which only ever favours the peer.

- :func:`accelerate_halving` -- Hugging Face Accelerate ``find_executable_batch_size``: start at
  the largest batch, multiply by 0.5 (or, in newer releases, 0.9) on each OOM, stop at the first
  that runs. Precision and checkpointing stay at the user's defaults.
- :func:`lightning_binsearch` -- Lightning ``BatchSizeFinder(mode="binsearch")``: from
  ``init_val=2`` double until OOM, then binary search between the last success and the
  failure, at most ``max_trials=25`` trials.
- :func:`deepspeed_autotuner` -- DeepSpeed autotuning at its own defaults (``min_train_micro_batch_
  size_per_gpu=1``, ``num_tuning_micro_batch_sizes=3``, ``metric="throughput"``, ``fast=True``,
  ``tuner_early_stopping=5``), micro-batch tuning of ZeRO stage 0 (stages 1-3 partition across
  data-parallel ranks: nothing to gain on one device): a profile run at micro-batch 1, the largest micro-batch predicted
  by linear scaling of its activation memory over 16 bytes/parameter of model states (bf16
  costed as fp32), probes at 1.05x/1x/0.95x of it, binary search with a 5% plateau rule, then
  the tuning list around the maximum and smaller sizes while each gains 5%.
- :func:`optuna_tpe` -- plain Optuna TPE over the whole space (precision, micro-batch,
  checkpointing, and the device split where the grid has one) with real trials only: no
  estimate, no pruning; an OOM is found by running it, scores 0 and is told to the sampler as a
  violated constraint.

The batch finders tune the micro-batch only. How a user would run them fairly (issue 13):

- **at the user's precision** (:func:`at_user_precision`): amp-bf16, :data:`USER_PRECISION`. It is
  the mixed-precision switch each tool documents -- Accelerate ``mixed_precision="bf16"``, the HF
  Trainer's ``bf16=True`` (both ``torch.autocast`` with fp32 weights), Lightning's
  ``precision="bf16-mixed"`` -- and what their guides recommend where the hardware has bf16. Pure
  bf16 weights (Lightning's ``"bf16-true"``) change the optimizer's numerics, so a careful user
  does not choose it for speed alone. DeepSpeed's ``bf16: {enabled: true}`` section is the same
  switch there.
- **as a per-precision sweep** (:func:`precision_sweep`): the finder run once per precision of the
  grid, the best measured answer kept, every run's trials charged to one clock -- what a careful
  user does by hand.

Checkpointing stays off in both (none of the finders turns it on): the handicap that remains.

The batch finders run on one device: where only a device split fits, they find nothing and
score 0, which is what they do (none of them splits a model).

Each strategy is ``fn(problem, oracle, seed) -> TrainConfig | None`` (its answer: the config it
would train with), and declares how it ranks its own trials (:data:`CRITERION`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from autofit.core.config import Precision, SplitMode, TrainConfig
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

    def __post_init__(self) -> None:
        bad = [m for m in self.micro_batches if self.global_batch is not None and self.global_batch % m]
        if bad or list(self.micro_batches) != sorted(set(self.micro_batches)):
            raise ValueError(f"micro_batches must ascend and divide {self.global_batch}: {self.micro_batches}")
        if self.default_precision not in self.precisions or self.default_checkpoint not in self.checkpoints:
            raise ValueError("the peers' default precision and checkpointing must be in the grid")
        if 1 not in self.device_splits:
            raise ValueError(f"device_splits must include 1 (one device, the peers' setting): {self.device_splits}")

    def config(self, micro_batch: int, precision: Precision | str | None = None,
               checkpoint_every: int | None = None, split: tuple[int, SplitMode] = ONE_DEVICE) -> TrainConfig:
        precision = self.default_precision if precision is None else Precision(precision)
        checkpoint = self.default_checkpoint if checkpoint_every is None else checkpoint_every
        device_split, mode = split
        ranks = device_split if mode is SplitMode.FSDP else 1
        grad_accum = 1 if self.global_batch is None else self.global_batch // (micro_batch * ranks)
        return TrainConfig(precision, micro_batch, grad_accum, checkpoint, device_split, mode)

    def splits(self) -> list[tuple[int, SplitMode]]:
        """The distinct (device_split, split_mode) pairs of the grid, one device first."""
        pairs = [(d, SplitMode(m) if d > 1 else SplitMode.PIPELINE) for d in self.device_splits for m in self.split_modes]
        return sorted(dict.fromkeys(pairs), key=lambda p: (p[0], p[1].value))

    def micro_batches_for(self, split: tuple[int, SplitMode]) -> tuple[int, ...]:
        """The micro-batches a split can run at the global batch (under fsdp, ranks x micro-batch must divide it)."""
        ranks = split[0] if split[1] is SplitMode.FSDP else 1
        return tuple(m for m in self.micro_batches if self.global_batch is None or self.global_batch % (m * ranks) == 0)

    def configs(self) -> list[TrainConfig]:
        """The whole grid, in a stable order (the same configs as autofit's SearchSpace for these values)."""
        return [self.config(m, p, c, s) for p in self.precisions for m in self.micro_batches for c in self.checkpoints
                for s in self.splits() if m in self.micro_batches_for(s)]

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

    def run(self, config: TrainConfig) -> Outcome:
        start = time.perf_counter()
        outcome = self._run(config)
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
    def _run(self, config: TrainConfig) -> Outcome:
        ...


class _Memo:
    """A strategy's memory of what it ran: a config is never run twice."""

    def __init__(self, oracle: Oracle) -> None:
        self.oracle = oracle
        self.seen: dict[TrainConfig, Outcome] = {}

    def __call__(self, config: TrainConfig) -> Outcome:
        if config not in self.seen:
            self.seen[config] = self.oracle.run(config)
        return self.seen[config]


def _best_by_throughput(outcomes) -> TrainConfig | None:
    ok = [o for o in outcomes if o.ok and o.samples_per_s]
    return max(ok, key=lambda o: o.samples_per_s).config if ok else None


# --------------------------------------------------------------------------------------
# Hugging Face Accelerate: find_executable_batch_size


def accelerate_halving(problem: Problem, oracle: Oracle, seed: int = 0, factor: float = 0.5) -> TrainConfig | None:
    """Start at the largest micro-batch; on OOM multiply it by ``factor``; the first that runs is the answer."""
    run = _Memo(oracle)
    batch = problem.micro_batches[-1]   # starting_batch_size (128 by default), capped at the global batch
    while batch >= 1:
        micro = problem.floor_micro_batch(batch)
        if micro is None:
            return None
        outcome = run(problem.config(micro))
        if outcome.ok:
            return outcome.config
        # Accelerate: ``batch_size //= 2``; newer releases ``int(batch_size * 0.9)``.
        batch = batch // 2 if factor == 0.5 else int(batch * factor)
    return None


def accelerate_halving_09(problem: Problem, oracle: Oracle, seed: int = 0) -> TrainConfig | None:
    """:func:`accelerate_halving` with the newer factor 0.9."""
    return accelerate_halving(problem, oracle, seed, factor=0.9)


# --------------------------------------------------------------------------------------
# Lightning: BatchSizeFinder(mode="binsearch")


def lightning_binsearch(problem: Problem, oracle: Oracle, seed: int = 0, init_val: int = 2,
                        max_trials: int = 25) -> TrainConfig | None:
    """Double from ``init_val`` until OOM, then bisect between the last success and the failure.

    Lightning's ``_run_binary_scaling``: ``low`` is the last size that ran (1 before any), ``high``
    the last that failed; stop when ``high - low <= 1`` or after ``max_trials``; the answer is the
    size it ends on -- after a failure next to ``low``, ``low`` itself, even the initial 1 that
    never ran. Sizes above the global batch are the global batch (a micro-batch cannot exceed it);
    a size below the smallest allowed micro-batch is the smallest.
    """
    run = _Memo(oracle)
    largest = problem.micro_batches[-1]

    def micro(size: int) -> int:
        return problem.floor_micro_batch(min(size, largest)) or problem.micro_batches[0]

    low, high = 1, None
    size = init_val
    for _ in range(max_trials):
        outcome = run(problem.config(micro(size)))
        if outcome.ok:
            low = size
            if micro(size) == largest:
                break
            if high is not None:
                if high - low <= 1:
                    break
                size = (high + low) // 2
            else:
                size *= 2
        else:
            high = size
            size = (high + low) // 2
            if high - low <= 1:
                break
    return problem.config(micro(size))


# --------------------------------------------------------------------------------------
# DeepSpeed autotuning (micro-batch tuning, ZeRO stage 0)

DS_PLATEAU = 0.05           # METRIC_PERCENT_DIFF_CONST
DS_NUM_TUNING_SIZES = 3     # num_tuning_micro_batch_sizes
DS_MODEL_STATE_BYTES_PER_PARAM = 16   # params 4 + grads 4 + Adam 8; bf16 is costed as fp32


def deepspeed_autotuner(problem: Problem, oracle: Oracle, seed: int = 0) -> TrainConfig | None:
    """DeepSpeed's ``tune_space`` for stage 0: model-info profile run, linear max, probes, bisect, list."""
    run = _Memo(oracle)
    metrics: dict[int, float] = {}   # micro-batch -> samples/s (0 when it did not run)

    def trial(mbs: int) -> float:
        micro = problem.floor_micro_batch(mbs)
        if micro is None:
            return 0.0
        outcome = run(problem.config(micro))
        metrics[micro] = outcome.samples_per_s if outcome.ok else 0.0
        return metrics[micro]

    # 1. model_info_profile_run: micro-batch 1, activation memory per sample by difference.
    smallest = problem.micro_batches[0]
    profile = run(problem.config(smallest))
    if not profile.ok or profile.peak_bytes is None:
        return None
    metrics[smallest] = profile.samples_per_s or 0.0
    instantiation = DS_MODEL_STATE_BYTES_PER_PARAM * problem.param_count
    activation_per_sample = max(1.0, (profile.peak_bytes - instantiation) / smallest)
    calculated_max = int((problem.budget_bytes - instantiation) // activation_per_sample)
    if calculated_max < smallest:
        return None
    # 2. get_min_max_micro_batch_size: the minimum is the profile's size (already run).
    used = [smallest]
    low_bound = smallest
    max_mbs = min(calculated_max, problem.micro_batches[-1])
    found = None
    for mbs in (math.ceil(1.05 * max_mbs), max_mbs, int(0.95 * max_mbs)):
        if mbs > problem.micro_batches[-1]:
            continue
        micro = problem.floor_micro_batch(mbs)
        if micro in used:
            found = micro
            break
        if trial(mbs) > 0:
            used.append(problem.floor_micro_batch(mbs))
            found = problem.floor_micro_batch(mbs)
            break
    if found is None:
        prev_metric = metrics.get(smallest)
        low, high = low_bound, max_mbs
        while low < high:
            mid = (low + high) // 2
            if mid == low:
                break
            if problem.floor_micro_batch(mid) in used and problem.floor_micro_batch(mid) != low:
                low = mid
                continue
            value = trial(mid)
            if value > 0:
                low = mid
                used.append(problem.floor_micro_batch(mid))
                if prev_metric and (value - prev_metric) / prev_metric < DS_PLATEAU:
                    break   # "performance plateaus"
                prev_metric = value
            else:
                high = mid - 1
        found = problem.floor_micro_batch(low)
    max_mbs = found
    # 3. get_tuning_micro_batch_size_list + run_tuning_micro_batch_sizes
    min_mbs = max(low_bound, max_mbs // 2)
    stride = max(1, (max_mbs - min_mbs) // DS_NUM_TUNING_SIZES)
    tuning = [m for m in range(min_mbs, max_mbs, stride) if max_mbs // m != 1] + [max_mbs]
    for mbs in tuning:
        trial(mbs)
    # smaller sizes with the same accumulation, while each gains more than 5%
    start = tuning[-2] + 1 if len(tuning) > 1 else low_bound
    best_metric = metrics.get(problem.floor_micro_batch(max_mbs), 0.0)
    stride = max(1, (max_mbs - start) // 3)
    for mbs in reversed(range(start, max_mbs, stride)):
        micro = problem.floor_micro_batch(mbs)
        if micro is None or micro < start:
            continue
        value = trial(mbs)
        if value > best_metric * (1 + DS_PLATEAU):
            best_metric = value
        else:
            break
    return _best_by_throughput(run.seen.values())


# --------------------------------------------------------------------------------------
# Plain Optuna TPE over the whole grid


def tpe_startup_trials(real_trials: int) -> int:
    """Random start-up trials for a budget of ``real_trials``: a fifth of it, at least 2.

    Optuna's default (10) suits budgets of 100 trials or more; out of 12 it leaves TPE close to
    random search. A fifth keeps TPE's own advice (start-up about a tenth of the trials) within
    reach of a small budget while still seeding both of its density estimates.
    """
    return max(2, real_trials // 5)


def optuna_tpe(problem: Problem, oracle: Oracle, seed: int = 0, real_trials: int = 12) -> TrainConfig | None:
    """TPE (seeded) over precision x micro-batch x checkpointing; every proposal runs for real.

    Set up as a careful Optuna user would for this budget: :func:`tpe_startup_trials` random
    start-up trials, Optuna 5's multivariate TPE (its default for one objective: precision and
    micro-batch interact in memory), and the budget as a constraint (``trial.set_constraint``;
    Optuna 5 deprecates ``constraints_func`` for it): peak/budget - 1 for a trial that ran, +1 for
    an OOM, so TPE learns where the infeasible region is instead of reading an OOM as a slow
    config. The objective is measured samples/s; a failed trial scores 0. A proposal already run
    is told its earlier result without running again. Stops after ``real_trials`` real trials
    (or 20x as many proposals).
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=tpe_startup_trials(real_trials))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    run = _Memo(oracle)
    proposals = 0
    while len(run.seen) < real_trials and proposals < 20 * real_trials:
        proposals += 1
        trial = study.ask()
        split = _suggest_split(trial, problem)
        micro_batches = problem.micro_batches_for(split)
        # a split that allows fewer micro-batches has its own parameter (Optuna's categorical
        # choices cannot change between trials under one name)
        name = "micro_batch" if micro_batches == problem.micro_batches else f"micro_batch_{_split_label(split)}"
        config = problem.config(trial.suggest_categorical(name, list(micro_batches)),
                                trial.suggest_categorical("precision", [p.value for p in problem.precisions]),
                                trial.suggest_categorical("checkpoint_every", list(problem.checkpoints)), split)
        outcome = run(config)
        trial.set_constraint("peak_over_budget", _over_budget(outcome, problem.budget_bytes))
        study.tell(trial, outcome.samples_per_s if outcome.ok and outcome.samples_per_s else 0.0)
        if len(run.seen) == len(problem.configs()):
            break
    return _best_by_throughput(run.seen.values())


def _over_budget(outcome: Outcome, budget_bytes: int) -> float:
    """The constraint TPE is told: > 0 over the budget (an OOM: 1), <= 0 within it."""
    if outcome.ok and outcome.peak_bytes:
        return outcome.peak_bytes / budget_bytes - 1
    return 1.0 if outcome.status is TrialStatus.OOM else 0.0


# --------------------------------------------------------------------------------------
# How a careful user runs a batch finder: at bf16 mixed precision, or once per precision

USER_PRECISION = Precision.AMP_BF16   # see the module docstring


def at_user_precision(problem: Problem, oracle: Oracle, seed: int = 0, *, finder: Callable,
                      **kwargs) -> TrainConfig | None:
    """Run ``finder`` with :data:`USER_PRECISION` as the precision it leaves alone."""
    return finder(dataclasses.replace(problem, default_precision=USER_PRECISION), oracle, seed, **kwargs)


def precision_sweep(problem: Problem, oracle: Oracle, seed: int = 0, *, finder: Callable,
                    **kwargs) -> TrainConfig | None:
    """Run ``finder`` once per precision of the grid on one clock; answer the fastest measured answer.

    An answer a finder never ran (Lightning can end on a size it did not try) has no measured
    throughput to compare: it is kept only when no precision's answer was measured.
    """
    answers = [finder(dataclasses.replace(problem, default_precision=p), oracle, seed, **kwargs)
               for p in problem.precisions]
    measured = {r.outcome.config: r.outcome.samples_per_s for r in oracle.history if r.outcome.ok}
    ran = [a for a in answers if a is not None and measured.get(a)]
    if ran:
        return max(ran, key=lambda a: measured[a])
    return next((a for a in answers if a is not None), None)


def _split_label(split: tuple[int, SplitMode]) -> str:
    return "1" if split[0] == 1 else f"{split[1].value}-{split[0]}"


def _suggest_split(trial, problem: Problem) -> tuple[int, SplitMode]:
    """The device split, a dimension of TPE's space only where the grid has more than one device."""
    splits = problem.splits()
    if len(splits) == 1:
        return splits[0]
    labels = [_split_label(s) for s in splits]
    return splits[labels.index(trial.suggest_categorical("split", labels))]


# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Strategy:
    """A named strategy and how it ranks its own trials (for "time to 95% of the optimum")."""

    name: str
    run: Callable[[Problem, Oracle, int], TrainConfig | None]
    # "throughput": best measured so far; "largest": largest micro-batch that ran; "sweep-largest":
    # the largest that ran per precision, then the fastest of those (a per-precision sweep of a finder)
    criterion: str
    deterministic: bool
    description: str = ""
    kwargs: dict = field(default_factory=dict)
    handicap: str = ""        # what it still leaves out, carried into the headline (e.g. "no checkpointing")

    def __call__(self, problem: Problem, oracle: Oracle, seed: int) -> TrainConfig | None:
        return self.run(problem, oracle, seed, **self.kwargs)


# The batch finders as the tools ship them: (name, function, criterion, description).
FINDERS = (
    ("accelerate-x0.5", accelerate_halving, "largest",
     "HF Accelerate find_executable_batch_size: from the largest micro-batch, x0.5 on OOM"),
    ("accelerate-x0.9", accelerate_halving_09, "largest", "the same with the newer x0.9 factor"),
    ("lightning-binsearch", lightning_binsearch, "largest",
     "Lightning BatchSizeFinder binsearch: double from 2 until OOM, then bisect; it can end on a size it "
     "never ran (1, after an OOM at 2), which counts for best found but not for time to 95%"),
    ("deepspeed-autotuner", deepspeed_autotuner, "throughput",
     "DeepSpeed autotuner at its defaults (stage 0): profile run at micro-batch 1, linear max, probes, bisect "
     "with 5% plateau, tuning list"),
)


def _finder_variants() -> tuple[Strategy, ...]:
    out = []
    for name, fn, criterion, description in FINDERS:
        out.append(Strategy(f"{name} @{USER_PRECISION.value}", at_user_precision, criterion, True,
                            f"{description}; at {USER_PRECISION.value}", {"finder": fn},
                            f"{USER_PRECISION.value} only, no checkpointing"))
        out.append(Strategy(f"{name} sweep", precision_sweep,
                            "sweep-largest" if criterion == "largest" else criterion, True,
                            f"{description}; once per precision, the fastest answer kept, trials summed",
                            {"finder": fn}, "no checkpointing"))
    return tuple(out)


PEERS: tuple[Strategy, ...] = (
    Strategy("optuna-tpe", optuna_tpe, "throughput", False,
             "Optuna TPE over the whole grid, real trials only: start-up trials a fifth of the budget (at least 2), "
             "multivariate, the budget as a constraint (an OOM is found by running and violates it)",
             handicap="no memory estimate"),
) + _finder_variants()


def sweeps(strategies: tuple[Strategy, ...]) -> tuple[Strategy, ...]:
    """The per-precision finder sweeps among ``strategies``."""
    return tuple(s for s in strategies if s.run is precision_sweep)


def incumbent(records: list[OracleRecord], criterion: str) -> list[TrainConfig | None]:
    """The config a strategy would answer after each of its trials, by its own criterion."""
    out: list[TrainConfig | None] = []
    best: dict[object, Outcome] = {}     # the incumbent per precision ("sweep-largest") or overall
    for record in records:
        o = record.outcome
        key = o.config.precision if criterion == "sweep-largest" else None
        if o.ok:
            old = best.get(key)
            if criterion in ("largest", "sweep-largest"):
                better = old is None or o.config.micro_batch > old.config.micro_batch
            else:
                better = old is None or (o.samples_per_s or 0.0) > (old.samples_per_s or 0.0)
            if better:
                best[key] = o
        top = max(best.values(), key=lambda x: x.samples_per_s or 0.0) if best else None
        out.append(None if top is None else top.config)
    return out

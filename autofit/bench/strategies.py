"""The search strategies compared by the search suite, written from their published behaviour.

None of the peers is imported: each is re-implemented here from its documentation and source
(docs/facts.md#peers), on the same problem autofit solves -- a fixed global batch, so a
micro-batch ``m`` always runs with ``grad_accum = global_batch / m`` -- and through the same
trial runner (an :class:`~autofit.bench.problem.Oracle`). Where a peer's algorithm proposes a micro-batch that does not
divide the global batch, it is rounded down to the largest one that does (a user keeping the
global batch would have to do the same); a value already run is answered from memory, not run
again, which only ever favours the peer.

- the batch-size finders of Accelerate, Lightning and DeepSpeed, each at the user's precision and
  as a per-precision sweep: :mod:`autofit.bench.finders`;
- :func:`optuna_tpe` -- plain Optuna TPE over the whole space (precision, micro-batch,
  checkpointing, and the device split, optimizer and checkpoint policy where the grid has more than
  one) with real trials only: no
  estimate, no pruning; an OOM is found by running it, scores 0 and is told to the sampler as a
  violated constraint.

Each strategy is ``fn(problem, oracle, seed) -> TrainConfig | None`` (its answer: the config it
would train with), and declares how it ranks its own trials (:class:`Criterion`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from autofit.bench.finders import (
    USER_PRECISION,
    accelerate_halving,
    accelerate_halving_09,
    at_user_precision,
    deepspeed_autotuner,
    lightning_binsearch,
    precision_sweep,
)
from autofit.bench.problem import (
    Memo,
    Oracle,
    OracleRecord,
    Outcome,
    Problem,
    best_by_throughput,
)
from autofit.core.config import SplitMode, TrainConfig
from autofit.core.records import TrialStatus

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
    run = Memo(oracle)
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
                                trial.suggest_categorical("checkpoint_every", list(problem.checkpoints)), split,
                                *_suggest_lean(trial, problem))
        outcome = run(config)
        trial.set_constraint("peak_over_budget", _over_budget(outcome, problem.budget_bytes))
        study.tell(trial, outcome.samples_per_s if outcome.ok and outcome.samples_per_s else 0.0)
        if len(run.seen) == len(problem.configs()):
            break
    return best_by_throughput(run.seen.values())


def _over_budget(outcome: Outcome, budget_bytes: int) -> float:
    """The constraint TPE is told: > 0 over the budget (an OOM: 1), <= 0 within it."""
    if outcome.ok and outcome.peak_bytes:
        return outcome.peak_bytes / budget_bytes - 1
    return 1.0 if outcome.status is TrialStatus.OOM else 0.0


def _suggest_lean(trial, problem: Problem) -> tuple[str, str]:
    """The optimizer and checkpoint policy: dimensions of TPE's space only where the grid has more than one
    value, so a grid without the lean levers is searched as before. Without checkpointing the policy is
    moot: the config is full (TrainConfig), and a proposal that collapses onto one already run is answered
    from memory, as any repeat."""
    values = []
    for name, choices in (("optimizer", problem.optimizers), ("checkpoint_policy", problem.checkpoint_policies)):
        labels = [c.value for c in choices]
        values.append(labels[0] if len(labels) == 1 else trial.suggest_categorical(name, labels))
    return values[0], values[1]


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


class Criterion(str, enum.Enum):
    """How a strategy ranks its own trials: the config it would answer after each (for "time to 95%")."""

    THROUGHPUT = "throughput"         # the best measured so far
    LARGEST = "largest"               # the largest micro-batch that ran
    # the largest that ran per precision, then the fastest of those (a per-precision sweep of a finder)
    SWEEP_LARGEST = "sweep-largest"


@dataclass(frozen=True)
class Strategy:
    """A named strategy and how it ranks its own trials (for "time to 95% of the optimum")."""

    name: str
    run: Callable[[Problem, Oracle, int], TrainConfig | None]
    criterion: Criterion
    deterministic: bool
    description: str = ""
    kwargs: dict = field(default_factory=dict)
    handicap: str = ""        # what it still leaves out, carried into the headline (e.g. "no checkpointing")

    def __post_init__(self) -> None:
        object.__setattr__(self, "criterion", Criterion(self.criterion))

    def __call__(self, problem: Problem, oracle: Oracle, seed: int) -> TrainConfig | None:
        return self.run(problem, oracle, seed, **self.kwargs)


@dataclass(frozen=True)
class Finder:
    """A batch finder as its tool ships it."""

    name: str
    run: Callable
    criterion: Criterion
    description: str


FINDERS = (
    Finder("accelerate-x0.5", accelerate_halving, Criterion.LARGEST,
           "HF Accelerate find_executable_batch_size: from the largest micro-batch, x0.5 on OOM"),
    Finder("accelerate-x0.9", accelerate_halving_09, Criterion.LARGEST, "the same with the newer x0.9 factor"),
    Finder("lightning-binsearch", lightning_binsearch, Criterion.LARGEST,
           "Lightning BatchSizeFinder binsearch: double from 2 until OOM, then bisect; it can end on a size it "
           "never ran (1, after an OOM at 2), which counts for best found but not for time to 95%"),
    Finder("deepspeed-autotuner", deepspeed_autotuner, Criterion.THROUGHPUT,
           "DeepSpeed autotuner at its defaults (stage 0): profile run at micro-batch 1, linear max, probes, bisect "
           "with 5% plateau, tuning list"),
)


def _finder_variants() -> tuple[Strategy, ...]:
    out = []
    for f in FINDERS:
        out.append(Strategy(f"{f.name} @{USER_PRECISION.value}", at_user_precision, f.criterion, True,
                            f"{f.description}; at {USER_PRECISION.value}", {"finder": f.run},
                            f"{USER_PRECISION.value} only, no checkpointing"))
        out.append(Strategy(f"{f.name} sweep", precision_sweep,
                            Criterion.SWEEP_LARGEST if f.criterion is Criterion.LARGEST else f.criterion, True,
                            f"{f.description}; once per precision, the fastest answer kept, trials summed",
                            {"finder": f.run}, "no checkpointing"))
    return tuple(out)


PEERS: tuple[Strategy, ...] = (
    Strategy("optuna-tpe", optuna_tpe, Criterion.THROUGHPUT, False,
             "Optuna TPE over the whole grid, real trials only: start-up trials a fifth of the budget (at least 2), "
             "multivariate, the budget as a constraint (an OOM is found by running and violates it)",
             handicap="no memory estimate"),
) + _finder_variants()


def sweeps(strategies: tuple[Strategy, ...]) -> tuple[Strategy, ...]:
    """The per-precision finder sweeps among ``strategies``."""
    return tuple(s for s in strategies if s.run is precision_sweep)


def incumbent(records: list[OracleRecord], criterion: Criterion) -> list[TrainConfig | None]:
    """The config a strategy would answer after each of its trials, by its own criterion."""
    out: list[TrainConfig | None] = []
    best: dict[object, Outcome] = {}     # the incumbent per precision (Criterion.SWEEP_LARGEST) or overall
    for record in records:
        o = record.outcome
        key = o.config.precision if criterion is Criterion.SWEEP_LARGEST else None
        if o.ok:
            old = best.get(key)
            if criterion in (Criterion.LARGEST, Criterion.SWEEP_LARGEST):
                better = old is None or o.config.micro_batch > old.config.micro_batch
            else:
                better = old is None or (o.samples_per_s or 0.0) > (old.samples_per_s or 0.0)
            if better:
                best[key] = o
        top = max(best.values(), key=lambda x: x.samples_per_s or 0.0) if best else None
        out.append(None if top is None else top.config)
    return out

"""Running one strategy on one cell and scoring its answer by the grid's throughput of the config it
answered (so a live run and its replay are judged by the same yardstick)."""

from __future__ import annotations

import dataclasses
import math

from autofit.bench.own_search import NotAvailable, autofit_search
from autofit.bench.problem import Oracle
from autofit.bench.search_cells import problem_for
from autofit.bench.search_data import BenchMode, Grid, RunResult
from autofit.bench.strategies import Strategy, incumbent
from autofit.core.config import TrainConfig
from autofit.core.records import TrialStatus

TARGET_FRACTION = 0.95   # time to target: the clock when the strategy's incumbent first reached this
HEADLINE_FRACTION = 0.98  # the headline "time to 98%": the same, at 98% of the optimum


def answers_after_each(strategy: Strategy, oracle: Oracle) -> list[TrainConfig | None]:
    """The config the strategy would answer after each of its trials: what it said itself (``oracle.answers``,
    one per trial), else what its criterion picks from what it saw (:func:`autofit.bench.strategies.incumbent`)."""
    records = oracle.history
    if oracle.answers is not None and len(oracle.answers) == len(records):
        return list(oracle.answers)
    return incumbent(records, strategy.criterion)


def first_reaching(answers: list[TrainConfig | None], grid: Grid, budget_bytes: int, fraction: float) -> int | None:
    """Index of the first trial after which the config the strategy would answer (``answers``,
    :func:`answers_after_each`) is >= ``fraction`` of the optimum."""
    for i, config in enumerate(answers):
        if config is not None and grid.fraction(config, budget_bytes) >= fraction:
            return i
    return None


def score(strategy: Strategy, grid: Grid, budget_bytes: int, seed: int, mode: BenchMode, oracle: Oracle,
          answer: TrainConfig | None, error: str | None = None) -> RunResult:
    records = oracle.history
    answers = answers_after_each(strategy, oracle)
    at_95 = first_reaching(answers, grid, budget_bytes, TARGET_FRACTION)
    reached = None if at_95 is None else records[at_95].clock_s
    live_tput = None
    if BenchMode(mode) is BenchMode.LIVE and answer is not None:
        live_tput = next((r.outcome.samples_per_s for r in records if r.outcome.config == answer), None)
    return RunResult(
        strategy=strategy.name, workload=grid.cell.workload, budget_bytes=budget_bytes, seed=seed, mode=mode,
        answer=answer, fraction=grid.fraction(answer, budget_bytes), wall_s=oracle.clock_s, trials=len(records),
        oom_trials=sum(r.outcome.status is TrialStatus.OOM for r in records),
        failed_trials=sum(r.outcome.status in (TrialStatus.ERROR, TrialStatus.TIMEOUT) for r in records),
        time_to_target_s=reached, error=error, live_samples_per_s=live_tput, history=list(records),
        notes=list(oracle.notes), extra_s=oracle.extra_s,
        reached_98_at=first_reaching(answers, grid, budget_bytes, HEADLINE_FRACTION),
    )


def run_strategy(strategy: Strategy, grid: Grid, budget_bytes: int, seed: int, oracle: Oracle,
                 mode: BenchMode) -> RunResult:
    problem = problem_for(grid.cell, budget_bytes, grid.param_count)
    if strategy.run is autofit_search:
        strategy = dataclasses.replace(strategy, kwargs={**strategy.kwargs, "first_use_s": grid.first_use_s})
    try:
        answer = strategy(problem, oracle, seed)
        error = None
    except NotAvailable as exc:
        return RunResult(strategy.name, grid.cell.workload, budget_bytes, seed, mode, None, math.nan, math.nan, 0, 0,
                         0, None, error=str(exc))
    except Exception as exc:  # noqa: BLE001 -- a broken strategy is a row that says so
        answer, error = None, f"{type(exc).__name__}: {exc}"
    return score(strategy, grid, budget_bytes, seed, mode, oracle, answer, error)

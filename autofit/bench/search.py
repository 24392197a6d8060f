"""The search suite: autofit's search against its peers, on grids measured exhaustively here.

For each workload a small grid (precision x micro-batch x checkpointing, a fixed global batch,
for some cells a device split: pipeline stages or FSDP ranks, each a process on this
machine's CPU, gloo; for the lean cells the optimizer and the checkpoint policy) is run for real, config by config, with the same trial runner the strategies use
(:func:`autofit.trial.run.run_trial`, no budget), and each config that fits is sampled again in
rounds until its two best samples agree (:mod:`autofit.bench.search_grid`): its best sample is its ground
truth. The fastest config that fits a budget is the ground-truth optimum for that budget. Then each
strategy searches:

- **live**, once per strategy on one cell (a workload and budget): every trial a real,
  budget-enforced, isolated trial, timed by the wall clock;
- **replayed** against the measured grid for every cell and several seeds (a tabular benchmark,
  as in HPOBench and NAS-Bench): a trial that fits costs the grid's measured wall time; one over
  the budget is an OOM that costs the measured time of a trial that dies at once (process start,
  imports, model build) plus one step of that config. A config's first run shows the strategy
  the grid trial's own throughput, a re-run the grid's second sample, and so on (the noise a real
  search meets). The strategy's own work (profiling, sampling) is timed for real.
  :mod:`autofit.bench.replay` replays against a committed ``search_grid.csv``.

A strategy's answer is scored by the grid's throughput of the config it answered, so a live
run and its replay are judged by the same yardstick and measurement noise cannot make an
answer look better than the optimum.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from autofit.bench.common import pct, seconds
from autofit.bench.oracles import LiveOracle, ReplayOracle
from autofit.bench.own_search import STRATEGIES
from autofit.bench.scoring import run_strategy
from autofit.bench.search_cells import CELLS, HEAVY_CELLS, LEAN_CELLS, QUICK_CELLS
from autofit.bench.search_data import (
    BenchMode,
    Cell,
    Grid,
    MiB,
    RunResult,
    SearchResults,
)
from autofit.bench.search_grid import measure_grid
from autofit.bench.search_tables import write_search
from autofit.bench.strategies import PEERS, Strategy, optuna_tpe, sweeps

# Live by default: autofit and the peers the done-when criteria compare it with (TPE and the
# per-precision finder sweeps); the finders at amp-bf16 alone are replayed only. In --quick:
# autofit and one sweep, to stay within minutes.
# These run live on the first cell's first budget; autofit (LIVE_EVERY_CELL) also on every other
# cell, since its live answer is judged per cell (search_tables' done-when table).
LIVE = ("autofit", "optuna-tpe") + tuple(s.name for s in sweeps(PEERS))
QUICK_LIVE = ("autofit", "accelerate-x0.5 sweep")
LIVE_EVERY_CELL = ("autofit",)


def _run_live(strategy: Strategy, grid: Grid, budget: int, progress: Callable[[str], None]) -> RunResult:
    label = f"{strategy.name} @ {grid.cell.workload} {budget / MiB:.0f} MiB"
    result = run_strategy(strategy, grid, budget, 0, LiveOracle(grid.cell.workload, budget, progress, label),
                          BenchMode.LIVE)
    progress(f"live {label}: answer {result.answer.short() if result.answer else None}, "
             f"{pct(result.fraction)} of optimum, {seconds(result.wall_s)} s"
             + (f" ({result.error})" if result.error else ""))
    return result


def run_search_suite(out_dir: Path, env: dict, *, quick: bool = False, seeds: int | None = None,
                     cells: tuple[Cell, ...] | None = None, strategies: tuple[Strategy, ...] = STRATEGIES,
                     live: bool | tuple[str, ...] = True, tpe_trials: int | None = None,
                     progress: Callable[[str], None] = lambda _m: None, lean_only: bool = False) -> SearchResults:
    """Measure the grids, run every strategy (live once, replayed per cell and seed), write the tables.

    ``live``: True runs :data:`LIVE` (:data:`QUICK_LIVE` with ``quick``) live once each (seed 0)
    on the first cell's first budget, and those of them in :data:`LIVE_EVERY_CELL` on every other
    cell too; a tuple of names runs only those; False none. ``tpe_trials``: Optuna TPE's
    real-trial budget (default 12; 6 with ``quick``). ``cells`` default: :data:`CELLS`, :data:`LEAN_CELLS` and :data:`HEAVY_CELLS`;
    :data:`QUICK_CELLS` with ``quick``; :data:`LEAN_CELLS` alone with ``lean_only`` (``quick`` then only
    cuts the seeds, TPE's trials and the live runs).
    """
    started = time.perf_counter()
    cells = cells or (LEAN_CELLS if lean_only else QUICK_CELLS if quick else CELLS + LEAN_CELLS + HEAVY_CELLS)
    seeds = seeds or (3 if quick else 5)
    tpe_trials = tpe_trials or (6 if quick else 12)
    strategies = tuple(dataclasses.replace(s, kwargs={**s.kwargs, "real_trials": tpe_trials})
                       if s.run is optuna_tpe else s for s in strategies)
    if live is True:
        live = QUICK_LIVE if quick else LIVE
    live_names = set(live or ())
    grids = [measure_grid(cell, progress) for cell in cells]
    runs: list[RunResult] = []
    live_cell = (cells[0].workload, cells[0].budgets_mib[0] * MiB)
    for grid in grids:
        for budget_mib in grid.cell.budgets_mib:
            first = grid is grids[0] and budget_mib == grid.cell.budgets_mib[0]
            names = live_names if first else live_names & set(LIVE_EVERY_CELL)
            runs += [_run_live(s, grid, budget_mib * MiB, progress) for s in strategies if s.name in names]
    for grid in grids:
        for budget_mib in grid.cell.budgets_mib:
            budget = budget_mib * MiB
            for strategy in strategies:
                for seed in range(seeds):
                    runs.append(run_strategy(strategy, grid, budget, seed, ReplayOracle(grid, budget),
                                             BenchMode.REPLAY))
    results = SearchResults(grids, runs, live_cell, seeds, time.perf_counter() - started, strategies=strategies)
    results.files = write_search(out_dir, env, results, strategies)
    return results

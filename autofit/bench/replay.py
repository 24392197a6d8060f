"""Replays against a committed grid: load ``search_grid.csv`` back into grids and replay strategies on it.

A change to the search is judged in seconds this way, without measuring the grids again: the
grid (every config measured, two throughput samples each) is what ``autofit bench --suite search``
wrote; the replay is the suite's own (:func:`autofit.bench.scoring.run_strategy` with a
:class:`~autofit.bench.oracles.ReplayOracle`). ``python -m autofit.bench.replay`` prints
autofit's figures per cell (``--help``); ``--draws N`` replays on N random orders of each config's samples
(other draws of the noise) and prints the totals; with ``--out DIR`` it replays every strategy and writes
``search_cells.csv`` (time to 98% in the cpu and gpu-cost regimes, :mod:`autofit.bench.search_regimes`)
and ``search_replay.md`` (the regimes' section, the done-when table and the replay's medians) there.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import re
import statistics
import sys
from pathlib import Path

import pandas as pd

from autofit.bench.common import Report, environment
from autofit.bench.oracles import ReplayOracle
from autofit.bench.own_search import STRATEGIES
from autofit.bench.scoring import run_strategy
from autofit.bench.search_data import BenchMode, Cell, Grid, GridPoint, MiB, RunResult
from autofit.bench.search_regimes import (
    cells_frame,
    gpu_cost_section,
    run_rows,
    write_cells_csv,
)
from autofit.bench.search_tables import LEAN_TITLE, done_when_table
from autofit.bench.strategies import Strategy, sweeps
from autofit.core.config import (
    FIELDS,
    CheckpointPolicy,
    Precision,
    SplitMode,
    TrainConfig,
)

_FLOOR_RE = re.compile(r"a trial that dies at its first operator: ([\d.]+) s\)\. autofit's clock is charged ([\d.]+) s")
_WARM_RE = re.compile(r"with cold caches \(([\d.]+) s with them warm")
_TITLE_RE = re.compile(r"(.+?): global batch (\d+),")


def _number(value) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) or value == "" else float(value)


def _more_samples(value) -> tuple[float, ...]:
    """A ``;``-joined samples column (``more_samples_per_s``; empty, or absent in
    grids written before it: none)."""
    if not isinstance(value, str) or not value.strip():
        return ()
    return tuple(float(x) for x in value.split(";"))


def grid_costs(markdown: Path | None) -> dict[tuple[str, int, bool], tuple[float, float, float | None]]:
    """Per (workload, global batch, lean cell or not), (OOM floor s, first-use s, warm first-use s or None)
    as ``search.md`` states them."""
    if markdown is None or not markdown.is_file():
        return {}
    out = {}
    for section in markdown.read_text().split("\n## ")[1:]:
        found, title = _FLOOR_RE.search(section), _TITLE_RE.match(section)
        if found and title:
            lean = f", {LEAN_TITLE} " in section.splitlines()[0]
            warm = _WARM_RE.search(section)
            out[(title[1].strip(), int(title[2]), lean)] = (float(found[1]), float(found[2]),
                                                             float(warm[1]) if warm else None)
    return out


def _param_count(workload_spec: str) -> int:
    """Counted on the meta device, as the bench does."""
    from autofit.workloads import param_count
    from autofit.workloads.load import load_workload

    return param_count(load_workload(workload_spec))


def load_grids(csv_path: Path, markdown: Path | None = None) -> list[Grid]:
    """The grids of a ``search_grid.csv`` (and the costs its ``search.md`` states; 0 s when absent)."""
    # one sample alone would read as a float
    frame = pd.read_csv(csv_path, dtype={"more_samples_per_s": str})
    costs = grid_costs(markdown if markdown is not None else csv_path.with_name("search.md"))
    grids = []
    # the config columns it has (split_mode, optimizer, checkpoint_policy: absent from grids written before them)
    keys = [k for k in FIELDS if k in frame.columns]
    fits = [c for c in frame.columns if c.startswith("fits_")]
    # a workload may have several cells (one with device splits, one with the lean levers): one grid per
    # global batch and set of budgets (a row has a fits_ column for its own cell's budgets only)
    frame["global_batch"] = [TrainConfig.from_dict({k: row[k] for k in keys}).samples_per_step
                             for row in frame.to_dict("records")]
    frame["budgets"] = [",".join(c for c in fits if not pd.isna(row[c])) for row in frame.to_dict("records")]
    for (workload, global_batch, _), rows in frame.groupby(["workload", "global_batch", "budgets"], sort=False):
        points = {}
        for row in rows.to_dict("records"):
            config = TrainConfig.from_dict({k: row[k] for k in keys})
            points[config] = GridPoint(config, row["status"], None if math.isnan(row["measured_peak_bytes"])
                                       else int(row["measured_peak_bytes"]), _number(row["samples_per_s"]),
                                       _number(row["step_time_s"]), float(row["trial_wall_s"]),
                                       _number(row["predicted_peak_bytes"]), row.get("error") if isinstance(row.get("error"), str) and row["error"] else None,
                                       _number(row["trial_samples_per_s"]), _number(row["second_samples_per_s"]),
                                       _more_samples(row.get("more_samples_per_s")),
                                       _number(row.get("tracked_s", math.nan)))
        configs = list(points)
        budgets = tuple(int(c[len("fits_"):-len("MiB")]) for c in rows.columns
                        if c.startswith("fits_") and rows[c].notna().any())
        cell = Cell(str(workload), int(global_batch),
                    tuple(sorted({c.micro_batch for c in configs})),
                    tuple(dict.fromkeys(Precision(c.precision) for c in configs)), budgets,
                    tuple(sorted({c.checkpoint_every for c in configs})),
                    tuple(sorted({c.device_split for c in configs})),
                    tuple(dict.fromkeys(c.split_mode for c in configs if c.device_split > 1)) or (SplitMode.PIPELINE,),
                    tuple(dict.fromkeys(c.optimizer for c in configs)),
                    # full first, as a cell lists it (selective only ever comes with checkpointing)
                    tuple(sorted({c.checkpoint_policy for c in configs}, key=lambda k: k is not CheckpointPolicy.FULL)),
                    # grids written before the column were all measured on the CPU
                    str(rows["device"].iloc[0]) if "device" in rows.columns else "cpu")
        floor_s, first_use_s, warm_use_s = costs.get((str(workload), int(global_batch), cell.lean), (0.0, 0.0, None))
        # the DeepSpeed autotuner's model-state formula needs the parameter count (0 made it replay
        # a different search than the bench ran); grids written before the column: counted again
        params = int(rows["param_count"].iloc[0]) if "param_count" in rows.columns else _param_count(str(workload))
        grids.append(Grid(cell, points, floor_s, params, 0.0, first_use_s, warm_use_s))
    return grids


def replay(grids: list[Grid], strategies: tuple[Strategy, ...], seeds: int, first_sample: int = 0) -> list[RunResult]:
    """Every strategy on every cell (grid x budget) and seed, replayed (``first_sample``: see
    :class:`~autofit.bench.oracles.ReplayOracle`)."""
    runs = []
    for grid in grids:
        for budget_mib in grid.cell.budgets_mib:
            for strategy in strategies:
                for seed in range(seeds):
                    budget = budget_mib * MiB
                    runs.append(run_strategy(strategy, grid, budget, seed, ReplayOracle(grid, budget, first_sample),
                                             BenchMode.REPLAY))
    return runs


def shuffled(grids: list[Grid], draw: int) -> list[Grid]:
    """The grids with each config's throughput samples in a random order (seeded by ``draw``): another draw
    of the noise, where a trial may read any sample the grid took of its config and the ground truth stays."""
    rng, out = random.Random(draw), []
    for grid in grids:
        points = {}
        for config, point in grid.points.items():
            samples = point.samples()
            rng.shuffle(samples)
            points[config] = point if not samples else dataclasses.replace(
                point, trial_samples_per_s=samples[0], second_samples_per_s=samples[1] if len(samples) > 1 else None,
                more_samples_per_s=tuple(samples[2:]))
        out.append(dataclasses.replace(grid, points=points))
    return out


def draws_table(grids: list[Grid], strategies: tuple[Strategy, ...], draws: int) -> str:
    """Markdown: each strategy replayed once (seed 0) per cell on ``draws`` random sample orders
    (:func:`shuffled`): its searches, their real trials and wall time in all, and how many answered under
    98% of the optimum."""
    runs = [run for draw in range(draws) for run in replay(shuffled(grids, draw), strategies, 1)]
    lines = ["| strategy | searches | real trials | wall time (s) | under 98% | lowest |", "|---|---:|---:|---:|---:|---:|"]
    for strategy in strategies:
        mine = [r for r in runs if r.strategy == strategy.name]
        lines.append(f"| {strategy.name} | {len(mine)} | {sum(r.trials for r in mine)} | "
                     f"{sum(r.wall_s for r in mine):.0f} | {sum(r.fraction < 0.98 for r in mine)} | "
                     f"{min(r.fraction for r in mine):.1%} |")
    return "\n".join(lines)


def table(runs: list[RunResult]) -> str:
    """Markdown: per strategy and cell, the medians over seeds (fraction of optimum, trials, wall time)."""
    lines = ["| strategy | cell | best found / optimum (median, min) | real trials | wall time (s) | stop |",
             "|---|---|---:|---:|---:|---|"]
    keys = list(dict.fromkeys((r.strategy, r.workload, r.budget_bytes) for r in runs))
    for name, workload, budget in keys:
        cell = [r for r in runs if (r.strategy, r.workload, r.budget_bytes) == (name, workload, budget)]
        fractions = [r.fraction for r in cell]
        stops = sorted({n.split(": ", 2)[1] for r in cell for n in r.notes if n.startswith("stopped: ")})
        lines.append(f"| {name} | {workload} @ {budget / MiB:.0f} MiB | {statistics.median(fractions):.1%} "
                     f"({min(fractions):.1%}) | {statistics.median(r.trials for r in cell):g} | "
                     f"{statistics.median(r.wall_s for r in cell):.1f} | {', '.join(stops)} |")
    return "\n".join(lines)


def write_replay(out_dir: Path, grid_csv: Path, grids: list[Grid], runs: list[RunResult],
                 strategies: tuple[Strategy, ...], command: str) -> list[Path]:
    """``search_cells.csv`` and ``search_replay.md`` from a replay of a committed grid."""
    cells = cells_frame(run_rows(runs, grids, strategies))
    rep = Report("Search: a replay of the measured grid", {**environment(command), "grid": str(grid_csv)},
                 generator="python -m autofit.bench.replay")
    rep.add(f"Every strategy replayed against `{grid_csv}` (no trial run): {max(r.seed for r in runs) + 1} seeds per "
            "strategy and cell. The cpu clock charges each trial the grid's measured wall time, and times each "
            "strategy's own work on this machine now.")
    rep.add(gpu_cost_section(cells, strategies))
    rep.add(done_when_table(grids, runs, strategies))
    rep.add("## Replayed medians, cpu clock\n\n" + table(runs))
    return [write_cells_csv(out_dir / "search_cells.csv", cells), rep.write(out_dir / "search_replay.md")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autofit.bench.replay", description=__doc__.split("\n")[0])
    parser.add_argument("grid", type=Path, nargs="?", default=Path("results/benchmarks/search_grid.csv"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--strategy", action="append", help="strategy names (default: autofit)")
    parser.add_argument("--done-when", action="store_true",
                        help="replay autofit, TPE and the finder sweeps and print the search suite's done-when table")
    parser.add_argument("--swap-samples", action="store_true",
                        help="answer each config's second grid sample first (the other draw of the noise)")
    parser.add_argument("--draws", type=int, default=0,
                        help="replay on this many random orders of each config's samples (seed 0 each) and print "
                             "the totals: trials, wall time and answers under 98%% of the optimum")
    parser.add_argument("--out", type=Path,
                        help="replay every strategy and write search_cells.csv and search_replay.md into this folder")
    args = parser.parse_args(argv)
    if args.draws and (args.out or args.swap_samples or args.done_when):
        # a draw is already every order of the samples, and its totals are all it prints
        given = [f for f, on in (("--out", args.out), ("--swap-samples", args.swap_samples),
                                 ("--done-when", args.done_when)) if on]
        parser.error(f"--draws prints its totals only: drop {', '.join(given)}")
    if args.draws < 0:
        parser.error("--draws must be 0 or more")
    names = args.strategy or ["autofit"]
    if args.done_when:
        names += ["autofit", "optuna-tpe"] + [s.name for s in sweeps(STRATEGIES)]
    if args.out:
        names += [s.name for s in STRATEGIES]
    strategies = tuple(s for s in STRATEGIES if s.name in names)
    grids = load_grids(args.grid)
    if args.draws:
        print(draws_table(grids, strategies, args.draws))
        return 0
    runs = replay(grids, strategies, args.seeds, int(args.swap_samples))
    if args.out:
        command = "python -m autofit.bench.replay " + " ".join(argv if argv is not None else sys.argv[1:])
        for path in write_replay(args.out, args.grid, grids, runs, strategies, command.strip()):
            print(f"wrote {path}")
    print(table(runs))
    if args.done_when:
        print(done_when_table(grids, runs, strategies))
    for r in runs:
        if r.seed == 0:
            print(f"{r.strategy} {r.workload} @ {r.budget_bytes / MiB:.0f} MiB: "
                  + " ; ".join(f"{h.outcome.config.short()}={h.outcome.status}"
                               f"{'' if h.outcome.samples_per_s is None else f' {h.outcome.samples_per_s:.1f}'}"
                               for h in r.history) + f" -> {r.answer.short() if r.answer else None}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

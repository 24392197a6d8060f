"""Time to 98% of the optimum in two cost regimes, per cell and strategy: ``search_cells.csv`` and the
gpu-cost section of ``search.md``.

- ``cpu``: the replay's clock as the search suite keeps it (each trial costs the grid's measured CPU wall
  time, a strategy's own work is timed for real);
- ``gpu-cost``: the same replayed trials charged what they would cost on a GPU (:mod:`autofit.bench.gpu_cost`).

*Time to 98%* is the clock when the config the strategy would answer at that point (its own criterion,
:func:`autofit.bench.strategies.incumbent`) first reached 98% of the grid's optimum; the headline beside
total wall time. Figures are medians over the replayed seeds; a seed that never reaches 98% counts as
never, so a median that falls on such a seed is never (an empty ``time_to_98_s``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from autofit.bench.common import markdown_table, pct, seconds
from autofit.bench.finders import at_user_precision
from autofit.bench.gpu_cost import DEFAULT_COSTS, GpuCosts, charge, figures_table
from autofit.bench.search_data import BenchMode, Grid, MiB, RunResult, grids_by_cell
from autofit.bench.strategies import Strategy, sweeps
from autofit.bench.verdict import AUTOFIT_NAME

REGIMES = ("cpu", "gpu-cost")
CELLS_COLUMNS = ["cell", "regime", "strategy", "best_found_pct", "wall_s", "time_to_98_s", "real_trials", "oom_trials"]
TPE_NAME = "optuna-tpe"
SINGLE_PRECISION_RATIO = 1.25   # autofit's time to 98% over a single-precision finder's, where that finder reaches it


def cell_label(workload: str, budget_bytes: int) -> str:
    return f"{workload} @ {budget_bytes / MiB:.0f} MiB"


def run_rows(runs: list[RunResult], grids: list[Grid], strategies: tuple[Strategy, ...],
             costs: GpuCosts = DEFAULT_COSTS) -> pd.DataFrame:
    """One row per replayed run and regime (seed level); runs of a strategy that did not run are left out."""
    by_name = {s.name: s for s in strategies}
    grid_of = grids_by_cell(grids)
    rows = []
    for r in runs:
        if r.mode is not BenchMode.REPLAY or math.isnan(r.fraction) or r.strategy not in by_name:
            continue
        common = {"cell": cell_label(r.workload, r.budget_bytes), "strategy": r.strategy,
                  "best_found_pct": 100 * r.fraction, "real_trials": r.trials, "oom_trials": r.oom_trials}
        rows.append({**common, "regime": "cpu", "wall_s": r.wall_s, "time_to_98_s": r.time_to_98_s})
        gpu = charge(r, grid_of[(r.workload, r.budget_bytes)], by_name[r.strategy], costs)
        rows.append({**common, "regime": "gpu-cost", "wall_s": gpu.wall_s, "time_to_98_s": gpu.time_to_98_s})
    return pd.DataFrame(rows, columns=CELLS_COLUMNS)


def _median_time(times: pd.Series) -> float:
    """Median with never (None/NaN) as infinitely late; NaN when the median is never."""
    value = times.astype(float).fillna(math.inf).median()
    return math.nan if math.isinf(value) else value


def cells_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Medians over seeds per cell, regime and strategy, in first-seen order: the rows of ``search_cells.csv``."""
    if rows.empty:
        return pd.DataFrame(columns=CELLS_COLUMNS)
    grouped = rows.groupby(["cell", "regime", "strategy"], sort=False)
    out = grouped.agg(best_found_pct=("best_found_pct", "median"), wall_s=("wall_s", "median"),
                      time_to_98_s=("time_to_98_s", _median_time), real_trials=("real_trials", "median"),
                      oom_trials=("oom_trials", "median")).reset_index()
    # cell by cell, each regime's strategies together, all in the order the runs came
    order = {key: {v: i for i, v in enumerate(dict.fromkeys(rows[key]))} for key in ("cell", "regime", "strategy")}
    out = out.sort_values(["cell", "regime", "strategy"], key=lambda col: col.map(order[col.name]), kind="stable")
    return out[CELLS_COLUMNS].reset_index(drop=True)


def write_cells_csv(path: Path, cells: pd.DataFrame) -> Path:
    """``search_cells.csv``: exactly :data:`CELLS_COLUMNS`; a never-reached time to 98% is empty."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cells[CELLS_COLUMNS].to_csv(path, index=False, float_format="%.4g")
    return path


@dataclass
class RegimeVerdict:
    """One cell in one regime: does autofit reach 98% sooner than TPE and every sweep, and how it compares
    with each single-precision finder that reaches 98% (ratio of times, target <= 1.25)."""

    cell: str
    autofit_s: float                                          # inf: never
    slower: dict[str, float] = field(default_factory=dict)   # TPE and sweeps, each one's time (inf: never)
    ratios: dict[str, float] = field(default_factory=dict)   # single-precision finders that reach 98%
    answer_pct: float = 100.0   # autofit's final answer (median): its incumbent can pass 98% and the answer not stay

    @property
    def sooner(self) -> bool:
        return not math.isinf(self.autofit_s) and all(self.autofit_s < t for t in self.slower.values())

    @property
    def passed(self) -> bool:
        return self.sooner and all(x <= SINGLE_PRECISION_RATIO for x in self.ratios.values())


def regime_verdicts(cells: pd.DataFrame, strategies: tuple[Strategy, ...], regime: str) -> list[RegimeVerdict]:
    """Per cell of ``cells`` (the frame of :func:`cells_frame`) in ``regime``."""
    peers = [TPE_NAME] + [s.name for s in sweeps(strategies)]
    singles = [s.name for s in strategies if s.run is at_user_precision]
    out = []
    here = cells[cells["regime"] == regime]
    for cell, rows in here.groupby("cell", sort=False):
        t98 = {row.strategy: (math.inf if pd.isna(row.time_to_98_s) else float(row.time_to_98_s))
               for row in rows.itertuples()}
        if AUTOFIT_NAME not in t98:
            continue
        mine = t98[AUTOFIT_NAME]
        answer = float(rows.loc[rows["strategy"] == AUTOFIT_NAME, "best_found_pct"].iloc[0])
        v = RegimeVerdict(cell, mine, {p: t98[p] for p in peers if p in t98}, answer_pct=answer)
        v.ratios = {s: mine / t98[s] for s in singles if s in t98 and not math.isinf(t98[s])}
        out.append(v)
    return out


def _secs(x: float) -> str:
    return "never" if math.isinf(x) else seconds(x)


def verdict_table(verdicts: list[RegimeVerdict]) -> str:
    rows = []
    for v in verdicts:
        fastest = min(v.slower.items(), key=lambda kv: kv[1], default=None)
        ratios = "; ".join(f"{name} {x:.2f}×" + (" ✓" if x <= SINGLE_PRECISION_RATIO else " ✗")
                           for name, x in v.ratios.items()) or "none reaches 98%"
        answer = "" if v.answer_pct >= 98 or math.isinf(v.autofit_s) else f" (answer {v.answer_pct:.1f}%)"
        rows.append([v.cell, _secs(v.autofit_s) + answer, _secs(v.slower.get(TPE_NAME, math.inf)),
                     f"{fastest[0]} {_secs(fastest[1])}" if fastest and not math.isinf(fastest[1])
                     else "none reaches 98%",
                     "✓" if v.sooner else "✗", ratios, "PASS" if v.passed else "FAIL"])
    return markdown_table(["cell", "autofit (s)", "optuna-tpe (s)", "fastest peer (s)",
                           "autofit sooner than TPE and every sweep",
                           f"autofit / single-precision finder (≤ {SINGLE_PRECISION_RATIO:g}×)", "verdict"],
                          rows, "lrrllll")


def gpu_cost_section(cells: pd.DataFrame, strategies: tuple[Strategy, ...]) -> str:
    """The search page's section: the regime's figures and sources, the verdict per cell, the same check on
    the cpu clock beside it, and each strategy's gpu-cost figures."""
    gpu, cpu = (regime_verdicts(cells, strategies, r) for r in ("gpu-cost", "cpu"))
    figures = cells[cells["regime"] == "gpu-cost"]
    rows = [[r.cell, r.strategy, pct(r.best_found_pct / 100), seconds(r.wall_s),
             "never" if pd.isna(r.time_to_98_s) else seconds(r.time_to_98_s), f"{r.real_trials:g}", f"{r.oom_trials:g}"]
            for r in figures.itertuples()]
    return ("## GPU cost regime: time to 98%\n\n"
            "The replayed runs again, each trial charged what it would cost on a GPU (`autofit/bench/gpu_cost.py`): "
            "autofit runs its trials in a trial host (a process until a trial that is not ok) and pays its own "
            "cost once; a batch-size finder retries inside "
            "one process (a sweep: one process per precision); Optuna TPE runs its trials in one process. Time "
            "to 98%: the clock when the config the strategy would answer first reached 98% of the optimum "
            "(medians over seeds; a seed that never does counts as never). It follows the answer the strategy "
            "would give after each trial, so a search can pass 98% and end on a lesser answer after re-measuring "
            "(autofit's column then shows its final answer). Every figure is in "
            "[search_cells.csv](search_cells.csv), both regimes. The charges and where each comes from:\n\n"
            + figures_table()
            + f"\n\nPer cell, gpu-cost clock: {sum(v.passed for v in gpu)} of {len(gpu)} pass.\n\n"
            + verdict_table(gpu)
            + f"\n\nThe same check on the cpu clock (the replay's): {sum(v.passed for v in cpu)} of {len(cpu)} pass.\n\n"
            + verdict_table(cpu)
            + "\n\nEach strategy on the gpu-cost clock (medians):\n\n"
            + markdown_table(["cell", "strategy", "best found / optimum", "wall time (s)", "time to 98% (s)",
                              "real trials", "OOM trials"], rows, "llrrrrr"))

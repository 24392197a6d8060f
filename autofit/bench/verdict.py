"""The search suite's done-when criteria, checked per cell of the search suite, and where autofit fails them.

For each cell (a workload and a budget), from the scored runs of :mod:`autofit.bench.search`:

- autofit's answer is at least 98% of the grid optimum (median over the replayed seeds);
- the live run, where the cell ran live, at least 95%;
- no OOM trial, in any replayed seed or the live run;
- fewer real trials and less wall time (medians) than the best per-precision finder sweep (the
  sweep with the highest median fraction of the optimum, then the least wall time);
- time to 95% of the optimum at least 2x sooner than Optuna TPE (medians; a seed that never
  reaches 95% counts as never, so a strategy that misses in most seeds has no median time).

A check that does not apply (no live run in the cell, no sweep or TPE among the strategies) is
``None`` and neither passes nor fails. Where a check fails, :attr:`CellVerdict.notes` says where
and, from the figures at hand, why.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import astuple, dataclass, field
from typing import NamedTuple

from autofit.bench.common import pct, seconds
from autofit.bench.search_data import BenchMode
from autofit.core.records import TrialStatus

AUTOFIT_NAME = "autofit"
MiB = 2**20

REPLAY_TARGET = 0.98       # autofit's answer, median over seeds, of the grid optimum
LIVE_TARGET = 0.95         # the live run
TPE_SPEEDUP = 2.0          # time to 95%: at least this many times sooner than TPE


@dataclass(frozen=True)
class CheckLabels:
    """Each check's label, by name: the key of :attr:`CellVerdict.checks` and its column in the table."""

    answer: str = "≥98% of optimum"
    live: str = "live ≥95%"
    no_oom: str = "no OOM trial"
    fewer_trials: str = "fewer trials than best sweep"
    less_wall: str = "less wall time than best sweep"
    tpe: str = "95% ≥2× sooner than TPE"


CHECK = CheckLabels()
CHECKS = astuple(CHECK)   # every check, in the table's column order


@dataclass
class CellVerdict:
    workload: str
    budget_bytes: int
    figures: dict[str, str] = field(default_factory=dict)     # check -> what was measured
    checks: dict[str, bool | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.workload} @ {self.budget_bytes / MiB:.0f} MiB"

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(v is not False for v in self.checks.values())

    @property
    def failed(self) -> list[str]:
        return [k for k, v in self.checks.items() if v is False]


def _median(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(xs) if xs else math.nan


def _t95(runs) -> float:
    """Median time to 95%, a run that never reached it counting as infinitely late."""
    return _median([math.inf if r.time_to_target_s is None else r.time_to_target_s for r in runs])


def _secs(x: float) -> str:
    return "never" if math.isinf(x) else seconds(x)


class SweepRuns(NamedTuple):
    """A sweep's name and its runs in one cell."""

    name: str
    runs: list


def best_sweep(cell_runs, sweep_names: tuple[str, ...]) -> SweepRuns | None:
    """The sweep with the highest median fraction of the optimum, then the least median wall time."""
    found = [SweepRuns(name, [r for r in cell_runs if r.strategy == name]) for name in sweep_names]
    found = [f for f in found if f.runs and not all(math.isnan(r.fraction) for r in f.runs)]
    if not found:
        return None
    return max(found, key=lambda f: (_median([r.fraction for r in f.runs]), -_median([r.wall_s for r in f.runs])))


def cell_verdict(runs, workload: str, budget_bytes: int, sweep_names: tuple[str, ...],
                 tpe_name: str = "optuna-tpe") -> CellVerdict:
    """Check one cell; ``runs`` are all the suite's scored runs (replayed and live)."""
    v = CellVerdict(workload, budget_bytes)
    here = [r for r in runs if r.workload == workload and r.budget_bytes == budget_bytes]
    replay = [r for r in here if r.mode is BenchMode.REPLAY]
    mine = [r for r in replay if r.strategy == AUTOFIT_NAME]
    live = [r for r in here if r.mode is BenchMode.LIVE and r.strategy == AUTOFIT_NAME]
    if not mine or all(math.isnan(r.fraction) for r in mine):
        v.checks = {c: False for c in CHECKS}
        v.notes.append("autofit's search did not run" + (f" ({mine[0].error})" if mine and mine[0].error else ""))
        return v
    _check_answer(v, mine, live)
    _check_ooms(v, mine + live)
    _check_sweep(v, mine, replay, sweep_names)
    _check_tpe(v, mine, [r for r in replay if r.strategy == tpe_name])
    # Why, once: how autofit's search stopped, and where its time went.
    if any(v.checks.get(c) is False for c in (CHECK.answer, CHECK.fewer_trials)) and _stop_reasons(mine):
        v.notes.append(_stop_reasons(mine))
    if v.checks.get(CHECK.less_wall) is False or v.checks.get(CHECK.tpe) is False:
        v.notes.append(_time_parts(mine))
    return v


def _check_answer(v: CellVerdict, mine, live) -> None:
    frac = _median([r.fraction for r in mine])
    v.figures[CHECK.answer] = pct(frac)
    v.checks[CHECK.answer] = frac >= REPLAY_TARGET
    if not v.checks[CHECK.answer]:
        wrong = sorted({r.answer.short() if r.answer else "none" for r in mine if r.fraction < REPLAY_TARGET})
        v.notes.append(f"replayed answers under 98%: {', '.join(f'`{a}`' for a in wrong)}")
    if not live:
        v.checks[CHECK.live] = None
        v.figures[CHECK.live] = "not run live"
        return
    r = live[0]
    v.figures[CHECK.live] = pct(r.fraction)
    v.checks[CHECK.live] = r.fraction >= LIVE_TARGET
    if not v.checks[CHECK.live]:
        measured = next((x.outcome.samples_per_s for x in r.history
                         if r.answer is not None and x.outcome.config == r.answer), None)
        v.notes.append(f"live answer `{r.answer.short() if r.answer else 'none'}` is {pct(r.fraction)} of the grid "
                       f"optimum" + (f"; live it measured {measured:.1f} samples/s" if measured else "")
                       + "; live " + (_stop_reasons([r]) or "no stop reason recorded"))


def _check_ooms(v: CellVerdict, runs) -> None:
    ooms = sorted({x.outcome.config.short() for r in runs for x in r.history
                   if x.outcome.status is TrialStatus.OOM})
    v.figures[CHECK.no_oom] = str(max(r.oom_trials for r in runs))
    v.checks[CHECK.no_oom] = not ooms
    if ooms:
        v.notes.append(f"OOM trial(s): {', '.join(f'`{c}`' for c in ooms)}")


def _check_sweep(v: CellVerdict, mine, replay, sweep_names) -> None:
    best = best_sweep(replay, sweep_names)
    if best is None:
        for c in (CHECK.fewer_trials, CHECK.less_wall):
            v.checks[c], v.figures[c] = None, "no sweep"
        return
    name, theirs = best
    against = f"{name}, {pct(_median([r.fraction for r in theirs]))} of the optimum"
    for check, key, fmt in ((CHECK.fewer_trials, "trials", lambda x: f"{x:g}"),
                            (CHECK.less_wall, "wall_s", seconds)):
        a, b = _median([getattr(r, key) for r in mine]), _median([getattr(r, key) for r in theirs])
        v.figures[check] = f"{fmt(a)} vs {fmt(b)}"
        v.checks[check] = a < b
        if not v.checks[check]:
            v.notes.append(f"{'real trials' if key == 'trials' else 'wall time (s)'} {fmt(a)} vs {fmt(b)} "
                           f"({against})")


def _check_tpe(v: CellVerdict, mine, tpe) -> None:
    if not tpe:
        v.checks[CHECK.tpe], v.figures[CHECK.tpe] = None, "no TPE"
        return
    a, b = _t95(mine), _t95(tpe)
    v.figures[CHECK.tpe] = f"{_secs(a)} vs {_secs(b)}"
    v.checks[CHECK.tpe] = not math.isinf(a) and a * TPE_SPEEDUP <= b
    if not v.checks[CHECK.tpe]:
        v.notes.append("autofit's median never reaches 95%" + ("" if math.isinf(b) else f" (TPE: {_secs(b)} s)")
                       if math.isinf(a) else
                       f"time to 95% {_secs(a)} s vs TPE {_secs(b)} s (2x sooner needs ≤ {_secs(b / TPE_SPEEDUP)} s)")


def _stop_reasons(runs) -> str:
    stops = sorted({n.removeprefix("stopped: ") for r in runs for n in r.notes if n.startswith("stopped:")})
    return "autofit stopped on " + " / ".join(stops) if stops else ""


def _time_parts(runs) -> str:
    first = _median([r.extra_s for r in runs])
    trials = _median([r.trials_s for r in runs])
    own = _median([r.wall_s - r.trials_s - r.extra_s for r in runs])
    return (f"autofit's time: {seconds(first)} s first use + {seconds(trials)} s in "
            f"{_median([r.trials for r in runs]):g} trials + {seconds(own)} s own work")


def verdicts(runs, sweep_names: tuple[str, ...], tpe_name: str = "optuna-tpe") -> list[CellVerdict]:
    """One :class:`CellVerdict` per replayed cell, in the order the cells first appear."""
    keys = dict.fromkeys((r.workload, r.budget_bytes) for r in runs if r.mode is BenchMode.REPLAY)
    return [cell_verdict(runs, w, b, sweep_names, tpe_name) for w, b in keys]


__all__ = ["CHECK", "CHECKS", "CellVerdict", "CheckLabels", "best_sweep", "cell_verdict", "verdicts"]

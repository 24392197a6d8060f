"""The search suite's done-when criteria, checked per cell of the search suite, and where autofit fails them.

For each cell (a workload and a budget), from the scored runs of :mod:`autofit.bench.search` and the
cell's measured grid:

- autofit's answer is at least 98% of the grid optimum (median over the replayed seeds);
- the live run, where the cell ran live, at least 95%;
- no OOM trial, in any replayed seed or the live run;
- time to 98% of the optimum (the headline) sooner than the per-precision finder sweep that reaches
  98% soonest (medians; a seed that never reaches 98% counts as never);
- total wall time at most 1.5x the best sweep's (the sweep with the highest median fraction of the
  optimum, then the least wall time).

The time-to-98% target is held per kind of cell (:func:`tallies`): every cell where a lever other than
batch size and precision matters (:func:`lever_kind`), every cell whose trials cost 10 s or more, and
at least 6 of today's 8 cells. A check that does not apply (no live run in the cell, no sweep among the
strategies) is ``None`` and neither passes nor fails. Where a check fails, :attr:`CellVerdict.notes`
says where and, from the measured figures, why.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import astuple, dataclass, field
from typing import NamedTuple

from autofit.bench.common import pct, seconds
from autofit.bench.search_data import BenchMode, grids_by_cell
from autofit.core.records import TrialStatus

AUTOFIT_NAME = "autofit"
MiB = 2**20

REPLAY_TARGET = 0.98       # autofit's answer, median over seeds, of the grid optimum
LIVE_TARGET = 0.95         # the live run
WALL_RATIO = 1.5           # autofit's total wall time over the best sweep's, at most
TODAY_SHARE = 6 / 8        # of today's cells, at least this share sooner to 98% than the best sweep (6 of 8)
HEAVY_TRIAL_S = 10.0       # a cell whose trials cost this much (median) is in the heavy regime

# The kinds of cell the time-to-98% target names (:attr:`CellVerdict.kinds`).
TODAY, LEVER, HEAVY = "today's", "lever", "heavy"


@dataclass(frozen=True)
class CheckLabels:
    """Each check's label, by name: the key of :attr:`CellVerdict.checks` and its column in the table."""

    answer: str = "≥98% of optimum"
    live: str = "live ≥95%"
    no_oom: str = "no OOM trial"
    t98: str = "98% sooner than best sweep"
    wall: str = f"wall ≤{WALL_RATIO:g}× best sweep"


CHECK = CheckLabels()
CHECKS = astuple(CHECK)   # every check, in the table's column order


@dataclass
class CellVerdict:
    workload: str
    budget_bytes: int
    figures: dict[str, str] = field(default_factory=dict)     # check -> what was measured
    checks: dict[str, bool | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)       # TODAY / LEVER / HEAVY -> why this cell is one

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


def _t98(runs) -> float:
    """Median time to 98%, a run that never reached it counting as infinitely late."""
    return _median([math.inf if r.time_to_98_s is None else r.time_to_98_s for r in runs])


def _secs(x: float) -> str:
    return "never" if math.isinf(x) else seconds(x)


class SweepRuns(NamedTuple):
    """A sweep's name and its runs in one cell."""

    name: str
    runs: list


def _sweep_runs(cell_runs, sweep_names: tuple[str, ...]) -> list[SweepRuns]:
    found = [SweepRuns(name, [r for r in cell_runs if r.strategy == name]) for name in sweep_names]
    return [f for f in found if f.runs and not all(math.isnan(r.fraction) for r in f.runs)]


def best_sweep(cell_runs, sweep_names: tuple[str, ...]) -> SweepRuns | None:
    """The sweep with the highest median fraction of the optimum, then the least median wall time."""
    found = _sweep_runs(cell_runs, sweep_names)
    if not found:
        return None
    return max(found, key=lambda f: (_median([r.fraction for r in f.runs]), -_median([r.wall_s for r in f.runs])))


def soonest_sweep(cell_runs, sweep_names: tuple[str, ...]) -> SweepRuns | None:
    """The sweep whose median time to 98% is least (one that never reaches it: the best sweep)."""
    found = _sweep_runs(cell_runs, sweep_names)
    reaching = [f for f in found if not math.isinf(_t98(f.runs))]
    if not reaching:
        return best_sweep(cell_runs, sweep_names)
    return min(reaching, key=lambda f: _t98(f.runs))


def lever_kind(grid, budget_bytes: int) -> str | None:
    """Why a lever other than batch size and precision matters in this cell, measured on its grid (None: none
    does): the optimum uses checkpointing, a device split or a lean lever, and without it the best config that
    fits is under 98% of the optimum, or nothing fits. Accumulation is the batch size's own lever here: at a
    fixed global batch it only trades micro-batch for steps."""
    best = grid.optimum(budget_bytes)
    if best is None:
        return None
    for lever, without in grid.lever_margins(budget_bytes):
        if lever == "accumulation":
            continue
        if without is None:
            return f"{lever}: nothing fits without it"
        if without.samples_per_s < REPLAY_TARGET * best.samples_per_s:
            return f"{lever}: {pct(without.samples_per_s / best.samples_per_s)} without it"
    return None


def median_trial_s(grid) -> float:
    """The grid's median trial wall time (every config, each run once without a budget)."""
    return _median([p.wall_s for p in grid.points.values()])


def cell_kinds(grid, budget_bytes: int, today: bool, heavy: bool) -> dict[str, str]:
    """The kinds of cell the time-to-98% target names that this one is, each with why."""
    kinds = {}
    if today:
        kinds[TODAY] = "one of today's cells"
    if (why := lever_kind(grid, budget_bytes)) is not None:
        kinds[LEVER] = why
    trial_s = median_trial_s(grid)
    if heavy or trial_s >= HEAVY_TRIAL_S:
        kinds[HEAVY] = f"median trial {seconds(trial_s)} s" + ("" if trial_s >= HEAVY_TRIAL_S
                                                                 else f", under the {HEAVY_TRIAL_S:g} s it stands for")
    return kinds


def cell_verdict(runs, workload: str, budget_bytes: int, sweep_names: tuple[str, ...], grid=None,
                 kinds: dict[str, str] | None = None) -> CellVerdict:
    """Check one cell; ``runs`` are all the suite's scored runs (replayed and live), ``grid`` the cell's."""
    v = CellVerdict(workload, budget_bytes, kinds=dict(kinds or {}))
    here = [r for r in runs if r.workload == workload and r.budget_bytes == budget_bytes]
    replay = [r for r in here if r.mode is BenchMode.REPLAY]
    mine = [r for r in replay if r.strategy == AUTOFIT_NAME]
    live = [r for r in here if r.mode is BenchMode.LIVE and r.strategy == AUTOFIT_NAME]
    if not mine or all(math.isnan(r.fraction) for r in mine):
        v.checks = {c: False for c in CHECKS}
        v.notes.append("autofit's search did not run" + (f" ({mine[0].error})" if mine and mine[0].error else ""))
        return v
    _check_answer(v, mine, live, grid, budget_bytes)
    _check_ooms(v, mine + live)
    _check_t98(v, mine, replay, sweep_names, grid)
    _check_wall(v, mine, replay, sweep_names)
    if v.checks.get(CHECK.answer) is False and _stop_reasons(mine):
        v.notes.append(_stop_reasons(mine))
    return v


def _check_answer(v: CellVerdict, mine, live, grid=None, budget_bytes: int = 0) -> None:
    frac = _median([r.fraction for r in mine])
    v.figures[CHECK.answer] = pct(frac)
    v.checks[CHECK.answer] = frac >= REPLAY_TARGET
    if not v.checks[CHECK.answer]:
        wrong = sorted({r.answer for r in mine if r.fraction < REPLAY_TARGET and r.answer is not None},
                       key=lambda c: c.short())
        none = any(r.answer is None and r.fraction < REPLAY_TARGET for r in mine)
        v.notes.append("replayed answers under 98%: "
                       + ", ".join([f"`{a.short()}`" for a in wrong] + ["`none`"] * none)
                       + (_truth_cause(grid, budget_bytes, wrong) if grid is not None else ""))
    if not live:
        v.checks[CHECK.live] = None
        v.figures[CHECK.live] = "not run live"
        return
    r = live[0]
    v.figures[CHECK.live] = pct(r.fraction)
    v.checks[CHECK.live] = r.fraction >= LIVE_TARGET
    if not v.checks[CHECK.live]:
        v.notes.append(f"live answer `{r.answer.short() if r.answer else 'none'}` is {pct(r.fraction)} of the grid "
                       f"optimum" + _live_samples(r, grid.optimum(budget_bytes) if grid is not None else None)
                       + "; live " + (_stop_reasons([r]) or "no stop reason recorded"))


def _live_best(run, config) -> tuple[float, int] | None:
    """The best of ``run``'s own samples of ``config`` (the figure a search ranks by) and how many it took."""
    seen = [x.outcome.samples_per_s for x in run.history if x.outcome.config == config and x.outcome.samples_per_s]
    return (max(seen), len(seen)) if seen else None


def _live_samples(run, optimum) -> str:
    """What the live run itself measured of its answer and of the grid's optimum: the grid's truth ranks
    them one way, and this says whether the live samples did too, or never took the optimum."""
    mine = _live_best(run, run.answer) if run.answer is not None else None
    if mine is None:
        return ""
    text = f"; live it read {mine[0]:.1f} samples/s (the best of {mine[1]} sample(s))"
    if optimum is None or optimum.config == run.answer:
        return text
    theirs = _live_best(run, optimum.config)
    if theirs is None:
        return text + f", and it never ran the optimum `{optimum.config.short()}`"
    return (text + f" against the optimum `{optimum.config.short()}`'s {theirs[0]:.1f} (the best of {theirs[1]}): "
            + (f"live the answer read {pct(mine[0] / theirs[0] - 1)} faster, where the grid's truth has it "
               f"{pct(1 - run.fraction)} slower" if mine[0] >= theirs[0] else
               f"live the optimum read {pct(theirs[0] / mine[0] - 1)} faster"))


def _truth_cause(grid, budget_bytes: int, answers) -> str:
    """What the grid's ground truth says of answers under 98% (``answers``): each one's truth and the
    optimum's, with how many samples each is the best of and the gap between its two best (the truth's
    own noise, :meth:`~autofit.bench.search_data.GridPoint.truth_noise`); where the shortfall is within
    the larger of those gaps, the grid cannot tell the answer from one at 98%, and the note says so."""
    best = grid.optimum(budget_bytes)
    if best is None or not best.samples_per_s:
        return ""
    parts = []
    for config in answers:
        point = grid.points.get(config)
        if point is None or not point.samples_per_s:
            continue
        gaps = [g for g in (point.truth_noise(), best.truth_noise()) if g is not None]
        within = bool(gaps) and point.samples_per_s / best.samples_per_s >= REPLAY_TARGET - max(gaps)
        parts.append(f"`{config.short()}` {_truth_text(point)} against the optimum `{best.config.short()}` "
                     f"{_truth_text(best)}" + ("; a shortfall within the truth's own noise there" if within else ""))
    return " (ground truth: " + "; ".join(parts) + ")" if parts else ""


def _truth_text(point) -> str:
    samples, gap = point.samples(), point.truth_noise()
    return (f"{point.samples_per_s:.1f} samples/s, the best of {len(samples)} samples"
            + (f" (its two best {pct(gap)} apart)" if gap is not None else ""))


def _check_ooms(v: CellVerdict, runs) -> None:
    ooms = sorted({x.outcome.config.short() for r in runs for x in r.history
                   if x.outcome.status is TrialStatus.OOM})
    v.figures[CHECK.no_oom] = str(max(r.oom_trials for r in runs))
    v.checks[CHECK.no_oom] = not ooms
    if ooms:
        v.notes.append(f"OOM trial(s): {', '.join(f'`{c}`' for c in ooms)}")


def _check_t98(v: CellVerdict, mine, replay, sweep_names, grid) -> None:
    sweep = soonest_sweep(replay, sweep_names)
    if sweep is None:
        v.checks[CHECK.t98], v.figures[CHECK.t98] = None, "no sweep"
        return
    a, b = _t98(mine), _t98(sweep.runs)
    v.figures[CHECK.t98] = f"{_secs(a)} vs {_secs(b)}"
    v.checks[CHECK.t98] = not math.isinf(a) and a < b
    if not v.checks[CHECK.t98]:
        v.notes.append(_t98_cause(mine, sweep, a, b, grid))


def _t98_cause(mine, sweep: SweepRuns, a: float, b: float, grid) -> str:
    """Where autofit's time to 98% went, against the soonest sweep's: its first use, its trials up to then,
    and what the trials before the one that reached 98% found."""
    against = "no sweep reaches 98%"
    if not math.isinf(b):
        theirs = _at_median([r for r in sweep.runs if r.time_to_98_s is not None], b)
        against = f"{sweep.name} {_secs(b)} s ({_trials_text(theirs, theirs.reached_98_at)})"
    if math.isinf(a):
        return f"autofit never reaches 98% (its answer: {pct(_median([r.fraction for r in mine]))}); {against}"
    run = _at_median([r for r in mine if r.time_to_98_s is not None], a)
    k = run.reached_98_at
    parts = [f"first use {seconds(run.extra_s)} s", _trials_text(run, k)]
    before = run.history[:k]
    if before and grid is not None:
        parts.append("before it " + ", ".join(_found(x.outcome, grid, run.budget_bytes) for x in before[:3])
                     + (" ..." if len(before) > 3 else ""))
    cause = f"autofit {_secs(a)} s: " + "; ".join(parts) + f"; against {against}"
    if run.extra_s >= b:
        cause += f"; its first use alone is {seconds(run.extra_s)} s"
    return cause


def _at_median(runs, t98_s: float):
    """The run whose time to 98% is the median ``t98_s`` (with an even count of seeds, one of the two middle ones)."""
    return min(runs, key=lambda r: abs(r.time_to_98_s - t98_s))


def _found(outcome, grid, budget_bytes: int) -> str:
    """A trial as the verdict names it: its config, what the grid's truth makes of it, and what it read."""
    best = grid.optimum(budget_bytes)
    read = (f", read {pct(outcome.samples_per_s / best.samples_per_s)}"
            if best is not None and outcome.samples_per_s else f", {outcome.status.value}")
    return f"`{outcome.config.short()}` ({pct(grid.fraction(outcome.config, budget_bytes))} of the optimum{read})"


def _trials_text(run, upto: int | None) -> str:
    """``n trial(s), x s`` of ``run``'s history up to and with index ``upto`` (all of it: None)."""
    done = run.history if upto is None else run.history[:upto + 1]
    ooms = sum(x.outcome.status is TrialStatus.OOM for x in done)
    return (f"{len(done)} trial(s) in {seconds(sum(x.outcome.cost_s for x in done))} s"
            + (f", {ooms} OOM" if ooms else ""))


def _check_wall(v: CellVerdict, mine, replay, sweep_names) -> None:
    best = best_sweep(replay, sweep_names)
    if best is None:
        v.checks[CHECK.wall], v.figures[CHECK.wall] = None, "no sweep"
        return
    a, b = _median([r.wall_s for r in mine]), _median([r.wall_s for r in best.runs])
    found = _median([r.fraction for r in best.runs])
    v.figures[CHECK.wall] = f"{seconds(a)} vs {seconds(b)}"
    v.checks[CHECK.wall] = a <= WALL_RATIO * b
    if not v.checks[CHECK.wall]:
        against = (f"against {best.name} {seconds(b)} s, {pct(found)} of the optimum" if found > 0 else
                   f"no sweep finds a config that fits, and the quickest to give up, {best.name}, stops after "
                   f"{seconds(b)} s")
        v.notes.append(f"wall time {seconds(a)} s ({_time_parts(mine)}); {against}; "
                       f"{WALL_RATIO:g}× is {seconds(WALL_RATIO * b)} s")


def _stop_reasons(runs) -> str:
    stops = sorted({n.removeprefix("stopped: ") for r in runs for n in r.notes if n.startswith("stopped:")})
    return "autofit stopped on " + " / ".join(stops) if stops else ""


def _time_parts(runs) -> str:
    first = _median([r.extra_s for r in runs])
    trials = _median([r.trials_s for r in runs])
    own = _median([r.wall_s - r.trials_s - r.extra_s for r in runs])
    repeats = _median([len(r.history) - len({x.outcome.config for x in r.history}) for r in runs])
    return (f"{seconds(first)} s first use + {seconds(trials)} s in {_median([r.trials for r in runs]):g} trial(s)"
            + (f" ({repeats:g} of them re-measurements)" if repeats else "") + f" + {seconds(own)} s own work")


def verdicts(runs, sweep_names: tuple[str, ...], grids=(), today: frozenset = frozenset(),
             heavy: frozenset = frozenset()) -> list[CellVerdict]:
    """One :class:`CellVerdict` per replayed cell, in the order the cells first appear. ``grids``: the cells'
    measured grids (for each cell's kinds and its trials' findings); ``today`` and ``heavy``: the
    ``(workload, budget_bytes)`` of today's cells and of the heavy cells (:mod:`autofit.bench.search_cells`)."""
    grid_of = grids_by_cell(grids)
    keys = dict.fromkeys((r.workload, r.budget_bytes) for r in runs if r.mode is BenchMode.REPLAY)
    out = []
    for w, b in keys:
        grid = grid_of.get((w, b))
        kinds = cell_kinds(grid, b, (w, b) in today, (w, b) in heavy) if grid is not None else {}
        out.append(cell_verdict(runs, w, b, sweep_names, grid, kinds))
    return out


@dataclass(frozen=True)
class Tally:
    """One line of the done-when reading: how many cells of a kind pass a check, against how many must."""

    label: str
    passed: int
    of: int
    needed: int
    failing: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.of > 0 and self.passed >= self.needed

    def text(self, where: bool = True) -> str:
        """The line; ``where``: with the cells that fail it."""
        if not self.of:
            return f"{self.label}: no such cell in this run"
        return (f"{self.label}: {self.passed} of {self.of} (needs {self.needed}) — {'PASS' if self.ok else 'FAIL'}"
                + (f"; not in {', '.join(self.failing)}" if self.failing and where else ""))


def tallies(cells: list[CellVerdict]) -> list[Tally]:
    """The done-when criteria over all cells: answers, OOMs, time to 98% per kind of cell, wall time."""
    def tally(label: str, check: str, among: list[CellVerdict], needed: int | None = None) -> Tally:
        judged = [v for v in among if v.checks.get(check) is not None]
        good = [v for v in judged if v.checks[check]]
        return Tally(label, len(good), len(judged), len(judged) if needed is None else min(needed, len(judged)),
                     tuple(v.where for v in judged if not v.checks[check]))

    of_kind = lambda kind: [v for v in cells if kind in v.kinds]
    return [tally("answer ≥98% of the optimum, replayed", CHECK.answer, cells),
            tally("live answer ≥95%", CHECK.live, cells),
            tally("no OOM trial", CHECK.no_oom, cells),
            tally("time to 98% sooner than the best sweep, cells where a lever other than batch size and precision "
                  "matters", CHECK.t98, of_kind(LEVER)),
            tally("time to 98% sooner than the best sweep, heavy cells", CHECK.t98, of_kind(HEAVY)),
            tally("time to 98% sooner than the best sweep, today's cells", CHECK.t98, of_kind(TODAY),
                  needed=math.ceil(TODAY_SHARE * len(of_kind(TODAY)) - 1e-9)),
            tally(f"wall time ≤{WALL_RATIO:g}× the best sweep's", CHECK.wall, cells)]


__all__ = ["CHECK", "CHECKS", "CellVerdict", "CheckLabels", "HEAVY", "LEVER", "TODAY", "Tally", "best_sweep",
           "cell_kinds", "cell_verdict", "lever_kind", "soonest_sweep", "tallies", "verdicts"]

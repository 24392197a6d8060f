"""The search suite's tables: ``search.md``, ``search_grid.csv``, ``search_runs.csv``, ``search_cells.csv``
(:mod:`autofit.bench.search_regimes`) and ``search.png``.

Reads the suite's results (:class:`autofit.bench.search_data.SearchResults`: grids and scored runs)
and says, in plain sentences, every figure on which autofit is worse than a peer (:func:`losses`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from autofit.bench.common import (
    Report,
    Spread,
    markdown_table,
    median_and_spread,
    mib,
    pct,
    seconds,
    try_plot,
    write_csv,
)
from autofit.bench.search_data import (
    TRUTH_NOISE_TARGET,
    BenchMode,
    Cell,
    Grid,
    MiB,
    RunResult,
    SearchResults,
    TruthNoise,
    grids_by_cell,
)
from autofit.bench.search_regimes import (
    cells_frame,
    gpu_cost_section,
    run_rows,
    write_cells_csv,
)
from autofit.bench.strategies import Strategy, sweeps
from autofit.bench.verdict import AUTOFIT_NAME, CHECKS, WALL_RATIO, tallies, verdicts
from autofit.core.records import TrialStatus
from autofit.runtime.schedule import DEFAULT_SCHEDULE as SCHEDULE


def _summary(runs: list[RunResult]) -> dict:
    frac = median_and_spread([r.fraction for r in runs])
    wall = median_and_spread([r.wall_s for r in runs])
    trials = median_and_spread([r.trials for r in runs])
    ooms = median_and_spread([r.oom_trials for r in runs])
    reached = [r.time_to_98_s for r in runs if r.time_to_98_s is not None]
    t98 = median_and_spread(reached)
    return {"fraction": frac, "wall": wall, "trials": trials, "ooms": ooms, "t98": t98,
            "reached": len(reached), "n": len(runs)}


def _spread(spread: Spread, fmt) -> str:
    med, lo, hi = spread
    if math.isnan(med):
        return "-"
    return fmt(med) if lo == hi else f"{fmt(med)} [{fmt(lo)}–{fmt(hi)}]"


def _count(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def losses(runs: list[RunResult], strategies: tuple[Strategy, ...]) -> list[str]:
    """Plain statements of every figure on which autofit is worse than a peer: replayed medians, then live runs.

    One line per cell and figure, naming every peer that beats autofit on it (with the fraction of
    the optimum that peer found, so a fast peer that finds little reads as such).
    """
    out = []
    for mode in (BenchMode.REPLAY, BenchMode.LIVE):
        keys = sorted({(r.workload, r.budget_bytes) for r in runs if r.mode is mode})
        for workload, budget in keys:
            where = f"{workload} @ {budget / MiB:.0f} MiB" + (" (live)" if mode is BenchMode.LIVE else "")
            what = "medians" if mode is BenchMode.REPLAY else "one live run each"
            cell = [r for r in runs if r.mode is mode and r.workload == workload and r.budget_bytes == budget]
            mine = [r for r in cell if r.strategy == AUTOFIT_NAME]
            if not mine:
                continue
            if any(r.error and math.isnan(r.fraction) for r in mine):
                out.append(f"{where}: autofit's search did not run ({mine[0].error}); every figure is a loss until it does.")
                continue
            out += _cell_losses(where, what, _summary(mine), cell, strategies)
    return out


@dataclass(frozen=True)
class _Figure:
    """A figure autofit is compared on: its name in the sentence, its key in :func:`_summary`, and its format."""

    label: str
    key: str
    higher_better: bool
    fmt: Callable[[float], str]


_FIGURES = (_Figure("best throughput found", "fraction", True, pct), _Figure("wall time (s)", "wall", False, seconds),
            _Figure("real trials", "trials", False, _count), _Figure("OOM trials", "ooms", False, _count),
            _Figure("time to 98% (s)", "t98", False, seconds))


def _cell_losses(where: str, what: str, a: dict, cell: list, strategies) -> list[str]:
    beaten: dict[str, list[str]] = {f.label: [] for f in _FIGURES}
    out = []
    for s in strategies:
        theirs = [r for r in cell if r.strategy == s.name]
        if s.name == AUTOFIT_NAME or not theirs or all(math.isnan(r.fraction) for r in theirs):
            continue
        b = _summary(theirs)
        if b["reached"] and not a["reached"]:
            out.append(f"{where}: {s.name} reaches 98% of the optimum; autofit does not.")
        for f in _FIGURES:
            if f.key == "t98" and not (a["reached"] and b["reached"]):
                continue
            mine_v, theirs_v = a[f.key].median, b[f.key].median
            if mine_v < theirs_v - 1e-9 if f.higher_better else mine_v > theirs_v + 1e-9:
                found = "" if f.key == "fraction" else f", {pct(b['fraction'].median, 0)} of the optimum"
                beaten[f.label].append(f"{s.name} {f.fmt(theirs_v)}{found}")
    for f in _FIGURES:
        if beaten[f.label]:
            out.append(f"{where}: on {f.label} autofit's {f.fmt(a[f.key].median)} is beaten by "
                       + "; ".join(beaten[f.label]) + f" ({what}).")
    return out


def cell_sets(grids: list[Grid]) -> tuple[frozenset, frozenset]:
    """The ``(workload, budget_bytes)`` of today's cells and of the heavy cells among ``grids``' cells
    (:data:`autofit.bench.search_cells.CELLS`, :data:`~autofit.bench.search_cells.HEAVY_CELLS`)."""
    from autofit.bench.search_cells import CELLS, HEAVY_CELLS

    present = grids_by_cell(grids)
    keys = lambda group: frozenset(k for c in group for b in c.budgets_mib if (k := (c.workload, b * MiB)) in present)
    return keys(CELLS), keys(HEAVY_CELLS)


def cell_verdicts(grids: list[Grid], runs: list[RunResult], strategies: tuple[Strategy, ...]):
    """Each cell's :class:`autofit.bench.verdict.CellVerdict`, its kinds from the suite's own cells."""
    today, heavy = cell_sets(grids)
    return verdicts(runs, tuple(s.name for s in sweeps(strategies)), grids, today, heavy)


def done_when_table(grids: list[Grid], runs: list[RunResult], strategies: tuple[Strategy, ...]) -> str:
    """The "Done when" section: the criteria tallied over the cells, then per cell each check's figures,
    PASS/FAIL, where and why."""
    cells = cell_verdicts(grids, runs, strategies)
    rows = [[v.where, "; ".join(f"{k} ({why})" for k, why in v.kinds.items()) or "-"]
            + [v.figures.get(c, "-") + ("" if v.checks.get(c) is None else (" ✓" if v.checks[c] else " ✗"))
               for c in CHECKS]
            + ["PASS" if v.passed else "FAIL", "; ".join(v.notes) or "-"] for v in cells]
    return ("## Done when\n\nPer cell: autofit's replayed answer ≥ 98% of the optimum (median over seeds), "
            "the live run ≥ 95% (where the cell ran live), no OOM trial in any run, time to 98% of the optimum "
            "sooner than the per-precision finder sweep that reaches it soonest (medians over seeds; a seed that "
            f"never reaches 98% counts as never), and total wall time at most {WALL_RATIO:g}× the best sweep's (highest "
            "median fraction of the optimum, then least wall time). Time to 98% is held to in every cell where a "
            "lever other than batch size and precision matters (the optimum uses it, and the best config without "
            "it is under 98% of the optimum or nothing fits), in every heavy cell (trials of about 10 s), and in "
            "at least 6 of today's 8 cells. ✓ passes, ✗ fails; the last column says where and why autofit fails, "
            "from the measured figures.\n\n"
            + "\n".join(f"- {t.text()}" for t in tallies(cells)) + "\n\n"
            + markdown_table(["cell", "kind"] + list(CHECKS) + ["verdict", "where and why"], rows,
                             "ll" + "r" * len(CHECKS) + "ll"))


def _live_plan(runs: list[RunResult]) -> str:
    cells = dict.fromkeys((r.workload, r.budget_bytes) for r in runs if r.mode is BenchMode.LIVE)
    return "; ".join(f"{w} @ {b / MiB:.0f} MiB — " + ", ".join(r.strategy for r in runs if r.mode is BenchMode.LIVE
                                                               and (r.workload, r.budget_bytes) == (w, b))
                     for w, b in cells)


def _autofit_time(runs: list[RunResult], cell: Cell, budget: int) -> str:
    mine = [r for r in runs if r.mode is BenchMode.REPLAY and r.strategy == AUTOFIT_NAME and r.workload == cell.workload
            and r.budget_bytes == budget and not math.isnan(r.wall_s)]
    if not mine:
        return ""
    med = lambda xs: median_and_spread(xs).median
    trials, extra = med([r.trials_s for r in mine]), med([r.extra_s for r in mine])
    own = med([r.wall_s - r.trials_s - r.extra_s for r in mine])
    return (f"autofit's wall time (medians): {seconds(extra)} s first use + {seconds(trials)} s of trials + "
            f"{seconds(own)} s of its own work (estimate, time model, calibration, Optuna storage, reports).")


def _after_table(stops: dict[BenchMode, list[str]], time_text: str) -> str:
    """The line under a cell's table: how autofit's replayed and live runs stopped (each run's own words, the
    two kinds named apart: a live run's stop may differ from its replays'), then where its time went."""
    said = [f"autofit {mode.value}{'s' if len(lines) > 1 else ''} " + "; ".join(lines) + "."
            for mode, lines in stops.items() if lines]
    parts = said + ([time_text] if time_text else [])
    return "\n\n" + " ".join(parts) if parts else ""


def write_search(out_dir: Path, env: dict, res: SearchResults, strategies: tuple[Strategy, ...]) -> list[Path]:
    """Write ``search_grid.csv``, ``search_runs.csv``, ``search_cells.csv``, ``search.md`` and (with matplotlib)
    ``search.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cells = cells_frame(run_rows(res.runs, res.grids, strategies))
    files = [write_csv(out_dir / "search_grid.csv", _grid_rows(res.grids)),
             write_csv(out_dir / "search_runs.csv", [r.row() for r in res.runs]),
             write_cells_csv(out_dir / "search_cells.csv", cells)]
    rep = Report("Search: autofit against its peers", env)
    for part in _method_sections(res, strategies):
        rep.add(part)
    for grid in res.grids:
        rep.add(_grid_section(grid))
        for budget_mib in grid.cell.budgets_mib:
            rep.add(_budget_section(grid, budget_mib, res.runs, strategies))
    live = _live_section(res.runs)
    if live:
        rep.add(live)
    rep.add(done_when_table(res.grids, res.runs, strategies))
    rep.add(gpu_cost_section(cells, strategies))
    lost = losses(res.runs, strategies)
    rep.add("## Where autofit loses\n\n" + ("\n".join(f"- {line}" for line in lost) if lost
                                             else "Nowhere: on every figure autofit's median is at least as good as each peer's."))
    files.append(rep.write(out_dir / "search.md"))
    plot = try_plot(out_dir / "search.png", lambda plt: _plot(plt, res, strategies))
    if plot:
        files.append(plot)
    return files


def _grid_rows(grids: list[Grid]) -> list[dict]:
    """``search_grid.csv``: every measured config, and whether it fits each of its cell's budgets."""
    grid_rows = []
    for grid in grids:
        for p in grid.points.values():
            row = {"workload": grid.cell.workload, **p.config.to_dict(), "status": p.status,
                   "measured_peak_bytes": p.peak_bytes, "predicted_peak_bytes": p.predicted_peak_bytes,
                   "samples_per_s": p.samples_per_s, "trial_samples_per_s": p.trial_samples_per_s,
                   "second_samples_per_s": p.second_samples_per_s,
                   "more_samples_per_s": ";".join(repr(x) for x in p.more_samples_per_s),
                   "step_time_s": p.step_time_s, "trial_wall_s": p.wall_s, "tracked_s": p.tracked_s,
                   "error": p.error or "", "param_count": grid.param_count, "device": grid.cell.device}
            for b in grid.cell.budgets_mib:
                row[f"fits_{b}MiB"] = p.status is TrialStatus.OK and p.peak_bytes is not None and p.peak_bytes <= b * MiB
            grid_rows.append(row)
    return grid_rows


def _method_sections(res: SearchResults, strategies: tuple[Strategy, ...]) -> list[str]:
    """How the suite measured, charged and scored, how the finders are run, and one line per strategy."""
    out = [f"Suite wall time: {res.wall_s / 60:.1f} min. Grids measured with `run_trial` "
           f"(warm-up {SCHEDULE.warmup_steps}, measured {SCHEDULE.measured_steps} step(s), timed steps "
           f"{SCHEDULE.timed_steps}), one config at a time; then rounds of more samples of each config that fits, taken by "
           "a warm worker process one config after another. "
           f"Replayed figures: {res.seeds} seeds per strategy and cell (median [min–max]); deterministic "
           "strategies give the same figures for every seed. Live figures: one real run (seed 0) per strategy "
           "and cell: " + (_live_plan(res.runs) or "none") + ".",
           "How a replayed trial is charged: a config that fits costs the grid's measured trial wall time (a "
           "re-measurement, which times throughput only: that time less the trial's seconds under the CPU "
           "memory tracker, plus its two warm-up steps run bare, where the grid recorded them as `tracked_s`); one "
           "over the budget costs the wall time of a trial that went over at its first operator plus one step of "
           "that config. A replayed trial shows the strategy the throughput that config's grid trial measured "
           "(noise included); running the same config again (autofit's re-measurements) shows the grid's second "
           "sample, and further runs its further samples. Answers are scored by the grid's throughput of the answered config over the grid's best "
           "config that fits (0 when the answer does not fit or there is none). *Time to 98%*, the headline: the "
           "strategy's clock when the config it would answer at that point first reached 98% of the optimum "
           "(medians over the seeds that reach it, with how many did when not all).",
           "How the batch-size finders (Accelerate, Lightning, DeepSpeed's autotuner) are run: each tunes the "
           "micro-batch only, keeping the global batch (accumulation = global batch / micro-batch) and leaving "
           "checkpointing off, as the tools do. `@amp-bf16`: at the precision a knowledgeable user chooses, the "
           "mixed-precision switch each tool documents (Accelerate `mixed_precision=\"bf16\"`, the HF Trainer's "
           "`bf16=True`, Lightning's `bf16-mixed`, DeepSpeed's `bf16` section). `sweep`: once per precision of the "
           "grid, the fastest measured answer kept, all trials charged to one clock. amp-fp16 is not in the grids, "
           "to keep them affordable: on CPUs without native fp16 kernels a step is ~1000x slower (docs/facts.md#device-rates-differ-by-dtype); where "
           "the CPU has them (this machine's matmul probe shows avx512_fp16 rates) it measures close to fp32. "
           "The finders run on one device: none of them splits a model, so where only a device split fits they "
           "find nothing and score 0. DeepSpeed itself would also try ZeRO stages 1-3 on several devices (stage 3 "
           "shards as fsdp does here), which the re-implementation here (stage 0) does not: a handicap in the "
           "split cells."]
    return out + [f"- **{s.name}**: {s.description}" + (f" (handicap: {s.handicap})" if s.handicap else "")
                  for s in strategies]


LEAN_TITLE = "optimizers"   # in a lean cell's heading: how a replay tells its costs from another cell's


def _grid_section(grid: Grid) -> str:
    """A cell's heading: its grid, what measuring it cost, the measurement noise, and configs that did not run."""
    cell = grid.cell
    title = (f"## {cell.workload}: global batch {cell.global_batch}, micro-batches "
             f"{', '.join(map(str, cell.micro_batches))}, precisions {', '.join(p.value for p in cell.precisions)}, "
             f"checkpointing {', '.join(map(str, cell.checkpoints))}"
             + (f", device splits {', '.join(map(str, cell.device_splits))} "
                f"({', '.join(m.value for m in cell.split_modes)})" if cell.device_splits != (1,) else "")
             + (f", {LEAN_TITLE} {', '.join(o.value for o in cell.optimizers)}, checkpoint policies "
                f"{', '.join(k.value for k in cell.checkpoint_policies)}" if cell.lean else ""))
    measured = (f"{len(grid.points)} configs measured in {grid.wall_s / 60:.1f} min "
                f"(median trial {seconds(median_and_spread([p.wall_s for p in grid.points.values()]).median)} s; "
                f"a trial that dies at its first operator: {grid.oom_floor_s:.1f} s). autofit's clock is charged "
                f"{grid.first_use_s:.1f} s per run for its first use on this workload: profiling on fake tensors "
                "and probing the device (and, where a split runs, its collectives), with cold caches"
                + (f" ({grid.warm_use_s:.2f} s with them warm: each read back in a new process, as a user's next "
                   "search reads them" + (f"; the trials' fork server it starts first was ready after "
                                          f"{grid.warm_server_ready_s:.1f} s" if grid.warm_server_ready_s else "")
                   + ")." if grid.warm_use_s is not None else ".")
                + (" Its parts, cold: " + ", ".join(f"{name} {t:.1f} s" for name, t in grid.first_use_parts_s.items())
                   + "." if grid.first_use_parts_s else ""))
    lines = [title, "", measured]
    pairs = [(p.trial_samples_per_s, p.second_samples_per_s) for p in grid.points.values()
             if p.trial_samples_per_s and p.second_samples_per_s]
    if pairs:
        diffs = [abs(a / b - 1) for a, b in pairs]
        lines.append(f"Measurement noise: the trial's throughput and a second sample of the same config differ by "
                     f"{pct(median_and_spread(diffs).median, 0)} (median) and up to {pct(max(diffs), 0)}. "
                     + truth_noise_text(TruthNoise.of([grid])))
    bad = [p for p in grid.points.values() if p.status is not TrialStatus.OK]
    if bad:
        lines.append("Grid configs that did not run: " + "; ".join(f"{p.config.short()}: {p.status} ({p.error})" for p in bad))
    return "\n".join(lines)


def truth_noise_text(noise: TruthNoise) -> str:
    """The ground truth's samples and its own noise, in words (empty when no config has two samples)."""
    if not noise.gaps:
        return ""
    counts = median_and_spread(noise.samples)
    gaps = median_and_spread(noise.gaps)
    return (f"The ground truth of each of {len(noise.gaps)} configs that fit is the best of its "
            f"{counts.low:.0f}–{counts.high:.0f} throughput samples (median {counts.median:.0f}; load from other "
            f"processes only ever slows a step); its own noise, the gap between a config's two best samples, "
            f"is {pct(gaps.median, 1)} (median) and at most {pct(gaps.high, 1)}; {noise.over_target()} of "
            f"{len(noise.gaps)} at or over {pct(TRUTH_NOISE_TARGET, 0)}.")


def _budget_section(grid: Grid, budget_mib: int, runs: list[RunResult], strategies: tuple[Strategy, ...]) -> str:
    """One cell at one budget: its optimum, the estimate's mistakes, the levers, and every strategy's replayed figures."""
    cell = grid.cell
    budget = budget_mib * MiB
    best = grid.optimum(budget)
    feasible = grid.feasible(budget)
    pruned_wrong = [p for p in grid.points.values() if p.status is TrialStatus.OK and p.predicted_peak_bytes is not None
                    and p.predicted_peak_bytes > budget >= p.peak_bytes]
    fits_wrong = [p for p in grid.points.values() if p.status is TrialStatus.OK and p.predicted_peak_bytes is not None
                  and p.predicted_peak_bytes <= budget < p.peak_bytes]
    head = [f"### {cell.workload} @ {budget_mib} MiB",
            "",
            f"{len(feasible)} of {len(grid.points)} configs fit (measured). Optimum: "
            + (f"`{best.config.short()}` at {best.samples_per_s:.1f} samples/s, {mib(best.peak_bytes)} MiB."
               if best else "none fits."),
            f"The estimate on this grid: {len(fits_wrong)} false fit(s), {len(pruned_wrong)} false prune(s)"
            + (": " + "; ".join(f"`{p.config.short()}` predicted {mib(p.predicted_peak_bytes)} measured "
                                f"{mib(p.peak_bytes)} MiB" for p in fits_wrong + pruned_wrong)
               if fits_wrong or pruned_wrong else "."), lever_line(grid, budget), ""]
    rows = []
    for s in strategies:
        mine = [r for r in runs if r.mode is BenchMode.REPLAY and r.strategy == s.name and r.workload == cell.workload
                and r.budget_bytes == budget]
        if mine:
            rows.append(_strategy_row(s.name, mine))
    ours = [r for r in runs if r.strategy == AUTOFIT_NAME and r.workload == cell.workload and r.budget_bytes == budget]
    stops = {mode: sorted({n for r in ours if r.mode is mode for n in r.notes if n.startswith("stopped:")})
             for mode in (BenchMode.REPLAY, BenchMode.LIVE)}
    return ("\n".join(head) + markdown_table(
        ["strategy", "best found / optimum", "wall time (s)", "real trials", "OOM trials", "time to 98% (s)",
         "answer(s)", "figures"], rows, "lrrrrrll")
        + _after_table(stops, _autofit_time(runs, cell, budget)))


def _strategy_row(name: str, mine: list[RunResult]) -> list:
    """A strategy's replayed figures in one cell and budget, over its seeds."""
    if all(r.error and math.isnan(r.fraction) for r in mine):
        return [name, f"**not available**: {mine[0].error}", "-", "-", "-", "-", "-", "FAIL"]
    sm = _summary(mine)
    answers = sorted({r.answer.short() if r.answer else "none" for r in mine})
    return [name, _spread(sm["fraction"], pct), _spread(sm["wall"], seconds),
            _spread(sm["trials"], _count), _spread(sm["ooms"], _count),
            (_spread(sm["t98"], seconds) + (f" ({sm['reached']}/{sm['n']} reached)"
                                            if sm["reached"] < sm["n"] else ""))
            if sm["reached"] else "never",
            ", ".join(f"`{a}`" for a in answers[:3]) + (" ..." if len(answers) > 3 else ""),
            f"{BenchMode.REPLAY}" + (f" ({sm['n']} seeds)" if sm["n"] > 1 else "")]


def _live_section(runs: list[RunResult]) -> str | None:
    """Every live run beside its replay (None without live runs)."""
    live = [r for r in runs if r.mode is BenchMode.LIVE]
    if not live:
        return None
    rows = []
    for r in live:
        replay = next((x for x in runs if x.mode is BenchMode.REPLAY and x.strategy == r.strategy and x.seed == 0
                       and x.workload == r.workload and x.budget_bytes == r.budget_bytes), None)
        if r.error and math.isnan(r.fraction):
            rows.append([f"{r.workload} @ {r.budget_bytes / MiB:.0f} MiB", r.strategy,
                         f"**not available**: {r.error}", "-", "-", "-", "-", "-", "-"])
            continue
        rows.append([f"{r.workload} @ {r.budget_bytes / MiB:.0f} MiB", r.strategy,
                     f"`{r.answer.short()}`" if r.answer else "none", pct(r.fraction),
                     seconds(r.wall_s), r.trials, r.oom_trials, seconds(r.time_to_98_s) if r.time_to_98_s is not None
                     else "never",
                     (f"{seconds(replay.wall_s)} s, {replay.trials} trials, {pct(replay.fraction)}" if replay else "-")
                     + (f"; error: {r.error}" if r.error else "")])
    return ("## Live runs, seed 0\n\n"
            "Every trial real, isolated and budget-enforced, timed by the wall clock. The last column is the same "
            "strategy and seed replayed against the grid: where they differ, the machine's noise (other "
            "processes share its two cores) or a config near the budget measured differently.\n\n"
            + markdown_table(["cell", "strategy", "answer", "best found / optimum (grid)", "wall time (s)",
                              "real trials", "OOM trials", "time to 98% (s)", "replay of the same run"], rows,
                             "lllrrrrrl"))


def _plot(plt, res: SearchResults, strategies):
    keys = sorted({(r.workload, r.budget_bytes) for r in res.runs if r.mode is BenchMode.REPLAY})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.8), squeeze=False)
    for ax, (workload, budget) in zip(axes[0], keys):
        for s in strategies:
            mine = [r for r in res.runs if r.mode is BenchMode.REPLAY and r.strategy == s.name and r.workload == workload
                    and r.budget_bytes == budget and not math.isnan(r.fraction)]
            if mine:
                ax.scatter([r.wall_s for r in mine], [r.fraction for r in mine], label=s.name, s=18)
        ax.set_title(f"{workload} @ {budget / MiB:.0f} MiB")
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("best found / optimum")
        ax.set_ylim(-0.05, 1.05)
    axes[0][-1].legend(fontsize=7)
    return fig


def lever_line(grid, budget_bytes: int) -> str:
    """What the optimum's levers are worth here, measured: the best config that fits without each."""
    parts = []
    for lever, without in grid.lever_margins(budget_bytes):
        best = grid.optimum(budget_bytes)
        if without is None:
            parts.append(f"{lever} (nothing fits without it)")
        else:
            parts.append(f"{lever} (best without it: `{without.config.short()}` at {without.samples_per_s:.1f} "
                         f"samples/s, {pct(without.samples_per_s / best.samples_per_s)} of the optimum)")
    return ("The optimum uses " + "; ".join(parts) + "." if parts
            else "The optimum uses none of checkpointing, accumulation, a device split or a lean lever.")

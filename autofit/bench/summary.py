"""The headline figures of a bench run, for the README: one short Markdown file."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from autofit.bench.common import median_and_spread, pct, seconds
from autofit.bench.search_data import BenchMode


def headline(results) -> list[str]:
    """One line per headline figure of the suites that ran."""
    lines = []
    acc = results.suites.get("accuracy")
    if acc is not None:
        from autofit.bench.accuracy import (
            TARGET_MEDIAN,
            lean_stats,
            safety,
            target_verdict,
        )
        from autofit.bench.accuracy_cases import MAIN_WORKLOADS

        main = tuple(w for w in MAIN_WORKLOADS if any(r.workload == w and not r.lean for r in acc.rows))
        s = acc.stats(main)
        verdict = "PASS" if acc.passes(main) else "FAIL"
        if main:
            lines.append(f"Peak memory, estimate vs measured (CPU tracker), {s.n} configs of {' and '.join(main)}: "
                         f"median |error| {pct(s.median, 2)}, p95 {pct(s.p95, 2)}, max {pct(s.max, 2)} — {verdict} "
                         "against the targets ≤ 3% / ≤ 8% (LLMem reports ≤ 1.6% on one GPU, DNNMem ~15%).")
        lean = lean_stats(acc)
        if lean.n:
            lines.append(f"Lean levers (adafactor, adamw8bit, selective checkpointing), {lean.n} configs against the "
                         f"allocator (the tracker for splits): median |error| {pct(lean.median, 2)}, max "
                         f"{pct(lean.max, 2)} — {target_verdict(lean, TARGET_MEDIAN)} against ≤ 3% / ≤ 8%.")
        for extra in sorted({r.workload for r in acc.rows if not r.lean} - set(main)):
            e = acc.stats((extra,))
            lines.append(f"{extra} (reported, not a target): median |error| {pct(e.median, 1)}, max {pct(e.max, 1)}, "
                         f"{e.under}/{e.n} under-estimates.")
        n_fits = n_prunes = 0
        for w, budgets in acc.budgets.items():
            for b in budgets:
                fits, prunes = safety([r for r in acc.rows if r.workload == w], b)
                n_fits, n_prunes = n_fits + len(fits), n_prunes + len(prunes)
        lines.append(f"At the search budgets: {n_fits} false fit(s), {n_prunes} false prune(s).")
        from autofit.bench.prior import PRIOR, overall

        if acc.prior and overall(acc.prior, PRIOR.bare) and overall(acc.prior, PRIOR.layer):
            (med, top), (bare_med, bare_top) = overall(acc.prior, PRIOR.layer), overall(acc.prior, PRIOR.bare)
            lines.append(f"Time model prior error (before any trial calibrates it) over the search grids' configs, "
                         f"median/max: {pct(med, 0)}/{pct(top, 0)} with the workload's own layer timed, against "
                         f"{pct(bare_med, 0)}/{pct(bare_top, 0)} from the bare matmul probe alone.")
    srch = results.suites.get("search")
    if srch is not None:
        lines += _search_lines(srch)
    cost = results.suites.get("cost")
    if cost is not None:
        rate = max((r["value"] for r in cost.rows if r["metric"] == "configs_per_s"), default=None)
        llama = [r for r in cost.rows if r["kind"] == "profile" and r["item"].startswith("llama-7b")]
        overhead = {runner: [r["value"] for r in cost.rows if r["metric"] == "overhead_fraction" and r["value"]
                             and r["item"].endswith(runner)] for runner in ("fresh interpreter", "fork server")}
        slow = [r["value"] for r in cost.rows if r["metric"] == "slowdown" and r["value"]]
        if rate:
            lines.append(f"Estimator: {rate:,.0f} configs scored per second.")
        for r in llama:
            lines.append(f"Profiling {r['item']}: {seconds(r['value'])} s on fake tensors, cold cache.")
        if overhead["fresh interpreter"] and overhead["fork server"]:
            spawned, forked = overhead["fresh interpreter"], overhead["fork server"]
            lines.append(f"Trial runner: process start and model build are {pct(min(forked), 0)}–{pct(max(forked), 0)} "
                         f"of a short trial's wall time with the fork server, against {pct(min(spawned), 0)}–"
                         f"{pct(max(spawned), 0)} with a fresh interpreter per trial.")
        if slow:
            lines.append(f"Memory tracker: {min(slow):.1f}–{max(slow):.1f}x slower training steps (timed steps run "
                         "without it).")
    steady = results.suites.get("steady")
    if steady is not None:
        for v in steady.verdicts():
            lines.append(f"Steadiness, {v.where}: {len(v.answers)} distinct answer(s) ({', '.join(v.answers)}); the "
                         f"slowest measures {pct(v.worst_share, 1)} of the fastest quietly — "
                         f"{'PASS' if v.passed else 'FAIL'} against ≥ 95%.")
    for name, wall in results.wall_s.items():
        lines.append(f"Suite {name}: {wall / 60:.1f} min.")
    return lines


def _search_lines(srch) -> list[str]:
    """Per cell: each strategy's median fraction and wall time, its handicap named; then the done-when verdicts."""
    from autofit.bench.own_search import AUTOFIT
    from autofit.bench.search_data import TRUTH_NOISE_TARGET, TruthNoise, sample_spreads
    from autofit.bench.search_tables import cell_verdicts, truth_noise_text
    from autofit.bench.verdict import tallies

    handicap = {s.name: s.handicap for s in srch.strategies}
    named = lambda n: f"{n} ({handicap[n]})" if handicap.get(n) else n
    lines = []
    for grid in srch.grids:
        for b in grid.cell.budgets_mib:
            runs = [r for r in srch.runs if r.mode is BenchMode.REPLAY and r.workload == grid.cell.workload
                    and r.budget_bytes == b * 2**20]
            parts = []
            for name in dict.fromkeys(r.strategy for r in runs):
                mine = [r for r in runs if r.strategy == name]
                frac = median_and_spread([r.fraction for r in mine]).median
                if math.isnan(frac):
                    parts.append(f"{name} not available")
                    continue
                wall = median_and_spread([r.wall_s for r in mine]).median
                parts.append(f"{named(name)} {pct(frac, 0)} in {seconds(wall, 0)} s")
            lines.append(f"Search, {grid.cell.workload} @ {b} MiB (best found / optimum, median wall time): "
                         + "; ".join(parts) + ".")
    for workload, budget in dict.fromkeys((r.workload, r.budget_bytes) for r in srch.runs if r.mode is BenchMode.LIVE):
        live = [r for r in srch.runs if r.mode is BenchMode.LIVE and (r.workload, r.budget_bytes) == (workload, budget)]
        lines.append(f"Live, {workload} @ {budget / 2**20:.0f} MiB (one real run each): "
                     + "; ".join(f"{named(r.strategy)} {pct(r.fraction, 0)} in {seconds(r.wall_s, 0)} s"
                                 for r in live if not math.isnan(r.fraction)) + ".")
    if not any(r.strategy == AUTOFIT.name and not math.isnan(r.fraction) for r in srch.runs):
        lines.append("autofit's own search was not available to the benchmark in this run.")
    noise = TruthNoise.of(srch.grids)
    if noise.gaps:
        lines.append(f"Search grids' ground truth: {truth_noise_text(noise)} — "
                     f"{'PASS' if not noise.over_target() else 'FAIL'} against < {pct(TRUTH_NOISE_TARGET, 0)}.")
    if spread := spread_text(sample_spreads(srch.grids)):
        lines.append(spread)
    cells = cell_verdicts(srch.grids, srch.runs, srch.strategies)
    lines.append("Search done-when criteria, over the cells (each cell, where and why: search.md): "
                 + "; ".join(t.text(where=False) for t in tallies(cells)) + ".")
    for v in cells:
        lines.append(f"Done when, {v.where}: " + ("PASS" if v.passed else
                     "FAIL on " + ", ".join(f"{c} ({v.figures.get(c, '-')})" for c in v.failed)) + ".")
    return lines


def spread_text(spreads: list[float]) -> str:
    """One sample's noise over the search grids, in quantiles, beside the search's re-measurement floor."""
    from autofit.study.leaders import NOISE_MIN

    if not spreads:
        return ""
    q = np.quantile(spreads, [0.5, 0.75, 0.9, 0.95])
    return (f"One throughput sample's noise, over the search grids' {len(spreads)} configs with two (the trial's "
            f"and the next; larger / smaller - 1): {pct(q[0], 1)} median, {pct(q[1], 1)} at the 75th percentile, "
            f"{pct(q[2], 1)} at the 90th, {pct(q[3], 1)} at the 95th, {pct(max(spreads), 1)} at most; a search "
            f"re-measures the leaders a spread of at least {pct(NOISE_MIN, 0)} could reorder "
            "(`autofit.study.leaders.NOISE_MIN`; wider once its own samples spread more).")


def write_summary(out_dir: Path, results, command: str, complete: bool) -> Path | None:
    """Write ``summary.md`` (headline figures) when every suite ran; return its path, else None."""
    if not complete:
        return None
    text = "# autofit bench: headline figures\n\n" + f"Reproduce with `{command}`; details in the suites' files.\n\n" \
        + "\n".join(f"- {line}" for line in headline(results)) + "\n"
    path = Path(out_dir) / "summary.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


__all__ = ["headline", "write_summary"]

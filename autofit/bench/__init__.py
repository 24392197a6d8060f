"""``autofit bench``: accuracy, search quality and cost, measured on this machine, written as tables.

Four suites, each a module: :mod:`~autofit.bench.accuracy` (estimated against measured peak
memory), :mod:`~autofit.bench.search` (autofit's search against the peers in
:mod:`~autofit.bench.strategies`, on exhaustively measured grids), :mod:`~autofit.bench.cost`
(estimator, profiler, trial runner and tracker costs) and :mod:`~autofit.bench.steady` (the same
answer run after run, and beside a busy core). Each writes Markdown and CSV under the
output directory, headed by the machine, device, versions and date (:mod:`~autofit.bench.common`).

Example::

    from pathlib import Path
    from autofit.bench import run_bench
    results = run_bench(["accuracy"], out_dir=Path("results/benchmarks"), quick=True)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autofit.bench.common import apply_bench_env, environment

SUITES = ("accuracy", "search", "cost", "steady")
DEFAULT_OUT = Path("results/benchmarks")


@dataclass
class BenchResults:
    """What each suite returned (by name), its wall time, and the files written."""

    suites: dict[str, Any] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)


def run_bench(suites: Sequence[str] = SUITES, *, out_dir: Path = DEFAULT_OUT, quick: bool = False,
              command: str = "autofit bench", progress: Callable[[str], None] = lambda _m: None,
              workloads: Sequence[str] | None = None, lean_only: bool = False) -> BenchResults:
    """Run ``suites`` in order and write their tables to ``out_dir``.

    ``workloads``: parts of the accuracy suite's workload names; only those workloads are
    measured (:func:`autofit.bench.accuracy_cases.select_workloads`). ``lean_only``: the accuracy suite
    measures only the configs that use a lean lever (another optimizer, selective checkpointing), the
    search suite only its lean cells (:data:`autofit.bench.search_cells.LEAN_CELLS`); the cost and
    steady suites have no lean part (ValueError). Returns a :class:`BenchResults`. Raises ValueError for an unknown suite name, ConfigError
    for a ``workloads`` part that names none. Every real training step runs in a child process
    with ``OMP_WAIT_POLICY=PASSIVE`` (set here).
    """
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}: expected {', '.join(SUITES)}")
    if lean_only and ("cost" in suites or "steady" in suites):
        raise ValueError("only the accuracy and search suites have a lean part: lean_only runs those")
    selected = None
    if workloads:
        from autofit.bench.accuracy_cases import select_workloads

        selected = select_workloads(tuple(workloads), quick)
    apply_bench_env()
    env = environment(command, probe_host=True)
    out_dir = Path(out_dir)
    results = BenchResults()
    for name in suites:
        started = time.perf_counter()
        progress(f"suite {name}{' (quick)' if quick else ''}...")
        if name == "accuracy":
            from autofit.bench.accuracy import run_accuracy

            res = run_accuracy(out_dir, env, quick=quick, workloads=selected, progress=progress, lean_only=lean_only)
        elif name == "search":
            from autofit.bench.search import run_search_suite

            res = run_search_suite(out_dir, env, quick=quick, progress=progress, lean_only=lean_only)
        elif name == "cost":
            from autofit.bench.cost import run_cost

            res = run_cost(out_dir, env, quick=quick, progress=progress)
        else:
            from autofit.bench.steady import run_steady

            res = run_steady(out_dir, env, quick=quick, progress=progress)
        results.suites[name] = res
        results.wall_s[name] = time.perf_counter() - started
        results.files += list(res.files)
        progress(f"suite {name} done in {results.wall_s[name] / 60:.1f} min")
    return results


__all__ = ["DEFAULT_OUT", "SUITES", "BenchResults", "run_bench"]

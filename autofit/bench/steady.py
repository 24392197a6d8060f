"""The steadiness suite: does the answer depend on when the search ran, or on what else the machine does?

- **repeats**: the README's commands on the built-in ``gpt-tiny`` (``autofit search --budget 8GB``, and
  ``--budget 200MB``, where the budget binds on a CPU), each run :data:`REPEATS` times, one after another;
- **busy core**: the 200 MB search again beside a busy loop holding one core (what a browser tab, a build
  or a data loader does to a user's machine).

The searches and the quiet measurements run in a user's environment: without the ``OMP_WAIT_POLICY``
the other suites set for their timing.

Then every distinct answer is measured quietly, :data:`QUIET_ROUNDS` rounds of one trial per answer,
the answers' trials interleaved so that drift in the machine's speed falls on all of them alike, and
each answer is scored by the median of its trials. Not by the best: with no load to slow a trial, what
still moves it is two-sided (each trial is a new process, with its own memory layout and clock), and
one config's quiet trials here have read 26.9-39.6 samples/s around a median of 33.1, so the best of
several rewards the config with the widest spread rather than the fastest. A check passes when every
answer reaches :data:`TARGET_SHARE` of the fastest answer's quiet median: the same answer, or one as good.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from autofit.bench.common import Report, markdown_table, pct, write_csv
from autofit.core.records import best_sample, config_samples
from autofit.report.tables import RAN

MODEL = "gpt-tiny"
BUDGETS = ("8GB", "200MB")   # the README's first command, and its CPU demo where the budget binds
BUSY_BUDGET = "200MB"
REPEATS = 3
# Quiet trials per answer. Two answers a few percent apart are told apart by their medians only if those
# are steadier than the gap: one config's quiet trials have spanned ±15% here, and the median of 15 such
# trials has about half the spread of the median of 7 (a standard error ~1.25σ/√n).
QUIET_ROUNDS = 15
TARGET_SHARE = 0.95
COLUMNS = ["check", "budget", "run", "answer", "search_samples_per_s", "quiet_samples_per_s", "quiet_min_per_s",
           "quiet_max_per_s", "quiet_trials", "share_of_best", "fastest_in_search_per_s", "fastest_in_search_samples",
           "wall_s", "real_trials", "starved_steps", "max_wait_share"]


@dataclass
class SteadyResults:
    """One row per search run (:data:`COLUMNS`) and the suite's wall time."""

    rows: list[dict]
    wall_s: float
    files: list[Path] = field(default_factory=list)

    def verdicts(self) -> list[Verdict]:
        """Per check and budget. Shares are of the fastest answer at the budget, the quiet runs' and the
        loaded run's alike, so a busy-core answer slower than a quiet run's answer fails."""
        out = []
        for check, budget in dict.fromkeys((r["check"], r["budget"]) for r in self.rows):
            rows = [r for r in self.rows if (r["check"], r["budget"]) == (check, budget)]
            shares = [r["share_of_best"] for r in rows if r["share_of_best"] is not None]
            worst = min(shares) if shares else float("nan")
            answers = tuple(dict.fromkeys(r["answer"] for r in rows if r["answer"]))
            out.append(Verdict(f"{check}, {budget}", worst, bool(shares) and worst >= TARGET_SHARE, answers))
        return out


class Verdict(NamedTuple):
    """One check: where, the slowest answer's quiet share of the fastest's, whether it passed, the answers."""

    where: str
    worst_share: float
    passed: bool
    answers: tuple[str, ...]


def _spin(stop) -> None:
    while not stop.is_set():
        pass


class BusyCore:
    """A busy loop on one core while the block runs (a separate process: it holds a core, not the GIL)."""

    def __enter__(self) -> BusyCore:
        self._stop = multiprocessing.get_context("spawn").Event()
        self._hog = multiprocessing.get_context("spawn").Process(target=_spin, args=(self._stop,), daemon=True)
        self._hog.start()
        time.sleep(0.5)  # the interpreter started and spinning before the search does
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._hog.join(10)  # a loaded machine may still be starting its interpreter
        if self._hog.is_alive():
            self._hog.kill()
            self._hog.join()  # reaped: gone when the block ends


def _search_row(check: str, budget: str, run: int, out: Path) -> dict:
    import autofit
    from autofit.study.storage import load_snapshot

    started = time.perf_counter()
    res = autofit.search(MODEL, budget, out=out, device="cpu", progress=False)
    table = res.table
    real = table[table["status"].isin(RAN)]
    waits = real["max_wait_share"].dropna()
    return {"check": check, "budget": budget, "run": run, "answer": res.best.short() if res.best else None,
            "config": res.best, "search_samples_per_s": (res.best_measured or {}).get("samples_per_s"),
            "seen": _best_samples(load_snapshot(out).records),
            "quiet_samples_per_s": None, "share_of_best": None, "wall_s": time.perf_counter() - started,
            "real_trials": len(real), "starved_steps": int(real["starved_steps"].fillna(0).sum()),
            "max_wait_share": float(waits.max()) if len(waits) else None}


def _best_samples(records) -> dict:
    """Each config a search ran ok under the budget: the samples/s of the sample it is ranked by
    (:func:`autofit.core.records.best_sample`) and how many samples it has."""
    return {config: (best_sample(samples).measurement.get("samples_per_s"), len(samples))
            for config, samples in config_samples(records).items()}


class Quiet(NamedTuple):
    """One answer's quiet trials: their median throughput (its score), the slowest and fastest, how many ran."""

    median_per_s: float
    min_per_s: float
    max_per_s: float
    trials: int


def _measure_quietly(configs: list, rounds: int, progress) -> dict:
    """Each config's :class:`Quiet` figures over ``rounds`` trials, the configs' trials interleaved."""
    from autofit.trial.run import run_trial

    seen: dict = {config: [] for config in configs}
    for i in range(rounds):
        for config in configs:
            r = run_trial(MODEL, config, device="cpu", warmup_steps=2, measure_steps=3, timeout_s=300)
            seen[config].append(r.samples_per_s or 0.0)
            progress(f"steady: quiet sample {i + 1}/{rounds} of {config.short()}: "
                     f"{r.samples_per_s or 0:.1f} samples/s ({r.status.value})")
    return {config: Quiet(statistics.median(v), min(v), max(v), len(v)) for config, v in seen.items() if v}


@contextlib.contextmanager
def _as_users_run_it():
    """Trials in the environment a user's shell has: without the OpenMP wait policy the bench sets for
    its own timing (a trial's process takes it from ours: the fork server restarts without it)."""
    policy = os.environ.pop("OMP_WAIT_POLICY", None)
    try:
        yield
    finally:
        if policy is not None:
            os.environ["OMP_WAIT_POLICY"] = policy


def run_steady(out_dir: Path, env: dict, *, quick: bool = False,
               progress: Callable[[str], None] = lambda _m: None) -> SteadyResults:
    """Run the searches, measure their answers quietly, and write ``steady.md`` and ``steady.csv``."""
    with _as_users_run_it():
        return _run_steady(out_dir, env, quick, progress)


def _run_steady(out_dir: Path, env: dict, quick: bool, progress) -> SteadyResults:
    started = time.perf_counter()
    repeats = 2 if quick else REPEATS
    budgets = (BUSY_BUDGET,) if quick else BUDGETS
    rows = []
    with tempfile.TemporaryDirectory(prefix="autofit-steady-") as tmp:
        for budget in budgets:
            for run in range(1, repeats + 1):
                progress(f"steady: autofit search --budget {budget}, run {run} of {repeats}...")
                rows.append(_search_row("repeats", budget, run, Path(tmp) / f"{budget}-{run}"))
        progress(f"steady: autofit search --budget {BUSY_BUDGET} beside a busy core...")
        with BusyCore():
            rows.append(_search_row("busy core", BUSY_BUDGET, 1, Path(tmp) / "busy"))
    for budget in budgets:
        mine = [r for r in rows if r["budget"] == budget and r["config"] is not None]
        quiet = _measure_quietly(list(dict.fromkeys(r["config"] for r in mine)), 3 if quick else QUIET_ROUNDS,
                                 progress)
        fastest = max((q.median_per_s for q in quiet.values()), default=0.0)
        fastest_config = max(quiet, key=lambda c: quiet[c].median_per_s, default=None)
        for r in mine:
            q = quiet[r["config"]]
            seen = r.get("seen", {}).get(fastest_config, (None, 0))
            r.update(quiet_samples_per_s=q.median_per_s, quiet_min_per_s=q.min_per_s, quiet_max_per_s=q.max_per_s,
                     quiet_trials=q.trials, share_of_best=q.median_per_s / fastest if fastest else None,
                     fastest_in_search_per_s=seen[0], fastest_in_search_samples=seen[1])
    res = SteadyResults(rows, time.perf_counter() - started)
    res.files = write_steady(out_dir, env, res, repeats)
    return res


def _quiet_cell(row: dict) -> str:
    if not row.get("quiet_samples_per_s"):
        return "-"
    return (f"{row['quiet_samples_per_s']:.1f} [{row.get('quiet_min_per_s') or 0:.1f}-"
            f"{row.get('quiet_max_per_s') or 0:.1f}] ({row.get('quiet_trials')})")


def _fastest_cell(row: dict) -> str:
    """What this run's search read of the budget's quietly fastest answer: why it answered another, if it did."""
    if row.get("share_of_best") is None:
        return "-"
    if row["share_of_best"] >= 1.0:
        return "its answer"
    if not row.get("fastest_in_search_samples"):
        return "not run"
    return f"{row['fastest_in_search_per_s']:.1f} (best of {row['fastest_in_search_samples']})"


def _why(rows: list[dict], verdict: Verdict) -> str:
    """A failing check's measured cause: what each run under the target read of its answer and of the fastest."""
    parts = [f"run {r['run']} answered `{r['answer']}` at {r['search_samples_per_s'] or 0:.1f} in its search, where "
             + ("it never ran the fastest" if not r.get("fastest_in_search_samples") else
                f"the fastest read {_fastest_cell(r)}")
             for r in rows if f"{r['check']}, {r['budget']}" == verdict.where
             and r["share_of_best"] is not None and r["share_of_best"] < TARGET_SHARE]
    return "; " + "; ".join(parts) if parts else ""


def write_steady(out_dir: Path, env: dict, res: SteadyResults, repeats: int) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [write_csv(out_dir / "steady.csv", res.rows, COLUMNS)]
    rep = Report("Steadiness: the same answer, run after run and beside a busy core", env)
    rep.add(f"Suite wall time: {res.wall_s / 60:.1f} min. `autofit search` on `{MODEL}` with the default space, "
            f"{repeats} times per budget, then once at {BUSY_BUDGET} beside a busy loop holding one core. Every "
            f"distinct answer was then measured quietly, {QUIET_ROUNDS} rounds of one trial per answer, "
            f"interleaved, and scored by the median of its trials (not the best: quiet trials also vary upward, "
            f"see docs/benchmarks.md); *share of best* is an answer's quiet median over the fastest answer's. "
            f"Target: every answer at least {TARGET_SHARE:.0%} (the same answer, or one as fast within the noise).")
    rows = [[r["check"], r["budget"], r["run"], f"`{r['answer']}`" if r["answer"] else "none",
             f"{r['search_samples_per_s']:.1f}" if r["search_samples_per_s"] else "-",
             _quiet_cell(r), pct(r["share_of_best"], 1), _fastest_cell(r),
             f"{r['wall_s']:.0f}", r["real_trials"], r["starved_steps"],
             pct(r["max_wait_share"], 0)] for r in res.rows]
    rep.add(markdown_table(["check", "budget", "run", "answer", "in the search (samples/s)",
                            "quiet: median [min-max] (trials)", "share of best",
                            "the fastest answer in this search (samples/s)", "wall (s)", "real trials",
                            "starved steps", "longest CPU wait"], rows, "llrlrrrrrrrr"))
    rep.add("*the fastest answer in this search*: where a run answered other than the answer fastest quietly at "
            "its budget, the best of that search's own samples of the fastest one (the figure it ranks by), or "
            "*not run*; "
            "*starved steps*: timed steps whose threads waited for a CPU longer than 5% of the step, taken again "
            "(docs/search.md); *longest CPU wait*: the largest such wait of a trial, as a share of its step.")
    rep.add("\n".join(f"- {v.where}: {len(v.answers)} distinct answer(s); the slowest measures "
                      f"{pct(v.worst_share, 1)} of the fastest quietly — {'PASS' if v.passed else 'FAIL'} "
                      f"(target ≥ {TARGET_SHARE:.0%})" + ("" if v.passed else _why(res.rows, v))
                      for v in res.verdicts()))
    files.append(rep.write(out_dir / "steady.md"))
    return files


__all__ = ["BUDGETS", "BusyCore", "SteadyResults", "Verdict", "run_steady", "write_steady"]

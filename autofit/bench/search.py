"""The search suite: autofit's search against its peers, on grids measured exhaustively here.

For each workload a small grid (precision x micro-batch x checkpointing, a fixed global batch,
and for some cells a device split: pipeline stages or FSDP ranks, each a process on this
machine's CPU, gloo) is run for real, config by config, with the same trial runner the strategies use
(:func:`autofit.trial.run.run_trial`, no budget). Its fastest config that fits a budget is the
ground-truth optimum for that budget. Then each strategy searches:

- **live**, once per strategy on one cell (a workload and budget): every trial a real,
  budget-enforced, isolated trial, timed by the wall clock;
- **replayed** against the measured grid for every cell and several seeds (a tabular benchmark,
  as in HPOBench and NAS-Bench): a trial that fits costs the grid's measured wall time; one over
  the budget is an OOM that costs the measured time of a trial that dies at once (process start,
  imports, model build) plus one step of that config. A config's first run shows the strategy
  the grid trial's own throughput, a re-run the grid's second sample (the noise a real search
  meets). The strategy's own work (profiling, sampling) is timed for real.
  :mod:`autofit.bench.replay` replays against a committed ``search_grid.csv``.

A strategy's answer is scored by the grid's throughput of the config it answered, so a live
run and its replay are judged by the same yardstick and measurement noise cannot make an
answer look better than the optimum.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from autofit.bench.common import mib, pct, seconds
from autofit.bench.search_data import (
    Cell,
    Grid,
    GridPoint,
    MiB,
    RunResult,
    SearchResults,
)
from autofit.bench.search_tables import AUTOFIT_NAME, write_search
from autofit.bench.strategies import (
    PEERS,
    Oracle,
    Outcome,
    Problem,
    Strategy,
    incumbent,
    optuna_tpe,
    sweeps,
)
from autofit.core.config import Precision, SplitMode, TrainConfig
from autofit.core.records import TrialStatus
from autofit.runtime.schedule import DEFAULT_SCHEDULE

# Trial settings shared by the grid, the live runs and (through the grid) the replays.
SCHEDULE = DEFAULT_SCHEDULE  # the steps of a study's trial (autofit.runtime.schedule), so grid and search measure alike
TRIAL_TIMEOUT_S = 240.0
TARGET_FRACTION = 0.95


_THREE = (Precision.FP32, Precision.AMP_BF16, Precision.BF16)
# amp-fp16 is left out to keep the exhaustive grids affordable: on CPUs without native fp16
# kernels a step is ~1000x slower (FACTS.md), and where the CPU has them (avx512_fp16, as the
# search's probe found on this machine) it measures close to fp32, which the grid already has.
_PIPELINE_AND_FSDP = (SplitMode.PIPELINE, SplitMode.FSDP)


def user_model(file: str, function: str = "workload") -> str:
    """The ``--model`` spec of a workload file in ``autofit/bench/user_models`` (written as a user
    writes one, loaded by path), relative to the working directory as a user would type it."""
    path = Path(__file__).resolve().parent / "user_models" / file
    try:
        path = Path(os.path.relpath(path))
    except ValueError:  # another drive (Windows): keep it absolute
        pass
    return f"{path.as_posix()}:{function}"


# Cells where each lever decides the optimum, chosen from measurements (the tables' "The optimum
# uses ..." line states, per budget, what each lever is worth in the committed run):
# - accumulation: gpt-tiny @ 64 MiB. No config with grad_accum 1 fits at global batch 12 (the
#   smallest, bf16 mb=12 ckpt=1, measured 66.2 MiB); the optimum was bf16 mb=6 ga=2.
# - checkpointing: gpt-tiny @ 94 MiB. fp32 mb=6 ckpt=1 (90.9 MiB) measured 46.3 samples/s where the
#   best config without checkpointing, bf16 mb=6 (62.4 MiB), measured 34.7 (+33%; fp32 mb=4, 96.4 MiB,
#   is over). Checkpointing wins here because a small model's CPU step gains much from a larger
#   micro-batch (fp32 mb=2 -> 6: 32.5 -> 55.7 samples/s) and recomputation costs ~20% (46.3 vs 55.7).
#   Replayed on that committed grid at 94 MiB: autofit answered the optimum in 3 of 3 seeds; the
#   per-precision finder sweeps, which never checkpoint, 70-75% of it.
# - device split: a 2-way pipeline and 2 FSDP ranks (gloo processes on this CPU) at 24 MiB, under
#   gpt-tiny's smallest one-device config (bf16 mb=1 ckpt=1, 25.3 MiB; the fp32 states alone are
#   42 MB): bf16 pipeline mb=1 measured 18.6 MiB, fsdp mb=1 19.3, fsdp mb=2 21.6 (pipeline mb=2,
#   24.2, is over). Only budgets where nothing fits on one device: there every fitting config is
#   one job on both devices, so autofit's objective (job samples/s, autofit.core.objective) and the
#   grid's (one trial's samples/s) rank them alike; with room for one device, autofit would count
#   an unsplit config twice (two data-parallel replicas) where the grid counts it once.
# - a workload file: the MLP-Mixer of user_models/mixer.py (RMSprop with momentum), loaded by path as
#   a user would load it. Its budgets from the estimate (which matched the tracker on it): at 16 MiB
#   fp32 fits up to mb=8 with checkpointing, amp-bf16 mb=4 without / mb=16 with, bf16 mb=8 / mb=32;
#   at 24 MiB fp32 mb=16 with checkpointing, amp-bf16 mb=8 / mb=32, bf16 mb=16 / mb=32.
# Every grid's micro-batches go down to 1, so a finder that halves its way down always has a size
# left to try (a grid starting at 4 scored a finder that would have run 3 as finding nothing).
CELLS = (
    Cell("gpt-tiny", 12, (1, 2, 4, 6, 12), _THREE, (64, 94, 128)),
    Cell("convnet-bn", 24, (1, 2, 4, 6, 8, 12, 24), _THREE, (16, 24)),
    Cell("gpt-tiny", 4, (1, 2), _THREE, (24,), checkpoints=(0,),
         device_splits=(1, 2), split_modes=_PIPELINE_AND_FSDP),
    Cell(user_model("mixer.py"), 32, (1, 4, 8, 16, 32), _THREE, (16, 24)),
)
QUICK_CELLS = (
    Cell("gpt-tiny", 12, (1, 4, 12), (Precision.FP32, Precision.AMP_BF16), (64, 128)),
)


def search_budgets(quick: bool = False) -> dict[str, tuple[int, ...]]:
    """Budgets in bytes per workload, as used by the search suite (the accuracy suite reuses them).

    A workload in several cells gets the budgets of all of them."""
    out: dict[str, tuple[int, ...]] = {}
    for c in QUICK_CELLS if quick else CELLS:
        out[c.workload] = tuple(sorted(set(out.get(c.workload, ())) | {b * MiB for b in c.budgets_mib}))
    return out


def problem_for(cell: Cell, budget_bytes: int, param_count: int) -> Problem:
    return Problem(workload=cell.workload, budget_bytes=budget_bytes, global_batch=cell.global_batch,
                   precisions=cell.precisions, micro_batches=cell.micro_batches, checkpoints=cell.checkpoints,
                   param_count=param_count, device_splits=cell.device_splits, split_modes=cell.split_modes)


def measure_grid(cell: Cell, progress: Callable[[str], None] = lambda _m: None) -> Grid:
    """Run every config of ``cell`` (no budget), plus one trial that dies at once (the OOM cost floor)."""
    from autofit.bench.worker import run_jobs
    from autofit.estimate.memory_model import estimate_table, needs_split_ends
    from autofit.profiling.profile import profile_workload
    from autofit.runtime import forkserver
    from autofit.trial.run import run_trial
    from autofit.workloads import param_count
    from autofit.workloads.load import load_workload

    started = time.perf_counter()
    workload = load_workload(cell.workload)
    problem = problem_for(cell, cell.budgets_mib[0] * MiB, param_count(workload))
    configs = problem.configs()
    # autofit's first-use cost on this workload, with cold caches (then the caches are filled for its runs),
    # and no fork server yet (a search process starts one; an earlier cell's would be warm here). Split ends
    # as the search over this space profiles them (autofit.api.run_study): only for a pipeline split.
    split_ends = needs_split_ends(configs)
    forkserver.stop_server()
    cold = time.perf_counter()
    profile_workload(workload, list(cell.precisions), device_type="cpu", use_cache=False, split_ends=split_ends)
    first_use_s = time.perf_counter() - cold
    try:
        from autofit.probes.device_rates import probe_rates

        cold = time.perf_counter()
        probe_rates("cpu", use_cache=False)
        first_use_s += time.perf_counter() - cold
        rates = probe_rates("cpu")
        from autofit.probes.links import split_sizes, with_links

        if split_sizes(configs, max(cell.device_splits)):  # the splits' collectives, timed as a search times them
            cold = time.perf_counter()
            with_links(rates, configs, max(cell.device_splits), use_cache=False)
            first_use_s += time.perf_counter() - cold
            with_links(rates, configs, max(cell.device_splits))
        from autofit.estimate.layer_prior import workload_prior

        cold = time.perf_counter()  # the workload's own layer, timed for the prior (then cached for the runs)
        cold_profile = profile_workload(workload, list(cell.precisions), device_type="cpu", split_ends=split_ends)
        precisions = [p.value for p in cell.precisions]
        workload_prior(workload, cold_profile, rates, precisions, use_cache=False)
        first_use_s += time.perf_counter() - cold
        workload_prior(workload, cold_profile, rates, precisions)
    except ImportError:
        pass
    progress(f"grid {cell.workload}: cold profile and device probe took {first_use_s:.1f} s")
    profile = profile_workload(workload, list(cell.precisions), device_type="cpu", split_ends=split_ends)
    predicted = estimate_table(profile, configs)["peak_bytes"].tolist()
    trials = []
    for i, config in enumerate(configs):
        r = run_trial(cell.workload, config, device="cpu", schedule=SCHEDULE,
                      timeout_s=TRIAL_TIMEOUT_S)
        trials.append(r)
        progress(f"grid {cell.workload} [{i + 1}/{len(configs)}] {config.short()}: {r.status.value} "
                 f"{mib(r.peak_bytes)} MiB, {seconds(r.samples_per_s)} samples/s, {r.wall_s:.1f} s")
    # A second throughput sample per config that fits one of the cell's budgets (over all of them, a
    # config is only ever an OOM, whose cost uses the trial's step time), at another moment: 3
    # untracked steps in one worker; a device split runs its ranks' processes through measure_trial
    # (the trial's own code path), as long as a trial, so this skips most of a split cell's cost.
    largest = max(cell.budgets_mib) * MiB
    sampled = [c for c, r in zip(configs, trials) if r.ok and r.peak_bytes is not None and r.peak_bytes <= largest]
    second = run_jobs([_second_sample_job(cell.workload, c) for c in sampled], job_timeout_s=TRIAL_TIMEOUT_S)
    second_by_config = dict(zip(sampled, second))
    points = {}
    for config, r, pred in zip(configs, trials, predicted):
        other = second_by_config.get(config, {}).get("samples_per_s")
        best = max([x for x in (r.samples_per_s, other) if x], default=None)
        step = config.samples_per_step / best if best else r.step_time_s
        points[config] = GridPoint(config, r.status, r.peak_bytes, best, step, r.wall_s, pred, r.error,
                                   r.samples_per_s, other)
    progress(f"grid {cell.workload}: second throughput sample of {len(second)} configs (those that fit "
             f"{max(cell.budgets_mib)} MiB) done")
    floor = run_trial(cell.workload, configs[0], device="cpu", budget_bytes=1, schedule=SCHEDULE,
                      timeout_s=TRIAL_TIMEOUT_S)
    progress(f"grid {cell.workload}: a trial over its budget at the first operator took {floor.wall_s:.1f} s "
             f"({floor.status.value})")
    return Grid(cell, points, floor.wall_s, problem.param_count, time.perf_counter() - started, first_use_s)


def _second_sample_job(workload: str, config: TrainConfig) -> dict:
    if config.device_split > 1:
        return {"kind": "memory", "workload": workload, "config": config.to_dict(), "time": True,
                "warmup_steps": SCHEDULE.warmup_steps, "measure_steps": 1}
    return {"kind": "throughput", "workload": workload, "config": config.to_dict(), "steps": 3}


# --------------------------------------------------------------------------------------
# Oracles


class ReplayOracle(Oracle):
    """Answers trials from a measured grid; charges each the grid's cost (see the module docstring).

    A strategy sees what a real trial would have shown it, noise included: the first run of a
    config answers the grid trial's own throughput, a second run (a re-measurement) the grid's
    second sample, and further runs take the two in turn (the grid holds two samples per config
    that fits one of its cell's budgets; over all of them a config has its trial's sample only).
    The answer is still scored by the ground truth (the larger of the two). ``first_sample`` 1
    answers the second sample first: the other draw of the noise, to see whether a strategy's
    answer holds under it."""

    def __init__(self, grid: Grid, budget_bytes: int, first_sample: int = 0) -> None:
        super().__init__()
        self.grid = grid
        self.budget_bytes = budget_bytes
        self.first_sample = first_sample
        self.runs: dict[TrainConfig, int] = {}

    def sample(self, point: GridPoint) -> float | None:
        """The throughput this run of ``point`` measures (see the class docstring)."""
        samples = [s for s in (point.trial_samples_per_s, point.second_samples_per_s) if s] or [point.samples_per_s]
        k = self.runs.get(point.config, 0)
        self.runs[point.config] = k + 1
        return samples[(k + self.first_sample) % len(samples)]

    def _run(self, config: TrainConfig) -> Outcome:
        point = self.grid.points.get(config)
        if point is None:
            raise KeyError(f"{config.short()} is not in the measured grid")
        if point.status is not TrialStatus.OK:
            return Outcome(config, point.status, None, None, point.wall_s)
        if point.peak_bytes > self.budget_bytes:
            return Outcome(config, TrialStatus.OOM, None, None, self.grid.oom_floor_s + (point.step_time_s or 0.0))
        sample = self.sample(point)
        step = config.samples_per_step / sample if sample else point.step_time_s
        return Outcome(config, TrialStatus.OK, sample, point.peak_bytes, point.wall_s, step)


class LiveOracle(Oracle):
    """Runs each trial for real with :func:`autofit.trial.run.run_trial`, the budget enforced."""

    def __init__(self, workload: str, budget_bytes: int, progress: Callable[[str], None] = lambda _m: None,
                 label: str = "") -> None:
        super().__init__()
        self.workload = workload
        self.budget_bytes = budget_bytes
        self.progress = progress
        self.label = label

    def _run(self, config: TrainConfig) -> Outcome:
        from autofit.trial.run import run_trial

        r = run_trial(self.workload, config, device="cpu", budget_bytes=self.budget_bytes, schedule=SCHEDULE,
                      timeout_s=TRIAL_TIMEOUT_S)
        self.progress(f"live {self.label}: {config.short()} {r.status.value} {seconds(r.samples_per_s)} samples/s "
                      f"({r.wall_s:.1f} s)")
        return Outcome(config, r.status, r.samples_per_s, r.peak_bytes, r.wall_s, r.step_time_s, r)


def score(strategy: Strategy, grid: Grid, budget_bytes: int, seed: int, mode: str, oracle: Oracle,
          answer: TrainConfig | None, error: str | None = None) -> RunResult:
    records = oracle.history
    reached = None
    for record, config in zip(records, incumbent(records, strategy.criterion)):
        if config is not None and grid.fraction(config, budget_bytes) >= TARGET_FRACTION:
            reached = record.clock_s
            break
    live_tput = None
    if mode == "live" and answer is not None:
        live_tput = next((r.outcome.samples_per_s for r in records if r.outcome.config == answer), None)
    return RunResult(
        strategy=strategy.name, workload=grid.cell.workload, budget_bytes=budget_bytes, seed=seed, mode=mode,
        answer=answer, fraction=grid.fraction(answer, budget_bytes), wall_s=oracle.clock_s, trials=len(records),
        oom_trials=sum(r.outcome.status is TrialStatus.OOM for r in records),
        failed_trials=sum(r.outcome.status in (TrialStatus.ERROR, TrialStatus.TIMEOUT) for r in records),
        time_to_target_s=reached, error=error, live_samples_per_s=live_tput, history=list(records),
        notes=list(oracle.notes), extra_s=oracle.extra_s,
    )


def run_strategy(strategy: Strategy, grid: Grid, budget_bytes: int, seed: int, oracle: Oracle, mode: str) -> RunResult:
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


class NotAvailable(Exception):
    """A strategy that cannot run in this checkout (e.g. autofit's search before it lands)."""


# --------------------------------------------------------------------------------------
# autofit's own search, as shipped


def autofit_search(problem: Problem, oracle: Oracle, seed: int = 0, first_use_s: float = 0.0) -> TrainConfig | None:
    """autofit's search (:func:`autofit.study.search`, defaults as shipped) over the problem's grid.

    Its trials go through ``oracle`` (passed to the search as its ``trial_runner``), so a live
    oracle runs them for real and a replay oracle answers from the grid; everything else --
    estimate, time model, calibration, Optuna storage, reports -- runs for real and is timed.
    ``first_use_s`` is charged to the clock: profiling the workload on fake tensors and probing
    the device with cold caches, measured once per workload (the runs themselves find both cached).
    """
    import tempfile

    from autofit.api.run_study import search
    from autofit.core.space import SearchSpace
    from autofit.trial.run import TrialResult

    def run_trial(workload, config, *, device, budget_bytes, timeout_s):
        outcome = oracle.run(config)
        if outcome.result is not None:
            return outcome.result
        return TrialResult(workload=problem.workload, config=config, device=device, status=outcome.status,
                           peak_bytes=outcome.peak_bytes,
                           per_device_peak_bytes=[outcome.peak_bytes] if outcome.peak_bytes else [],
                           samples_per_s=outcome.samples_per_s, step_time_s=outcome.step_time_s if outcome.ok else None,
                           wall_s=outcome.cost_s, budget_bytes=budget_bytes,
                           error=None if outcome.ok else f"{outcome.status} (replayed from the measured grid)")

    if first_use_s:
        oracle.charge(first_use_s, "cold profile and device probe")
    space = SearchSpace(precision=problem.precisions, micro_batch=problem.micro_batches,
                        checkpoint_every=problem.checkpoints, device_split=problem.device_splits,
                        split_mode=problem.split_modes, global_batch=problem.global_batch)
    with tempfile.TemporaryDirectory(prefix="autofit-bench-study-") as out:
        # devices: the grid's largest split (its stages or ranks are processes sharing this CPU)
        result = search(problem.workload, problem.budget_bytes, space=space, out_dir=out, device="cpu", seed=seed,
                        devices=max(problem.device_splits), trial_runner=run_trial)
    stop = getattr(result, "stop_reason", None)
    if stop:
        oracle.notes.append(f"stopped: {stop}")
    return result.best


AUTOFIT = Strategy(AUTOFIT_NAME, autofit_search, "throughput", False,
                   "autofit's search as shipped: estimate prunes, time model orders, real trials confirm")
STRATEGIES: tuple[Strategy, ...] = (AUTOFIT,) + PEERS


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
    result = run_strategy(strategy, grid, budget, 0, LiveOracle(grid.cell.workload, budget, progress, label), "live")
    progress(f"live {label}: answer {result.answer.short() if result.answer else None}, "
             f"{pct(result.fraction)} of optimum, {seconds(result.wall_s)} s"
             + (f" ({result.error})" if result.error else ""))
    return result


def run_search_suite(out_dir: Path, env: dict, *, quick: bool = False, seeds: int | None = None,
                     cells: tuple[Cell, ...] | None = None, strategies: tuple[Strategy, ...] = STRATEGIES,
                     live: bool | tuple[str, ...] = True, tpe_trials: int | None = None,
                     progress: Callable[[str], None] = lambda _m: None) -> SearchResults:
    """Measure the grids, run every strategy (live once, replayed per cell and seed), write the tables.

    ``live``: True runs :data:`LIVE` (:data:`QUICK_LIVE` with ``quick``) live once each (seed 0)
    on the first cell's first budget, and those of them in :data:`LIVE_EVERY_CELL` on every other
    cell too; a tuple of names runs only those; False none. ``tpe_trials``: Optuna TPE's
    real-trial budget (default 12; 6 with ``quick``).
    """
    started = time.perf_counter()
    cells = cells or (QUICK_CELLS if quick else CELLS)
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
                    runs.append(run_strategy(strategy, grid, budget, seed, ReplayOracle(grid, budget), "replay"))
    results = SearchResults(grids, runs, live_cell, seeds, time.perf_counter() - started, strategies=strategies)
    results.files = write_search(out_dir, env, results, strategies)
    return results

"""Measuring a cell's grid: every config run for real with the study's own trial runner and no
budget, a second throughput sample of each config that fits, and the cost of a trial that dies at
once (the OOM cost floor). See :mod:`autofit.bench.search` for how the grid is used."""

from __future__ import annotations

import time
from collections.abc import Callable

from autofit.bench.common import mib, seconds
from autofit.bench.search_cells import problem_for
from autofit.bench.search_data import Cell, Grid, GridPoint, MiB
from autofit.core.config import TrainConfig
from autofit.runtime.schedule import DEFAULT_SCHEDULE

# Trial settings shared by the grid, the live runs and (through the grid) the replays.
SCHEDULE = DEFAULT_SCHEDULE  # the steps of a study's trial (autofit.runtime.schedule), so grid and search measure alike
TRIAL_TIMEOUT_S = 240.0


def measure_grid(cell: Cell, progress: Callable[[str], None] = lambda _m: None) -> Grid:
    """Run every config of ``cell`` (no budget), plus one trial that dies at once (the OOM cost floor)."""
    from autofit.bench.worker import run_jobs
    from autofit.estimator.memory_model import (
        estimate_table,
        needs_split_ends,
        optimizer_choices,
    )
    from autofit.profiling.profile import profile_workload
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
    # and the replacement optimizers' states, as a search over a lean space profiles them
    optimizers = optimizer_choices(configs)
    first_use_s = _first_use_s(cell, workload, configs, split_ends, optimizers)
    progress(f"grid {cell.workload}: cold profile and device probe took {first_use_s:.1f} s")
    profile = profile_workload(workload, list(cell.precisions), device_type="cpu", split_ends=split_ends,
                               optimizers=optimizers)
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


def _first_use_s(cell: Cell, workload, configs: list[TrainConfig], split_ends, optimizers: list[str]) -> float:
    """Seconds autofit's first use of ``workload`` takes with cold caches: profiling on fake tensors, the
    device probe, the splits' collectives and the workload's own layer (each then cached for the runs)."""
    from autofit.runtime.devicelock import DeviceLock

    # Held for the whole measurement (the probes take it again without waiting): its clocks start after any
    # wait for another process's trial, which is no part of autofit's first use.
    with DeviceLock(["cpu"], "first-use measurement"):
        return _first_use_locked_s(cell, workload, configs, split_ends, optimizers)


def _first_use_locked_s(cell: Cell, workload, configs: list[TrainConfig], split_ends, optimizers: list[str]) -> float:
    from autofit.profiling.profile import profile_workload
    from autofit.runtime import forkserver

    forkserver.stop_server()
    cold = time.perf_counter()
    profile_workload(workload, list(cell.precisions), device_type="cpu", use_cache=False, split_ends=split_ends,
                     optimizers=optimizers)
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
        from autofit.estimator.layer_prior import workload_prior

        cold = time.perf_counter()  # the workload's own layer, timed for the prior (then cached for the runs)
        cold_profile = profile_workload(workload, list(cell.precisions), device_type="cpu", split_ends=split_ends,
                                        optimizers=optimizers)
        precisions = [p.value for p in cell.precisions]
        workload_prior(workload, cold_profile, rates, precisions, use_cache=False)
        first_use_s += time.perf_counter() - cold
        workload_prior(workload, cold_profile, rates, precisions)
    except ImportError:
        pass
    return first_use_s


def _second_sample_job(workload: str, config: TrainConfig) -> dict:
    if config.device_split > 1:
        return {"kind": "memory", "workload": workload, "config": config.to_dict(), "time": True,
                "warmup_steps": SCHEDULE.warmup_steps, "measure_steps": 1}
    return {"kind": "throughput", "workload": workload, "config": config.to_dict(), "steps": 3}

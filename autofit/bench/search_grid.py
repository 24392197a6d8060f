"""Measuring a cell's grid: every config run for real with the study's own trial runner and no
budget, more throughput samples of each config that fits (for a ground truth with little noise of
its own), and the cost of a trial that dies at once (the OOM cost floor). See :mod:`autofit.bench.search` for how the grid is used."""

from __future__ import annotations

import time
from collections.abc import Callable

from autofit.bench.common import mib, seconds
from autofit.bench.search_cells import problem_for
from autofit.bench.search_data import Cell, Grid, GridPoint, MiB, top_two_gap
from autofit.core.config import TrainConfig
from autofit.runtime.schedule import DEFAULT_SCHEDULE

# Trial settings shared by the grid, the live runs and (through the grid) the replays.
SCHEDULE = DEFAULT_SCHEDULE  # the steps of a study's trial (autofit.runtime.schedule), so grid and search measure alike
TRIAL_TIMEOUT_S = 240.0
# The ground truth of a config that fits is the best of its throughput samples; taken until its two
# best agree within TRUTH_GAP (at least TRUTH_SAMPLES_MIN, at most TRUTH_SAMPLES_MAX, the trial's
# own included), so the truth's own noise stays under the 3% the verdicts need (search.md reports it).
TRUTH_SAMPLES_MIN = 3
TRUTH_SAMPLES_MAX = 6
TRUTH_GAP = 0.02


def measure_grid(cell: Cell, progress: Callable[[str], None] = lambda _m: None,
                 samples_until: float | None = None) -> Grid:
    """Run every config of ``cell`` (no budget), plus one trial that dies at once (the OOM cost floor).

    ``samples_until``: a ``time.monotonic()`` after which no further round of truth samples starts (a
    short loan of a GPU); the grid's heading reports how many samples each config got."""
    from autofit.estimator.memory_model import (
        estimate_table,
        needs_selective,
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
    # and no fork server yet (a search process starts one; an earlier cell's would be warm here). Profiled
    # as the search over this space profiles it (autofit.api.run_study): split ends only for a pipeline
    # split, the selective forwards only for the selective policy, the replacement optimizers' states
    # where a lean space asks for them.
    profile_kw = {"split_ends": needs_split_ends(configs), "optimizers": optimizer_choices(configs),
                  "selective": needs_selective(configs)}
    first_use_s, warm, first_use_parts = _first_use_s(cell, workload, configs, profile_kw)
    warm_use_s = warm.get("use_s")
    progress(f"grid {cell.workload}: cold profile and device probe took {first_use_s:.1f} s "
             f"({seconds(warm_use_s)} s read back from the caches in a new process)")
    profile = profile_workload(workload, list(cell.precisions), device_type=_device_type(cell), **profile_kw)
    predicted = estimate_table(profile, configs)["peak_bytes"].tolist()
    trials = []
    for i, config in enumerate(configs):
        r = run_trial(cell.workload, config, device=cell.device, schedule=SCHEDULE,
                      timeout_s=TRIAL_TIMEOUT_S)
        trials.append(r)
        progress(f"grid {cell.workload} [{i + 1}/{len(configs)}] {config.short()}: {r.status.value} "
                 f"{mib(r.judged_peak_bytes)} MiB, {seconds(r.samples_per_s)} samples/s, {r.wall_s:.1f} s")
    # More throughput samples of each config that fits one of the cell's budgets (over all of them, a
    # config is only ever an OOM, whose cost uses the trial's step time), for a ground truth whose own
    # noise is small (:func:`_truth_samples`).
    largest = max(cell.budgets_mib) * MiB
    sampled = [c for c, r in zip(configs, trials)
               if r.ok and r.judged_peak_bytes is not None and r.judged_peak_bytes <= largest]
    first = {c: r.samples_per_s for c, r in zip(configs, trials)}
    extra = _truth_samples(cell.workload, sampled, first, progress, cell.device, samples_until)
    points = {}
    for config, r, pred in zip(configs, trials, predicted):
        more = extra.get(config, [])
        best = max([x for x in (r.samples_per_s, *more) if x], default=None)
        step = config.samples_per_step / best if best else r.step_time_s
        points[config] = GridPoint(config, r.status, r.judged_peak_bytes, best, step, r.wall_s, pred, r.error,
                                   r.samples_per_s, more[0] if more else None, tuple(more[1:]), r.tracked_s)
    floor = run_trial(cell.workload, configs[0], device=cell.device, budget_bytes=1, schedule=SCHEDULE,
                      timeout_s=TRIAL_TIMEOUT_S)
    progress(f"grid {cell.workload}: a trial over its budget at the first operator took {floor.wall_s:.1f} s "
             f"({floor.status.value})")
    return Grid(cell, points, floor.wall_s, problem.param_count, time.perf_counter() - started, first_use_s, warm_use_s,
                first_use_parts, warm.get("server_ready_s"))


def _first_use_s(cell: Cell, workload, configs: list[TrainConfig], profile_kw: dict) -> tuple[float, dict, dict]:
    """Seconds autofit's first use of ``workload`` takes with cold caches (profiling on fake tensors, the
    device probe, the splits' collectives and the workload's own layer), the cold one's parts, and what a
    new process pays with those caches warm, as a user's next search reads them (:func:`_warm_use`)."""
    from autofit.runtime import forkserver
    from autofit.runtime.devicelock import DeviceLock

    # Held for the cold measurement (the probes take it again without waiting): its clocks start after any
    # wait for another process's trial, which is no part of autofit's first use.
    with DeviceLock([cell.device], "first-use measurement"):
        forkserver.stop_server()
        cold = _use_s(cell, workload, configs, profile_kw, use_cache=False)
        _use_s(cell, workload, configs, profile_kw, use_cache=True)  # untimed: fills the caches for the runs
    return sum(cold.values()), _warm_use(cell, configs, profile_kw), cold


def _warm_use(cell: Cell, configs: list[TrainConfig], profile_kw: dict) -> dict:
    """A new interpreter's first use of the cell's workload with the caches warm (:func:`warm_use_child`):
    ``{"use_s", "server_ready_s"}``, or ``{}`` when the child failed. Read back in the process that profiled,
    the same first use takes a twentieth of the time: torch imports ``torch._dynamo`` (about a second
    here) the first time a process builds an optimizer or a fake tensor mode, which a new search pays."""
    from autofit.runtime import procs

    request = {"workload": cell.workload, "precisions": [p.value for p in cell.precisions], "device": cell.device,
               "device_splits": list(cell.device_splits), "configs": [c.to_dict() for c in configs],
               "profile_kw": profile_kw}  # the optimizer lever's choices by name (optimizer_choices)
    child = procs.spawn("autofit.bench.search_grid:warm_use_child", request, timeout_s=300, env=procs.child_env())
    try:
        child.wait()
    finally:
        child.kill()
    out = child.last_message() or {}
    return {k: out[k] for k in ("use_s", "server_ready_s") if k in out}


def warm_use_child(request: dict, send=None) -> dict:
    """In a new interpreter, as ``autofit search`` starts with warm caches: its trials' fork server started
    (on the CPU), then what it does before planning (:func:`_use_s`, ``use_s``), then the wait until that
    server could fork its first trial (``server_ready_s``, from the same start; None off the CPU)."""
    from autofit.core.config import Precision
    from autofit.runtime import forkserver
    from autofit.workloads.load import load_workload

    # only what _use_s reads of a cell: its workload, precisions, device and splits
    cell = Cell(request["workload"], 1, (1,), tuple(Precision(p) for p in request["precisions"]), (1,),
                device_splits=tuple(request["device_splits"]), device=request["device"])
    configs = [TrainConfig.from_dict(c) for c in request["configs"]]
    profile_kw = request["profile_kw"]
    workload = load_workload(cell.workload)
    on_cpu = cell.device == "cpu" and forkserver.enabled()
    started = time.perf_counter()
    if on_cpu:
        forkserver.start_server_soon()  # as a CPU search does first (autofit.api.run_study)
    use_s = sum(_use_s(cell, workload, configs, profile_kw, use_cache=True).values())
    if on_cpu:
        forkserver.ensure_server()
    return {"use_s": use_s, "server_ready_s": time.perf_counter() - started if on_cpu else None}


def _use_s(cell: Cell, workload, configs: list[TrainConfig], profile_kw: dict, use_cache: bool) -> dict[str, float]:
    """Seconds of each part of what a search does before planning, in this process, with or without the caches."""
    from autofit.api.run_study import probe_beside_profiling
    from autofit.estimator.layer_prior import workload_prior
    from autofit.probes.device_rates import probe_rates
    from autofit.probes.links import split_sizes, with_links
    from autofit.profiling.profile import profile_workload

    parts, started = {}, time.perf_counter()
    # as a search does it: on a GPU the probe's child runs while this process profiles, and only what is
    # left of it after the profiling counts as the probe's part
    early = probe_beside_profiling(_device_type(cell), cell.precisions, use_cache=use_cache)
    profile = profile_workload(workload, list(cell.precisions), device_type=_device_type(cell), use_cache=use_cache,
                               **profile_kw)
    parts["profiling"], started = time.perf_counter() - started, time.perf_counter()
    rates = early.result() if early is not None else probe_rates(cell.device, use_cache=use_cache,
                                                                 precisions=cell.precisions)
    if split_sizes(configs, max(cell.device_splits)):  # the splits' collectives, timed as a search times them
        rates = with_links(rates, configs, max(cell.device_splits), use_cache=use_cache)
    parts["device probe"], started = time.perf_counter() - started, time.perf_counter()
    workload_prior(workload, profile, rates, [p.value for p in cell.precisions], use_cache=use_cache)
    parts["layer timing"] = time.perf_counter() - started
    return parts


def _device_type(cell: Cell) -> str:
    return cell.device.split(":")[0]


def _truth_samples(workload: str, configs: list[TrainConfig], first: dict[TrainConfig, float | None],
                   progress: Callable[[str], None], device: str = "cpu",
                   until: float | None = None) -> dict[TrainConfig, list[float]]:
    """Throughput samples of each config beyond its trial's (``first``), taken in rounds (one sample of
    each config still short of them per round, so one config's samples are a whole round apart and a
    burst of load elsewhere spoils few of them): every config gets TRUTH_SAMPLES_MIN in all; one whose two
    best samples still differ by more than TRUTH_GAP gets more, up to TRUTH_SAMPLES_MAX. A sample that
    fails ends its config's sampling."""
    extra: dict[TrainConfig, list[float]] = {c: [] for c in configs}
    done: set[TrainConfig] = set()

    def short(c: TrainConfig) -> bool:
        have = [x for x in (first.get(c), *extra[c]) if x]
        if c in done or len(have) >= TRUTH_SAMPLES_MAX:
            return False
        return len(have) < TRUTH_SAMPLES_MIN or top_two_gap(have) > TRUTH_GAP

    for round_no in range(2, TRUTH_SAMPLES_MAX + 1):
        todo = [c for c in configs if short(c)]
        if not todo:
            break
        if until is not None and time.monotonic() > until:
            progress(f"grid {workload}: throughput samples stopped at round {round_no - 1} (time box)")
            break
        for c, out in zip(todo, _sample_round(workload, todo, device)):
            if out.get("samples_per_s"):
                extra[c].append(out["samples_per_s"])
            else:
                done.add(c)
        progress(f"grid {workload}: throughput sample {round_no} of {len(todo)} configs done")
    return extra


def _sample_round(workload: str, configs: list[TrainConfig], device: str) -> list[dict]:
    """One more throughput sample of each config: on the CPU by the bench's worker (a warm process, its
    threads pinned as a trial's); elsewhere by another trial of the config (on CUDA in the trial host, a
    process kept warm between trials)."""
    if device == "cpu":
        from autofit.bench.worker import run_jobs

        return run_jobs([_second_sample_job(workload, c) for c in configs], job_timeout_s=TRIAL_TIMEOUT_S)
    from autofit.trial.run import run_trial

    return [{"samples_per_s": run_trial(workload, c, device=device, schedule=SCHEDULE,
                                        timeout_s=TRIAL_TIMEOUT_S).samples_per_s} for c in configs]


def _second_sample_job(workload: str, config: TrainConfig) -> dict:
    if config.device_split > 1:
        return {"kind": "memory", "workload": workload, "config": config.to_dict(), "time": True,
                "warmup_steps": SCHEDULE.warmup_steps, "measure_steps": 1}
    return {"kind": "throughput", "workload": workload, "config": config.to_dict(), "steps": 3}

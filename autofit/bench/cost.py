"""The cost suite: what autofit's machinery costs on this machine.

- the estimator: configs scored per second by :func:`autofit.estimator.memory_model.estimate_table`
  (100,000 configs of one profile);
- the profiler: time to profile each built-in workload on fake tensors with a cold cache
  (``use_cache=False``), the 7B preset included;
- the trial runner: a trial's wall time split into process start and model build (a trial that
  goes over its budget at the first operator) against the measured steps, with a fresh
  interpreter per trial and forked from the fork server (:mod:`autofit.runtime.forkserver`);
- the memory tracker: the same training steps with and without it;
- sizing: ``autofit size``'s default grid of shapes times the default space, from the estimate alone.
"""

from __future__ import annotations

import importlib.util
import itertools
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from autofit.bench.common import Report, markdown_table, seconds, write_csv
from autofit.core.config import Precision, TrainConfig
from autofit.core.records import TrialStatus

N_SCORED = 100_000


@dataclass
class CostResults:
    rows: list[dict]
    wall_s: float
    files: list[Path] = field(default_factory=list)

    def value(self, kind: str, item: str, metric: str) -> float | None:
        return next((r["value"] for r in self.rows if (r["kind"], r["item"], r["metric"]) == (kind, item, metric)), None)


def scoring_configs(n: int = N_SCORED, n_layers: int = 4) -> list[TrainConfig]:
    """``n`` distinct configs: 4 precisions x micro-batches x accumulation x checkpointing x splits."""
    splits = [s for s in (1, 2, 3, 4) if s <= n_layers]
    grid = itertools.product(Precision, range(1, 51), range(1, 26), range(5), splits)
    return [TrainConfig(p, mb, ga, ck, ds) for p, mb, ga, ck, ds in itertools.islice(grid, n)]


def _estimator_rate(progress) -> list[dict]:
    from autofit.estimator.memory_model import estimate_table
    from autofit.profiling.profile import profile_workload
    from autofit.workloads.load import load_workload

    profile = profile_workload(load_workload("gpt-tiny"), list(Precision), device_type="cpu")
    configs = scoring_configs(N_SCORED, profile.n_layers)
    times = []
    for _ in range(3):  # the first run fills the per-(precision, checkpoint, split) cache; later ones reuse it
        start = time.perf_counter()
        table = estimate_table(profile, configs, budget_bytes=2**30)
        times.append(time.perf_counter() - start)
    best = min(times)
    progress(f"cost: estimate_table scored {len(table):,} configs in {best:.2f} s")
    return [{"kind": "estimator", "item": f"estimate_table, gpt-tiny profile, {len(configs):,} configs",
             "metric": "configs_per_s", "value": len(configs) / best, "unit": "configs/s",
             "note": f"best of 3 runs ({', '.join(f'{t:.2f}' for t in times)} s); 80 (precision, checkpoint, split) "
                     "groups"},
            {"kind": "estimator", "item": f"estimate_table, gpt-tiny profile, {len(configs):,} configs, first call",
             "metric": "configs_per_s", "value": len(configs) / times[0], "unit": "configs/s",
             "note": "per-stage lines not cached yet"}]


def _default_space_scoring(quick: bool, progress) -> list[dict]:
    """Scoring each built-in's whole default space (search_spaces/default.toml) from its profile.

    The profile comes from the cache when there is one (its cost is the profiling rows'); the
    time is the first ``estimate_table`` call, before its per-structure cache is warm.
    """
    from autofit.core.space import load_space
    from autofit.estimator.memory_model import clear_caches, estimate_table
    from autofit.profiling.profile import profile_workload
    from autofit.workloads import BUILTINS
    from autofit.workloads.load import load_workload

    space = load_space()
    configs = space.configs()
    rows = []
    # --quick: gpt-tiny only (its profile is cached by the accuracy suite; llama-7b's four
    # precisions would cost half a minute of profiling with a cold cache)
    for name in (("gpt-tiny",) if quick else tuple(BUILTINS)):
        profile = profile_workload(load_workload(name), list(space.precision), device_type="cpu")
        clear_caches()
        start = time.perf_counter()
        estimate_table(profile, configs, budget_bytes=8 * 10**9)
        wall = time.perf_counter() - start
        progress(f"cost: scored the default space of {name} in {wall:.3f} s")
        rows.append({"kind": "estimator", "item": f"default space ({len(configs)} configs), {name}",
                     "metric": "score_s", "value": wall, "unit": "s", "note": "first call, cold per-structure cache"})
    return rows


def _size_scoring(quick: bool, progress) -> list[dict]:
    """``autofit size``'s default grid (13 depths x 14 widths) times the default space, from the estimate alone."""
    from autofit.sizing.size import size

    family = "gpt-tiny" if quick else "gpt2"
    result = size(family, "8GB", device="cpu")
    t = result.timing
    progress(f"cost: autofit size {family} 8GB: {t['shapes']} shapes x {t['configs_per_shape']} configs in "
             f"{t['total_s']:.1f} s ({t['score_s']:.1f} s scoring)")
    item = f"autofit size --family {family} --budget 8GB: {t['shapes']} shapes x {t['configs_per_shape']} configs"
    note = (f"{t['profiled']} one-layer profiles (from the cache when warm), {t['interpolated']} widths "
            "interpolated; answer " + (result.top["spec"] if result.top else "none"))
    return [{"kind": "size", "item": item, "metric": "total_s", "value": t["total_s"], "unit": "s", "note": note},
            {"kind": "size", "item": item, "metric": "profile_s", "value": t["profile_s"], "unit": "s", "note": ""},
            {"kind": "size", "item": item, "metric": "score_s", "value": t["score_s"], "unit": "s",
             "note": f"{t['configs_scored']:,} configs: estimate_table + predict_table per shape"}]


def _profile_times(quick: bool, progress) -> list[dict]:
    from autofit.profiling.profile import profile_workload
    from autofit.runtime import forkserver
    from autofit.workloads import BUILTINS
    from autofit.workloads.load import load_workload

    plan: list[tuple[str, tuple[Precision, ...]]]
    if quick:
        plan = [("gpt-tiny", (Precision.FP32,)), ("llama-7b", (Precision.FP32,))]
    else:
        plan = [(name, (Precision.FP32,)) for name in BUILTINS]
        plan += [("gpt-tiny", tuple(Precision)), ("llama-7b", tuple(Precision))]
    rows = []
    for name, precisions in plan:
        workload = load_workload(name)
        label = "fp32" if len(precisions) == 1 else f"all {len(precisions)} precisions (parallel forked workers)"
        forkserver.stop_server()  # cold as in a new search process: the fork server its workers fork from starts too
        start = time.perf_counter()
        try:
            profile = profile_workload(workload, precisions, device_type="cpu", use_cache=False)
        except Exception as exc:  # noqa: BLE001 -- one failing profile is a row, not the end of the suite
            rows.append({"kind": "profile", "item": f"{name}, {label}", "metric": "profile_s", "value": None,
                         "unit": "s", "note": f"failed: {type(exc).__name__}: {exc}"[:300]})
            progress(f"cost: profiling {name} failed: {exc}")
            continue
        wall = time.perf_counter() - start
        progress(f"cost: profiled {name} ({label}) in {wall:.1f} s")
        rows.append({"kind": "profile", "item": f"{name} ({profile.param_count / 1e6:,.1f}M params, "
                                                f"{profile.n_layers} layers), {label}",
                     "metric": "profile_s", "value": wall, "unit": "s",
                     "note": "cold cache (use_cache=False) and fork server (its start included)"})
    return rows


def _trial_overhead(quick: bool, progress) -> list[dict]:
    """A trial's fixed cost (start and build: a trial that dies at its first operator) against the whole
    trial, with each trial in a fresh interpreter (``AUTOFIT_TRIAL_SERVER=0``, as before the fork
    server) and forked from the fork server (as shipped), in the same run."""
    import os

    from autofit.runtime import forkserver
    from autofit.runtime.schedule import DEFAULT_SCHEDULE as schedule
    from autofit.trial.run import run_trial
    from autofit.workloads.load import load_workload

    rows = []
    start = time.perf_counter()
    imports_code = ("import autofit.trial.run, autofit.trial.measure, autofit.workloads; "
                    "from torch.distributed._tools import mem_tracker")
    subprocess.run([sys.executable, "-c", imports_code], check=False)
    imports = time.perf_counter() - start
    rows.append({"kind": "trial", "item": "interpreter start + imports (torch, autofit, mem_tracker)",
                 "metric": "wall_s", "value": imports, "unit": "s", "note": ""})
    forkserver.stop_server()
    start = time.perf_counter()
    forkserver.ensure_server()
    rows.append({"kind": "trial", "item": "fork server start (its imports; once per search process)",
                 "metric": "wall_s", "value": time.perf_counter() - start, "unit": "s",
                 "note": "autofit.runtime.forkserver: a child that imports torch and autofit once, then forks each CPU trial"})
    cases = [("gpt-tiny", TrainConfig(Precision.AMP_BF16, 4, 3))]
    if not quick:
        cases.append(("convnet-bn", TrainConfig(Precision.FP32, 8, 3)))
        if importlib.util.find_spec("transformers") is not None:  # the hf extra
            cases.append((HF_CASE, TrainConfig(Precision.BF16, 4, 3)))
    previous = os.environ.get("AUTOFIT_TRIAL_SERVER")
    try:
        for name, config in cases:
            preload = load_workload(name).preload
            for runner, flag in _runners(preload):
                os.environ["AUTOFIT_TRIAL_SERVER"] = flag
                _zygote_for(preload, runner)
                rows += _one_trial_overhead(name, config, runner, schedule, run_trial, progress)
            rows += _hosted_trial_overhead(name, config, schedule, run_trial, progress)
    finally:
        forkserver.use_preload(())  # later suites' zygotes import no workload's modules
        forkserver.stop_server()
        if previous is None:
            os.environ.pop("AUTOFIT_TRIAL_SERVER", None)
        else:
            os.environ["AUTOFIT_TRIAL_SERVER"] = previous
    return rows


# A Hugging Face model (the hf extra), whose trials import transformers unless the fork server has.
HF_CASE = "hf:gpt2?n_layer=2&n_embd=64&n_head=2#seq_len=64#task=causal-lm"
_LABELS = {HF_CASE: "hf:gpt2 (2 layers of width 64, 64 tokens)"}
_UNLOADED = "fork server, without the workload's preload"


def _runners(preload: tuple[str, ...]) -> list[tuple[str, str]]:
    """(runner, AUTOFIT_TRIAL_SERVER) for a case: a workload with modules to preload (``Workload.preload``)
    is also forked from a zygote that lacks them, as every search's was before it preloaded them."""
    unloaded = [(_UNLOADED, "1")] if preload else []
    return [("fresh interpreter", "0"), *unloaded, ("fork server", "1")]


def _zygote_for(preload: tuple[str, ...], runner: str) -> None:
    """A zygote as a search starts it (the workload's ``preload`` imported), or one without them."""
    from autofit.runtime import forkserver

    if runner in ("fork server", _UNLOADED):
        forkserver.use_preload(preload if runner == "fork server" else ())
        forkserver.stop_server()
        forkserver.ensure_server()


def _hosted_trial_overhead(name: str, config: TrainConfig, schedule, run_trial, progress) -> list[dict]:
    """The same figures for a trial in a trial host (autofit.trial.host, CUDA's default) after its first
    trial: what every trial of a CUDA search but the first (and those after a failure) costs."""
    import os

    from autofit.trial import host

    host.release()
    previous = os.environ.get("AUTOFIT_TRIAL_HOST")
    os.environ["AUTOFIT_TRIAL_HOST"] = "1"
    try:
        first = run_trial(name, config, schedule=schedule, timeout_s=240)  # starts the host
        rows = _one_trial_overhead(name, config, "trial host, after its first trial", schedule, run_trial, progress,
                                   floor_last=True)
    finally:
        host.release()
        if previous is None:
            os.environ.pop("AUTOFIT_TRIAL_HOST", None)
        else:
            os.environ["AUTOFIT_TRIAL_HOST"] = previous
    rows[0]["note"] += f" (the host's first trial, its start included: {first.wall_s:.2f} s)"
    return rows


def _one_trial_overhead(name: str, config: TrainConfig, runner: str, schedule, run_trial, progress,
                        floor_last: bool = False) -> list[dict]:
    """``floor_last``: the over-budget trial after the full one (in a host it ends the host)."""
    if not floor_last:
        floor = run_trial(name, config, budget_bytes=1, schedule=schedule, timeout_s=240)
    full = run_trial(name, config, schedule=schedule, timeout_s=240)
    if floor_last:
        floor = run_trial(name, config, budget_bytes=1, schedule=schedule, timeout_s=240)
    timed = schedule.timed_steps * (full.step_time_s or 0.0)   # the untracked optimizer steps
    label = _LABELS.get(name, name)
    progress(f"cost: trial {label} {config.short()} ({runner}): {full.wall_s:.1f} s in all, {floor.wall_s:.1f} s to "
             f"die at the first operator, {timed:.2f} s of timed steps")
    item = f"{label} `{config.short()}`, {runner}"
    return [
        {"kind": "trial", "item": item, "metric": "trial_wall_s", "value": full.wall_s, "unit": "s",
         "note": f"run_trial: {schedule.warmup_steps} warm-up + {schedule.measured_steps} tracked step, "
                 f"then {schedule.timed_steps} timed steps"},
        {"kind": "trial", "item": item, "metric": "start_and_build_s", "value": floor.wall_s, "unit": "s",
         "note": f"the same trial with a 1-byte budget (status {floor.status.value}): "
                 + {"fresh interpreter": "process start, imports, ", "fork server": "process start (a fork), ",
                    _UNLOADED: "process start (a fork), the workload's imports, "}.get(runner, "")
                 + "model and optimizer build, batches"},
        {"kind": "trial", "item": item, "metric": "timed_steps_s", "value": timed, "unit": "s",
         "note": f"3 x measured step time {full.step_time_s:.3f} s" if full.step_time_s else full.error or ""},
        {"kind": "trial", "item": item, "metric": "overhead_fraction",
         "value": floor.wall_s / full.wall_s if full.wall_s else None, "unit": "fraction",
         "note": "start and build over the whole trial"},
    ]


def _tracker_slowdown(quick: bool, progress) -> list[dict]:
    from autofit.bench.worker import run_jobs

    cases = [("gpt-tiny", TrainConfig(Precision.FP32, 8))]
    if not quick:
        cases += [("gpt-tiny", TrainConfig(Precision.AMP_BF16, 8, 1, 1)), ("convnet-bn", TrainConfig(Precision.FP32, 32)),
                  ("lstm-lm", TrainConfig(Precision.FP32, 16))]
    jobs = [{"kind": "tracker_overhead", "workload": w, "config": c.to_dict(), "steps": 3 if quick else 5}
            for w, c in cases]
    rows = []
    for (name, config), out in zip(cases, run_jobs(jobs, job_timeout_s=300)):
        item = f"{name} `{config.short()}`"
        if out.get("status") != TrialStatus.OK:
            rows.append({"kind": "tracker", "item": item, "metric": "slowdown", "value": None, "unit": "x",
                         "note": f"{out.get('status')}: {out.get('error')}"})
            continue
        slowdown = out["tracked_step_s"] / out["plain_step_s"]
        progress(f"cost: tracker on {item}: {out['plain_step_s']:.3f} s -> {out['tracked_step_s']:.3f} s per step")
        rows += [
            {"kind": "tracker", "item": item, "metric": "plain_step_s", "value": out["plain_step_s"], "unit": "s",
             "note": f"median of {out['steps']}"},
            {"kind": "tracker", "item": item, "metric": "tracked_step_s", "value": out["tracked_step_s"], "unit": "s",
             "note": f"median of {out['steps']}"},
            {"kind": "tracker", "item": item, "metric": "slowdown", "value": slowdown, "unit": "x",
             "note": "interleaved rounds, same model and batches"},
        ]
    return rows


def run_cost(out_dir: Path, env: dict, *, quick: bool = False,
             progress: Callable[[str], None] = lambda _m: None) -> CostResults:
    """Run the four cost measurements and write ``cost.md`` and ``cost.csv``."""
    started = time.perf_counter()
    rows = _estimator_rate(progress)
    rows += _profile_times(quick, progress)
    rows += _default_space_scoring(quick, progress)
    rows += _size_scoring(quick, progress)
    rows += _trial_overhead(quick, progress)
    rows += _tracker_slowdown(quick, progress)
    res = CostResults(rows, time.perf_counter() - started)
    res.files = write_cost(out_dir, env, res)
    return res


def _fmt(value, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "configs/s":
        return f"{value:,.0f}"
    if unit == "fraction":
        return f"{100 * value:.0f}%"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "s" and value < 0.1:
        return f"{value:.4f}"
    return seconds(value, 2)


def write_cost(out_dir: Path, env: dict, res: CostResults) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [write_csv(out_dir / "cost.csv", res.rows, ["kind", "item", "metric", "value", "unit", "note"])]
    rep = Report("Cost of the machinery", env)
    rep.add(f"Suite wall time: {res.wall_s / 60:.1f} min. Wall-clock times on a machine shared with other "
            "processes: compare within one run, not across runs.")
    titles = {"estimator": "Estimator throughput", "profile": "Profiling on fake tensors (cold cache)",
              "size": "Sizing: shapes x configs from the estimate alone", "trial": "Trial runner fixed cost", "tracker": "Memory tracker slowdown"}
    for kind, title in titles.items():
        rows = [[r["item"], r["metric"], _fmt(r["value"], r["unit"]), r["unit"], r["note"]]
                for r in res.rows if r["kind"] == kind]
        if rows:
            rep.add(f"## {title}\n\n" + markdown_table(["what", "metric", "value", "unit", "note"], rows, "llrll"))
    slow = [r["value"] for r in res.rows if r["kind"] == "tracker" and r["metric"] == "slowdown" and r["value"]]
    if slow:
        rep.add(f"Median tracker slowdown: {statistics.median(slow):.2f}x. Trials time their steps without the "
                "tracker, so it costs trial time, never accuracy of the throughput figure.")
    files.append(rep.write(out_dir / "cost.md"))
    return files


__all__ = ["N_SCORED", "CostResults", "run_cost", "scoring_configs"]

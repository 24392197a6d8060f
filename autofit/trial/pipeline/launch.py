"""Start one process per pipeline stage, collect their JSON results: :func:`measure_split`.

The processes are those of every multi-rank trial (:func:`autofit.runtime.ranks.launch`): a workload
with a ``source`` spec is re-loaded in a fresh interpreter per stage, one built in code is
inherited by ``fork``; each stage sends back one JSON object; parameters, when asked for,
travel as ``.npz`` files.
"""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path

import torch

from autofit.core.config import TrainConfig
from autofit.core.records import TrialStatus
from autofit.runtime import procs
from autofit.runtime.messages import result_status
from autofit.runtime.ranks import (
    combine_results,
    free_port,
    join_failure,
    join_group,
    launch,
    leave_group,
    load_tensors,
)
from autofit.runtime.schedule import MeasureSchedule
from autofit.trial.pipeline.stages import Schedule
from autofit.trial.pipeline.steps import run_stage
from autofit.workloads.base import Workload
from autofit.workloads.load import load_workload


def combine_stage_results(results: list[dict], world_size: int) -> dict:
    """Merge per-stage results (ordered by rank) into :func:`measure_split`'s result."""
    combined, ordered = combine_results(results, world_size, "stage")
    if ordered is None:
        return combined
    combined["losses"] = ordered[-1]["losses"]
    combined["schedule"] = ordered[0]["schedule"]
    combined["stage_layers"] = [r["layers"] for r in ordered]
    combined["activation_recv_bytes"] = [r["activation_recv_bytes"] for r in ordered]
    combined["grad_recv_bytes"] = [r["grad_recv_bytes"] for r in ordered]
    return combined


def stage_entry(request: dict, send: procs.Send | None = None, workload: Workload | None = None) -> dict:
    """A stage process's whole life: join the group, run the stage, leave. Returns its (JSON) result."""
    rank, options = request["rank"], request["options"]
    try:
        device = join_group(request, spawned=workload is None)
        if workload is None:
            workload = load_workload(request["workload"])
    except Exception as exc:
        return join_failure(exc, rank, "stage")
    try:
        return run_stage(workload, request["config"], rank=rank, world_size=request["world_size"], device=device,
                         budget_bytes=options["budget_bytes"], schedule=options["schedule"], seed=options["seed"],
                         params_path=options["params_dir"] and str(Path(options["params_dir"]) / f"stage-{rank}.npz"),
                         steps=MeasureSchedule.from_dict(options["steps"]))
    finally:
        leave_group()


def measure_split(workload: Workload, config: TrainConfig, *, device_type: str, budget_bytes: int | None,
                  warmup_steps: int = 2, measure_steps: int = 3, schedule: Schedule | str = Schedule.ONE_F_ONE_B,
                  seed: int = 0, timeout_s: float = 600.0, collect_params: bool = False,
                  steps: MeasureSchedule | None = None) -> dict:
    """Run ``config`` as ``config.device_split`` pipeline stages, one process each, and measure it.

    CPU: gloo, one child process per stage on this machine. CUDA: NCCL, stage ``i`` on
    ``cuda:i``. Each stage builds the model from ``seed`` and its ``grad_accum``
    micro-batches from ``seed + 1`` (as :func:`autofit.runtime.training.build_trainee` and
    ``make_micro_batches`` would after ``torch.manual_seed``), then measures as
    :func:`run_stage` says, following ``steps`` (default
    ``MeasureSchedule.from_steps(warmup_steps, measure_steps)``): warm-up, tracked steps (CPU),
    timed steps.

    Never raises for a failing trial. Returns::

        {"status": "ok" | "oom" | "error" | "timeout", "error": str | None,
         "per_device_peak_bytes": [int per stage], "peak_bytes": int,
         "breakdown": {six categories, of the stage with the largest peak},
         "per_device_breakdown": [...], "step_time_s": float (slowest stage's median),
         "losses": [mean loss per optimizer step, all steps run], "schedule": "1f1b" | "gpipe",
         "stage_layers": [[start, end], ...], "activation_recv_bytes": [...],
         "grad_recv_bytes": [...], "params": {name: tensor} (only with collect_params)}

    ``oom``: a stage's live bytes passed ``budget_bytes`` (per device) or allocation failed.
    ``timeout``: the stages did not finish within ``timeout_s``; they are killed.

    Example::

        measure_split(load_workload("gpt-tiny"), TrainConfig(micro_batch=4, grad_accum=4, device_split=2),
                      device_type="cpu", budget_bytes=None, steps=MeasureSchedule())
    """
    config = TrainConfig.from_dict(config) if isinstance(config, dict) else config
    world_size = config.device_split
    base = {"status": "error", "error": None, "per_device_peak_bytes": [], "peak_bytes": None, "breakdown": None,
            "step_time_s": None, "losses": []}
    if device_type not in ("cpu", "cuda"):
        return {**base, "error": f"unknown device_type {device_type!r}: expected cpu or cuda"}
    if device_type == "cuda" and torch.cuda.device_count() < world_size:
        return {**base, "error": f"device_split={world_size} needs {world_size} GPUs, found {torch.cuda.device_count()}"}
    try:
        schedule = Schedule(str(schedule))
    except ValueError:
        return {**base, "error": f"unknown schedule {schedule!r}: expected 1f1b or gpipe"}
    steps = steps or MeasureSchedule.from_steps(warmup_steps, measure_steps)
    if workload.source is None:
        # Forked stages inherit this process's modules: import the heavy ones (export, the
        # pipelining runtime, the memory tracker) once here rather than once per stage.
        importlib.import_module("torch.distributed._tools.mem_tracker")
        importlib.import_module("torch.distributed.pipelining")
    with tempfile.TemporaryDirectory(prefix="autofit-split-") as params_dir:
        options = {"budget_bytes": budget_bytes, "schedule": schedule.value, "seed": seed,
                   "params_dir": params_dir if collect_params else None, "steps": steps.to_dict()}
        port = free_port()
        requests = [{"rank": rank, "world_size": world_size, "port": port, "device_type": device_type,
                     "pg_timeout_s": max(30.0, timeout_s), "config": config.to_dict(), "options": options}
                    for rank in range(world_size)]
        results, timed_out = launch("autofit.trial.pipeline.launch:stage_entry", requests, workload, timeout_s=timeout_s,
                                    label="stage")
        if timed_out and all(result_status(r) is TrialStatus.OK for r in results.values()):
            return {**base, "status": "timeout", "error": f"stages did not finish within {timeout_s:g} s"}
        combined = combine_stage_results(list(results.values()), world_size)
        if collect_params and result_status(combined) is TrialStatus.OK:
            combined["params"] = {}
            for rank in range(world_size):
                combined["params"].update(load_tensors(Path(params_dir) / f"stage-{rank}.npz"))
    return combined

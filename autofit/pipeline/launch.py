"""Start one process per pipeline stage, collect their JSON results, kill them: :func:`measure_split`.

Processes are :mod:`autofit.procs` children: a workload with a ``source`` spec is re-loaded in
a fresh interpreter per stage; one built in code is inherited by ``fork``. Stages stay in the
caller's process group (a trial's group kill takes them too) and die with the caller. They
rendezvous on 127.0.0.1 at a free port: gloo on the CPU, NCCL with one GPU per stage on CUDA.
Each sends back one JSON object; parameters, when asked for, travel as ``.npz`` files.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autofit import procs
from autofit.config import TrainConfig
from autofit.pipeline.stages import Schedule, is_peer_failure, last_line
from autofit.pipeline.steps import load_params, run_stage
from autofit.schedule import MeasureSchedule
from autofit.workload import Workload, load_workload

# Once one stage has failed the others are blocked on it: how long they get to report their own failure.
PEER_REPORT_S = 2.0
# Stages that reported are leaving their process group: how long they get to exit on their own.
EXIT_GRACE_S = 10.0


def combine_stage_results(results: list[dict], world_size: int) -> dict:
    """Merge per-stage results (ordered by rank) into :func:`measure_split`'s result."""
    by_rank = {r["rank"]: r for r in results}
    combined: dict[str, Any] = {"status": "ok", "error": None, "per_device_peak_bytes": [], "peak_bytes": None,
                                "breakdown": None, "per_device_breakdown": [], "step_time_s": None,
                                "losses": [], "schedule": None, "stage_layers": [],
                                "activation_recv_bytes": [], "grad_recv_bytes": []}
    failed = [by_rank[r] for r in sorted(by_rank) if by_rank[r]["status"] != "ok"]
    missing = [r for r in range(world_size) if r not in by_rank]
    if failed or missing:
        # The cause, not its echo: an out-of-memory stage first, then a stage that failed on
        # its own, before one that failed because a peer it talked to went away.
        failed.sort(key=lambda r: (r["status"] != "oom", bool(r.get("peer_failed"))))
        first = failed[0] if failed else None
        combined["status"] = first["status"] if first else "error"
        combined["error"] = first["error"] if first else f"stage(s) {missing} returned no result"
        return combined
    ordered = [by_rank[r] for r in range(world_size)]
    combined["per_device_peak_bytes"] = [int(r["peak_bytes"]) for r in ordered]
    combined["peak_bytes"] = max(combined["per_device_peak_bytes"])
    combined["per_device_breakdown"] = [r["breakdown"] for r in ordered]
    combined["breakdown"] = max(ordered, key=lambda r: r["peak_bytes"])["breakdown"]
    combined["step_time_s"] = max(r["step_time_s"] for r in ordered)
    combined["losses"] = ordered[-1]["losses"]
    combined["schedule"] = ordered[0]["schedule"]
    combined["stage_layers"] = [r["layers"] for r in ordered]
    combined["activation_recv_bytes"] = [r["activation_recv_bytes"] for r in ordered]
    combined["grad_recv_bytes"] = [r["grad_recv_bytes"] for r in ordered]
    return combined




def stage_entry(request: dict, send: procs.Send | None = None, workload: Workload | None = None) -> dict:
    """A stage process's whole life: join the group, run the stage, leave. Returns its (JSON) result."""
    rank, world_size, device_type = request["rank"], request["world_size"], request["device_type"]
    if device_type == "cpu" and workload is None:
        # The stages share this machine's cores, as they would share nothing on real devices.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    backend = "nccl" if device_type == "cuda" else "gloo"
    options = dict(request["options"])
    try:
        if workload is None:
            workload = load_workload(request["workload"])
        device = torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)  # before NCCL binds this process to a GPU
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{request['port']}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=options.pop("pg_timeout_s")))
    except BaseException as exc:
        # A peer that failed fast (and left) breaks the rendezvous: that is its echo, not a cause.
        return {"rank": rank, "status": "error", "error": f"stage {rank}: {type(exc).__name__}: {last_line(exc)}",
                "peer_failed": is_peer_failure(exc)}
    try:
        return run_stage(workload, request["config"], rank=rank, world_size=world_size, device=device,
                         budget_bytes=options["budget_bytes"], schedule=options["schedule"], seed=options["seed"],
                         params_path=options["params_dir"] and str(Path(options["params_dir"]) / f"stage-{rank}.npz"),
                         steps=MeasureSchedule.from_dict(options["steps"]))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(workload: Workload, request: dict, timeout_s: float) -> procs.Child:
    # A workload with a source spec is re-loaded in a fresh interpreter; one built in code can
    # only reach the stage by fork (and never with CUDA initialised here).
    if workload.source is not None:
        return procs.spawn("autofit.pipeline.launch:stage_entry", {**request, "workload": workload.source},
                           timeout_s=timeout_s, new_group=False, echo_stderr=True)
    return procs.fork(functools.partial(stage_entry, workload=workload), request, timeout_s=timeout_s,
                      new_group=False, echo_stderr=True)


def _stage_result(child: procs.Child, rank: int) -> dict:
    message = child.last_message()
    if message is not None and "status" in message:
        return message
    return {"rank": rank, "status": "error", "error": f"stage {rank} process {child.failure()}"}


def _collect(children: list[procs.Child]) -> tuple[dict[int, dict], bool]:
    """Read every stage's result until all have reported; returns (results by rank, timed out)."""
    results: dict[int, dict] = {}
    failed_at = None
    while len(results) < len(children):
        if any(child.timed_out for rank, child in enumerate(children) if rank not in results):
            return results, True
        if failed_at is not None and time.monotonic() - failed_at > PEER_REPORT_S:
            break
        procs.pump([c for rank, c in enumerate(children) if rank not in results], 0.1)
        for rank, child in enumerate(children):
            if rank not in results and child.done:
                results[rank] = _stage_result(child, rank)
                if results[rank]["status"] != "ok" and failed_at is None:
                    failed_at = time.monotonic()
    return results, False


def _stop(children: list[procs.Child], results: dict[int, dict]) -> None:
    grace_end = time.monotonic() + EXIT_GRACE_S
    for rank, child in enumerate(children):
        if rank in results and results[rank]["status"] == "ok":
            while not child.exited() and time.monotonic() < grace_end:
                time.sleep(0.02)
    for child in children:
        child.kill(grace_s=5.0)


def measure_split(workload: Workload, config: TrainConfig, *, device_type: str, budget_bytes: int | None,
                  warmup_steps: int = 2, measure_steps: int = 3, schedule: Schedule | str = Schedule.ONE_F_ONE_B,
                  seed: int = 0, timeout_s: float = 600.0, collect_params: bool = False,
                  steps: MeasureSchedule | None = None) -> dict:
    """Run ``config`` as ``config.device_split`` pipeline stages, one process each, and measure it.

    CPU: gloo, one child process per stage on this machine. CUDA: NCCL, stage ``i`` on
    ``cuda:i``. Each stage builds the model from ``seed`` and its ``grad_accum``
    micro-batches from ``seed + 1`` (as :func:`autofit.training.build_trainee` and
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
                   "params_dir": params_dir if collect_params else None, "steps": steps.to_dict(),
                   "pg_timeout_s": max(30.0, timeout_s)}
        port = _free_port()
        children: list[procs.Child] = []
        results: dict[int, dict] = {}
        timed_out = False
        try:
            for rank in range(world_size):
                request = {"rank": rank, "world_size": world_size, "port": port, "config": config.to_dict(),
                           "device_type": device_type, "options": options}
                children.append(_start(workload, request, timeout_s))
            results, timed_out = _collect(children)
        finally:
            _stop(children, results)
        if timed_out and all(r["status"] == "ok" for r in results.values()):
            return {**base, "status": "timeout", "error": f"stages did not finish within {timeout_s:g} s"}
        combined = combine_stage_results(list(results.values()), world_size)
        if collect_params and combined["status"] == "ok":
            combined["params"] = {}
            for rank in range(world_size):
                combined["params"].update(load_params(Path(params_dir) / f"stage-{rank}.npz"))
    return combined

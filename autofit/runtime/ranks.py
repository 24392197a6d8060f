"""What every multi-process trial shares (pipeline stages, FSDP ranks): one process per device.

- :func:`launch` starts one :mod:`autofit.runtime.procs` child per rank (a fresh interpreter that
  re-loads the workload from its ``source``, or a fork for a workload built in code), collects
  the JSON result each sends back, and stops them all: ranks that reported get time to leave
  their process group on their own, the rest are killed. Ranks stay in the caller's process
  group (a trial's group kill takes them too) and die with the caller.
- :func:`join_group` / :func:`leave_group`: the rendezvous on 127.0.0.1 (gloo on the CPU, NCCL
  with rank ``i`` on ``cuda:i``).
- :func:`measure_rank`: the steps of a :class:`autofit.runtime.schedule.MeasureSchedule`
  (:func:`autofit.runtime.schedule.run_steps`), then timed steps every rank starts together; the peak
  from the CPU tracker or CUDA's allocator.
- :func:`agreed_optimizer_step`: the GradScaler's inf/NaN check agreed on by all ranks.
- :func:`record_failure` and :func:`combine_results`: a failing rank is a result, and of
  several failures the cause (an out-of-memory rank, then one that failed on its own) is
  reported, not the echo of a peer that went away.
- :func:`save_tensors` / :func:`load_tensors`: parameters as ``.npz`` files (no pickle).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import socket
import statistics
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from autofit.core.errors import ConfigError
from autofit.core.records import TrialStatus
from autofit.runtime import procs
from autofit.runtime.messages import result_status
from autofit.runtime.schedule import MeasureSchedule, run_steps
from autofit.workloads.base import Workload

__all__ = ["agreed_optimizer_step", "cap_cuda_memory", "cause_chain", "check_budget", "combine_results", "free_port",
           "is_peer_failure", "join_failure", "join_group", "last_line", "launch", "leave_group", "load_tensors",
           "measure_rank", "record_failure", "root_cause", "save_tensors"]

# Once one rank has failed the others are blocked on it: how long they get to report their own failure.
PEER_REPORT_S = 2.0
# Ranks that reported are leaving their process group: how long they get to exit on their own.
EXIT_GRACE_S = 10.0
_PEER_FAILURE_TEXT = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket timeout")

# --------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(entry: str, requests: list[dict], workload: Workload | str, *, timeout_s: float,
           label: str) -> tuple[dict[int, dict], bool]:
    """Run one child per request (``requests[i]`` is rank ``i``'s JSON) and collect their results.

    ``entry`` is ``"module:function"``, called as ``function(request, send, workload=None)`` in
    a fresh interpreter when the workload has a source (a spec string, or ``workload.source``;
    ``request["workload"]`` is the source), else forked with the workload itself. ``label``
    names a rank in errors (``stage``, ``rank``). Returns (results by rank, timed out).
    """
    module_name, _, name = entry.partition(":")
    source = workload if isinstance(workload, str) else workload.source
    children: list[procs.Child] = []
    results: dict[int, dict] = {}
    try:
        for request in requests:
            if source is not None:
                children.append(procs.spawn(entry, {**request, "workload": source}, timeout_s=timeout_s,
                                            new_group=False, echo_stderr=True))
            else:
                function = getattr(importlib.import_module(module_name), name)
                children.append(procs.fork(functools.partial(function, workload=workload), request,
                                           timeout_s=timeout_s, new_group=False, echo_stderr=True))
        results, timed_out = _collect(children, label)
    finally:
        _stop(children, results)
    return results, timed_out


def _collect(children: list[procs.Child], label: str) -> tuple[dict[int, dict], bool]:
    results: dict[int, dict] = {}
    failed_at = None
    while len(results) < len(children):
        waiting = [(rank, child) for rank, child in enumerate(children) if rank not in results]
        if any(child.timed_out for _, child in waiting):
            return results, True
        if failed_at is not None and time.monotonic() - failed_at > PEER_REPORT_S:
            break
        procs.pump([child for _, child in waiting], 0.1)
        for rank, child in waiting:
            if child.done:
                message = child.last_message()
                results[rank] = message if message is not None and "status" in message else {
                    "rank": rank, "status": TrialStatus.ERROR.value,
                    "error": f"{label} {rank} process {child.failure()}"}
                if result_status(results[rank]) is not TrialStatus.OK and failed_at is None:
                    failed_at = time.monotonic()
    return results, False


def _stop(children: list[procs.Child], results: dict[int, dict]) -> None:
    grace_end = time.monotonic() + EXIT_GRACE_S
    for rank, child in enumerate(children):
        if rank in results and result_status(results[rank]) is TrialStatus.OK:
            while not child.exited() and time.monotonic() < grace_end:
                time.sleep(0.02)
    for child in children:
        child.kill(grace_s=5.0)


def join_group(request: dict, spawned: bool) -> torch.device:
    """In a rank: set its device and threads, join the process group; returns the device. Raises what init raises."""
    rank, world_size, device_type = request["rank"], request["world_size"], request["device_type"]
    if device_type == "cpu" and spawned:  # a forked child already runs on one thread (procs.fork)
        # The ranks share this machine's cores, as they would share nothing on real devices.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    device = torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL binds this process to a GPU
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{request['port']}",
                            rank=rank, world_size=world_size, timeout=timedelta(seconds=request["pg_timeout_s"]))
    return device


def leave_group() -> None:
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def join_failure(exc: BaseException, rank: int, label: str) -> dict:
    # A peer that failed fast (and left) breaks the rendezvous: that is its echo, not a cause.
    return {"rank": rank, "status": "error", "error": f"{label} {rank}: {type(exc).__name__}: {last_line(exc)}",
            "peer_failed": is_peer_failure(exc)}


# --------------------------------------------------------------------------- measuring


def cap_cuda_memory(device: torch.device, budget_bytes: int | None) -> None:
    """Cap the caching allocator at the budget. The CUDA context and NCCL are outside it
    (docs/facts.md#cuda-caching-allocator)."""
    torch.cuda.set_device(device)
    if budget_bytes is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)


def agreed_optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                          device: torch.device) -> None:
    """The optimizer step; with a GradScaler every rank skips (or takes) it together and updates its
    scale alike: an inf/NaN found on any rank counts on all of them."""
    if scaler is None:
        optimizer.step()
        return
    scaler.unscale_(optimizer)
    found = scaler._found_inf_per_device(optimizer)  # private, torch >= 1.6
    flag = torch.zeros(1, device=device)
    for value in found.values():
        flag += value.to(device).reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    for value in found.values():
        value.copy_(flag.reshape(value.shape).to(value.device))
    scaler.step(optimizer)
    scaler.update()


def measure_rank(result: dict, schedule: MeasureSchedule, device: torch.device, step: Callable[[], Any], *,
                 make_tracker: Callable[[], Any], cuda_breakdown: Callable[[int], dict],
                 untracked_steps: int = 0) -> None:
    """Run ``schedule`` on this rank, filling ``result``'s ``losses``, ``peak_bytes``, ``breakdown``, ``step_time_s``.

    ``step()`` runs one optimizer step and returns its loss. CPU: warm-up and measured steps
    under ``make_tracker()`` (after ``untracked_steps`` bare ones); CUDA: bare, the allocator's
    peak read over the timed steps. Timed steps: every rank starts each one together (a
    barrier), so a rank's time is not its wait for the others; the median is kept. A schedule
    without ``memory`` on the CPU runs bare and leaves ``peak_bytes`` None.
    """
    losses = result["losses"]
    started = time.perf_counter()
    tracker = run_steps(schedule, lambda: losses.append(step()),
                        tracker=make_tracker if device.type == "cpu" else None, untracked_steps=untracked_steps)
    if tracker is not None:
        result["tracked_s"] = time.perf_counter() - started  # what a throughput sample of the split saves
        result["peak_bytes"] = tracker.peak_bytes
        result["breakdown"] = tracker.peak_breakdown()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        result["peak_bytes"], result["breakdown"] = None, None
    times = []
    for _ in range(schedule.timed_steps):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        losses.append(step())
        _sync(device)
        times.append(time.perf_counter() - start)
    result["step_time_s"] = statistics.median(times)
    if device.type == "cuda":  # nothing slows CUDA steps down: the timed steps are the measured ones
        result["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        result["breakdown"] = cuda_breakdown(result["peak_bytes"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_budget(result: dict, budget_bytes: int | None, label: str) -> None:
    """``ok``, or ``oom`` when the rank's peak passed the budget."""
    if budget_bytes is not None and result["peak_bytes"] is not None and result["peak_bytes"] > budget_bytes:
        result["status"] = TrialStatus.OOM.value
        result["error"] = (f"{label} {result['rank']} peaked at {result['peak_bytes']} bytes, over the budget "
                           f"of {budget_bytes} bytes")
    else:
        result["status"] = TrialStatus.OK.value


# --------------------------------------------------------------------------- failures


def cause_chain(exc: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        chain.append(exc)
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return chain


def root_cause(exc: BaseException, preferred: tuple[type, ...] = ()) -> BaseException:
    """The origin of a wrapped failure (the schedule wraps a stage's: "[Stage 0] failed to run forward")."""
    chain = cause_chain(exc)
    for e in chain:
        if isinstance(e, (*preferred, ConfigError, torch.OutOfMemoryError, MemoryError)):
            return e
    return chain[-1]


def is_peer_failure(exc: BaseException) -> bool:
    """A rank blocked on a send/recv to a rank that died fails too; that is not the cause."""
    return any(isinstance(e, dist.DistError) or any(t in str(e).lower() for t in _PEER_FAILURE_TEXT)
               for e in cause_chain(exc))


def last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def record_failure(result: dict, exc: BaseException, *, label: str, tracker, budget_bytes: int | None,
                   preferred: tuple[type, ...] = ()) -> None:
    """Turn ``exc`` into ``result``'s ``oom`` or ``error`` status, its one-line error and a traceback."""
    rank = result["rank"]
    if tracker is not None and tracker.exceeded_bytes is not None:
        # Checked by state, not by exception type: the schedule wraps what the rank raised.
        result["status"] = TrialStatus.OOM.value
        result["error"] = (f"{label} {rank}: live tensor bytes reached {tracker.exceeded_bytes} "
                           f"(over the budget of {budget_bytes} bytes)")
    else:
        cause = root_cause(exc, preferred)
        oom = any(isinstance(e, (torch.OutOfMemoryError, MemoryError)) for e in cause_chain(exc))
        result["status"] = (TrialStatus.OOM if oom else TrialStatus.ERROR).value
        result["error"] = f"{label} {rank}: {type(cause).__name__}: {last_line(cause)}"
        result["peer_failed"] = is_peer_failure(exc)
    result["traceback"] = traceback.format_exc(limit=8)


def combine_results(results: list[dict], world_size: int, label: str) -> tuple[dict, list[dict] | None]:
    """The fields every multi-rank result has, and the per-rank results in rank order (None on failure).

    ``per_device_peak_bytes``, ``peak_bytes`` (the largest rank's), ``per_device_breakdown``,
    ``breakdown`` (of the largest rank), ``step_time_s`` (the slowest rank's median). On a
    failure: the status and error of the cause.
    """
    by_rank = {r["rank"]: r for r in results}
    combined: dict[str, Any] = {"status": TrialStatus.OK.value, "error": None, "per_device_peak_bytes": [],
                                "peak_bytes": None, "breakdown": None, "per_device_breakdown": [], "step_time_s": None,
                                "losses": []}
    failed = [by_rank[r] for r in sorted(by_rank) if result_status(by_rank[r]) is not TrialStatus.OK]
    missing = [r for r in range(world_size) if r not in by_rank]
    if failed or missing:
        # An out-of-memory rank first, then one that failed on its own, before one that failed
        # because a peer it talked to went away.
        failed.sort(key=lambda r: (result_status(r) is not TrialStatus.OOM, bool(r.get("peer_failed"))))
        combined["status"] = failed[0]["status"] if failed else TrialStatus.ERROR.value
        combined["error"] = failed[0]["error"] if failed else f"{label}(s) {missing} returned no result"
        return combined, None
    ordered = [by_rank[r] for r in range(world_size)]
    combined["step_time_s"] = max(r["step_time_s"] for r in ordered)
    tracked = [r["tracked_s"] for r in ordered if r.get("tracked_s") is not None]
    combined["tracked_s"] = max(tracked) if len(tracked) == len(ordered) else None  # the ranks run in step
    if any(r.get("peak_bytes") is None for r in ordered):  # a throughput sample: no rank read its peak
        return combined, ordered
    combined["per_device_peak_bytes"] = [int(r["peak_bytes"]) for r in ordered]
    combined["peak_bytes"] = max(combined["per_device_peak_bytes"])
    combined["per_device_breakdown"] = [r["breakdown"] for r in ordered]
    combined["breakdown"] = max(ordered, key=lambda r: r["peak_bytes"])["breakdown"]
    return combined, ordered


# --------------------------------------------------------------------------- parameters


def save_tensors(named: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write tensors to ``path`` as an ``.npz`` of float32 arrays (exact for fp32, bf16 and fp16), their
    dtypes in ``__dtypes__``: read back by :func:`load_tensors` without unpickling anything."""
    arrays = {name: t.detach().cpu().float().numpy() for name, t in named.items()}
    arrays["__dtypes__"] = np.array([f"{name}={str(t.dtype).removeprefix('torch.')}" for name, t in named.items()])
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors :func:`save_tensors` wrote, in their own dtypes."""
    with np.load(path, allow_pickle=False) as data:
        dtypes = dict(entry.split("=", 1) for entry in data["__dtypes__"].tolist())
        return {name: torch.from_numpy(data[name]).to(getattr(torch, dtype)) for name, dtype in dtypes.items()}

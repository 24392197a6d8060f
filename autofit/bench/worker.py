"""Measurement jobs run in a fresh interpreter: ``python -m autofit.bench.worker`` (JSON jobs on stdin).

The accuracy suite measures dozens of configs; starting an interpreter per config (what the
trial runner does, ~3-5 s here) would cost more than the measurements. So one worker process
per workload runs them in turn, each on a fresh model and optimizer, and prints one JSON object
per job on stdout as it finishes. The worker is a child so that the benchmark's own process
never trains (the OpenMP policy in :data:`autofit.bench.common.BENCH_ENV` is read when the
library loads, and only a child can be given it), and so a crash costs one workload's rows.

Job kinds:

- ``memory``: peak live tensor bytes of ``config`` (the CPU tracker, steady state) and, with
  ``time``, the step time. Single-device configs with ``time`` go through
  :func:`autofit.measure.measure_trial` itself (the trial runner's code path); without
  ``time`` (amp-fp16, whose CPU kernels are ~1000x slow) only the tracked steps run. Device
  splits always go through ``measure_trial``, which runs PyTorch's pipeline engine.
- ``tracker_overhead``: the same training steps timed with and without the memory tracker.
- ``throughput``: samples/s of ``config`` from a few untracked steps, timed as a trial times
  them: a second throughput sample for the search suite's ground truth.
"""

from __future__ import annotations

import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path


def _memory_only(workload, config, warmup_steps: int, measure_steps: int) -> dict:
    """What ``measure_trial`` does on the CPU up to the peak, without its timed steps."""
    from autofit.measure import _micro_batches
    from autofit.tracker import MemoryTracker
    from autofit.training import build_trainee, train_step

    trainee = build_trainee(workload, config, "cpu")
    batches = _micro_batches(workload, config, trainee.device)
    tracker = MemoryTracker(trainee.model, trainee.optimizer, inputs=batches)
    boundary = lambda _index: tracker.step_boundary()
    with tracker:
        for _ in range(warmup_steps):
            train_step(trainee, batches, on_micro_step=boundary)
        tracker.reset_peak()
        for _ in range(measure_steps):
            train_step(trainee, batches, on_micro_step=boundary)
    return {"status": "ok", "error": None, "peak_bytes": tracker.peak_bytes,
            "per_device_peak_bytes": [tracker.peak_bytes], "breakdown": tracker.peak_breakdown(),
            "step_time_s": None}


def _memory(job: dict) -> dict:
    import torch

    from autofit.config import TrainConfig
    from autofit.measure import measure_trial
    from autofit.workload import load_workload

    workload = load_workload(job["workload"])
    config = TrainConfig.from_dict(job["config"])
    torch.manual_seed(0)
    if job.get("time", True) or config.device_split > 1:
        out = measure_trial(workload, config, device="cpu", warmup_steps=job.get("warmup_steps", 2),
                            measure_steps=job.get("measure_steps", 1))
    else:
        out = _memory_only(workload, config, job.get("warmup_steps", 2), job.get("measure_steps", 1))
    keep = ("status", "error", "peak_bytes", "per_device_peak_bytes", "breakdown", "step_time_s", "samples_per_s")
    return {k: out.get(k) for k in keep}


def _tracker_overhead(job: dict) -> dict:
    """Median step time of the same steps with and without the tracker (warm steps first)."""
    import torch

    from autofit.config import TrainConfig
    from autofit.measure import _micro_batches
    from autofit.tracker import MemoryTracker
    from autofit.training import build_trainee, train_step
    from autofit.workload import load_workload

    workload = load_workload(job["workload"])
    config = TrainConfig.from_dict(job["config"])
    steps = int(job.get("steps", 5))
    torch.manual_seed(0)
    trainee = build_trainee(workload, config, "cpu")
    batches = _micro_batches(workload, config, trainee.device)
    for _ in range(2):  # warm: optimizer state exists, kernels chosen
        train_step(trainee, batches)

    def timed(step) -> list[float]:
        out = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            out.append(time.perf_counter() - start)
        return out

    plain: list[float] = []
    tracked: list[float] = []
    tracker = MemoryTracker(trainee.model, trainee.optimizer, inputs=batches)
    boundary = lambda _index: tracker.step_boundary()
    # Interleaved rounds, so a burst of load from other processes hits both sides alike.
    for _ in range(2):
        plain += timed(lambda: train_step(trainee, batches))
        with tracker:
            tracked += timed(lambda: train_step(trainee, batches, on_micro_step=boundary))
    return {"status": "ok", "error": None, "plain_step_s": statistics.median(plain),
            "tracked_step_s": statistics.median(tracked), "steps": len(plain)}


def _throughput(job: dict) -> dict:
    """Samples/s of a few untracked steps, timed as a trial times them (medians of micro-steps and optimizer steps)."""
    import torch

    from autofit.config import TrainConfig
    from autofit.measure import _micro_batches, compose_step_time
    from autofit.training import (
        build_trainee,
        forward_backward,
        optimizer_step,
        train_step,
    )
    from autofit.workload import load_workload

    workload = load_workload(job["workload"])
    config = TrainConfig.from_dict(job["config"])
    torch.manual_seed(0)
    trainee = build_trainee(workload, config, "cpu")
    batches = _micro_batches(workload, config, trainee.device)
    train_step(trainee, batches)   # warm: optimizer state exists
    micro_s, optimizer_s = [], []
    for _ in range(int(job.get("steps", 3))):
        trainee.optimizer.zero_grad(set_to_none=True)
        for inputs, targets in batches:
            start = time.perf_counter()
            forward_backward(trainee, inputs, targets)
            micro_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        optimizer_step(trainee)
        optimizer_s.append(time.perf_counter() - start)
    # the trial's own estimator (medians), so configs with more micro-steps per step are not favoured
    step_time_s = compose_step_time(config, statistics.median(micro_s), statistics.median(optimizer_s))
    return {"status": "ok", "error": None, "step_time_s": step_time_s,
            "samples_per_s": config.samples_per_step / step_time_s}


_KINDS = {"memory": _memory, "tracker_overhead": _tracker_overhead, "throughput": _throughput}


def main() -> int:
    jobs = json.load(sys.stdin)
    for job in jobs:
        start = time.perf_counter()
        try:
            out = _KINDS[job["kind"]](job)
        except Exception as exc:  # noqa: BLE001 -- a failing job is a row, not the end of the run
            lines = [line for line in str(exc).splitlines() if line.strip()]
            out = {"status": "error", "error": f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:500]}
            if job.get("traceback"):
                traceback.print_exc()
        out["id"] = job.get("id")
        out["job_s"] = time.perf_counter() - start
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    return 0


# --- the parent side ----------------------------------------------------------------------------

def run_jobs(jobs: list[dict], *, job_timeout_s: float = 300.0,
             on_result: Callable[[dict, dict], None] | None = None) -> list[dict]:
    """Run ``jobs`` in worker processes; one result dict per job, in order; never raises for a job.

    Each job gets ``job_timeout_s``; a job past it is killed with its worker (and any stage
    processes in the worker's process group) and reported as ``timeout``; the remaining jobs
    go to a fresh worker. ``on_result(job, result)`` is called as each one finishes.
    """
    jobs = [{**job, "id": i} for i, job in enumerate(jobs)]
    results: dict[int, dict] = {}
    pending = list(jobs)
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    while pending:
        proc = subprocess.Popen([sys.executable, "-m", "autofit.bench.worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        proc.stdin.write(json.dumps(pending).encode())
        proc.stdin.close()
        buffer = b""
        deadline = time.monotonic() + job_timeout_s
        fd = proc.stdout.fileno()
        while pending:
            remaining = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(0.0, min(remaining, 1.0)))[0] if remaining > 0 else []
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:  # the worker died: the job in progress is an error, the rest go on
                    job = pending.pop(0)
                    results[job["id"]] = {"status": "error", "error": f"worker exited ({proc.wait()})"}
                    _report(on_result, job, results[job["id"]])
                    break
                buffer += chunk
                while b"\n" in buffer and pending:
                    line, buffer = buffer.split(b"\n", 1)
                    out = json.loads(line)
                    job = pending.pop(0)
                    results[job["id"]] = out
                    _report(on_result, job, out)
                    deadline = time.monotonic() + job_timeout_s
            elif remaining <= 0:
                job = pending.pop(0)
                results[job["id"]] = {"status": "timeout", "error": f"over {job_timeout_s:.0f} s"}
                _report(on_result, job, results[job["id"]])
                break
        _kill(proc)
    return [results[job["id"]] for job in jobs]


def _report(on_result, job: dict, result: dict) -> None:
    if on_result is not None:
        on_result(job, result)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    proc.stdout.close()


if __name__ == "__main__":
    raise SystemExit(main())

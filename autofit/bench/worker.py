"""Measurement jobs run in a fresh interpreter, an :mod:`autofit.runtime.procs` child (JSON jobs in, one JSON result a job out).

The accuracy suite measures dozens of configs; starting an interpreter per config (what the
trial runner does, ~3-5 s here) would cost more than the measurements. So one worker process
per workload runs them in turn, each on a fresh model and optimizer, and sends one JSON object
per job as it finishes. The worker is a child so that the benchmark's own process
never trains (the OpenMP policy in :data:`autofit.bench.common.BENCH_ENV` is read when the
library loads, and only a child can be given it), and so a crash costs one workload's rows.

Job kinds:

- ``memory``: peak live tensor bytes of ``config`` (the CPU tracker, steady state) and, with
  ``time``, the step time; with ``truth_repeats``, the independent ground truth of
  :mod:`autofit.trial.ground_truth` (allocator and resident peaks, that many times each) for a single device. Single-device configs with ``time`` go through
  :func:`autofit.trial.measure.measure_trial` itself (the trial runner's code path); without
  ``time`` (amp-fp16, whose CPU kernels are ~1000x slow) only the tracked steps run. Device
  splits always go through ``measure_trial``, which runs PyTorch's pipeline engine.
- ``tracker_overhead``: the same training steps timed with and without the memory tracker.
- ``throughput``: samples/s of ``config`` from a few untracked steps, timed as a trial times
  them: a second throughput sample for the search suite's ground truth.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable

from autofit.core.records import TrialStatus
from autofit.runtime import procs
from autofit.runtime.devicelock import DeviceLock, device_names
from autofit.runtime.schedule import MeasureSchedule, run_steps


def _memory_only(workload, config, schedule: MeasureSchedule) -> dict:
    """What ``measure_trial`` does on the CPU up to the peak (the same step loop), without its timed steps."""
    from autofit.runtime.tracker import MemoryTracker
    from autofit.runtime.training import build_trainee, train_step
    from autofit.trial.measure import trial_micro_batches

    trainee = build_trainee(workload, config, "cpu")
    batches = trial_micro_batches(workload, config, trainee.device, schedule)
    tracker = MemoryTracker(trainee.model, trainee.optimizer, inputs=batches)
    boundary = lambda _index: tracker.step_boundary()
    run_steps(schedule, lambda: train_step(trainee, batches, on_micro_step=boundary), tracker=lambda: tracker)
    return {"status": "ok", "error": None, "peak_bytes": tracker.peak_bytes,
            "per_device_peak_bytes": [tracker.peak_bytes], "breakdown": tracker.peak_breakdown(),
            "step_time_s": None}


def _memory(job: dict) -> dict:
    import torch

    from autofit.core.config import TrainConfig
    from autofit.trial.measure import measure_trial
    from autofit.workloads.load import load_workload

    workload = load_workload(job["workload"])
    config = TrainConfig.from_dict(job["config"])
    torch.manual_seed(0)
    schedule = MeasureSchedule.from_steps(job.get("warmup_steps", 2), job.get("measure_steps", 1))
    if job.get("time", True) or config.device_split > 1:
        out = measure_trial(workload, config, device="cpu", schedule=schedule)
    else:
        out = _memory_only(workload, config, schedule)
    keep = ("status", "error", "peak_bytes", "per_device_peak_bytes", "breakdown", "step_time_s", "samples_per_s")
    out = {k: out.get(k) for k in keep}
    if job.get("truth_repeats") and config.device_split == 1 and out["status"] == TrialStatus.OK:
        from autofit.trial.ground_truth import ground_truth

        # after the trial's own steps, on fresh models: nothing timed runs under the profiler
        out.update(ground_truth(workload, config, schedule, int(job["truth_repeats"]),
                                tracker_peak_bytes=out["peak_bytes"]))
    return out


def _tracker_overhead(job: dict) -> dict:
    """Median step time of the same steps with and without the tracker (warm steps first)."""
    import torch

    from autofit.core.config import TrainConfig
    from autofit.runtime.tracker import MemoryTracker
    from autofit.runtime.training import build_trainee, train_step
    from autofit.trial.measure import trial_micro_batches
    from autofit.workloads.load import load_workload

    workload = load_workload(job["workload"])
    config = TrainConfig.from_dict(job["config"])
    steps = int(job.get("steps", 5))
    torch.manual_seed(0)
    trainee = build_trainee(workload, config, "cpu")
    batches = trial_micro_batches(workload, config, trainee.device)
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

    from autofit.core.config import TrainConfig
    from autofit.runtime.training import build_trainee, train_step
    from autofit.trial.measure import (
        compose_step_time,
        time_micro_and_optimizer_steps,
        trial_micro_batches,
    )
    from autofit.workloads.load import load_workload

    workload = load_workload(job["workload"])
    config = TrainConfig.from_dict(job["config"])
    torch.manual_seed(0)
    trainee = build_trainee(workload, config, "cpu")
    batches = trial_micro_batches(workload, config, trainee.device)
    train_step(trainee, batches)   # warm: optimizer state exists
    # the trial's own timed loop and estimator (medians), so configs with more micro-steps per step are not favoured
    t_micro, t_optimizer = time_micro_and_optimizer_steps(trainee, batches, int(job.get("steps", 3)))
    step_time_s = compose_step_time(config, t_micro, t_optimizer)
    return {"status": "ok", "error": None, "step_time_s": step_time_s,
            "samples_per_s": config.samples_per_step / step_time_s}


_KINDS = {"memory": _memory, "tracker_overhead": _tracker_overhead, "throughput": _throughput}


def serve(request: dict, send: procs.Send) -> None:
    """The worker (a :mod:`autofit.runtime.procs` child): run ``request["jobs"]`` in turn, sending one result each."""
    for job in request["jobs"]:
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
        send(out)


# --- the parent side ----------------------------------------------------------------------------

def run_jobs(jobs: list[dict], *, job_timeout_s: float = 300.0,
             on_result: Callable[[dict, dict], None] | None = None) -> list[dict]:
    """Run ``jobs`` in worker processes; one result dict per job, in order; never raises for a job.

    Each job gets ``job_timeout_s``; a job past it is killed with its worker (and any stage
    processes in the worker's process group) and reported as ``timeout``; the remaining jobs
    go to a fresh worker. ``on_result(job, result)`` is called as each one finishes. The jobs
    hold the CPU's device lock (:mod:`autofit.runtime.devicelock`), as a trial does: nothing else on this
    machine measures beside them.
    """
    with DeviceLock(device_names("cpu"), "bench jobs"):
        return _run_jobs(jobs, job_timeout_s, on_result)


def _run_jobs(jobs: list[dict], job_timeout_s: float, on_result) -> list[dict]:
    jobs = [{**job, "id": i} for i, job in enumerate(jobs)]
    results: dict[int, dict] = {}
    pending = list(jobs)
    while pending:
        worker = procs.spawn("autofit.bench.worker:serve", {"jobs": pending}, timeout_s=job_timeout_s)
        try:
            while pending:
                job = pending[0]
                try:
                    out = worker.next_message()
                except TimeoutError:
                    out = {"status": "timeout", "error": f"over {job_timeout_s:.0f} s"}
                if out is None:  # the worker died: the job in progress is an error, the rest go on
                    worker.kill()
                    out = {"status": "error", "error": f"worker {worker.failure()}"}
                pending.pop(0)
                results[job["id"]] = out
                _report(on_result, job, out)
                if out["status"] == TrialStatus.TIMEOUT or (worker.done and not worker.messages):
                    break
                worker.extend_deadline(job_timeout_s)
        finally:
            worker.kill()
    return [results[job["id"]] for job in jobs]


def _report(on_result, job: dict, result: dict) -> None:
    if on_result is not None:
        on_result(job, result)

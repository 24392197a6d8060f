"""Measure one trial in the current process: peak memory and throughput of a config, for real.

The trial runner (:mod:`autofit.trial.run`) calls :func:`measure_trial` in a child process; call
it directly only when you accept that an out-of-memory error, a crash or a hang of the
workload takes your process with it.

What is measured, in order (the steps of a :class:`autofit.runtime.schedule.MeasureSchedule`, run by
:func:`autofit.runtime.schedule.run_steps`), on a fresh model and optimizer built by
:func:`autofit.runtime.training.build_trainee`:

1. warm-up steps (at least 2, so the optimizer state exists);
2. peak memory over the steady-state steps that follow (the third optimizer step onward):
   on the CPU, live tensor bytes counted by :class:`autofit.runtime.tracker.MemoryTracker` (which
   also watches the warm-up, to stop a config that cannot fit as early as a device would);
   on CUDA, the caching allocator's ``max_memory_allocated`` / ``max_memory_reserved``;
3. throughput, on steps run without any tracker: micro-steps and the optimizer step are timed
   separately and composed as ``step_time_s = grad_accum * t_micro + t_optimizer``
   (docs/facts.md#step-time-with-accumulation), so a config with ``grad_accum=64`` runs only a few
   micro-steps per timed step. Each timed step records its CPU time and how long its threads
   waited for a CPU (:mod:`autofit.runtime.timing`); a step another process starved is taken
   again (up to ``MAX_RETIMED_STEPS`` more, none once load starved a whole run of steps), and the
   throughput is the fastest step that was not starved: load only ever slows a step, so the fastest
   is the figure it inflates least.

A schedule without ``memory`` (a re-measurement: the config's first trial measured its memory) runs
only 1 and 3 and reports no peak. On the CPU a trial that reads the peak also reports ``tracked_s``,
the seconds of its tracked steps (what a re-measurement saves).

Each measured step runs ``min(grad_accum, 3)`` micro-batches (the schedule's
``micro_steps_per_step``): after the second micro-step
the gradients are accumulated in place, so further micro-steps repeat the same memory
pattern and the same work, and the composition above accounts for them.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import torch

from autofit.core.config import SplitMode, TrainConfig
from autofit.core.records import TrialStatus
from autofit.probes.cuda_overhead import (
    context_bytes_now,
    fallback_overhead,
    warm_up_kernels,
)
from autofit.runtime.messages import result_status
from autofit.runtime.offload import release_offloaded
from autofit.runtime.schedule import MeasureSchedule, run_steps
from autofit.runtime.timing import (
    StepClock,
    StepSample,
    StepTimes,
    cpus_available,
    more_steps_due,
)
from autofit.runtime.tracker import CATEGORIES as BREAKDOWN_KEYS
from autofit.runtime.tracker import MemoryTracker, optimizer_state_bytes, storage_bytes
from autofit.runtime.training import (
    build_trainee,
    forward_backward,
    make_micro_batches,
    optimizer_step,
    train_step,
)
from autofit.workloads.base import Workload


def measure_trial(workload: Workload, config: TrainConfig, *, device: str = "cpu", budget_bytes: int | None = None,
                  warmup_steps: int = 2, measure_steps: int = 3, schedule: MeasureSchedule | None = None) -> dict:
    """Run ``config`` on ``workload`` in this process and measure it.

    Returns a JSON-ready dict with ``status`` (``"ok"``, ``"oom"``, or ``"error"`` when the
    device split engine is unavailable or fails), ``peak_bytes``, ``per_device_peak_bytes``,
    ``peak_reserved_bytes`` (CUDA only), ``breakdown`` (:data:`BREAKDOWN_KEYS`),
    ``samples_per_s``, ``tokens_per_s``, ``step_time_s``, ``micro_step_time_s``,
    ``optimizer_step_time_s`` and ``error`` (None unless the status is not ok).

    Exceeding ``budget_bytes`` is ``status: "oom"``: on the CPU live tensor bytes are checked
    after every operator; on CUDA the budget is enforced as a card of that size would: the caching
    allocator is capped at the budget less the CUDA context (``set_per_process_memory_fraction``;
    the context lies outside the allocator), ``torch.OutOfMemoryError`` is caught, and a run whose
    ``max_memory_reserved`` + context exceeds the budget is ``oom`` too. On CUDA the result also
    has ``context_bytes`` (NVML's per-process figure less reserved, else the device probe's),
    ``context_measured`` and ``peak_card_bytes`` (reserved + context: what the estimate predicts).

    The steps run are ``schedule``; without one, ``MeasureSchedule.from_steps(warmup_steps, measure_steps)``.
    Raises ValueError for ``measure_steps < 1``, and whatever the workload raises (the trial
    runner reports it as ``error``).
    """
    if schedule is None:
        schedule = MeasureSchedule.from_steps(warmup_steps, measure_steps)
    device_type = torch.device(device).type
    if config.device_split > 1:
        return _measure_split(workload, config, device_type=device_type, budget_bytes=budget_bytes,
                              schedule=schedule)
    try:
        if device_type == "cuda":
            return _measure_cuda(workload, config, device, budget_bytes, schedule)
        if device_type == "cpu":
            return _measure_cpu(workload, config, budget_bytes, schedule)
    except torch.OutOfMemoryError as exc:  # a real allocator failure, on either device
        return _failed("oom", _first_line(exc))
    raise ValueError(f"unsupported device {device!r}: expected cpu or cuda")


def _measure_cpu(workload: Workload, config: TrainConfig, budget_bytes: int | None, schedule: MeasureSchedule) -> dict:
    trainee = build_trainee(workload, config, "cpu")
    batches = trial_micro_batches(workload, config, trainee.device, schedule)
    if not schedule.memory:  # a throughput sample: no tracker, no peak
        run_steps(schedule, lambda: train_step(trainee, batches))
        times, t_micro, t_optimizer = time_steps(trainee, batches, config, schedule.timed_steps)
        return _result(workload, config, None, None, None, t_micro, t_optimizer, times)
    tracker = MemoryTracker(trainee.model, trainee.optimizer, inputs=batches, budget_bytes=budget_bytes)
    boundary = lambda _index: tracker.step_boundary()  # noqa: E731
    started = time.perf_counter()
    try:
        run_steps(schedule, lambda: train_step(trainee, batches, on_micro_step=boundary), tracker=lambda: tracker)
    except Exception:
        # Checked by state, not by exception type: the workload may have wrapped the exception.
        if tracker.exceeded_bytes is not None:
            return _failed("oom", f"live tensor bytes reached {tracker.exceeded_bytes} "
                                  f"(over the budget of {budget_bytes} bytes)")
        raise
    peak_bytes = tracker.peak_bytes
    breakdown = tracker.peak_breakdown()
    tracked_s = time.perf_counter() - started
    times, t_micro, t_optimizer = time_steps(trainee, batches, config, schedule.timed_steps)
    return {**_result(workload, config, peak_bytes, None, breakdown, t_micro, t_optimizer, times),
            "tracked_s": tracked_s}


def _measure_cuda(workload: Workload, config: TrainConfig, device: str, budget_bytes: int | None,
                  schedule: MeasureSchedule) -> dict:
    dev = torch.device(device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(dev)
    warm_up_kernels(dev)  # the context grows as kernel modules load lazily: measure it grown
    torch.cuda.empty_cache()  # nothing cached by an earlier run in this process counts as this config's
    torch.cuda.reset_peak_memory_stats(dev)
    expected = expected_context_bytes(dev)
    if budget_bytes is not None:
        # The card holds the context too: the caching allocator gets the budget less the context
        # (as large as the device probe saw it after a warm-up: lazily loaded kernels make it grow).
        # A budget above the card is the card.
        total = torch.cuda.get_device_properties(dev).total_memory
        cap = max(budget_bytes - expected, 1)
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), dev)
    else:  # no cap left by an earlier trial of this process (a trial host runs several)
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
    trainee = build_trainee(workload, config, dev)
    try:
        return _steps_on_cuda(trainee, dev, budget_bytes, schedule, expected)
    finally:
        release_offloaded(trainee.optimizer)


def _steps_on_cuda(trainee, dev: torch.device, budget_bytes: int | None, schedule: MeasureSchedule,
                   expected: int) -> dict:
    """The measured steps of a CUDA trial, on ``trainee`` built for it (:func:`_measure_cuda`)."""
    workload, config = trainee.workload, trainee.config
    batches = trial_micro_batches(workload, config, dev, schedule)
    run_steps(schedule, lambda: train_step(trainee, batches))
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    # On CUDA nothing slows the steps down, so the timed steps are also the measured ones.
    times, t_micro, t_optimizer = time_steps(trainee, batches, config, schedule.timed_steps,
                                             sync=lambda: torch.cuda.synchronize(dev), device=dev)
    peak_bytes = torch.cuda.max_memory_allocated(dev)
    reserved_bytes = torch.cuda.max_memory_reserved(dev)
    measured, _how = context_bytes_now(dev)
    context = measured if measured is not None else expected
    card_bytes = reserved_bytes + context
    if budget_bytes is not None and card_bytes > budget_bytes:
        return _failed("oom", f"reserved {reserved_bytes} + context {context} = {card_bytes} bytes: over the "
                              f"budget of {budget_bytes} bytes (the card would not hold it)")
    model = trainee.model
    params = storage_bytes(list(model.parameters()) + list(model.buffers()))
    grads = storage_bytes([p.grad for p in model.parameters() if p.grad is not None])
    state = optimizer_state_bytes(trainee.optimizer)
    inputs = storage_bytes(batches)  # the data loader's batches occupy the device too
    breakdown = {
        "params_bytes": params, "grads_bytes": grads, "optimizer_bytes": state,
        # Allocator statistics have no categories: activations are the rest of the peak.
        "activations_bytes": max(0, peak_bytes - params - grads - state - inputs),
        "temporary_bytes": 0, "overhead_bytes": inputs,
    }
    out = _result(workload, config, peak_bytes, reserved_bytes, breakdown, t_micro, t_optimizer, times)
    out.update(context_bytes=int(context), context_measured=measured is not None, peak_card_bytes=int(card_bytes))
    return out


def expected_context_bytes(device: torch.device) -> int:
    """The context this process will hold: the larger of what it holds now and what the device probe
    measured after its warm-up (cached on disk); the fallback constant when neither is known."""
    from autofit.probes.device_rates import cached_rates

    now, _ = context_bytes_now(device)
    rates = cached_rates("cuda")
    probed = rates.memory_overhead() if rates is not None else None
    known = [x for x in (now, probed.context_bytes if probed else None) if x is not None]
    return max(known) if known else fallback_overhead().context_bytes


def time_micro_and_optimizer_steps(trainee, micro_batches: list, repeats: int,
                                   sync: Callable[[], None] = lambda: None,
                                   clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """Median seconds of one micro-step (``forward_backward``) and of one optimizer step.

    Runs ``repeats`` steps of ``len(micro_batches)`` micro-steps each, exactly as
    :func:`autofit.runtime.training.train_step` does, timing each part; ``sync`` waits for the device
    (``torch.cuda.synchronize`` on CUDA) before reading ``clock`` (wall time by default).
    """
    micro_s: list[float] = []
    optimizer_s: list[float] = []
    for _ in range(repeats):
        trainee.optimizer.zero_grad(set_to_none=True)
        for inputs, targets in micro_batches:
            sync()
            start = clock()
            forward_backward(trainee, inputs, targets)
            sync()
            micro_s.append(clock() - start)
        start = clock()
        optimizer_step(trainee)
        sync()
        optimizer_s.append(clock() - start)
    return statistics.median(micro_s), statistics.median(optimizer_s)


def time_steps(trainee, micro_batches: list, config: TrainConfig, repeats: int,
               sync: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.perf_counter,
               device: torch.device | None = None) -> tuple[StepTimes, float, float]:
    """Time ``repeats`` steps that no other process starved (taking more to replace starved ones while
    :func:`~autofit.runtime.timing.more_steps_due`), each as :func:`autofit.runtime.training.train_step` runs it.

    Returns the steps' :class:`~autofit.runtime.timing.StepTimes` and the micro-step and optimizer
    step seconds of its best step (composed by :func:`compose_step_time` into ``best_s``). On
    CUDA (``device``) each step's event time is recorded beside its wall time.
    """
    steps = StepClock(clock)
    samples, parts = [], []
    while not samples or more_steps_due(samples, repeats):
        sample, part = step_sample(trainee, micro_batches, config, sync, steps, device)
        samples.append(sample)
        parts.append(part)
    times = StepTimes(tuple(samples), torch.get_num_threads(), cpus_available())
    t_micro, t_optimizer = parts[samples.index(times.best)]
    return times, t_micro, t_optimizer


def step_sample(trainee, micro_batches: list, config: TrainConfig, sync, steps: StepClock,
                device: torch.device | None) -> tuple[StepSample, tuple[float, float]]:
    """Time one step (:func:`timed_step`) and compose it for ``config``: its sample on ``steps`` (with its CUDA
    event time on ``device``) and its (micro-step, optimizer step) seconds."""
    events = cuda_events(device)
    micro_s, optimizer_s = timed_step(trainee, micro_batches, sync, steps, events)
    t_micro = statistics.fmean(micro_s)
    device_s = events[0].elapsed_time(events[1]) / 1000.0 if events else None
    return steps.step_sample(compose_step_time(config, t_micro, optimizer_s), device_s), (t_micro, optimizer_s)


def timed_step(trainee, micro_batches: list, sync, steps: StepClock, events) -> tuple[list[float], float]:
    """One step as :func:`autofit.runtime.training.train_step` runs it, each part timed on ``steps``;
    returns the micro-steps' seconds and the optimizer step's."""
    trainee.optimizer.zero_grad(set_to_none=True)
    micro_s = []
    for inputs, targets in micro_batches:
        sync()
        steps.start()
        if events and not micro_s:
            events[0].record()
        forward_backward(trainee, inputs, targets)
        sync()
        micro_s.append(steps.stop())
    steps.start()
    optimizer_step(trainee)
    if events:
        events[1].record()
    sync()
    return micro_s, steps.stop()


def cuda_events(device):
    """A start and an end event for timing a step on CUDA; None elsewhere."""
    if device is None or device.type != "cuda":
        return None
    return (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))


def compose_step_time(config: TrainConfig, micro_step_time_s: float, optimizer_step_time_s: float) -> float:
    """Seconds per optimizer step: ``grad_accum`` micro-steps and one optimizer step."""
    return config.grad_accum * micro_step_time_s + optimizer_step_time_s


def trial_micro_batches(workload: Workload, config: TrainConfig, device: torch.device,
                        schedule: MeasureSchedule | None = None) -> list:
    """The micro-batches one measured step runs on one device: ``schedule.micro_steps(grad_accum)`` of them."""
    count = (schedule or MeasureSchedule()).micro_steps(config.grad_accum)
    return make_micro_batches(workload, dataclasses.replace(config, grad_accum=count), device)


def _result(workload: Workload, config: TrainConfig, peak_bytes: int | None, reserved_bytes: int | None,
            breakdown: dict | None, t_micro: float, t_optimizer: float, times: StepTimes | None = None) -> dict:
    """An ok trial's result; ``peak_bytes`` and ``breakdown`` None for a throughput sample."""
    step_time_s = compose_step_time(config, t_micro, t_optimizer)
    samples_per_s = config.samples_per_step / step_time_s
    return {**(times.to_dict() if times is not None else {}),
        "status": "ok", "error": None,
        "peak_bytes": None if peak_bytes is None else int(peak_bytes),
        "per_device_peak_bytes": [] if peak_bytes is None else [int(peak_bytes)],
        "peak_reserved_bytes": None if reserved_bytes is None else int(reserved_bytes),
        "breakdown": {k: None if breakdown is None else int(breakdown[k]) for k in BREAKDOWN_KEYS},
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * workload.tokens_per_sample if workload.tokens_per_sample else None,
        "step_time_s": step_time_s, "micro_step_time_s": t_micro, "optimizer_step_time_s": t_optimizer,
    }


def _failed(status: str, error: str) -> dict:
    return {"status": status, "error": error, "peak_bytes": None, "per_device_peak_bytes": [],
            "peak_reserved_bytes": None, "breakdown": dict.fromkeys(BREAKDOWN_KEYS),
            "samples_per_s": None, "tokens_per_s": None, "step_time_s": None,
            "micro_step_time_s": None, "optimizer_step_time_s": None}


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _measure_split(workload: Workload, config: TrainConfig, *, device_type: str, budget_bytes: int | None,
                   schedule: MeasureSchedule) -> dict:
    """Device split > 1: PyTorch's pipeline engine (:func:`autofit.trial.pipeline.measure_split`) or
    FSDP2 ranks (:func:`autofit.trial.fsdp.measure_fsdp`), as ``config.split_mode`` says."""
    engine = "autofit.trial.fsdp.measure_fsdp" if config.split_mode is SplitMode.FSDP else "autofit.trial.pipeline.measure_split"
    try:  # torch.distributed is missing from some torch builds
        if config.split_mode is SplitMode.FSDP:
            from autofit.trial.fsdp import measure_fsdp as measure
        else:
            from autofit.trial.pipeline import measure_split as measure
    except ImportError as exc:
        return _failed("error", f"device_split={config.device_split} needs {engine}, which is not available ({exc})")
    out: dict[str, Any] = measure(workload, config, device_type=device_type, steps=schedule, budget_bytes=budget_bytes)
    status = result_status(out, missing=TrialStatus.OK)
    if status is not TrialStatus.OK:
        return _failed(status.value, out.get("error") or f"pipeline trial ended with status {status}")
    per_device = [int(b) for b in out.get("per_device_peak_bytes") or []]
    step_time_s = float(out["step_time_s"])
    breakdown = out.get("breakdown") or {}
    samples_per_s = config.samples_per_step / step_time_s
    return {
        "status": "ok", "error": None,
        "peak_bytes": max(per_device) if per_device else None, "per_device_peak_bytes": per_device,
        "peak_reserved_bytes": None,
        "breakdown": {k: None if breakdown.get(k) is None else int(breakdown[k]) for k in BREAKDOWN_KEYS},
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * workload.tokens_per_sample if workload.tokens_per_sample else None,
        "step_time_s": step_time_s, "micro_step_time_s": None, "optimizer_step_time_s": None,
        "tracked_s": out.get("tracked_s"),
    }

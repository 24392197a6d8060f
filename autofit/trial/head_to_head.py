"""Time several configs that share one build in one process, their timed steps interleaved.

Configs with the same :attr:`autofit.core.config.TrainConfig.build` (precision, checkpointing,
optimizer, offload) train the same model with the same optimizer and differ only in micro-batch and
accumulation, so one model and optimizer serve them all: each config's steps run in turn (A B C, then
C B A, ...), a fraction of a second apart, so a slow spell of the machine falls on them more alike
(measured: the spread of two configs' ratio 9.9% against 13.6% in separate trials).

The search does not rank by it: timed this way, configs of one build read closer than each trains in a
process of its own (gpt-tiny, bf16 micro-batch 32 x 2 against 64 x 1: alike head to head, 6% apart
in trials of their own and over 15 steps each; docs/facts.md#throughput-noise). It stays as the
instrument that measures that (``scripts/head_to_head_spread.py``).

Memory is not measured here: the model and optimizer state are shared, so the process holds one
copy; the activations of one config's step are freed before the next config's step starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from autofit.core.config import TrainConfig
from autofit.runtime.schedule import MeasureSchedule
from autofit.runtime.timing import (
    MAX_RETIMED_STEPS,
    StepClock,
    StepTimes,
    cpus_available,
    more_steps_due,
)
from autofit.runtime.training import build_trainee, train_step
from autofit.trial.measure import compose_step_time, step_sample, trial_micro_batches
from autofit.workloads.base import Workload


def check_shared_build(configs: Sequence[TrainConfig]) -> None:
    """Raises ValueError unless there are two or more distinct configs, all of one build on one device."""
    if len(configs) < 2 or len(set(configs)) != len(configs):
        raise ValueError(f"a head-to-head needs two or more distinct configs, got {len(configs)}")
    builds = {c.build for c in configs}
    if None in builds or len(builds) != 1:
        raise ValueError("a head-to-head times configs of one build (precision, checkpointing, optimizer, "
                         "offload) on one device: " + ", ".join(c.short() for c in configs))


def measure_head_to_head(workload: Workload, configs: Sequence[TrainConfig], *, device: str = "cpu",
                         schedule: MeasureSchedule | None = None) -> list[dict]:
    """Time ``configs`` (one build: :func:`check_shared_build`) on one model and optimizer, interleaved.

    Each config first runs ``schedule.warmup_steps`` steps of its own shape; then rounds of one
    timed step per config, in alternating order, until each has ``schedule.timed_steps`` steps
    that no other process starved (:func:`~autofit.runtime.timing.more_steps_due`). Returns one
    JSON-ready dict per config, in order, with the timing keys of
    :func:`autofit.trial.measure.measure_trial` (``samples_per_s``, ``step_time_s``, the timed
    steps' record) and no memory figures (``peak_bytes`` None: see the module docstring).
    """
    check_shared_build(configs)
    schedule = schedule or MeasureSchedule()
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device()))
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    shared = build_trainee(workload, configs[0], dev)
    # Per config: the same model and optimizer under its own config (forward_backward divides the
    # loss by its grad_accum), and its own micro-batches.
    trainees = [dataclasses.replace(shared, config=c) for c in configs]
    batches = [trial_micro_batches(workload, c, shared.device, schedule) for c in configs]
    for trainee, micro_batches in zip(trainees, batches):
        for _ in range(schedule.warmup_steps):
            train_step(trainee, micro_batches)
    sync()
    clocks = [StepClock() for _ in configs]
    samples: list[list] = [[] for _ in configs]
    parts: list[list] = [[] for _ in configs]
    for round_index in range(schedule.timed_steps + MAX_RETIMED_STEPS):
        order = range(len(configs)) if round_index % 2 == 0 else reversed(range(len(configs)))
        for k in order:
            if samples[k] and not more_steps_due(samples[k], schedule.timed_steps):
                continue
            sample, part = step_sample(trainees[k], batches[k], configs[k], sync, clocks[k], dev)
            samples[k].append(sample)
            parts[k].append(part)
        if not any(more_steps_due(done, schedule.timed_steps) for done in samples):
            break
    return [_timing_result(workload, c, StepTimes(tuple(s), torch.get_num_threads(), cpus_available()), p)
            for c, s, p in zip(configs, samples, parts)]


def _timing_result(workload: Workload, config: TrainConfig, times: StepTimes, parts: list) -> dict:
    t_micro, t_optimizer = parts[times.samples.index(times.best)]
    step_time_s = compose_step_time(config, t_micro, t_optimizer)
    samples_per_s = config.samples_per_step / step_time_s
    return {**times.to_dict(), "status": "ok", "error": None, "config": config.to_dict(),
            "peak_bytes": None, "per_device_peak_bytes": [],
            "samples_per_s": samples_per_s,
            "tokens_per_s": samples_per_s * workload.tokens_per_sample if workload.tokens_per_sample else None,
            "step_time_s": step_time_s, "micro_step_time_s": t_micro, "optimizer_step_time_s": t_optimizer}

"""Trials in child processes: every outcome is a result, and nothing is left behind."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from trial_workloads import mlp_workload

from autofit.core.config import TrainConfig
from autofit.runtime import forkserver
from autofit.runtime.schedule import MeasureSchedule
from autofit.runtime.tracker import CATEGORIES
from autofit.runtime.training import build_trainee
from autofit.trial.measure import (
    compose_step_time,
    measure_trial,
    time_micro_and_optimizer_steps,
    trial_micro_batches,
)
from autofit.trial.run import TrialResult, TrialStatus, run_trial

CONFIG = TrainConfig(micro_batch=8)


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a zombie holds no memory and runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] != b"Z"


def _live_children() -> list[int]:
    children = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # state ppid pgrp ...
        if int(fields[1]) == os.getpid() and fields[0] != b"Z":
            children.append(int(entry))
    return children


@pytest.fixture
def pidfile(tmp_path, monkeypatch):
    """Trial processes (and the hang workload's grandchild) append their pids here."""
    path = tmp_path / "pids"
    monkeypatch.setenv("AUTOFIT_TEST_PIDFILE", str(path))
    before = set(_live_children())  # other tests' helpers (e.g. multiprocessing's resource tracker) may stay
    yield path
    forkserver.stop_server()  # the trials' fork server outlives a trial by design; stopped, nothing may stay
    assert set(_live_children()) - before == set(), "a trial left a child process behind"


def _recorded(pidfile) -> list[int]:
    return [int(line) for line in pidfile.read_text().split()] if pidfile.exists() else []


def _assert_gone(pids: list[int]) -> None:
    assert pids, "the workload did not record its process"
    alive = [pid for pid in pids if _running(pid)]
    assert alive == [], f"processes left behind: {alive}"


def test_ok_trial_measures_and_round_trips(trial_workload_spec, pidfile):
    result = run_trial(trial_workload_spec("tiny"), TrainConfig(micro_batch=8, grad_accum=4), timeout_s=120)
    assert result.status is TrialStatus.OK, result.error
    assert result.workload == "tiny-mlp" and result.device == "cpu" and result.error is None
    assert result.peak_bytes == sum(result.breakdown.values()) and result.per_device_peak_bytes == [result.peak_bytes]
    assert set(result.breakdown) == set(CATEGORIES)
    params = sum(p.numel() * 4 for p in mlp_workload().model().parameters())
    assert result.breakdown["params_bytes"] == result.breakdown["grads_bytes"] == params
    assert result.breakdown["optimizer_bytes"] == 2 * params + 4 * 10  # AdamW: 2 moments, a step scalar per tensor
    assert result.step_time_s == pytest.approx(4 * result.micro_step_time_s + result.optimizer_step_time_s)
    assert result.samples_per_s == pytest.approx(32 / result.step_time_s)
    assert result.tokens_per_s == pytest.approx(result.samples_per_s)  # tokens_per_sample=1
    data = json.loads(json.dumps(result.to_dict()))
    assert data["config"] == {"precision": "fp32", "micro_batch": 8, "grad_accum": 4, "checkpoint_every": 0,
                              "device_split": 1, "split_mode": "pipeline", "optimizer": "as-given",
                              "checkpoint_policy": "full", "offload": "none"}
    assert data["status"] == "ok"
    assert TrialResult.from_dict(data) == result
    _assert_gone(_recorded(pidfile))


def test_over_budget_is_oom(trial_workload_spec, pidfile):
    result = run_trial(trial_workload_spec("wide"), CONFIG, budget_bytes=100_000, timeout_s=120)
    assert result.status is TrialStatus.OOM
    assert "over the budget of 100000 bytes" in result.error
    assert result.peak_bytes is None and result.budget_bytes == 100_000
    _assert_gone(_recorded(pidfile))


def test_raising_workload_is_error_with_the_last_line(trial_workload_spec, pidfile):
    result = run_trial(trial_workload_spec("raising"), CONFIG, timeout_s=120)
    assert result.status is TrialStatus.ERROR
    assert result.error == "ValueError: shape mismatch (8, 8) vs (8,)"
    assert result.workload == "raising"
    _assert_gone(_recorded(pidfile))


def test_segfault_is_error(trial_workload_spec, pidfile):
    result = run_trial(trial_workload_spec("segfault"), CONFIG, timeout_s=120)
    assert result.status is TrialStatus.ERROR
    assert result.error == "killed by signal SIGSEGV"
    _assert_gone(_recorded(pidfile))


def test_hang_is_timeout_and_kills_the_whole_group(trial_workload_spec, pidfile):
    # Long enough for the child to start and reach the hang on a loaded machine.
    result = run_trial(trial_workload_spec("hang"), CONFIG, timeout_s=15)
    assert result.status is TrialStatus.TIMEOUT
    assert result.error == "exceeded the wall-clock limit of 15 s"
    assert result.wall_s >= 15
    pids = _recorded(pidfile)
    assert len(pids) == 2  # the trial child and the grandchild it started
    _assert_gone(pids)


def test_unloadable_spec_is_error(tmp_path, pidfile):
    result = run_trial(f"{tmp_path / 'missing.py'}:make", CONFIG, timeout_s=120)
    assert result.status is TrialStatus.ERROR
    assert result.error.startswith("WorkloadError: ") and "no such file" in result.error


def test_workload_without_source_runs_in_a_forked_child(pidfile):
    workload = mlp_workload()  # built in Python with closures: no source, cannot be pickled
    assert workload.source is None
    torch.ones(256, 256) @ torch.ones(256, 256)  # this process has used the OpenMP pool: the child must cope
    with pytest.warns(RuntimeWarning, match="forked child"):
        result = run_trial(workload, CONFIG, timeout_s=120)
    assert result.status is TrialStatus.OK, result.error
    assert result.workload == "tiny-mlp" and result.peak_bytes > 0


def test_split_without_the_pipeline_engine_is_an_error_not_a_crash(monkeypatch):
    monkeypatch.setitem(sys.modules, "autofit.trial.pipeline", None)  # import fails as if the module were missing
    result = measure_trial(mlp_workload(), TrainConfig(micro_batch=2, device_split=2))
    assert result["status"] == "error" and "autofit.trial.pipeline.measure_split" in result["error"]
    assert result["peak_bytes"] is None and set(result["breakdown"]) == set(CATEGORIES)


def test_checkpointing_lowers_measured_activations(one_thread):
    workload = mlp_workload(dim=64, depth=6)
    plain = measure_trial(workload, TrainConfig(micro_batch=64), measure_steps=1)
    ckpt = measure_trial(workload, TrainConfig(micro_batch=64, checkpoint_every=1), measure_steps=1)
    assert plain["status"] == ckpt["status"] == "ok"
    assert ckpt["breakdown"]["params_bytes"] == plain["breakdown"]["params_bytes"]
    assert ckpt["peak_bytes"] < plain["peak_bytes"]


def test_step_time_is_composed_from_medians_of_the_micro_steps_run():
    """The timed loop reads the clock around each micro-step and each optimizer step; the step
    time counts ``grad_accum`` micro-steps although only 3 of them run. A clock that advances
    by one second per read makes each part last exactly one second."""
    workload = mlp_workload()
    config = TrainConfig(micro_batch=2, grad_accum=5)
    trainee = build_trainee(workload, config)
    batches = trial_micro_batches(workload, config, trainee.device)
    assert len(batches) == 3  # at most 3 micro-batches a measured step (MeasureSchedule.micro_steps_per_step)
    ticks = iter(range(1000))
    t_micro, t_optimizer = time_micro_and_optimizer_steps(trainee, batches, 2, clock=lambda: float(next(ticks)))
    assert (t_micro, t_optimizer) == (1.0, 1.0)
    assert next(ticks) == 2 * (3 + 1) * 2  # two reads per timed part: 3 micro-steps + 1 optimizer step, 2 steps
    assert compose_step_time(config, t_micro, t_optimizer) == 5 * 1.0 + 1.0


@pytest.mark.cuda
def test_cuda_trial_measures_allocator_peak():
    result = run_trial("gpt-tiny", TrainConfig(precision="amp-bf16", micro_batch=4), device="cuda", timeout_s=300)
    assert result.status is TrialStatus.OK, result.error
    assert result.peak_reserved_bytes >= result.peak_bytes > 0
    assert not torch.cuda.is_initialized()  # the parent never touched the GPU


@pytest.mark.cuda
def test_cuda_trial_over_budget_is_oom():
    result = run_trial("gpt-tiny", TrainConfig(micro_batch=64), device="cuda", budget_bytes=4 << 20, timeout_s=300)
    assert result.status is TrialStatus.OOM, result.error
    assert not torch.cuda.is_initialized()


def test_starved_steps_are_taken_again_and_never_the_figure(monkeypatch):
    """The first two timed steps' threads waited on the run queue half of each part: they are taken
    again, and the throughput is the fastest step that did not wait (load only slows a step down)."""
    from autofit.runtime import timing
    from autofit.trial.measure import time_steps

    workload = mlp_workload()
    config = TrainConfig(micro_batch=2, grad_accum=2)
    trainee = build_trainee(workload, config)
    batches = trial_micro_batches(workload, config, trainee.device)
    parts_per_step = len(batches) + 1
    state = {"reads": 0, "wait_ns": 0}

    def schedstats():  # read at the start and end of each timed part; each part of the first two steps waits 0.5 s
        state["reads"] += 1
        part = (state["reads"] - 1) // 2
        if state["reads"] % 2 == 0 and part < 2 * parts_per_step:
            state["wait_ns"] += 5 * 10**8
        return {"1": (10**9 * state["reads"], state["wait_ns"])}

    monkeypatch.setattr(timing, "_schedstats", schedstats)
    ticks = iter(range(10_000))
    times, t_micro, t_optimizer = time_steps(trainee, batches, config, 3, clock=lambda: float(next(ticks)))
    assert times.starved_steps == 2 and len(times.samples) == 5
    assert [s.starved for s in times.samples] == [True, True, False, False, False]
    assert times.best_s == compose_step_time(config, t_micro, t_optimizer) == 2 * 1.0 + 1.0


def test_a_throughput_sample_reads_no_memory_and_runs_no_tracker(monkeypatch):
    import autofit.trial.measure as measure

    workload = mlp_workload()
    full = measure_trial(workload, TrainConfig(micro_batch=4, grad_accum=2))
    assert full["status"] == "ok" and full["peak_bytes"] > 0 and full["tracked_s"] > 0

    def no_tracker(*args, **kwargs):
        raise AssertionError("a throughput sample built a memory tracker")

    monkeypatch.setattr(measure, "MemoryTracker", no_tracker)
    sample = measure_trial(workload, TrainConfig(micro_batch=4, grad_accum=2), schedule=MeasureSchedule(memory=False))
    assert sample["status"] == "ok" and sample["samples_per_s"] > 0 and "tracked_s" not in sample
    assert sample["peak_bytes"] is None and sample["per_device_peak_bytes"] == []
    assert set(sample["breakdown"]) == set(CATEGORIES) and not any(sample["breakdown"].values())


def test_a_throughput_sample_of_a_pipeline_split_reads_no_memory():
    from trial_workloads import TINY_LM

    full = run_trial(TINY_LM, TrainConfig(micro_batch=1, grad_accum=2, device_split=2), timeout_s=120)
    assert full.ok and full.peak_bytes > 0 and full.tracked_s > 0, full.error
    result = run_trial(TINY_LM, TrainConfig(micro_batch=1, grad_accum=2, device_split=2),
                       schedule=MeasureSchedule(memory=False), timeout_s=120)
    assert result.ok and result.samples_per_s > 0, result.error
    assert result.peak_bytes is None and result.per_device_peak_bytes == [] and result.tracked_s is None

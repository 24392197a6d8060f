"""FSDP2 ranks (gloo, one process each) against the unsharded run on the same samples."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autofit.core.config import TrainConfig
from autofit.runtime.training import build_trainee, make_micro_batches, train_step
from autofit.trial.fsdp import fsdp_units, measure_fsdp
from autofit.workloads.load import load_workload

SPEC = "tests/fsdp_workloads.py:tiny_decoder"
STEPS = dict(warmup_steps=2, measure_steps=1)  # 2 warm-up + 1 tracked + 3 timed = 6 optimizer steps
N_STEPS = 6


def reference(config: TrainConfig, seed: int = 0):
    """The unsharded run of the whole job: micro_batch × ranks samples per micro-step, same seeds."""
    ranks = config.device_split
    config = dataclasses.replace(config, micro_batch=config.micro_batch * ranks, device_split=1, split_mode="pipeline")
    workload = load_workload(SPEC)
    torch.manual_seed(seed)
    trainee = build_trainee(workload, config)
    torch.manual_seed(seed + 1)
    micro_batches = make_micro_batches(workload, config, torch.device("cpu"))
    losses = [float(train_step(trainee, micro_batches)) for _ in range(N_STEPS)]
    return losses, {name: p.detach().clone() for name, p in trainee.model.named_parameters()}


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
@pytest.mark.parametrize("checkpoint_every", [0, 1])
def test_fsdp_matches_unsharded_loss_and_update(ranks, precision, checkpoint_every):
    config = TrainConfig(precision=precision, micro_batch=2, grad_accum=2, checkpoint_every=checkpoint_every,
                         device_split=ranks, split_mode="fsdp")
    result = measure_fsdp(SPEC, config, device_type="cpu", collect_params=True, timeout_s=300, **STEPS)
    assert result["status"] == "ok", result["error"]
    assert len(result["per_device_peak_bytes"]) == ranks
    ref_losses, ref_params = reference(config)
    # The same sums in another order (each rank's samples, then a reduce-scatter); under amp-bf16
    # the per-rank matmuls round to bf16 on smaller batches.
    tol = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=1e-3, atol=1e-4)
    assert len(result["losses"]) == N_STEPS
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), **tol)
    assert set(result["params"]) == set(ref_params)
    initial = reference_initial()
    for name, value in result["params"].items():
        # the update (change from the shared initial weights), not just the weights
        torch.testing.assert_close(value - initial[name], ref_params[name] - initial[name], **tol)


_initial: dict = {}


def reference_initial() -> dict:
    if not _initial:
        torch.manual_seed(0)
        model = load_workload(SPEC).model()
        _initial.update({name: p.detach().clone() for name, p in model.named_parameters()})
    return _initial


def test_checkpoint_segments_are_fsdp_units():
    assert fsdp_units(5, 0) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert fsdp_units(5, 2) == [(0, 2), (2, 4), (4, 5)]


def test_budget_exceeded_is_oom():
    config = TrainConfig(micro_batch=2, device_split=2, split_mode="fsdp")
    result = measure_fsdp(SPEC, config, device_type="cpu", budget_bytes=20_000, timeout_s=120, **STEPS)
    assert result["status"] == "oom"
    assert "over the budget of 20000 bytes" in result["error"]


def test_workload_without_source_is_a_clear_error():
    workload = dataclasses.replace(load_workload(SPEC), source=None)
    result = measure_fsdp(workload, TrainConfig(device_split=2, split_mode="fsdp"), device_type="cpu")
    assert result["status"] == "error" and "Workload.source" in result["error"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP over NCCL needs two GPUs")
def test_fsdp_on_two_gpus_matches_its_estimate():
    from autofit.estimator.memory_table import estimate_table
    from autofit.profiling.profile import profile_workload

    config = TrainConfig(precision="amp-bf16", micro_batch=2, grad_accum=2, device_split=2, split_mode="fsdp")
    result = measure_fsdp(SPEC, config, device_type="cuda", timeout_s=300, **STEPS)
    assert result["status"] == "ok", result["error"]
    predicted = estimate_table(profile_workload(load_workload(SPEC), ["amp-bf16"], device_type="cuda"), [config])
    # CUDA adds the context and allocator rounding: the estimate includes them, the allocated peak does not
    assert result["peak_bytes"] <= predicted.iloc[0].peak_bytes


def test_a_training_plan_says_how_to_run_fsdp():
    from torch import nn

    from autofit.core.errors import ConfigError
    from autofit.trial.apply import TrainingPlan

    plan = TrainingPlan(TrainConfig(device_split=2, split_mode="fsdp"))
    with pytest.raises(ConfigError, match="autofit.trial.fsdp.shard_model"):
        plan.prepare(nn.Sequential(nn.ModuleList([nn.Linear(2, 2)])))


def test_a_throughput_sample_of_fsdp_ranks_reads_no_memory():
    from autofit.runtime.schedule import MeasureSchedule

    config = TrainConfig(micro_batch=2, device_split=2, split_mode="fsdp")
    full = measure_fsdp(SPEC, config, device_type="cpu", timeout_s=120, **STEPS)
    sample = measure_fsdp(SPEC, config, device_type="cpu", timeout_s=120, steps=MeasureSchedule(memory=False))
    assert full["status"] == "ok" and full["peak_bytes"] > 0 and full["tracked_s"] > 0, full["error"]
    assert sample["status"] == "ok" and sample["step_time_s"] > 0, sample["error"]
    assert sample["peak_bytes"] is None and sample["per_device_peak_bytes"] == [] and sample["tracked_s"] is None

"""Split configs with one rank slowed: the other ranks run ahead and wait with what they hold.

Every rank's measured peak must stay at or under the estimate.
"""

from __future__ import annotations

import pytest

from autofit.core.config import TrainConfig
from autofit.estimator.fsdp_memory import rank_lines
from autofit.estimator.memory_table import estimate_table
from autofit.profiling.profile import profile_workload
from autofit.trial.fsdp import measure_fsdp
from autofit.trial.pipeline.launch import measure_split
from autofit.workloads.load import load_workload

SLOWED = "tests/slow_rank_workloads.py:slow_tiny_decoder"


@pytest.fixture(scope="module")
def workload():
    return load_workload(SLOWED)


@pytest.fixture(scope="module")
def profile(workload):
    return profile_workload(workload, ["fp32"], use_cache=False)


@pytest.mark.parametrize(("config", "slow_rank"), [
    (TrainConfig(split_mode="fsdp", micro_batch=2, device_split=2), 1),
    (TrainConfig(split_mode="fsdp", micro_batch=2, device_split=4, checkpoint_every=2), 0),
])
def test_fsdp_ranks_stay_under_the_estimate(profile, config, slow_rank, monkeypatch):
    monkeypatch.setenv("AUTOFIT_TEST_SLOW_RANK", str(slow_rank))
    measured = measure_fsdp(SLOWED, config, device_type="cpu", warmup_steps=2, measure_steps=2, timeout_s=120)
    assert measured["status"] == "ok", measured["error"]
    predicted = estimate_table(profile, [config]).iloc[0].peak_bytes
    in_flight = rank_lines(profile.for_precision("fp32"), config.device_split, config.checkpoint_every,
                           False).in_flight_bytes
    peaks = measured["per_device_peak_bytes"]
    assert max(peaks) <= predicted, (peaks, predicted)
    # and not far over: at most the collective buffer allowed for in flight, and 8%
    assert (predicted - in_flight - max(peaks)) / max(peaks) <= 0.08, (peaks, predicted, in_flight)


def _assert_stages_under(workload, profile, config: TrainConfig, slow_rank: int, monkeypatch) -> None:
    """Measure ``config`` with stage ``slow_rank`` slowed: each stage at or under its estimate."""
    monkeypatch.setenv("AUTOFIT_TEST_SLOW_RANK", str(slow_rank))
    measured = measure_split(workload, config, device_type="cpu", budget_bytes=None, warmup_steps=2,
                             measure_steps=2, timeout_s=180)
    assert measured["status"] == "ok", measured.get("error")
    predicted = estimate_table(profile, [config]).iloc[0].per_device_peak_bytes
    for stage, (peak, estimate) in enumerate(zip(measured["per_device_peak_bytes"], predicted)):
        # 16 bytes: the last stage's scalars (loss, its scale) are counted to within a few bytes
        assert peak <= estimate + 16, (stage, peak, estimate)
        assert (estimate - peak) / peak <= 0.03, (stage, peak, estimate)


@pytest.mark.parametrize(("config", "slow_rank"), [
    (TrainConfig(split_mode="pipeline", micro_batch=2, grad_accum=2, device_split=2), 0),
    (TrainConfig(split_mode="pipeline", micro_batch=2, grad_accum=3, device_split=3), 2),
])
def test_pipeline_stages_stay_under_the_estimate(workload, profile, config, slow_rank, monkeypatch):
    # the first stage is slowed by its optimizer step, the last by its loss (stages are traced
    # graphs: the layer hooks do not run there)
    _assert_stages_under(workload, profile, config, slow_rank, monkeypatch)


def test_four_pipeline_stages_stay_under_the_estimate(monkeypatch):
    workload = load_workload("tests/slow_rank_workloads.py:slow_deeper_decoder")
    profile = profile_workload(workload, ["fp32"], use_cache=False)
    config = TrainConfig(split_mode="pipeline", micro_batch=2, grad_accum=4, device_split=4)
    _assert_stages_under(workload, profile, config, 3, monkeypatch)  # the last stage, through its loss

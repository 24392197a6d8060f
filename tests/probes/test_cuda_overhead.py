"""The CUDA card's bytes outside the tensors (context, cuBLAS workspace): carried from the device probe
into the estimate, the trial and calibration. The measuring itself needs a GPU (marked ``cuda``)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from trial_workloads import TINY_LM as TINY

from autofit.core.config import TrainConfig
from autofit.core.records import TrialStatus
from autofit.estimator.calibration import measured_peak
from autofit.estimator.memory_model import estimate
from autofit.estimator.memory_table import estimate_table
from autofit.estimator.reserved_model import FITTED
from autofit.probes.cuda_overhead import (
    FALLBACK_CONTEXT_BYTES,
    CudaOverhead,
    fallback_overhead,
)
from autofit.probes.device_rates import (
    DeviceRates,
    cached_rates,
    device_overhead,
    probe_rates,
)
from autofit.profiling.profile import profile_workload
from autofit.runtime.training import cast_fake_in_place
from autofit.trial.run import TrialResult, run_trial
from autofit.workloads.load import load_workload

MiB = 2**20
MEASURED = CudaOverhead(context_bytes=760 * MiB, workspace_bytes=66 * MiB, measured=True, method="nvml per process")


@pytest.fixture(scope="module")
def profiles():
    cpu = profile_workload(load_workload(TINY), ["fp32"], device_type="cpu")
    # The same tensors as a CUDA profile would count (CPU-built: this machine may have no GPU).
    return cpu, dataclasses.replace(cpu, device_type="cuda")


def test_a_measured_context_and_workspace_replace_the_fallback(profiles):
    _, cuda = profiles
    config = TrainConfig(precision="fp32", micro_batch=4)
    assumed = estimate(cuda, config)
    measured = estimate(cuda, config, overhead=MEASURED)
    # the workspace is a block of its own (no fragmentation on it); the context is outside the allocator
    expected = (MEASURED.context_bytes - FALLBACK_CONTEXT_BYTES) + MEASURED.workspace_bytes
    assert measured.peak_bytes - assumed.peak_bytes == pytest.approx(expected, abs=2)
    assert any("ASSUMED" in n for n in assumed.notes)
    assert any("760 MiB" in n and "measured" in n and "ASSUMED" not in n for n in measured.notes)
    table = estimate_table(cuda, [config], budget_bytes=measured.peak_bytes - 1, overhead=MEASURED)
    assert not table.loc[0, "fits"]


def test_the_allocators_reserve_follows_the_tensors_and_checkpointing(profiles):
    _, cuda = profiles
    for every in (0, 1):
        config = TrainConfig(precision="fp32", micro_batch=4, checkpoint_every=every)
        est = estimate(cuda, config, overhead=MEASURED)
        tensors = est.peak_bytes - est.overhead_bytes
        share = FITTED.fragmentation + (FITTED.checkpoint_fragmentation if every else 0.0)
        expected = (MEASURED.context_bytes + MEASURED.workspace_bytes + FITTED.fixed_bytes + FITTED.margin_bytes
                    + share * tensors)
        assert est.overhead_bytes == pytest.approx(expected, abs=2)


def test_a_cached_overhead_of_an_older_version_still_reads():
    old = {**MEASURED.to_dict(), "fragmentation": 0.10}  # what caches written before the fitted reserve hold
    assert CudaOverhead.from_dict(old) == MEASURED


def test_the_cpu_estimate_ignores_any_cuda_overhead(profiles):
    cpu, _ = profiles
    config = TrainConfig(precision="fp32", micro_batch=4)
    plain, given = estimate(cpu, config), estimate(cpu, config, overhead=MEASURED)
    assert plain.peak_bytes == given.peak_bytes and plain.overhead_bytes == 0
    assert not any("CUDA" in n for n in given.notes)
    assert device_overhead("cpu") is None


def test_the_probes_overhead_round_trips_through_the_rates_cache(tmp_path, monkeypatch):
    from autofit.probes import device_rates as time_model

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(time_model, "RATE_AGREEMENT", float("inf"))  # repeats on a loaded machine: not judged here
    assert cached_rates("cpu") is None  # never probes
    rates = probe_rates("cpu")
    assert rates.memory_overhead() is None  # a CPU has none
    assert cached_rates("cpu") == rates
    with_overhead = dataclasses.replace(rates, cuda_overhead=MEASURED.to_dict())
    back = DeviceRates.from_dict(json.loads(json.dumps(with_overhead.to_dict())))
    assert back.memory_overhead() == MEASURED


def test_without_a_device_the_cuda_overhead_is_the_labelled_fallback():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: it is measured")
    found = device_overhead("cuda")
    assert found == fallback_overhead() and not found.measured and "no CUDA device" in found.note()


def test_calibration_and_the_budget_judge_cuda_trials_on_what_the_card_held():
    assert measured_peak({"peak_bytes": 100, "peak_card_bytes": 900}) == 900
    assert measured_peak({"peak_bytes": 100}) == 100  # the CPU
    on_cuda = TrialResult("w", TrainConfig(), "cuda", TrialStatus.OK, peak_bytes=100, peak_reserved_bytes=120,
                          context_bytes=780, peak_card_bytes=900)
    assert on_cuda.judged_peak_bytes == 900
    assert TrialResult.from_dict(on_cuda.to_dict()) == on_cuda
    assert TrialResult("w", TrainConfig(), "cpu", TrialStatus.OK, peak_bytes=100).judged_peak_bytes == 100


def test_casting_a_fake_model_keeps_tied_weights_and_integer_buffers():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
        model[1].weight = model[0].weight  # tied, as language models tie their head
        model.register_buffer("scale", torch.ones(3))
        model.register_buffer("index", torch.arange(3))
        cast_fake_in_place(model, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and p.requires_grad for p in model.parameters())
    assert model[1].weight is model[0].weight and len(list(model.parameters())) == 2
    assert model.scale.dtype == torch.bfloat16 and model.index.dtype == torch.int64


def test_gpu_check_predicts_allocated_as_tensors_plus_workspace():
    from test_gpu_check import gc

    tensors = 1000 * MiB
    peak = tensors * 1.3 + MEASURED.context_bytes + MEASURED.workspace_bytes
    est = SimpleNamespace(device_type="cuda", peak_bytes=peak, overhead_bytes=peak - tensors)
    assert gc.predicted_allocated(est, MEASURED) == pytest.approx(tensors + MEASURED.workspace_bytes, abs=1)


@pytest.mark.cuda
def test_the_probe_measures_the_context_and_workspace_on_the_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    overhead = probe_rates("cuda").memory_overhead()
    assert overhead is not None and 0 < overhead.workspace_bytes < 1024 * MiB
    assert 50 * MiB < overhead.context_bytes < 4096 * MiB or not overhead.measured


@pytest.mark.cuda
def test_a_cuda_trial_under_a_budget_fits_the_card_with_its_context():
    budget = 2 * 10**9
    result = run_trial("gpt-tiny", TrainConfig(precision="amp-bf16", micro_batch=4), device="cuda",
                       budget_bytes=budget, timeout_s=300)
    assert result.ok, result.error
    assert result.peak_card_bytes == result.peak_reserved_bytes + result.context_bytes <= budget


@pytest.mark.cuda
def test_an_lstm_profiles_for_cuda_on_fake_tensors():
    profile = profile_workload(load_workload("lstm-lm"), ["fp32"], device_type="cuda")
    assert estimate(profile, TrainConfig(precision="fp32", micro_batch=2)).peak_bytes > 0

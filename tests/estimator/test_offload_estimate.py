"""The offload lever in the estimate: what leaves the device, what the host must hold, and when it is pruned.

This machine has no CUDA, so the CUDA estimate is taken from a CPU profile relabelled ``cuda``: the
lines are the CPU's (no 512-byte blocks), which is what these tests compare against; the real CUDA
run is ``scripts/gpu_check.py``'s.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autofit.core.config import TrainConfig
from autofit.core.errors import ConfigError
from autofit.estimator.memory_model import estimate
from autofit.estimator.memory_table import estimate_table
from autofit.estimator.offload_memory import host_need
from autofit.probes.cuda_overhead import fallback_overhead
from autofit.profiling.profile import profile_workload
from autofit.runtime import offload as offload_runtime
from autofit.runtime.offload import MIN_OFFLOAD_NUMEL
from trial_workloads import mlp_workload

LARGE_HOST = 1 << 40


@pytest.fixture(scope="module")
def workload():
    # four 256x256 blocks (offloaded) and an 8x256 head with biases (each under 4096 elements: kept)
    return mlp_workload(name="wide-mlp", dim=256)


@pytest.fixture(scope="module")
def cpu_profile(workload):
    return profile_workload(workload, ["fp32"], optimizers=["adafactor"])


@pytest.fixture(scope="module")
def cuda_profile(cpu_profile):
    return dataclasses.replace(cpu_profile, device_type="cuda")


def _real_state_bytes(workload, large: bool) -> int:
    """The state a real AdamW step leaves for the parameters of 4096 elements or more (or the others)."""
    model = workload.model()
    optimizer = workload.optimizer(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return sum(t.numel() * t.element_size() for p, state in optimizer.state.items()
               if (p.numel() >= MIN_OFFLOAD_NUMEL) == large for t in state.values() if isinstance(t, torch.Tensor))


def test_offload_on_the_cpu_is_pruned_with_its_reason(cpu_profile):
    table = estimate_table(cpu_profile, [TrainConfig("fp32", 4), TrainConfig("fp32", 4, offload="optimizer")])
    assert list(table["valid"]) == [True, False]
    assert table["reason"][1].startswith("offload=optimizer keeps the optimizer's state on the host: on device cpu "
                                         "it is there already")
    with pytest.raises(ConfigError, match="on device cpu it is there already"):
        estimate(cpu_profile, TrainConfig("fp32", 4, offload="optimizer"))


def test_the_device_keeps_only_the_small_parameters_state(workload, cuda_profile):
    given = estimate(cuda_profile, TrainConfig("fp32", 4), host_bytes=LARGE_HOST)
    offloaded = estimate(cuda_profile, TrainConfig("fp32", 4, offload="optimizer"), host_bytes=LARGE_HOST)
    large, small = _real_state_bytes(workload, True), _real_state_bytes(workload, False)
    # the profile's state is the real one's; what stays is the small tensors' share, counted in the card's
    # 512-byte blocks (this CPU profile's state is not rounded: the kept state is high by their rounding)
    assert given.optimizer_bytes == large + small
    small_tensors = 6  # four block biases, the head's weight and bias
    # (and a fused step counter on the card each)
    assert small <= offloaded.optimizer_bytes <= small + 3 * 512 * small_tensors
    assert large - 3 * 512 * small_tensors <= given.optimizer_bytes - offloaded.optimizer_bytes <= large
    assert offloaded.params_bytes == given.params_bytes
    assert offloaded.model_state_bytes == given.model_state_bytes  # the whole state, wherever it lives
    # the card holds more context in a process that offloads (no card here: the fallback's figure), and
    # the allocator's reserve shrinks a little with the state that left
    more_context = fallback_overhead().offload_context_bytes
    assert 0 < more_context - (offloaded.overhead_bytes - given.overhead_bytes) < 0.1 * more_context
    assert offloaded.peak_bytes - more_context < given.peak_bytes
    assert any(n.startswith("offload=optimizer: ") and "on the host" in n for n in offloaded.notes)


def test_the_host_holds_pinned_copies_and_the_offloaded_state(workload, cuda_profile):
    need = host_need(cuda_profile.for_precision("fp32"))
    block = 256 * 256 * 4  # a power of two already: pinned blocks round up to one
    assert need.pinned_bytes == 2 * 4 * block  # each block's weight and its gradient
    # counted per byte on the host: its step counters are shared out by gradient bytes, a few bytes off
    assert abs(need.state_bytes - _real_state_bytes(workload, True)) <= 4 * 10
    assert need.step_bytes == 4 * block
    assert need.host_bytes == need.pinned_bytes + need.state_bytes + need.step_bytes


def test_a_host_too_small_is_a_prune_reason(cuda_profile):
    config = TrainConfig("fp32", 4, offload="optimizer")
    row = estimate_table(cuda_profile, [config], host_bytes=1 << 20).iloc[0]
    assert not row["valid"]
    assert row["reason"].startswith("offload=optimizer needs 5.00 MiB on the host (pinned copies 2.00 MiB, "
                                    "optimizer state 2.00 MiB, step 1.00 MiB)")
    assert row["reason"].endswith("more than this machine's 1.00 MiB")
    assert estimate_table(cuda_profile, [config], host_bytes=LARGE_HOST).iloc[0]["valid"]


def test_fsdp_ranks_with_offload_are_pruned(cuda_profile):
    config = TrainConfig("fp32", 4, device_split=2, split_mode="fsdp", offload="optimizer")
    row = estimate_table(cuda_profile, [config], host_bytes=LARGE_HOST).iloc[0]
    assert not row["valid"]
    assert row["reason"].startswith("offload=optimizer with split_mode=fsdp: FSDP2's CPUOffloadPolicy")


@pytest.mark.parametrize("config,optimizer,reason", [
    (TrainConfig("amp-fp16", 4, offload="optimizer"), "AdamW", "offload=optimizer with amp-fp16: the GradScaler"),
    (TrainConfig("fp32", 4, optimizer="adamw8bit", offload="optimizer"), "AdamW",
     "offload=optimizer with optimizer=adamw8bit: not combined"),
    (TrainConfig("fp32", 4, offload="optimizer"), "SGD",
     "the workload's optimizer is SGD: offload=optimizer wraps only torch.optim.Adam, torch.optim.AdamW"),
], ids=["amp-fp16", "adamw8bit", "sgd"])
def test_combinations_it_does_not_run_say_why(config, optimizer, reason):
    assert offload_runtime.refusal(config, optimizer, "cuda").startswith(reason)
    assert offload_runtime.refusal(dataclasses.replace(config, offload="none"), optimizer, "cuda") is None


def test_without_torchao_offload_is_pruned_saying_how_to_install(cuda_profile, monkeypatch):
    monkeypatch.setattr(offload_runtime.importlib.util, "find_spec", lambda name: None)
    row = estimate_table(cuda_profile, [TrainConfig("fp32", 4, offload="optimizer")], host_bytes=LARGE_HOST).iloc[0]
    assert row["reason"] == ("offload=optimizer needs torchao, which is not installed: "
                             "pip install 'autofit[offload]'")


def test_offload_with_adafactor_moves_adafactors_state(cuda_profile):
    config = TrainConfig("fp32", 4, optimizer="adafactor")
    lean = estimate(cuda_profile, config, host_bytes=LARGE_HOST)
    offloaded = estimate(cuda_profile, dataclasses.replace(config, offload="optimizer"), host_bytes=LARGE_HOST)
    assert 0 < offloaded.optimizer_bytes < lean.optimizer_bytes


def test_advice_says_when_offload_would_fit_one_device(cpu_profile):
    from autofit.estimator.advice import advise

    # blocks large enough that their Adam state outweighs the context an offloading process adds
    wide = profile_workload(mlp_workload(name="wider-mlp", dim=2048), ["fp32"], optimizers=["adafactor"])
    cuda_profile = dataclasses.replace(wide, device_type="cuda")
    given = estimate(cuda_profile, TrainConfig("fp32", 1), host_bytes=LARGE_HOST)
    offloaded = estimate(cuda_profile, TrainConfig("fp32", 1, offload="optimizer"), host_bytes=LARGE_HOST)
    budget = (given.peak_bytes + offloaded.peak_bytes) // 2  # fits only with the state on the host
    lines = advise(cuda_profile, budget, ["fp32"]).lines
    assert any(line.startswith("with offload=optimizer (the optimizer state on the host; it does not change the "
                               "training): fp32 with checkpoint_every=") for line in lines)
    assert not any("offload" in line for line in advise(cpu_profile, 10**5, ["fp32"]).lines)  # not on the CPU

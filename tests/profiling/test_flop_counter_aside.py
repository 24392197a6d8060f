"""The FLOP counter beside the memory timeline: an operator torch counts by its decomposition
(``silu_backward`` has no formula) runs whole as far as the timeline sees, as the real step runs it,
and its FLOPs are still counted. A user's conv-GroupNorm-SiLU net (tests/silu_workloads.py) is then
estimated to the byte at micro-batches the profile never ran."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from autofit import TrainConfig
from autofit.estimator.memory_model import estimate
from autofit.profiling.flops import flop_counter
from autofit.profiling.profile import profile_workload
from autofit.profiling.timeline import Timeline
from autofit.trial.measure import measure_trial
from autofit.workloads.load import load_workload


def _conv_silu_step(counter: str):
    """One conv + SiLU forward and backward on fake tensors under a timeline: (trace, FLOPs)."""
    with FakeTensorMode():
        x = torch.randn(2, 3, 8, 8, requires_grad=True)
        w = torch.randn(4, 3, 3, 3, requires_grad=True)
        timeline = Timeline(1)
        with timeline:
            count = {"none": contextlib.nullcontext(), "torch": flop_counter(),
                     "aside": flop_counter(timeline.quiet)}[counter]
            with count:
                F.silu(F.conv2d(x, w, padding=1)).sum().backward()
    return timeline.trace, None if counter == "none" else count.get_total_flops()


def test_a_decomposed_operator_runs_whole_below_the_counter_and_its_flops_still_count():
    plain, _ = _conv_silu_step("none")
    torch_trace, torch_flops = _conv_silu_step("torch")
    aside_trace, aside_flops = _conv_silu_step("aside")
    assert len(torch_trace) > len(plain)  # torch's counter shows the timeline silu_backward's parts
    assert aside_trace == plain
    assert aside_flops == torch_flops > 0


def test_an_operator_that_mutates_its_argument_runs_once():
    with FakeTensorMode():
        timeline = Timeline(1)
        x = torch.zeros(4)
        with timeline, flop_counter(timeline.quiet):
            x.add_(1)
    assert len(timeline.trace) == 1


@pytest.fixture(scope="module")
def silu_net():
    workload = load_workload("tests/silu_workloads.py:silu_convnet")
    return workload, profile_workload(workload, ["fp32"], use_cache=False)


@pytest.mark.parametrize("micro_batch", [1, 8])
@pytest.mark.parametrize("checkpoint_every", [0, 1])
def test_a_conv_groupnorm_silu_net_is_estimated_to_the_byte_off_the_profiled_sizes(silu_net, micro_batch,
                                                                                     checkpoint_every):
    """torch's counter made this 5.6-7.3% under at micro-batch 1 and 59-86% over at 8."""
    workload, profile = silu_net
    config = TrainConfig.parse(f"precision=fp32,micro_batch={micro_batch},checkpoint_every={checkpoint_every}")
    measured = measure_trial(workload, config, device="cpu", warmup_steps=1, measure_steps=1)
    assert measured["status"] == "ok", measured["error"]
    assert estimate(profile, config).peak_bytes == pytest.approx(measured["peak_bytes"], rel=0.002)

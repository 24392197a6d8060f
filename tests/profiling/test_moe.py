"""Mixture-of-experts models profile and are estimated at or above a real step with random routing:
``hf:`` Mixtral and OLMoE (``transformers``' grouped-matmul experts) and a user's own top-k layer
(tests/moe_workloads.py: a loop over the experts with ``torch.where``). Tiny configs only."""

from __future__ import annotations

import json

import pytest
import torch

from autofit import TrainConfig, WorkloadError
from autofit.estimator.memory_model import estimate
from autofit.profiling.fake_kernels import FakeKernels
from autofit.profiling.profile import profile_workload
from autofit.profiling.routing import ROUTING_NOTE, worst_case_picks
from autofit.trial.measure import measure_trial
from autofit.workloads.load import load_workload

MOE_FILE = "tests/moe_workloads.py"
MIXTRAL = ("mixtral?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
           "&num_key_value_heads=2&num_local_experts=4&num_experts_per_tok=2&vocab_size=100")
OLMOE = ("olmoe?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
         "&num_key_value_heads=4&num_experts=4&num_experts_per_tok=2&vocab_size=100&eos_token_id=1&pad_token_id=0")


def test_worst_case_routing_sends_every_token_to_the_same_experts_and_reaches_every_expert():
    picks = worst_case_picks([10, 7], 2, 1)  # 10 tokens, 7 experts, top-2
    assert picks.shape == (10, 2)
    counts = torch.bincount(picks.flatten(), minlength=7)
    assert counts[0] == counts[1] == 10 - 3 and counts[2:].min() >= 1  # 3 tokens cover experts 2..6
    assert all(len(set(row.tolist())) == 2 for row in picks)  # a token's k experts are distinct
    assert worst_case_picks([3, 5, 4], 1, 2).shape == (3, 5, 1)


def test_grouped_matmul_outside_bf16_runs_on_fake_tensors_as_on_real_ones():
    """The meta kernel accepts bf16 only; the CPU kernel runs fp32 (a real step of an fp32 MoE does)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tokens, weight = torch.randn(6, 8), torch.randn(3, 8, 4, requires_grad=True)
    offs = torch.tensor([2, 4, 6], dtype=torch.int32)
    real = torch.nn.functional.grouped_mm(tokens, weight, offs=offs)
    with FakeTensorMode() as mode:
        a, w, o = mode.from_tensor(tokens), mode.from_tensor(weight), mode.from_tensor(offs)
        with pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
            torch.nn.functional.grouped_mm(a, w, offs=o)
        with FakeKernels():
            out = torch.nn.functional.grouped_mm(a, w, offs=o)
            out.sum().backward()
        assert out.shape == real.shape and out.dtype == real.dtype and w.grad.shape == weight.shape


@pytest.fixture(scope="module")
def hf_profiles():
    pytest.importorskip("transformers")
    from autofit import hf_workload

    workloads = {name: hf_workload(spec, seq_len=16) for name, spec in (("mixtral", MIXTRAL), ("olmoe", OLMOE))}
    return {name: (w, profile_workload(w, ["fp32", "amp-bf16"], use_cache=False)) for name, w in workloads.items()}


@pytest.mark.parametrize("name", ["mixtral", "olmoe"])
@pytest.mark.parametrize("spec", ["precision=fp32,micro_batch=8,checkpoint_every=0",
                                  "precision=amp-bf16,micro_batch=4,grad_accum=2,checkpoint_every=2"])
def test_hf_mixture_of_experts_estimate_is_at_or_above_a_real_step(hf_profiles, name, spec):
    workload, profile = hf_profiles[name]
    config = TrainConfig.parse(spec)
    predicted = estimate(profile, config)
    measured = measure_trial(workload, config, device="cpu", warmup_steps=1, measure_steps=2)
    assert measured["status"] == "ok", measured["error"]
    assert ROUTING_NOTE in predicted.notes
    # at or above (but for the 4-byte scalar every tiny model's step keeps beyond its estimate), within 10%
    assert measured["peak_bytes"] - 8 <= predicted.peak_bytes <= 1.10 * measured["peak_bytes"]


def test_estimate_says_which_routing_it_assumed(capsys):
    from autofit.cli import main

    pytest.importorskip("transformers")
    code = main(["estimate", "--model", "hf:" + MIXTRAL, "--seq-len", "16", "--budget", "1GB", "--device", "cpu",
                 "--config", "precision=fp32,micro_batch=2", "--json"])
    assert code == 0
    assert ROUTING_NOTE in json.loads(capsys.readouterr().out)["notes"]


@pytest.mark.parametrize("function", ["moe_lm", "top1_lm"])
@pytest.mark.parametrize("spec", ["precision=fp32,micro_batch=4,grad_accum=2,checkpoint_every=0",
                                  "precision=amp-bf16,micro_batch=8,checkpoint_every=2"])
def test_users_own_top_k_layer_is_estimated_at_or_above_a_real_step(function, spec):
    workload = load_workload(f"{MOE_FILE}:{function}")
    config = TrainConfig.parse(spec)
    predicted = estimate(profile_workload(workload, [config.precision.value], use_cache=False), config)
    measured = measure_trial(workload, config, device="cpu", warmup_steps=1, measure_steps=3)
    assert measured["status"] == "ok", measured["error"]
    assert ROUTING_NOTE in predicted.notes
    assert measured["peak_bytes"] - 8 <= predicted.peak_bytes <= 1.25 * measured["peak_bytes"]


def test_a_size_read_from_values_without_a_router_is_a_one_line_error():
    workload = load_workload(f"{MOE_FILE}:value_gated_lm")
    with pytest.raises(WorkloadError) as info:
        profile_workload(workload, ["fp32"], use_cache=False)
    message = str(info.value)
    assert "reads tensor values (aten.nonzero.default" in message and "torch.topk" in message
    assert "\n" not in message
    # the failed step left no process-wide saved-tensor hooks behind (they kept every tensor autograd
    # saved afterwards alive, in this process's later steps)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None

"""Device split estimates per stage against the stages' measured peaks (issues 12 and 13).

The schedule decides how many micro-batches a stage holds at once: the first stage of a
2-stage 1F1B pipeline over 2 micro-batches holds both during its first backward but only one
during its second, whose gradients already exist. Counting two there over-estimated the first
stage of a parameter-heavy model (a tied GPT-2: +12%) and of user-file models (+2%).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from autofit.core.config import TrainConfig
from autofit.estimator.memory_model import estimate
from autofit.estimator.memory_table import in_flight, in_flight_later
from autofit.profiling.profile import profile_workload
from autofit.trial.pipeline import measure_split
from autofit.workloads.base import Workload
from autofit.workloads.load import load_workload

USER_MODELS = Path(__file__).resolve().parents[2] / "autofit" / "bench" / "user_models"


def test_later_micro_steps_hold_one_micro_batch_fewer():
    ga = np.array([2, 3, 8])
    # 1F1B, 2 stages: stage 0 holds min(k, 2) at its first backward, min(k - 1, 2) afterwards.
    assert in_flight(0, 2, ga).tolist() == [2, 2, 2]
    assert in_flight_later(0, 2, ga).tolist() == [1, 2, 2]
    assert in_flight_later(1, 2, ga).tolist() == [1, 1, 1]
    # GPipe runs every forward first; backward j starts with k - j micro-batches.
    assert in_flight_later(0, 2, ga, "gpipe").tolist() == [1, 2, 7]
    assert in_flight_later(0, 1, ga).tolist() == [1, 1, 1]


def _stage_errors(spec: str, config: TrainConfig) -> list[float]:
    workload = load_workload(spec)
    predicted = estimate(profile_workload(workload, [config.precision], use_cache=False), config)
    measured = measure_split(workload, config, device_type="cpu", budget_bytes=None, measure_steps=1)
    assert measured["status"] == "ok", measured["error"]
    return [(p - m) / m for p, m in zip(predicted.per_device_peak_bytes, measured["per_device_peak_bytes"])]


@pytest.mark.slow
def test_stage_peaks_of_a_tied_hf_gpt2():
    pytest.importorskip("transformers")
    # A vocabulary large next to the width: stage 0's peak is set by its weights and state.
    spec = "hf:gpt2?n_layer=2&n_embd=64&n_head=2&vocab_size=8192#seq_len=32"
    errors = _stage_errors(spec, TrainConfig.parse("precision=fp32,micro_batch=2,grad_accum=2,device_split=2"))
    assert max(abs(e) for e in errors) <= 0.02, errors


@pytest.mark.slow
def test_stage_peaks_of_a_user_file_model():
    spec = f"{USER_MODELS / 'mixer.py'}:workload"  # loaded from its file, as a user's model is
    errors = _stage_errors(spec, TrainConfig.parse("precision=amp-bf16,micro_batch=4,grad_accum=2,device_split=2"))
    assert max(abs(e) for e in errors) <= 0.02, errors


@pytest.mark.parametrize("tie", [True, False])
def test_tied_weights_are_profiled_as_the_end_stages_hold_them(tie):
    pytest.importorskip("transformers")
    from autofit.workloads.hf import hf_workload

    vocab, width = 2048, 64
    w = hf_workload(f"gpt2?n_layer=2&n_embd={width}&n_head=2&vocab_size={vocab}&tie_word_embeddings={str(tie).lower()}",
                    seq_len=16)
    pp = profile_workload(w, ["fp32"], use_cache=False).for_precision("fp32")
    if not tie:
        assert pp.split_ends is None  # nothing shared: the stages hold what the model holds
        return
    tied = vocab * width * 4
    ends = pp.split_ends
    assert ends.layers == pp.layers
    assert ends.grad_bytes == pp.grad_bytes + tied  # the first and the last stage each train a copy
    # Unsplit, the head's gradient of the tied weight waits in autograd's buffer and is summed with
    # the embedding's into a new tensor; the first stage never receives it: its embedding
    # backward peaks one copy lower and ends one gradient higher.
    assert ends.pre_backward.peak[0] == pytest.approx(pp.pre_backward.peak[0] - tied, abs=4096)
    assert ends.pre_backward.delta[0] == pytest.approx(pp.pre_backward.delta[0] + tied, abs=4096)


# Blocks that end in a ReLU (its backward needs its output) with outputs large beside their
# weights: a stage's output is a large share of what it holds.
WIDTH, LAYERS = 64, 4


class _ReluStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())
                                          for _ in range(LAYERS))
        self.head = torch.nn.Linear(WIDTH, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


RELU_STACK = Workload(name="relu-stack", model=_ReluStack,
                      batch=lambda n: (torch.randn(n, WIDTH), torch.randint(0, 4, (n,))),
                      loss=torch.nn.functional.cross_entropy,
                      optimizer=lambda params: torch.optim.SGD(params, lr=0.1), layers=lambda m: m.layers)


@pytest.mark.parametrize("every", [0, 1])
def test_an_earlier_stage_keeps_its_output_and_its_gradient_through_its_backward(every):
    # The schedule holds stage 0's output until that micro-batch's backward returns and the
    # output's gradient stays in its receive buffer, where an unsplit model frees both in the
    # last layer's backward. Stage 0 peaks after that backward here, with checkpointing and
    # without: counting both freed under-estimated it by 14% (convnet-bn checkpointed: 6%).
    config = TrainConfig.parse(f"precision=fp32,micro_batch=256,grad_accum=2,checkpoint_every={every},device_split=2")
    predicted = estimate(profile_workload(RELU_STACK, [config.precision], use_cache=False), config)
    measured = measure_split(RELU_STACK, config, device_type="cpu", budget_bytes=None, measure_steps=1)
    assert measured["status"] == "ok", measured["error"]
    errors = [(p - m) / m for p, m in zip(predicted.per_device_peak_bytes, measured["per_device_peak_bytes"])]
    assert max(abs(e) for e in errors) <= 0.02, errors


def test_the_profile_traces_a_stage_ending_layer_backward_with_its_output_and_gradient_kept():
    # A ReLU block saves its output; its backward frees that output and the output's gradient.
    # Kept, the region ends higher by exactly both, and never peaks lower than the plain one.
    pp = profile_workload(RELU_STACK, ["fp32"], use_cache=False).for_precision("fp32")
    b = 4
    for layer in pp.layers:
        assert layer.output_saved
        out = layer.output[0] + layer.output[1] * b
        plain, grad_kept, both_kept = (layer.backward, layer.backward_grad_kept, layer.backward_output_kept)
        value = lambda line: line[0] + line[1] * b  # noqa: E731
        assert value(grad_kept.delta) == pytest.approx(value(plain.delta) + out)
        assert value(both_kept.delta) == pytest.approx(value(plain.delta) + 2 * out)
        assert value(plain.peak) <= value(grad_kept.peak) <= value(both_kept.peak)


@pytest.mark.parametrize("spec", ["precision=fp32,micro_batch=8,grad_accum=2,device_split=2",
                                  "precision=amp-bf16,micro_batch=8,grad_accum=1,device_split=2",
                                  "precision=bf16,micro_batch=8,grad_accum=3,checkpoint_every=2,device_split=3"])
def test_resnet_stages_that_send_their_output_are_not_under_estimated(spec):
    # Residual conv blocks ending in a ReLU: the block's backward peaks after it has freed its output
    # and the output's gradient, which a stage keeps. Counted freed, these stages read 4-7% under.
    errors = _stage_errors(f"{USER_MODELS / 'resnet.py'}:workload", TrainConfig.parse(spec))
    assert min(errors) >= -0.001 and max(errors) <= 0.03, errors

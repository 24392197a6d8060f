"""An RNN profiled for CUDA on fake tensors: cuDNN refuses fake tensors, so the step is profiled again with
cuDNN off (its native kernels have fake implementations). The errors are the two the H200 runs met."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autofit.core.config import Precision
from autofit.core.errors import WorkloadError
from autofit.profiling import step
from autofit.profiling.step import cudnn_refused

# What profiling lstm-lm for CUDA raised on the H200 (results/benchmarks/gpu/run1-h200.md, run2-h200-abc.md).
BAD_PARAM = "cuDNN error: CUDNN_STATUS_BAD_PARAM"
NO_WEIGHT_BUF = ("Expected a proper Tensor but got None (or an undefined Tensor in C++) for argument #3 "
                 "'weight_buf'")


@dataclasses.dataclass(frozen=True)
class _Run:
    """A stand-in for the profiled step's RawRun: the one field the fallback sets."""

    cudnn_off: bool = False


def _wrapped(message: str) -> WorkloadError:
    try:
        try:
            raise RuntimeError(message)
        except RuntimeError as inner:
            raise WorkloadError(f"lstm-lm: profiling on fake tensors failed (RuntimeError: {message})") from inner
    except WorkloadError as outer:
        return outer


def test_both_torch_versions_refusals_are_recognised_and_nothing_else():
    for message in (BAD_PARAM, NO_WEIGHT_BUF):
        assert cudnn_refused(RuntimeError(message))
        assert cudnn_refused(_wrapped(message))
    assert not cudnn_refused(_wrapped("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"))


@pytest.mark.parametrize("message", [BAD_PARAM, NO_WEIGHT_BUF])
def test_a_cuda_profile_that_cudnn_refuses_runs_again_with_cudnn_off(message, monkeypatch):
    calls = []

    def fake_step(*args, **kwargs):
        calls.append(torch.backends.cudnn.enabled)
        if len(calls) == 1:
            raise _wrapped(message)
        return _Run()

    monkeypatch.setattr(step, "run_step", fake_step)
    enabled = torch.backends.cudnn.enabled
    assert step.run_fake(None, Precision("fp32"), 2, "cuda", None) == _Run(cudnn_off=True)  # and it says so
    assert calls == [enabled, False] and torch.backends.cudnn.enabled == enabled
    calls.clear()
    with pytest.raises(WorkloadError):  # the CPU has no cuDNN to turn off: the error is the user's
        step.run_fake(None, Precision("fp32"), 2, "cpu", None)


@pytest.mark.skipif(not torch.backends.cuda.is_built(),
                    reason="this PyTorch is a CPU-only build: a step on fake CUDA tensors aborts (no CUDA device "
                           "guard); on a GPU, scripts/gpu_check.py --parts a --workloads lstm-lm checks it")
def test_the_lstm_language_model_profiles_for_cuda_on_fake_tensors(tmp_path, monkeypatch):
    from autofit.profiling.profile import profile_workload
    from autofit.workloads.load import load_workload

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    profile = profile_workload(load_workload("lstm-lm"), ["fp32"], device_type="cuda")
    assert profile.device_type == "cuda" and profile.n_layers == 4
    assert profile.for_precision("fp32").forward_flops[1] > 0  # per sample


def test_an_estimate_of_a_model_profiled_with_cudnn_off_says_so(monkeypatch):
    """The CUDA fallback, simulated on this CPU: the runs come back marked, and the profile's note and the
    estimate's notes say what the native kernels' profile is not (the H200's measured gap)."""
    from autofit.core.config import TrainConfig
    from autofit.estimator.memory_model import estimate
    from autofit.profiling import precision as profiling_precision
    from autofit.profiling.profile import profile_workload

    real_run_fake = profiling_precision.run_fake

    def marked(*args, **kwargs):
        return dataclasses.replace(real_run_fake(*args, **kwargs), cudnn_off=True)

    monkeypatch.setattr(profiling_precision, "run_fake", marked)
    profile = profile_workload(_small_lstm(), ["fp32"], use_cache=False, split_ends=False, selective=False)
    note = profile.for_precision("fp32").real_check
    assert note.startswith(profiling_precision.CUDNN_OFF_NOTE)
    assert "trials measure the real step" in note
    notes = estimate(profile, TrainConfig("fp32", 2)).notes
    assert any(n.startswith("profile: profiled with cuDNN off (its RNN kernels refuse fake tensors)") for n in notes)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(16, 16, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0]


class _SmallLSTM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList([_Block()])
        self.head = torch.nn.Linear(16, 32)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _small_lstm():
    """An LSTM language model small enough that its per-time-step fake ops take a moment (4 steps)."""
    from autofit import Workload

    def loss(logits, targets):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return Workload(name="small-lstm", model=_SmallLSTM, batch=lambda n: (torch.randint(32, (n, 4)),) * 2,
                    loss=loss, optimizer=lambda params: torch.optim.AdamW(params), layers=lambda model: model.blocks)

"""An RNN profiled for CUDA on fake tensors: cuDNN refuses fake tensors, so the step is profiled again with
cuDNN off (its native kernels have fake implementations). The errors are the two the H200 runs met."""

from __future__ import annotations

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
        return "the step without cuDNN"

    monkeypatch.setattr(step, "run_step", fake_step)
    enabled = torch.backends.cudnn.enabled
    assert step.run_fake(None, Precision("fp32"), 2, "cuda", None) == "the step without cuDNN"
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

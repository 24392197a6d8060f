"""The ``optimizer`` lever's choices, profiled on fake tensors over the workload's own parameters.

A choice's memory depends on the parameters alone (their shapes, dtypes and groups), not on the
model's forward, so it is profiled apart from the step (:mod:`autofit.profiling.step`): the model is
built on fake tensors in the precision's parameter dtype, every trainable parameter is given a
gradient, and the choice's optimizer (:func:`autofit.runtime.optimizers.replace_optimizer`, the code a
trial runs) takes one step to make its state, as every step after the first finds it, then another
under the timeline, which counts what that step allocates beyond weights, gradients and state. This
profiles the state's real layout, read from the optimizer in hand: bitsandbytes' one-byte moments with
their fp32 block scales (256 elements a block) and its shared quantization maps, and its fp32 moments
for tensors under 4096 elements; Adafactor's row and column statistics, its full second moment for
vectors, its per-tensor step counts (its step's reads of values are answered on fake tensors:
:func:`autofit.runtime.optimizers.scalar_stand_ins`). On the CPU, bitsandbytes' kernel computes inside
one operator, unseen by the timeline: what it allocates is added from its documented steps
(:func:`autofit.runtime.optimizers.cpu_kernel_bytes`). Checked against real steps by
``tests/profiling/test_optimizer_options.py``.
"""

from __future__ import annotations

import importlib.metadata

import torch

from autofit.core.config import OptimizerChoice, Precision, TrainConfig
from autofit.core.errors import WorkloadError
from autofit.profiling.data import OptimizerProfile
from autofit.profiling.step import CUDA_BLOCK_BYTES
from autofit.profiling.timeline import Timeline, state_tensors, tensor_bytes
from autofit.runtime.optimizers import (
    cpu_kernel_bytes,
    replace_optimizer,
    scalar_stand_ins,
)
from autofit.runtime.training import build_trainee
from autofit.workloads.base import Workload, explain_failure

__all__ = ["option_library", "profile_options"]


def option_library(choice: OptimizerChoice | str) -> str:
    """The library (and its version) that implements ``choice``: a cached profile of another is made again."""
    if OptimizerChoice(choice) is OptimizerChoice.ADAMW8BIT:
        try:
            return f"bitsandbytes {importlib.metadata.version('bitsandbytes')}"
        except importlib.metadata.PackageNotFoundError:
            return "bitsandbytes (not installed)"
    return f"torch {torch.__version__}"


def profile_options(workload: Workload, precision: Precision | str, device_type: str,
                    choices) -> tuple[OptimizerProfile, ...]:
    """Profile each lever choice in ``choices`` (OptimizerChoice values other than ``as-given``) for
    ``precision``. Raises WorkloadError when one cannot run on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    precision = Precision(precision)
    round_bytes = CUDA_BLOCK_BYTES if device_type == "cuda" else 1
    mode = FakeTensorMode()
    with mode:
        trainee = build_trainee(workload, TrainConfig(precision=precision), device=device_type, fake=True)
        params = [p for p in trainee.model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
    held = params + [p.grad for p in params] + list(trainee.model.buffers())
    out = []
    for choice in choices:
        choice = OptimizerChoice(choice)
        try:
            out.append(_profile_one(choice, trainee.optimizer, mode, held, params, round_bytes, device_type))
        except WorkloadError:
            raise
        except Exception as exc:
            raise WorkloadError(explain_failure(f"{workload.name} optimizer={choice.value}", exc)) from exc
    return tuple(out)


def _profile_one(choice: OptimizerChoice, base: torch.optim.Optimizer, mode, held: list, params: list,
                 round_bytes: int, device_type: str) -> OptimizerProfile:
    with mode:
        optimizer = replace_optimizer(choice, base)
        with scalar_stand_ins(optimizer):
            optimizer.step()  # its state, as every step after the first finds it
    state = state_tensors(optimizer)
    timeline = Timeline(round_bytes)
    with mode:
        timeline.register(held + state)
        timeline.reset_peaks()
        start = timeline.live
        with timeline, scalar_stand_ins(optimizer):
            optimizer.step()
    kernel = 0
    if device_type == "cpu":  # bitsandbytes' CPU kernel: one tensor at a time, inside one operator
        kernel = max((cpu_kernel_bytes(choice, p.numel(), p.element_size()) for p in params), default=0)
    return OptimizerProfile(choice=choice.value, optimizer=type(optimizer).__name__,
                            state_bytes=tensor_bytes(state, round_bytes), peak_bytes=max(0, timeline.peak - start),
                            library=option_library(choice), kernel_bytes=kernel)

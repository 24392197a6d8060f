"""Apply a TrainConfig to a workload and run optimizer steps exactly as a training script would.

The profiler (on fake tensors) and the trial runner (on real ones) both use this module,
so what is estimated and what is measured is the same code path.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autofit.config import Precision, TrainConfig
from autofit.errors import WorkloadError
from autofit.workload import Workload

AUTOCAST_DTYPE = {Precision.AMP_FP16: torch.float16, Precision.AMP_BF16: torch.bfloat16}


def param_dtype(precision: Precision) -> torch.dtype:
    """Dtype of weights, gradients and optimizer state: bf16 only in pure-bf16 mode."""
    return torch.bfloat16 if precision is Precision.BF16 else torch.float32


def autocast_context(precision: Precision, device_type: str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for the amp modes, a null context otherwise."""
    if precision.is_amp:
        return torch.autocast(device_type=device_type, dtype=AUTOCAST_DTYPE[precision])
    return contextlib.nullcontext()


def to_device(batch: Any, device: torch.device, float_dtype: torch.dtype | None = None) -> Any:
    """Move a nested batch to ``device``; cast floating tensors to ``float_dtype`` if given."""
    if isinstance(batch, torch.Tensor):
        if float_dtype is not None and batch.is_floating_point():
            return batch.to(device=device, dtype=float_dtype)
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device, float_dtype) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, float_dtype) for k, v in batch.items()}
    return batch


def _first_tensor(output: Any) -> Any:
    return output[0] if isinstance(output, (tuple, list)) else output


def checkpoint_layers(layers: nn.ModuleList, every: int) -> None:
    """Make each run of ``every`` consecutive layers one non-reentrant checkpoint segment.

    The first layer of a segment runs the whole segment under ``torch.utils.checkpoint``;
    the others become pass-throughs, so the model's own forward (``x = layer(x, ...)``) is
    unchanged and parameter names stay as they are. Layers must chain: each takes the
    previous one's output (or its first element) as its first argument.
    """
    if every <= 0:
        return
    originals = [layer.forward for layer in layers]
    for start in range(0, len(layers), every):
        segment = originals[start:start + every]
        state: dict = {}

        def run_segment(x, *args, _segment=segment, **kwargs):
            out = _segment[0](x, *args, **kwargs)
            for forward in _segment[1:]:
                out = forward(_first_tensor(out), *args, **kwargs)
            return out

        def head_forward(x, *args, _run=run_segment, _state=state, **kwargs):
            out = checkpoint(_run, x, *args, use_reentrant=False, **kwargs)
            _state["tail"] = tuple(out[1:]) if isinstance(out, tuple) else None
            first = _first_tensor(out)
            # a weak reference: holding the output itself would keep it alive past its use
            _state["out"] = weakref.ref(first) if isinstance(first, torch.Tensor) else None
            return out

        def pass_through(x, *args, _state=state, **kwargs):
            # The segment already ran this layer; that is only right if the model hands the
            # head's output straight on. Anything done between layers would be skipped.
            ref = _state.get("out")
            if ref is None or x is not ref():
                raise WorkloadError(
                    "checkpoint_every > 1 needs layers that chain (x = layer(x)); this model changes "
                    "the hidden state between layers, so use checkpoint_every 0 or 1"
                )
            tail = _state.get("tail")
            return x if tail is None else (x, *tail)

        layers[start].forward = head_forward
        for offset in range(1, len(segment)):
            layers[start + offset].forward = pass_through


@dataclass
class Trainee:
    """A model and optimizer with a config applied, ready for :func:`train_step`."""

    workload: Workload
    config: TrainConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    device: torch.device


def build_model(workload: Workload, precision: Precision, device: torch.device, fake: bool = False) -> nn.Module:
    """A fresh model in the precision's parameter dtype on ``device``.

    On fake tensors ``Module.to`` cannot swap parameters, so the model is built directly
    in place (default device and dtype set), which gives the same tensors.
    """
    dtype = param_dtype(precision)
    if not fake:
        return workload.model().to(device=device, dtype=dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return workload.model()
    finally:
        torch.set_default_dtype(previous)


def build_trainee(workload: Workload, config: TrainConfig, device: str | torch.device = "cpu",
                  fake: bool = False) -> Trainee:
    """Build a fresh model and optimizer for ``config`` on ``device`` (single stage).

    ``fake=True`` is the profiler's mode (under ``FakeTensorMode``): the model is built in
    place and the GradScaler is left out (fake tensors cannot answer its
    ``found_inf.item()``; its state is a few scalars).
    """
    device = torch.device(device)
    model = build_model(workload, config.precision, device, fake)
    model.train()
    if config.checkpoint_every:
        checkpoint_layers(workload.layers(model), config.checkpoint_every)
    optimizer = workload.optimizer(model.parameters())
    scaler = None
    if config.precision is Precision.AMP_FP16 and not fake:
        scaler = torch.amp.GradScaler(device.type)
    return Trainee(workload, config, model, optimizer, scaler, device)


def make_micro_batches(workload: Workload, config: TrainConfig, device: torch.device) -> list:
    """``grad_accum`` micro-batches of ``micro_batch`` samples each, on ``device``."""
    float_dtype = torch.bfloat16 if config.precision is Precision.BF16 else None
    return [to_device(workload.batch(config.micro_batch), device, float_dtype) for _ in range(config.grad_accum)]


def forward_backward(trainee: Trainee, inputs: Any, targets: Any,
                     before_backward: Callable[[], None] | None = None) -> torch.Tensor:
    """One micro-step: forward under the config's precision, loss divided by ``grad_accum``, backward.

    Dividing the loss (not the gradients) makes the accumulated gradient equal one step over
    the whole batch for a mean-reduced loss. Returns the undivided loss, detached.
    """
    with autocast_context(trainee.config.precision, trainee.device.type):
        outputs = trainee.model(inputs)
        loss = trainee.workload.loss(outputs, targets)
    scaled = loss / trainee.config.grad_accum
    if trainee.scaler is not None:
        scaled = trainee.scaler.scale(scaled)
    if before_backward is not None:  # the profiler marks the forward/backward boundary here
        before_backward()
    scaled.backward()
    return loss.detach()


def optimizer_step(trainee: Trainee) -> None:
    """The optimizer step (through the GradScaler for fp16, which skips it on inf/NaN)."""
    if trainee.scaler is not None:
        trainee.scaler.step(trainee.optimizer)
        trainee.scaler.update()
    else:
        trainee.optimizer.step()


def train_step(trainee: Trainee, micro_batches: list, on_micro_step: Callable[[int], None] | None = None) -> torch.Tensor:
    """One optimizer step over ``micro_batches``; returns the mean loss (detached).

    Gradients are set to None first, so they exist only from the first backward to the
    end of the step, as in ``optimizer.zero_grad(); ...; optimizer.step()``.
    """
    trainee.optimizer.zero_grad(set_to_none=True)
    losses = []
    for index, (inputs, targets) in enumerate(micro_batches):
        losses.append(forward_backward(trainee, inputs, targets))
        if on_micro_step is not None:
            on_micro_step(index)
    optimizer_step(trainee)
    return torch.stack(losses).float().mean()

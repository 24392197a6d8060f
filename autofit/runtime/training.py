"""Apply a TrainConfig to a workload and run optimizer steps exactly as a training script would.

The profiler (on fake tensors), the trial runner and each pipeline stage (on real ones) and
:class:`autofit.trial.apply.TrainingPlan` (on a user's model) all apply a config with
:func:`apply_config`, so what is estimated, what is measured and what a user trains with is
the same code path. A config is applied in one fixed order, each step logged (logger
``autofit.runtime.training``, level DEBUG):

1. precision: parameters cast to the parameter dtype (bf16 only for ``precision=bf16``) and
   moved to the device;
2. checkpointing: every ``checkpoint_every`` layers one non-reentrant
   ``torch.utils.checkpoint`` segment (``checkpoint_policy=selective``: saving the matmul and attention
   outputs, :data:`SELECTIVE_SAVE`);
3. the optimizer, made on the cast parameters (the workload's, or the ``optimizer`` lever's
   replacement of it: :mod:`autofit.runtime.optimizers`), wrapped to step on the host with
   ``offload=optimizer`` (CUDA: :mod:`autofit.runtime.offload`);
4. a ``torch.amp.GradScaler`` for ``amp-fp16``.

Autocast (the amp precisions) is not a change to the model: :func:`autocast_context` wraps
each forward and loss, never the backward.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autofit.core.config import CheckpointPolicy, Offload, Precision, TrainConfig
from autofit.core.errors import AutofitError, WorkloadError
from autofit.runtime.offload import apply_offload
from autofit.runtime.optimizers import replace_optimizer
from autofit.workloads.base import Workload

log = logging.getLogger(__name__)

AUTOCAST_DTYPE = {Precision.AMP_FP16: torch.float16, Precision.AMP_BF16: torch.bfloat16}


def param_dtype(precision: Precision) -> torch.dtype:
    """Dtype of weights, gradients and optimizer state: bf16 only in pure-bf16 mode."""
    return torch.bfloat16 if precision is Precision.BF16 else torch.float32


def autocast_context(precision: Precision, device_type: str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for the amp modes, a null context otherwise."""
    if precision.is_amp:
        return torch.autocast(device_type=device_type, dtype=AUTOCAST_DTYPE[precision])
    return contextlib.nullcontext()


def check_fake_device(device_type: str) -> None:
    """Refuse up front a device type whose fake tensors cannot train in this PyTorch.

    A CPU-only build of PyTorch registers no CUDA device guard, so fake CUDA tensors are made
    but cannot train: a cross-device ``Tensor.copy_`` or ``.to("cuda")`` raises "PyTorch is not
    linked with support for cuda devices" and autograd's backward aborts the process on it.
    A CUDA build on a machine without a GPU is let through: ``FakeTensorMode`` puts a no-op CUDA
    device guard in place there (``torch._C._ensureCUDADeviceGuardSet``).
    """
    if device_type == "cuda" and not torch.backends.cuda.is_built():
        raise AutofitError(f"--device cuda: this PyTorch ({torch.__version__}) is a CPU-only build and cannot "
                           "profile for CUDA, not even on fake tensors; install a CUDA build of PyTorch to estimate "
                           "for a GPU, or use --device cpu")


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


def is_kv_cache(value: Any) -> bool:
    """Whether ``value`` is a key/value cache a transformers model returns while it trains (its default
    ``use_cache=True``): what no loss reads, and what a pipeline stage cannot pass on (torch.export does
    not capture it). transformers is only looked up where the model already imported it."""
    module = sys.modules.get("transformers.cache_utils")
    cache_type = getattr(module, "Cache", None)
    return cache_type is not None and isinstance(value, cache_type)


def _first_tensor(output: Any) -> Any:
    return output[0] if isinstance(output, (tuple, list)) else output


# What selective checkpointing saves in a segment's forward (``checkpoint_policy=selective``): the outputs
# of matrix multiplications and of attention, the expensive operators; every other operator is
# recomputed in the segment's backward, as torch's selective activation checkpointing does it
# (``create_selective_checkpoint_contexts``).
SELECTIVE_SAVE = tuple(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
) if hasattr(torch.ops.aten, name))


def selective_context():
    """The ``context_fn`` of a selectively checkpointed segment: save :data:`SELECTIVE_SAVE`'s outputs."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(list(SELECTIVE_SAVE))


def checkpoint_layers(layers: nn.ModuleList, every: int, policy: CheckpointPolicy = CheckpointPolicy.FULL) -> None:
    """Make each run of ``every`` consecutive layers one non-reentrant checkpoint segment.

    The first layer of a segment runs the whole segment under ``torch.utils.checkpoint``;
    the others become pass-throughs, so the model's own forward (``x = layer(x, ...)``) is
    unchanged and parameter names stay as they are. Layers must chain: each takes the
    previous one's output (or its first element) as its first argument. ``policy`` selective:
    the segment also saves the outputs of :data:`SELECTIVE_SAVE` and recomputes only the rest.
    """
    if every <= 0:
        return
    extra = {"context_fn": selective_context} if CheckpointPolicy(policy) is CheckpointPolicy.SELECTIVE else {}
    originals = [layer.forward for layer in layers]
    roles: list[Callable] = list(originals)
    for start in range(0, len(layers), every):
        segment = originals[start:start + every]
        state: dict = {}

        def run_segment(x, *args, _segment=segment, **kwargs):
            out = _segment[0](x, *args, **kwargs)
            for forward in _segment[1:]:
                out = forward(_first_tensor(out), *args, **kwargs)
            return out

        def head_forward(x, *args, _run=run_segment, _state=state, _passes=len(segment) - 1, **kwargs):
            out = checkpoint(_run, x, *args, use_reentrant=False, **extra, **kwargs)
            if _passes:  # the segment's other outputs (an RNN's final state), for its pass-throughs to hand on
                _state["tail"], _state["passes"] = (tuple(out[1:]) if isinstance(out, tuple) else None), _passes
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
            # the segment's last pass-through lets the tail go: kept here, it would outlive the model's own
            # use of it (to the next forward), memory the user's training does not hold
            _state["passes"] = _state.get("passes", 1) - 1
            tail = _state.get("tail") if _state["passes"] > 0 else _state.pop("tail", None)
            return x if tail is None else (x, *tail)

        roles[start] = head_forward
        for offset in range(1, len(segment)):
            roles[start + offset] = pass_through
    for layer in {id(layer): layer for layer in layers}.values():
        places = [roles[i] for i, other in enumerate(layers) if other is layer]
        layer.forward = places[0] if len(places) == 1 else _by_call_order(places)


def _by_call_order(places: list[Callable]) -> Callable:
    """The forward of a module listed several times (weight sharing): its k-th call in a model
    forward plays the role of its k-th place in the layer list. The segments' recomputation
    calls the original forward, not this one, so it does not advance the count."""
    calls = itertools.count()

    def forward(*args, **kwargs):
        return places[next(calls) % len(places)](*args, **kwargs)
    return forward


@dataclass(frozen=True)
class Applied:
    """What :func:`apply_config` made: the optimizer, the GradScaler (amp-fp16 only) and the log of its steps."""

    optimizer: torch.optim.Optimizer | None
    scaler: torch.amp.GradScaler | None
    steps: tuple[str, ...]


def grad_scaler(precision: Precision, device_type: str) -> torch.amp.GradScaler | None:
    """A new GradScaler for ``amp-fp16`` (fp16 gradients underflow without one), else None."""
    return torch.amp.GradScaler(device_type) if precision is Precision.AMP_FP16 else None


def apply_config(model: nn.Module, config: TrainConfig, device: torch.device | str | None, *,
                 layers: nn.ModuleList | None,
                 make_optimizer: Callable[[Any], torch.optim.Optimizer] | None,
                 scaler: bool = True) -> Applied:
    """Apply ``config`` to ``model`` in place, in the module's fixed order: cast, checkpoint, optimizer, scaler.

    ``device``: where the model goes (None: where it is); ``layers``: the repeated blocks to
    checkpoint (needed when ``checkpoint_every > 0``); ``make_optimizer(parameters)``: the
    optimizer factory, whose optimizer the config's ``optimizer`` lever may replace (None: the
    caller keeps its own optimizer, which still holds the same Parameter objects after the cast); ``scaler=False`` leaves the GradScaler out (fake tensors
    cannot answer its ``found_inf.item()``). Raises WorkloadError when checkpointing has no layers, or
    when the lever cannot replace the workload's optimizer.
    """
    steps = []
    dtype = param_dtype(config.precision)
    if _needs_move(model, dtype, device):
        if _is_fake(model):
            cast_fake_in_place(model, dtype)  # Module.to swaps fake parameters, which torch 2.11 refuses
        else:
            model.to(dtype=dtype) if device is None else model.to(device=torch.device(device), dtype=dtype)
    steps.append(f"precision {config.precision.value}: parameters in {dtype}"
                 + ("" if device is None else f" on {torch.device(device)}")
                 + (f", autocast to {AUTOCAST_DTYPE[config.precision]} in forward" if config.precision.is_amp else ""))
    if config.checkpoint_every:
        if layers is None:
            raise WorkloadError("checkpoint_every > 0 needs the model's layer list")
        checkpoint_layers(layers, config.checkpoint_every, config.checkpoint_policy)
        steps.append(f"checkpoint: {len(layers)} layers in non-reentrant segments of {config.checkpoint_every}"
                     + (" (selective: matmul and attention outputs saved)"
                        if config.checkpoint_policy is CheckpointPolicy.SELECTIVE else ""))
    optimizer = None
    if make_optimizer is not None:
        optimizer = make_optimizer(model.parameters())
        given = type(optimizer).__name__
        optimizer = replace_optimizer(config.optimizer, optimizer)
        steps.append(f"optimizer: {type(optimizer).__name__}"
                     + (f" (optimizer={config.optimizer.value}, replacing the workload's {given})"
                        if config.changes_optimizer else ""))
        # A fake model is profiled on the device (no host to offload to): the estimate moves its state.
        if config.offload is Offload.OPTIMIZER and not _is_fake(model):
            optimizer = apply_offload(config, optimizer, _device_type(model, device))
            steps.append("offload: the state of parameters of 4096 elements or more, and its step, on the host")
    made_scaler = None
    if scaler and (made_scaler := grad_scaler(config.precision, _device_type(model, device))) is not None:
        steps.append("GradScaler for amp-fp16")
    for line in steps:
        log.debug("apply %s: %s", config.short(), line)
    return Applied(optimizer, made_scaler, tuple(steps))


def _is_fake(model: nn.Module) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(t, FakeTensor) for t in [*model.parameters(), *model.buffers()])


def cast_fake_in_place(model: nn.Module, dtype: torch.dtype) -> None:
    """What ``model.to(dtype=dtype)`` does to floating-point parameters and buffers, done by replacing
    them in their modules instead of swapping tensors (``Module._apply`` must swap fake tensors, and
    torch 2.11 fails with "Couldn't swap Embedding.weight"). A parameter shared by several modules
    (tied weights) stays one parameter."""
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, make in ((module._parameters, lambda t, old: nn.Parameter(t, requires_grad=old.requires_grad)),
                            (module._buffers, lambda t, old: t)):
            for name, old in list(table.items()):
                if old is None or not old.is_floating_point() or old.dtype == dtype:
                    continue
                if id(old) not in done:
                    with torch.no_grad():
                        done[id(old)] = make(old.to(dtype), old)
                table[name] = done[id(old)]


def _needs_move(model: nn.Module, dtype: torch.dtype, device: torch.device | str | None) -> bool:
    target = None if device is None else torch.device(device)
    return any((t.is_floating_point() and t.dtype != dtype) or (target is not None and t.device != target)
               for t in [*model.parameters(), *model.buffers()])


def _device_type(model: nn.Module, device: torch.device | str | None) -> str:
    if device is not None:
        return torch.device(device).type
    return next((p.device.type for p in model.parameters()), "cpu")


@dataclass
class Trainee:
    """A model and optimizer with a config applied, ready for :func:`train_step`."""

    workload: Workload
    config: TrainConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    device: torch.device


@contextlib.contextmanager
def copies_stay_fake():
    """Under the active ``FakeTensorMode``, let a model built there deep-copy its fake tensors.

    ``nn.TransformerEncoder``, ``nn.Transformer`` and other ``_get_clones`` users deep-copy their
    first layer; ``Tensor.__deepcopy__`` deep-copies a fake tensor's ``fake_mode`` attribute too, and
    the copies then fail in the first operator with "Mixing fake modes NYI" (torch's ``FakeCopyMode``
    is no help: it makes every copy of one tensor the same fake tensor, so clones would share weights).
    Here each copy is a fresh fake tensor of the active mode; deepcopy's memo keeps tied weights tied.
    """
    from torch._guards import detect_fake_mode
    from torch.overrides import TorchFunctionMode

    mode = detect_fake_mode()
    if mode is None:
        yield
        return

    class FreshFakeCopies(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is not torch.Tensor.__deepcopy__ or getattr(args[0], "fake_mode", None) is not mode:
                return func(*args, **(kwargs or {}))
            tensor, memo = args
            with torch.no_grad():
                copy = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=tensor.device)
            copy = (nn.Parameter(copy, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter)
                    else copy.requires_grad_(tensor.requires_grad))
            memo[id(tensor)] = copy
            return copy

    with FreshFakeCopies():
        yield


def build_model(workload: Workload, precision: Precision, device: torch.device, fake: bool = False) -> nn.Module:
    """A fresh model in the precision's parameter dtype on ``device``.

    On fake tensors ``Module.to`` cannot swap parameters, so the model is built directly
    in place (default device and dtype set), which gives the same tensors.
    """
    if not fake:
        return workload.model().to(device=device, dtype=param_dtype(precision))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(param_dtype(precision))
    try:
        with torch.device(device), copies_stay_fake():
            return workload.model()
    finally:
        torch.set_default_dtype(previous)


def build_trainee(workload: Workload, config: TrainConfig, device: str | torch.device = "cpu",
                  fake: bool = False) -> Trainee:
    """Build a fresh model and optimizer for ``config`` on ``device`` (single stage), with :func:`apply_config`.

    ``fake=True`` is the profiler's mode (under ``FakeTensorMode``): the model is built in
    place and the GradScaler is left out (fake tensors cannot answer its
    ``found_inf.item()``; its state is a few scalars).
    """
    device = torch.device(device)
    # Real models are built on the CPU in fp32 and moved and cast once, by apply_config.
    model = build_model(workload, config.precision, device, fake) if fake else workload.model()
    model.train()
    applied = apply_config(model, config, None if fake else device,
                           layers=workload.layers(model) if config.checkpoint_every else None,
                           make_optimizer=workload.optimizer, scaler=not fake)
    return Trainee(workload, config, model, applied.optimizer, applied.scaler, device)


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

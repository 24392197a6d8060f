"""Run one profiled micro-step and read it into a :class:`~autofit.profiling.raw.RawRun`.

The step goes through the same code as a real trial (:mod:`autofit.runtime.training`), on fake
tensors (:func:`run_fake`) or, for the real check, on real ones, under a
:class:`~autofit.profiling.trace.StepTrace` that cuts its timeline into regions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from autofit.core.config import Precision, TrainConfig
from autofit.profiling.data import PROFILE_BATCHES
from autofit.profiling.fake_kernels import FakeKernels
from autofit.profiling.raw import EMPTY_REGION, RawLayer, RawRun
from autofit.profiling.recompute_kept import recomputed_kept
from autofit.profiling.routing import ROUTING_NOTE, Routing
from autofit.profiling.timeline import (
    init_optimizer_state,
    max_tensor_bytes,
    state_tensors,
    tensor_bytes,
)
from autofit.profiling.trace import StepTrace
from autofit.runtime.optimizers import scalar_stand_ins
from autofit.runtime.training import Trainee, build_trainee, forward_backward, to_device
from autofit.workloads.base import Workload

__all__ = ["CUDA_BLOCK_BYTES", "cudnn_refused", "param_rows", "run_fake", "run_step"]

# The CUDA caching allocator rounds every block up to 512 bytes (docs/facts.md#cuda-caching-allocator).
CUDA_BLOCK_BYTES = 512


def param_rows(params) -> tuple[tuple[int, int], ...]:
    """(size(0), bytes) of each parameter, tied ones once: FSDP2 shards and pads each on dim 0."""
    seen, rows = set(), []
    for p in params:
        if id(p.untyped_storage()) not in seen:
            seen.add(id(p.untyped_storage()))
            rows.append((int(p.shape[0]) if p.dim() else 1, int(p.numel() * p.element_size())))
    return tuple(rows)


class _Step(NamedTuple):
    """A step ready to run: the trainee, its batch on the device, and the tensors the timeline knows."""

    trainee: Trainee
    inputs: Any
    targets: Any
    layers: list[nn.Module]
    params: list[nn.Parameter]
    buffers: list[torch.Tensor]
    state: list[torch.Tensor]  # the optimizer's
    batch: list[torch.Tensor]  # the inputs' and targets' tensors


def run_step(workload: Workload, precision: Precision, micro_batch: int, device_type: str,
             tensor_mode, real_batch, count_flops: bool = True, step_optimizer: bool = True,
             layer_recomputes: bool = True, selective: bool = True) -> RawRun:
    """One profiled micro-step at ``micro_batch`` samples under ``tensor_mode`` (a ``FakeTensorMode``, or
    :class:`~autofit.profiling.real_check.RealTensors`), plus the optimizer step (its state made first)
    when ``step_optimizer``. ``layer_recomputes=False`` skips the layers' checkpointed and selective
    forwards (their fields read 0), for a caller that keeps only what lies outside the layers;
    ``selective=False`` skips only the selective ones (a profile for configs that never use that policy).
    Raises WorkloadError where the backward pass cannot be followed."""
    round_bytes = CUDA_BLOCK_BYTES if device_type == "cuda" else 1
    tensor_mode = _StepModes(tensor_mode)
    step = _build(workload, precision, micro_batch, device_type, tensor_mode, real_batch, step_optimizer)
    trace = StepTrace(len(step.layers), round_bytes, count_flops)
    checkpointed = _trace(step, trace, tensor_mode, step_optimizer, layer_recomputes=layer_recomputes,
                          selective=selective)
    grads = [p.grad for p in step.params if p.grad is not None]
    left = trace.timeline.left_alive(step.params + step.buffers + step.state + grads)
    del grads
    kept_bytes = 0
    if left:
        # The step left tensors for the next one (a hook's stash, a buffer the forward replaced): every
        # step after the first starts with them. Trace that step, on the same model, which now holds them.
        kept_bytes = sum(trace.timeline.counted_bytes(s) for s in left)
        trace = StepTrace(len(step.layers), round_bytes, count_flops)
        checkpointed = _trace(step, trace, tensor_mode, step_optimizer, left, layer_recomputes, selective)
    layer_flops, fwd_flops, bwd_flops = [0.0] * len(step.layers), 0.0, 0.0
    if count_flops:
        layer_flops = trace.layer_flops(step.trainee.model, step.layers)
        fwd_flops, bwd_flops = float(trace.fwd_counter.get_total_flops()), float(trace.bwd_counter.get_total_flops())
    trace.check_backward(workload.name)
    run = _read(step, trace, checkpointed, layer_flops, fwd_flops, bwd_flops, step_optimizer, kept_bytes)
    return dataclasses.replace(run, routing=ROUTING_NOTE) if tensor_mode.routing.routed else run


class _StepModes:
    """The step's tensor mode (``FakeTensorMode`` or the real check's real tensors) with the modes the
    step runs under above it: the routing assumption (:mod:`autofit.profiling.routing`, real and fake
    alike, so the real check runs the same step) and, on fake tensors, the kernels whose fake
    implementation refuses a real step's inputs (:mod:`autofit.profiling.fake_kernels`)."""

    def __init__(self, tensor_mode) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.tensor_mode = tensor_mode
        fake = isinstance(tensor_mode, FakeTensorMode)
        self.routing = Routing(fake=fake)
        self._above = [FakeKernels(), self.routing] if fake else [self.routing]
        self._stacks: list[contextlib.ExitStack] = []

    def from_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return self.tensor_mode.from_tensor(t)

    def __enter__(self):
        stack = contextlib.ExitStack()
        stack.enter_context(self.tensor_mode)
        for mode in self._above:
            stack.enter_context(mode)
        self._stacks.append(stack)
        return self

    def __exit__(self, *exc) -> bool | None:
        return self._stacks.pop().__exit__(*exc)


def _build(workload: Workload, precision: Precision, micro_batch: int, device_type: str, tensor_mode,
           real_batch, step_optimizer: bool) -> _Step:
    config = TrainConfig(precision=precision, micro_batch=micro_batch)
    with tensor_mode:
        trainee = build_trainee(workload, config, device=device_type, fake=True)
        if step_optimizer:  # its state exists before the step, as in every step after the first
            init_optimizer_state(trainee)
        float_dtype = torch.bfloat16 if precision is Precision.BF16 else None
        # Tensors nested in dicts or lists (e.g. {"input_ids": ..., "labels": ...}) are made fake too
        inputs, targets = to_device(tree_map_only(torch.Tensor, tensor_mode.from_tensor, tuple(real_batch)),
                                    trainee.device, float_dtype)
    batch_tensors = [t for t in tree_leaves((inputs, targets)) if isinstance(t, torch.Tensor)]
    model = trainee.model
    return _Step(trainee, inputs, targets, workload.layers(model), params=[p for p in model.parameters()],
                 buffers=list(model.buffers()), state=state_tensors(trainee.optimizer), batch=batch_tensors)


def _trace(step: _Step, trace: StepTrace, tensor_mode, step_optimizer: bool,
           carried: list | None = None, layer_recomputes: bool = True,
           selective: bool = True) -> list[tuple[tuple, tuple, tuple]]:
    """Run ``step`` under ``trace``'s hooks and timeline, then the checkpointed forward and the selectively
    checkpointed one (per layer: :meth:`StepTrace.checkpointed_forwards`'s region and kept bytes, and
    :meth:`StepTrace.selective_forwards`'s four values, then what its recomputation leaves alive where a
    layer keeps tensors beyond autograd: :func:`~autofit.profiling.recompute_kept.recomputed_kept`).
    ``carried``: storages a step before left alive, counted from the start (the list is emptied: no
    reference here may keep them past their replacement). ``layer_recomputes=False``: none of these
    forwards, zeros in their place; ``selective=False``: no selective forward (a quarter of a fake run's
    time on a small transformer), zeros in its place."""
    trainee, timeline = step.trainee, trace.timeline
    trace.attach(trainee.model, step.layers, step.params)
    try:
        _traced_step(step, trace, tensor_mode, step_optimizer, carried)
    finally:  # a step that raised must not leave its process-wide hooks behind
        trace.detach()
    if not layer_recomputes:
        return [_NO_RECOMPUTES] * trace.n
    with tensor_mode, timeline:
        checkpointed = trace.checkpointed_forwards(trainee, step.layers, step.inputs)
        selective_runs = (trace.selective_forwards(trainee, step.layers, step.inputs) if selective
                          else [_NO_RECOMPUTES[1]] * trace.n)
        # only a layer that keeps something beyond autograd (a key/value cache) changes what a recomputation keeps
        kept = (recomputed_kept(trainee, step.layers, step.inputs, timeline) if any(r for _, r in checkpointed)
                else [(0, 0, 0, 0)] * trace.n)
        return list(zip(checkpointed, selective_runs, kept))


# (checkpointed forward, retained), (selective forward, kept, output kept, saved FLOPs, recompute, its prefix),
# what a recomputation keeps: the shape of one layer's entry from _trace
_NO_RECOMPUTES = ((EMPTY_REGION, 0), (EMPTY_REGION, 0, False, 0.0, None, None), (0, 0, 0, 0))


def _traced_step(step: _Step, trace: StepTrace, tensor_mode, step_optimizer: bool, carried: list | None) -> None:
    trainee, timeline = step.trainee, trace.timeline
    with tensor_mode:
        timeline.register(step.params + step.buffers + step.state)
        timeline.register(step.batch, counted=False)
        for storage in carried or ():
            timeline.add_storage(storage)
        if carried:
            carried.clear()
        timeline.reset_peaks()
        trainee.optimizer.zero_grad(set_to_none=True)
        with timeline:
            trace.forward_starts()
            forward_backward(trainee, step.inputs, step.targets, before_backward=trace.between_forward_and_backward)
            trace.backward_ends()
            if step_optimizer:
                with scalar_stand_ins(trainee.optimizer):  # Adafactor's reads of its step and norms
                    trainee.optimizer.step()
                trace.optimizer_stepped()


def _read(step: _Step, trace: StepTrace, checkpointed: list[tuple[tuple, tuple, tuple]], layer_flops: list[float],
          fwd_flops: float, bwd_flops: float, step_optimizer: bool, kept_bytes: int) -> RawRun:
    """The traced step's numbers."""
    weights = _weights(step.trainee.model, step.layers, step.params, step.buffers, trace.module_phase)
    rb, n = trace.round_bytes, trace.n
    grads = {id(p): p for p in step.params if p.requires_grad}
    pre_grads = [t for t in weights.pre if id(t) in grads]
    post_grads = [t for t in weights.post if id(t) in grads]
    return RawRun(
        static_param_bytes=tensor_bytes(step.params + step.buffers, rb),
        grad_bytes=tensor_bytes(grads.values(), rb),
        grad_rows=param_rows(grads.values()),
        **({"optimizer_bytes": tensor_bytes(step.state, rb), "opt_region": trace.region("end", "opt")}
           if step_optimizer else {}),
        pre_param_bytes=tensor_bytes(weights.pre, rb),
        # weights used before and after the layers (a tied embedding and head): a split copies them
        tied_bytes=tensor_bytes([t for t in weights.pre if any(t is u for u in weights.post)], rb),
        post_param_bytes=tensor_bytes(weights.post, rb),
        pre_buffer_bytes=tensor_bytes([t for t in weights.pre if any(t is b for b in step.buffers)], rb),
        pre_grad_bytes=tensor_bytes(pre_grads, rb),
        post_grad_bytes=tensor_bytes(post_grads, rb),
        pre_max_grad_tensor_bytes=max_tensor_bytes(pre_grads, rb),
        post_max_grad_tensor_bytes=max_tensor_bytes(post_grads, rb),
        pre_forward=trace.region("start", "f0"),
        layer_args=trace.layer_args(0, {t.untyped_storage()._cdata for t in step.params + step.buffers}),
        post_forward=trace.region("layers_done", "loss"),
        post_backward=trace.region("loss", f"b{n - 1}"),
        **trace.output_regions(),
        pre_backward=trace.region("B0", "end"),
        forward_flops=fwd_flops,
        backward_flops=bwd_flops,
        input_bytes=tensor_bytes(step.batch, rb),
        kept_bytes=kept_bytes,
        step_peak_bytes=max((live for live, _ in trace.timeline.trace), default=0),
        layers=tuple(_raw_layer(trace, i, weights.layers[i], weights.layer_buffers[i], checkpointed[i], layer_flops[i])
                     for i in range(n)),
    )


def _raw_layer(trace: StepTrace, i: int, params: list, buffers: list, forwards: tuple[tuple, tuple, tuple],
               flops: float) -> RawLayer:
    rb, last = trace.round_bytes, i == trace.n - 1
    trainable = [p for p in params if p.requires_grad]
    (checkpointed, retained), (selective, selective_kept, selective_output_kept, selective_saved_flops,
                               selective_recompute, selective_recompute_prefix), recomputed = forwards
    return RawLayer(
        param_bytes=tensor_bytes(params + buffers, rb),
        grad_bytes=tensor_bytes(trainable, rb),
        max_grad_tensor_bytes=max_tensor_bytes(trainable, rb),
        grad_rows=param_rows(trainable),
        output=trace.layer_out[i],
        output_saved=trace.output_saved[i],
        forward=trace.region(f"f{i}", f"F{i}"),
        recompute=trace.recompute(i),
        checkpointed_forward=checkpointed,
        retained=retained,
        retained_recomputed_inner=recomputed[0],
        retained_recomputed=recomputed[1],
        recomputed_input_kept=recomputed[2],
        recomputed_args_kept=recomputed[3],
        selective_forward=selective,
        selective_kept=selective_kept,
        selective_output_kept=selective_output_kept,
        selective_saved_flops=selective_saved_flops,
        selective_recompute=selective_recompute,
        selective_recompute_prefix=selective_recompute_prefix,
        # what dies before the next layer starts (the last: before the next operator):
        # this layer's input, when no backward keeps it
        after=trace.region(f"F{i}", "layers_done" if last else f"f{i + 1}").delta,
        backward=trace.region(f"b{i}", f"B{i}"),
        backward_grad_kept=trace.backward_kept(i, output_too=False),
        backward_output_kept=trace.backward_kept(i, output_too=True),
        input_freed_late=trace.freed_late(i, True),
        args_freed_late=trace.freed_late(i, False),
        forward_flops=flops,
    )


class _Weights(NamedTuple):
    pre: list[torch.Tensor]     # weights and buffers outside the layers used before them
    post: list[torch.Tensor]    # ... used after (or among) them; a tied one is in both
    layers: list[list[nn.Parameter]]       # each layer's own parameters
    layer_buffers: list[list[torch.Tensor]]


def _weights(model: nn.Module, layers, params: list, buffers: list, module_phase: dict[int, str]) -> _Weights:
    """The model's weights grouped by where the step used them (``module_phase``: the phase in which
    each module outside the layers first ran)."""
    # A module listed several times owns its weights once: at its first place in the list.
    first_place = {id(layer): i for i, layer in reversed(list(enumerate(layers)))}
    layer_params = [list(layer.parameters()) if first_place[id(layer)] == i else [] for i, layer in enumerate(layers)]
    in_layers = {id(p) for ps in layer_params for p in ps}
    owner_phase: dict[int, set] = {}
    for module in model.modules():
        ph = module_phase.get(id(module))
        if ph is None:
            continue
        for p in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            owner_phase.setdefault(id(p), set()).add(ph)
    outside = [t for t in params + buffers if id(t) not in in_layers]
    pre = [t for t in outside if "pre" in owner_phase.get(id(t), {"pre"})]
    post = [t for t in outside if "post" in owner_phase.get(id(t), set()) or "layers" in owner_phase.get(id(t), set())]
    layer_buffers = [list(layer.buffers()) if first_place[id(layer)] == i else [] for i, layer in enumerate(layers)]
    return _Weights(pre, post, layer_params, layer_buffers)


def run_fake(workload: Workload, precision: Precision, micro_batch: int, device_type: str, real_batch,
             layer_recomputes: bool = True, selective: bool = True) -> RawRun:
    """One profiled step on fake tensors. On CUDA, a model whose cuDNN kernels refuse fake tensors
    (an RNN, :func:`cudnn_refused`) is profiled again with cuDNN off: its native kernels
    (``_thnn_fused_lstm_cell``…) have fake implementations. They save each step's gates where cuDNN
    keeps a reserve buffer (which torch's fake kernel sizes as 0 anyway), so the profile is that of
    the native kernels; the trials on the device measure the real one and calibration corrects the
    estimate (``scripts/gpu_check.py --workloads lstm-lm`` measures the gap on a GPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # FLOPs and the optimizer step do not depend on the micro-batch: counted and run at the larger one only
    # (each costs about as much as the forward and backward on fake tensors).
    full = micro_batch == PROFILE_BATCHES[-1]
    try:
        with _quiet_fake_kernels():
            return run_step(workload, precision, micro_batch, device_type, FakeTensorMode(), real_batch, full, full,
                            layer_recomputes, selective)
    except Exception as exc:
        if device_type != "cuda" or not cudnn_refused(exc):
            raise
    with torch.backends.cudnn.flags(enabled=False), _quiet_fake_kernels():
        run = run_step(workload, precision, micro_batch, device_type, FakeTensorMode(), real_batch, full, full,
                       layer_recomputes, selective)
    return dataclasses.replace(run, cudnn_off=True)


def cudnn_refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is cuDNN refusing fake tensors. Which error
    depends on the torch version: ``flatten_parameters`` calling cuDNN with fake pointers fails with
    CUDNN_STATUS_BAD_PARAM (torch 2.11, results/benchmarks/gpu/run1-h200.md), and where the flat
    weights were never made, ``_cudnn_rnn`` fails for its missing ``weight_buf`` argument, a message
    that never names cuDNN (run2-h200-abc.md)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = f"{type(exc).__name__} {exc}".lower()
        if "cudnn" in text or "'weight_buf'" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def _quiet_fake_kernels():
    """FakeTensorMode logs a traceback when a fake kernel raises (a user's shape mistake) before the
    error reaches us; the user gets it as one line (WorkloadError), in whichever process profiles."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled

"""Pipeline stages: cut a workload's model into contiguous stages and apply the config to one.

The tracer, ``torch.distributed.pipelining.pipeline(model, mb_args, split_spec=...)``, captures
the model's own forward with ``torch.export``, so whatever runs before the first layer lands on
the first stage and whatever runs after the last layer on the last, with no knowledge of the
model beyond its layer list. The traced stage module runs inside the manual ``PipelineStage``
wrapped by :class:`StageModule`, which applies ``torch.autocast`` to the forward only. The
config is applied to each stage by :func:`autofit.runtime.training.apply_config`, as to an unsplit model.
"""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import (
    TreeSpec,
    tree_map,
    tree_map_only,
    tree_structure,
    tree_unflatten,
)

from autofit.core.config import PipelineSchedule, Precision, TrainConfig, stage_bounds
from autofit.core.errors import WorkloadError
from autofit.runtime.ranks import last_line, root_cause
from autofit.runtime.training import (
    apply_config,
    autocast_context,
    is_kv_cache,
    make_micro_batches,
    param_dtype,
    to_device,
)
from autofit.workloads.base import Workload

# The one schedule enum (autofit.core.config.PipelineSchedule), under the name this package always used.
Schedule = PipelineSchedule

class SplitError(RuntimeError):
    """A model that cannot be cut into pipeline stages (not capturable by ``torch.export``)."""


# --------------------------------------------------------------------------- stage building


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(t) if t.requires_grad else t


class StageModule(nn.Module):
    """The traced stage, run under the config's autocast (forward only, as in forward_backward)."""

    def __init__(self, inner: nn.Module, precision: Precision, device_type: str):
        super().__init__()
        self.inner = inner
        self.precision = precision
        self.device_type = device_type

    def forward(self, *args, **kwargs):
        # Send/recv need contiguous tensors, and the runtime sizes its receive buffers from the
        # first micro-batch's strides: make outputs and input gradients contiguous (an
        # nn.LSTM's are strided). A no-op, no copy, for those already contiguous.
        args = tree_map_only(torch.Tensor, _contiguous_grad, args)
        with autocast_context(self.precision, self.device_type):
            out = self.inner(*args, **kwargs)
        return tree_map_only(torch.Tensor, _contiguous, out)


@dataclass
class Stage:
    index: int
    num_stages: int
    bounds: tuple[int, int]
    device: torch.device
    module: StageModule
    pipeline_stage: Any
    schedule: Any
    schedule_name: Schedule
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    # (parameter, process group of its owner stages) for this stage's parameters that are
    # replicated on other stages too (tied weights): their gradients are summed over the group
    replicated: list
    raw_losses: list
    arg_mbs: list | None
    target_mbs: list | None


def without_caches(model: nn.Module) -> nn.Module:
    """``model`` with any key/value cache in its output replaced by None (:func:`is_kv_cache`): a
    transformers model with its default ``use_cache=True`` returns one while it trains, which no loss
    reads and torch.export (the stages' tracer) cannot capture. The forward is replaced on the instance,
    not wrapped in another module, so every parameter and layer keeps its name."""
    forward = model.forward

    def forward_without_caches(*args, **kwargs):
        return tree_map(lambda value: None if is_kv_cache(value) else value, forward(*args, **kwargs))

    model.forward = forward_without_caches
    return model


def _output_spec(model: nn.Module, example_args: tuple) -> TreeSpec:
    """The structure of ``model``'s output (a transformers ModelOutput, a tuple, a tensor), read from a
    forward on fake tensors (no compute, no memory): the traced last stage returns the output's tensors
    flat, and the user's loss is given them in that structure again (``out.logits`` works)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        return tree_structure(model(*example_args))


def _restructured(output: Any, spec: TreeSpec) -> Any:
    """The last stage's flat output in the model's own output structure ``spec``."""
    leaves = list(output) if isinstance(output, (tuple, list)) and len(output) == spec.num_leaves else [output]
    return tree_unflatten(leaves, spec) if len(leaves) == spec.num_leaves else output


def _module_fqn(model: nn.Module, target: nn.Module) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name
    raise SplitError("workload.layers(model) is not a submodule of the model")


def _modify_graph_op_device(module: nn.Module, device: torch.device) -> None:
    # torch.export burns the tracing device into ops such as torch.arange(device=...);
    # Pipe.build_stage fixes them the same way (private helper, torch >= 2.4).
    if device.type == "cpu":
        return
    from torch.distributed.pipelining._IR import _modify_graph_op_device as modify

    modify(module, device)


def _trace_stage(model: nn.Module, layers_fqn: str, bounds: list[tuple[int, int]], example_args: tuple,
                 rank: int):
    from torch.distributed.pipelining import SplitPoint, pipeline
    from torch.distributed.pipelining._IR import get_submod_name

    split_spec = {f"{layers_fqn}.{start}": SplitPoint.BEGINNING for start, _ in bounds[1:]}
    try:
        with warnings.catch_warnings():
            # Noise from export itself, e.g. nn.LSTM's _flat_weights "assigned during export".
            warnings.filterwarnings("ignore", message=".*assigned during export.*")
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
            pipe = pipeline(model, mb_args=example_args, split_spec=split_spec)
    except Exception as exc:
        cause = root_cause(exc)
        raise SplitError(
            f"cannot cut {type(model).__name__} into {len(bounds)} pipeline stages: torch.export failed "
            f"to capture its forward ({type(cause).__name__}: {last_line(cause)}). Device split needs a "
            "model torch.export can trace (no data-dependent control flow or graph breaks)"
        ) from exc
    if pipe.num_stages != len(bounds):
        raise SplitError(
            f"tracing produced {pipe.num_stages} stages, expected {len(bounds)}: the model must call "
            f"{layers_fqn}[i] once each, in order, inside its forward"
        )
    stage_module = pipe.get_stage_module(rank)
    _drop_unused_aliases(stage_module, model)
    # [{submod_name: qualname}] for parameters used on several stages (e.g. tied weights).
    index_of = {get_submod_name(i): i for i in range(len(bounds))}
    replicated = [{index_of[name]: qualname for name, qualname in mapping.items()}
                  for mapping in pipe.replicated_params]
    return stage_module, replicated


def _used_parameter_names(root: nn.Module) -> set[str]:
    # Walk the traced hierarchy from the stage's graph: parameters read by get_attr, and all
    # parameters of any non-graph module that a graph calls.
    used: set[str] = set()

    def visit(module: nn.Module, prefix: str) -> None:
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            used.update(prefix + name for name, _ in module.named_parameters(remove_duplicate=False))
            return
        for node in graph.nodes:
            if node.op == "get_attr":
                used.add(prefix + str(node.target))
            elif node.op == "call_module":
                visit(module.get_submodule(str(node.target)), prefix + str(node.target) + ".")

    visit(root, "")
    return used


def _drop_unused_aliases(stage_module: nn.Module, model: nn.Module) -> None:
    # A tied parameter (one tensor under several names, e.g. wte.weight and head.weight) is
    # attached by the tracer under every name whose parent module exists on the stage, also
    # where this stage never reads it: the first stage of a tied GPT carries an unused copy of
    # the head weight. Remove such copies so the stage holds (and we measure) only what it uses.
    names_by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_tensor.setdefault(id(param), []).append(name)
    aliased = {name for names in names_by_tensor.values() if len(names) > 1 for name in names}
    used = _used_parameter_names(stage_module)
    for name, _ in list(stage_module.named_parameters(remove_duplicate=False)):
        if name in aliased and name not in used:
            owner_name, _, leaf = name.rpartition(".")
            delattr(stage_module.get_submodule(owner_name) if owner_name else stage_module, leaf)


def build_stage(workload: Workload, config: TrainConfig, *, rank: int, world_size: int,
                 device: torch.device, schedule: Schedule, seed: int) -> Stage:
    precision = config.precision
    # Every stage builds the same model from the same seed, as the unsplit run would. It is
    # traced in the parameter dtype it will train in (export records dtypes).
    torch.manual_seed(seed)
    model = workload.model().to(dtype=param_dtype(precision))
    model.train()
    layers = workload.layers(model)
    all_bounds = stage_bounds(len(layers), world_size)
    layers_fqn = _module_fqn(model, layers)

    # The same micro-batches on every stage: the first stage reads the inputs, the last the
    # targets. Made once and reused for every step, outside any memory tracking.
    torch.manual_seed(seed + 1)
    micro_batches = make_micro_batches(workload, config, torch.device("cpu"))
    example_args = (micro_batches[0][0],)

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    output_spec = None
    if workload.split is not None:  # cut by hand (a model the tracer cannot capture)
        try:
            stage_module, replicated_spec = workload.split(model, all_bounds, rank, example_args[0])
        except WorkloadError as exc:
            raise SplitError(str(exc)) from exc
    else:
        model = without_caches(model)
        output_spec = _output_spec(model, example_args) if rank == world_size - 1 else None
        stage_module, replicated_spec = _trace_stage(model, layers_fqn, all_bounds, example_args, rank)
    del model, layers
    gc.collect()

    lo, hi = all_bounds[rank]
    _modify_graph_op_device(stage_module, device)
    module = StageModule(stage_module, precision, device.type)
    # The traced stage keeps the layers as submodules named like the original ones.
    stage_layers = nn.ModuleList(stage_module.get_submodule(f"{layers_fqn}.{i}") for i in range(lo, hi))
    applied = apply_config(module, config, device, layers=stage_layers if config.checkpoint_every else None,
                           make_optimizer=workload.optimizer)
    optimizer, scaler = applied.optimizer, applied.scaler
    if scaler is not None:
        # Only the last stage scales a loss; scaling anything once creates the scale tensor on
        # the other stages too, so all unscale their (already scaled) gradients alike.
        scaler.scale(torch.ones((), device=device))

    replicated = []
    for owners in replicated_spec:
        ranks = sorted(owners)
        # new_group is collective over the world: every rank creates every group, in order.
        group = None if len(ranks) == world_size else dist.new_group(ranks)
        if rank in owners:
            replicated.append((module.inner.get_parameter(owners[rank]), group))

    raw_losses: list = []

    def loss_fn(output, target):
        if output_spec is not None:
            output = _restructured(output, output_spec)
        with autocast_context(precision, device.type):
            loss = workload.loss(output, target)
        raw_losses.append(loss.detach())
        # Mean-reduced per micro-batch; the schedule divides the summed gradients by
        # n_microbatches (scale_grads=True), which equals train_step's loss / grad_accum.
        return scaler.scale(loss) if scaler is not None else loss

    pipeline_stage = PipelineStage(module, rank, world_size, device)
    schedule_name = Schedule(schedule)
    if schedule_name is Schedule.ONE_F_ONE_B and config.grad_accum < world_size:
        schedule_name = Schedule.GPIPE  # Schedule1F1B refuses fewer micro-batches than stages
    schedule_cls = Schedule1F1B if schedule_name is Schedule.ONE_F_ONE_B else ScheduleGPipe
    pipe_schedule = schedule_cls(pipeline_stage, n_microbatches=config.grad_accum, loss_fn=loss_fn,
                                 scale_grads=True)

    float_dtype = torch.bfloat16 if precision is Precision.BF16 else None
    arg_mbs = [(to_device(x, device, float_dtype),) for x, _ in micro_batches] if rank == 0 else None
    target_mbs = [to_device(y, device, float_dtype) for _, y in micro_batches] if rank == world_size - 1 else None
    return Stage(rank, world_size, (lo, hi), device, module, pipeline_stage, pipe_schedule, schedule_name,
                 optimizer, scaler, replicated, raw_losses, arg_mbs, target_mbs)

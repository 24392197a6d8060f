"""Device split: a workload's layers cut into contiguous pipeline stages, one process per device.

``TrainConfig.device_split = p`` runs the model as ``p`` stages of PyTorch's own pipeline
engine, :mod:`torch.distributed.pipelining`: ``grad_accum`` micro-batches of ``micro_batch``
samples go through a 1F1B (default) or GPipe schedule per optimizer step. There is no
home-made pipeline here; this module only cuts the model, applies the config to each stage,
runs the steps and measures them.

Front end: the tracer, ``pipeline(model, mb_args, split_spec={"<layers>.<i>": BEGINNING})``.
It is the generic one: ``torch.export`` captures the model's own forward, so whatever runs
before the first layer (embeddings) lands on the first stage and whatever runs after the
last layer (final norm, head) on the last stage, with no knowledge of the model beyond its
layer list. Manual stage construction would have to know which modules to drop on which
stage, which a generic ``Workload`` does not say. The traced stages keep the original module
hierarchy and parameter names (``blocks.2.attn.weight``), so checkpointing and the optimizer
act on them as on the eager model. A model that ``torch.export`` cannot capture (data-dependent
control flow, graph breaks) gets a clear ``error`` status naming the cause.

The traced stage module runs inside the manual ``PipelineStage`` (not ``Pipe.build_stage``) so
that it can be wrapped: the wrapper applies ``torch.autocast`` to the stage forward only, as
:func:`autofit.training.forward_backward` does (backward runs outside autocast). The loss
runs on the last stage as the schedule's ``loss_fn``, under the same autocast.

Processes: one per stage, rendezvous on 127.0.0.1 at a free port. On the CPU gloo, on CUDA
NCCL with one GPU per stage (``cuda:{rank}``). A workload with a ``source`` spec is re-loaded
in a fresh interpreter per stage (``subprocess``, like :mod:`autofit.trial`, so no
multiprocessing helper outlives the trial); one built in code is inherited by ``fork``. Each
stage sends its result back through a pipe; the parent kills every stage it started before
returning. :func:`run_stage` is the per-process body and also runs under ``torchrun``
(``scripts/run_split_torchrun.py``, which reads RANK, WORLD_SIZE and LOCAL_RANK).

Known limitations:

- Dropout draws differ from the unsplit run (each stage process has its own RNG stream), so
  losses match the unsplit run only for models without dropout.
- Parameters used on two stages (tied embedding and head) are replicated by the tracer; their
  gradients are summed across the owning stages before the optimizer step, so they stay tied.
- Checkpoint segments restart at each stage boundary: with ``checkpoint_every = k`` a stage of
  ``n`` layers has ``ceil(n / k)`` segments.
- 1F1B needs at least as many micro-batches as stages; with ``grad_accum < device_split`` the
  schedule falls back to GPipe (the result's ``schedule`` says which ran). With fewer
  micro-batches than stages the two schedules hold the same activations anyway.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import gc
import inspect
import io
import json
import os
import pickle
import select
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import importlib

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from autofit.config import Precision, TrainConfig, stage_bounds
from autofit.errors import ConfigError
from autofit.tracker import CATEGORIES as BREAKDOWN_KEYS
from autofit.tracker import MemoryTracker, optimizer_state_bytes, storage_bytes
from autofit.training import autocast_context, checkpoint_layers, make_micro_batches, param_dtype, to_device
from autofit.workload import Workload, load_workload

__all__ = ["BREAKDOWN_KEYS", "Schedule", "SplitError", "combine_stage_results", "measure_split", "run_stage",
           "stage_bounds"]

# Optimizer steps run before memory is measured: step 1 also runs the pipeline's shape
# inference and creates the optimizer state, so step 3 is the first fully steady step.
MIN_WARMUP_STEPS = 2
# Timed steps are at least this many, whatever measure_steps is: a median needs a few samples.
MIN_TIMED_STEPS = 3


class Schedule(str, enum.Enum):
    """Pipeline schedule: 1F1B holds at most ``p - i`` micro-batches' activations on stage ``i``;
    GPipe holds all ``grad_accum`` of them (FACTS.md, Narayanan et al. SC'21)."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"

    def __str__(self) -> str:
        return self.value


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


class _StageModule(nn.Module):
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
class _Stage:
    index: int
    num_stages: int
    bounds: tuple[int, int]
    device: torch.device
    module: _StageModule
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
        cause = _root_cause(exc)
        raise SplitError(
            f"cannot cut {type(model).__name__} into {len(bounds)} pipeline stages: torch.export failed "
            f"to capture its forward ({type(cause).__name__}: {_last_line(cause)}). Device split needs a "
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


def _build_stage(workload: Workload, config: TrainConfig, *, rank: int, world_size: int,
                 device: torch.device, schedule: Schedule, seed: int) -> _Stage:
    precision = config.precision
    # Every stage builds the same model from the same seed, as the unsplit run would.
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

    stage_module, replicated_spec = _trace_stage(model, layers_fqn, all_bounds, example_args, rank)
    del model, layers
    gc.collect()

    lo, hi = all_bounds[rank]
    if config.checkpoint_every > 0:
        # The traced stage keeps the layers as submodules named like the original ones.
        stage_layers = nn.ModuleList(stage_module.get_submodule(f"{layers_fqn}.{i}") for i in range(lo, hi))
        checkpoint_layers(stage_layers, config.checkpoint_every)

    _modify_graph_op_device(stage_module, device)
    module = _StageModule(stage_module, precision, device.type).to(device)

    replicated = []
    for owners in replicated_spec:
        ranks = sorted(owners)
        # new_group is collective over the world: every rank creates every group, in order.
        group = None if len(ranks) == world_size else dist.new_group(ranks)
        if rank in owners:
            replicated.append((module.inner.get_parameter(owners[rank]), group))

    optimizer = workload.optimizer(module.parameters())
    scaler = None
    if precision is Precision.AMP_FP16:
        scaler = torch.amp.GradScaler(device.type)
        # Only the last stage scales a loss; scaling anything once creates the scale tensor on
        # the other stages too, so all unscale their (already scaled) gradients alike.
        scaler.scale(torch.ones((), device=device))
    raw_losses: list = []

    def loss_fn(output, target):
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
    return _Stage(rank, world_size, (lo, hi), device, module, pipeline_stage, pipe_schedule, schedule_name,
                  optimizer, scaler, replicated, raw_losses, arg_mbs, target_mbs)


# --------------------------------------------------------------------------- one optimizer step


def _run_schedule(stage: _Stage) -> None:
    # What Schedule.step() does, minus splitting a whole batch: we pass pre-made
    # micro-batches, so no view of a full-batch tensor is created (and counted) while the
    # memory tracker is on, and return_outputs=False keeps no logits for a merged output.
    schedule = stage.schedule
    stage.pipeline_stage.has_backward = True
    stage.pipeline_stage.clear_runtime_states()
    kwargs = {}
    if "return_outputs" in inspect.signature(schedule._step_microbatches).parameters:
        kwargs["return_outputs"] = False
    schedule._step_microbatches(stage.arg_mbs, None, stage.target_mbs, None, **kwargs)


def _sync_replicated_grads(stage: _Stage) -> None:
    for param, group in stage.replicated:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)


def _optimizer_step(stage: _Stage) -> None:
    scaler = stage.scaler
    if scaler is None:
        stage.optimizer.step()
        return
    # Every stage must skip (or take) the step together, and update its scale the same way:
    # an inf/NaN on any stage counts on all of them.
    scaler.unscale_(stage.optimizer)
    found = scaler._found_inf_per_device(stage.optimizer)  # private, torch >= 1.6
    flag = torch.zeros(1, device=stage.device)
    for value in found.values():
        flag += value.to(stage.device).reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    for value in found.values():
        value.copy_(flag.reshape(value.shape).to(value.device))
    scaler.step(stage.optimizer)
    scaler.update()


def _train_step(stage: _Stage) -> float | None:
    """One optimizer step over ``grad_accum`` micro-batches; the mean loss on the last stage."""
    stage.optimizer.zero_grad(set_to_none=True)
    stage.raw_losses.clear()
    _run_schedule(stage)
    _sync_replicated_grads(stage)
    _optimizer_step(stage)
    if stage.index != stage.num_stages - 1:
        return None
    # The first step also computes a loss for the schedule's shape inference: keep the last n.
    losses = stage.raw_losses[-len(stage.target_mbs):]
    return float(torch.stack(losses).float().mean())


# --------------------------------------------------------------------------- measuring


def _recv_buffers(stage: _Stage) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Buffers the pipelining runtime allocates once per micro-batch and keeps between steps:
    received activations (non-first stages) and received output gradients (non-last stages)."""
    ps = stage.pipeline_stage

    def buffers(infos) -> list[torch.Tensor]:
        out = []
        for chunk in infos.values():
            for info in chunk:
                if not getattr(info, "is_root_arg", False) and isinstance(getattr(info, "buffer", None), torch.Tensor):
                    out.append(info.buffer)
        return out

    return buffers(ps.args_recv_info), buffers(ps.grad_recv_info)


def _cuda_breakdown(stage: _Stage, peak_bytes: int) -> dict[str, int]:
    # As autofit.measure does on CUDA: allocator statistics have no categories, so
    # activations are the rest of the peak after the states we can size.
    params = storage_bytes(list(stage.module.parameters()) + list(stage.module.buffers()))
    grads = storage_bytes([p.grad for p in stage.module.parameters() if p.grad is not None])
    state = optimizer_state_bytes(stage.optimizer)
    overhead = storage_bytes([stage.arg_mbs, stage.target_mbs, *_recv_buffers(stage)])
    return {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": state,
            "activations_bytes": max(0, peak_bytes - params - grads - state - overhead),
            "temporary_bytes": 0, "overhead_bytes": overhead}


def _timed_step(stage: _Stage) -> tuple[float, float | None]:
    dist.barrier()  # start together, so a stage's time is not its wait for the others
    if stage.device.type == "cuda":
        torch.cuda.synchronize(stage.device)
    start = time.perf_counter()
    loss = _train_step(stage)
    if stage.device.type == "cuda":
        torch.cuda.synchronize(stage.device)
    return time.perf_counter() - start, loss


def run_stage(workload: Workload, config: TrainConfig, *, rank: int, world_size: int, device: torch.device | str,
              warmup_steps: int = MIN_WARMUP_STEPS, measure_steps: int = 3, budget_bytes: int | None = None,
              schedule: Schedule | str = Schedule.ONE_F_ONE_B, seed: int = 0,
              collect_params: bool = False) -> dict:
    """Build and measure stage ``rank`` of ``world_size`` inside an initialized process group.

    The per-process body of :func:`measure_split`, also used under ``torchrun``. As
    :func:`autofit.measure.measure_trial` does for one device:

    1. ``max(warmup_steps, 2)`` warm-up optimizer steps (the first, which also runs the
       schedule's shape inference, untracked);
    2. peak memory over the ``measure_steps`` steps that follow: on the CPU, live tensor bytes
       counted by :class:`autofit.tracker.MemoryTracker` (which also watches the warm-up and
       stops the stage as soon as it passes ``budget_bytes``); on CUDA,
       ``max_memory_allocated`` under a memory fraction capped at the budget;
    3. the median wall time of ``max(measure_steps, 3)`` whole optimizer steps run without any
       tracker (every stage starts each one together, after a barrier).

    Never raises for a failing trial; returns ``{"rank", "status": "ok"|"oom"|"error", "error",
    "peak_bytes", "breakdown", "step_time_s", "losses" (last stage only: the mean loss of every
    step run), "layers": [start, end], "schedule", "activation_recv_bytes", "grad_recv_bytes",
    "params" (torch.save bytes of {name: tensor}, only with collect_params)}``.
    """
    device = torch.device(device)
    result: dict[str, Any] = {"rank": rank, "status": "error", "error": None, "peak_bytes": None,
                              "breakdown": None, "step_time_s": None, "losses": [], "layers": None,
                              "schedule": None, "activation_recv_bytes": 0, "grad_recv_bytes": 0}
    tracker = None
    try:
        config = TrainConfig.from_dict(config) if isinstance(config, dict) else config
        if device.type == "cuda":
            torch.cuda.set_device(device)
            if budget_bytes is not None:
                # Caps the caching allocator only; the CUDA context and NCCL are outside it (FACTS.md).
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
        stage = _build_stage(workload, config, rank=rank, world_size=world_size, device=device,
                             schedule=schedule, seed=seed)
        result["layers"] = list(stage.bounds)
        result["schedule"] = stage.schedule_name.value
        losses: list = result["losses"]
        warmup_steps = max(warmup_steps, MIN_WARMUP_STEPS)
        measure_steps = max(measure_steps, 1)
        if device.type == "cpu":
            # Step 1 runs untracked: the schedule first infers the shapes it sends with an extra
            # forward and an autograd.grad that the tracker's module hooks break, and allocates
            # its receive buffers, which live on and are counted as overhead from step 2 on. The
            # pre-made micro-batches are the data loader's, never counted.
            losses.append(_train_step(stage))
            tracker = MemoryTracker(stage.module, stage.optimizer, inputs=[stage.arg_mbs, stage.target_mbs],
                                    overhead=[t for buffers in _recv_buffers(stage) for t in buffers],
                                    budget_bytes=budget_bytes)
            with tracker:
                for _ in range(warmup_steps - 1):
                    losses.append(_train_step(stage))
                    tracker.step_boundary()
                tracker.reset_peak()
                for _ in range(measure_steps):
                    losses.append(_train_step(stage))
                    tracker.step_boundary()
            result["peak_bytes"] = tracker.peak_bytes
            result["breakdown"] = tracker.peak_breakdown()
        else:
            for _ in range(warmup_steps):
                losses.append(_train_step(stage))
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(max(measure_steps, MIN_TIMED_STEPS)):
            elapsed, loss = _timed_step(stage)
            times.append(elapsed)
            losses.append(loss)
        result["step_time_s"] = statistics.median(times)
        if device.type == "cuda":
            # On CUDA nothing slows the steps down, so the timed steps are also the measured ones.
            result["peak_bytes"] = torch.cuda.max_memory_allocated(device)
            result["breakdown"] = _cuda_breakdown(stage, result["peak_bytes"])
        activation_recv, grad_recv = _recv_buffers(stage)
        result["activation_recv_bytes"] = storage_bytes(activation_recv)
        result["grad_recv_bytes"] = storage_bytes(grad_recv)
        if rank != world_size - 1:
            result["losses"] = []
        if collect_params:
            buffer = io.BytesIO()
            torch.save({name: p.detach().cpu() for name, p in stage.module.inner.named_parameters()}, buffer)
            result["params"] = buffer.getvalue()
        if budget_bytes is not None and result["peak_bytes"] > budget_bytes:
            result["status"] = "oom"
            result["error"] = (f"stage {rank} peaked at {result['peak_bytes']} bytes, over the budget "
                               f"of {budget_bytes} bytes")
        else:
            result["status"] = "ok"
    except BaseException as exc:  # a trial failure is a result, never an escaping exception
        if isinstance(exc, KeyboardInterrupt):
            raise
        cause = _root_cause(exc)
        if tracker is not None and tracker.exceeded_bytes is not None:
            # Checked by state, not by exception type: the schedule wraps what the stage raised.
            result["status"] = "oom"
            result["error"] = (f"stage {rank}: live tensor bytes reached {tracker.exceeded_bytes} "
                               f"(over the budget of {budget_bytes} bytes)")
        else:
            oom = any(isinstance(e, (torch.OutOfMemoryError, MemoryError)) for e in _cause_chain(exc))
            result["status"] = "oom" if oom else "error"
            result["error"] = f"stage {rank}: {type(cause).__name__}: {_last_line(cause)}"
            result["peer_failed"] = _is_peer_failure(exc)
        result["traceback"] = traceback.format_exc(limit=8)
    return result


def _cause_chain(exc: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        chain.append(exc)
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return chain


def _root_cause(exc: BaseException) -> BaseException:
    # The schedule wraps stage failures ("[Stage 0] failed to run forward"); report the origin.
    chain = _cause_chain(exc)
    for e in chain:
        if isinstance(e, (SplitError, ConfigError, torch.OutOfMemoryError, MemoryError)):
            return e
    return chain[-1]


_PEER_FAILURE_TEXT = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket timeout")


def _is_peer_failure(exc: BaseException) -> bool:
    # A stage blocked on a send/recv to a stage that died fails too; that is not the cause.
    return any(isinstance(e, dist.DistError) or any(t in str(e).lower() for t in _PEER_FAILURE_TEXT)
               for e in _cause_chain(exc))


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


# --------------------------------------------------------------------------- processes


def combine_stage_results(results: list[dict], world_size: int) -> dict:
    """Merge per-stage results (ordered by rank) into :func:`measure_split`'s result."""
    by_rank = {r["rank"]: r for r in results}
    combined: dict[str, Any] = {"status": "ok", "error": None, "per_device_peak_bytes": [], "peak_bytes": None,
                                "breakdown": None, "per_device_breakdown": [], "step_time_s": None,
                                "losses": [], "schedule": None, "stage_layers": [],
                                "activation_recv_bytes": [], "grad_recv_bytes": []}
    failed = [by_rank[r] for r in sorted(by_rank) if by_rank[r]["status"] != "ok"]
    missing = [r for r in range(world_size) if r not in by_rank]
    if failed or missing:
        # The cause, not its echo: an out-of-memory stage first, then a stage that failed on
        # its own, before one that failed because a peer it talked to went away.
        failed.sort(key=lambda r: (r["status"] != "oom", bool(r.get("peer_failed"))))
        first = failed[0] if failed else None
        combined["status"] = first["status"] if first else "error"
        combined["error"] = first["error"] if first else f"stage(s) {missing} returned no result"
        return combined
    ordered = [by_rank[r] for r in range(world_size)]
    combined["per_device_peak_bytes"] = [int(r["peak_bytes"]) for r in ordered]
    combined["peak_bytes"] = max(combined["per_device_peak_bytes"])
    combined["per_device_breakdown"] = [r["breakdown"] for r in ordered]
    combined["breakdown"] = max(ordered, key=lambda r: r["peak_bytes"])["breakdown"]
    combined["step_time_s"] = max(r["step_time_s"] for r in ordered)
    combined["losses"] = ordered[-1]["losses"]
    combined["schedule"] = ordered[0]["schedule"]
    combined["stage_layers"] = [r["layers"] for r in ordered]
    combined["activation_recv_bytes"] = [r["activation_recv_bytes"] for r in ordered]
    combined["grad_recv_bytes"] = [r["grad_recv_bytes"] for r in ordered]
    if any("params" in r for r in ordered):
        params: dict[str, torch.Tensor] = {}
        for r in ordered:
            params.update(torch.load(io.BytesIO(r["params"]), weights_only=True))
        combined["params"] = params
    return combined


def _die_with_parent() -> None:
    # A stage must not outlive the process that started it (a trial killed by its runner).
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _write_result(fd: int, result: dict) -> None:
    data = pickle.dumps(result)
    with os.fdopen(fd, "wb") as pipe:
        pipe.write(data)


def _stage_main(rank: int, world_size: int, port: int, workload: Workload | str, config: dict,
                device_type: str, options: dict) -> dict:
    """A stage process's whole life: join the group, run the stage, leave. Returns its result."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    try:
        if isinstance(workload, str):
            workload = load_workload(workload)
        device = torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)  # before NCCL binds this process to a GPU
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=options.pop("pg_timeout_s")))
    except BaseException as exc:
        return {"rank": rank, "status": "error", "error": f"stage {rank}: {type(exc).__name__}: {_last_line(exc)}"}
    try:
        return run_stage(workload, config, rank=rank, world_size=world_size, device=device, **options)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _subprocess_main() -> None:
    """Entry point of a spawned stage: ``python -c ... <result fd> <request json>``."""
    _die_with_parent()
    write_fd, request = int(sys.argv[1]), json.loads(sys.argv[2])
    if request["device_type"] == "cpu":
        # The stages share this machine's cores, as they would share nothing on real devices.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // request["world_size"]))
    _write_result(write_fd, _stage_main(**request))


def _spawn_stage(request: dict) -> tuple[subprocess.Popen, int]:
    # A fresh interpreter that re-loads the workload from its source spec. Plain subprocess, as
    # autofit.trial does: no multiprocessing helper (resource tracker) outlives the trial.
    read_fd, write_fd = os.pipe()
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent)  # so the stage imports this autofit
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", "from autofit.pipeline import _subprocess_main; _subprocess_main()",
             str(write_fd), json.dumps(request)],
            pass_fds=(write_fd,), stdin=subprocess.DEVNULL, env=env)
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return process, read_fd


def _fork_stage(request: dict, workload: Workload) -> tuple[int, int]:
    # A Workload built in code (lambdas, closures) reaches the stage only by inheritance.
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        status = 1
        try:
            _die_with_parent()
            os.close(read_fd)
            # GNU OpenMP is not fork-safe: a forked child's first parallel region can hang when
            # the parent used the intra-op pool. One thread runs every op inline.
            torch.set_num_threads(1)
            _write_result(write_fd, _stage_main(workload=workload, **request))
            status = 0
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(status)  # never run the parent's atexit handlers or test teardown here
    os.close(write_fd)
    return pid, read_fd


class _StageProcess:
    """One stage process, spawned (Popen) or forked (a pid), and the read end of its result pipe."""

    def __init__(self, rank: int, read_fd: int, pid: int, popen: subprocess.Popen | None = None):
        self.rank, self.read_fd, self.pid, self.popen = rank, read_fd, pid, popen
        self.returncode: int | None = None
        self.data = bytearray()

    def poll(self) -> int | None:
        if self.returncode is None:
            if self.popen is not None:
                self.returncode = self.popen.poll()
            else:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout_s: float) -> int | None:
        end = time.monotonic() + timeout_s
        while self.poll() is None and time.monotonic() < end:
            time.sleep(0.02)
        return self.returncode

    def send(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def result(self) -> dict:
        if self.data:
            try:
                return pickle.loads(bytes(self.data))
            except Exception as exc:  # a truncated write: the stage died while reporting
                return {"rank": self.rank, "status": "error", "error": f"stage {self.rank}: unreadable result ({exc})"}
        code = self.wait(2.0)
        how = ("did not exit" if code is None else f"killed by signal {signal.Signals(-code).name}" if code < 0
               else f"exited with code {code}")
        return {"rank": self.rank, "status": "error", "error": f"stage {self.rank} process {how} without a result"}


def _collect(procs: list[_StageProcess], timeout_s: float) -> tuple[dict[int, dict], bool]:
    """Read every stage's result until all have reported; returns (results by rank, timed out)."""
    results: dict[int, dict] = {}
    open_procs = {proc.read_fd: proc for proc in procs}
    deadline = time.monotonic() + timeout_s
    failed_at = None
    while open_procs:
        now = time.monotonic()
        if now > deadline:
            return results, True
        # Once one stage has failed the others are blocked on it: give them a moment to report
        # their own failure, then stop waiting.
        if failed_at is not None and now - failed_at > 2.0:
            break
        ready, _, _ = select.select(list(open_procs), [], [], 0.1)
        for fd in ready:
            proc = open_procs[fd]
            chunk = os.read(fd, 1 << 20)
            if chunk:
                proc.data.extend(chunk)
                continue
            del open_procs[fd]  # end of file: the stage has written its result, or died
            os.close(fd)
            results[proc.rank] = proc.result()
            if results[proc.rank]["status"] != "ok" and failed_at is None:
                failed_at = time.monotonic()
    return results, False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure_split(workload: Workload, config: TrainConfig, *, device_type: str, warmup_steps: int,
                  measure_steps: int, budget_bytes: int | None, schedule: Schedule | str = Schedule.ONE_F_ONE_B,
                  seed: int = 0, timeout_s: float = 600.0, collect_params: bool = False) -> dict:
    """Run ``config`` as ``config.device_split`` pipeline stages, one process each, and measure it.

    CPU: gloo, one child process per stage on this machine. CUDA: NCCL, stage ``i`` on
    ``cuda:i``. Each stage builds the model from ``seed`` and its ``grad_accum``
    micro-batches from ``seed + 1`` (as :func:`autofit.training.build_trainee` and
    ``make_micro_batches`` would after ``torch.manual_seed``), then measures as
    :func:`run_stage` says: warm-up, tracked steps (CPU), timed steps.

    Never raises for a failing trial. Returns::

        {"status": "ok" | "oom" | "error" | "timeout", "error": str | None,
         "per_device_peak_bytes": [int per stage], "peak_bytes": int,
         "breakdown": {six categories, of the stage with the largest peak},
         "per_device_breakdown": [...], "step_time_s": float (slowest stage's median),
         "losses": [mean loss per optimizer step, all steps run], "schedule": "1f1b" | "gpipe",
         "stage_layers": [[start, end], ...], "activation_recv_bytes": [...],
         "grad_recv_bytes": [...], "params": {name: tensor} (only with collect_params)}

    ``oom``: a stage's live bytes passed ``budget_bytes`` (per device) or allocation failed.
    ``timeout``: the stages did not finish within ``timeout_s``; they are killed.

    Example::

        measure_split(load_workload("gpt-tiny"), TrainConfig(micro_batch=4, grad_accum=4, device_split=2),
                      device_type="cpu", warmup_steps=2, measure_steps=3, budget_bytes=None)
    """
    config = TrainConfig.from_dict(config) if isinstance(config, dict) else config
    world_size = config.device_split
    base = {"status": "error", "error": None, "per_device_peak_bytes": [], "peak_bytes": None, "breakdown": None,
            "step_time_s": None, "losses": []}
    if device_type not in ("cpu", "cuda"):
        return {**base, "error": f"unknown device_type {device_type!r}: expected cpu or cuda"}
    if device_type == "cuda" and torch.cuda.device_count() < world_size:
        return {**base, "error": f"device_split={world_size} needs {world_size} GPUs, found {torch.cuda.device_count()}"}
    try:
        schedule = Schedule(str(schedule).lower())
    except ValueError:
        return {**base, "error": f"unknown schedule {schedule!r}: expected 1f1b or gpipe"}

    options = {"warmup_steps": warmup_steps, "measure_steps": measure_steps, "budget_bytes": budget_bytes,
               "schedule": schedule.value, "seed": seed, "collect_params": collect_params,
               "pg_timeout_s": max(30.0, timeout_s)}
    if workload.source is None:
        # Forked stages inherit this process's modules: import the heavy ones (export, the
        # pipelining runtime, the memory tracker) once here rather than once per stage.
        # (importlib: an `import torch.x` here would make `torch` local to the whole function)
        importlib.import_module("torch.distributed._tools.mem_tracker")
        importlib.import_module("torch.distributed.pipelining")
    port = _free_port()
    procs: list[_StageProcess] = []
    results: dict[int, dict] = {}
    timed_out = False
    try:
        for rank in range(world_size):
            request = {"rank": rank, "world_size": world_size, "port": port, "config": config.to_dict(),
                       "device_type": device_type, "options": dict(options)}
            # A workload with a source spec is re-loaded in a fresh interpreter; one built in
            # code can only reach the stage by fork (and never with CUDA initialised here).
            if workload.source is not None:
                process, read_fd = _spawn_stage({**request, "workload": workload.source})
                procs.append(_StageProcess(rank, read_fd, process.pid, process))
            else:
                pid, read_fd = _fork_stage(request, workload)
                procs.append(_StageProcess(rank, read_fd, pid))
        results, timed_out = _collect(procs, timeout_s)
    finally:
        # Stages that reported are leaving their process group: let them exit on their own.
        grace_end = time.monotonic() + 10.0
        for proc in procs:
            if proc.rank in results and results[proc.rank]["status"] == "ok":
                proc.wait(max(0.0, grace_end - time.monotonic()))
        for proc in procs:
            proc.send(signal.SIGTERM)
        for proc in procs:
            if proc.wait(5.0) is None:
                proc.send(signal.SIGKILL)
                proc.wait(5.0)
            with contextlib.suppress(OSError):
                os.close(proc.read_fd)  # already closed when its result was read
    if timed_out and all(r["status"] == "ok" for r in results.values()):
        return {**base, "status": "timeout", "error": f"stages did not finish within {timeout_s:g} s"}
    return combine_stage_results(list(results.values()), world_size)

"""Run and measure one pipeline stage inside an initialized process group: :func:`run_stage`.

One optimizer step is PyTorch's schedule over pre-made micro-batches, the gradients of tied
parameters summed over their owner stages, and the optimizer step (through the GradScaler,
all stages skipping together on inf/NaN). The steps follow a :class:`autofit.runtime.schedule.MeasureSchedule`
run by :func:`autofit.runtime.schedule.run_steps`, as a single-device trial's do.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

from autofit.core.config import TrainConfig
from autofit.runtime.ranks import (
    agreed_optimizer_step,
    cap_cuda_memory,
    check_budget,
    measure_rank,
    record_failure,
    save_tensors,
)
from autofit.runtime.schedule import MeasureSchedule
from autofit.runtime.tracker import MemoryTracker, optimizer_state_bytes, storage_bytes
from autofit.trial.pipeline.stages import Schedule, SplitError, Stage, build_stage
from autofit.workloads.base import Workload

# --------------------------------------------------------------------------- one optimizer step


def _run_schedule(stage: Stage) -> None:
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


def _sync_replicated_grads(stage: Stage) -> None:
    for param, group in stage.replicated:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)


def _train_step(stage: Stage) -> float | None:
    """One optimizer step over ``grad_accum`` micro-batches; the mean loss on the last stage."""
    stage.optimizer.zero_grad(set_to_none=True)
    stage.raw_losses.clear()
    _run_schedule(stage)
    _sync_replicated_grads(stage)
    agreed_optimizer_step(stage.optimizer, stage.scaler, stage.device)
    if stage.index != stage.num_stages - 1:
        return None
    # The first step also computes a loss for the schedule's shape inference: keep the last n.
    losses = stage.raw_losses[-len(stage.target_mbs):]
    return float(torch.stack(losses).float().mean())


# --------------------------------------------------------------------------- measuring


def _recv_buffers(stage: Stage) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
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


def _cuda_breakdown(stage: Stage, peak_bytes: int) -> dict[str, int]:
    # As autofit.trial.measure does on CUDA: allocator statistics have no categories, so
    # activations are the rest of the peak after the states we can size.
    params = storage_bytes(list(stage.module.parameters()) + list(stage.module.buffers()))
    grads = storage_bytes([p.grad for p in stage.module.parameters() if p.grad is not None])
    state = optimizer_state_bytes(stage.optimizer)
    overhead = storage_bytes([stage.arg_mbs, stage.target_mbs, *_recv_buffers(stage)])
    return {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": state,
            "activations_bytes": max(0, peak_bytes - params - grads - state - overhead),
            "temporary_bytes": 0, "overhead_bytes": overhead}


def run_stage(workload: Workload, config: TrainConfig, *, rank: int, world_size: int, device: torch.device | str,
              warmup_steps: int = 2, measure_steps: int = 3, budget_bytes: int | None = None,
              schedule: Schedule | str = Schedule.ONE_F_ONE_B, seed: int = 0,
              params_path: str | None = None, steps: MeasureSchedule | None = None) -> dict:
    """Build and measure stage ``rank`` of ``world_size`` inside an initialized process group.

    The per-process body of :func:`measure_split`, also used under ``torchrun``. As
    :func:`autofit.trial.measure.measure_trial` does for one device:

    ``steps`` (a MeasureSchedule; default ``MeasureSchedule.from_steps(warmup_steps, measure_steps)``):

    1. its warm-up optimizer steps (the first, which also runs the schedule's shape
       inference, untracked);
    2. peak memory over its measured steps: on the CPU, live tensor bytes counted by
       :class:`autofit.runtime.tracker.MemoryTracker` (which also watches the warm-up and stops the
       stage as soon as it passes ``budget_bytes``); on CUDA, ``max_memory_allocated`` under
       a memory fraction capped at the budget;
    3. the median wall time of its timed steps, whole optimizer steps run without any tracker
       (every stage starts each one together, after a barrier).

    Never raises for a failing trial; returns a JSON-ready ``{"rank", "status":
    "ok"|"oom"|"error", "error", "peak_bytes", "breakdown", "step_time_s", "losses" (last
    stage only: the mean loss of every step run), "layers": [start, end], "schedule",
    "activation_recv_bytes", "grad_recv_bytes"}``. With ``params_path`` the stage's final
    parameters are written there (:func:`autofit.runtime.ranks.save_tensors`).
    """
    device = torch.device(device)
    result: dict[str, Any] = {"rank": rank, "status": "error", "error": None, "peak_bytes": None,
                              "breakdown": None, "step_time_s": None, "losses": [], "layers": None,
                              "schedule": None, "activation_recv_bytes": 0, "grad_recv_bytes": 0}
    tracker = None
    try:
        config = TrainConfig.from_dict(config) if isinstance(config, dict) else config
        if device.type == "cuda":
            cap_cuda_memory(device, budget_bytes)
        stage = build_stage(workload, config, rank=rank, world_size=world_size, device=device,
                            schedule=schedule, seed=seed)
        result["layers"] = list(stage.bounds)
        result["schedule"] = stage.schedule_name.value

        def step() -> float | None:
            loss = _train_step(stage)
            if tracker is not None and tracker.active:
                tracker.step_boundary()
            return loss

        def make_tracker() -> MemoryTracker:
            # The pre-made micro-batches are the data loader's, never counted; the receive
            # buffers allocated by step 1 live on and are counted as overhead.
            nonlocal tracker
            tracker = MemoryTracker(stage.module, stage.optimizer, inputs=[stage.arg_mbs, stage.target_mbs],
                                    overhead=[t for buffers in _recv_buffers(stage) for t in buffers],
                                    budget_bytes=budget_bytes)
            return tracker

        # Step 1 runs untracked: the schedule first infers the shapes it sends with an extra
        # forward and an autograd.grad that the tracker's module hooks break.
        measure_rank(result, steps or MeasureSchedule.from_steps(warmup_steps, measure_steps), device, step,
                     make_tracker=make_tracker, untracked_steps=1,
                     cuda_breakdown=lambda peak_bytes: _cuda_breakdown(stage, peak_bytes))
        activation_recv, grad_recv = _recv_buffers(stage)
        result["activation_recv_bytes"] = storage_bytes(activation_recv)
        result["grad_recv_bytes"] = storage_bytes(grad_recv)
        if rank != world_size - 1:
            result["losses"] = []
        if params_path is not None:
            save_tensors(dict(stage.module.inner.named_parameters()), params_path)
        check_budget(result, budget_bytes, "stage")
    except Exception as exc:  # a trial failure is a result, never an escaping exception
        record_failure(result, exc, label="stage", tracker=tracker, budget_bytes=budget_bytes, preferred=(SplitError,))
    return result

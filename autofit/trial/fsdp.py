"""Sharded data parallel: ``split_mode = fsdp`` runs ``device_split`` ranks of PyTorch's FSDP2.

``TrainConfig(device_split=N, split_mode="fsdp")`` trains the whole model on every rank, each on
its own ``micro_batch`` samples per micro-step (data parallel: a step of the job takes
``micro_batch × grad_accum × N`` samples), with the weights, gradients and optimizer state
sharded over the ranks by :func:`torch.distributed.fsdp.fully_shard`. There is no home-made
sharding here; this module applies the config to a model, runs the steps and measures them.

How the config is applied (:func:`shard_model`), as torchtitan's ``apply_fsdp`` does:

- every layer of ``workload.layers(model)`` is its own FSDP unit, then the root (embeddings,
  final norm, head: whatever is outside the layers); ``reshard_after_forward=True`` frees a
  layer's gathered weights after its forward and gathers them again for its backward (the
  root's too: measured on torch 2.13, FSDP2 reshards the root after its forward as well);
- with ``checkpoint_every = k > 1`` each checkpoint segment of k layers is one FSDP unit
  (``fully_shard([layer_i, ..., layer_i+k-1])``), because the segment's recomputation runs
  its layers' forwards inside one checkpoint;
- ``amp-bf16`` / ``amp-fp16``: ``torch.autocast`` around forward and loss over fp32 gathered
  weights, exactly as on one device (autofit's amp precisions are autocast over fp32 weights,
  gradients and optimizer state), and no ``MixedPrecisionPolicy``. That policy is the usual
  FSDP way to get *bf16 compute* (torchtitan: ``param_dtype=bf16, reduce_dtype=fp32``, no
  autocast), but it is a different precision, not AMP: every module then computes in bf16
  (embeddings, norms and the residual stream too), so losses and activations are not those of
  the one-device amp run. Its middle road does not run on the CPU: the policy on the layers with
  ``cast_forward_inputs=False`` gives layer norm bf16 weights and fp32 inputs, which the CPU
  kernel refuses ("mixed dtype (CPU)"). So here amp gathers fp32 weights (twice the bytes of a
  bf16 gather; the memory model counts them so) and matches the unsharded amp run's numerics.
  ``amp-fp16`` also uses a GradScaler whose inf check all ranks agree on. ``bf16``: the
  parameters themselves are bf16; ``fp32``: plain.

Processes: one per rank, rendezvous on 127.0.0.1; gloo on the CPU, NCCL on CUDA with rank i on
``cuda:i``. :func:`run_rank` is the per-process body and also runs under ``torchrun``
(``scripts/run_split_torchrun.py``).

Known limitations: dropout draws differ from the unsharded run (each rank has its own RNG
stream and its own samples); the measured step time on one CPU is that of N ranks sharing its
cores.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from autofit.core.config import Precision, SplitMode, TrainConfig
from autofit.core.records import TrialStatus
from autofit.estimator.fsdp_memory import fsdp_units
from autofit.runtime.messages import result_status
from autofit.runtime.ranks import (
    agreed_optimizer_step,
    cap_cuda_memory,
    check_budget,
    combine_results,
    free_port,
    join_failure,
    join_group,
    launch,
    leave_group,
    load_tensors,
    measure_rank,
    record_failure,
    save_tensors,
)
from autofit.runtime.schedule import MeasureSchedule
from autofit.runtime.tracker import MemoryTracker, optimizer_state_bytes, storage_bytes
from autofit.runtime.training import (
    Trainee,
    apply_config,
    checkpoint_layers,
    forward_backward,
    to_device,
)
from autofit.workloads.base import Workload
from autofit.workloads.load import load_workload

__all__ = ["fsdp_units", "measure_fsdp", "rank_child", "run_rank", "shard_model"]

def shard_model(model: nn.Module, layers: nn.ModuleList, config: TrainConfig, mesh=None,
                checkpoint: bool = True) -> nn.Module:
    """Checkpoint ``layers`` as ``config`` says (unless ``checkpoint=False``: already done), then
    ``fully_shard`` each unit and the root; returns ``model``.

    Must run inside an initialized process group (``mesh``: a 1-D DeviceMesh, default all ranks).
    """
    from torch.distributed.fsdp import fully_shard

    if config.checkpoint_every and checkpoint:
        checkpoint_layers(layers, config.checkpoint_every, config.checkpoint_policy)
    # amp-*: no MixedPrecisionPolicy -- see the module docstring for why autocast over fp32 gathers.
    for start, end in fsdp_units(len(layers), config.checkpoint_every):
        unit = layers[start] if end - start == 1 else [layers[i] for i in range(start, end)]
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


def _shard_then_optimize(model: nn.Module, workload: Workload, config: TrainConfig) -> torch.optim.Optimizer:
    shard_model(model, workload.layers(model), config, checkpoint=False)
    return workload.optimizer(model.parameters())


class _Rank:
    """One rank's model, optimizer and pre-made micro-batches."""

    def __init__(self, workload: Workload, config: TrainConfig, rank: int, world_size: int,
                 device: torch.device, seed: int) -> None:
        self.workload, self.config, self.device = workload, config, device
        self.world_size = world_size
        torch.manual_seed(seed)  # every rank builds the same model, as the unsharded run would
        model = workload.model()
        model.train()
        # The config's one order (autofit.runtime.training.apply_config): cast, checkpoint, then -- between
        # them and the optimizer, which must see the sharded parameters -- the FSDP units.
        applied = apply_config(model, config, device, layers=workload.layers(model) if config.checkpoint_every else None,
                               make_optimizer=lambda _params: _shard_then_optimize(model, workload, config))
        self.model, self.optimizer, self.scaler = model, applied.optimizer, applied.scaler
        # The job's micro-batches, as an unsharded run of micro_batch × N samples would draw
        # them; this rank keeps its slice. Made once, reused every step, never counted.
        torch.manual_seed(seed + 1)
        float_dtype = torch.bfloat16 if config.precision is Precision.BF16 else None
        lo, hi = rank * config.micro_batch, (rank + 1) * config.micro_batch
        self.micro_batches = [
            to_device(tree_map_only(torch.Tensor, lambda t: t[lo:hi].clone(), workload.batch(config.micro_batch * world_size)),
                      device, float_dtype)
            for _ in range(config.grad_accum)]

    def step(self, on_micro_step=None) -> float:
        """One optimizer step over the rank's micro-batches; the job's mean loss (all ranks)."""
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        trainee = Trainee(self.workload, self.config, self.model, self.optimizer, self.scaler, self.device)
        for index, (inputs, targets) in enumerate(self.micro_batches):
            # the one-device micro-step itself: autocast, loss / grad_accum, scaling, backward
            total += forward_backward(trainee, inputs, targets).float()
            if on_micro_step is not None:
                on_micro_step(index)
        agreed_optimizer_step(self.optimizer, self.scaler, self.device)
        total /= self.config.grad_accum * self.world_size
        dist.all_reduce(total)  # gloo has no AVG: a sum of each rank's share
        return float(total)


def _cuda_breakdown(r: _Rank, peak_bytes: int) -> dict[str, int]:
    # Allocator statistics have no categories: activations are the rest after the states we can size.
    params = storage_bytes([getattr(p, "_local_tensor", p) for p in r.model.parameters()] + list(r.model.buffers()))
    grads = storage_bytes([getattr(p.grad, "_local_tensor", p.grad) for p in r.model.parameters() if p.grad is not None])
    state = optimizer_state_bytes(r.optimizer)
    inputs = storage_bytes(r.micro_batches)
    return {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": state,
            "activations_bytes": max(0, peak_bytes - params - grads - state - inputs),
            "temporary_bytes": 0, "overhead_bytes": inputs}


def run_rank(workload: Workload, config: TrainConfig, *, rank: int, world_size: int, device: torch.device | str,
             warmup_steps: int = 2, measure_steps: int = 3, budget_bytes: int | None = None,
             seed: int = 0, params_path: str | None = None, steps: MeasureSchedule | None = None) -> dict:
    """Build and measure rank ``rank`` of ``world_size`` inside an initialized process group.

    As :func:`autofit.trial.pipeline.run_stage` does for a stage (:func:`autofit.runtime.ranks.measure_rank`),
    following ``steps`` (default ``MeasureSchedule.from_steps(warmup_steps, measure_steps)``):
    warm-up steps, the peak over the measured steps (CPU: :class:`autofit.runtime.tracker.MemoryTracker`,
    which stops the rank as soon as its live bytes pass ``budget_bytes``; CUDA:
    ``max_memory_allocated`` under a memory fraction capped at the budget), then the median
    wall time of the timed steps, started together.

    Never raises for a failing trial; returns a JSON-ready ``{"rank", "status": "ok"|"oom"|"error",
    "error", "peak_bytes", "breakdown", "step_time_s", "losses" (the job's mean loss per step),
    With ``params_path``, rank 0 writes the full parameters there (:func:`autofit.runtime.ranks.save_tensors`).
    """
    device = torch.device(device)
    result: dict[str, Any] = {"rank": rank, "status": "error", "error": None, "peak_bytes": None,
                              "breakdown": None, "step_time_s": None, "losses": []}
    tracker = None
    try:
        config = TrainConfig.from_dict(config) if isinstance(config, dict) else config
        if device.type == "cuda":
            cap_cuda_memory(device, budget_bytes)
        r = _Rank(workload, config, rank, world_size, device, seed)

        def step() -> float:
            active = tracker is not None and tracker.active
            return r.step((lambda _index: tracker.step_boundary()) if active else None)

        def make_tracker() -> MemoryTracker:
            nonlocal tracker
            tracker = MemoryTracker(r.model, r.optimizer, inputs=r.micro_batches, budget_bytes=budget_bytes)
            return tracker

        measure_rank(result, steps or MeasureSchedule.from_steps(warmup_steps, measure_steps), device, step,
                     make_tracker=make_tracker, cuda_breakdown=lambda peak_bytes: _cuda_breakdown(r, peak_bytes))
        if params_path is not None:
            full = {name: p.full_tensor() if hasattr(p, "full_tensor") else p
                    for name, p in r.model.named_parameters()}  # all-gathers: every rank takes part
            if rank == 0:
                save_tensors(full, params_path)
        check_budget(result, budget_bytes, "rank")
    except Exception as exc:  # a trial failure is a result, never an escaping exception
        record_failure(result, exc, label="rank", tracker=tracker, budget_bytes=budget_bytes)
    return result


# --------------------------------------------------------------------------- processes


def rank_child(request: dict, send=None, workload: Workload | None = None) -> dict:
    """A rank process's whole life (an :mod:`autofit.runtime.procs` child): join the group, run the rank, leave."""
    rank, options = request["rank"], request["options"]
    try:
        device = join_group(request, spawned=workload is None)
        workload = workload or load_workload(request["workload"])
    except Exception as exc:
        return join_failure(exc, rank, "rank")
    try:
        return run_rank(workload, request["config"], rank=rank, world_size=request["world_size"], device=device,
                        budget_bytes=options["budget_bytes"], seed=options["seed"],
                        params_path=options["params_dir"] and str(Path(options["params_dir"]) / "rank-0.npz"),
                        steps=MeasureSchedule.from_dict(options["steps"]))
    finally:
        leave_group()


def combine_rank_results(results: list[dict], world_size: int) -> dict:
    """Merge per-rank results into :func:`measure_fsdp`'s result: the largest rank's peak, the slowest rank's time."""
    combined, ordered = combine_results(results, world_size, "rank")
    if ordered is not None:
        combined["losses"] = ordered[0]["losses"]
    return combined


def measure_fsdp(workload: Workload | str, config: TrainConfig, *, device_type: str, warmup_steps: int = 2,
                 measure_steps: int = 3, budget_bytes: int | None = None, seed: int = 0, timeout_s: float = 600.0,
                 collect_params: bool = False, steps: MeasureSchedule | None = None) -> dict:
    """Run ``config`` as ``config.device_split`` FSDP ranks, one process each, and measure it.

    The workload must be loadable by name in a fresh interpreter (a built-in or a
    ``file.py:function`` spec: its ``source``). Never raises for a failing trial. Returns::

        {"status": "ok" | "oom" | "error" | "timeout", "error": str | None,
         "per_device_peak_bytes": [int per rank], "peak_bytes": int (the largest rank's),
         "breakdown": {six categories, of the largest rank}, "per_device_breakdown": [...],
         "step_time_s": float (the slowest rank's median), "losses": [the job's mean loss per step],
         "params": {name: full tensor} (only with collect_params)}

    Example::

        measure_fsdp("gpt-tiny", TrainConfig(micro_batch=4, device_split=2, split_mode="fsdp"), device_type="cpu")
    """
    config = TrainConfig.from_dict(config) if isinstance(config, dict) else config
    world_size = config.device_split
    base = {"status": "error", "error": None, "per_device_peak_bytes": [], "peak_bytes": None, "breakdown": None,
            "step_time_s": None, "losses": []}
    source = workload if isinstance(workload, str) else workload.source
    if source is None:
        return {**base, "error": "an fsdp trial re-loads the workload in each rank process: it needs a built-in "
                                 "name or a file.py:function spec (Workload.source)"}
    if device_type not in ("cpu", "cuda"):
        return {**base, "error": f"unknown device_type {device_type!r}: expected cpu or cuda"}
    if device_type == "cuda" and torch.cuda.device_count() < world_size:
        return {**base, "error": f"fsdp over {world_size} ranks needs {world_size} GPUs, found {torch.cuda.device_count()}"}
    steps = steps or MeasureSchedule.from_steps(warmup_steps, measure_steps)
    with tempfile.TemporaryDirectory(prefix="autofit-fsdp-") as params_dir:
        options = {"budget_bytes": budget_bytes, "seed": seed, "steps": steps.to_dict(),
                   "params_dir": params_dir if collect_params else None}
        port = free_port()
        requests = [{"rank": rank, "world_size": world_size, "port": port, "device_type": device_type,
                     "pg_timeout_s": max(30.0, timeout_s), "config": config.to_dict(), "options": options}
                    for rank in range(world_size)]
        results, timed_out = launch("autofit.trial.fsdp:rank_child", requests, source,
                                    timeout_s=timeout_s, label="rank")
        if timed_out and all(result_status(r) is TrialStatus.OK for r in results.values()):
            return {**base, "status": "timeout", "error": f"ranks did not finish within {timeout_s:g} s"}
        combined = combine_rank_results(list(results.values()), world_size)
        if collect_params and result_status(combined) is TrialStatus.OK:
            combined["params"] = load_tensors(Path(params_dir) / "rank-0.npz")
    return combined


def is_fsdp(config: TrainConfig) -> bool:
    """Whether ``config`` runs as FSDP ranks (fsdp over more than one device)."""
    return config.split_mode is SplitMode.FSDP and config.device_split > 1

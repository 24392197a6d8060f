"""Sharded data parallel: ``split_mode = fsdp`` runs ``device_split`` ranks of PyTorch's FSDP2.

``TrainConfig(device_split=N, split_mode="fsdp")`` trains the whole model on every rank, each on
its own ``micro_batch`` samples per micro-step (data parallel: a step of the job takes
``micro_batch × grad_accum × N`` samples), with the weights, gradients and optimizer state
sharded over the ranks by :func:`torch.distributed.fsdp.fully_shard`. There is no home-made
sharding here; this module applies the config to a model, runs the steps and measures them.

How the config is applied (:func:`shard_model`), as torchtitan's ``apply_fsdp`` does:

- every layer of ``workload.layers(model)`` is its own FSDP unit, then the root (embeddings,
  final norm, head: whatever is outside the layers); ``reshard_after_forward=True`` frees a
  layer's gathered weights after its forward and gathers them again for its backward (FSDP2
  keeps the root's gathered, as it is needed again first);
- with ``checkpoint_every = k > 1`` each checkpoint segment of k layers is one FSDP unit
  (``fully_shard([layer_i, ..., layer_i+k-1])``), because the segment's recomputation runs
  its layers' forwards inside one checkpoint;
- ``amp-bf16`` / ``amp-fp16``: ``MixedPrecisionPolicy(param_dtype=half, reduce_dtype=float32)``
  -- the all-gathers move half-precision weights and gradients are reduced in fp32, which is how
  FSDP users run mixed precision -- *and* ``torch.autocast`` around forward and loss, so the
  operators autocast keeps in fp32 (softmax, norms, the loss) still run in fp32, as in the
  unsharded AMP run; ``amp-fp16`` also uses a GradScaler whose inf check is agreed on by all
  ranks. ``bf16``: the parameters themselves are bf16; ``fp32``: no policy.

Processes: one per rank, rendezvous on 127.0.0.1; gloo on the CPU, NCCL on CUDA with rank i on
``cuda:i``. :func:`run_rank` is the per-process body and also runs under ``torchrun``
(``scripts/run_split_torchrun.py``).

Known limitations: dropout draws differ from the unsharded run (each rank has its own RNG
stream and its own samples); the measured step time on one CPU is that of N ranks sharing its
cores.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from autofit.config import Precision, SplitMode, TrainConfig
from autofit.tracker import CATEGORIES as BREAKDOWN_KEYS
from autofit.tracker import MemoryTracker, optimizer_state_bytes, storage_bytes
from autofit.training import AUTOCAST_DTYPE, autocast_context, checkpoint_layers, param_dtype, to_device
from autofit.workload import Workload, load_workload

__all__ = ["fsdp_units", "measure_fsdp", "rank_child", "run_rank", "shard_model"]

MIN_WARMUP_STEPS = 2   # step 1 creates the optimizer state; step 3 is the first steady one
MIN_TIMED_STEPS = 3    # a median needs a few samples


def fsdp_units(n_layers: int, checkpoint_every: int) -> list[tuple[int, int]]:
    """``[start, end)`` layer ranges that are one FSDP unit each: a layer, or a checkpoint segment."""
    k = checkpoint_every if checkpoint_every > 1 else 1
    return [(s, min(s + k, n_layers)) for s in range(0, n_layers, k)]


def shard_model(model: nn.Module, layers: nn.ModuleList, config: TrainConfig, mesh=None) -> nn.Module:
    """Checkpoint ``layers`` as ``config`` says, then ``fully_shard`` each unit and the root; returns ``model``.

    Must run inside an initialized process group (``mesh``: a 1-D DeviceMesh, default all ranks).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if config.checkpoint_every:
        checkpoint_layers(layers, config.checkpoint_every)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": True}
    if config.precision.is_amp:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=AUTOCAST_DTYPE[config.precision],
                                                   reduce_dtype=torch.float32)
    for start, end in fsdp_units(len(layers), config.checkpoint_every):
        unit = layers[start] if end - start == 1 else [layers[i] for i in range(start, end)]
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


class _Rank:
    """One rank's model, optimizer and pre-made micro-batches."""

    def __init__(self, workload: Workload, config: TrainConfig, rank: int, world_size: int,
                 device: torch.device, seed: int) -> None:
        self.workload, self.config, self.device = workload, config, device
        self.world_size = world_size
        torch.manual_seed(seed)  # every rank builds the same model, as the unsharded run would
        model = workload.model().to(device=device, dtype=param_dtype(config.precision))
        model.train()
        self.model = shard_model(model, workload.layers(model), config)
        self.optimizer = workload.optimizer(self.model.parameters())
        self.scaler = torch.amp.GradScaler(device.type) if config.precision is Precision.AMP_FP16 else None
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
        for index, (inputs, targets) in enumerate(self.micro_batches):
            with autocast_context(self.config.precision, self.device.type):
                loss = self.workload.loss(self.model(inputs), targets)
            scaled = loss / self.config.grad_accum
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            total += loss.detach().float()
            if on_micro_step is not None:
                on_micro_step(index)
        self._optimizer_step()
        total /= self.config.grad_accum * self.world_size
        dist.all_reduce(total)  # gloo has no AVG: a sum of each rank's share
        return float(total)

    def _optimizer_step(self) -> None:
        if self.scaler is None:
            self.optimizer.step()
            return
        # Each rank checks only its shards for inf/NaN: all must skip (or take) the step together.
        self.scaler.unscale_(self.optimizer)
        found = self.scaler._found_inf_per_device(self.optimizer)  # private, torch >= 1.6
        flag = torch.zeros(1, device=self.device)
        for value in found.values():
            flag += value.to(self.device).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        for value in found.values():
            value.copy_(flag.reshape(value.shape).to(value.device))
        self.scaler.step(self.optimizer)
        self.scaler.update()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_step(r: _Rank) -> tuple[float, float]:
    dist.barrier()  # start together, so a rank's time is not its wait for the others
    _sync(r.device)
    start = time.perf_counter()
    loss = r.step()
    _sync(r.device)
    return time.perf_counter() - start, loss


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
             warmup_steps: int = MIN_WARMUP_STEPS, measure_steps: int = 3, budget_bytes: int | None = None,
             seed: int = 0, collect_params: bool = False) -> dict:
    """Build and measure rank ``rank`` of ``world_size`` inside an initialized process group.

    As :func:`autofit.pipeline.run_stage` does for a stage: ``max(warmup_steps, 2)`` warm-up
    steps, the peak over ``measure_steps`` steps (CPU: :class:`autofit.tracker.MemoryTracker`,
    which stops the rank as soon as its live bytes pass ``budget_bytes``; CUDA:
    ``max_memory_allocated`` under a memory fraction capped at the budget), then the median
    wall time of ``max(measure_steps, 3)`` untracked steps started together.

    Never raises for a failing trial; returns a JSON-ready ``{"rank", "status": "ok"|"oom"|"error",
    "error", "peak_bytes", "breakdown", "step_time_s", "losses" (the job's mean loss per step),
    "params" (rank 0 with collect_params: base64 of torch.save of the full parameters)}``.
    """
    device = torch.device(device)
    result: dict[str, Any] = {"rank": rank, "status": "error", "error": None, "peak_bytes": None,
                              "breakdown": None, "step_time_s": None, "losses": []}
    tracker = None
    try:
        config = TrainConfig.from_dict(config) if isinstance(config, dict) else config
        if device.type == "cuda":
            torch.cuda.set_device(device)
            if budget_bytes is not None:
                # Caps the caching allocator only; the CUDA context and NCCL are outside it (FACTS.md).
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
        r = _Rank(workload, config, rank, world_size, device, seed)
        losses: list = result["losses"]
        warmup_steps, measure_steps = max(warmup_steps, MIN_WARMUP_STEPS), max(measure_steps, 1)
        if device.type == "cpu":
            tracker = MemoryTracker(r.model, r.optimizer, inputs=r.micro_batches, budget_bytes=budget_bytes)
            boundary = lambda _index: tracker.step_boundary()  # noqa: E731
            with tracker:
                for _ in range(warmup_steps):
                    losses.append(r.step(boundary))
                tracker.reset_peak()
                for _ in range(measure_steps):
                    losses.append(r.step(boundary))
            result["peak_bytes"] = tracker.peak_bytes
            result["breakdown"] = tracker.peak_breakdown()
        else:
            for _ in range(warmup_steps):
                losses.append(r.step())
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(max(measure_steps, MIN_TIMED_STEPS)):
            elapsed, loss = _timed_step(r)
            times.append(elapsed)
            losses.append(loss)
        result["step_time_s"] = statistics.median(times)
        if device.type == "cuda":  # nothing slows CUDA steps down: the timed steps are the measured ones
            result["peak_bytes"] = torch.cuda.max_memory_allocated(device)
            result["breakdown"] = _cuda_breakdown(r, result["peak_bytes"])
        if collect_params:
            full = {name: p.full_tensor().detach().cpu() if hasattr(p, "full_tensor") else p.detach().cpu()
                    for name, p in r.model.named_parameters()}  # all-gathers: every rank takes part
            if rank == 0:
                buffer = io.BytesIO()
                torch.save(full, buffer)
                result["params"] = base64.b64encode(buffer.getvalue()).decode()
        if budget_bytes is not None and result["peak_bytes"] > budget_bytes:
            result["status"] = "oom"
            result["error"] = f"rank {rank} peaked at {result['peak_bytes']} bytes, over the budget of {budget_bytes} bytes"
        else:
            result["status"] = "ok"
    except Exception as exc:  # a trial failure is a result, never an escaping exception
        chain = _cause_chain(exc)
        if tracker is not None and tracker.exceeded_bytes is not None:
            result["status"] = "oom"
            result["error"] = (f"rank {rank}: live tensor bytes reached {tracker.exceeded_bytes} "
                               f"(over the budget of {budget_bytes} bytes)")
        else:
            oom = any(isinstance(e, (torch.OutOfMemoryError, MemoryError)) for e in chain)
            result["status"] = "oom" if oom else "error"
            result["error"] = f"rank {rank}: {type(chain[-1]).__name__}: {_last_line(chain[-1])}"
            result["peer_failed"] = any(isinstance(e, dist.DistError) for e in chain)
        result["traceback"] = traceback.format_exc(limit=8)
    return result


def _cause_chain(exc: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        chain.append(exc)
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return chain


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


# --------------------------------------------------------------------------- processes


def rank_child(request: dict, send=None) -> dict:
    """A rank process's whole life: join the group, run the rank, leave. ``request`` is JSON."""
    rank, world_size, device_type = request["rank"], request["world_size"], request["device_type"]
    backend = "nccl" if device_type == "cuda" else "gloo"
    try:
        workload = request["workload"]
        workload = load_workload(workload) if isinstance(workload, str) else workload
        device = torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)  # before NCCL binds this process to a GPU
        else:  # the ranks share this machine's cores, as they would share nothing on real devices
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{request['port']}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=request["pg_timeout_s"]))
    except Exception as exc:
        return {"rank": rank, "status": "error", "error": f"rank {rank}: {type(exc).__name__}: {_last_line(exc)}"}
    try:
        return run_rank(workload, request["config"], rank=rank, world_size=world_size, device=device,
                        **request["options"])
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _RankProcess:
    """A spawned rank: a fresh interpreter in its own process group, its JSON result on a pipe."""

    def __init__(self, request: dict) -> None:
        self.rank = request["rank"]
        self.read_fd, write_fd = os.pipe()
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parent.parent)  # so the rank imports this autofit
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        code = ("import ctypes,json,os,signal,sys;"
                "ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL);"  # PR_SET_PDEATHSIG: die with the parent
                "from autofit.fsdp import rank_child;"
                "out = json.dumps(rank_child(json.loads(sys.argv[2]))).encode();"
                "f = os.fdopen(int(sys.argv[1]), 'wb'); f.write(out); f.close()")
        try:
            self.popen = subprocess.Popen([sys.executable, "-c", code, str(write_fd), json.dumps(request)],
                                          pass_fds=(write_fd,), stdin=subprocess.DEVNULL, env=env,
                                          start_new_session=True)
        finally:
            os.close(write_fd)
        self.data = bytearray()
        self.result: dict | None = None

    def read(self) -> None:
        chunk = os.read(self.read_fd, 1 << 20)
        if chunk:
            self.data.extend(chunk)
            return
        os.close(self.read_fd)
        self.read_fd = -1
        try:
            self.result = json.loads(bytes(self.data))
        except ValueError:
            code = self.popen.wait(5.0)
            how = f"killed by signal {signal.Signals(-code).name}" if code and code < 0 else f"exited with code {code}"
            self.result = {"rank": self.rank, "status": "error", "error": f"rank {self.rank} process {how} without a result"}

    def kill(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1


def _collect(procs: list[_RankProcess], timeout_s: float) -> bool:
    """Read every rank's result; False when ``timeout_s`` passed first."""
    deadline = time.monotonic() + timeout_s
    failed_at = None
    while any(p.result is None for p in procs):
        now = time.monotonic()
        if now > deadline:
            return False
        if failed_at is not None and now - failed_at > 2.0:  # the others are blocked on the failed one
            return True
        fds = {p.read_fd: p for p in procs if p.result is None}
        for fd in select.select(list(fds), [], [], 0.1)[0]:
            fds[fd].read()
            if fds[fd].result is not None and fds[fd].result["status"] != "ok" and failed_at is None:
                failed_at = time.monotonic()
    return True


def combine_rank_results(results: list[dict], world_size: int) -> dict:
    """Merge per-rank results into :func:`measure_fsdp`'s result: the largest rank's peak, the slowest rank's time."""
    by_rank = {r["rank"]: r for r in results}
    combined: dict[str, Any] = {"status": "ok", "error": None, "per_device_peak_bytes": [], "peak_bytes": None,
                                "breakdown": None, "per_device_breakdown": [], "step_time_s": None, "losses": []}
    failed = [by_rank[r] for r in sorted(by_rank) if by_rank[r]["status"] != "ok"]
    missing = [r for r in range(world_size) if r not in by_rank]
    if failed or missing:
        failed.sort(key=lambda r: (r["status"] != "oom", bool(r.get("peer_failed"))))  # the cause, not its echo
        combined["status"] = failed[0]["status"] if failed else "error"
        combined["error"] = failed[0]["error"] if failed else f"rank(s) {missing} returned no result"
        return combined
    ordered = [by_rank[r] for r in range(world_size)]
    combined["per_device_peak_bytes"] = [int(r["peak_bytes"]) for r in ordered]
    combined["peak_bytes"] = max(combined["per_device_peak_bytes"])
    combined["per_device_breakdown"] = [r["breakdown"] for r in ordered]
    combined["breakdown"] = max(ordered, key=lambda r: r["peak_bytes"])["breakdown"]
    combined["step_time_s"] = max(r["step_time_s"] for r in ordered)
    combined["losses"] = ordered[0]["losses"]
    if "params" in ordered[0]:
        combined["params"] = torch.load(io.BytesIO(base64.b64decode(ordered[0]["params"])), weights_only=True)
    return combined


def measure_fsdp(workload: Workload | str, config: TrainConfig, *, device_type: str, warmup_steps: int = 2,
                 measure_steps: int = 3, budget_bytes: int | None = None, seed: int = 0, timeout_s: float = 600.0,
                 collect_params: bool = False) -> dict:
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
    options = {"warmup_steps": warmup_steps, "measure_steps": measure_steps, "budget_bytes": budget_bytes,
               "seed": seed, "collect_params": collect_params}
    port = _free_port()
    procs: list[_RankProcess] = []
    try:
        for rank in range(world_size):
            procs.append(_RankProcess({"rank": rank, "world_size": world_size, "port": port, "workload": source,
                                       "config": config.to_dict(), "device_type": device_type,
                                       "pg_timeout_s": max(30.0, timeout_s), "options": options}))
        finished = _collect(procs, timeout_s)
    finally:
        for proc in procs:
            proc.kill()
    results = [p.result for p in procs if p.result is not None]
    if not finished and all(r["status"] == "ok" for r in results):
        return {**base, "status": "timeout", "error": f"ranks did not finish within {timeout_s:g} s"}
    return combine_rank_results(results, world_size)


def is_fsdp(config: TrainConfig) -> bool:
    """Whether ``config`` runs as FSDP ranks (fsdp over more than one device)."""
    return config.split_mode is SplitMode.FSDP and config.device_split > 1

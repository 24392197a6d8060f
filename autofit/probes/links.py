"""A device split's communication, measured: what moving bytes between ranks costs the time model.

FSDP ranks (:mod:`autofit.trial.fsdp`) all-gather each unit's parameters before its forward and again
before its backward (``reshard_after_forward=True``, the root included) and reduce-scatter its
gradients after its backward, at every micro-step; pipeline stages (:mod:`autofit.trial.pipeline`)
send each micro-batch's activations forward and their gradients back at every boundary. What
that costs depends on the backend and the link (gloo over loopback on a CPU, NCCL over NVLink
or PCIe), so it is measured, never looked up: :func:`probe_links` runs ``N`` ranks as a trial's
ranks run (:func:`autofit.runtime.ranks.join_group`: same backend, rendezvous and thread share), times
``all_gather_into_tensor``, ``reduce_scatter_tensor`` and a send at two sizes, and fits
``seconds = latency_s + bytes / bytes_per_s`` per operation (bytes: the gathered tensor, the
tensor before the scatter, the tensor sent); then what an FSDP unit adds to a micro-step beyond
its bytes (FSDP2's hooks, copies and collectives on a stack of tiny ``fully_shard``-ed layers,
against the same stack unsharded) and what an operator on a sharded parameter (a DTensor) costs
beyond a plain tensor's. It runs only when the space has splits that run,
once per machine and world size, cached next to the device rates.

From those lines and the profile's bytes of the model in hand (:func:`fsdp_micro_step_seconds`,
:func:`send_seconds`) the time model (:func:`autofit.estimator.time_model.predict_table`) costs, per
micro-step of one rank or stage::

    fsdp  = sum over units u (each layer or checkpoint segment, and the root) of
            fsdp_unit_s                                                   # hooks, copies, latencies: measured
            + 2 * params_u / all_gather_rate + grads_u / reduce_scatter_rate  # the bytes of the collectives
            + (2 * 2 * params_u + 2 * grads_u) * (1 + 1/N) / memory_rate  # FSDP2's copy-in / copy-out
    stage = per boundary it touches: send(activations) + send(activation gradients)

and an FSDP rank's optimizer step moves 1/N of the bytes but still runs its operators on every
tensor (it holds a shard of each), each a DTensor: ``ops * (op_latency + dtensor_op_s)``.

On the committed gpt-tiny grid (2 ranks on a 2-core CPU) this took the prior's FSDP step times from
1.7-2.7x fast to within the pipeline's error band (bf16, fp32: measured / predicted 0.8-1.2).

Known limitations: the probe measures one pair of sizes, not each unit's, and its units hold two
tensors (a unit's per-tensor work is not scaled); FSDP's gathers are priced in the bytes the profile
gives a unit (weights and buffers); ranks sharing one CPU are costed as if each had its cores
(modelling the share put FSDP further ahead of the pipeline than the grid measured).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

LINKS_VERSION = 3  # 2: FSDP's per-unit overhead; 3: a DTensor operator's
OPS = ("all_gather", "reduce_scatter", "send")
PROBE_BYTES = (16 * 1024, 4 * 2**20)  # a latency-bound and a bandwidth-bound size (bytes of the full tensor)
PROBE_REPEATS = 5
PROBE_TIMEOUT_S = 120.0
PROBE_UNITS = 4  # FSDP units of the per-unit overhead's probe


@dataclass(frozen=True)
class LinkRates:
    """Measured collective costs of ``world_size`` ranks on this machine: per operation (:data:`OPS`),
    a latency and the bytes per second of the full tensor."""

    device_type: str
    world_size: int
    backend: str
    latency_s: dict[str, float]
    bytes_per_s: dict[str, float]
    fsdp_unit_s: float  # what one FSDP unit adds to a micro-step beyond its bytes (hooks, copies, latencies)
    dtensor_op_s: float  # what an operator on a sharded parameter (a DTensor: the optimizer's) adds
    probe_s: float
    torch_version: str

    def seconds(self, op: str, nbytes: float, count: float = 1.0) -> float:
        """``count`` operations ``op`` moving ``nbytes`` in all."""
        return count * self.latency_s[op] + nbytes / self.bytes_per_s[op]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LinkRates":
        return cls(**data)


def implausible_links(links: LinkRates) -> str | None:
    """Why ``links`` cannot be a link's (a figure missing, zero, negative or not finite), or None."""
    for op in OPS:
        for what, value in (("latency", links.latency_s.get(op)), ("bytes/s", links.bytes_per_s.get(op))):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                return f"{op} {what} is {value!r}"
    for what, value in (("an FSDP unit's overhead", links.fsdp_unit_s), ("a DTensor operator's", links.dtensor_op_s)):
        if not (math.isfinite(value) and value >= 0):
            return f"{what} is {value!r}"
    return None


# --------------------------------------------------------------------------------------
# The probe


def _fit(sizes: tuple[int, ...], seconds: list[float]) -> tuple[float, float]:
    """(latency s, bytes/s) of the line through the two sizes' times (noise that reverses them: the
    larger size's average rate, the smaller size's time as the latency)."""
    (n1, n2), (t1, t2) = sizes, seconds
    if t2 > t1:
        rate = (n2 - n1) / (t2 - t1)
        return max(t1 - n1 / rate, t1 * 1e-3), rate
    return t1, n2 / t2


def _measure(device, world_size: int, rank: int) -> dict[str, list[float]]:
    """Best-of seconds of each operation at each of :data:`PROBE_BYTES`."""
    import torch
    import torch.distributed as dist

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    out: dict[str, list[float]] = {op: [] for op in OPS}
    for nbytes in PROBE_BYTES:
        numel = max(nbytes // 4 // world_size, 1) * world_size
        full = torch.zeros(numel, device=device)
        shard = torch.ones(numel // world_size, device=device)
        ops = {"all_gather": lambda: dist.all_gather_into_tensor(full, shard),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full)}

        def send():  # rank 0 sends to rank 1 and gets it back: two one-way sends
            if rank == 0:
                dist.send(full, 1)
                dist.recv(full, 1)
            elif rank == 1:
                dist.recv(full, 0)
                dist.send(full, 0)

        ops["send"] = send
        for op, fn in ops.items():
            best = _best_seconds(fn, sync)
            out[op].append(best / 2 if op == "send" else best)
    return out


def _best_seconds(fn, sync) -> float:
    """The best of :data:`PROBE_REPEATS` timed calls of ``fn`` after one warm-up (connections,
    buffers), every rank starting each call together (a barrier) and ``sync`` closing it."""
    import torch.distributed as dist

    fn()
    best = math.inf
    for _ in range(PROBE_REPEATS):
        dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _fsdp_overheads(device, units: int = PROBE_UNITS, width: int = 64) -> tuple[float, float]:
    """(seconds one FSDP unit adds to a micro-step beyond its bytes, seconds an operator on a sharded
    parameter takes beyond the same on a plain tensor). ``units`` small linear layers (their bytes
    negligible), each ``fully_shard``-ed as :func:`autofit.trial.fsdp.shard_model` does, timed forward and
    backward against the same stack unsharded on this rank: FSDP2's own work per unit (hooks, copies,
    the collectives' latency), as a trial's rank meets it. Then an in-place operator on each of
    their parameters, DTensors (what the optimizer steps) against plain ones."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    x = torch.randn(4, width, device=device)

    def stack():
        return nn.Sequential(*(nn.Linear(width, width) for _ in range(units))).to(device)

    def best(model) -> float:
        def step():
            model(x).sum().backward()
            model.zero_grad(set_to_none=True)

        return _best_seconds(step, sync)

    plain = best(stack())
    sharded = stack()
    for layer in sharded:
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(sharded, reshard_after_forward=True)
    unit_s = max(best(sharded) - plain, 0.0) / units

    def per_op(tensors) -> float:
        with torch.no_grad():
            out = math.inf
            for _ in range(PROBE_REPEATS + 1):  # the first: warm-up
                sync()
                start = time.perf_counter()
                for t in tensors:
                    t.mul_(1.0)
                sync()
                out = min(out, time.perf_counter() - start)
        return out / len(tensors)

    params = [p.detach() for p in sharded.parameters()]
    return unit_s, max(per_op(params) - per_op([p.to_local().clone() for p in params]), 0.0)


def link_probe_child(request: dict, send=None) -> dict:
    """One probe rank (an :mod:`autofit.runtime.procs` child): join the group as a trial's rank does, time the
    operations, leave. ``{"status": "ok", "seconds": {op: [s per size]}, "backend"}`` or an error."""
    import torch.distributed as dist

    from autofit.probes.failures import error_reply
    from autofit.runtime.ranks import join_group, leave_group

    try:
        device = join_group(request, spawned=True)
    except Exception as exc:  # noqa: BLE001 -- a rank that cannot join is the probe's failure, said
        return error_reply(exc)
    try:
        seconds = _measure(device, request["world_size"], request["rank"])
        unit_s, dtensor_op_s = _fsdp_overheads(device)
        return {"status": "ok", "seconds": seconds, "backend": dist.get_backend(), "fsdp_unit_s": unit_s,
                "dtensor_op_s": dtensor_op_s}
    except Exception as exc:  # noqa: BLE001
        return error_reply(exc)
    finally:
        leave_group()


def _start_rank(request: dict, device_type: str):
    """A probe rank in a trial rank's environment: forked from the trials' fork server on the CPU (no
    interpreter to start; our environment, as the ranks a trial spawns), else a fresh interpreter."""
    from autofit.runtime import forkserver, procs

    entry = "autofit.probes.links:link_probe_child"
    if device_type == "cpu" and forkserver.enabled():
        try:
            return forkserver.start_trial(entry, request, timeout_s=PROBE_TIMEOUT_S, echo_stderr=False)
        except OSError:
            pass  # no fork server here: a fresh interpreter
    return procs.spawn(entry, request, timeout_s=PROBE_TIMEOUT_S)


def measure_links(device_type: str, world_size: int) -> LinkRates:
    """Run the probe's ``world_size`` ranks (:func:`_start_rank`) and fit their timings. Raises
    RuntimeError when a rank fails (why in one line, its traceback logged at DEBUG:
    :mod:`autofit.probes.failures`) or what it measured is implausible."""
    import torch

    from autofit.core.records import TrialStatus
    from autofit.probes.failures import child_failure
    from autofit.runtime.messages import result_status
    from autofit.runtime.ranks import free_port

    started = time.perf_counter()
    port = free_port()
    children = []
    try:
        for rank in range(world_size):
            children.append(_start_rank({"rank": rank, "world_size": world_size, "port": port,
                                         "device_type": device_type, "pg_timeout_s": PROBE_TIMEOUT_S}, device_type))
        for child in children:
            child.wait()
    finally:
        for child in children:
            child.kill()
    results = [child.last_message() for child in children]
    failed = next((child_failure(child, True, f"the link probe's rank {rank}")
                   for rank, (r, child) in enumerate(zip(results, children))
                   if result_status(r) is not TrialStatus.OK), None)
    if failed is not None:
        raise RuntimeError(f"the link probe of {world_size} {device_type} ranks failed: {failed}")
    # A collective ends when its slowest rank does.
    latency, rate = {}, {}
    for op in OPS:
        worst = [max(r["seconds"][op][i] for r in results) for i in range(len(PROBE_BYTES))]
        latency[op], rate[op] = _fit(PROBE_BYTES, worst)
    links = LinkRates(device_type=device_type, world_size=world_size, backend=results[0]["backend"],
                      latency_s=latency, bytes_per_s=rate, fsdp_unit_s=max(r["fsdp_unit_s"] for r in results),
                      dtensor_op_s=max(r["dtensor_op_s"] for r in results),
                      probe_s=time.perf_counter() - started,
                      torch_version=torch.__version__)
    why = implausible_links(links)
    if why is not None:
        raise RuntimeError(f"the link probe of {world_size} {device_type} ranks measured {why}")
    return links


def _cache_path(device_type: str, world_size: int) -> Path:
    import torch

    from autofit.profiling.cache import cache_dir

    threads = "" if device_type == "cuda" else (os.environ.get("OMP_NUM_THREADS") or str(os.cpu_count()))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "") if device_type == "cuda" else ""
    ident = repr((LINKS_VERSION, torch.__version__, device_type, world_size, platform.node(), threads, visible))
    return cache_dir() / f"links-{device_type}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"


def probe_links(device_type: str, world_size: int, use_cache: bool = True,
                note: Callable[[str], None] | None = None) -> LinkRates | None:
    """The measured collective costs of ``world_size`` ranks on ``device_type``, read from the disk cache
    or probed (:func:`measure_links`) and cached. None when the probe fails or there are not that many
    GPUs (the time model then leaves the communication out, as it did before the probe); ``note`` is
    told which, a line at a time."""
    from autofit.core.files import write_atomic
    from autofit.runtime.devicelock import DeviceLock, device_names

    note = note or (lambda line: None)
    path = _cache_path(device_type, world_size)
    if use_cache and path.is_file():
        try:
            cached = LinkRates.from_dict(json.loads(path.read_text()))
            if implausible_links(cached) is None:
                note(f"{world_size}-rank link costs read from the cache ({path})")
                return cached
        except (ValueError, TypeError, KeyError):
            pass  # re-measured
    if device_type == "cuda":
        import torch

        if torch.cuda.device_count() < world_size:
            return None
    note(f"timing the collectives of {world_size} {device_type} ranks (all-gather, reduce-scatter, send; once "
         "per machine)...")
    started = time.perf_counter()
    try:
        with DeviceLock(device_names(device_type, world_size), "link probe"):
            links = measure_links(device_type, world_size)
    except RuntimeError as exc:
        note(f"{exc}: the time model leaves the splits' communication out until trials calibrate it")
        return None
    note(f"timed the collectives in {time.perf_counter() - started:.1f} s: all-gather "
         f"{links.latency_s['all_gather'] * 1e3:.2f} ms + {links.bytes_per_s['all_gather'] / 1e9:.2f} GB/s")
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(links.to_dict()))
        except OSError:
            pass
    return links


def split_sizes(configs, devices: int) -> list[int]:
    """The world sizes of ``configs``' device splits that run on ``devices`` devices (others are only estimated)."""
    return sorted({c.device_split for c in configs if 1 < c.device_split <= devices})


def with_links(rates, configs, devices: int, use_cache: bool = True, note: Callable[[str], None] | None = None):
    """``rates`` (:class:`autofit.probes.device_rates.DeviceRates`) with the link costs of every split size of
    ``configs`` that runs (:func:`split_sizes`), probed or read from the cache; ``rates`` itself when
    there is none (no split runs, or every probe failed)."""
    import dataclasses

    links = dict(rates.links or {})
    for n in split_sizes(configs, devices):
        if str(n) not in links:
            found = probe_links(rates.device_type, n, use_cache, note)
            if found is not None:
                links[str(n)] = found.to_dict()
    return dataclasses.replace(rates, links=links) if links else rates

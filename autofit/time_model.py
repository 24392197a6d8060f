"""The time model: a predicted step time for every config, from the profile's FLOPs and the device's rates.

It is a prior, for ordering a search and for sizing trial time limits; real trials calibrate
it (:mod:`autofit.calibration`). Three measured rates of the device, per dtype where it
matters, come from a short probe (:func:`probe_rates`: a child process with
``OMP_WAIT_POLICY=PASSIVE`` that measures twice, a few seconds once, then cached on disk next to
the profiles; implausible rates are never cached), never from a table of peak numbers: the same chip runs fp16 matmuls 1000x
slower than bf16 when it has no native kernel (FACTS.md, "Compute and time").

For one micro-step of ``b`` samples on a stage (shapes: scalars per config, vectorized over
a table of configs)::

    flops   = forward(b) + backward(b) + recompute(b)       # recompute: the checkpointed layers' forward
    bytes   = 4 * saved_activations(b) + 5 * weight_bytes   # write + read + gradient write + read; weights
                                                            # read by forward, dgrad, wgrad; grads written
    t_micro = flops / matmul_rate[dtype] + bytes / memory_rate + ops * op_latency

and for a step of ``m = grad_accum`` micro-batches over ``p`` pipeline stages (1F1B or GPipe,
Narayanan et al. SC'21)::

    t_step  = (m + p - 1) * max_s t_micro[s] + max_s t_optimizer[s]     # bubble (p - 1) / (m + p - 1)
    t_optimizer = 2 * (weights + grads + optimizer state) / memory_rate + ops * op_latency
    # an FSDP rank of N: the bytes / N, the ops on every tensor (a shard of each), each + a DTensor's overhead

With ``p = 1`` this is ``grad_accum * t_micro + t_optimizer`` (FACTS.md). Backward FLOPs of
a stage are the whole model's backward in proportion to the stage's forward FLOPs.

Known limitations: matmuls are costed at the probe's large-matrix rate (small matrices run
slower: the prior favours small micro-batches too much until calibrated); the operator count is
estimated from the parameter tensors, not counted; pipeline stages and FSDP ranks are assumed to run on
separate devices (ranks sharing one CPU get no speed-up, which the prior does not know). A split's
communication (FSDP's gathers and reduce-scatters, a pipeline's sends) is costed from the profile's
bytes and the measured links (:mod:`autofit.collectives`) when the search probed them; without them
a pipeline's transfers are a copy at the memory rate and FSDP's are left out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from autofit import forkserver, procs
from autofit.collectives import fsdp_micro_step_seconds, send_seconds
from autofit.config import FIELDS, Precision, TrainConfig, stage_bounds
from autofit.devicelock import DeviceLock, device_names
from autofit.files import write_atomic
from autofit.profile import Profile, cache_dir

if TYPE_CHECKING:
    import pandas as pd

RATES_VERSION = 3  # 3: the CUDA probe also measures the context and the cuBLAS workspace
# The dtype of the matmuls each precision runs (autocast runs matmuls in its low-precision dtype).
MATMUL_DTYPE = {Precision.FP32: "float32", Precision.AMP_BF16: "bfloat16", Precision.BF16: "bfloat16",
                Precision.AMP_FP16: "float16"}
# A probe matmul grows until one run takes this long (or reaches the largest size): long enough
# to time, short enough that fp16 without a native kernel (~0.4 GFLOP/s) costs tens of ms.
PROBE_TIMEOUT_S = 300.0  # the probe child's wall-clock limit
# Two probes of one device whose rates differ by more than this factor are not trusted (one was
# disturbed: another process, a frequency change); up to PROBE_ATTEMPTS children try again.
RATE_AGREEMENT = 3.0
PROBE_ATTEMPTS = 3
_PROBE_TARGET_S = 0.01
_PROBE_SIZES = (128, 256, 512, 1024, 2048)
_PROBE_REPEATS = 3
_PROBE_OPS = 10  # operators in the latency probe's forward + backward, accumulation included
# Operators per micro-step (forward + backward): about OPS_PER_TENSOR per parameter tensor (a
# transformer block's 12 tensors go with ~25 forward operators; backward doubles that), counted
# on the meta device by :func:`op_counts`; OPS_PER_LAYER when the workload is not at hand.
# Autocast adds a cast before most matmuls. A prior only: calibration corrects it.
OPS_PER_TENSOR = 6
OPS_PER_LAYER = 75
OPS_OUTSIDE_LAYERS = 40
AMP_OPS_FACTOR = 1.4
OPTIMIZER_OPS_PER_TENSOR = 4  # the optimizer's foreach kernels still touch every tensor
OPTIMIZER_TENSORS_PER_LAYER = 12
# Traffic multipliers of the formula in the module docstring.
ACTIVATION_TRAFFIC = 4.0
WEIGHT_TRAFFIC = 5.0
OPTIMIZER_TRAFFIC = 2.0


@dataclass(frozen=True)
class DeviceRates:
    """Measured rates of one device: matmul FLOP/s per dtype, memory bytes/s, seconds per tiny operator.

    ``device_name`` and ``threads`` identify what was measured (a CPU's model and the intra-op
    threads, a GPU's name); ``probe_s`` is what the probe cost.
    """

    device_type: str
    device_name: str
    threads: int
    matmul_flops_per_s: dict[str, float]
    memory_bytes_per_s: float
    op_latency_s: float
    probe_s: float
    torch_version: str
    # CUDA only (autofit.cuda_memory): the card's bytes outside the tensors, measured by the probe child
    cuda_overhead: dict | None = None
    # Device splits only (autofit.collectives): {world size: LinkRates dict}, what moving bytes between ranks costs
    links: dict | None = None

    def link(self, world_size: int):
        """The measured :class:`autofit.collectives.LinkRates` of ``world_size`` ranks, or None."""
        from autofit.collectives import LinkRates

        found = (self.links or {}).get(str(world_size))
        return LinkRates.from_dict(found) if found else None

    def memory_overhead(self):
        """The measured :class:`autofit.cuda_memory.CudaOverhead` (None on the CPU or when not measured)."""
        from autofit.cuda_memory import CudaOverhead

        return CudaOverhead(**self.cuda_overhead) if self.cuda_overhead else None

    def flops_per_s(self, precision: Precision | str) -> float:
        """Matmul FLOP/s of the dtype ``precision`` computes in."""
        return self.matmul_flops_per_s[MATMUL_DTYPE[Precision(precision)]]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DeviceRates":
        return cls(**data)


# --------------------------------------------------------------------------------------
# The probe.


def _device_name(device_type: str) -> str:
    if device_type == "cuda":
        import torch

        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _time_min(fn, sync, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def measure_rates(device_type: str = "cpu", dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")) -> DeviceRates:
    """Run the probe in this process (on CUDA this creates a context: prefer :func:`probe_rates`).

    The best of a few runs is kept: on a shared machine that is closest to what the device can do.
    """
    import torch

    started = time.perf_counter()
    device = torch.device(device_type)
    sync = (lambda: torch.cuda.synchronize(device)) if device_type == "cuda" else (lambda: None)
    flops: dict[str, float] = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        rate = 0.0
        for n in _PROBE_SIZES:
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            torch.mm(a, b)  # warm-up: kernel selection, thread pool start
            seconds = _time_min(lambda a=a, b=b: torch.mm(a, b), sync, _PROBE_REPEATS)
            rate = max(rate, 2 * n**3 / max(seconds, 1e-9))
            if seconds >= _PROBE_TARGET_S:
                break
        flops[name] = rate
    # Memory: a copy of 32 MiB reads and writes 64 MiB.
    src = torch.empty(8 * 2**20, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = _time_min(lambda: dst.copy_(src), sync, _PROBE_REPEATS)
    memory_bytes_per_s = 2 * src.numel() * src.element_size() / max(seconds, 1e-9)
    # Operator latency: a tiny forward and backward (matmul, GELU, sum; about _PROBE_OPS operators
    # with their autograd bookkeeping), dominated by dispatch (and kernel launches on CUDA).
    x = torch.randn(4, 16, device=device, requires_grad=True)
    w = torch.randn(16, 16, device=device, requires_grad=True)

    def tiny_steps():
        for _ in range(50):
            torch.nn.functional.gelu(x @ w).sum().backward()

    tiny_steps()
    op_latency_s = _time_min(tiny_steps, sync, _PROBE_REPEATS) / (50 * _PROBE_OPS)
    return DeviceRates(
        device_type=device_type, device_name=_device_name(device_type), threads=torch.get_num_threads(),
        matmul_flops_per_s=flops, memory_bytes_per_s=memory_bytes_per_s, op_latency_s=op_latency_s,
        probe_s=time.perf_counter() - started, torch_version=torch.__version__,
    )


def _cache_path(device_type: str) -> Path:
    import torch

    # A GPU's rates do not depend on the CPU threads: every process (a trial child too) finds one entry.
    threads = "" if device_type == "cuda" else (os.environ.get("OMP_NUM_THREADS") or str(torch.get_num_threads()))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "") if device_type == "cuda" else ""
    ident = repr((RATES_VERSION, torch.__version__, device_type, platform.node(), threads, visible,
                  _device_name(device_type) if device_type == "cpu" else ""))
    return cache_dir() / f"rates-{device_type}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"


def implausible(rates: DeviceRates) -> str | None:
    """Why ``rates`` cannot be a device's (a rate zero, negative, NaN or infinite), or None when they can."""
    values = {f"{name} matmul FLOP/s": v for name, v in rates.matmul_flops_per_s.items()}
    values.update({"memory bytes/s": rates.memory_bytes_per_s, "operator latency": rates.op_latency_s})
    for what, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            return f"{what} is {value!r}"
    return None


def disagreement(a: DeviceRates, b: DeviceRates, factor: float | None = None) -> str | None:
    """Which rate two probes of one device measured more than ``factor`` (default :data:`RATE_AGREEMENT`)
    apart, or None when they agree."""
    factor = RATE_AGREEMENT if factor is None else factor
    pairs = {f"{name} matmul FLOP/s": (a.matmul_flops_per_s[name], b.matmul_flops_per_s.get(name, math.nan))
             for name in a.matmul_flops_per_s}
    pairs.update({"memory bytes/s": (a.memory_bytes_per_s, b.memory_bytes_per_s),
                  "operator latency": (a.op_latency_s, b.op_latency_s)})
    for what, (x, y) in pairs.items():
        if not (max(x, y) <= factor * min(x, y)):
            return f"{what}: {x:.3g} against {y:.3g}"
    return None


def best_of(a: DeviceRates, b: DeviceRates) -> DeviceRates:
    """The faster figure of each rate: on a shared machine that is closest to what the device can do."""
    return dataclasses.replace(
        a, matmul_flops_per_s={k: max(v, b.matmul_flops_per_s[k]) for k, v in a.matmul_flops_per_s.items()},
        memory_bytes_per_s=max(a.memory_bytes_per_s, b.memory_bytes_per_s),
        op_latency_s=min(a.op_latency_s, b.op_latency_s), probe_s=a.probe_s + b.probe_s)


def probe_env(device_type: str) -> dict[str, str]:
    """The probe child's environment: a trial's, with GNU OpenMP's ``OMP_WAIT_POLICY=PASSIVE`` unless
    the user chose a policy (its default spin-wait makes the probe's own timing up to 500x slow on a
    loaded machine, as the bench found)."""
    return procs.child_env({"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")})


def start_probe_child(entry: str, request: dict, device_type: str, timeout_s: float) -> procs.Child:
    """A probe child running ``entry``: forked from the trials' fork server (:mod:`autofit.forkserver`:
    no interpreter to start nor torch to import, and the server is warm for the first trial) when
    that child would run in the probe's environment -- on the CPU, with an OpenMP wait policy already
    set in ours (OpenMP reads it when the server loads it, so the server's must be the probe's) --
    else spawned with :func:`probe_env`."""
    if (device_type == "cpu" and forkserver.enabled()
            and os.environ.get("OMP_WAIT_POLICY") == probe_env(device_type)["OMP_WAIT_POLICY"]):
        try:
            return forkserver.start_trial(entry, request, timeout_s=timeout_s, echo_stderr=False)
        except OSError:
            pass  # no fork server here: a fresh interpreter
    forkserver.wait_started()  # one starting (profiling starts it) would import beside the probe's timing
    return procs.spawn(entry, request, timeout_s=timeout_s, env=probe_env(device_type))


def _probe_once(device_type: str) -> list[DeviceRates]:
    """One probe child: its measurements (two, back to back). Raises RuntimeError when it fails."""
    child = start_probe_child("autofit.time_model:probe_child", {"device_type": device_type, "repeats": 2},
                              device_type, PROBE_TIMEOUT_S)
    try:
        finished = child.wait()
    finally:
        child.kill()
    messages = list(child.messages)
    if not messages:
        raise RuntimeError(f"the {device_type} rate probe failed: {child.failure(finished)}")
    return [DeviceRates.from_dict(m) for m in messages]


def measure_checked(device_type: str, attempts: int = PROBE_ATTEMPTS) -> tuple[DeviceRates, str | None]:
    """Probe in children until two measurements in a row are plausible and agree.

    Returns the rates and None, or -- when no attempt agreed -- the best plausible measurement and
    why it is doubtful (the caller warns and does not cache it). Raises RuntimeError when a probe
    child fails or nothing plausible was measured.
    """
    doubt, fallback = None, None
    for _ in range(attempts):
        measured = _probe_once(device_type)
        plausible = [r for r in measured if implausible(r) is None]
        if len(plausible) < len(measured):
            doubt = f"implausible rates ({implausible(next(r for r in measured if implausible(r)))})"
        for a, b in zip(plausible, plausible[1:]):
            why = disagreement(a, b)
            if why is None:
                return best_of(a, b), None
            doubt = f"repeated probes disagree ({why})"
        for r in plausible:
            fallback = r if fallback is None else best_of(fallback, r)
    if fallback is None:
        raise RuntimeError(f"the {device_type} rate probe measured {doubt}")
    return fallback, f"after {attempts} probes, {doubt}"


def probe_rates(device_type: str = "cpu", use_cache: bool = True,
                note: Callable[[str], None] | None = None) -> DeviceRates:
    """The device's rates, measured once per machine, device type, thread count and torch version.

    Cached under :func:`autofit.profile.cache_dir`. The probe runs in a child process (so the caller
    -- a search that runs trials in children -- never holds a CUDA context nor starts OpenMP's
    threads) with ``OMP_WAIT_POLICY=PASSIVE`` (:func:`probe_env`), and measures twice: rates that
    are zero, infinite or far off their repeat (:func:`implausible`, :func:`disagreement`) are probed
    again, and if they never settle the best plausible ones are used with a warning, never cached.
    Raises RuntimeError when the probe child fails or measures nothing plausible. ``note`` is
    called with a line for a user: the rates read from the cache, or the probe starting and done.
    """
    note = note or (lambda line: None)
    path = _cache_path(device_type)
    if use_cache and path.is_file():
        try:
            cached = DeviceRates.from_dict(json.loads(path.read_text()))
            if implausible(cached) is None:
                note(f"{device_type} rates read from the cache ({path})")
                return cached
        except (ValueError, TypeError, KeyError):
            pass  # an unreadable (or implausible) cache entry is re-measured
    note(f"probing the {device_type}'s rates (matmuls and operator latency in a child; once per machine)...")
    started = time.perf_counter()
    with DeviceLock(device_names(device_type), "device probe"):  # a trial beside it would halve its rates
        rates, doubt = measure_checked(device_type)
    note(f"probed the {device_type} in {time.perf_counter() - started:.1f} s: "
         f"{rates.matmul_flops_per_s.get('float32', 0.0) / 1e9:,.1f} GFLOP/s fp32 matmul, "
         f"{rates.op_latency_s * 1e6:,.1f} us per operator")
    if doubt is not None:
        warnings.warn(f"the {device_type} rate probe is unsteady ({doubt}): using its best rates for this run "
                      "only; the time model's prior is rougher until trials calibrate it", RuntimeWarning,
                      stacklevel=2)
        return rates
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(rates.to_dict()))  # a concurrent reader never sees half a file
        except OSError:
            pass
    return rates


# --------------------------------------------------------------------------------------
# Prediction.


@dataclass(frozen=True)
class OpCounts:
    """Parameter tensors of each layer and of the rest of the model (operators scale with them)."""

    tensors_per_layer: tuple[int, ...]
    tensors_outside: int
    # (precision, per-sample factor, fixed factor): the workload's own layer timed for real against
    # :func:`layer_time_line` (autofit.layer_probe); () when not measured.
    layer_scales: tuple[tuple[str, float, float], ...] = ()

    def scales(self, precision: str) -> tuple[float, float]:
        """(per-sample factor, fixed factor) of ``precision``; (1, 1) when its layer was not timed."""
        return next(((c, f) for p, c, f in self.layer_scales if p == precision), (1.0, 1.0))


def op_counts(workload) -> OpCounts | None:
    """Parameter tensors of ``workload``'s model, built on the meta device (no memory, no init).
    None when the model cannot be built there."""
    import torch

    try:
        with torch.device("meta"):
            model = workload.model()
        layers = workload.layers(model)
    except Exception:  # noqa: BLE001 -- a model that refuses the meta device gets the per-layer default
        return None
    in_layers = tuple(len(list(layer.parameters())) for layer in layers)
    return OpCounts(tensors_per_layer=in_layers, tensors_outside=max(len(list(model.parameters())) - sum(in_layers), 0))


def layer_time_line(profile: Profile, precision: str, rates: DeviceRates,
                    counts: OpCounts | None = None) -> tuple[float, float]:
    """The time model's (fixed seconds, seconds per sample) of the first layer's forward and backward,
    unscaled: what :mod:`autofit.layer_probe` compares a real run of that layer with."""
    pp = profile.for_precision(precision)
    layer = pp.layers[0]
    fwd_total = pp.forward_flops[1]
    flops = layer.forward_flops[1] * (1 + (pp.backward_flops[1] / fwd_total if fwd_total else 2.0))
    per_sample = (flops / rates.flops_per_s(precision)
                  + ACTIVATION_TRAFFIC * max(layer.forward.delta[1], 0.0) / rates.memory_bytes_per_s)
    tensors = counts.tensors_per_layer[0] if counts is not None and counts.tensors_per_layer else None
    ops = OPS_PER_TENSOR * max(tensors, 1) if tensors is not None else OPS_PER_LAYER
    ops *= AMP_OPS_FACTOR if Precision(precision).is_amp else 1.0
    fixed = (WEIGHT_TRAFFIC * (layer.param_bytes + layer.grad_bytes) / rates.memory_bytes_per_s
             + ops * rates.op_latency_s)
    return fixed, per_sample


def _stage_terms(profile: Profile, precision: str, split: int, checkpointed: bool,
                 counts: OpCounts | None = None) -> list[dict]:
    """Per stage: FLOPs per sample (forward + backward + recompute), activation bytes per sample,
    weight bytes, optimizer-step bytes, operator counts, boundary bytes per sample."""
    pp = profile.for_precision(precision)
    n = profile.n_layers
    layer_fwd = np.array([layer.forward_flops[1] for layer in pp.layers])
    fwd_total = pp.forward_flops[1]
    bwd_total = pp.backward_flops[1]
    outside_fwd = max(fwd_total - layer_fwd.sum(), 0.0)
    amp = Precision(precision).is_amp
    terms = []
    for s, (start, end) in enumerate(stage_bounds(n, split)):
        first, last = s == 0, s == split - 1
        fwd = layer_fwd[start:end].sum() + (outside_fwd if (first and last) else outside_fwd / 2 * (first + last))
        bwd = bwd_total * (fwd / fwd_total) if fwd_total else 0.0
        recompute = layer_fwd[start:end].sum() if checkpointed else 0.0  # every layer sits in a segment
        saved = sum(max(pp.layers[i].forward.delta[1], 0.0) for i in range(start, end))
        if last:
            saved += max(pp.post_forward.delta[1], 0.0)
        if first:
            saved += max(pp.pre_forward.delta[1], 0.0)
        weights = sum(pp.layers[i].param_bytes for i in range(start, end))
        grads = sum(pp.layers[i].grad_bytes for i in range(start, end))
        if first and last:
            weights, grads = pp.static_param_bytes, pp.grad_bytes
        else:
            weights += (pp.pre_param_bytes if first else 0) + (pp.post_param_bytes if last else 0)
            grads += (pp.pre_grad_bytes if first else 0) + (pp.post_grad_bytes if last else 0)
        share = grads / pp.grad_bytes if pp.grad_bytes else 1.0
        if counts is not None and len(counts.tensors_per_layer) == n:
            layer_ops = OPS_PER_TENSOR * sum(max(k, 1) for k in counts.tensors_per_layer[start:end])
            outside_ops = OPS_PER_TENSOR * max(counts.tensors_outside, 1)
            tensors = sum(counts.tensors_per_layer[start:end]) + counts.tensors_outside * (first + last) / 2
        else:
            layer_ops, outside_ops = OPS_PER_LAYER * (end - start), OPS_OUTSIDE_LAYERS
            tensors = OPTIMIZER_TENSORS_PER_LAYER * (end - start)
        # Recomputation runs the forward once more: a third of a micro-step's operators.
        ops = layer_ops * (4 / 3 if checkpointed else 1.0) + outside_ops / 2 * (first + last)
        terms.append({
            "flops_per_sample": fwd + bwd + recompute,
            "recompute_flops_per_sample": recompute,
            "saved_bytes_per_sample": saved,
            "weight_bytes": weights + grads,
            "optimizer_bytes": weights + grads + pp.optimizer_bytes * share,
            "ops": ops * (AMP_OPS_FACTOR if amp else 1.0),
            "optimizer_ops": OPTIMIZER_OPS_PER_TENSOR * max(tensors, 1),
            "boundary_bytes_per_sample": pp.layers[end - 1].output[1] if not last else 0.0,
            # per boundary it sends over or receives from (after it, before it): bytes per sample
            "boundaries_bytes_per_sample": ([pp.layers[end - 1].output[1]] if not last else [])
                                           + ([pp.layers[start - 1].output[1]] if not first else []),
        })
    return terms


def exposed(comm_s, compute_s, device_type: str):
    """The part of FSDP's communication ``comm_s`` a micro-step waits for, next to its compute ``compute_s``.
    On the CPU all of it: gloo's copies and reductions run on the cores that compute (the ranks share
    them). On CUDA NCCL runs on streams of its own beside the compute (FSDP2 prefetches the next
    unit's gather), so only what the compute cannot hide."""
    if device_type == "cuda":
        return np.maximum(comm_s - compute_s, 0.0)
    return comm_s


def predict_table(profile: Profile, configs: list[TrainConfig], rates: DeviceRates,
                  counts: OpCounts | None = None) -> pd.DataFrame:
    """Predicted times of many configs. One row per config, in the given order.

    Columns: the five config fields, ``micro_step_time_s`` (the slowest stage's micro-step),
    ``optimizer_step_time_s``, ``step_time_s``, ``samples_per_s``, ``flops_per_step`` (all
    stages, recomputation included), ``recompute_flops_per_step`` and ``bubble_fraction``.
    ``counts`` (:func:`op_counts`) sizes the operator overhead; without it a transformer
    block's count is assumed. Configs with more stages than layers get NaN times. Raises KeyError if the profile or the
    rates lack a precision of ``configs``.
    """
    import pandas as pd  # here, not at the top: the probe child imports this module and needs no pandas

    n = len(configs)
    cols = {f: np.array([getattr(getattr(c, f), "value", getattr(c, f)) for c in configs]) for f in FIELDS}
    out = {k: np.full(n, np.nan) for k in ("micro_step_time_s", "optimizer_step_time_s", "step_time_s",
                                            "flops_per_step", "recompute_flops_per_step", "bubble_fraction")}
    keys = np.array([f"{c.precision.value}|{int(c.checkpoint_every > 0)}|{c.device_split}|{c.data_parallel}"
                     for c in configs])
    for key in np.unique(keys) if n else []:
        idx = np.nonzero(keys == key)[0]
        precision, checkpointed, split, ranks = key.split("|")
        split, ranks = int(split), int(ranks)
        links = rates.link(max(split, ranks))  # measured collectives (autofit.collectives); None: not costed
        comm, dtensor_op_s = np.zeros(len(idx)), 0.0
        if ranks > 1:
            # FSDP: every rank runs the whole model on its micro-batch (one stage), the optimizer on
            # its shards (below), and gathers and reduce-scatters every unit (a layer or a checkpoint
            # segment) at each micro-step.
            if links is not None:
                dtensor_op_s = links.dtensor_op_s
                every = cols["checkpoint_every"][idx]
                for k in np.unique(every):
                    comm[every == k] = fsdp_micro_step_seconds(profile.for_precision(precision), profile.n_layers,
                                                               int(k), links, rates.memory_bytes_per_s)
            split = 1
        elif split > profile.n_layers:
            continue
        b = cols["micro_batch"][idx].astype(np.float64)
        m = cols["grad_accum"][idx].astype(np.float64)
        rate = rates.flops_per_s(precision)
        # The workload's own layer, timed (autofit.layer_probe): per-sample and fixed parts rescaled.
        per_sample_scale, fixed_scale = counts.scales(precision) if counts is not None else (1.0, 1.0)
        stage_micro, stage_opt = [], []
        flops = np.zeros(len(idx))
        recompute = np.zeros(len(idx))
        for t in _stage_terms(profile, precision, split, checkpointed == "1", counts):
            # A boundary's transfers: measured sends, on both of its stages (the receiver waits for them);
            # without the link probe, a copy at the memory rate on the sender.
            copied = 0.0 if links is not None else 2 * t["boundary_bytes_per_sample"]
            sends = sum(send_seconds(x * b, links) for x in t["boundaries_bytes_per_sample"]) if links is not None else 0.0
            per_sample = (t["flops_per_sample"] / rate + (ACTIVATION_TRAFFIC * t["saved_bytes_per_sample"]
                          + copied) / rates.memory_bytes_per_s) * b
            fixed = WEIGHT_TRAFFIC * t["weight_bytes"] / rates.memory_bytes_per_s + t["ops"] * rates.op_latency_s
            compute = per_sample_scale * per_sample + fixed_scale * fixed
            stage_micro.append(compute + sends + exposed(comm, compute, rates.device_type))
            # An FSDP rank steps 1/ranks of the bytes, but every tensor (a shard of each), as DTensors.
            stage_opt.append(OPTIMIZER_TRAFFIC * t["optimizer_bytes"] / rates.memory_bytes_per_s / ranks
                             + t["optimizer_ops"] * (rates.op_latency_s + dtensor_op_s))
            flops += t["flops_per_sample"] * b * m
            recompute += t["recompute_flops_per_sample"] * b * m
        t_micro = np.max(np.stack(stage_micro), axis=0)
        t_opt = float(max(stage_opt))
        flops, recompute = flops * ranks, recompute * ranks  # the whole job's
        out["micro_step_time_s"][idx] = t_micro
        out["optimizer_step_time_s"][idx] = t_opt
        out["step_time_s"][idx] = (m + split - 1) * t_micro + t_opt
        out["flops_per_step"][idx] = flops
        out["recompute_flops_per_step"][idx] = recompute
        out["bubble_fraction"][idx] = (split - 1) / (m + split - 1)
    table = pd.DataFrame({f: cols[f] for f in FIELDS})
    for k, v in out.items():
        table[k] = v
    table["samples_per_s"] = np.array([c.samples_per_step for c in configs], dtype=np.float64) / table["step_time_s"]
    return table[list(FIELDS) + ["micro_step_time_s", "optimizer_step_time_s", "step_time_s", "samples_per_s",
                                 "flops_per_step", "recompute_flops_per_step", "bubble_fraction"]]


def predict(profile: Profile, config: TrainConfig, rates: DeviceRates, counts: OpCounts | None = None) -> dict:
    """The predicted times of one config, as :func:`predict_table`'s row (a dict)."""
    return predict_table(profile, [config], rates, counts).iloc[0].to_dict()


def probe_child(request: dict, send=None) -> dict:
    """The rate probe in a child process (:mod:`autofit.procs`): the rates as a JSON-ready dict.

    With ``request["repeats"]`` > 1 it measures that many times back to back, sending each
    measurement but the last as a message and returning the last (so a caller can check them
    against each other). On CUDA the context and the cuBLAS workspace are measured first, before
    any probe tensor exists (:func:`autofit.cuda_memory.measure_overhead`)."""
    overhead = None
    if request["device_type"] == "cuda":
        from autofit.cuda_memory import measure_overhead

        overhead = measure_overhead("cuda").to_dict()
    repeats = max(int(request.get("repeats", 1)), 1)
    for i in range(repeats):
        rates = measure_rates(request["device_type"]).to_dict()
        rates["cuda_overhead"] = overhead
        if i < repeats - 1 and send is not None:
            send(rates)
    return rates


def cached_rates(device_type: str) -> DeviceRates | None:
    """The probe's cached rates of this machine's device, or None; never probes (a trial child reads
    the context the probe measured without starting another process)."""
    path = _cache_path(device_type)
    try:
        return DeviceRates.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None

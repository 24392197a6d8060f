"""The device probe: matmul FLOP/s per dtype, memory bandwidth and per-operator latency, measured on this
machine in a child process (twice, disagreeing or implausible rates probed again), and cached.
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

from autofit.core.config import Precision
from autofit.core.files import write_atomic
from autofit.probes.cuda_overhead import CudaOverhead, fallback_overhead
from autofit.profiling.cache import cache_dir
from autofit.runtime import forkserver, procs
from autofit.runtime.devicelock import DeviceLock, device_names

if TYPE_CHECKING:
    pass

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
ALL_DTYPES = ("float32", "bfloat16", "float16")
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_PROBE_TARGET_S = 0.01
# Past 1024 the size grows by sqrt(2) (each matmul about 2.8x the last one's time, not 8x): the largest
# size's four runs are most of the probe, and a CPU whose 1024 matmul just misses the target (7 ms at fp32
# on the bench's machine) stops at 1448 (~20 ms) instead of 2048 (~55 ms), at a rate a few percent lower
# (there 288-297 GFLOP/s at 1448 against 302-307 at 2048).
_PROBE_SIZES = (128, 256, 512, 1024, 1448, 2048)
_PROBE_REPEATS = 3
_PROBE_OPS = 10  # operators in the latency probe's forward + backward, accumulation included


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
    # CUDA only (autofit.probes.cuda_overhead): the card's bytes outside the tensors, measured by the probe child
    cuda_overhead: dict | None = None
    # Device splits only (autofit.probes.links): {world size: LinkRates dict}, what moving bytes between ranks costs
    links: dict | None = None

    def link(self, world_size: int):
        """The measured :class:`autofit.probes.links.LinkRates` of ``world_size`` ranks, or None."""
        from autofit.probes.links import LinkRates

        found = (self.links or {}).get(str(world_size))
        return LinkRates.from_dict(found) if found else None

    def memory_overhead(self):
        """The measured :class:`autofit.probes.cuda_overhead.CudaOverhead` (None on the CPU or when not measured)."""
        from autofit.probes.cuda_overhead import CudaOverhead

        return CudaOverhead.from_dict(self.cuda_overhead) if self.cuda_overhead else None

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


def measure_rates(device_type: str = "cpu", dtypes: tuple[str, ...] = ALL_DTYPES) -> DeviceRates:
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
            # uniform, drawn in the dtype: half the time of normal draws cast after (a GEMM's speed does not
            # depend on its values, save denormals, which [0, 1) in these dtypes does not produce)
            a = torch.rand(n, n, device=device, dtype=dtype)
            b = torch.rand(n, n, device=device, dtype=dtype)
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


def start_probe_child(entry: str, request: dict, device_type: str, timeout_s: float) -> procs.Child:
    """A probe child running ``entry``: on the CPU, forked from the trials' fork server
    (:mod:`autofit.runtime.forkserver`: no interpreter to start nor torch to import, and the server is
    warm for the first trial), else spawned. Either way it runs in a trial's environment
    (:func:`autofit.runtime.procs.child_env`), whose OpenMP wait policy keeps the probe's timing off
    spin-waits (up to 500x slow on a loaded machine, as the bench found)."""
    if device_type == "cpu" and forkserver.enabled():
        try:
            return forkserver.start_trial(entry, request, timeout_s=timeout_s, echo_stderr=False)
        except OSError:
            pass  # no fork server here: a fresh interpreter
    forkserver.wait_started()  # one starting (profiling starts it) would import beside the probe's timing
    return procs.spawn(entry, request, timeout_s=timeout_s, env=procs.child_env())


def _probe_once(device_type: str, dtypes: tuple[str, ...] = ALL_DTYPES) -> list[DeviceRates]:
    """One probe child: its measurements of ``dtypes``' matmuls (two, back to back). Raises RuntimeError when
    it fails, saying why in one line (the child's traceback logged at DEBUG: :mod:`autofit.probes.failures`)."""
    from autofit.probes.failures import child_failure

    child = start_probe_child("autofit.probes.device_rates:probe_child",
                              {"device_type": device_type, "repeats": 2, "dtypes": list(dtypes)},
                              device_type, PROBE_TIMEOUT_S)
    try:
        finished = child.wait()
    finally:
        child.kill()
    messages = [m for m in child.messages if m.get("status") != "error"]
    if not messages or len(messages) < len(child.messages):
        raise RuntimeError(f"the {device_type} rate probe failed: "
                           f"{child_failure(child, finished, f'the {device_type} rate probe')}")
    return [DeviceRates.from_dict(m) for m in messages]


def measure_checked(device_type: str, attempts: int = PROBE_ATTEMPTS,
                    dtypes: tuple[str, ...] = ALL_DTYPES) -> tuple[DeviceRates, str | None]:
    """Probe in children until two measurements in a row are plausible and agree.

    Returns the rates and None, or -- when no attempt agreed -- the best plausible measurement and
    why it is doubtful (the caller warns and does not cache it). Raises RuntimeError when a probe
    child fails or nothing plausible was measured.
    """
    doubt, fallback = None, None
    for _ in range(attempts):
        measured = _probe_once(device_type, dtypes)
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
                note: Callable[[str], None] | None = None, precisions=None) -> DeviceRates:
    """The device's rates, measured once per machine, device type, thread count and torch version.

    Cached under :func:`autofit.profiling.cache.cache_dir`. The probe runs in a child process (so the caller
    -- a search that runs trials in children -- never holds a CUDA context nor starts OpenMP's
    threads) in a trial's environment and OpenMP wait policy (:func:`autofit.runtime.procs.child_env`), and measures twice: rates that
    are zero, infinite or far off their repeat (:func:`implausible`, :func:`disagreement`) are probed
    again, and if they never settle the best plausible ones are used with a warning, never cached.
    Raises RuntimeError when the probe child fails or measures nothing plausible. ``note`` is
    called with a line for a user: the rates read from the cache, or the probe starting and done.

    ``precisions`` (default: all) limits the matmuls timed to the dtypes those precisions compute in:
    the probe runs before a search's first trial, and a dtype no config uses (fp16 on a CPU without its
    kernels: tens of ms a matmul) is time the user waits for nothing. A cached entry lacking a dtype asked
    for has it probed and added (its memory and operator figures kept).
    """
    note = note or (lambda line: None)
    dtypes = _dtypes(precisions)
    path = _cache_path(device_type)
    cached = _read_cache(path) if use_cache else None
    if cached is not None and all(d in cached.matmul_flops_per_s for d in dtypes):
        note(f"{device_type} rates read from the cache ({path})")
        return cached
    if cached is not None:
        dtypes = tuple(d for d in dtypes if d not in cached.matmul_flops_per_s)
    note(f"probing the {device_type}'s rates (matmuls and operator latency in a child; once per machine)...")
    started = time.perf_counter()
    with DeviceLock(device_names(device_type), "device probe"):  # a trial beside it would halve its rates
        rates, doubt = measure_checked(device_type, dtypes=dtypes)
    note(f"probed the {device_type} in {time.perf_counter() - started:.1f} s: "
         + "".join(f"{rate / 1e9:,.1f} GFLOP/s {_SHORT.get(name, name)} matmul, "
                   for name, rate in rates.matmul_flops_per_s.items())
         + f"{rates.op_latency_s * 1e6:,.1f} us per operator")
    if cached is not None:
        rates = dataclasses.replace(cached, matmul_flops_per_s={**cached.matmul_flops_per_s, **rates.matmul_flops_per_s},
                                    probe_s=cached.probe_s + rates.probe_s)
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


def _dtypes(precisions) -> tuple[str, ...]:
    """The matmul dtypes ``precisions`` compute in (:data:`MATMUL_DTYPE`), in :data:`ALL_DTYPES`' order; all for None."""
    if precisions is None:
        return ALL_DTYPES
    wanted = {MATMUL_DTYPE[Precision(p)] for p in precisions}
    return tuple(d for d in ALL_DTYPES if d in wanted)


def _read_cache(path: Path) -> DeviceRates | None:
    """The plausible rates cached at ``path``, or None (none there, unreadable or implausible: probed again)."""
    try:
        cached = DeviceRates.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return cached if implausible(cached) is None else None


def probe_child(request: dict, send=None) -> dict:
    """The rate probe in a child process (:mod:`autofit.runtime.procs`): the rates as a JSON-ready dict.

    With ``request["repeats"]`` > 1 it measures that many times back to back, sending each
    measurement but the last as a message and returning the last (so a caller can check them
    against each other). On CUDA the context and the cuBLAS workspace are measured first, before
    any probe tensor exists (:func:`autofit.probes.cuda_overhead.measure_overhead`). A failure is
    returned as :func:`autofit.probes.failures.error_reply`'s message."""
    from autofit.probes.failures import error_reply

    try:
        overhead = None
        if request["device_type"] == "cuda":
            from autofit.probes.cuda_overhead import measure_overhead

            overhead = measure_overhead("cuda").to_dict()
        repeats = max(int(request.get("repeats", 1)), 1)
        dtypes = tuple(request.get("dtypes") or ALL_DTYPES)
        for i in range(repeats):
            rates = measure_rates(request["device_type"], dtypes).to_dict()
            rates["cuda_overhead"] = overhead
            if i < repeats - 1 and send is not None:
                send(rates)
        return rates
    except Exception as exc:  # noqa: BLE001 -- the parent says it in one line, the traceback under --debug
        return error_reply(exc)


def cached_rates(device_type: str) -> DeviceRates | None:
    """The probe's cached rates of this machine's device, or None; never probes (a trial child reads
    the context the probe measured without starting another process)."""
    path = _cache_path(device_type)
    try:
        return DeviceRates.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def device_overhead(device_type: str) -> CudaOverhead | None:
    """What estimates for ``device_type`` should use: None on the CPU; on CUDA the probe's measured
    overhead where this machine has a CUDA device (probed once in a child, then cached), else the
    fallback, labelled as assumed."""
    if device_type != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return fallback_overhead()
    from autofit.probes.device_rates import probe_rates

    try:
        return probe_rates("cuda").memory_overhead() or fallback_overhead("the device probe measured nothing")
    except RuntimeError as exc:
        return fallback_overhead(f"the device probe failed ({exc})")

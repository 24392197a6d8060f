"""What a CUDA card holds beyond the tensors autofit counts: the context and the cuBLAS workspaces.

Both are properties of the device, the driver and the CUDA/torch build, so they are measured on
the device in use (by the device probe child, :func:`autofit.probes.device_rates.probe_rates`, and again
by each trial child), never looked up in a table:

- **context**: the process's use of the card (NVML's per-process figure) less the caching
  allocator's reserved bytes. It grows as lazily loaded kernel modules arrive, so it is read
  after a warm-up that runs the kernels a training step runs (matmuls in every dtype, their
  backward, an elementwise op, a reduction).
- **workspace**: cuBLAS / cuBLASLt allocate their workspaces through the caching allocator, once
  per handle and stream, and keep them: after the warm-up's tensors are freed, what is still
  allocated is the workspaces (tens of MiB on recent GPUs; ``max_memory_allocated`` counts them).

Where nothing can be measured (estimating for CUDA on a machine without one) the fallback
constants below are used and every estimate says so.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields

# Fallbacks only (no CUDA device here, or no NVML): the context with lazy module loading is about
# 300-500 MB on CUDA 12 (pytorch #107667, docs/facts.md#cuda-context); measured 742-760 MiB on an H200 with CUDA 13
# (results/benchmarks/gpu/run1-h200.md). The workspace is not assumed. What the allocator reserves
# beyond its tensors is the estimate's own model (autofit.estimator.reserved_model), not the device's.
FALLBACK_CONTEXT_BYTES = 450 * 2**20
FALLBACK_WORKSPACE_BYTES = 0
# A process that offloads its optimizer (torchao's CPUOffloadOptimizer: pinned host buffers, a side stream)
# holds more context: 68-72 MiB more on an H200 with torch 2.11 and torchao 0.18, the same for two models
# of different sizes (results/benchmarks/gpu/README.md, run 7). Measured by the probe where torchao is
# installed; this is the fallback.
FALLBACK_OFFLOAD_CONTEXT_BYTES = 72 * 2**20


@dataclass(frozen=True)
class CudaOverhead:
    """Bytes a CUDA process holds on the card besides its tensors, and how they were obtained.

    ``measured`` is False for the fallback constants; ``method`` says how (``nvml per process``,
    ``mem_get_info (whole card)``, or why nothing was measured).
    """

    context_bytes: int
    workspace_bytes: int
    measured: bool = False
    method: str = "assumed: not measured"
    offload_context_bytes: int = FALLBACK_OFFLOAD_CONTEXT_BYTES  # more context with offload=optimizer

    def note(self) -> str:
        """One line for an estimate's notes."""
        how = "measured" if self.measured else "ASSUMED (not measured)"
        return (f"CUDA context {self.context_bytes / 2**20:,.0f} MiB and cuBLAS workspace "
                f"{self.workspace_bytes / 2**20:,.0f} MiB {how}: {self.method}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CudaOverhead:
        """Read :meth:`to_dict`'s output; keys of older versions (a cached ``fragmentation``) are dropped."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def fallback_overhead(why: str = "no CUDA device here to measure it") -> CudaOverhead:
    return CudaOverhead(FALLBACK_CONTEXT_BYTES, FALLBACK_WORKSPACE_BYTES, False, f"assumed: {why}")


def nvml_index() -> int:
    """NVML's index of CUDA device 0 (the first entry of CUDA_VISIBLE_DEVICES when it is a number)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def process_used_bytes(index: int | None = None) -> int | None:
    """This process's use of the card as NVML lists it; None without NVML (pynvml / nvidia-ml-py)
    or when NVML cannot see this process (another PID namespace)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index() if index is None else index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
    except Exception:  # noqa: BLE001 -- not installed, no driver library, no permission: not measurable
        pass
    return None


def context_bytes_now(device=None) -> tuple[int | None, str]:
    """(this process's bytes on the card outside the allocator's reserved bytes, how), or (None, why)."""
    import torch

    own = process_used_bytes()
    if own is None:
        return None, "NVML cannot see this process (pip install nvidia-ml-py)"
    return own - torch.cuda.memory_reserved(device), "nvml per process"


def warm_up_kernels(device) -> None:
    """Run what a training step commonly runs, once, so that the lazily loaded kernel modules a trial
    will load anyway and the cuBLAS handles exist: the probe and every trial run the same warm-up, so
    the context they measure differs only by the model's own kernels. Everything is freed after."""
    import torch
    from torch.nn import functional as F

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in (64, 1024):  # small and large GEMM tiles load different kernels
            emb = torch.nn.Embedding(100, n, device=device, dtype=dtype)
            lin = torch.nn.Linear(n, 100, device=device, dtype=dtype)
            opt = torch.optim.AdamW([*emb.parameters(), *lin.parameters()])
            tokens = torch.randint(100, (64,), device=device)
            h = F.dropout(F.layer_norm(emb(tokens), (n,)), 0.1)
            F.cross_entropy(lin(F.gelu(h)).float(), tokens).backward()
            opt.step()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lin = torch.nn.Linear(64, 64, device=device)
        lin(torch.randn(64, 64, device=device)).float().sum().backward()
    torch.cuda.synchronize(device)


def measure_overhead(device="cuda") -> CudaOverhead:
    """Measure the context and the workspaces in this process (it creates a CUDA context: run it in a
    child, as :func:`autofit.probes.device_rates.probe_rates` does). Call it before any tensor of the caller's
    is allocated on the device: whatever is still allocated after the warm-up counts as workspace."""
    import gc

    import torch

    device = torch.device(device)
    warm_up_kernels(device)
    gc.collect()
    workspace = int(torch.cuda.memory_allocated(device))
    context, method = context_bytes_now(device)
    if context is None:
        return CudaOverhead(FALLBACK_CONTEXT_BYTES, workspace, False,
                            f"workspace measured, context assumed: {method}")
    return CudaOverhead(int(context), workspace, True, method, _offload_context_bytes(device, int(context)))


def _offload_context_bytes(device, context_bytes: int) -> int:
    """How much more context a process holds once it has stepped an offloaded optimizer (measured after the
    plain context, on one parameter torchao offloads); the fallback where torchao is missing or it fails."""
    import torch

    from autofit.runtime.offload import MIN_OFFLOAD_NUMEL, missing_library, offload_optimizer, release_offloaded

    if missing_library() is not None:
        return FALLBACK_OFFLOAD_CONTEXT_BYTES
    try:
        weight = torch.nn.Parameter(torch.zeros(MIN_OFFLOAD_NUMEL, device=device))
        optimizer = offload_optimizer(torch.optim.AdamW([weight]))
        (weight * 2).sum().backward()
        optimizer.step()
        torch.cuda.synchronize(device)
        grown, _ = context_bytes_now(device)
        release_offloaded(optimizer)  # the probe goes on to time matmuls: its parameter goes now
    except Exception:  # noqa: BLE001 -- the fallback stands, as it does without torchao
        return FALLBACK_OFFLOAD_CONTEXT_BYTES
    return max(0, int(grown) - context_bytes) if grown is not None else FALLBACK_OFFLOAD_CONTEXT_BYTES

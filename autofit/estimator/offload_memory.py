"""The ``offload`` lever's memory: what stays on the device, and what the host must hold.

With ``offload=optimizer`` (:mod:`autofit.runtime.offload`, torchao's ``CPUOffloadOptimizer``) every
trainable parameter of at least 4096 elements is stepped on the host. From the profile's
optimizer, the one a config trains with (the workload's, or the ``optimizer`` lever's, profiled over
the same parameters), and the profile's list of trainable tensors (``grad_rows``):

- the device keeps the weights, the gradients (accumulated there; the host copy is made as each is
  final) and the small parameters' state. That state is their share of the profiled state per
  gradient byte, counted in the card's 512-byte blocks, at least one byte per byte (a vector's
  Adafactor second moment is as large as the vector, though its matrices' factored state is
  smaller), plus the step counters of the fused Adam that steps them there; the step's temporaries
  shrink to the small parameters' share. The copies back into the parameters are in place: no
  device buffer;
- the host keeps, per offloaded parameter, a pinned copy and a pinned gradient (torch's caching host
  allocator rounds each pinned block up to a power of two), the offloaded part of the state, and one
  parameter's step temporaries at a time (each has its own optimizer): counted as four times the
  largest offloaded tensor.

The host's total must fit in the machine's physical memory (pinned pages cannot be swapped out):
otherwise the config is pruned, saying how much it needs. The step's time on the host and the copies
are not in the time model: trials measure them, and the calibration gives offload a term of its own.
"""

from __future__ import annotations

import dataclasses
import os

from autofit.core.budget import format_bytes
from autofit.core.config import TrainConfig
from autofit.profiling.data import PrecisionProfile, Profile
from autofit.profiling.step import CUDA_BLOCK_BYTES
from autofit.runtime.offload import MIN_OFFLOAD_NUMEL, refusal
from autofit.runtime.training import param_dtype

__all__ = ["HostNeed", "host_need", "host_refusal", "machine_memory_bytes", "offload_refusal", "offloaded"]

# A parameter's host step: its optimizer's temporaries, as a multiple of the parameter's bytes.
HOST_STEP_FACTOR = 4


@dataclasses.dataclass(frozen=True)
class HostNeed:
    """What offloading a precision's optimizer moves: bytes on the host, and the state left on the device."""

    pinned_bytes: int        # pinned copies of the offloaded parameters and of their gradients
    state_bytes: int         # the offloaded optimizer state
    step_bytes: int          # one parameter's host step at a time
    device_state_bytes: int  # the state of the parameters under 4096 elements, which stays

    @property
    def host_bytes(self) -> int:
        return self.pinned_bytes + self.state_bytes + self.step_bytes


def machine_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _pinned_block(nbytes: int) -> int:
    return 1 << max(nbytes - 1, 0).bit_length()


def _device_block(nbytes: int) -> int:
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


def host_need(pp: PrecisionProfile, fused: bool = False) -> HostNeed:
    """What ``pp`` (as it trains: its optimizer's state in ``optimizer_bytes``) needs with ``offload=optimizer``.
    ``fused``: the optimizer is an Adam or AdamW, which :mod:`autofit.runtime.offload` makes fused."""
    small_limit = MIN_OFFLOAD_NUMEL * param_dtype(pp.precision).itemsize
    large = [nbytes for _, nbytes in pp.grad_rows if nbytes >= small_limit]
    # On the card each state tensor is a block of its own (512-byte multiples): a small tensor's share
    # of the state is counted over its blocks, so rounding never puts the kept state under the card's.
    blocks = sum(_device_block(nbytes) for _, nbytes in pp.grad_rows)
    small_blocks = sum(_device_block(nbytes) for _, nbytes in pp.grad_rows if nbytes < small_limit)
    per_block_byte = pp.optimizer_bytes / blocks if blocks else 0.0
    # a fused Adam keeps its step counters on the card, a block each (the profiled one kept them on the host)
    counters = CUDA_BLOCK_BYTES * sum(1 for _, nbytes in pp.grad_rows if nbytes < small_limit) if fused else 0
    kept = min(pp.optimizer_bytes, int(round(small_blocks * max(per_block_byte, 1.0)))) + counters
    # the host's copy is not rounded: its share is counted per byte
    small_bytes = sum(nbytes for _, nbytes in pp.grad_rows if nbytes < small_limit)
    per_grad_byte = pp.optimizer_bytes / pp.grad_bytes if pp.grad_bytes else 0.0
    host_state = pp.optimizer_bytes - min(pp.optimizer_bytes, int(round(small_bytes * max(per_grad_byte, 1.0))))
    return HostNeed(pinned_bytes=2 * sum(_pinned_block(n) for n in large), state_bytes=host_state,
                    step_bytes=HOST_STEP_FACTOR * max(large, default=0), device_state_bytes=kept)


def offloaded(pp: PrecisionProfile, fused: bool = False) -> PrecisionProfile:
    """``pp`` as the device sees it with ``offload=optimizer``: only the small parameters' state, and their
    step's temporaries (a device split's ends likewise; ``fused``: as in :func:`host_need`)."""
    need = host_need(pp, fused)
    share = min(1.0, need.device_state_bytes / pp.optimizer_bytes) if pp.optimizer_bytes else 0.0
    ends = pp.split_ends
    if ends is not None:
        ends = offloaded(ends, fused) if ends.grad_rows else dataclasses.replace(
            ends, optimizer_bytes=int(round(ends.optimizer_bytes * share)),
            optimizer_peak_bytes=int(round(ends.optimizer_peak_bytes * share)), optimizer_per_tensor=False)
    return dataclasses.replace(pp, optimizer_bytes=need.device_state_bytes,
                               optimizer_peak_bytes=int(round(pp.optimizer_peak_bytes * share)),
                               optimizer_per_tensor=False, split_ends=ends)


def offload_refusal(profile: Profile, config: TrainConfig) -> str | None:
    """Why ``config``'s offload cannot run, before any memory is counted (None: it can, or offloads
    nothing): the lever's own refusals (:func:`autofit.runtime.offload.refusal`: the CPU device, FSDP,
    amp-fp16, adamw8bit, an optimizer it does not wrap, torchao missing)."""
    return refusal(config, profile.optimizer, profile.device_type)


def host_refusal(pp: PrecisionProfile, host_bytes: int | None = None) -> str | None:
    """Why offloading ``pp``'s optimizer (the precision as it trains) cannot run on a host of
    ``host_bytes`` (default: this machine's physical memory), or None: a profile without its list of
    tensors, or more to hold there than the host has."""
    if not pp.grad_rows:
        return "offload=optimizer needs the profile's list of trainable tensors, which this profile lacks: profile again"
    need = host_need(pp)
    host_bytes = machine_memory_bytes() if host_bytes is None else host_bytes
    if need.host_bytes > host_bytes:
        return (f"offload=optimizer needs {format_bytes(need.host_bytes)} on the host (pinned copies "
                f"{format_bytes(need.pinned_bytes)}, optimizer state {format_bytes(need.state_bytes)}, step "
                f"{format_bytes(need.step_bytes)}): more than this machine's {format_bytes(host_bytes)}")
    return None

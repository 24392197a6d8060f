"""Peak memory of CPU training steps read without autofit's counting: the allocator's and the OS's view.

The tracker (:mod:`autofit.runtime.tracker`) and the profiler both count the storages of the tensors a
dispatch mode sees, so their agreement says little. Two readers that share nothing with them:

- **allocator** (:func:`allocator_peak_bytes`): ``torch.profiler`` with ``profile_memory=True``
  records every allocation and free made through PyTorch's CPU allocator -- tensor storages, and
  the buffers oneDNN (ideep) takes from the same allocator inside a kernel. The profiler starts
  before the model is built, so the running sum of its memory events is what the allocator holds
  for this config: weights, gradients, optimizer state, activations, temporaries. The input
  batches are made before it starts (the CPU estimate leaves them out, as the tracker does). The
  peak is the highest running sum over the measured steps, after the warm-up.
- **resident** (:func:`resident_peak_bytes`, Linux only): what the OS has given the process.
  ``RssAnon`` after the warm-up less ``RssAnon`` before the model was built (both after
  ``malloc_trim``, so freed memory the C allocator kept is handed back first), plus the growth of
  the resident high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) over the
  measured steps. It also counts what is not a tensor: Python objects, the autograd graph,
  oneDNN's generated code, the C allocator's free lists within the step. An upper view.

Both run in the trial child on a fresh model, apart from any timed step. Repeat them
(:func:`ground_truth`) to know their noise.

Observing changes the run, and the allocator shows by how much: under any ``TorchDispatchMode``
(the tracker's, the fake-tensor profile's, even one that only calls the operator) every tensor
is "subclass-like" to autograd (``isTensorSubclassLike`` is true while a dispatch mode is on),
so autograd's ``InputBuffer`` sums a gradient's several contributions out of place, in a fresh
buffer, where an unobserved run adds them in place. ``allocator_peak_bytes(..., observed=True)``
reads the allocator under such a no-op mode: where the tracker counts more than the allocator,
that reading says whether this is why (measured: ``gpt-tiny`` amp at micro-batch 1 peaks while
the tied embedding's two gradient contributions are summed, 3 MiB out of place; unobserved, the
allocator peaks 1 MiB lower, under the no-op mode exactly at the tracker's count).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import statistics
from pathlib import Path

import torch

from autofit.core.config import TrainConfig
from autofit.runtime.schedule import MeasureSchedule, run_steps
from autofit.workloads.base import Workload

__all__ = ["MEASURED_MARK", "allocator_peak_bytes", "ground_truth", "resident_peak_bytes", "spread"]

MEASURED_MARK = "autofit.measured_steps"
_STATUS = Path("/proc/self/status")
# Where the tracker counts more than the allocator by over this, the allocator is also read observed.
OBSERVED_ABOVE = 0.005


class _Window:
    """A ``run_steps`` tracker that only marks where the measured steps begin and end."""

    def __init__(self, on_reset=lambda: None, on_exit=lambda: None) -> None:
        self._on_reset, self._on_exit = on_reset, on_exit

    def __enter__(self) -> "_Window":
        return self

    def reset_peak(self) -> None:
        self._on_reset()

    def __exit__(self, *exc) -> None:
        self._on_exit()


def _no_op_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoOpMode(TorchDispatchMode):
        """A dispatch mode that only runs the operator: what observing alone changes."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    return NoOpMode()


def _steps(workload: Workload, config: TrainConfig, schedule: MeasureSchedule, batches: list, window: _Window,
           observed: bool = False) -> None:
    from autofit.runtime.training import build_trainee, train_step

    trainee = build_trainee(workload, config, "cpu")
    with _no_op_mode() if observed else contextlib.nullcontext():
        run_steps(schedule, lambda: train_step(trainee, batches), tracker=lambda: window)


def _batches(workload: Workload, config: TrainConfig, schedule: MeasureSchedule) -> list:
    from autofit.trial.measure import trial_micro_batches

    return trial_micro_batches(workload, config, torch.device("cpu"), schedule)


def peak_of_events(events: list[tuple[int, int]], start_ns: int, end_ns: int) -> int:
    """The highest running sum of ``(time_ns, signed bytes)`` allocator events within [start, end]."""
    live, peak = 0, None
    for t, nbytes in sorted(events):
        if t > end_ns:
            break
        if t >= start_ns and peak is None:
            peak = live
        live += nbytes
        if t >= start_ns:
            peak = max(peak, live)
    return live if peak is None else peak


def allocator_peak_bytes(workload: Workload, config: TrainConfig, schedule: MeasureSchedule | None = None,
                         observed: bool = False) -> int:
    """The CPU allocator's peak over the measured steps, from ``torch.profiler`` memory events.

    ``observed``: the steps run under a dispatch mode that only calls each operator (see the module docstring)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    schedule = schedule or MeasureSchedule()
    batches = _batches(workload, config, schedule)
    gc.collect()
    mark = record_function(MEASURED_MARK)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _steps(workload, config, schedule, batches, _Window(mark.__enter__, lambda: mark.__exit__(None, None, None)),
               observed)
        gc.collect()
    events = prof.profiler.kineto_results.events()
    window = [e for e in events if e.name() == MEASURED_MARK]
    if not window:
        raise RuntimeError("torch.profiler recorded no measured-steps mark")
    memory = [(e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    return peak_of_events(memory, window[0].start_ns(), window[0].end_ns())


def _status_kib(*keys: str) -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in _STATUS.read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in keys}


def _trim() -> None:
    """Collect garbage and hand the C allocator's free memory back to the OS (glibc ``malloc_trim``)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        pass


def resident_peak_bytes(workload: Workload, config: TrainConfig, schedule: MeasureSchedule | None = None) -> int | None:
    """Resident bytes this config adds to the process at its peak (see the module docstring); None off Linux."""
    if not _STATUS.is_file():
        return None
    schedule = schedule or MeasureSchedule()
    batches = _batches(workload, config, schedule)
    _trim()
    before = _status_kib("RssAnon")["RssAnon"]
    at: dict[str, int] = {}

    def reset() -> None:
        _trim()
        at.update(_status_kib("RssAnon"))
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
        at["VmRSS"] = _status_kib("VmRSS")["VmRSS"]

    def done() -> None:
        at.update(_status_kib("VmHWM"))

    _steps(workload, config, schedule, batches, _Window(reset, done))
    return at["RssAnon"] - before + max(0, at["VmHWM"] - at["VmRSS"])


def spread(values: list[float]) -> float:
    """(largest - smallest) / median: the repeats' relative spread."""
    return (max(values) - min(values)) / statistics.median(values) if values and statistics.median(values) else 0.0


def ground_truth(workload: Workload, config: TrainConfig, schedule: MeasureSchedule | None = None,
                 repeats: int = 3, tracker_peak_bytes: int | None = None) -> dict:
    """Both views, ``repeats`` times each on a fresh model: ``{"allocator_peak_bytes": [...],
    "resident_peak_bytes": [...], "observed_allocator_peak_bytes": int | None}`` (the resident list
    empty off Linux). The last is read once, under a no-op dispatch mode, only where
    ``tracker_peak_bytes`` is above the allocator's median by more than :data:`OBSERVED_ABOVE`."""
    allocator = [allocator_peak_bytes(workload, config, schedule) for _ in range(repeats)]
    resident = [resident_peak_bytes(workload, config, schedule) for _ in range(repeats)]
    observed = None
    if tracker_peak_bytes is not None and tracker_peak_bytes > (1 + OBSERVED_ABOVE) * statistics.median(allocator):
        observed = allocator_peak_bytes(workload, config, schedule, observed=True)
    return {"allocator_peak_bytes": allocator, "resident_peak_bytes": [r for r in resident if r is not None],
            "observed_allocator_peak_bytes": observed}

"""One short real step beside the fake-tensor profile: memory that fake tensors do not see.

``FakeTensorMode`` runs each operator's fake kernel, which sizes outputs from shapes alone. A few
real kernels allocate more: oneDNN's LSTM (``mkldnn_rnn_layer`` on the CPU) returns a workspace
that backward needs, and its fake kernel makes it empty, so a fake profile of an LSTM misses
about 40% of the step. No table of such kernels is kept: after the fake runs, the profiler runs
the same profiled step again on real tensors, on the real device, at the smaller profiled
micro-batch, and where that finds more, at the larger one too (where affordable: :func:`refusal`). Wherever a region's real bytes differ from its
fake bytes by more than :data:`REL_TOLERANCE` of the region's peak, each size's measured difference
is added, so the region's lines (``c0 + c1·b``) are fitted through real bytes there: the extra
memory grows with the micro-batch as measured (on oneDNN's LSTM, the workspace at micro-batch 4 is
2.00x that at 2 less 12 KiB). Peaks are only ever raised; the ends of regions (what is kept for backward) move both ways, so what a
forward keeps and its backward frees stay balanced.

The corrected numbers enter the profile itself, so the estimate, the planner's pruning and the
advice all see them, and they are cached with the profile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import NamedTuple

import torch

from autofit.core.config import Precision
from autofit.profiling.data import PROFILE_BATCHES
from autofit.profiling.raw import RawRegion, RawRun
from autofit.profiling.step import run_step
from autofit.workloads.base import Workload

__all__ = ["MAX_REAL_STEP_BYTES", "REL_TOLERANCE", "Checked", "Corrected", "RealTensors", "check_runs", "correct_runs",
           "refusal"]

# Differences below this share of a region's peak are operator-level detail (a few hundred bytes
# of saved statistics), not memory the fake kernels miss.
REL_TOLERANCE = 0.01
# The real step must be short and must not endanger the machine: at most this many bytes, and at
# most a quarter of the memory available (CPU) or half the free memory (CUDA).
MAX_REAL_STEP_BYTES = 2**30
# RawRun's regions whose bytes scale with the micro-batch. The optimizer step's region does not;
# it is left as profiled.
REGION_KEYS = ("pre_forward", "post_forward", "post_backward", "head_forward", "loss_forward", "loss_backward",
               "head_backward", "pre_backward")
# RawLayer's regions.
LAYER_REGION_KEYS = ("forward", "backward", "recompute", "checkpointed_forward", "selective_forward",
                     "selective_recompute", "selective_recompute_prefix", "backward_grad_kept", "backward_output_kept")


class RealTensors(contextlib.nullcontext):
    """Stands in for ``FakeTensorMode`` in the profiler's step: real tensors, taken as they are."""

    @staticmethod
    def from_tensor(t: torch.Tensor) -> torch.Tensor:
        return t


def available_bytes(device_type: str) -> int | None:
    """Memory the real step may use at most on ``device_type``; None where the device is absent."""
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info()
        return min(MAX_REAL_STEP_BYTES, free // 2)
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        avail = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        avail = MAX_REAL_STEP_BYTES * 4  # no /proc (not Linux): the fixed cap alone
    return min(MAX_REAL_STEP_BYTES, avail // 4)


def refusal(fake_step_peak_bytes: int, device_type: str) -> str | None:
    """Why no real step is run (None: run it): no such device here, or the step is too large."""
    if os.environ.get("AUTOFIT_REAL_CHECK") == "0":
        return "turned off (AUTOFIT_REAL_CHECK=0)"
    if device_type == "cuda" and os.environ.get("AUTOFIT_PROFILE_WORKERS") != "1":
        return "on CUDA it runs only in a profiling child (a workload without a source is profiled in-process)"
    limit = available_bytes(device_type)
    if limit is None:
        return f"no {device_type} device here"
    if fake_step_peak_bytes > limit:
        return (f"the step needs {fake_step_peak_bytes / 2**20:,.0f} MiB, over the {limit / 2**20:,.0f} MiB "
                "a check may take")
    return None


def _region_extra(fake: RawRegion, real: RawRegion) -> list[int]:
    """Real minus fake for the region's four values, zero where the difference is detail."""
    scale = max(abs(fake.peak), abs(real.peak), abs(fake.peak_nongrad), abs(real.peak_nongrad), 1)
    extra = [r - f if abs(r - f) > REL_TOLERANCE * scale else 0 for f, r in zip(fake[:4], real[:4])]
    extra[1], extra[3] = max(0, extra[1]), max(0, extra[3])  # a peak is raised, never lowered
    return extra


def _corrected(region: RawRegion, extra: list[int], factor: float) -> RawRegion:
    values = [v + round(e * factor) for v, e in zip(region[:4], extra)]
    points = [p + round(extra[1] * factor) for p in region.points]
    points_ng = [p + round(extra[3] * factor) for p in region.points_nongrad]
    return RawRegion(*values, points, points_ng)


class Corrected(NamedTuple):
    run1: RawRun
    run2: RawRun
    regions: int                    # how many regions were corrected
    extra_bytes_per_sample: float   # what the real step keeps beyond the fake one


def _region(run: RawRun, key: str, i: int | None) -> RawRegion | None:
    return getattr(run, key) if i is None else getattr(run.layers[i], key)


def correct_runs(fake1: RawRun, fake2: RawRun, real1: RawRun, real2: RawRun | None, b1: int, b2: int) -> Corrected:
    """The fake raw runs at ``b1`` and ``b2`` corrected by the real runs, the number of regions corrected,
    and the bytes per sample the real step keeps beyond the fake one (the sum of the regions' raised ends,
    at ``b1``). Without ``real2`` the difference at ``b1`` is scaled to ``b2`` (bytes per sample); with it,
    each size gets its own measured difference."""
    places = [(k, None) for k in REGION_KEYS
              if all(getattr(run, k) is not None for run in (fake1, real1, fake2))]
    places += [(k, i) for i in range(min(len(fake1.layers), len(real1.layers))) for k in LAYER_REGION_KEYS
               if all(_region(run, k, i) is not None for run in (fake1, real1, fake2, real2) if run is not None)]
    # the corrected regions of each output run: {(key, layer or None): region}
    new1: dict[tuple[str, int | None], RawRegion] = {}
    new2: dict[tuple[str, int | None], RawRegion] = {}
    corrected, kept = 0, 0
    for key, i in places:
        extra = _region_extra(_region(fake1, key, i), _region(real1, key, i))
        if not any(extra):
            continue
        if key in ("forward", "backward") or i is None:  # the other layer regions rerun the forward: counted there
            corrected += 1
            kept += max(0, extra[0])
        extra2, factor2 = extra, b2 / b1
        if real2 is not None:  # the same places, measured again at b2
            fake_at_b2, real_at_b2 = _region(fake2, key, i), _region(real2, key, i)
            extra2 = [r - f if e else 0 for f, r, e in zip(fake_at_b2[:4], real_at_b2[:4], extra)]
            extra2[1], extra2[3], factor2 = max(0, extra2[1]), max(0, extra2[3]), 1.0
        new1[key, i] = _corrected(_region(fake1, key, i), extra, 1.0)
        new2[key, i] = _corrected(_region(fake2, key, i), extra2, factor2)
    return Corrected(_replaced(fake1, new1), _replaced(fake2, new2), corrected, kept / b1)


def _replaced(run: RawRun, regions: dict[tuple[str, int | None], RawRegion]) -> RawRun:
    """``run`` with ``regions`` in place of its own."""
    layers = tuple(dataclasses.replace(layer, **{k: r for (k, at), r in regions.items() if at == i})
                   for i, layer in enumerate(run.layers))
    return dataclasses.replace(run, layers=layers, **{k: r for (k, at), r in regions.items() if at is None})


def _real_run(workload: Workload, precision: Precision, b: int, device_type: str, real_batch,
              selective: bool) -> RawRun:
    """The profiled step on real tensors (no FLOPs counted, no optimizer step; the selective forwards only
    where the fake runs have them, else a region the fake runs lack would read as real bytes they missed)."""
    with torch.random.fork_rng(devices=[]):  # the caller's random stream is left as it was
        return run_step(workload, precision, b, device_type, RealTensors(), real_batch, False, False,
                        selective=selective)


class Checked(NamedTuple):
    runs: dict[int, RawRun]         # the fake runs by micro-batch, corrected
    note: str                       # what was done
    extra_bytes_per_sample: float   # what the real step keeps beyond the fake one


def check_runs(workload: Workload, precision: Precision, device_type: str, runs: dict[int, RawRun],
               real_batches: dict, selective: bool = True) -> Checked:
    """The fake runs corrected by real steps at the profiled micro-batches, a note saying what was done,
    and the bytes per sample the real step keeps beyond the fake one."""
    b1, b2 = PROFILE_BATCHES
    why = refusal(runs[b2].step_peak_bytes, device_type)
    if why is not None:
        return Checked(runs, f"no real step: {why}", 0.0)
    try:
        real1 = _real_run(workload, precision, b1, device_type, real_batches[b1], selective)
        # Most models match at b1: only a mismatch pays for the second real step.
        r1, r2, corrected, extra = correct_runs(runs[b1], runs[b2], real1, None, b1, b2)
        if corrected:
            real2 = _real_run(workload, precision, b2, device_type, real_batches[b2], selective)
            r1, r2, corrected, extra = correct_runs(runs[b1], runs[b2], real1, real2, b1, b2)
    except Exception as exc:  # noqa: BLE001 -- a step that fails for real fails in the trial too, with its error
        lines = [line for line in str(exc).splitlines() if line.strip()]
        return Checked(runs, f"no real step: it failed ({type(exc).__name__}: {lines[0] if lines else ''})"[:300], 0.0)
    if not corrected:
        return Checked(runs, f"real step at micro-batch {b1} on {device_type}: matches the fake profile", 0.0)
    return Checked({b1: r1, b2: r2}, f"real steps at micro-batches {b1} and {b2} on {device_type}: {corrected} regions "
                   f"corrected, {extra:,.0f} bytes per sample more kept than on fake tensors", float(extra))

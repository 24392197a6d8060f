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
import os

import torch

__all__ = ["MAX_REAL_STEP_BYTES", "REL_TOLERANCE", "RealTensors", "correct_runs", "refusal"]

# Differences below this share of a region's peak are operator-level detail (a few hundred bytes
# of saved statistics), not memory the fake kernels miss.
REL_TOLERANCE = 0.01
# The real step must be short and must not endanger the machine: at most this many bytes, and at
# most a quarter of the memory available (CPU) or half the free memory (CUDA).
MAX_REAL_STEP_BYTES = 2**30
# Raw-profile keys holding a region (delta, peak, delta w/o grads, peak w/o grads, points, points w/o grads)
# whose bytes scale with the micro-batch. The optimizer step's region does not; it is left as profiled.
REGION_KEYS = ("pre_forward", "post_forward", "post_backward", "head_forward", "loss_forward", "loss_backward",
               "head_backward", "pre_backward")


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


def _region_extra(fake: tuple, real: tuple) -> list[int]:
    """Real minus fake for the region's four values, zero where the difference is detail."""
    scale = max(abs(fake[1]), abs(real[1]), abs(fake[3]), abs(real[3]), 1)
    extra = [r - f if abs(r - f) > REL_TOLERANCE * scale else 0 for f, r in zip(fake[:4], real[:4])]
    extra[1], extra[3] = max(0, extra[1]), max(0, extra[3])  # a peak is raised, never lowered
    return extra


def _corrected(region: tuple, extra: list[int], factor: float) -> tuple:
    values = [v + round(e * factor) for v, e in zip(region[:4], extra)]
    points = [p + round(extra[1] * factor) for p in region[4]]
    points_ng = [p + round(extra[3] * factor) for p in region[5]]
    return (*values, points, points_ng)


def correct_runs(fake1: dict, fake2: dict, real1: dict, real2: dict | None, b1: int, b2: int) -> tuple[dict, dict, int, float]:
    """The fake raw runs at ``b1`` and ``b2`` corrected by the real runs, the number of regions corrected,
    and the bytes per sample the real step keeps beyond the fake one (the sum of the regions' raised ends,
    at ``b1``). Without ``real2`` the difference at ``b1`` is scaled to ``b2`` (bytes per sample); with it,
    each size gets its own measured difference. Raw runs are :mod:`autofit.profiling.precision`'s per-step dicts."""
    out1, out2 = dict(fake1), dict(fake2)
    out1["layers"] = [dict(layer) for layer in fake1["layers"]]
    out2["layers"] = [dict(layer) for layer in fake2["layers"]]
    places = [(k, None) for k in REGION_KEYS if k in fake1 and k in real1 and k in fake2]
    places += [(k, i) for i in range(min(len(fake1["layers"]), len(real1["layers"])))
               for k in ("forward", "backward", "recompute", "checkpointed_forward")
               if k in fake1["layers"][i] and k in real1["layers"][i]]
    corrected, kept = 0, 0
    for key, i in places:
        get = (lambda run, k=key: run[k]) if i is None else (lambda run, k=key, i=i: run["layers"][i][k])
        extra = _region_extra(get(fake1), get(real1))
        if not any(extra):
            continue
        if key in ("forward", "backward") or i is None:  # the other layer regions rerun the forward: counted there
            corrected += 1
            kept += max(0, extra[0])
        extra2, factor2 = extra, b2 / b1
        if real2 is not None:  # the same places, measured again at b2
            extra2 = [r - f if e else 0 for f, r, e in zip(get(fake2)[:4], get(real2)[:4], extra)]
            extra2[1], extra2[3], factor2 = max(0, extra2[1]), max(0, extra2[3]), 1.0
        for out, run, ext, factor in ((out1, fake1, extra, 1.0), (out2, fake2, extra2, factor2)):
            target = out if i is None else out["layers"][i]
            target[key] = _corrected(get(run), ext, factor)
    return out1, out2, corrected, kept / b1

"""The accuracy suite's independent ground truth: the estimate and the tracker against the allocator and the OS.

:mod:`autofit.trial.ground_truth` reads each single-device config's peak twice more, without autofit's
counting, several times each: the CPU allocator's peak (``torch.profiler`` memory events) and the
resident peak the OS reports. This module turns those repeats into the suite's section: the
error of the estimate against each, each view's own noise (the spread of its repeats), and, for
every config where the estimate and a view disagree by more than that view's noise, what the
difference is made of, from the measured numbers.
"""

from __future__ import annotations

import math
import statistics

from autofit.bench.common import (
    ErrorStats,
    markdown_table,
    mib,
    pct,
    relative_error,
    signed_pct,
)
from autofit.core.records import TrialStatus

__all__ = ["explain", "truth_section", "view"]

# A view's noise is the spread of its repeats; below this floor a difference is rounding.
NOISE_FLOOR = 0.005


def view(values: tuple) -> tuple[float, float]:
    """(median, spread) of one view's repeats; NaNs without repeats. Spread = (max - min) / median."""
    if not values:
        return math.nan, math.nan
    med = statistics.median(values)
    return float(med), (max(values) - min(values)) / med if med else math.nan


def explain(row) -> str:
    """Why the estimate and a view disagree beyond that view's noise, from the measured numbers (empty if they agree)."""
    alloc, alloc_noise = view(row.allocator_peak_bytes)
    res, res_noise = view(row.resident_peak_bytes)
    notes = []
    tol_alloc = max(alloc_noise, NOISE_FLOOR)
    if abs(relative_error(row.predicted_peak_bytes, alloc)) > tol_alloc:
        held = alloc - row.measured_peak_bytes  # allocator bytes beyond the live tensors the tracker counts
        if -held / alloc > tol_alloc:
            notes.append(_tracker_above(row, alloc, tol_alloc))
        elif held / alloc > tol_alloc:
            notes.append(f"the allocator holds {mib(held)} MiB ({signed_pct(held / row.measured_peak_bytes)}) "
                         "beyond the live tensors at its peak: buffers a kernel allocates inside itself (oneDNN "
                         "scratchpads, convolution buffers), which no count at the dispatcher sees")
        est = relative_error(row.predicted_peak_bytes, row.measured_peak_bytes)
        if abs(est) > tol_alloc:
            notes.append(f"the estimate is {signed_pct(est)} off the live tensors themselves")
    if not math.isnan(res) and abs(relative_error(row.predicted_peak_bytes, res)) > max(res_noise, NOISE_FLOOR):
        if res > alloc:
            notes.append(f"resident {signed_pct(relative_error(res, alloc))} over the allocator: the C allocator's "
                         "free lists, Python objects and the autograd graph, oneDNN's generated code")
        else:
            notes.append(f"resident {signed_pct(relative_error(res, alloc))} under the allocator: memory allocated but "
                         "never touched is not resident (a scratchpad sized for the worst case)")
    return "; ".join(notes)


def _tracker_above(row, alloc: float, tol: float) -> str:
    """The note where the tracker counts more than the allocator: observing, if the no-op-mode reading says so."""
    text = f"the tracker counts {mib(row.measured_peak_bytes - alloc)} MiB more than the allocator shows at its peak"
    observed = getattr(row, "observed_allocator_peak_bytes", None)
    if observed is None:
        return text + " (cause not identified: the allocator was not read under a dispatch mode)"
    if abs(relative_error(observed, row.measured_peak_bytes)) <= tol:
        return (text + f": observing changes the run. Under any dispatch mode (the tracker's, the fake-tensor "
                f"profile's) autograd sums a gradient's contributions out of place (every tensor is "
                f"`isTensorSubclassLike`), unobserved in place; under a no-op mode the allocator peaks at "
                f"{mib(observed)} MiB, the tracker's count, so the estimate is high (safe) by that much")
    return text + (f" (cause not identified: under a no-op dispatch mode the allocator peaks at {mib(observed)} MiB, "
                   "not at the tracker's count)")


def truth_section(rows: list) -> str:
    """The Markdown section: summary line, noise, and a per-config table (empty without ground-truth rows)."""
    rows = [r for r in rows if r.status is TrialStatus.OK and r.allocator_peak_bytes]
    if not rows:
        return ""
    alloc = [view(r.allocator_peak_bytes) for r in rows]
    res = [view(r.resident_peak_bytes) for r in rows]
    est_alloc = ErrorStats.of(relative_error(r.predicted_peak_bytes, a) for r, (a, _) in zip(rows, alloc))
    trk_alloc = ErrorStats.of(relative_error(r.measured_peak_bytes, a) for r, (a, _) in zip(rows, alloc))
    est_res = ErrorStats.of(relative_error(r.predicted_peak_bytes, m) for r, (m, _) in zip(rows, res))
    a_noise = [s for _, s in alloc if not math.isnan(s)]
    r_noise = [s for _, s in res if not math.isnan(s)]
    repeats = len(rows[0].allocator_peak_bytes)
    agree = sum(1 for r in rows if not explain(r))
    text = [
        "## Against an independent ground truth\n",
        "The tracker counts live tensor storages seen at the dispatcher, as the profiler does, so the error above "
        "checks that fake and real tensors agree. Two views that share nothing with that counting "
        f"(`autofit.trial.ground_truth`), each read {repeats} times on a fresh model in the worker, apart from any timed step, "
        "for every single-device config:\n",
        "- **allocator**: `torch.profiler(profile_memory=True)` started before the model is built; the highest running "
        "sum of its allocation events over the measured steps (every block PyTorch's CPU allocator hands out, "
        "tensor or not; input batches made before it starts);",
        "- **resident**: the process's anonymous resident bytes after the warm-up over those before the model was "
        "built (both after `malloc_trim`), plus the growth of `VmHWM` (reset) over the measured steps.",
        "- where the tracker counts more than the allocator: the allocator once more, the steps run under a dispatch "
        "mode that only calls each operator (what observing alone changes).\n",
        f"Over {len(rows)} configs: estimate against the allocator median |error| {pct(est_alloc.median, 2)}, max "
        f"{pct(est_alloc.max, 2)} (mean signed {signed_pct(est_alloc.mean_signed)}); the tracker against the "
        f"allocator median {pct(trk_alloc.median, 2)}, max {pct(trk_alloc.max, 2)}; estimate against resident median "
        f"{pct(est_res.median, 2)}, max {pct(est_res.max, 2)}.",
        f"Noise (spread of the {repeats} repeats, (max − min) / median): allocator median "
        f"{pct(statistics.median(a_noise), 2) if a_noise else '-'}, max {pct(max(a_noise), 2) if a_noise else '-'}; "
        f"resident median {pct(statistics.median(r_noise), 2) if r_noise else '-'}, max "
        f"{pct(max(r_noise), 2) if r_noise else '-'}. {agree} of {len(rows)} configs agree with both views within "
        f"their noise (at least {pct(NOISE_FLOOR, 1)}); the note says what the difference is for the others.\n",
    ]
    table = [[r.workload, f"`{r.config.short()}`", mib(r.predicted_peak_bytes), mib(r.measured_peak_bytes),
              mib(a), pct(an, 2), signed_pct(relative_error(r.predicted_peak_bytes, a)),
              mib(m) if not math.isnan(m) else "-", pct(mn, 1) if not math.isnan(mn) else "-",
              signed_pct(relative_error(r.predicted_peak_bytes, m)) if not math.isnan(m) else "-", explain(r) or "agree"]
             for r, (a, an), (m, mn) in zip(rows, alloc, res)]
    text.append(markdown_table(
        ["workload", "config", "estimate MiB", "tracker MiB", "allocator MiB", "allocator noise", "estimate vs allocator",
         "resident MiB", "resident noise", "estimate vs resident", "note"], table, "llrrrrrrrrl"))
    return "\n".join(text)

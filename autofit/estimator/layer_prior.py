"""The time model's prior, rescaled by the workload's own first layer timed for real
(:mod:`autofit.probes.layer_timing`): per-sample and fixed parts, each within a plausible range.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable

from autofit.probes.layer_timing import (
    LAYER_BATCHES,
    MAX_LAYER_S,
    SCALE_RANGE,
    measure_layer_seconds,
)


def layer_scales(profile, rates, counts, seconds: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    """Per precision, (per-sample factor, fixed factor): the measured layer's line over the time model's
    (:func:`autofit.estimator.time_model.layer_time_line`). Precisions whose factors fall outside
    :data:`SCALE_RANGE` are left out (the prior stays as it was for them)."""
    from autofit.estimator.time_model import layer_time_line

    (b1, b2), scales = LAYER_BATCHES, {}
    for precision, (t1, t2) in seconds.items():
        fixed_pred, per_sample_pred = layer_time_line(profile, precision, rates, counts)
        per_sample = (t2 - t1) / (b2 - b1)
        fixed = t1 - per_sample * b1
        if per_sample <= 0 or per_sample_pred <= 0 or fixed_pred <= 0:
            continue  # noise swamped the slope: no evidence either way
        compute, overhead = per_sample / per_sample_pred, max(fixed, 0.0) / fixed_pred
        lo, hi = SCALE_RANGE
        if lo <= compute <= hi:
            scales[precision] = (compute, min(max(overhead, lo), hi))
    return scales


def workload_prior(workload, profile, rates, precisions: list[str], use_cache: bool = True,
                   note: Callable[[str], None] | None = None):
    """:func:`autofit.estimator.time_model.op_counts` of ``workload`` with its measured :attr:`layer_scales`, timed for
    the precisions whose layer is cheap enough (:data:`MAX_LAYER_S`), the others given the timed ones'
    geometric mean; plain op counts when the workload has no source, no layer can be timed, or the
    probe fails. What a search's planner uses (:func:`autofit.study.worker.run_worker`). ``note``:
    as :func:`measure_layer_seconds`'s."""
    import dataclasses

    from autofit.estimator.time_model import layer_time_line, op_counts

    counts = op_counts(workload)
    if workload.source is None or counts is None:
        return counts
    cheap = []
    for precision in precisions:
        try:
            fixed, per_sample = layer_time_line(profile, precision, rates, counts)
        except KeyError:
            continue
        if fixed + per_sample * LAYER_BATCHES[-1] <= MAX_LAYER_S:
            cheap.append(precision)
    seconds = (measure_layer_seconds(workload.source, cheap, profile.device_type, use_cache, note, key=profile.key)
               if cheap else None)
    if not seconds:
        return counts
    scales = layer_scales(profile, rates, counts, seconds)
    dropped = [p for p in seconds if p not in scales]
    if dropped and note is not None:  # said, never silent: the timing ran but is not used for these
        lo, hi = SCALE_RANGE
        note(f"the layer timings of {', '.join(dropped)} are not used (the slope lost in noise, or the layer "
             f"{lo:g}-{hi:g}x off the time model's): "
             + ("the prior stays the device probe's" if not scales else "they get the others' mean factors"))
    if not scales:
        return counts
    # A precision without its own factors (its slope lost in noise, or its layer too slow to time) gets
    # the others' geometric mean: scaling some precisions and not others would reorder them by accident.
    mean = tuple(math.exp(statistics.fmean(math.log(s[i]) for s in scales.values())) for i in (0, 1))
    full = {p: scales.get(p, mean) for p in precisions}
    return dataclasses.replace(counts, layer_scales=tuple((p, c, f) for p, (c, f) in full.items()))


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
    measure_layer_timings,
)

FIXED_NOISE_BANDS = 1.0  # how far (in its noise bands) the fixed part must move before the timing moves it


def layer_scales(profile, rates, counts, seconds: dict[str, list[float]],
                 spread_s: dict[str, list[float]] | None = None,
                 bands: float = FIXED_NOISE_BANDS) -> dict[str, tuple[float, float]]:
    """Per precision, (per-sample factor, fixed factor): the measured layer's line over the time model's
    (:func:`autofit.estimator.time_model.layer_time_line`). Precisions whose factors fall outside
    :data:`SCALE_RANGE` are left out (the prior stays as it was for them). ``spread_s``: per precision and
    point, how much slower the next best call was than the best; the fixed part, a small difference of the
    two points, moves the prediction only by what it differs beyond ``bands`` of its noise
    (:func:`_fixed_seconds`)."""
    from autofit.estimator.time_model import layer_time_line

    (b1, b2), scales = LAYER_BATCHES, {}
    for precision, (t1, t2) in seconds.items():
        fixed_pred, per_sample_pred = layer_time_line(profile, precision, rates, counts)
        per_sample = (t2 - t1) / (b2 - b1)
        if per_sample <= 0 or per_sample_pred <= 0 or fixed_pred <= 0:
            continue  # noise swamped the slope: no evidence either way
        e1, e2 = (spread_s or {}).get(precision) or (0.0, 0.0)
        fixed = _fixed_seconds((t1, t2), (e1, e2), fixed_pred, bands)
        compute, overhead = per_sample / per_sample_pred, max(fixed, 0.0) / fixed_pred
        lo, hi = SCALE_RANGE
        if lo <= compute <= hi:
            scales[precision] = (compute, min(max(overhead, lo), hi))
    return scales


def _fixed_seconds(points_s: tuple[float, float], spread_s: tuple[float, float], predicted_s: float,
                   bands: float = FIXED_NOISE_BANDS) -> float:
    """The line's intercept through the two timed points, soft-thresholded towards the prediction.

    The intercept t1 * b2/(b2-b1) - t2 * b1/(b2-b1) is a few percent of either point for a layer whose time
    grows with its batch, so a point a few percent slow moves it by several times (one timing of the same
    layer read 0.2x, another 15x the prediction). Its noise band is the points' spreads carried through those
    coefficients; within ``bands`` of them the timing says nothing and the prediction stays, beyond
    them it moves by the excess only (a soft threshold, the usual estimator of a signal in noise)."""
    (b1, b2), (t1, t2), (e1, e2) = LAYER_BATCHES, points_s, spread_s
    a1, a2 = b2 / (b2 - b1), b1 / (b2 - b1)
    measured = a1 * t1 - a2 * t2
    band = bands * math.hypot(a1 * e1, a2 * e2)
    excess = abs(measured - predicted_s) - band
    return predicted_s if excess <= 0 else predicted_s + math.copysign(excess, measured - predicted_s)


def workload_prior(workload, profile, rates, precisions: list[str], use_cache: bool = True,
                   note: Callable[[str], None] | None = None):
    """:func:`autofit.estimator.time_model.op_counts` of ``workload`` with its measured :attr:`layer_scales`, timed for
    the precisions whose layer is cheap enough (:data:`MAX_LAYER_S`), the others given the timed ones'
    geometric mean; plain op counts when the workload has no source, no layer can be timed, or the
    probe fails. What a search's planner uses (:func:`autofit.study.worker.run_worker`). ``note``:
    as :func:`measure_layer_timings`'s."""
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
    timings = (measure_layer_timings(workload.source, cheap, profile.device_type, use_cache, note, key=profile.key)
               if cheap else None)
    if not timings or not timings.seconds:
        return counts
    seconds = timings.seconds
    scales = layer_scales(profile, rates, counts, seconds, timings.spread_s)
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


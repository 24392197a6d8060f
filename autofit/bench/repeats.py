"""Re-measuring an accuracy row whose first sample misses the estimate.

One measurement per config is the suite's rule (the tracker's count is deterministic for most
configs), but an FSDP rank's is not always: ProcessGroupGloo's worker thread marks a collective
complete and only afterwards, once it re-takes its queue lock, drops the work and the tensors it
holds, so a buffer the caller has already let go of is freed a moment late, from that thread.
``scripts/gloo_buffer_race.py`` counts it: after a 2 MiB ``all_gather_into_tensor`` returned on 2
gloo ranks here, its output was still referenced in 24-53% of 2000 calls (0% for a
reduce-scatter's). FSDP2 drops each unit's all-gather buffer right after copying it out; when
the late free spans the rank's peak moment, the peak carries one unit's gathered weights. Seen
once (not caught in the act, but the size fits): ``convnet-bn amp-fp16 mb=1`` FSDP over 2 ranks,
rank 1 920,064 bytes over rank 0, where the unit ``layers[4]``'s fp32 weights are 920,576 bytes;
seven re-runs, and two by ``autofit measure``, gave both ranks 8,542,940 bytes. Such bytes are
really held, so the count is not wrong; it is one draw, and the FSDP memory model counts one
such buffer in flight (:mod:`autofit.estimator.fsdp_memory`), so the estimate stays above it.

So a row whose first sample is off the estimate by more than :data:`REPEAT_ABOVE` is measured
again with the same job, and a third time when the two samples differ by more than
:data:`AGREE_WITHIN` (a systematic miss repeats exactly: a third sample would add nothing but
time); the row reports the median sample and keeps every sample, first first, so a miss is never
hidden, only weighed against its repeats.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from autofit.bench.common import mib, relative_error, signed_pct
from autofit.core.records import TrialStatus

__all__ = ["AGREE_WITHIN", "EXTRA_SAMPLES", "REPEAT_ABOVE", "median_sample", "misses", "resample", "samples_cell"]

# A first sample further off the estimate than this (|error|) is measured again.
REPEAT_ABOVE = 0.02
# At most this many more samples for a missing row (three in all: the median is one of them).
EXTRA_SAMPLES = 2
# Two samples this close (relative) agree: the miss is systematic and no third sample is taken.
AGREE_WITHIN = 0.005


def misses(predicted_bytes: float | None, out: dict) -> bool:
    """Whether a measured result is ``ok`` and off ``predicted_bytes`` by more than :data:`REPEAT_ABOVE`."""
    if out.get("status") != TrialStatus.OK or not out.get("peak_bytes") or predicted_bytes is None:
        return False
    return abs(relative_error(predicted_bytes, out["peak_bytes"])) > REPEAT_ABOVE


def _agree(a: dict, b: dict) -> bool:
    ok = a.get("status") == b.get("status") == TrialStatus.OK and a.get("peak_bytes") and b.get("peak_bytes")
    return bool(ok) and abs(relative_error(b["peak_bytes"], a["peak_bytes"])) <= AGREE_WITHIN


def resample(jobs: list[dict], first: list[dict], predicted: list[float | None],
             run: Callable[[list[dict]], list[dict]]) -> list[list[dict]]:
    """Every job's samples: its first result, plus up to :data:`EXTRA_SAMPLES` more where the first :func:`misses`
    (another while the samples so far disagree).

    ``run(jobs) -> results`` measures a list of jobs (the suite's :func:`autofit.bench.worker.run_jobs`);
    the repeats are the same jobs without the ground truth (read once, on the first sample), one call per round.
    """
    samples = [[out] for out in first]
    again = [i for i, (out, pred) in enumerate(zip(first, predicted)) if misses(pred, out)]
    for _ in range(EXTRA_SAMPLES):
        if not again:
            break
        for i, out in zip(again, run([{**jobs[i], "truth_repeats": 0} for i in again])):
            samples[i].append(out)
        again = [i for i in again if not _agree(samples[i][0], samples[i][-1])]
    return samples


def median_sample(samples: list[dict]) -> dict:
    """The sample with the median peak among the ``ok`` ones (the lower middle of an even count);
    the first sample when fewer than two are ``ok``."""
    ok = [s for s in samples if s.get("status") == TrialStatus.OK and s.get("peak_bytes") is not None]
    if len(ok) < 2:
        return samples[0]
    peak = statistics.median_low(s["peak_bytes"] for s in ok)
    return next(s for s in ok if s["peak_bytes"] == peak)


def samples_cell(predicted_bytes: float | None, peaks: tuple) -> str:
    """Every sample's peak (MiB) and error, first first, for a repeated row's table cell; empty for one sample."""
    if len(peaks) < 2:
        return ""
    return " / ".join(f"{mib(p)} ({signed_pct(relative_error(predicted_bytes, p))})" if p is not None else "failed"
                      for p in peaks)


def repeats_note(rows: list) -> str:
    """The suite's paragraph on re-measured rows (rows with ``peak_samples_bytes``): which, and every sample."""
    repeated = [r for r in rows if len(r.peak_samples_bytes) > 1]
    head = (f"Rows whose first sample missed the estimate by more than {REPEAT_ABOVE:.0%} were measured again "
            f"(the same job, on a fresh model), and a third time when the two differ by more than "
            f"{AGREE_WITHIN:.1%}; such a row reports the median sample (the lower of two that agree), and the tables "
            "judge it by that. Every sample is listed, first first.")
    if not repeated:
        return head + " No row missed."
    lines = [f"- `{r.workload} {r.config.short()}`: estimate {mib(r.predicted_peak_bytes)} MiB; samples "
             f"{samples_cell(r.predicted_peak_bytes, r.peak_samples_bytes)}; median {signed_pct(r.error_rel)}"
             for r in repeated]
    return head + f" {len(repeated)} rows were repeated:\n\n" + "\n".join(lines)

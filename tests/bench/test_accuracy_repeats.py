"""The accuracy suite's re-measurement of a row whose first sample misses the estimate (autofit.bench.repeats)."""

from __future__ import annotations

from autofit.bench.repeats import EXTRA_SAMPLES, median_sample, misses, resample
from autofit.core.config import Precision, TrainConfig

MiB = 2**20


def _out(peak: int, status: str = "ok") -> dict:
    return {"status": status, "error": None, "peak_bytes": peak, "per_device_peak_bytes": [peak, peak - 1]}


def test_a_row_that_misses_once_is_measured_again_and_reported_by_its_median():
    jobs = [{"kind": "memory", "config": "a", "truth_repeats": 3}, {"kind": "memory", "config": "b", "truth_repeats": 3}]
    predicted = [100.0 * MiB, 50.0 * MiB]
    first = [_out(110 * MiB), _out(50 * MiB)]  # a: +10% off (a one-off), b: matches
    calls = []

    def fake_run(again: list[dict]) -> list[dict]:  # the repeats match the estimate
        calls.append(again)
        return [_out(100 * MiB) for _ in again]

    samples = resample(jobs, first, predicted, fake_run)
    # the repeat disagrees with the first sample: a third is taken, one job a round, only for the missing row
    assert [[j["config"] for j in c] for c in calls] == [["a"]] * EXTRA_SAMPLES
    assert all(j["truth_repeats"] == 0 for c in calls for j in c)  # the ground truth is read once, on the first sample
    assert [s["peak_bytes"] for s in samples[0]] == [110 * MiB] + [100 * MiB] * EXTRA_SAMPLES  # the first is kept
    assert samples[1] == [first[1]]  # a row that matches is measured once
    assert median_sample(samples[0])["peak_bytes"] == 100 * MiB


def test_a_systematic_miss_stays_a_miss_and_nothing_is_repeated_without_one():
    predicted = [100.0 * MiB]
    samples = resample([{"config": "a"}], [_out(110 * MiB)], predicted, lambda again: [_out(110 * MiB + 1)] * len(again))
    assert len(samples[0]) == 2  # the repeat agrees with the first: no third sample
    assert median_sample(samples[0])["peak_bytes"] == 110 * MiB
    assert resample([{"config": "a"}], [_out(101 * MiB)], predicted, lambda again: 1 / 0) == [[_out(101 * MiB)]]
    assert not misses(100.0, {"status": "oom", "peak_bytes": 200})  # only measured rows are repeated
    # a failed repeat does not count in the median
    assert median_sample([_out(110), {"status": "error", "peak_bytes": None}, _out(100)])["peak_bytes"] == 100


def test_the_report_lists_every_sample_first_first(tmp_path):
    from autofit.bench.accuracy import AccuracyResults, AccuracyRow, write_accuracy

    config = TrainConfig(Precision.AMP_FP16, 1, 1, 0, 2, "fsdp")
    row = AccuracyRow(workload="convnet-bn", config=config, status="ok", predicted_peak_bytes=8.0 * MiB,
                      measured_peak_bytes=8 * MiB, predicted_per_device=(8 * MiB, 8 * MiB),
                      measured_per_device=(8 * MiB, 8 * MiB), peak_samples_bytes=(9 * MiB, 8 * MiB, 8 * MiB))
    res = AccuracyResults([row], {}, None, 1.0)
    write_accuracy(tmp_path, {"date": "today"}, res)
    md = (tmp_path / "accuracy.md").read_text()
    assert "1 rows were repeated" in md and "9.0 (-11.11%) / 8.0 (+0.00%) / 8.0 (+0.00%)" in md
    assert row.error_rel == 0.0
    assert "9437184 8388608 8388608" in (tmp_path / "accuracy.csv").read_text()

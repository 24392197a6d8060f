"""The pictures' data against the trials (what was drawn where, read back from the figures), and the
trial numbers every output shows: real trials from 1, whatever Optuna numbered them. No training."""

from __future__ import annotations

import datetime
import json

import pytest

from autofit.core.config import TrainConfig
from autofit.core.records import (
    PruneReason,
    StudySnapshot,
    TrialRecord,
    TrialStatus,
    best_of,
    trial_number,
    trial_numbers,
)
from autofit.report import pictures
from autofit.report.summary import summary_markdown
from autofit.report.tables import (
    best_record,
    calibration_of,
    top_configs,
    trials_table,
)

MIB = 2**20
BUDGET = 8_000_000_000  # 7.45 GiB: far right of peaks of a hundred MiB
T0 = datetime.datetime(2025, 1, 1, 12, 0, 0)
BREAKDOWN = {"params_bytes": 10 * MIB, "grads_bytes": 10 * MIB, "optimizer_bytes": 20 * MIB,
             "activations_bytes": 50 * MIB, "temporary_bytes": 10 * MIB, "overhead_bytes": 0}


def _pruned(number, config, kind, peak_mib, prior_s, worker=None):
    return TrialRecord(number=number, config=config, status=TrialStatus.PRUNED, prune_reason=PruneReason(kind),
                       reason=f"{kind}",
                       prediction={"peak_bytes": peak_mib * MIB, "prior_step_time_s": prior_s,
                                   "step_time_s": prior_s, "samples_per_s": config.samples_per_step / prior_s},
                       worker=worker or {})


def _ran(number, config, status, rate, peak_mib, finished_s, sample=1, budget=BUDGET):
    ok = status == "ok"
    peak = peak_mib * MIB
    step = config.samples_per_step / rate if ok else None
    # predicted twice as fast as measured: the calibration halves the pruned configs' estimates
    prior = step / 2 if ok else 0.05
    return TrialRecord(
        number=number, config=config, status=TrialStatus(status), sample=sample,
        prediction={"peak_bytes": peak, "calibrated_peak_bytes": peak, "step_time_s": prior, "prior_step_time_s": prior,
                    "samples_per_s": config.samples_per_step / prior, **BREAKDOWN},
        measurement={"peak_bytes": peak if ok else None, "samples_per_s": rate if ok else None, "step_time_s": step,
                     "breakdown": dict(BREAKDOWN) if ok else {}},
        value=rate if ok else 0.0, constraints={"peak_over_budget_bytes": float(peak - budget) if ok else 1.0,
                                                "failed": 0.0 if ok else 1.0},
        started=T0 + datetime.timedelta(seconds=finished_s - 5), finished=T0 + datetime.timedelta(seconds=finished_s),
        worker={"pid": 1})


def _study(budget=BUDGET, extra=()):
    fp8, amp8, fp16 = TrainConfig("fp32", 8, 1), TrainConfig("amp-bf16", 8, 1), TrainConfig("fp32", 16, 1)
    records = [
        _pruned(0, TrainConfig("fp32", 8, 1, 0, 2), "devices", 70, 0.1),
        _pruned(1, TrainConfig("amp-bf16", 8, 1, 0, 2), "devices", 60, 0.1),
        _pruned(2, TrainConfig("fp32", 4, 2), "too_slow", 80, 1.0),
        _pruned(3, TrainConfig("fp32", 8, 1, 1), "dominated", 90, 0.12),
        _ran(4, fp8, "ok", 40.0, 120, 10),
        _pruned(5, TrainConfig("amp-bf16", 4, 2), "too_slow", 75, 1.0),
        _ran(6, amp8, "ok", 30.0, 100, 20),
        _ran(7, fp8, "ok", 45.0, 121, 30, sample=2),  # the best config's best sample
        _ran(8, fp16, "oom", None, 140, 40),
        *extra,
    ]
    settings = {"budget_bytes": budget, "devices": 1, "device_type": "cpu", "workload_name": "w",
                "workload_source": "w", "space": {}}
    return StudySnapshot("pics", records, settings=settings, stop_reason="trial limit: 5 real trials")


def _collections(ax):
    return {c.get_gid(): c for c in ax.collections if c.get_gid()}


def _throughput(study):
    table = trials_table(study)
    calibration = calibration_of(study)
    best = best_of(list(study.records))
    fig = pictures.throughput_vs_peak(table, study.settings["budget_bytes"], best and best.number, study.study_name,
                                      estimates=pictures.estimates_of(study.records, calibration),
                                      calibrated_on=calibration.n_trials)
    return fig, fig.axes[0], table


def test_throughput_axis_zooms_to_the_data_and_names_a_far_budget_at_the_edge():
    _, ax, table = _throughput(_study())
    real = table[table["status"].isin(pictures.REAL)]
    peaks = real["measured_peak_bytes"].fillna(real["predicted_peak_bytes"]).astype(float).to_numpy() / MIB
    low, high = ax.get_xlim()
    assert low == 0 and high >= peaks.max() and high <= 2 * peaks.max()  # not stretched to 7.45 GiB
    assert "MiB" in ax.get_xlabel()
    assert not [line for line in ax.lines if line.get_gid() == "budget"]
    (note,) = [t for t in ax.texts if t.get_gid() == "edge-note"]
    assert note.get_text() == "budget 7.45 GiB →"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[0] == "ran ok (3)" and "ran oom (1)" in legend  # what ran first ...
    # ... then the pruned configs, by reason, each counted
    assert {t for t in legend if t.startswith("pruned")} == {"pruned: devices (2)", "pruned: too slow (2)",
                                                           "pruned: dominated (1)"}
    assert ax.get_legend().get_bbox_to_anchor().x0 >= ax.get_window_extent().x1  # outside the plot area


def test_a_budget_near_the_data_is_a_line_inside_the_axis():
    _, ax, _ = _throughput(_study(budget=130 * MIB))
    (line,) = [line for line in ax.lines if line.get_gid() == "budget"]
    assert line.get_xdata()[0] == pytest.approx(130) and ax.get_xlim()[1] >= 130
    assert "budget 130.00 MiB" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert not [t for t in ax.texts if t.get_gid() == "edge-note"]


def test_the_star_sits_on_the_best_configs_best_sample():
    study = _study()
    _, ax, _ = _throughput(study)
    star = _collections(ax)["best"]
    best = best_of(list(study.records))
    assert best.number == 7  # fp32 mb=8 measured twice (40, 45): ranked by its best sample
    assert star.get_offsets()[0].tolist() == pytest.approx([121.0, 45.0])
    assert star.get_label() == "best: trial 3"  # Optuna's 7 is the third real trial
    ok = _collections(ax)["status:ok"].get_offsets()
    assert [121.0, 45.0] in ok.tolist() and [120.0, 40.0] in ok.tolist()  # both samples drawn, the star on one


def test_pruned_configs_are_drawn_at_the_calibrated_estimate_not_the_uncalibrated_prediction():
    study = _study()
    fig, ax, _ = _throughput(study)
    estimates = pictures.estimates_of(study.records, calibration_of(study))
    drawn = _collections(ax)["pruned:devices"].get_offsets()
    uncalibrated = [r.prediction["samples_per_s"] for r in study.records if r.number in (0, 1)]
    # per device: a 2-stage split on a 1-device worker is scored per device (autofit.core.objective)
    assert sorted(drawn[:, 1]) == pytest.approx(sorted(estimates.loc[[0, 1], "objective"]))
    assert max(drawn[:, 1]) < min(uncalibrated) / 2 * 1.3  # measured 2x slower than the prior; halved per device
    assert "calibrated on the 4 real trial(s)" in next(t.get_text() for t in fig.texts if t.get_gid() == "pruned-note")


def test_pruned_estimates_far_right_of_the_real_trials_sit_at_the_edge_counted():
    extra = [_pruned(9, TrainConfig("fp32", 32, 1), "over_budget", 20_000, 0.5)]  # 19.5 GiB: off the axis
    _, ax, _ = _throughput(_study(extra=extra))
    assert ax.get_xlim()[1] <= 2 * 140
    assert _collections(ax)["pruned-beyond:over_budget"].get_offsets()[0][0] == pytest.approx(ax.get_xlim()[1])
    (note,) = [t for t in ax.texts if t.get_gid() == "edge-note"]
    assert note.get_text() == "budget 7.45 GiB →\n1 pruned further right →"
    assert "pruned: over budget (1)" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_when_nothing_ran_the_estimates_and_the_budget_are_drawn():
    records = [_pruned(i, TrainConfig("fp32", 2 ** i, 1), "over_budget", 50 + 10 * i, 0.1) for i in range(3)]
    study = StudySnapshot("none", records, settings={"budget_bytes": 20 * MIB, "devices": 1})
    fig, ax, _ = _throughput(study)
    assert [line.get_xdata()[0] for line in ax.lines if line.get_gid() == "budget"] == [pytest.approx(20)]
    assert 70 <= ax.get_xlim()[1] <= 2 * 70
    assert "pruned: over budget (3)" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert "no real trial ran" in next(t.get_text() for t in fig.texts if t.get_gid() == "pruned-note")
    for figure in (pictures.predicted_vs_measured(trials_table(study), "none"),
                   pictures.best_so_far(trials_table(study), "none", 20 * MIB),
                   pictures.memory_breakdown(trials_table(study), {}, 20 * MIB, "none")):
        assert all(not ax.axison for ax in figure.axes)  # no meaningless 0..1 axes
        assert any("no real trial has run" in t.get_text() for ax in figure.axes for t in ax.texts)


def _visible_tick_labels(axis):
    """The major tick labels inside the axis' view, as drawn."""
    low, high = sorted(axis.get_view_interval())
    ticks = [t for t in axis.get_major_ticks() if low <= t.get_loc() <= high]
    return [t.label1.get_text() for t in ticks if t.label1.get_visible() and t.label1.get_text()]


def test_predicted_vs_measured_titles_match_their_axes_and_log_ticks_are_few_and_plain():
    study = _study()
    table = trials_table(study)
    # step times from 0.1 s to 2.5 s: a log axis over a decade and a bit, where matplotlib's own
    # labels crowd (2x10^-1, 3x10^-1, 4x10^-1, 6x10^-1 between the decades)
    table.loc[table["status"] == "ok", "predicted_step_time_s"] = [0.1, 0.3, 2.5]
    table.loc[table["status"] == "ok", "step_time_s"] = [0.12, 0.5, 2.2]
    fig = pictures.predicted_vs_measured(table, "t")
    fig.canvas.draw()
    memory, step = fig.axes
    assert memory.get_title() == "peak memory per device" and step.get_title() == "step time (one optimizer step)"
    for ax, what in ((memory, "peak per device (MiB)"), (step, "step time (s)")):
        assert ax.get_xlabel() == f"predicted {what}" and ax.get_ylabel() == f"measured {what}"
    assert step.get_xscale() == "log"
    for axis in (step.xaxis, step.yaxis):
        labels = _visible_tick_labels(axis)
        assert 3 <= len(labels) <= 6 and all("times" not in t and "^" not in t for t in labels), labels
        assert not [t for t in axis.get_minorticklabels() if t.get_text()]


def test_memory_breakdown_keeps_its_labels_inside_the_frame_and_shows_trial_numbers():
    study = _study()
    table = trials_table(study)
    breakdowns = pictures.breakdowns_of(study.records)
    fig = pictures.memory_breakdown(table, breakdowns, BUDGET, "t", [int(n) for n in top_configs(study, table)["number"]])
    ax = fig.axes[0]
    tallest = max(sum(BREAKDOWN.values()) for _ in breakdowns) / MIB
    assert ax.get_ylim()[1] >= 1.1 * tallest  # room for the "pred."/"meas." labels above the bars
    assert all(t.get_position()[1] < ax.get_ylim()[1] for t in ax.texts)
    ticks = [t.get_text().split("\n")[0] for t in ax.get_xticklabels()]
    assert ticks == ["trial 3", "trial 2"]  # one bar pair per config, by its best sample, best first
    assert "overhead" not in [t.get_text() for t in ax.get_legend().get_texts()]  # nothing held it


def test_best_so_far_ends_at_the_best_and_ignores_a_faster_trial_over_the_budget():
    over = _ran(9, TrainConfig("fp32", 32, 1), "ok", 90.0, 400, 50, budget=300 * MIB)
    study = _study(budget=300 * MIB, extra=[over])
    table = trials_table(study)
    best = best_of(list(study.records))
    _, values = pictures.best_curve(table, 300 * MIB)
    assert values[-1] == best.value == 45.0 and list(values) == [40.0, 40.0, 45.0, 45.0, 45.0]
    fig = pictures.best_so_far(table, "t", 300 * MIB, best.number)
    star = _collections(fig.axes[0])["best"]
    assert star.get_offsets()[0].tolist() == pytest.approx([25.0, 45.0]) and star.get_label() == "best: trial 3"


# --- trial numbers ---------------------------------------------------------------------------------


def test_real_trials_are_numbered_from_one_in_every_table_and_storage_numbers_kept():
    study = _study()
    assert trial_numbers(study.records) == {4: 1, 6: 2, 7: 3, 8: 4}
    assert all(trial_number(study.records, n) == shown for n, shown in trial_numbers(study.records).items())
    table = trials_table(study)
    assert table["trial"].fillna(-1).tolist() == [-1, -1, -1, -1, 1, -1, 2, 3, 4]  # a pruned config has none
    assert table["number"].tolist() == list(range(9))  # Optuna's, for its own tools
    best = best_record(study)
    assert best["trial"] == 3 and best["number"] == 7 and [s["trial"] for s in best["samples"]] == [1, 3]
    json.dumps(best)  # plain ints
    summary = summary_markdown(study, table)
    assert "`fp32 mb=8 ga=1 ckpt=0 split=1` (trial 3)" in summary
    top = summary.split("## Top 10 configs")[1]
    assert top.splitlines()[4].startswith("| 3 | fp32 mb=8")
    errors = summary.split("## Prediction error of every real trial")[1]
    assert [line.split("|")[1].strip() for line in errors.splitlines()[4:8]] == ["1", "2", "3", "4"]


def test_a_number_once_shown_never_changes_as_the_study_goes_on():
    first = trial_numbers(_study().records)
    later = [
        _pruned(9, TrainConfig("fp32", 2, 4), "too_slow", 50, 1.0),
        # claimed, then found a duplicate of another machine's claim: it keeps its number
        _pruned(10, TrainConfig("fp32", 2, 4, 1), "duplicate", 50, 1.0, worker={"pid": 2}),
        _ran(11, TrainConfig("fp32", 4, 2), "ok", 20.0, 80, 60),
        TrialRecord(number=12, config=TrainConfig("fp32", 2, 4), status=TrialStatus.RUNNING, worker={"pid": 1}),
    ]
    numbers = trial_numbers(_study(extra=later).records)
    assert {n: numbers[n] for n in first} == first
    assert numbers[10] == 5 and numbers[11] == 6 and numbers[12] == 7 and 9 not in numbers
    assert trial_number(_study(extra=later[:3]).records, 12) == 7  # what the worker says before the record exists


def test_the_progress_line_shows_the_best_sample_as_the_tables_do():
    from autofit.study.progress import progress_of

    event = progress_of(_study().records, "x", 0.0)
    assert event.best_samples_per_s == 45.0  # fp32 mb=8's best sample (40 and 45), not their median


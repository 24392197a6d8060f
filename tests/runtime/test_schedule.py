"""autofit.runtime.schedule.MeasureSchedule: validation, the legacy arguments, the cost in steps."""

from __future__ import annotations

import pytest

from autofit.runtime.schedule import DEFAULT_SCHEDULE, MeasureSchedule


def test_default_is_two_warmup_one_measured_three_timed():
    assert (DEFAULT_SCHEDULE.warmup_steps, DEFAULT_SCHEDULE.measured_steps, DEFAULT_SCHEDULE.timed_steps,
            DEFAULT_SCHEDULE.micro_steps_per_step) == (2, 1, 3, 3)
    assert DEFAULT_SCHEDULE.total_steps == 6


def test_step_equivalents_counts_tracked_steps_at_the_slowdown():
    # (2 warm-up + 1 measured) tracked steps at 2.0 each, plus 3 timed: 9 untracked steps' worth.
    assert DEFAULT_SCHEDULE.step_equivalents() == 9.0
    assert MeasureSchedule(warmup_steps=4, measured_steps=2, timed_steps=5).step_equivalents(3.0) == 23.0


def test_micro_steps_are_capped():
    assert [DEFAULT_SCHEDULE.micro_steps(k) for k in (1, 2, 3, 64)] == [1, 2, 3, 3]


def test_from_steps_keeps_the_old_arguments_meaning():
    assert MeasureSchedule.from_steps(0, 1) == MeasureSchedule(2, 1, 3, 3)
    assert MeasureSchedule.from_steps(5, 7) == MeasureSchedule(5, 7, 7, 3)
    with pytest.raises(ValueError, match="measure_steps must be an integer >= 1, got 0"):
        MeasureSchedule.from_steps(2, 0)


@pytest.mark.parametrize("field, value", [("warmup_steps", 1), ("measured_steps", 0), ("timed_steps", 0),
                                          ("micro_steps_per_step", 1), ("timed_steps", 2.5), ("warmup_steps", True)])
def test_out_of_range_counts_are_refused(field, value):
    with pytest.raises(ValueError, match=f"MeasureSchedule.{field} must be an integer"):
        MeasureSchedule(**{field: value})


def test_round_trips_through_a_dict():
    schedule = MeasureSchedule(3, 2, 4, 2)
    assert MeasureSchedule.from_dict(schedule.to_dict()) == schedule


def test_a_throughput_sample_runs_no_measured_steps_and_round_trips():
    sample = MeasureSchedule(memory=False)
    assert sample.total_steps == 5 and sample.step_equivalents() == 5.0
    assert MeasureSchedule.from_dict(sample.to_dict()) == sample
    assert MeasureSchedule.from_dict({"warmup_steps": 2}).memory  # a schedule written before the field reads memory
    with pytest.raises(ValueError, match="MeasureSchedule.memory must be True or False, got 1"):
        MeasureSchedule(memory=1)


def test_a_throughput_sample_never_makes_a_tracker():
    from autofit.runtime.schedule import run_steps

    steps = []

    def tracker():
        raise AssertionError("a throughput sample made a tracker")

    assert run_steps(MeasureSchedule(memory=False), lambda: steps.append(1), tracker=tracker) is None
    assert len(steps) == 2  # the warm-up only: the caller times the timed steps

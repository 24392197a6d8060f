"""What a timed step got from the machine: starved steps are recognised, taken again, and never the figure."""

from __future__ import annotations

import os
import time

import pytest

from autofit.runtime import timing
from autofit.runtime.timing import STARVED_WAIT_SHARE, StepClock, StepSample, StepTimes


def test_a_starved_step_is_never_the_best_and_the_spread_is_of_the_clean_ones():
    fast_but_starved = StepSample(wall_s=0.5, cpu_s=0.4, wait_s=0.5 * (STARVED_WAIT_SHARE + 0.1))
    clean = (StepSample(1.0, 1.8, 0.0), StepSample(1.2, 2.0, 0.01), StepSample(1.1, 1.9, 0.0))
    times = StepTimes((fast_but_starved, *clean), threads=2, cpus=2)
    assert fast_but_starved.starved and not any(s.starved for s in clean)
    assert times.best_s == 1.0 and times.starved_steps == 1
    assert times.spread == pytest.approx(1.1 / 1.0 - 1.0)
    assert times.cpu_share == pytest.approx(1.8 / (1.0 * 2))
    data = times.to_dict()
    assert data["timed_steps"] == 4 and data["starved_steps"] == 1
    assert data["max_wait_share"] == pytest.approx(STARVED_WAIT_SHARE + 0.1)


def test_when_every_step_starved_the_fastest_is_kept_and_flagged():
    starved = tuple(StepSample(w, w, w) for w in (2.0, 1.5, 3.0))
    times = StepTimes(starved, threads=1, cpus=1)
    assert times.best_s == 1.5 and times.starved_steps == 3


def test_without_schedstat_no_step_is_judged_starved(monkeypatch):
    monkeypatch.setattr(timing, "_schedstats", lambda: None)
    clock = StepClock()
    clock.start()
    clock.stop()
    sample = clock.step_sample(1.0)
    assert sample.wait_s is None and not sample.starved


def test_the_step_clock_scales_its_parts_to_the_composed_step(monkeypatch):
    """A step of grad_accum=6 composed from 3 micro-steps that ran: its CPU time and wait are scaled
    like its wall time, so the shares stay those of the steps that ran."""
    stats = iter([{"1": (0, 0)}, {"1": (10**9, int(0.2e9))}])
    monkeypatch.setattr(timing, "_schedstats", lambda: next(stats))
    ticks = iter([0.0, 1.0])
    clock = StepClock(clock=lambda: next(ticks))
    clock.start()
    assert clock.stop() == 1.0
    sample = clock.step_sample(2.0)
    assert sample.wall_s == 2.0 and sample.wait_s == pytest.approx(0.4)


def _spin(seconds: float) -> None:
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        pass


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux's per-thread schedstat")
def test_a_step_that_shares_its_cpus_with_busy_processes_is_starved():
    """As many busy processes as this process may use CPUs, plus this step: the step's thread waits
    on the run queue about 1/(cpus+1) of the time, far over the starvation share."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    hogs = [ctx.Process(target=_spin, args=(3.0,)) for _ in range(timing.cpus_available())]
    for h in hogs:
        h.start()
    try:
        time.sleep(0.2)  # the hogs are running
        clock = StepClock()
        clock.start()
        _spin(0.5)
        wall = clock.stop()
        sample = clock.step_sample(wall)
    finally:
        for h in hogs:
            h.terminate()
            h.join()
    assert sample.wait_s is not None and sample.starved, sample


def test_starved_steps_are_taken_again_unless_the_load_lasts():
    from autofit.runtime.timing import MAX_RETIMED_STEPS, more_steps_due

    quiet, starved = StepSample(1.0, 2.0, 0.0), StepSample(2.0, 2.0, 0.5)
    assert more_steps_due([], 3) and more_steps_due([quiet, quiet], 3)
    assert not more_steps_due([quiet] * 3, 3)
    # a passing load: the starved steps are replaced
    assert more_steps_due([starved, starved, quiet], 3) and more_steps_due([starved, quiet, starved, quiet], 3)
    # a lasting one: as many starved steps in a row as the trial times, and no more are taken
    assert not more_steps_due([starved] * 3, 3) and not more_steps_due([quiet, starved, starved, starved], 3)
    # and never more than MAX_RETIMED_STEPS extra
    alternating = [starved, quiet] * 10
    assert not more_steps_due(alternating[:3 + MAX_RETIMED_STEPS], 3)

"""The steadiness suite: its verdict per check, its tables, and its plumbing from searches to quiet measurements."""

from __future__ import annotations

import pandas as pd
import pytest

from autofit.bench import steady
from autofit.core.config import TrainConfig

FAST, SLOW = TrainConfig("bf16", 16, 4), TrainConfig("bf16", 8, 8)


def _row(check, budget, run, config, share):
    return {"check": check, "budget": budget, "run": run, "answer": config.short(), "config": config,
            "search_samples_per_s": 90.0, "quiet_samples_per_s": None if share is None else 100 * share,
            "share_of_best": share, "wall_s": 30.0,
            "real_trials": 4, "starved_steps": 0, "max_wait_share": 0.01}


def test_a_check_passes_when_every_answer_is_within_five_percent_of_the_fastest():
    res = steady.SteadyResults([_row("repeats", "200MB", 1, FAST, 1.0), _row("repeats", "200MB", 2, SLOW, 0.96),
                                _row("repeats", "8GB", 1, FAST, 1.0), _row("repeats", "8GB", 2, SLOW, 0.90),
                                _row("busy core", "200MB", 1, SLOW, 0.96)], 60.0)
    assert [tuple(v)[:3] for v in res.verdicts()] == [("repeats, 200MB", 0.96, True), ("repeats, 8GB", 0.90, False),
                                                     ("busy core, 200MB", 0.96, True)]
    assert res.verdicts()[0].answers == (FAST.short(), SLOW.short())
    # the busy-core run is judged by its own answer's share (of the fastest answer at its budget)
    res.rows[-1]["share_of_best"] = 0.80
    assert tuple(res.verdicts()[-1]) == ("busy core, 200MB", 0.80, False, (SLOW.short(),))
    res.rows[1]["share_of_best"], res.rows[-1]["share_of_best"] = 0.5, 1.0  # a slow quiet answer fails the repeats only
    assert [v.passed for v in res.verdicts()] == [False, False, True]


def test_the_tables_say_each_run_and_the_verdicts(tmp_path):
    res = steady.SteadyResults([_row("repeats", "200MB", 1, FAST, 1.0), _row("busy core", "200MB", 1, SLOW, 0.9)], 60.0)
    files = steady.write_steady(tmp_path, {"date": "today"}, res, repeats=1)
    table = pd.read_csv(tmp_path / "steady.csv")
    assert list(table.columns) == steady.COLUMNS and len(table) == 2
    text = (tmp_path / "steady.md").read_text()
    assert "`bf16 mb=8 ga=8" in text and "busy core, 200MB: 1 distinct answer(s); the slowest measures 90.0% of the fastest" in text
    assert "FAIL" in text and {p.name for p in files} == {"steady.csv", "steady.md"}
    assert "busy core, 200MB: 1 distinct answer(s)" in text


def test_each_distinct_answer_is_measured_quietly_and_scored_against_the_fastest(tmp_path, monkeypatch):
    answers = iter([FAST, SLOW, FAST])
    monkeypatch.setattr(steady, "_search_row", lambda check, budget, run, out: _row(check, budget, run, next(answers), None))
    measured = []

    def quietly(configs, rounds, progress):
        measured.append(configs)
        return {FAST: steady.Quiet(100.0, 90.0, 104.0, 3), SLOW: steady.Quiet(97.0, 80.0, 120.0, 3)}

    monkeypatch.setattr(steady, "_measure_quietly", quietly)
    res = steady.run_steady(tmp_path, {}, quick=True)
    assert measured == [[FAST, SLOW]]  # each answer once, in the order found
    assert [(r["check"], r["share_of_best"]) for r in res.rows] == [("repeats", 1.0), ("repeats", 0.97),
                                                                   ("busy core", 1.0)]
    assert all(v.passed for v in res.verdicts())


@pytest.mark.slow
def test_a_busy_core_is_a_separate_process_that_stops():
    import time

    with steady.BusyCore() as busy:
        hog = busy._hog
        assert hog.is_alive()
        time.sleep(0.2)
    assert not hog.is_alive()


def test_quiet_trials_are_interleaved_and_scored_by_their_median(monkeypatch):
    """One lucky trial does not make an answer the fastest: the median scores it, and the table shows the spread."""
    import types

    import autofit.trial.run

    readings = {FAST: iter([30.0, 31.0, 32.0]), SLOW: iter([26.0, 40.0, 29.0])}
    calls = []

    def fake_trial(model, config, **_):
        calls.append(config)
        return types.SimpleNamespace(samples_per_s=next(readings[config]), status=types.SimpleNamespace(value="ok"))

    monkeypatch.setattr(autofit.trial.run, "run_trial", fake_trial)
    quiet = steady._measure_quietly([FAST, SLOW], 3, lambda _m: None)
    assert calls == [FAST, SLOW] * 3
    assert quiet == {FAST: steady.Quiet(31.0, 30.0, 32.0, 3), SLOW: steady.Quiet(29.0, 26.0, 40.0, 3)}
    row = {"quiet_samples_per_s": 29.0, "quiet_min_per_s": 26.0, "quiet_max_per_s": 40.0, "quiet_trials": 3}
    assert steady._quiet_cell(row) == "29.0 [26.0-40.0] (3)"


def test_a_failing_check_says_what_its_search_read_of_the_fastest_answer(tmp_path):
    rows = [_row("repeats", "8GB", 1, FAST, 1.0), _row("repeats", "8GB", 2, SLOW, 0.9),
            _row("repeats", "8GB", 3, SLOW, 0.9)]
    rows[1].update(fastest_in_search_per_s=88.5, fastest_in_search_samples=2)
    rows[2].update(fastest_in_search_per_s=None, fastest_in_search_samples=0)
    steady.write_steady(tmp_path, {"date": "today"}, steady.SteadyResults(rows, 60.0), repeats=3)
    text = (tmp_path / "steady.md").read_text()
    assert ("FAIL (target ≥ 95%); run 2 answered `bf16 mb=8 ga=8 ckpt=0 split=1` at 90.0 in its search, where the "
            "fastest read 88.5 (best of 2); run 3 answered `bf16 mb=8 ga=8 ckpt=0 split=1` at 90.0 in its search, "
            "where it never ran the fastest") in text
    assert "| its answer |" in text and "| 88.5 (best of 2) |" in text and "| not run |" in text
    table = pd.read_csv(tmp_path / "steady.csv")
    assert list(table["fastest_in_search_samples"].fillna(0)) == [0, 2, 0]


def test_each_run_records_what_it_read_of_the_fastest_answer(tmp_path, monkeypatch):
    answers = iter([(FAST, {FAST: (101.0, 2), SLOW: (99.0, 1)}), (SLOW, {FAST: (95.0, 3), SLOW: (98.0, 2)}),
                    (SLOW, {SLOW: (80.0, 1)})])

    def search_row(check, budget, run, out):
        config, seen = next(answers)
        return {**_row(check, budget, run, config, None), "seen": seen}

    monkeypatch.setattr(steady, "_search_row", search_row)
    monkeypatch.setattr(steady, "_measure_quietly", lambda configs, rounds, progress: {
        FAST: steady.Quiet(100.0, 90.0, 104.0, 3), SLOW: steady.Quiet(90.0, 80.0, 95.0, 3)})
    res = steady.run_steady(tmp_path, {}, quick=True)
    assert [(r["fastest_in_search_per_s"], r["fastest_in_search_samples"]) for r in res.rows] == [
        (101.0, 2), (95.0, 3), (None, 0)]


def test_a_search_ranks_each_config_by_the_best_of_its_samples():
    from autofit.core.records import TrialRecord, TrialStatus

    fits = {"peak_over_budget_bytes": -1.0, "failed": 0.0}
    records = [TrialRecord(n, c, TrialStatus.OK, value=v, measurement={"samples_per_s": v}, constraints=fits)
               for n, (c, v) in enumerate([(FAST, 90.0), (SLOW, 70.0), (FAST, 95.0)])]
    records.append(TrialRecord(3, SLOW, TrialStatus.PRUNED))  # no sample
    assert steady._best_samples(records) == {FAST: (95.0, 2), SLOW: (70.0, 1)}

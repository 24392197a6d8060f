"""autofit bench: table writing, the peers' logic against a synthetic oracle, replay scoring, a tiny suite.

No timing assertions: the machine is shared and noisy.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re

import pytest

from autofit.bench import finders
from autofit.bench import strategies as st
from autofit.bench.common import (
    ErrorStats,
    Report,
    environment,
    markdown_table,
    median_and_spread,
    relative_error,
    write_csv,
)
from autofit.bench.oracles import ReplayOracle
from autofit.bench.problem import Oracle, OracleRecord, Outcome, Problem
from autofit.bench.scoring import run_strategy, score
from autofit.bench.search_cells import problem_for
from autofit.bench.search_data import BenchMode, Cell, Grid, GridPoint, SearchResults
from autofit.bench.search_tables import losses, write_search
from autofit.core.config import Precision, TrainConfig

MiB = 2**20
HALVING = st.Strategy("accelerate-x0.5", finders.accelerate_halving, st.Criterion.LARGEST, True)   # the finder at fp32


# --- a synthetic oracle --------------------------------------------------------------------------

class Synthetic(Oracle):
    """Memory linear in the micro-batch; throughput rising with it (saturating); checkpointing halves
    activations and costs a third more time; pure bf16 halves everything and is twice as fast."""

    def __init__(self, budget_bytes: int, per_sample: float = 10 * MiB, base: float = 20 * MiB) -> None:
        super().__init__()
        self.budget_bytes = budget_bytes
        self.per_sample = per_sample
        self.base = base

    def peak(self, c: TrainConfig) -> float:
        scale = 0.5 if c.precision is Precision.BF16 else 1.0
        act = self.per_sample * (0.5 if c.checkpoint_every else 1.0)
        return scale * (self.base + act * c.micro_batch)

    def throughput(self, c: TrainConfig) -> float:
        speed = 2.0 if c.precision is Precision.BF16 else 1.0
        return speed * 100 * c.micro_batch / (c.micro_batch + 4) / (1.33 if c.checkpoint_every else 1.0)

    def _run(self, c: TrainConfig, memory: bool = True) -> Outcome:
        peak = self.peak(c)
        if peak > self.budget_bytes:
            return Outcome(c, "oom", None, None, 1.0)
        return Outcome(c, "ok", self.throughput(c), int(peak), 2.0)


def _problem(budget_mib: float, micro_batches=(1, 2, 4, 8, 16, 32, 64), global_batch=64, param_count=0) -> Problem:
    return Problem("synthetic", int(budget_mib * MiB), global_batch, (Precision.FP32, Precision.BF16),
                      tuple(micro_batches), (0, 1), param_count=param_count)


def _largest_fitting(oracle: Synthetic, problem: Problem) -> int | None:
    fitting = [m for m in problem.micro_batches if oracle.peak(problem.config(m)) <= problem.budget_bytes]
    return max(fitting) if fitting else None


@pytest.mark.parametrize("budget_mib", [25, 60, 100, 200, 700, 1000])
def test_halving_finds_largest_fitting_batch_in_log_trials(budget_mib):
    problem = _problem(budget_mib)
    oracle = Synthetic(problem.budget_bytes)
    answer = finders.accelerate_halving(problem, oracle)
    expected = _largest_fitting(oracle, problem)
    assert (answer.micro_batch if answer else None) == expected
    # from 64 down by halves: one trial per power of two tried
    assert len(oracle.history) <= int(math.log2(64)) + 1
    assert sum(r.outcome.status == "oom" for r in oracle.history) == len(oracle.history) - (1 if answer else 0)
    assert all(r.outcome.config.precision is Precision.FP32 and r.outcome.config.checkpoint_every == 0
               for r in oracle.history)


def test_halving_with_09_rounds_down_to_divisors_and_never_repeats():
    problem = _problem(100, micro_batches=(1, 2, 3, 4, 6, 12), global_batch=12)
    oracle = Synthetic(problem.budget_bytes, per_sample=12 * MiB)
    answer = finders.accelerate_halving_09(problem, oracle)
    tried = [r.outcome.config.micro_batch for r in oracle.history]
    assert len(tried) == len(set(tried))
    assert answer.micro_batch == _largest_fitting(oracle, problem)
    # x0.9 walks 12 -> 10 (runs 6) -> 9 (6 again, from memory) -> 8 (6) -> 7 (6) -> 6 (6) -> 5 (4) ...
    assert tried[:2] == [12, 6]


def test_halving_gives_up_when_nothing_fits():
    problem = _problem(5)
    oracle = Synthetic(problem.budget_bytes)
    assert finders.accelerate_halving(problem, oracle) is None
    assert all(r.outcome.status == "oom" for r in oracle.history)


@pytest.mark.parametrize("budget_mib", [25, 60, 100, 200, 700, 1000])
def test_binsearch_finds_largest_fitting_batch(budget_mib):
    problem = _problem(budget_mib, micro_batches=tuple(range(1, 65)), global_batch=None)  # Lightning's own domain
    oracle = Synthetic(problem.budget_bytes)
    answer = finders.lightning_binsearch(problem, oracle)
    # when nothing fits, Lightning ends on its initial low of 1, which never ran
    assert answer.micro_batch == (_largest_fitting(oracle, problem) or 1)
    assert len(oracle.history) <= 2 * int(math.log2(64)) + 2


def test_binsearch_trial_sequence_matches_lightning():
    # fits up to 6 (20 + 10 * 6 = 80 MiB): 2 ok, 4 ok, 8 oom, then bisect (4+8)//2 = 6 ok, (6+8)//2 = 7 oom
    problem = _problem(85, micro_batches=tuple(range(1, 65)), global_batch=None)
    oracle = Synthetic(problem.budget_bytes)
    finders.lightning_binsearch(problem, oracle)
    assert [r.outcome.config.micro_batch for r in oracle.history] == [2, 4, 8, 6, 7]


def test_deepspeed_predicts_max_from_profile_run_and_probes():
    # model states 16 B/param; the profile run at micro-batch 1 gives activations per sample by difference
    problem = _problem(200, micro_batches=tuple(range(1, 65)), global_batch=None, param_count=(20 * MiB) // 16)
    oracle = Synthetic(problem.budget_bytes)
    answer = finders.deepspeed_autotuner(problem, oracle)
    tried = [r.outcome.config.micro_batch for r in oracle.history]
    assert tried[0] == 1                          # the profile run
    assert tried[1] == math.ceil(1.05 * 18)       # (200 - 20) / 10 = 18 predicted; probe 5% above first
    assert 18 in tried
    assert answer is not None and answer.micro_batch <= _largest_fitting(oracle, problem)
    assert len(tried) == len(set(tried))


def test_deepspeed_gives_up_when_profile_run_does_not_fit():
    problem = _problem(5, param_count=1000)
    oracle = Synthetic(problem.budget_bytes)
    assert finders.deepspeed_autotuner(problem, oracle) is None
    assert len(oracle.history) == 1


def test_tpe_explores_whole_space_and_respects_trial_budget():
    problem = _problem(200)
    oracle = Synthetic(problem.budget_bytes)
    answer = st.optuna_tpe(problem, oracle, seed=3, real_trials=8)
    configs = [r.outcome.config for r in oracle.history]
    assert len(configs) == 8 and len(set(configs)) == 8
    assert answer in configs and oracle.peak(answer) <= problem.budget_bytes


def test_incumbent_by_criterion():
    c = lambda m: TrainConfig(Precision.FP32, m, 1)
    recs = [OracleRecord(Outcome(c(8), "ok", 5.0, 1, 1.0), 1.0),
            OracleRecord(Outcome(c(16), "ok", 4.0, 1, 1.0), 2.0),
            OracleRecord(Outcome(c(32), "oom", None, None, 1.0), 3.0)]
    assert [x.micro_batch for x in st.incumbent(recs, st.Criterion.LARGEST)] == [8, 16, 16]
    assert [x.micro_batch for x in st.incumbent(recs, st.Criterion.THROUGHPUT)] == [8, 8, 8]


def test_problem_rejects_non_divisors():
    with pytest.raises(ValueError):
        _problem(100, micro_batches=(1, 3, 5), global_batch=12)


# --- fair baselines: the user's precision, per-precision sweeps, TPE for a small budget -------------

def _three(budget_mib: float) -> Problem:
    return Problem("synthetic", int(budget_mib * MiB), 64, (Precision.FP32, Precision.AMP_BF16, Precision.BF16),
                      (1, 2, 4, 8, 16, 32, 64), (0, 1))


def test_finder_at_user_precision_runs_amp_bf16_only():
    problem = _three(200)
    oracle = Synthetic(problem.budget_bytes)
    answer = finders.at_user_precision(problem, oracle, 0, finder=finders.accelerate_halving)
    assert {r.outcome.config.precision for r in oracle.history} == {Precision.AMP_BF16}
    assert answer.precision is Precision.AMP_BF16 and answer.micro_batch == 16   # 20 + 10 * 16 = 180 MiB fits


def test_sweep_runs_each_precision_on_one_clock_and_keeps_the_fastest():
    problem = _three(200)
    oracle = Synthetic(problem.budget_bytes)
    answer = finders.precision_sweep(problem, oracle, 0, finder=finders.accelerate_halving)
    by_precision = {p: [r for r in oracle.history if r.outcome.config.precision is p] for p in problem.precisions}
    assert all(by_precision.values())
    # pure bf16 halves the memory (fits 32) and is twice as fast: the sweep answers it
    assert answer == problem.config(32, Precision.BF16)
    single = Synthetic(problem.budget_bytes)
    finders.accelerate_halving(dataclasses.replace(problem, default_precision=Precision.BF16), single)
    assert len(oracle.history) == sum(len(v) for v in by_precision.values()) > len(single.history)
    assert oracle.clock_s >= sum(r.outcome.cost_s for r in oracle.history)


def test_sweep_incumbent_is_largest_per_precision_then_fastest():
    c = lambda p, m: TrainConfig(p, m, 1)
    recs = [OracleRecord(Outcome(c(Precision.FP32, 8), "ok", 5.0, 1, 1.0), 1.0),
            OracleRecord(Outcome(c(Precision.BF16, 4), "ok", 9.0, 1, 1.0), 2.0),
            OracleRecord(Outcome(c(Precision.BF16, 2), "ok", 9.5, 1, 1.0), 3.0),   # smaller: not bf16's answer
            OracleRecord(Outcome(c(Precision.FP32, 16), "ok", 12.0, 1, 1.0), 4.0)]
    assert [x.short() for x in st.incumbent(recs, st.Criterion.SWEEP_LARGEST)] == [
        c(Precision.FP32, 8).short(), c(Precision.BF16, 4).short(), c(Precision.BF16, 4).short(),
        c(Precision.FP32, 16).short()]


def test_peers_run_each_finder_at_user_precision_and_swept_with_handicaps_named():
    names = [s.name for s in st.PEERS]
    for finder in ("accelerate-x0.5", "accelerate-x0.9", "lightning-binsearch", "deepspeed-autotuner"):
        assert f"{finder} @amp-bf16" in names and f"{finder} sweep" in names
    assert all(s.handicap for s in st.PEERS)
    assert len(st.sweeps(st.PEERS)) == 4


@pytest.mark.parametrize("trials,startup", [(6, 2), (12, 2), (25, 5), (100, 20)])
def test_tpe_startup_scales_with_the_trial_budget(trials, startup):
    assert st.tpe_startup_trials(trials) == startup


def test_tpe_tells_the_budget_as_a_constraint(monkeypatch):
    import optuna

    studies = []
    real = optuna.create_study
    monkeypatch.setattr(optuna, "create_study", lambda **kw: studies.append(real(**kw)) or studies[-1])
    problem = _problem(60)
    oracle = Synthetic(problem.budget_bytes)
    st.optuna_tpe(problem, oracle, seed=1, real_trials=10)
    trials = studies[0].trials
    for t in trials:
        config = problem.config(t.params["micro_batch"], t.params["precision"], t.params["checkpoint_every"])
        fits = oracle.peak(config) <= problem.budget_bytes
        assert (t.constraints["peak_over_budget"] <= 0) == fits


# --- replay and scoring ---------------------------------------------------------------------------

def _grid() -> Grid:
    cell = Cell("synthetic", 8, (2, 4, 8), (Precision.FP32, Precision.AMP_BF16, Precision.BF16), (50, 100))
    oracle = Synthetic(10**12)
    points = {}
    for c in problem_for(cell, 1, 0).configs():
        points[c] = GridPoint(c, "ok", int(oracle.peak(c)), oracle.throughput(c), 0.1, 3.0, oracle.peak(c) * 1.01)
    return Grid(cell, points, oom_floor_s=1.5, param_count=0)


def test_replay_charges_grid_costs_and_scores_against_optimum():
    grid = _grid()
    budget = 50 * MiB
    best = grid.optimum(budget)
    assert best.peak_bytes <= budget
    assert all(p.samples_per_s <= best.samples_per_s for p in grid.feasible(budget))
    oracle = ReplayOracle(grid, budget)
    big = TrainConfig(Precision.FP32, 8, 1)
    out = oracle.run(big)
    assert out.status == "oom" and out.cost_s == pytest.approx(1.5 + 0.1)
    ok = oracle.run(best.config)
    assert ok.ok and ok.cost_s == 3.0
    assert oracle.clock_s == pytest.approx(4.6, abs=0.5)
    assert grid.fraction(best.config, budget) == 1.0
    assert grid.fraction(big, budget) == 0.0
    assert grid.fraction(None, budget) == 0.0


def test_a_replayed_remeasurement_is_charged_its_trial_without_the_tracked_steps(tmp_path):
    """A throughput sample (autofit's re-measurement) costs the grid trial's wall time less its tracked
    seconds, plus its bare warm-up steps; a grid that did not record them charges the whole trial."""
    from autofit.bench.oracles import throughput_sample_s
    from autofit.bench.replay import load_grids

    grid = _grid()
    c = next(iter(grid.points))
    grid.points[c] = dataclasses.replace(grid.points[c], tracked_s=2.0)  # wall 3.0 s, step 0.1 s
    oracle = ReplayOracle(grid, 10**12)
    first, again = oracle.run(c), oracle.run(c, memory=False)
    assert (first.cost_s, first.peak_bytes) == (3.0, grid.points[c].peak_bytes)
    assert again.cost_s == pytest.approx(3.0 - 2.0 + 2 * 0.1) and again.peak_bytes is None and again.ok
    other = next(p for p in grid.points.values() if p.config != c)
    assert other.tracked_s is None and throughput_sample_s(other) == other.wall_s
    runs = [run_strategy(HALVING, grid, 50 * MiB, 0, ReplayOracle(grid, 50 * MiB), BenchMode.REPLAY)]
    write_search(tmp_path, environment("test"), SearchResults([grid], runs, ("synthetic", 50 * MiB), 1, 0.0),
                 (HALVING,))
    loaded = load_grids(tmp_path / "search_grid.csv")[0].points
    assert loaded[c].tracked_s == 2.0 and loaded[other.config].tracked_s is None


def test_replay_answers_the_trial_sample_then_the_second_and_loads_back_from_csv(tmp_path):
    from autofit.bench.replay import load_grids

    grid = _grid()
    c = next(iter(grid.points))
    grid.points[c] = dataclasses.replace(grid.points[c], samples_per_s=12.0, trial_samples_per_s=9.0,
                                         second_samples_per_s=12.0)
    oracle = ReplayOracle(grid, 10**12)
    assert [oracle.run(c).samples_per_s for _ in range(3)] == [9.0, 12.0, 9.0]
    swapped = ReplayOracle(grid, 10**12, first_sample=1)  # the other draw of the noise
    assert [swapped.run(c).samples_per_s for _ in range(3)] == [12.0, 9.0, 12.0]
    assert oracle.history[0].outcome.step_time_s == pytest.approx(c.samples_per_step / 9.0)
    halving = HALVING
    runs = [run_strategy(halving, grid, 50 * MiB, 0, ReplayOracle(grid, 50 * MiB), BenchMode.REPLAY)]
    write_search(tmp_path, environment("test"), SearchResults([grid], runs, ("synthetic", 50 * MiB), 1, 0.0), (halving,))
    (loaded,) = load_grids(tmp_path / "search_grid.csv")
    assert [row["mode"] for row in csv.DictReader((tmp_path / "search_runs.csv").open())] == ["replay"]
    assert loaded.cell.budgets_mib == (50, 100) and loaded.cell.micro_batches == (2, 4, 8)
    assert loaded.points[c].trial_samples_per_s == 9.0 and loaded.optimum(50 * MiB) == grid.optimum(50 * MiB)
    assert loaded.oom_floor_s == 1.5
    assert loaded.points[c].more_samples_per_s == ()
    # a config sampled more than twice: its further samples load back, and a re-run cycles through them all
    grid.points[c] = dataclasses.replace(grid.points[c], more_samples_per_s=(11.5,))
    cycling = ReplayOracle(grid, 10**12)
    assert [cycling.run(c).samples_per_s for _ in range(4)] == [9.0, 12.0, 11.5, 9.0]
    write_search(tmp_path, environment("test"), SearchResults([grid], runs, ("synthetic", 50 * MiB), 1, 0.0), (halving,))
    assert load_grids(tmp_path / "search_grid.csv")[0].points[c].more_samples_per_s == (11.5,)
    # the DeepSpeed autotuner's model-state formula reads the parameter count: replayed as the bench ran it
    counted = dataclasses.replace(grid, param_count=123_456)
    write_search(tmp_path, environment("test"), SearchResults([counted], runs, ("synthetic", 50 * MiB), 1, 0.0),
                 (halving,))
    assert load_grids(tmp_path / "search_grid.csv")[0].param_count == 123_456


def test_a_replayed_re_measurement_answers_the_grids_next_sample_and_old_head_to_heads_are_ignored(tmp_path):
    import pandas as pd

    from autofit.bench.replay import load_grids

    grid = _grid()
    one = TrainConfig(Precision.BF16, 2, 4)
    grid.points[one] = dataclasses.replace(grid.points[one], trial_samples_per_s=10.0, second_samples_per_s=9.0,
                                           more_samples_per_s=(11.0,))
    oracle = ReplayOracle(grid, 10**12)
    assert [oracle.run(one).samples_per_s for _ in range(4)] == [10.0, 9.0, 11.0, 10.0]
    # a grid committed by an earlier version carries its head-to-head figures in a column of their own
    runs = [run_strategy(HALVING, grid, 50 * MiB, 0, ReplayOracle(grid, 50 * MiB), BenchMode.REPLAY)]
    write_search(tmp_path, environment("test"), SearchResults([grid], runs, ("synthetic", 50 * MiB), 1, 0.0), (HALVING,))
    path = tmp_path / "search_grid.csv"
    frame = pd.read_csv(path)
    assert "together_samples_per_s" not in frame.columns
    frame["together_samples_per_s"] = "8.0;8.5"
    frame.to_csv(path, index=False)
    (loaded,) = load_grids(path)
    assert loaded.points[one].samples() == [10.0, 9.0, 11.0]


def test_run_strategy_scores_peers_and_reports_unavailable_autofit():
    grid = _grid()
    budget = 100 * MiB
    strat = HALVING
    res = run_strategy(strat, grid, budget, 0, ReplayOracle(grid, budget), BenchMode.REPLAY)
    assert res.answer is not None and 0 < res.fraction <= 1 and res.trials >= 1 and res.error is None
    assert res.wall_s >= 3.0
    from autofit.bench.own_search import AUTOFIT

    def unavailable(problem, oracle, seed):
        from autofit.bench.own_search import NotAvailable
        raise NotAvailable("not yet available")

    fake = st.Strategy(AUTOFIT.name, unavailable, st.Criterion.THROUGHPUT, False)
    missing = run_strategy(fake, grid, budget, 0, ReplayOracle(grid, budget), BenchMode.REPLAY)
    assert missing.error == "not yet available" and math.isnan(missing.fraction)
    text = losses([res, missing], (fake, strat))
    assert text and "did not run" in text[0]


def test_time_to_target_uses_strategy_clock():
    grid = _grid()
    budget = 1000 * MiB
    halving = HALVING
    oracle = ReplayOracle(grid, budget)
    res = score(halving, grid, budget, 0, BenchMode.REPLAY, oracle, halving(problem_for(grid.cell, budget, 0), oracle, 0))
    # keeps fp32 while pure bf16 is twice as fast here: half the optimum, never 95%
    assert res.fraction == pytest.approx(0.5) and res.time_to_target_s is None
    tpe = next(s for s in st.PEERS if s.name == "optuna-tpe")
    oracle = ReplayOracle(grid, budget)
    res = score(tpe, grid, budget, 0, BenchMode.REPLAY, oracle, tpe(problem_for(grid.cell, budget, 0), oracle, 0))
    first = next(r for r in oracle.history if r.outcome.config == grid.optimum(budget).config)
    assert res.fraction == 1.0 and res.time_to_target_s == pytest.approx(first.clock_s)


# --- done-when verdicts --------------------------------------------------------------------------

def _verdict_runs(autofit_fn, budget_mib: int):
    """Replayed runs (2 seeds) of a stand-in autofit, a scripted TPE and the four sweeps, plus a live autofit run."""
    from autofit.bench.search_data import SearchResults

    grid, budget = _grid(), budget_mib * MiB
    optimum = grid.optimum(budget).config

    def tpe(problem, oracle, seed):   # two slow configs, then the optimum
        for config in (problem.config(2), problem.config(2, checkpoint_every=1), optimum):
            oracle.run(config)
        return optimum

    strategies = (st.Strategy("autofit", autofit_fn, st.Criterion.THROUGHPUT, True),
                  st.Strategy("optuna-tpe", tpe, st.Criterion.THROUGHPUT, True)) + st.sweeps(st.PEERS)
    runs = [run_strategy(s, grid, budget, seed, ReplayOracle(grid, budget), BenchMode.REPLAY) for s in strategies
            for seed in (0, 1)]
    runs.append(run_strategy(strategies[0], grid, budget, 0, ReplayOracle(grid, budget), BenchMode.LIVE))
    return SearchResults([grid], runs, ("synthetic", budget), 2, 1.0, strategies=strategies), optimum


def test_done_when_passes_a_search_that_goes_straight_to_the_optimum(tmp_path):
    from autofit.bench.search_tables import cell_verdicts, write_search
    from autofit.bench.summary import headline
    from autofit.bench.verdict import CHECK, CHECKS, tallies

    def straight(problem, oracle, seed):
        return oracle.run(_grid().optimum(problem.budget_bytes).config).config

    res, _ = _verdict_runs(straight, 100)
    [v] = cell_verdicts(res.grids, res.runs, res.strategies)
    assert v.checks == {c: True for c in CHECKS} and v.passed and not v.notes
    mine, theirs = v.figures[CHECK.t98].split(" vs ")
    assert float(mine) == pytest.approx(3.0, abs=0.5) and float(theirs) > float(mine)  # one 3-s trial, plus own work
    assert [t.ok for t in tallies([v]) if t.of] == [True] * 4   # answer, live, no OOM, wall: no kind holds t98 here
    write_search(tmp_path, {"date": "today"}, res, res.strategies)
    text = (tmp_path / "search.md").read_text()
    assert "## Done when" in text and "| synthetic @ 100 MiB | - | 100.0% ✓" in text and "| PASS |" in text
    assert "- no OOM trial: 1 of 1 (needs 1) — PASS" in text and "time to 98% (s)" in text
    lines = headline(type("R", (), {"suites": {"search": res}, "wall_s": {}})())
    assert "Done when, synthetic @ 100 MiB: PASS." in lines
    assert ("Search done-when criteria, over the cells (each cell, where and why: search.md): answer ≥98% of the "
            "optimum, replayed: 1 of 1 (needs 1) — PASS;") in lines[-2]
    assert any("accelerate-x0.5 sweep (no checkpointing)" in line for line in lines)


def test_done_when_fails_and_says_where_and_why():
    from autofit.bench.search_tables import cell_verdicts
    from autofit.bench.verdict import CHECK, CHECKS

    def clumsy(problem, oracle, seed):   # an OOM first, then a small fp32 micro-batch
        oracle.run(problem.config(8))
        return oracle.run(problem.config(2)).config

    res, optimum = _verdict_runs(clumsy, 50)
    [v] = cell_verdicts(res.grids, res.runs, res.strategies)
    assert not v.passed
    assert {c for c in CHECKS if v.checks[c] is False} >= {CHECK.answer, CHECK.live, CHECK.no_oom, CHECK.t98}
    notes = " ".join(v.notes)
    assert "`fp32 mb=8" in notes and "OOM" in notes and "`fp32 mb=2" in notes and "never reaches 98%" in notes


def test_done_when_says_why_autofit_reached_98_late_and_why_its_wall_time_is_over():
    """The cause is in the measured figures: the first use, the trials up to 98% with what each found, the peer's."""
    from autofit.bench.search_tables import cell_verdicts
    from autofit.bench.verdict import CHECK

    def slow(problem, oracle, seed):   # first use, two slow configs, then the optimum and four re-measurements
        oracle.charge(40.0 + 2 * seed, "cold profile and device probe")   # two seeds: the median is neither
        best = _grid().optimum(problem.budget_bytes).config
        for config in (problem.config(2), problem.config(2, checkpoint_every=1), best, best, best, best, best):
            oracle.run(config)
        return best

    res, _ = _verdict_runs(slow, 100)
    [v] = cell_verdicts(res.grids, res.runs, res.strategies)
    assert v.checks[CHECK.t98] is False and v.checks[CHECK.wall] is False
    t98, wall = v.notes
    assert re.match(r"autofit 50\.\d s: first use 4[02]\.0 s; 3 trial\(s\) in 9\.0 s; before it `fp32 mb=2", t98)
    assert "of the optimum, read" in t98 and "sweep" in t98 and "its first use alone is 4" in t98
    assert "41.0 s first use + 21.0 s in 7 trial(s) (4 of them re-measurements)" in wall and "1.5× is" in wall


def test_cell_kinds_come_from_the_grid_and_the_suite_cells():
    """A lever other than batch size and precision matters when the best config without it is under 98% of
    the optimum (or nothing fits); accumulation is the batch size's own; a heavy cell says its trials' cost."""
    from autofit.bench.verdict import HEAVY, LEVER, TODAY, Tally, cell_kinds, lever_kind, tallies

    grid = _grid()
    budget = 100 * MiB
    ckpt = dataclasses.replace(grid.optimum(budget).config, checkpoint_every=1)
    plain = TrainConfig(Precision.BF16, 2, 4)
    grid.points = {plain: GridPoint(plain, "ok", 10 * MiB, 10.0, 0.1, 3.0, 10 * MiB),
                   ckpt: GridPoint(ckpt, "ok", 10 * MiB, 12.0, 0.1, 12.0, 10 * MiB)}
    assert lever_kind(grid, budget) == "checkpointing: 83.3% without it"
    grid.points[plain] = dataclasses.replace(grid.points[plain], samples_per_s=11.9)
    assert lever_kind(grid, budget) is None                                   # 99.2% without it: it does not matter
    kinds = cell_kinds(grid, budget, today=True, heavy=True)
    assert set(kinds) == {TODAY, HEAVY} and kinds[HEAVY] == "median trial 7.5 s, under the 10 s it stands for"
    assert Tally("x", 5, 8, 6, ("a", "b", "c")).text() == "x: 5 of 8 (needs 6) — FAIL; not in a, b, c"
    assert not Tally("x", 0, 0, 0).ok and "no such cell" in Tally("x", 0, 0, 0).text()
    assert [t.needed for t in tallies([]) if "today" in t.label] == [0]
    assert LEVER == "lever"


# --- tables ---------------------------------------------------------------------------------------

def test_error_stats_and_spread():
    s = ErrorStats.of([0.01, -0.02, 0.03, math.nan, -0.10])
    assert s.n == 4 and s.median == pytest.approx(0.025) and s.max == pytest.approx(0.10) and s.under == 2
    assert relative_error(110, 100) == pytest.approx(0.10)
    assert math.isnan(relative_error(1, 0))
    assert median_and_spread([3, None, 1, 2]) == (2.0, 1.0, 3.0)
    assert all(math.isnan(x) for x in median_and_spread([]))


def test_markdown_and_csv_writing(tmp_path):
    table = markdown_table(["a", "b|c"], [[1, "x|y"], [2.5, None]], "lr")
    lines = table.splitlines()
    assert lines[0] == "| a | b\\|c |" and lines[1] == "|---|---:|" and "x\\|y" in lines[2]
    path = write_csv(tmp_path / "t.csv", [{"a": 1, "b": [1, 2]}, {"a": math.nan, "c": "z"}])
    rows = list(csv.DictReader(path.open()))
    assert rows[0] == {"a": "1", "b": "1 2", "c": ""} and rows[1]["a"] == ""
    rep = Report("T", {"date": "today", "machine": "m"})
    rep.add("body")
    text = rep.write(tmp_path / "r.md").read_text()
    assert text.startswith("# T") and "- **machine**: m" in text and text.rstrip().endswith("body")


# --- a tiny suite end to end ----------------------------------------------------------------------

@pytest.mark.slow
def test_tiny_search_and_accuracy_suites(tmp_path, monkeypatch):
    """One workload, a 2-config grid, replay only, plus two accuracy configs: the files exist and parse."""
    from autofit.bench import accuracy, accuracy_cases, search
    from autofit.bench.common import environment
    from autofit.bench.own_search import AUTOFIT

    env = environment("autofit bench (test)")
    cell = Cell("gpt-tiny", 4, (2, 4), (Precision.FP32,), (80,), checkpoints=(0,))
    peers = tuple(s for s in st.PEERS if s.name in ("accelerate-x0.5 sweep", "lightning-binsearch sweep"))
    res = search.run_search_suite(tmp_path, env, cells=(cell,), seeds=1, strategies=(AUTOFIT,) + peers,
                                  live=False)
    assert len(res.grids[0].points) == 2 and all(p.status == "ok" for p in res.grids[0].points.values())
    text = (tmp_path / "search.md").read_text()
    assert "gpt-tiny @ 80 MiB" in text and "Where autofit loses" in text
    fits = [p for p in res.grids[0].points.values() if p.peak_bytes <= 80 * MiB]
    from autofit.bench.search_grid import TRUTH_SAMPLES_MAX, TRUTH_SAMPLES_MIN

    assert fits and all(TRUTH_SAMPLES_MIN <= len(p.samples()) <= TRUTH_SAMPLES_MAX and p.truth_noise() is not None
                        for p in fits)
    assert "its own noise, the gap between a config's two best samples" in text
    assert len(list(csv.DictReader((tmp_path / "search_runs.csv").open()))) == 3
    # autofit's time to 98% follows its own answer after each trial (its study's best), so an answer that
    # reaches 98% was reached at some trial
    mine = [r for r in res.runs if r.strategy == AUTOFIT.name]
    assert mine and all(r.reached_98_at is not None for r in mine if r.fraction >= 0.98)

    monkeypatch.setattr(accuracy_cases, "_QUICK_CASES", {"gpt-tiny": [("fp32", 1), ("fp32", 2, 2, 1)]})
    acc = accuracy.run_accuracy(tmp_path, env, quick=True, workloads=("gpt-tiny",),
                                budgets={"gpt-tiny": (40 * MiB,)}, truth_repeats=1)
    assert [r.status for r in acc.rows] == ["ok", "ok"]
    assert all(abs(r.error_rel) < 0.5 for r in acc.rows)
    # the independent ground truth: the allocator holds at least the live tensors the tracker counts
    assert all(len(r.allocator_peak_bytes) == 1 and r.allocator_peak_bytes[0] >= 0.99 * r.measured_peak_bytes
               for r in acc.rows)
    md = (tmp_path / "accuracy.md").read_text()
    assert "Target, built-ins" in md and "LLMem" in md and "Against an independent ground truth" in md


def test_search_plot_written_when_matplotlib_is_importable(tmp_path):
    pytest.importorskip("matplotlib")

    grid = _grid()
    runs = [run_strategy(s, grid, b * MiB, 0, ReplayOracle(grid, b * MiB), BenchMode.REPLAY)
            for b in grid.cell.budgets_mib for s in st.PEERS]
    files = write_search(tmp_path, {"date": "today"}, SearchResults([grid], runs, ("synthetic", 50 * MiB), 1, 1.0),
                         st.PEERS)
    assert (tmp_path / "search.png") in files and (tmp_path / "search.png").stat().st_size > 0


# --- the README's benchmark block ------------------------------------------------------------------

def test_readme_block_is_what_the_bench_writes_from_the_committed_summary():
    from pathlib import Path

    from autofit.bench.readme import END, START, readme_block

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    committed = readme[readme.index(START):readme.index(END) + len(END)]
    assert committed == readme_block((root / "results/benchmarks/summary.md").read_text()), \
        "README's benchmark block differs from results/benchmarks/summary.md: rerun `autofit bench`"


def test_update_readme_rewrites_only_the_block(tmp_path):
    from autofit.bench.readme import END, START, replace_block, update_readme

    summary = tmp_path / "summary.md"
    summary.write_text("# autofit bench: headline figures\n\nReproduce with `autofit bench`.\n\n"
                       "- Peak memory, estimate vs measured (CPU tracker): figure one\n- Estimator: two\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{START}\n- stale figure\n{END}\nafter\n")
    assert update_readme(readme, summary)
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("\nafter\n")
    assert "- Peak memory, estimate vs measured (CPU tracker): figure one\n- Estimator: two\n" in text
    assert "stale" not in text and "Reproduce" not in text
    assert not update_readme(tmp_path / "missing.md", summary)
    with pytest.raises(ValueError, match="no benchmark block"):
        replace_block("no markers here", "x")


def test_readme_block_is_a_headline_of_the_summary():
    from autofit.bench.readme import DOCS_PAGE, END, MAX_LINES, START, readme_block

    summary = "\n".join([
        "# autofit bench: headline figures", "",
        "- Peak memory, estimate vs measured (CPU tracker), 3 configs of a: median |error| 1%.",
        "- lstm-lm (reported, not a target): median |error| 0.1%.",
        "- At the search budgets: 0 false fit(s), 0 false prune(s).",
        "- Search, a @ 8 MiB (best found / optimum, median wall time): autofit 93% in 16 s; "
        "optuna-tpe (no memory estimate) 93% in 15 s; finder sweep (no checkpointing) 100% in 7 s; "
        "other not available.",
        "- Search, b @ 4 MiB (best found / optimum, median wall time): autofit 100% in 9 s; "
        "finder @amp-bf16 (amp-bf16 only) 51% in 2 s.",
        "- Live, a @ 8 MiB (one real run each): autofit 100% in 16 s.",
        "- Search done-when criteria, over the cells (each cell, where and why: search.md): no OOM trial: 2 of 2 "
        "(needs 2) — PASS; wall time ≤1.5× the best sweep's: 1 of 2 (needs 2) — FAIL.",
        "- Done when (targets), a @ 8 MiB: FAIL on less wall time than best sweep (16 vs 7).",
        "- Done when (targets), b @ 4 MiB: PASS.",
        "- Estimator: 1,000 configs scored per second.",
        "- Suite accuracy: 1.0 min.",
    ])
    block = readme_block(summary).splitlines()
    assert block[0] == START and block[-1] == END and len(block) - 2 <= MAX_LINES
    assert f"]({DOCS_PAGE})" in block[1] and "](results/benchmarks/search.md)" in block[1]
    bullets = block[3:-1]
    assert bullets[0].startswith("- Peak memory") and bullets[1].startswith("- At the search budgets")
    # per cell: autofit's figures beside the best other strategy's (highest fraction, then least time)
    assert ("a @ 8 MiB 93% in 16 s vs 100% in 7 s (finder sweep); b @ 4 MiB 100% in 9 s vs 51% in 2 s "
            "(finder @amp-bf16).") in bullets[2]
    assert bullets[3].startswith("- Search done-when criteria") and bullets[3].endswith("1 of 2 (needs 2) — FAIL.")
    assert bullets[4] == "- Estimator: 1,000 configs scored per second."
    assert not any(b.startswith(("- lstm-lm", "- Live", "- Done when", "- Suite")) for b in bullets)


def test_committed_readme_block_fits_the_headline_and_keeps_the_summary_figures():
    from pathlib import Path

    from autofit.bench.readme import END, MAX_LINES, START

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    summary = (root / "results/benchmarks/summary.md").read_text().splitlines()
    inner = readme[readme.index(START) + len(START):readme.index(END)].strip("\n").splitlines()
    assert len(inner) <= MAX_LINES
    for line in inner:
        if line.startswith("- ") and not line.startswith("- Search"):
            assert line in summary, line  # a headline bullet is the summary's, word for word
    assert (root / "docs/benchmarks.md").is_file()


# --- levers: device splits and what each lever is worth -------------------------------------------

def _split_grid(global_batch: int = 8, micro_batches: tuple[int, ...] = (1, 2, 4, 8)) -> Grid:
    """One device never fits 30 MiB (base 80 MiB); a 2-way split halves the base (fsdp) or nearly (pipeline)."""
    from autofit.core.config import SplitMode

    cell = Cell("synthetic", global_batch, micro_batches, (Precision.FP32, Precision.AMP_BF16, Precision.BF16), (30, 1000),
                checkpoints=(0,),
                device_splits=(1, 2), split_modes=(SplitMode.PIPELINE, SplitMode.FSDP))
    oracle = Synthetic(10**12, per_sample=1 * MiB, base=80 * MiB)
    points = {}
    for c in problem_for(cell, 1, 0).configs():
        share = {1: 1.0, 2: 0.6 if c.split_mode is SplitMode.PIPELINE else 0.5}[c.device_split]
        peak = int(oracle.peak(c) * share)
        points[c] = GridPoint(c, "ok", peak, oracle.throughput(c) * (1.2 if c.device_split > 1 else 1.0), 0.1, 3.0,
                              peak)
    return Grid(cell, points, oom_floor_s=1.5, param_count=0)


def test_split_grid_matches_autofit_space_and_fsdp_keeps_the_global_batch():
    from autofit.core.config import SplitMode
    from autofit.core.space import SearchSpace

    grid = _split_grid()
    problem = problem_for(grid.cell, 30 * MiB, 0)
    space = SearchSpace(precision=problem.precisions, micro_batch=problem.micro_batches,
                        checkpoint_every=problem.checkpoints, device_split=(1, 2),
                        split_mode=(SplitMode.PIPELINE, SplitMode.FSDP), global_batch=8)
    assert set(problem.configs()) == set(space.configs()) and len(problem.configs()) == 3 * (4 + 4 + 3)
    assert all(c.samples_per_step == 8 for c in problem.configs())
    assert problem.micro_batches_for((2, SplitMode.FSDP)) == (1, 2, 4)
    with pytest.raises(ValueError, match="device_splits must include 1"):
        Problem("x", 1, 8, (Precision.FP32,), (1, 2), device_splits=(2,))


def test_finders_score_zero_where_only_a_split_fits_and_tpe_searches_the_split():
    grid = _split_grid()
    budget = 30 * MiB
    best = grid.optimum(budget)
    assert best.config.device_split == 2
    for strategy in st.PEERS:
        res = run_strategy(strategy, grid, budget, 0, ReplayOracle(grid, budget), BenchMode.REPLAY)
        assert res.error is None and res.trials > 0
        assert all(r.outcome.config.device_split == 1 for r in res.history) or strategy.name == "optuna-tpe"
        if strategy.name != "optuna-tpe":
            assert res.fraction == 0.0
    tpe = next(s for s in st.PEERS if s.name == "optuna-tpe")
    oracle = ReplayOracle(grid, budget)
    res = run_strategy(tpe, grid, budget, 0, oracle, BenchMode.REPLAY)
    assert {r.outcome.config.device_split for r in res.history} == {1, 2} and res.fraction > 0


def test_lever_margins_name_the_best_config_without_each_lever():
    from autofit.bench.search_tables import lever_line

    grid = _split_grid()
    split, = grid.lever_margins(30 * MiB)[-1:]
    assert split[0] == "a device split" and split[1] is None
    assert "nothing fits without it" in lever_line(grid, 30 * MiB)
    # with room, accumulation is worth the ratio to the best ga=1 config that fits
    roomy = 1000 * MiB
    best = grid.optimum(roomy)
    margins = dict(grid.lever_margins(roomy))
    if best.config.grad_accum > 1:
        without = margins["accumulation"]
        assert without.config.grad_accum == 1 and without.samples_per_s <= best.samples_per_s
    assert "of the optimum" in lever_line(grid, roomy) or "nothing fits" in lever_line(grid, roomy)


def test_replay_loads_two_cells_of_one_workload_with_their_splits(tmp_path):
    from autofit.bench.replay import load_grids

    one, split = _grid(), _split_grid(4, (1, 2, 4))   # global batches 8 and 4: two cells of one workload
    split = dataclasses.replace(split, cell=dataclasses.replace(split.cell, workload="synthetic", budgets_mib=(30,)))
    runs = [run_strategy(HALVING, g, g.cell.budgets_mib[0] * MiB, 0, ReplayOracle(g, g.cell.budgets_mib[0] * MiB),
                         BenchMode.REPLAY) for g in (one, split)]
    write_search(tmp_path, environment("test"), SearchResults([one, split], runs, ("synthetic", 50 * MiB), 1, 0.0),
                 (HALVING,))
    first, second = load_grids(tmp_path / "search_grid.csv")
    assert (first.cell.global_batch, first.cell.budgets_mib, first.cell.device_splits) == (8, (50, 100), (1,))
    assert second.cell.global_batch == 4 and second.cell.micro_batches == (1, 2, 4)
    assert second.cell.device_splits == (1, 2) and set(second.cell.split_modes) == {"pipeline", "fsdp"}
    assert set(second.points) == set(split.points) and second.optimum(30 * MiB) == split.optimum(30 * MiB)


def test_suite_runs_peers_live_on_the_first_cell_and_autofit_live_on_every_cell(tmp_path, monkeypatch):
    from autofit.bench import search

    grid = _grid()
    monkeypatch.setattr(search, "measure_grid", lambda cell, progress: grid)
    monkeypatch.setattr(search, "LiveOracle", lambda workload, budget, progress, label: ReplayOracle(grid, budget))

    def straight(problem, oracle, seed):
        return oracle.run(grid.optimum(problem.budget_bytes).config).config

    sweep = next(s for s in st.PEERS if s.name == "accelerate-x0.5 sweep")
    res = search.run_search_suite(tmp_path, {"date": "today"}, cells=(grid.cell,), seeds=1, live=True,
                                  strategies=(st.Strategy("autofit", straight, st.Criterion.THROUGHPUT, True), sweep))
    live = [(r.strategy, r.budget_bytes // MiB) for r in res.runs if r.mode is BenchMode.LIVE]
    assert live == [("autofit", 50), ("accelerate-x0.5 sweep", 50), ("autofit", 100)]
    text = (tmp_path / "search.md").read_text()
    assert "| synthetic @ 100 MiB | autofit |" in text and "| synthetic @ 100 MiB | - | 100.0% ✓ | 100.0% ✓ |" in text


def test_accuracy_workloads_are_selected_by_parts_of_their_names():
    from autofit.bench.accuracy_cases import (
        HF_WORKLOADS,
        USER_WORKLOADS,
        cases,
        select_workloads,
    )
    from autofit.core.errors import ConfigError

    assert select_workloads(("user_models",)) == USER_WORKLOADS
    assert select_workloads(("hf:gpt2", "mixer")) == (HF_WORKLOADS[0], USER_WORKLOADS[1])
    # Every selected HF decoder and user model is measured at a 2-stage split too.
    for name in select_workloads(("hf:gpt2", "hf:llama", "hf:qwen3", "hf:phi", "hf:gemma", "user_models")):
        assert any(c.device_split == 2 for c in cases(workloads=(name,))[name]), name
    with pytest.raises(ConfigError, match="'nope' matches none"):
        select_workloads(("gpt-tiny", "nope"))


def test_search_cells_are_valid_problems_whose_workloads_load():
    """Every cell builds a Problem every peer variant accepts, and its workload (a file, for one) loads."""
    from autofit.bench.search_cells import CELLS
    from autofit.workloads.load import load_workload

    for cell in CELLS:
        problem = problem_for(cell, cell.budgets_mib[0] * MiB, 0)
        assert finders.USER_PRECISION in problem.precisions and problem.configs()
        load_workload(cell.workload)
    assert any(c.device_splits != (1,) for c in CELLS)
    assert any(c.workload.endswith(".py:workload") for c in CELLS)


def test_ground_truth_samples_until_the_two_best_agree(monkeypatch):
    """Rounds of samples: every config gets three in all; one whose two best still differ by over 2% gets
    more, up to TRUTH_SAMPLES_MAX (six here); a failed sample ends its config's sampling."""
    from autofit.bench import search_grid
    from autofit.bench.search_data import TruthNoise

    monkeypatch.setattr(search_grid, "TRUTH_SAMPLES_MAX", 6)

    steady, noisy, broken = (TrainConfig(Precision.FP32, b, 1) for b in (1, 2, 4))
    draws = {steady: iter([100.0, 99.5]), noisy: iter([60.0, 80.0, 70.0, 90.0, 85.0]), broken: iter([])}
    rounds = []

    def fake_jobs(jobs, job_timeout_s):
        rounds.append(len(jobs))
        outs = []
        for job in jobs:
            value = next(draws[TrainConfig.from_dict(job["config"])], None)
            outs.append({"status": "ok", "samples_per_s": value} if value else {"status": "error"})
        return outs

    monkeypatch.setattr("autofit.bench.worker.run_jobs", fake_jobs)
    first = {steady: 99.0, noisy: 50.0, broken: 10.0}
    extra = search_grid._truth_samples("w", [steady, noisy, broken], first, lambda _m: None)
    assert extra == {steady: [100.0, 99.5], noisy: [60.0, 80.0, 70.0, 90.0, 85.0], broken: []}
    assert rounds == [3, 2, 1, 1, 1]
    point = GridPoint(noisy, "ok", 1, 90.0, 1.0, 1.0, trial_samples_per_s=50.0, second_samples_per_s=60.0,
                      more_samples_per_s=(80.0, 70.0, 90.0, 85.0))
    assert point.samples() == [50.0, 60.0, 80.0, 70.0, 90.0, 85.0]
    assert point.truth_noise() == pytest.approx(1 - 85 / 90)
    noise = TruthNoise.of([Grid(Cell("w", 4, (1,), (Precision.FP32,), (1,)), {noisy: point}, 0.0, 1)])
    assert noise.samples == (6,) and noise.over_target() == 1


def test_time_to_98_follows_the_answer_the_strategy_itself_gives_after_each_trial():
    """autofit's answer after a trial is its study's best (a head-to-head can put a config whose own sample
    read lower first); time to 98% follows that answer, not the highest sample seen."""
    from autofit.bench.scoring import answers_after_each, first_reaching

    grid = _grid()
    budget = 50 * MiB
    best = grid.optimum(budget).config
    other = next(p.config for p in grid.feasible(budget) if grid.fraction(p.config, budget) < 0.9)
    oracle = ReplayOracle(grid, budget)
    grid.points[other] = dataclasses.replace(grid.points[other], trial_samples_per_s=10 * grid.points[best].samples_per_s)
    for config in (other, best, best):
        oracle.run(config)
    by_sample = answers_after_each(st.PEERS[0], oracle)   # no answers said: the highest sample seen
    assert by_sample == [other, other, other] and first_reaching(by_sample, grid, budget, 0.98) is None
    oracle.answers = [other, other, best]                 # what the strategy answered after each trial
    assert first_reaching(answers_after_each(st.PEERS[0], oracle), grid, budget, 0.98) == 2
    oracle.answers = [best]                               # not one per trial: not trusted
    assert answers_after_each(st.PEERS[0], oracle) == by_sample


@pytest.mark.parametrize("warm_use_s", [0.12, None])
def test_a_grids_first_use_costs_read_back_from_its_section_as_written(tmp_path, warm_use_s):
    from autofit.bench.replay import grid_costs
    from autofit.bench.search_tables import _grid_section

    parts = {"profiling": 2.0, "device probe": 0.8, "layer timing": 0.6} if warm_use_s else {}
    grid = dataclasses.replace(_grid(), first_use_s=3.4, warm_use_s=warm_use_s, first_use_parts_s=parts)
    path = tmp_path / "search.md"
    path.write_text("# Search\n\n" + _grid_section(grid) + "\n")
    assert grid_costs(path) == {("synthetic", 8, False): (1.5, 3.4, warm_use_s)}
    assert ("with them warm" in path.read_text()) is (warm_use_s is not None)
    assert ("Its parts, cold: profiling 2.0 s, device probe 0.8 s, layer timing 0.6 s." in path.read_text()) is bool(parts)


def test_sample_spread_reports_one_samples_noise_beside_the_remeasurement_floor():
    """The summary's noise line: larger / smaller - 1 of each config's trial and second sample (configs with
    one sample left out), in quantiles, naming the study's floor it is the evidence for."""
    from autofit.bench.search_data import sample_spreads
    from autofit.bench.summary import spread_text
    from autofit.study.leaders import NOISE_MIN

    configs = [TrainConfig(Precision.FP32, b, 1) for b in (1, 2, 4, 8)]
    pairs = [(100.0, 110.0), (90.0, 60.0), (50.0, 50.0), (70.0, None)]
    points = {c: GridPoint(c, "ok", 1, max(a, b or 0), 1.0, 1.0, trial_samples_per_s=a, second_samples_per_s=b)
              for c, (a, b) in zip(configs, pairs)}
    grid = Grid(Cell("w", 8, (1, 2, 4, 8), (Precision.FP32,), (1,)), points, 0.0, 1)
    assert sample_spreads([grid]) == pytest.approx([0.1, 0.5, 0.0])
    text = spread_text(sample_spreads([grid]))
    assert "over the search grids' 3 configs" in text and "10.0% median" in text and "50.0% at most" in text
    assert f"at least {100 * NOISE_MIN:.0f}%" in text
    assert spread_text([]) == ""


@pytest.mark.parametrize("optimizers", [[], ["adafactor"]])
def test_the_warm_first_use_is_timed_in_a_new_process_as_a_users_next_search(tmp_path, monkeypatch, optimizers):
    """Read back in the process that profiled, a warm first use skips what a new search pays (torch's import of
    torch._dynamo at its first optimizer or fake mode); the bench times it in a new interpreter, with the
    trials' fork server it starts first."""
    from autofit.bench import search_grid
    from autofit.bench.search_data import Cell
    from autofit.estimator.memory_model import optimizer_choices
    from autofit.workloads.load import load_workload

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    cell = Cell("tests/trial_workloads.py:tiny_lm", 4, (2, 4), (Precision.FP32,), (1,), checkpoints=(0,))
    configs = [TrainConfig(Precision.FP32, 2, 2), TrainConfig(Precision.FP32, 4, 1)]
    configs += [TrainConfig(Precision.FP32, 2, 2, optimizer=o) for o in optimizers]
    # as the bench's grid profiles it (a lean cell names the optimizer lever's choices)
    kw = {"split_ends": False, "optimizers": optimizer_choices(configs), "selective": False}
    assert kw["optimizers"] == optimizers
    workload = load_workload(cell.workload)
    search_grid._use_s(cell, workload, configs, kw, use_cache=True)  # fills the caches
    warm = search_grid._warm_use(cell, configs, kw)
    assert set(warm) == {"use_s", "server_ready_s"} and 0 < warm["use_s"] <= warm["server_ready_s"] < 120


def test_a_benchs_header_gives_the_hosts_matmul_rates_when_asked_and_a_replay_does_not_probe():
    """A complete run's tables say how fast the CPU was at its start (the same machine name has read half its
    usual rates on some days); a replay's header, written in seconds from a committed grid, has no probe."""
    import re

    from autofit.bench.common import HOST_SPEED, environment, host_speed

    assert HOST_SPEED not in environment("replay")
    text = environment("autofit bench", probe_host=True)[HOST_SPEED]
    rates = re.fullmatch(r"matmul fp32 (\d+), bf16 (\d+) GFLOP/s \(best of 3 probes\)", text)
    assert rates and all(int(r) > 0 for r in rates.groups()), text
    assert host_speed(probes=0).endswith("(best of 1 probe)")

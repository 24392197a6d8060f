"""The search suite's lean cell: the grid enumerates the lean levers as autofit's space does, the finders
keep the workload's optimizer and full checkpointing, and where only a lean config fits, autofit answers
it while the finders find nothing."""

from __future__ import annotations

import dataclasses

import pytest

from autofit.bench import strategies as st
from autofit.bench.oracles import ReplayOracle
from autofit.bench.problem import Oracle, Outcome
from autofit.bench.scoring import run_strategy
from autofit.bench.search_cells import LEAN_CELLS, problem_for
from autofit.bench.search_data import (
    BenchMode,
    Cell,
    Grid,
    GridPoint,
    MiB,
    SearchResults,
)
from autofit.core.config import (
    CheckpointPolicy,
    OptimizerChoice,
    Precision,
    TrainConfig,
)
from autofit.core.space import SearchSpace

LEAN = (OptimizerChoice.AS_GIVEN, OptimizerChoice.ADAFACTOR, OptimizerChoice.ADAMW8BIT)
POLICIES = (CheckpointPolicy.FULL, CheckpointPolicy.SELECTIVE)
FINDERS = tuple(s for s in st.PEERS if s.run is not st.optuna_tpe)


def _cell(workload: str = "synthetic", budgets_mib: tuple[int, ...] = (20, 1000)) -> Cell:
    return Cell(workload, 4, (1, 2, 4), (Precision.AMP_BF16, Precision.BF16), budgets_mib,
                optimizers=LEAN, checkpoint_policies=POLICIES)


def _peak_mib(c: TrainConfig) -> float:
    """As-given never fits 20 MiB (base 24); another optimizer saves 10, checkpointing halves the activations."""
    base = 24.0 - (10.0 if c.changes_optimizer else 0.0)
    per_sample = 4.0 * (0.5 if c.checkpoint_every else 1.0) * (1.2 if c.checkpoint_policy is CheckpointPolicy.SELECTIVE else 1.0)
    return base + per_sample * c.micro_batch


def _speed(c: TrainConfig) -> float:
    return 10.0 * c.micro_batch / (c.micro_batch + 2) / (1.3 if c.checkpoint_every else 1.0) / (1.1 if c.changes_optimizer else 1.0)


def _grid(cell: Cell, peak_mib=_peak_mib) -> Grid:
    points = {c: GridPoint(c, "ok", int(peak_mib(c) * MiB), _speed(c), c.samples_per_step / _speed(c), 2.0,
                           peak_mib(c) * MiB, trial_samples_per_s=_speed(c), second_samples_per_s=_speed(c))
              for c in problem_for(cell, 1, 0).configs()}
    return Grid(cell, points, oom_floor_s=1.0, param_count=0)


def test_problem_enumerates_the_lean_levers_as_autofits_space_does():
    problem = problem_for(_cell(), 20 * MiB, 0)
    space = SearchSpace(precision=problem.precisions, micro_batch=problem.micro_batches,
                        checkpoint_every=problem.checkpoints, optimizer=LEAN, checkpoint_policy=POLICIES, global_batch=4)
    # no checkpointing is listed once, as full: 2 precisions x 3 micro-batches x 3 optimizers x (1 + 2)
    assert problem.configs() == space.configs() and len(problem.configs()) == 2 * 3 * 3 * 3
    # the peers' config keeps the workload's optimizer and full checkpointing
    assert problem.config(2, "bf16", 1) == TrainConfig(Precision.BF16, 2, 2, 1)
    with pytest.raises(ValueError, match="as-given"):
        dataclasses.replace(problem, optimizers=(OptimizerChoice.ADAFACTOR,))


def test_the_lean_cell_is_a_valid_problem_with_a_budget_only_lean_configs_fit():
    cell = LEAN_CELLS[0]
    problem = problem_for(cell, cell.budgets_mib[0] * MiB, 0)
    assert cell.lean and len(problem.configs()) == 2 * 5 * 3 * 3
    assert any(c.changes_optimizer for c in problem.configs())
    assert any(c.checkpoint_policy is CheckpointPolicy.SELECTIVE for c in problem.configs())


def test_the_selective_cell_keeps_the_workloads_optimizer_and_offers_the_selective_policy():
    cell = LEAN_CELLS[1]
    problem = problem_for(cell, cell.budgets_mib[0] * MiB, 0)
    # 2 precisions x 3 micro-batches x (no checkpointing + full + selective)
    assert cell.lean and len(problem.configs()) == 2 * 3 * 3
    assert not any(c.changes_optimizer for c in problem.configs())
    assert any(c.checkpoint_policy is CheckpointPolicy.SELECTIVE for c in problem.configs())


class _Synthetic(Oracle):
    def __init__(self, budget_bytes: int) -> None:
        super().__init__()
        self.budget_bytes = budget_bytes

    def _run(self, c: TrainConfig, memory: bool = True) -> Outcome:
        peak = _peak_mib(c) * MiB
        if peak > self.budget_bytes:
            return Outcome(c, "oom", None, None, 1.0)
        return Outcome(c, "ok", _speed(c), int(peak), 2.0)


@pytest.mark.parametrize("budget_mib", [20, 40, 1000])
def test_finders_never_change_the_optimizer_or_the_checkpoint_policy(budget_mib):
    problem = problem_for(_cell(), budget_mib * MiB, 0)
    for finder in FINDERS:
        oracle = _Synthetic(problem.budget_bytes)
        answer = finder(problem, oracle, 0)
        ran = [r.outcome.config for r in oracle.history] + ([answer] if answer else [])
        assert ran and all(not c.changes_optimizer and c.checkpoint_policy is CheckpointPolicy.FULL for c in ran), \
            finder.name


def test_tpe_searches_the_lean_levers_within_the_grid():
    problem = problem_for(_cell(), 20 * MiB, 0)
    oracle = _Synthetic(problem.budget_bytes)
    answer = st.optuna_tpe(problem, oracle, 0, real_trials=30)
    ran = [r.outcome.config for r in oracle.history]
    assert set(ran) <= set(problem.configs()) and any(c.changes_optimizer for c in ran)
    assert answer is not None and answer.changes_optimizer


def test_replay_where_only_a_lean_config_fits_scores_the_finders_zero():
    grid = _grid(_cell())
    budget = 20 * MiB
    best = grid.optimum(budget)
    assert best.config.changes_optimizer
    assert dict(grid.lever_margins(budget))["another optimizer"] is None   # nothing fits without it
    for finder in FINDERS:
        res = run_strategy(finder, grid, budget, 0, ReplayOracle(grid, budget), BenchMode.REPLAY)
        assert res.fraction == 0.0, finder.name


def test_lean_grid_round_trips_through_search_grid_csv_beside_a_plain_cell_of_the_workload(tmp_path):
    from autofit.bench.common import environment
    from autofit.bench.replay import load_grids
    from autofit.bench.search_tables import write_search

    plain_cell = dataclasses.replace(_cell(budgets_mib=(60,)), optimizers=(OptimizerChoice.AS_GIVEN,),
                                     checkpoint_policies=(CheckpointPolicy.FULL,))
    plain, lean = _grid(plain_cell), _grid(_cell())
    halving = FINDERS[0]
    runs = [run_strategy(halving, g, b * MiB, 0, ReplayOracle(g, b * MiB), BenchMode.REPLAY)
            for g in (plain, lean) for b in g.cell.budgets_mib]
    write_search(tmp_path, environment("test"), SearchResults([plain, lean], runs, ("synthetic", 60 * MiB), 1, 0.0),
                 (halving,))
    first, second = load_grids(tmp_path / "search_grid.csv")
    assert first.cell.budgets_mib == (60,) and not first.cell.lean and set(first.points) == set(plain.points)
    assert second.cell.budgets_mib == (20, 1000) and second.cell.optimizers == LEAN
    assert second.cell.checkpoint_policies == POLICIES and set(second.points) == set(lean.points)
    assert second.optimum(20 * MiB) == lean.optimum(20 * MiB) and second.oom_floor_s == 1.0


@pytest.mark.slow
def test_autofit_answers_the_lean_config_where_the_finders_find_nothing():
    """gpt-tiny's grid at its estimated peaks (the estimate is exact on it here): at 24 MiB no config with
    its own AdamW fits (the smallest, bf16 mb=1 ckpt=1, is 25.3 MiB); autofit's search finds a lean one."""
    from autofit.bench.own_search import AUTOFIT
    from autofit.estimator.memory_model import estimate_table, optimizer_choices
    from autofit.profiling.profile import profile_workload
    from autofit.workloads.load import load_workload

    cell = _cell("gpt-tiny", (24,))
    configs = problem_for(cell, 1, 0).configs()
    profile = profile_workload(load_workload("gpt-tiny"), list(cell.precisions), device_type="cpu",
                               split_ends=False, optimizers=optimizer_choices(configs))
    estimated = dict(zip(configs, estimate_table(profile, configs)["peak_bytes"].tolist()))
    grid = _grid(cell, lambda c: estimated[c] / MiB)
    budget = 24 * MiB
    assert not [p for p in grid.feasible(budget) if not p.config.changes_optimizer]
    res = run_strategy(AUTOFIT, grid, budget, 0, ReplayOracle(grid, budget), BenchMode.REPLAY)
    assert res.error is None and res.answer is not None and res.answer.changes_optimizer and res.fraction > 0.9
    for finder in FINDERS:
        assert run_strategy(finder, grid, budget, 0, ReplayOracle(grid, budget), BenchMode.REPLAY).fraction == 0.0


@pytest.mark.parametrize("suite", ["cost", "steady"])
def test_lean_is_refused_with_a_suite_that_has_no_lean_part_in_one_line(capsys, tmp_path, suite):
    from autofit.cli import main

    assert main(["bench", "--suite", suite, "--lean", "--out", str(tmp_path / "b")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autofit: error: ") and "--lean" in lines[0]
    assert not (tmp_path / "b").exists()


def test_after_table_names_replayed_and_live_stops_apart():
    """A live run that stopped otherwise than its replays is said as such, never run together with them."""
    from autofit.bench.search_data import BenchMode
    from autofit.bench.search_tables import _after_table

    text = _after_table({BenchMode.REPLAY: ["stopped: exhausted; then 2 re-measurements"],
                         BenchMode.LIVE: ["stopped: exhausted"]}, "time text")
    assert text == ("\n\nautofit replay stopped: exhausted; then 2 re-measurements. "
                    "autofit live stopped: exhausted. time text")
    both = _after_table({BenchMode.REPLAY: ["stopped: a", "stopped: b"], BenchMode.LIVE: []}, "")
    assert both == "\n\nautofit replays stopped: a; stopped: b."
    assert _after_table({BenchMode.REPLAY: [], BenchMode.LIVE: []}, "") == ""

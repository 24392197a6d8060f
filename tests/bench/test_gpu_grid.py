"""A grid measured on another device (scripts/gpu_grid.py): its device travels through search_grid.csv into the
replay's problem, its budgets come from the measured peaks, and its truth samples stop at a time box."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pandas as pd

from autofit.bench import search_grid
from autofit.bench.replay import load_grids
from autofit.bench.search_cells import problem_for
from autofit.bench.search_data import Cell, Grid, GridPoint, MiB
from autofit.bench.search_tables import _grid_rows
from autofit.core.config import Precision, TrainConfig
from autofit.core.records import TrialStatus

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_grid.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_grid_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _grid(device: str, peaks_mib: list[int]) -> Grid:
    cell = Cell("gpt-tiny", 4, (1, 2, 4), (Precision.BF16,), (64,), checkpoints=(0, 1), device=device)
    configs = [TrainConfig(Precision.BF16, mb, 4 // mb, ck) for mb in (1, 2, 4) for ck in (0, 1)]
    points = {c: GridPoint(c, TrialStatus.OK, mib * MiB, 10.0 + i, 0.1, 1.0, None, None, 10.0 + i, 9.0 + i)
              for i, (c, mib) in enumerate(zip(configs, peaks_mib))}
    return Grid(cell, points, 0.5, 1000)


def test_the_grid_device_travels_through_the_csv_into_the_problem(tmp_path):
    path = tmp_path / "search_grid.csv"
    pd.DataFrame(_grid_rows([_grid("cuda", [10, 20, 30, 40, 50, 60])])).to_csv(path, index=False)
    (grid,) = load_grids(path)
    assert grid.cell.device == "cuda"
    assert problem_for(grid.cell, 64 * MiB, 1000).device == "cuda"
    # a grid written before the column was measured on the CPU
    pd.read_csv(path).drop(columns=["device"]).to_csv(path, index=False)
    assert load_grids(path)[0].cell.device == "cpu"


def test_budgets_are_the_card_peaks_at_a_third_and_two_thirds_of_the_configs_that_ran():
    assert _script().budgets_from(_grid("cuda", [60, 10, 50, 20, 40, 30])) == (30, 50)


def test_truth_samples_stop_at_the_time_box(monkeypatch):
    def no_round(*_a):
        raise AssertionError("a round ran past the time box")

    monkeypatch.setattr(search_grid, "_sample_round", no_round)
    lines: list[str] = []
    config = TrainConfig(Precision.BF16, 1, 4, 0)
    extra = search_grid._truth_samples("gpt-tiny", [config], {config: 5.0}, lines.append, "cuda",
                                       until=time.monotonic() - 1)
    assert extra == {config: []} and "time box" in lines[0]

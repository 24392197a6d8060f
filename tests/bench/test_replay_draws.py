"""Replays on other draws of the noise: each config's samples in a random order (autofit.bench.replay.shuffled)."""

from __future__ import annotations

import pytest

from autofit.bench import finders
from autofit.bench import strategies as st
from autofit.bench.replay import draws_table, main, shuffled
from autofit.bench.search_data import Cell, Grid, GridPoint
from autofit.core.config import Precision, TrainConfig

HALVING = st.Strategy("accelerate-x0.5", finders.accelerate_halving, st.Criterion.LARGEST, True)


def _grid() -> Grid:
    cell = Cell("synthetic", 4, (2, 4), (Precision.FP32,), (50,))
    small, big = TrainConfig(Precision.FP32, 2, 2), TrainConfig(Precision.FP32, 4, 1)
    points = {
        small: GridPoint(small, "ok", 10 * 2**20, 12.0, 0.3, 2.0, trial_samples_per_s=9.0, second_samples_per_s=12.0,
                         more_samples_per_s=(11.0, 10.0)),
        big: GridPoint(big, "oom", None, None, None, 0.5),
    }
    return Grid(cell, points, oom_floor_s=0.5, param_count=0)


def test_a_draw_reorders_each_configs_samples_and_keeps_its_truth():
    grid = _grid()
    small, big = grid.points
    orders = {tuple(shuffled([grid], draw)[0].points[small].samples()) for draw in range(20)}
    assert len(orders) > 1 and all(sorted(order) == [9.0, 10.0, 11.0, 12.0] for order in orders)
    drawn = shuffled([grid], 3)[0]
    assert drawn.points[small].samples() == shuffled([grid], 3)[0].points[small].samples()  # seeded by the draw
    assert drawn.points[small].samples_per_s == 12.0 and drawn.points[big] == grid.points[big]
    assert grid.points[small].samples() == [9.0, 12.0, 11.0, 10.0]  # the grid itself is left as it was


def test_the_draws_table_counts_every_search_once_per_draw():
    table = draws_table([_grid()], (HALVING,), 3)
    row = table.splitlines()[-1].split(" | ")
    assert row[0] == "| accelerate-x0.5" and row[1] == "3" and row[4] == "0"  # 3 searches, none under 98%


@pytest.mark.parametrize("extra, named", [
    (["--out", "somewhere"], "--out"),
    (["--swap-samples"], "--swap-samples"),
    (["--done-when", "--swap-samples"], "--swap-samples, --done-when"),
])
def test_draws_with_an_option_it_would_ignore_is_a_one_line_error(capsys, extra, named):
    with pytest.raises(SystemExit) as stop:
        main(["no-such-grid.csv", "--draws", "2", *extra])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"error: --draws prints its totals only: drop {named}")


def test_negative_draws_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["no-such-grid.csv", "--draws", "-1"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().endswith("error: --draws must be 0 or more")

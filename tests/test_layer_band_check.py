"""scripts/layer_band_check.py: the configs it ranks and its rank correlation (the timing itself is the probe's)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("layer_band_check_under_test", ROOT / "scripts" / "layer_band_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_rank_correlation_is_spearmans(check):
    assert check.rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert check.rank_correlation([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert check.rank_correlation([1, 2, 3, 100], [1, 2, 3, 4]) == pytest.approx(1.0)  # ranks, not values


def test_only_single_device_configs_with_the_lever_defaults_are_ranked(check):
    grid = pd.read_csv(ROOT / check.GRID)
    rows = check.grid_rows(grid, "gpt-tiny")
    assert len(rows) > 10 and set(rows.status) == {"ok"} and set(rows.device_split) == {1}
    assert set(rows.optimizer) == {"as-given"} and set(rows.checkpoint_policy) == {"full"}
    assert check.grid_rows(grid, "no-such-model").empty

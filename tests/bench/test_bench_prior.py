"""The accuracy suite's time-model-prior table: errors summarised per prior from per-config rows."""

from __future__ import annotations

import pytest

from autofit.bench.prior import PRIOR, overall, prior_section, summary


def _row(prior, predicted, measured, workload="w"):
    return {"workload": workload, "config": "c", "prior": prior, "predicted_step_time_s": predicted,
            "measured_step_time_s": measured, "relative_error": (predicted - measured) / measured if measured else None,
            "layer_probe_s": 1.5 if prior == PRIOR.layer else None, "layer_scales": ""}


def test_prior_errors_are_summarised_per_prior_and_unmeasured_configs_left_out():
    rows = [_row(PRIOR.bare, 0.5, 1.0), _row(PRIOR.bare, 0.8, 1.0), _row(PRIOR.bare, 1.0, None),
            _row(PRIOR.layer, 1.1, 1.0), _row(PRIOR.layer, 0.7, 1.0, workload="v")]
    bare = summary(rows, PRIOR.bare)
    assert bare["configs"] == 2 and bare["median_abs_error"] == pytest.approx(0.35)
    assert bare["max_abs_error"] == pytest.approx(0.5) and bare["mean_signed_error"] == pytest.approx(-0.35)
    assert overall(rows, PRIOR.layer) == pytest.approx((0.2, 0.3))
    assert summary(rows, PRIOR.layer, "v")["configs"] == 1
    text = prior_section(rows)
    assert "median 35.0%, max 50.0%" in text and text.count("| w |") == 2

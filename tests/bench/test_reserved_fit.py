"""The CUDA reserve the estimate adds comes from the committed H200 measurements, and is checked held out."""

from __future__ import annotations

from autofit.bench import reserved_fit
from autofit.estimator.reserved_model import FITTED


def test_the_estimates_constants_are_the_fit_of_the_committed_measurements():
    model, text = reserved_fit.report(reserved_fit.load_rows())
    assert model == FITTED
    # The committed table is this command's output, unedited.
    assert (reserved_fit.GPU_DIR / "reserved_model.md").read_text() == text


def test_held_out_the_estimate_covers_the_card_in_at_least_95_percent_of_configs():
    rows = reserved_fit.load_rows()
    held = rows[~rows.workload.isin(reserved_fit.FIT_WORKLOADS)]
    assert len(held) >= 20 and set(held.workload).isdisjoint(reserved_fit.FIT_WORKLOADS)
    s = reserved_fit.scores(reserved_fit.predict(FITTED, held), held)
    assert s["under"] <= 0.05 * s["rows"]
    assert s["max_abs"] < 0.08


def test_the_fitted_margin_is_the_smallest_that_covers_95_percent():
    rows = reserved_fit.load_rows()
    train = rows[rows.workload.isin(reserved_fit.FIT_WORKLOADS)]
    model = reserved_fit.fit(train)
    covered = (reserved_fit.predict(model, train) >= train.card_bytes).mean()
    assert covered >= 0.95
    if model.margin_bytes:
        less = type(model)(model.fixed_bytes, model.fragmentation, model.checkpoint_fragmentation,
                           model.margin_bytes - reserved_fit.MiB)
        assert (reserved_fit.predict(less, train) >= train.card_bytes).mean() < 0.95

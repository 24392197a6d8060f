"""A region's highest point at any micro-batch: the max of its operators' lines, kept as the upper
envelope of those lines (:func:`autofit.profiling.assemble._envelope`)."""

from __future__ import annotations

import numpy as np

from autofit.profiling.assemble import _envelope, _region_lines
from autofit.profiling.data import PROFILE_BATCHES
from autofit.profiling.raw import RawRegion


def _points(lines: list[tuple[float, float]], b: int) -> list[int]:
    return [int(c0 + c1 * b) for c0, c1 in lines]


# Live bytes after each operator as lines in the micro-batch: flat (gradients), two per-sample
# ones, and one below them all.
LINES = [(2000.0, 0.0), (1000.0, 250.0), (0.0, 400.0), (100.0, 50.0)]


def _region() -> RawRegion:
    b1, b2 = PROFILE_BATCHES
    p1, p2 = _points(LINES, b1), _points(LINES, b2)
    return RawRegion(0, max(p1), 0, max(p1), p1, p1), RawRegion(0, max(p2), 0, max(p2), p2, p2)


def test_the_envelope_holds_every_line_that_is_highest_somewhere_from_micro_batch_one():
    r1, r2 = _region()
    assert _envelope(r1.points, r2.points) == ((2000.0, 0.0), (1000.0, 250.0), (0.0, 400.0))


def test_the_region_peaks_match_the_operators_highest_at_every_micro_batch():
    region = _region_lines(*_region())
    for b in range(1, 65):
        truth = max(c0 + c1 * b for c0, c1 in LINES)
        assert max(c0 + c1 * b for c0, c1 in region.peaks) == truth
    # the line through the profiled peaks (flat: 2000 at 2 and 4) and the steepest line alone miss the
    # middle one, highest from 4 to 6.7
    assert max(c0 + c1 * 6 for c0, c1 in (region.peak, region.steep)) == 2400 < 2500
    assert any(np.allclose(line, (1000.0, 250.0)) for line in region.peaks)


def test_runs_whose_operators_do_not_pair_up_keep_the_fitted_peak():
    assert _envelope([1, 2, 3], [1, 2]) == ()

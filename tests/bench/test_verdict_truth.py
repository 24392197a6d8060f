"""A replayed answer under 98% is explained by the grid's ground truth: both configs' truths, how many
samples each is the best of, and whether the shortfall lies within the truth's own noise."""

from __future__ import annotations

from autofit.bench.search_data import BenchMode, Cell, Grid, GridPoint, RunResult
from autofit.bench.verdict import AUTOFIT_NAME, CHECK, cell_verdict
from autofit.core.config import Precision, TrainConfig

MiB = 2**20
BEST, NEAR, FAR = (TrainConfig(Precision.BF16, mb, 8 // mb) for mb in (2, 4, 8))


def _grid(best_samples: tuple[float, ...]) -> Grid:
    def point(c, samples):
        return GridPoint(c, "ok", 10 * MiB, max(samples), 0.1, 1.0, trial_samples_per_s=samples[0],
                         second_samples_per_s=samples[1], more_samples_per_s=samples[2:])

    points = {BEST: point(BEST, best_samples), NEAR: point(NEAR, (95.0, 80.0, 90.0)),
              FAR: point(FAR, (80.0, 79.0, 60.0))}
    return Grid(Cell("synthetic", 8, (2, 4, 8), (Precision.BF16,), (50,)), points, oom_floor_s=0.5, param_count=0)


def _note(grid: Grid, answer: TrainConfig) -> str:
    run = RunResult(AUTOFIT_NAME, "synthetic", 50 * MiB, 0, BenchMode.REPLAY, answer,
                    grid.points[answer].samples_per_s / grid.optimum(50 * MiB).samples_per_s, 10.0, 3, 0, 0, None)
    verdict = cell_verdict([run], "synthetic", 50 * MiB, (), grid)
    assert verdict.checks[CHECK.answer] is False
    [note] = [n for n in verdict.notes if n.startswith("replayed answers under 98%")]
    return note


def test_a_shortfall_within_the_truths_own_noise_is_said_to_be():
    # the optimum's two best samples are 10% apart: 95 against 100 is within that
    note = _note(_grid((100.0, 90.0, 70.0)), NEAR)
    assert note == ("replayed answers under 98%: `bf16 mb=4 ga=2 ckpt=0 split=1` (ground truth: "
                    "`bf16 mb=4 ga=2 ckpt=0 split=1` 95.0 samples/s, the best of 3 samples (its two best 5.3% apart) "
                    "against the optimum `bf16 mb=2 ga=4 ckpt=0 split=1` 100.0 samples/s, the best of 3 samples "
                    "(its two best 10.0% apart); a shortfall within the truth's own noise there)")


def test_a_shortfall_beyond_the_truths_own_noise_is_the_searchs():
    note = _note(_grid((100.0, 99.0, 70.0)), FAR)
    assert note.endswith("`bf16 mb=8 ga=1 ckpt=0 split=1` 80.0 samples/s, the best of 3 samples (its two best 1.2% "
                         "apart) against the optimum `bf16 mb=2 ga=4 ckpt=0 split=1` 100.0 samples/s, the best of 3 "
                         "samples (its two best 1.0% apart))")
    assert "within the truth's own noise" not in note


def _live_note(grid: Grid, answer: TrainConfig, samples: list[tuple[TrainConfig, float]]) -> str:
    from autofit.bench.problem import OracleRecord, Outcome

    history = [OracleRecord(Outcome(c, "ok", s, 10 * MiB, 1.0), float(i)) for i, (c, s) in enumerate(samples)]
    fraction = grid.points[answer].samples_per_s / grid.optimum(50 * MiB).samples_per_s
    live = RunResult(AUTOFIT_NAME, "synthetic", 50 * MiB, 0, BenchMode.LIVE, answer, fraction, 10.0,
                     len(history), 0, 0, None, history=history)
    replayed = RunResult(AUTOFIT_NAME, "synthetic", 50 * MiB, 0, BenchMode.REPLAY, BEST, 1.0, 10.0, 3, 0, 0, None)
    verdict = cell_verdict([live, replayed], "synthetic", 50 * MiB, (), grid)
    assert verdict.checks[CHECK.live] is False
    [note] = [n for n in verdict.notes if n.startswith("live answer")]
    return note


def test_a_live_miss_gives_the_live_samples_of_the_answer_and_the_optimum_by_their_best():
    # the answer's first sample (70) is not the figure the search ranked it by (96)
    note = _live_note(_grid((100.0, 99.0, 98.0)), FAR, [(BEST, 94.0), (FAR, 70.0), (BEST, 90.0), (FAR, 96.0)])
    assert ("; live it read 96.0 samples/s (the best of 2 sample(s)) against the optimum "
            "`bf16 mb=2 ga=4 ckpt=0 split=1`'s 94.0 (the best of 2): live the answer read 2.1% faster, where "
            "the grid's truth has it 20.0% slower;") in note


def test_a_live_miss_that_never_ran_the_optimum_says_so():
    note = _live_note(_grid((100.0, 99.0, 98.0)), FAR, [(FAR, 80.0)])
    assert "live it read 80.0 samples/s (the best of 1 sample(s)), and it never ran the optimum" in note

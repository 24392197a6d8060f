"""Which leaders are measured again: the rules of autofit.study.leaders on hand-made records (no profile)."""

from __future__ import annotations

from autofit.core.config import TrainConfig
from autofit.core.records import TrialRecord, TrialStatus, config_samples
from autofit.study.leaders import NOISE_MIN, TIED_SAMPLES, remeasurements, undecided

A, B, C = TrainConfig("fp32", 8, 1), TrainConfig("amp-bf16", 8, 1), TrainConfig("bf16", 8, 1)
INDEX = {A: 0, B: 1, C: 2}


def _trials(*samples: tuple[TrainConfig, float]) -> list[TrialRecord]:
    """One ok trial per (config, samples/s), numbered in order, each config's samples counted up."""
    seen: dict[TrainConfig, int] = {}
    out = []
    for number, (config, value) in enumerate(samples):
        seen[config] = seen.get(config, 0) + 1
        out.append(TrialRecord(number, config, TrialStatus.OK, value=value, sample=seen[config],
                               measurement={"samples_per_s": value},
                               constraints={"peak_over_budget_bytes": -1.0, "failed": 0.0}))
    return out


def _due(trials, predicted=None) -> list[tuple[int, int]]:
    return remeasurements(trials, config_samples(trials), INDEX, predicted)


def test_a_config_read_low_once_where_the_model_ranks_it_first_is_measured_again():
    """B's one sample, raised by the noise floor, does not reach A's; its calibrated prediction does, so the
    model and the sample disagree and a second sample of each settles it. The prediction never ranks it."""
    low = 0.9 * 100.0 / (1 + NOISE_MIN)
    trials = _trials((A, 100.0), (B, low))
    assert _due(trials) == []                                  # a leader alone
    assert _due(trials, {A: 100.0, B: low}) == []              # the model agrees with the sample: A alone
    assert _due(trials, {A: 100.0, B: 105.0}) == [(0, 2), (1, 2)]
    # measured twice, B stands on its samples: the prediction no longer makes it a leader
    assert _due(_trials((A, 100.0), (B, low), (B, low)), {A: 100.0, B: 105.0}) == []


def test_the_top_two_get_a_third_sample_while_their_own_noise_leaves_the_order_open():
    # A's samples differ by 8.7%, more than the 3.1% between A's best and B's: a third sample of each
    open_ = _trials((A, 100.0), (B, 97.0), (A, 92.0), (B, 96.0))
    assert undecided(config_samples(open_)[A], config_samples(open_)[B])
    assert _due(open_) == [(0, 3), (1, 3)]
    # at TIED_SAMPLES each the order stands, open or not
    third = open_ + [TrialRecord(4 + k, c, TrialStatus.OK, value=v, sample=TIED_SAMPLES,
                                 measurement={"samples_per_s": v},
                                 constraints={"peak_over_budget_bytes": -1.0, "failed": 0.0})
                     for k, (c, v) in enumerate([(A, 93.0), (B, 96.5)])]
    assert _due(third) == []
    # each config's own samples agree within 1%, and the two differ by 5%: decided after two
    decided = _trials((A, 100.0), (B, 95.0), (A, 99.0), (B, 94.5))
    assert not undecided(config_samples(decided)[A], config_samples(decided)[B])
    assert _due(decided) == []


def test_a_third_config_within_the_noise_does_not_hold_the_top_two_open():
    """Only the top two are settled further: C, within the noise band of A but third, keeps its two samples."""
    trials = _trials((A, 100.0), (B, 99.0), (C, 98.0), (A, 99.5), (B, 98.8), (C, 90.0))
    assert not undecided(config_samples(trials)[A], config_samples(trials)[B])
    assert _due(trials) == []


def test_leaders_of_one_build_are_each_measured_in_a_trial_of_their_own():
    """Two micro-batches of one build (precision, checkpointing, optimizer, offload) within the noise: each
    gets a second trial of its own, as a training run has its process to itself, never one head-to-head."""
    small, large = TrainConfig("bf16", 32, 2), TrainConfig("bf16", 64, 1)
    assert small.build == large.build
    trials = _trials((large, 126.0), (small, 128.0))
    assert remeasurements(trials, config_samples(trials), {small: 0, large: 1}) == [(0, 2), (1, 2)]


def test_a_challenger_read_once_is_judged_against_the_leaders_first_sample_not_its_best_of_two():
    """The live bench's gpt-tiny at 64 MiB: B (the true best) read 92.2 once, A 99.2 and then 115.8. Against
    A's best of two B is outside the noise band, but the best of two reads higher by its count alone: against
    A's first sample B is within it, so B gets its second sample before the best is crowned."""
    trials = _trials((B, 92.2), (A, 99.2))
    assert _due(trials) == [(0, 2), (1, 2)]
    after = _trials((B, 92.2), (A, 99.2), (A, 115.8))
    assert 92.2 * (1 + NOISE_MIN) < 115.8  # the old bar: B dropped
    assert _due(after) == [(1, 2)]
    # with its second sample, B is judged against A's best of two
    assert _due(_trials((B, 92.2), (A, 99.2), (A, 115.8), (B, 93.0))) == []


def test_a_challenger_the_noise_lifts_only_within_min_improvement_of_the_best_is_not_measured_again():
    """Raised by the noise, B's one sample reaches A's but beats it by less than the study's min_improvement:
    a gain that small is noise, and answering A is within it of B however B's next sample reads. Lifted
    past it, B is a leader again."""
    within = 100.0 * 1.01 / (1 + NOISE_MIN)
    trials = _trials((A, 100.0), (B, within))
    assert _due(trials) == [(0, 2), (1, 2)]                    # no min_improvement: within the noise
    assert remeasurements(trials, config_samples(trials), INDEX, None, 0.02) == []
    past = 100.0 * 1.03 / (1 + NOISE_MIN)
    trials = _trials((A, 100.0), (B, past))
    assert remeasurements(trials, config_samples(trials), INDEX, None, 0.02) == [(0, 2), (1, 2)]

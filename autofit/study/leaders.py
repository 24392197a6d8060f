"""Which leaders are measured again before the best is crowned, and how: the planner's re-measurement rules.

One throughput sample is noisy, so before the best is crowned the configs whose noise bands overlap
the best's are measured again, each in a trial of its own, and the top two once more while their own
samples leave their order open.

Every sample is a trial of its own, as the user's training runs one config in a process. Timed head to
head in one process, two configs of one build read closer than they train: on gpt-tiny, bf16
micro-batch 32 x 2 over 64 x 1 had a median ratio of 0.930 in separate trials and 0.992 head to head
(``scripts/head_to_head_spread.py``, 14 rounds), and a search that timed its leaders head to head then
answered the slower one (docs/facts.md#throughput-noise).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from autofit.core.config import TrainConfig
from autofit.core.records import (
    TrialRecord,
    TrialStatus,
    best_sample,
    reach,
)

# Before the best is crowned, the leaders are measured again: one throughput sample is noisy. On
# the committed CPU grids (results/benchmarks/summary.md, "One throughput sample's noise": each
# config's trial sample and the next) two samples of one config differ by 5.1% in the median and 13.9%
# at the 90th percentile on a quiet day (129 configs), 7.3% and 24.5% on a noisier one
# (docs/facts.md#throughput-noise), so a slow first sample of the true best can leave it third or
# fourth among the leaders:
REMEASURE_TOP = 4          # the configs with the highest best sample that may be re-measured...
REMEASURE_SAMPLES = 2      # ...each brought to this many samples; the best is the highest best sample
NOISE_MIN = 0.14           # a leader is re-measured if its best sample, raised by the noise, reaches the best's;
#                            the noise: the largest spread between two samples of a config so far, at
#                            least this (the quiet day's 90th percentile). On a noisier day the study's
#                            own spreads raise it; replayed on both days' grids, a floor of 0.25 answered
#                            no better and re-measured more (docs/facts.md#throughput-noise)
TIED_SAMPLES = 3           # the top two leaders, while their samples leave their order open (undecided)
REMEASURE_MAX = 2 * REMEASURE_TOP * (REMEASURE_SAMPLES - 1)  # re-measurements in a study at most


def sample_noise(by_config: dict) -> float:
    """The measured sample-to-sample noise of throughput: the largest relative spread (max / min - 1)
    between the samples of one config (``by_config``: :func:`autofit.core.records.config_samples`), at
    least NOISE_MIN (before any config has two samples, it is NOISE_MIN)."""
    spreads = [_spread([r.value for r in s]) for s in by_config.values() if len(s) > 1]
    return max([NOISE_MIN] + [x for x in spreads if x is not None])


def _spread(values: Sequence[float]) -> float | None:
    """The relative spread of one config's samples, max / min - 1 (None when one is not positive)."""
    return max(values) / min(values) - 1.0 if min(values) > 0 else None


def remeasurements(records: Sequence[TrialRecord], by_config: dict, index: dict,
                   predicted: Mapping[TrainConfig, float] | None = None,
                   min_improvement: float = 0.0) -> list[tuple[int, int]]:
    """The re-measurements still due before the best is crowned, in the order they run: each a trial of
    its own, as (config index in ``index``, sample number); only where the leaders' noise
    bands overlap. The leaders are the best config and those whose best sample's :func:`reach`, raised by
    :func:`sample_noise`, beats the best config's figure by ``min_improvement`` (the study's: a smaller
    gain is noise, and the answer is then within it of the faster; up to REMEASURE_TOP of them, highest
    figure first); a leader alone is not measured again: nothing within the noise could overtake it. Each
    leader is brought to REMEASURE_SAMPLES samples, so a slow first sample gets its second chance.
    Running ones count (another worker has them).

    ``predicted``: each config's calibrated predicted figure now. A config measured once is a leader
    also when its prediction, raised by the noise, reaches the best: the model and its one sample
    disagree, and a second sample settles which was wrong (the prediction never ranks it). Once every
    leader has its samples, the top two are brought to TIED_SAMPLES each while they are
    :func:`undecided`."""
    claimed = [r for r in records if r.claimed and r.config in index]
    if sum(r.sample > 1 for r in claimed) >= REMEASURE_MAX or not by_config:
        return []
    ranked = sorted(by_config.items(), key=lambda kv: (-best_sample(kv[1]).value, kv[1][0].number))
    noise, predicted = sample_noise(by_config), predicted or {}

    def figure(config: TrainConfig, done: Sequence[TrialRecord]) -> float:
        measured = reach(best_sample(done))
        return max(measured, predicted.get(config, 0.0)) if len(done) == 1 else measured

    best, bar = ranked[0][1], 1 + min_improvement
    leaders = [c for c, done in ranked
               if done is best or figure(c, done) * (1 + noise) >= fair_bar(best, len(done)) * bar][:REMEASURE_TOP]
    if len(leaders) < 2:
        return []
    due = []
    for config in leaders:
        mine = [r for r in claimed if r.config == config]
        running = sum(r.status is TrialStatus.RUNNING for r in mine)
        if len(by_config[config]) + running < REMEASURE_SAMPLES:
            due.append((index[config], 1 + max(r.sample for r in mine)))
    if due or any(r.status is TrialStatus.RUNNING for r in claimed):
        return due
    return _settle(claimed, [(c, by_config[c]) for c, _ in ranked[:2] if c in leaders], index)


def fair_bar(best: Sequence[TrialRecord], samples: int) -> float:
    """What a config measured ``samples`` times must come within the noise of to lead: the best config's
    (``best``, in trial order) highest figure over as many of its samples (a starved sample's reach only
    raises challengers to it, so the bar is the objective). The best of more samples reads higher by their
    count alone: against the best config's figure after its re-measurement, a challenger read once was
    dropped before its second sample (live, gpt-tiny at 64 MiB: 92.2 against 99.2 was within the noise;
    against 115.8 after the leader's second sample, it was not, and the slower config was answered)."""
    return max(r.value for r in best[:max(samples, 1)])


def undecided(first: Sequence[TrialRecord], second: Sequence[TrialRecord]) -> bool:
    """Whether two configs' samples leave their order open: the gap between their best samples is
    smaller than the spread between either one's own samples (that config's noise, as measured here)."""
    a, b = reach(best_sample(first)), reach(best_sample(second))
    if min(len(first), len(second)) < 2 or min(a, b) <= 0:
        return False
    spreads = [_spread([reach(r) for r in samples]) for samples in (first, second)]
    return max(a, b) / min(a, b) - 1.0 < max(math.inf if x is None else x for x in spreads)


def _settle(claimed: list[TrialRecord], top: list[tuple[TrainConfig, Sequence[TrialRecord]]],
            index: dict) -> list[tuple[int, int]]:
    """One more sample of each of the top two leaders (``top``, best first), up to TIED_SAMPLES each,
    while :func:`undecided`. Replayed on the CPU grid of the bench at 90d8b79, two samples each left a
    config 2.5-2.7% below the best as the answer in 2 of 14 cells; a third settled both (docs/search.md)."""
    if len(top) < 2 or not undecided(top[0][1], top[1][1]):
        return []
    return [(index[c], 1 + max(r.sample for r in claimed if r.config == c))
            for c, done in top if len(done) < TIED_SAMPLES]

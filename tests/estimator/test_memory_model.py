"""The memory model against hand-checkable structure and against real CPU steps."""

import numpy as np
import pytest

from autofit.core.config import Precision, TrainConfig
from autofit.core.errors import ConfigError
from autofit.estimator.advice import advise
from autofit.estimator.memory_model import estimate
from autofit.estimator.memory_table import BREAKDOWN, estimate_table, in_flight
from autofit.profiling.profile import profile_workload
from autofit.trial.measure import measure_trial
from autofit.workloads.load import load_workload


@pytest.fixture(scope="module")
def tiny():
    return load_workload("gpt-tiny")


@pytest.fixture(scope="module")
def tiny_profile(tiny):
    return profile_workload(tiny, [Precision.FP32, Precision.AMP_BF16, Precision.BF16])


@pytest.fixture(scope="module")
def short():
    """gpt-tiny at 32 tokens: every term of the estimate, at a quarter of the real steps' work (on a CPU
    without bf16 matmul units a bf16 step of gpt-tiny at its 128 tokens takes seconds a sample)."""
    return load_workload("gpt-tiny+seq_len=32")


@pytest.fixture(scope="module")
def short_profile(short):
    return profile_workload(short, [Precision.FP32, Precision.AMP_BF16, Precision.BF16])


@pytest.mark.parametrize("config", [
    TrainConfig("fp32", 2, 1, 0, 1),
    TrainConfig("fp32", 4, 3, 1, 1),
    TrainConfig("amp-bf16", 3, 2, 2, 1),
    TrainConfig("amp-bf16", 4, 1, 0, 1),
    TrainConfig("bf16", 5, 2, 1, 1),
])
def test_estimate_matches_real_cpu_steps(short, short_profile, config, one_thread):
    measured = measure_trial(short, config, device="cpu", warmup_steps=2, measure_steps=1)
    assert measured["status"] == "ok", measured.get("error")
    predicted = estimate(short_profile, config).peak_bytes
    assert predicted == pytest.approx(measured["peak_bytes"], rel=0.01)


def test_breakdown_adds_up_and_model_state(tiny_profile):
    est = estimate(tiny_profile, TrainConfig("amp-bf16", 8, 4, 0, 1))
    assert sum(getattr(est, name) for name in BREAKDOWN) == pytest.approx(est.peak_bytes, abs=8)
    pp = tiny_profile.for_precision("amp-bf16")
    assert est.model_state_bytes == pp.static_param_bytes + pp.grad_bytes + pp.optimizer_bytes
    assert est.per_device_peak_bytes == (est.peak_bytes,)


def test_accumulation_keeps_gradients_but_not_activations(tiny_profile):
    one = estimate(tiny_profile, TrainConfig("fp32", 8, 1))
    many = estimate(tiny_profile, TrainConfig("fp32", 8, 8))
    # later micro-steps hold all gradients during their backward (and the losses so far, 4 bytes
    # each): more than the first, never 8x
    losses_bytes = 8 * 4
    assert one.peak_bytes < many.peak_bytes <= one.peak_bytes + tiny_profile.for_precision("fp32").grad_bytes + losses_bytes


def test_checkpointing_lowers_activation_peak(tiny_profile):
    peaks = [estimate(tiny_profile, TrainConfig("fp32", 32, 1, every)).peak_bytes for every in (0, 1, 2, 4)]
    assert peaks[1] < peaks[0] and peaks[2] < peaks[0]


def test_device_split_per_stage(tiny_profile):
    whole = estimate(tiny_profile, TrainConfig("fp32", 4, 4, 0, 1))
    split = estimate(tiny_profile, TrainConfig("fp32", 4, 4, 0, 2))
    assert len(split.per_device_peak_bytes) == 2
    assert split.peak_bytes == max(split.per_device_peak_bytes) < whole.peak_bytes
    with pytest.raises(ConfigError, match="layers"):
        estimate(tiny_profile, TrainConfig("fp32", 4, 4, 0, 8))


def test_in_flight_micro_batches():
    ga = np.array([1, 2, 8])
    assert in_flight(0, 4, ga).tolist() == [1, 2, 4]      # 1F1B: stage 0 holds up to p
    assert in_flight(3, 4, ga).tolist() == [1, 1, 1]      # the last stage holds one
    assert in_flight(0, 4, ga, "GPipe").tolist() == [1, 2, 8]


def test_table_rows_do_not_depend_on_their_neighbours(tiny_profile):
    # The table scores configs in groups of one structure at once: shuffling the configs
    # (so every group's rows are scattered) must give every config the same row.
    configs = [TrainConfig(p, mb, ga, ck, ds) for p in ("fp32", "bf16") for mb in (1, 7) for ga in (1, 3)
               for ck in (0, 1, 3) for ds in (1, 2, 4)]
    table = estimate_table(tiny_profile, configs, budget_bytes=40 * 2**20)
    order = np.random.default_rng(0).permutation(len(configs))
    shuffled = estimate_table(tiny_profile, [configs[i] for i in order], budget_bytes=40 * 2**20)
    for column in ("peak_bytes", "activations_bytes", "fits", "peak_phase"):
        assert shuffled[column].tolist() == table[column].iloc[order].tolist()
    assert table["fits"].any() and not table["fits"].all()  # the budget cuts through this space


def test_peak_grows_with_the_micro_batch(tiny_profile):
    configs = [TrainConfig(p, mb, ga, ck, ds) for p in ("fp32", "amp-bf16") for ga in (1, 4) for ck in (0, 1, 2)
               for ds in (1, 2) for mb in (1, 2, 8, 32, 128)]
    table = estimate_table(tiny_profile, configs)
    for _, group in table.groupby(["precision", "grad_accum", "checkpoint_every", "device_split"]):
        peaks = group.sort_values("micro_batch")["peak_bytes"].tolist()
        assert peaks == sorted(peaks) and peaks[-1] > peaks[0]


def test_large_table_scores(tiny_profile):
    rng = np.random.default_rng(0)
    configs = [TrainConfig(rng.choice(["fp32", "amp-bf16", "bf16"]), int(rng.integers(1, 512)), int(rng.integers(1, 64)),
                           int(rng.integers(0, 5)), int(rng.choice([1, 2, 4]))) for _ in range(5000)]
    table = estimate_table(tiny_profile, configs, budget_bytes=10**9)
    assert len(table) == 5000 and table["valid"].all() and (table["peak_bytes"] > 0).all()


def test_advice_when_nothing_fits(tiny_profile):
    pp = tiny_profile.for_precision("fp32")
    too_small = 13 * 2**20  # fp32 states (4x the 10 MB of fp32 weights) can't fit; 4 bf16 stages can
    assert pp.static_param_bytes + pp.grad_bytes + pp.optimizer_bytes > too_small
    advice = advise(tiny_profile, too_small, [Precision.FP32, Precision.BF16])
    text = " ".join(advice.lines)
    assert "fp32: weights + gradients + optimizer state alone" in text
    assert "fewest devices" in text and advice.smallest_fit is not None
    assert advice.smallest_fit.device_split > 1

"""The study: planning rules on synthetic records (fast), calibration, records read from storage
(including a journal written by autofit 0.1), a search through an injected trial runner, then
real searches that are killed and resumed, and two workers sharing one study.

The workload of every search test is ``tiny_lm`` (tests/trial_workloads.py, spec ``TINY``): an
embedding, four residual blocks and a head.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pandas as pd
import pytest
from optuna.trial import TrialState
from trial_workloads import SLOW_TINY_LM
from trial_workloads import TINY_LM as TINY

from autofit.core.config import TrainConfig
from autofit.estimator.calibration import (
    MARGIN_SLACK,
    PRIOR_MARGIN,
    Calibration,
    Observation,
    TimePoint,
    calibrate,
    relative_error,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # a loaded shared machine: no spin-waiting


# --- planning on synthetic trials ----------------------------------------------------------------

from autofit.core.records import PruneReason, TrialRecord, TrialStatus
from autofit.core.space import space_from_dict
from autofit.study import Planner, StopReason, StudySettings, space_to_dict  # noqa: E402


@pytest.fixture(scope="module")
def tiny_profile():
    from autofit.profiling.profile import profile_workload
    from autofit.workloads.load import load_workload

    return profile_workload(load_workload(TINY), ["fp32", "amp-bf16"], device_type="cpu")


@pytest.fixture(scope="module")
def rates():
    from autofit.probes.device_rates import DeviceRates

    # Fixed rates: planning tests must not depend on how loaded the machine is.
    return DeviceRates("cpu", "test", 2, {"float32": 1e11, "bfloat16": 5e10, "float16": 1e9}, 1e10, 5e-6, 0.0, "x")


def make_planner(profile, rates, budget_bytes=10**9, devices=1, **space) -> Planner:
    space = space or {"precision": ["fp32"], "micro_batch": [2, 4], "global_batch": 4,
                      "checkpoint_every": [0, 1, 4, 8], "device_split": [1, 2]}
    settings = StudySettings(workload_name="tiny-lm", workload_source=TINY, budget_bytes=budget_bytes,
                             budget_text=str(budget_bytes), space=space_to_dict(space_from_dict(space)),
                             device_type="cpu", devices=devices, study_name="t", out_dir="/nonexistent")
    return Planner(settings, profile, rates)


def ran_trial(planner: Planner, config: TrainConfig, number: int, status="ok", samples_per_s=100.0,
              peak_bytes=None, step_time_s=None, sample=1, head_to_head=None, **timing) -> TrialRecord:
    """A real trial's record as the worker writes it (``head_to_head``: the number of the head-to-head it was
    timed in; ``timing``: more measured keys, such as what its timed steps got from the machine)."""
    i = planner.index[config]
    predicted = planner.prediction(i, Calibration.prior())
    peak = predicted["peak_bytes"] if peak_bytes is None else peak_bytes
    ok = status == "ok"
    measured = {"peak_bytes": peak if ok else None, "samples_per_s": samples_per_s if ok else None,
                "step_time_s": (step_time_s or config.samples_per_step / samples_per_s) if ok else None,
                "head_to_head": head_to_head, **timing}
    errors = {"step_time": relative_error(predicted["step_time_s"], measured["step_time_s"])}
    return TrialRecord(number, config, TrialStatus(status), prediction=predicted, measurement=measured,
                       value=samples_per_s if ok else 0.0, sample=sample, errors=errors,
                       constraints={"peak_over_budget_bytes": -1.0 if ok else 1.0, "failed": 0.0 if ok else 1.0})


def settle(planner: Planner, trials: list[TrialRecord]):
    """Plan until the planner stops, answering each re-measurement with its config's first value."""
    trials = list(trials)
    step = planner.step(trials)
    while step.run is not None and step.sample > 1:
        config = planner.configs[step.run]
        first = next(r for r in trials if r.config == config and r.status.ran)
        trials.append(ran_trial(planner, config, len(trials), samples_per_s=first.value, sample=step.sample))
        step = planner.step(trials)
    return step


def pruned_trial(config: TrainConfig, number: int, reason: PruneReason | None = None) -> TrialRecord:
    return TrialRecord(number, config, TrialStatus.PRUNED, prune_reason=reason)


def kinds(step) -> dict:
    out = {}
    for p in step.prunes:
        out.setdefault(p.reason.value, []).append(p.index)
    return out


def test_static_prunes_each_with_its_reason(tiny_profile, rates):
    planner = make_planner(tiny_profile, rates)
    step = planner.step([])
    found = kinds(step)
    configs = planner.configs
    assert {configs[i].device_split for i in found["devices"]} == {2}
    assert all("needs 2 devices" in p.text for p in step.prunes if p.reason is PruneReason.DEVICES)
    # 4 layers: checkpoint_every 8 is one segment, as 4 is
    assert {configs[i].checkpoint_every for i in found["duplicate"]} == {8}
    # everything fits 1 GB: checkpointing only costs time
    assert {configs[i].checkpoint_every for i in found["dominated"]} == {1, 4}
    run = configs[step.run]
    assert run.checkpoint_every == 0 and run.device_split == 1
    assert step.stop is None
    # the predicted breakdown is kept for the pruned trial's user attrs
    assert all(p.prediction["peak_bytes"] > 0 and "activations_bytes" in p.prediction for p in step.prunes)


def test_a_pathologically_slow_precision_is_pruned_before_any_trial(tiny_profile):
    from autofit.probes.device_rates import DeviceRates

    no_bf16_kernel = DeviceRates("cpu", "test", 2, {"float32": 1e11, "bfloat16": 1e6, "float16": 1e6}, 1e10, 5e-6,
                                 0.0, "x")
    planner = make_planner(tiny_profile, no_bf16_kernel, precision=["fp32", "amp-bf16"], micro_batch=[2, 4],
                           global_batch=4)
    step = planner.step([])
    slow = kinds(step)["too_slow"]
    assert {planner.configs[i].precision.value for i in slow} == {"amp-bf16"} and len(slow) == 2
    assert planner.configs[step.run].precision.value == "fp32"


def test_more_devices_run_splits(tiny_profile, rates):
    step = make_planner(tiny_profile, rates, devices=2).step([])
    assert "devices" not in kinds(step)


def test_over_budget_and_checkpointing_that_then_pays(tiny_profile, rates):
    probe = make_planner(tiny_profile, rates)
    c0 = TrainConfig("fp32", 4, 1, 0, 1)
    c1 = TrainConfig("fp32", 4, 1, 1, 1)
    peak0 = probe.table.loc[probe.index[c0], "peak_bytes"]
    peak1 = probe.table.loc[probe.index[c1], "peak_bytes"]
    assert peak1 < peak0
    factor = Calibration.prior().peak_factor
    budget = int(peak0 * factor) - 1  # mb=4 without checkpointing is over, with it fits
    assert peak1 * factor <= budget
    planner = make_planner(tiny_profile, rates, budget_bytes=budget)
    step = planner.step([])
    found = kinds(step)
    assert planner.index[c0] in found["over_budget"]
    assert planner.index[c1] not in found.get("dominated", [])  # nothing cheaper fits at mb=4
    assert "over the budget" in next(p.text for p in step.prunes if p.index == planner.index[c0])


def test_a_dominated_config_comes_back_when_its_dominator_runs_out_of_memory(tiny_profile, rates):
    planner = make_planner(tiny_profile, rates)
    c0 = TrainConfig("fp32", 4, 1, 0, 1)
    c1 = TrainConfig("fp32", 4, 1, 1, 1)
    first = planner.step([])
    assert planner.index[c1] in kinds(first)["dominated"]
    pruned = [pruned_trial(planner.configs[p.index], k, p.reason) for k, p in enumerate(first.prunes)]
    oom = ran_trial(planner, c0, len(pruned), status="oom")
    step = planner.step(pruned + [oom])
    assert step.prunes == []  # nothing new to prune ...
    candidates = {planner.configs[step.run]}
    assert c1 in candidates or planner.configs[step.run].micro_batch == 2
    # ... and with mb=2 done too, the checkpointed mb=4 configs are what is left to run
    done = ran_trial(planner, TrainConfig("fp32", 2, 2, 0, 1), len(pruned) + 1)
    step = planner.step(pruned + [oom, done])
    assert planner.configs[step.run] in (c1, TrainConfig("fp32", 4, 1, 4, 1))


def test_a_slow_measurement_does_not_undo_dominance(tiny_profile, rates):
    planner = make_planner(tiny_profile, rates, precision=["fp32"], micro_batch=[2, 4], global_batch=4,
                           checkpoint_every=[0, 1])
    a0, a1 = TrainConfig("fp32", 4, 1, 0, 1), TrainConfig("fp32", 4, 1, 1, 1)
    b0, b1 = TrainConfig("fp32", 2, 2, 0, 1), TrainConfig("fp32", 2, 2, 1, 1)
    first = planner.step([])
    assert {planner.configs[p.index] for p in first.prunes} == {a1, b1}
    trials = [pruned_trial(config, k) for k, config in enumerate((a1, b1))]
    # a0 measured 10x slower than predicted, b0 as predicted: the calibrated time of a1 falls
    # below a0's measurement, but a1 still only adds recomputation to a0
    predicted = {c: planner.prediction(planner.index[c], Calibration.prior())["samples_per_s"] for c in (a0, b0)}
    trials += [ran_trial(planner, a0, 2, samples_per_s=predicted[a0] / 10),
               ran_trial(planner, b0, 3, samples_per_s=predicted[b0])]
    step = settle(planner, trials)
    assert step.run is None and step.stop_reason is StopReason.EXHAUSTED and step.stop.startswith("exhausted")


def test_each_precision_is_explored_before_exploiting(tiny_profile, rates):
    planner = make_planner(tiny_profile, rates, precision=["fp32", "amp-bf16"], micro_batch=[2, 4], global_batch=4)
    first = planner.configs[planner.step([]).run]
    second = planner.configs[planner.step([ran_trial(planner, first, 0)]).run]
    assert {first.precision.value, second.precision.value} == {"fp32", "amp-bf16"}


def test_stop_rules(tiny_profile, rates):
    space = {"precision": ["fp32"], "micro_batch": [1, 2, 4, 8], "global_batch": 8}
    planner = make_planner(tiny_profile, rates, **space)
    configs = planner.configs
    # exhausted
    trials = [ran_trial(planner, c, k) for k, c in enumerate(configs)]
    step = settle(planner, trials)
    assert step.stop_reason is StopReason.EXHAUSTED and step.stop.startswith("exhausted")
    # trial limit
    limited = dataclasses.replace(planner.settings, trials=1)
    planner_limited = Planner(limited, tiny_profile, rates)
    step = planner_limited.step(trials[:1])
    assert step.stop_reason is StopReason.TRIAL_LIMIT and step.stop.startswith("trial limit")
    # patience: the first is the best, the next ones do not improve it by 2%
    patient = Planner(dataclasses.replace(planner.settings, patience=2), tiny_profile, rates)
    flat = [ran_trial(patient, configs[0], 0, samples_per_s=100.0),
            ran_trial(patient, configs[1], 1, samples_per_s=101.0),
            ran_trial(patient, configs[2], 2, samples_per_s=99.0)]
    step = settle(patient, flat)
    assert step.stop_reason is StopReason.PATIENCE and step.stop.startswith("patience")
    assert patient.step(flat[:2]).stop is None and patient.step(flat[:2]).stop_reason is None
    # time limit
    late = Planner(dataclasses.replace(planner.settings, deadline=time.time() - 1), tiny_profile, rates)
    step = late.step([])
    assert step.stop_reason is StopReason.TIMEOUT and step.stop.startswith("timeout")


def test_bound_stops_when_nothing_left_is_predicted_close(tiny_profile, rates):
    planner = make_planner(tiny_profile, rates, precision=["fp32"], micro_batch=[1, 8], global_batch=8)
    big = TrainConfig("fp32", 8, 1, 0, 1)
    predicted = planner.prediction(planner.index[big], Calibration.prior())["samples_per_s"]
    # measured exactly as predicted, but the other config is predicted at a tiny fraction of it
    small = TrainConfig("fp32", 1, 8, 0, 1)
    small_predicted = planner.prediction(planner.index[small], Calibration.prior())["samples_per_s"]
    boosted = ran_trial(planner, big, 0, samples_per_s=predicted * 3 * predicted / small_predicted)
    step = settle(planner, [boosted])
    assert step.stop_reason is StopReason.BOUND and step.stop.startswith("bound")


def test_bound_does_not_rule_out_a_kind_before_the_error_across_kinds_is_measured(tiny_profile, rates):
    """One precision's trial, however fast, says nothing measured about another's: the other keeps a
    trial (its first measures the error across kinds), then the bound may stop."""
    planner = make_planner(tiny_profile, rates, precision=["fp32", "amp-bf16"], micro_batch=[8], global_batch=8)
    fp32, amp = TrainConfig("fp32", 8, 1), TrainConfig("amp-bf16", 8, 1)
    prior = {c: planner.prediction(planner.index[c], Calibration.prior())["samples_per_s"] for c in (fp32, amp)}
    # fp32 measured far above anything amp-bf16 is predicted at, even calibrated
    trials = [ran_trial(planner, fp32, 0, samples_per_s=100 * prior[fp32])]
    step = settle(planner, trials)
    assert step.stop is None and planner.configs[step.run] == amp
    trials.append(ran_trial(planner, amp, 1, samples_per_s=prior[amp]))
    assert settle(planner, trials).run is None


def test_leaders_of_one_build_are_measured_again_each_in_a_trial_of_its_own(tiny_profile, rates):
    """Micro-batches 8 and 4 of one build within the noise: each gets trials of its own, one at a time, as
    a training run has its process to itself (timed head to head in one process, two such configs read
    closer than they train: docs/facts.md#throughput-noise)."""
    from autofit.core.records import best_of

    planner = make_planner(tiny_profile, rates, precision=["fp32"], micro_batch=[1, 2, 4, 8], global_batch=8)
    a, b, c, d = (TrainConfig("fp32", m, 8 // m) for m in (8, 4, 2, 1))
    trials = [ran_trial(planner, a, 0, samples_per_s=100.0), ran_trial(planner, b, 1, samples_per_s=95.0),
              ran_trial(planner, c, 2, samples_per_s=60.0), ran_trial(planner, d, 3, samples_per_s=40.0)]
    assert best_of(trials).config == a
    step = planner.step(trials)
    assert (planner.configs[step.run], step.sample) == (a, 2)
    # another worker is measuring a again: this one measures b
    running = dataclasses.replace(ran_trial(planner, a, 4, sample=2), status=TrialStatus.RUNNING, value=None)
    step = planner.step(trials + [running])
    assert (planner.configs[step.run], step.sample) == (b, 2)
    # a's first sample was a fast moment of the machine; each config keeps its best sample
    trials += [ran_trial(planner, a, 4, samples_per_s=70.0, sample=2),
               ran_trial(planner, b, 5, samples_per_s=94.0, sample=2)]
    assert best_of(trials).config == a and best_of(trials).value == 100.0
    # their best samples are closer than a's own two: a third of each, then the order stands
    order = []
    step = planner.step(trials)
    while step.run is not None:
        order.append((planner.configs[step.run], step.sample))
        trials.append(ran_trial(planner, order[-1][0], len(trials), samples_per_s=97.0, sample=step.sample))
        step = planner.step(trials)
    assert order == [(a, 3), (b, 3)] and step.stop.endswith("; then 4 re-measurements of the leaders")
    # a re-measurement that goes over the budget rules its config out
    trials.append(ran_trial(planner, a, len(trials), status="oom", sample=4))
    assert best_of(trials).config == b


def test_a_sample_an_earlier_version_timed_head_to_head_ranks_as_any_other(tiny_profile, rates):
    """A study recorded by an earlier version, which timed leaders of one build in one process (gpt-tiny at
    94 MiB: micro-batches 6 and 4 head to head, 12 with checkpointing twice on its own): every config
    ranks by its best sample, head to head or not, and the answer's figure is the bar a config must beat."""
    from autofit.core.records import ranked_bests

    planner = make_planner(tiny_profile, rates, precision=["fp32"], micro_batch=[4, 6, 12], checkpoint_every=[0, 1],
                           global_batch=12)
    six, four, twelve = TrainConfig("fp32", 6, 2), TrainConfig("fp32", 4, 3), TrainConfig("fp32", 12, 1, 1)
    trials = [ran_trial(planner, six, 0, samples_per_s=109.0), ran_trial(planner, twelve, 1, samples_per_s=81.8),
              ran_trial(planner, four, 2, samples_per_s=96.8),
              ran_trial(planner, six, 3, samples_per_s=98.3, sample=2, head_to_head=3),
              ran_trial(planner, four, 4, samples_per_s=79.1, sample=2, head_to_head=3),
              ran_trial(planner, twelve, 5, samples_per_s=102.1, sample=2)]
    assert [(r.config, r.value) for r in ranked_bests(trials)] == [(six, 109.0), (twelve, 102.1), (four, 96.8)]
    trials.append(ran_trial(planner, four, 6, samples_per_s=120.0, sample=3))
    assert [(r.config, r.value) for r in ranked_bests(trials)] == [(four, 120.0), (six, 109.0), (twelve, 102.1)]


def test_up_to_four_leaders_are_measured_again(tiny_profile, rates):
    """Five configs within the noise of the best: the four with the highest best samples are measured again."""
    from autofit.core.records import config_samples
    from autofit.study.leaders import REMEASURE_TOP, remeasurements

    planner = make_planner(tiny_profile, rates, precision=["fp32", "amp-bf16"], micro_batch=[4, 8],
                           checkpoint_every=[0, 1], global_batch=8)
    a, b = TrainConfig("fp32", 8, 1), TrainConfig("fp32", 4, 2)
    c, d, e = TrainConfig("fp32", 8, 1, 1), TrainConfig("amp-bf16", 8, 1), TrainConfig("amp-bf16", 8, 1, 1)
    trials = [ran_trial(planner, x, k, samples_per_s=v) for k, (x, v) in
              enumerate([(a, 100.0), (b, 99.0), (c, 90.0), (d, 88.0), (e, 86.0)])]
    due = remeasurements(trials, config_samples(trials), planner.index)
    assert REMEASURE_TOP == 4 and [(planner.configs[i], k) for i, k in due] == [(a, 2), (b, 2), (c, 2), (d, 2)]


@pytest.mark.parametrize("starved_steps, timed_steps, share, again", [
    (3, 3, 0.6, True),     # every step waited: 40 could have been 100, so b and a are measured again
    (2, 5, 0.6, False),    # three clean steps: 40 is the config's figure, far below a's
    (3, 3, 0.05, False),   # starved, but the wait explains little of the gap
])
def test_a_starved_figure_is_a_floor_and_its_config_is_measured_again_with_the_leader(tiny_profile, rates,
                                                                                     starved_steps, timed_steps,
                                                                                     share, again):
    from autofit.core.records import config_samples, reach
    from autofit.study.leaders import remeasurements

    planner = make_planner(tiny_profile, rates, precision=["fp32"], micro_batch=[1, 16], global_batch=16)
    a, b = TrainConfig("fp32", 1, 16), TrainConfig("fp32", 16, 1)
    starved = ran_trial(planner, b, 0, samples_per_s=40.0, timed_steps=timed_steps, starved_steps=starved_steps,
                        max_wait_share=share)
    trials = [starved, ran_trial(planner, a, 1, samples_per_s=60.0, timed_steps=3, starved_steps=0,
                                 max_wait_share=0.01)]
    assert reach(starved) == pytest.approx(40.0 / (1 - share) if starved_steps == timed_steps else 40.0)
    step = planner.step(trials)
    if again:
        assert step.sample == 2
        assert {planner.configs[i] for i, _ in remeasurements(trials, config_samples(trials), planner.index)} == {a, b}
    else:
        assert step.run is None


def test_beside_a_busy_core_the_best_is_ranked_by_what_its_starved_samples_reach(tiny_profile, rates):
    """A CI run's loaded search: every step of both configs waited for a CPU, and the head-to-head read them
    alike (31.26 against 31.27 samples/s), since losing one of two cores costs the config that parallelises
    well (micro-batch 16: 56 quiet) more than the one that does not (micro-batch 1: 35 quiet). Raised by
    its wait, micro-batch 16 ranks first, as a quiet search ranks it."""
    from autofit.core.records import best_of, reach

    planner = make_planner(tiny_profile, rates, precision=["fp32"], micro_batch=[1, 16], global_batch=16)
    big, small = TrainConfig("fp32", 16, 1), TrainConfig("fp32", 1, 16)
    starved = {"timed_steps": 3, "starved_steps": 3}
    trials = [ran_trial(planner, big, 0, samples_per_s=33.47, max_wait_share=0.435, **starved),
              ran_trial(planner, small, 1, samples_per_s=29.63, max_wait_share=0.373, **starved),
              ran_trial(planner, big, 2, samples_per_s=31.256, max_wait_share=0.435, sample=2, head_to_head=2, **starved),
              ran_trial(planner, small, 3, samples_per_s=31.265, max_wait_share=0.368, sample=2, head_to_head=2,
                        **starved)]
    best = best_of(trials)
    assert best.config == big and best.number == 0  # its best sample, as the tables report it
    assert reach(best) == pytest.approx(33.47 / (1 - 0.435))
    quiet = [ran_trial(planner, c, k, samples_per_s=v, timed_steps=3, starved_steps=0, max_wait_share=0.02)
             for k, (c, v) in enumerate([(big, 31.256), (small, 31.265)])]
    assert best_of(quiet).config == small  # unstarved, a figure is itself: the faster one wins, however narrowly


def test_leaders_of_other_builds_are_measured_on_their_own(tiny_profile, rates):
    planner = make_planner(tiny_profile, rates, precision=["fp32", "amp-bf16"], micro_batch=[4, 8], global_batch=8)
    a, b = TrainConfig("fp32", 8, 1), TrainConfig("amp-bf16", 8, 1)
    trials = [ran_trial(planner, a, 0, samples_per_s=100.0), ran_trial(planner, b, 1, samples_per_s=95.0)]
    order = []
    step = planner.step(trials)
    while step.run is not None:
        if step.sample == 1:  # exploration goes on: give the other configs far slower results
            trials.append(ran_trial(planner, planner.configs[step.run], len(trials), samples_per_s=10.0))
        else:
            order.append(planner.configs[step.run])
            trials.append(ran_trial(planner, order[-1], len(trials), samples_per_s=90.0, sample=step.sample))
        step = planner.step(trials)
    # each leader's second sample, each a trial of its own; then, since a's 100 and b's 95 are closer
    # than a's own two samples (100 and 90), a third of each (leaders.undecided)
    assert order == [a, b, a, b]


def test_re_measurements_take_only_the_trials_left_under_the_limit(tiny_profile, rates):
    planner = make_planner(tiny_profile, rates, precision=["fp32"], micro_batch=[1, 2, 4, 8], global_batch=8)
    limited = Planner(dataclasses.replace(planner.settings, trials=5), tiny_profile, rates)
    configs = [TrainConfig("fp32", m, 8 // m) for m in (8, 4, 2)]
    trials = [ran_trial(limited, c, k, samples_per_s=100.0 - k) for k, c in enumerate(configs)]
    order = []
    step = limited.step(trials)  # 3 of 5 ran: two slots left, for the top two of the three leaders
    while step.run is not None:
        order.append((limited.configs[step.run], step.sample))
        trials.append(ran_trial(limited, order[-1][0], len(trials), samples_per_s=99.0, sample=step.sample))
        step = limited.step(trials)
    assert order == [(configs[0], 2), (configs[1], 2)] and len(trials) == 5 and step.run is None


def test_a_leader_alone_is_not_measured_again(tiny_profile, rates):
    from autofit.core.records import config_samples
    from autofit.study.leaders import NOISE_MIN, sample_noise

    planner = make_planner(tiny_profile, rates, precision=["fp32"], micro_batch=[1, 2, 4, 8], global_batch=8)
    a, b, c, d = (TrainConfig("fp32", m, 8 // m) for m in (8, 4, 2, 1))
    beyond_floor = 0.95 * 100.0 / (1 + NOISE_MIN)  # b's best, just beyond the noise floor of a's 100
    first = [ran_trial(planner, a, 0, samples_per_s=100.0), ran_trial(planner, b, 1, samples_per_s=beyond_floor),
             ran_trial(planner, c, 2, samples_per_s=0.5 * beyond_floor),
             ran_trial(planner, d, 3, samples_per_s=0.3 * beyond_floor)]
    assert sample_noise(config_samples(first)) == NOISE_MIN  # no config has two samples yet
    # nothing within the noise could overtake a
    step = planner.step(first)
    assert step.run is None and "re-measurement" not in step.stop
    # a's samples differ by more than the floor: b is within that noise of a's best, so b is measured again
    noisy = first + [ran_trial(planner, a, 4, samples_per_s=100.0 / (1 + 2 * NOISE_MIN), sample=2)]
    assert sample_noise(config_samples(noisy)) == pytest.approx(2 * NOISE_MIN)
    step = planner.step(noisy)
    assert (planner.configs[step.run], step.sample) == (b, 2)


def test_re_measurements_count_towards_the_trial_limit(tiny_profile, rates):
    planner = make_planner(tiny_profile, rates, precision=["fp32", "amp-bf16"], micro_batch=[1, 2, 4, 8],
                           global_batch=8)
    limited = Planner(dataclasses.replace(planner.settings, trials=4), tiny_profile, rates)
    configs = [TrainConfig("fp32", m, 8 // m) for m in (8, 4, 2)]
    trials = [ran_trial(limited, c, k, samples_per_s=100.0 - k) for k, c in enumerate(configs)]
    step = limited.step(trials)  # 3 of 4 ran: the last is left for a re-measurement of the best
    assert planner.configs[step.run] == configs[0] and step.sample == 2
    trials.append(ran_trial(limited, configs[0], 3, samples_per_s=99.0, sample=2))
    step = limited.step(trials)
    # one short line: the re-measurement is one of the 4 (no "left to re-measure", no "then ...")
    assert step.run is None and step.stop == "trial limit: 4 real trials, 1 of them a re-measurement of the leaders"


def test_the_stop_line_says_the_re_measurements_in_a_few_words():
    """One short line: within the trial limit the re-measurements are part of its count; after any
    other rule they ran once the rule held."""
    from autofit.study.planner import _remeasured_text

    config = TrainConfig("fp32", 8, 1)
    ran = [TrialRecord(number=n, config=config, status=TrialStatus.OK, value=1.0, sample=s)
           for n, s in ((3, 1), (5, 2), (6, 3))]
    assert _remeasured_text(ran[:1], StopReason.PATIENCE) == ""
    assert _remeasured_text(ran[:2], StopReason.EXHAUSTED) == "; then 1 re-measurement of the leaders"
    assert _remeasured_text(ran, StopReason.BOUND) == "; then 2 re-measurements of the leaders"
    assert _remeasured_text(ran, StopReason.TRIAL_LIMIT) == ", 2 of them re-measurements of the leaders"


def test_a_precision_the_calibrated_model_rules_out_is_dropped_after_its_own_trial(tiny_profile, rates):
    from autofit.study.planner import TIME_MARGIN_MIN, time_margin

    planner = make_planner(tiny_profile, rates, precision=["fp32", "amp-bf16"], micro_batch=[1, 2, 4, 8],
                           global_batch=8)
    fp32, amp = TrainConfig("fp32", 8, 1), TrainConfig("amp-bf16", 8, 1)
    predicted = {c: planner.prediction(planner.index[c], Calibration.prior())["samples_per_s"] for c in (fp32, amp)}
    # fp32 measured 100x faster than predicted: no amp-bf16 config is predicted near it, but amp-bf16
    # has not run, and across precisions one trial's calibration says little: it is not dropped
    trials = [ran_trial(planner, fp32, 0, samples_per_s=100 * predicted[fp32])]
    assert not [i for i in kinds(planner.step(trials)).get("slow_precision", []) if planner.configs[i].precision == "amp-bf16"]
    # a second fp32 trial measures the calibrated model's error within a precision (here 1/100 -> 10%)...
    trials = [ran_trial(planner, fp32, 0, samples_per_s=predicted[fp32])]
    fp32_4 = TrainConfig("fp32", 4, 2)
    trials.append(ran_trial(planner, fp32_4, 1, samples_per_s=planner.prediction(
        planner.index[fp32_4], Calibration.prior())["samples_per_s"] * 1.01))
    # ...then amp-bf16's own trial runs 5x slower than predicted: its other configs are dropped, with the reason
    trials.append(ran_trial(planner, amp, 2, samples_per_s=predicted[amp] / 5))
    step = planner.step(trials)
    dropped = {planner.configs[i] for i in kinds(step)["slow_precision"]}
    assert {TrainConfig("amp-bf16", m, 8 // m) for m in (2, 4)} <= dropped  # (mb=1 is too slow by 20x anyway)
    assert {planner.configs[p.index] for p in step.prunes} >= {TrainConfig("amp-bf16", m, 8 // m) for m in (1, 2, 4)}
    assert "10% faster (the time model's measured error)" in next(p.text for p in step.prunes if p.reason.value == "slow_precision"
                                                       and planner.configs[p.index].precision == "amp-bf16")
    # config by config within a precision that ran: fp32 mb=1 (predicted a third of mb=4's measurement)
    # is dropped, mb=8 (predicted above it) is not
    at = lambda c, k, x: ran_trial(planner, c, k, samples_per_s=x * planner.prediction(  # noqa: E731
        planner.index[c], Calibration.prior())["samples_per_s"])
    step = planner.step([at(TrainConfig("fp32", 4, 2), 0, 1.0), at(TrainConfig("fp32", 2, 4), 1, 1.01)])
    slow = {planner.configs[p.index]: p.text for p in step.prunes if p.reason.value == "too_slow"}
    assert "10% faster (the time model's measured error) it would not beat" in slow[TrainConfig("fp32", 1, 8)]
    assert TrainConfig("fp32", 8, 1) not in slow and planner.configs[step.run] in (TrainConfig("fp32", 8, 1), amp)
    # a config must be able to beat the best by min_improvement: asked for a gain mb=8 cannot reach
    # even at the top of the margin, it is dropped too
    ran = [at(TrainConfig("fp32", 4, 2), 0, 1.0), at(TrainConfig("fp32", 2, 4), 1, 1.01)]
    calibration = planner.step(ran).calibration
    upper = planner.prediction(planner.index[fp32], calibration)["samples_per_s"] * (1 + TIME_MARGIN_MIN)
    best = max(r.value for r in ran)
    assert upper > best  # by the margin alone mb=8 might beat the best...
    asked = upper / best - 1 + 0.05
    strict = Planner(dataclasses.replace(planner.settings, min_improvement=asked), tiny_profile, rates)
    slow = {strict.configs[p.index]: p.text for p in strict.step(ran).prunes
            if p.reason.value in ("too_slow", "slow_precision")}
    assert f"by {asked:.0%}" in slow[fp32]  # ...but not by as much as asked
    # the margin: errors of trials planned once their precision had run, else any trial's
    with_errors = lambda r, e: dataclasses.replace(r, errors={"step_time": e})  # noqa: E731
    first = with_errors(ran_trial(planner, fp32, 0), 0.6)
    assert time_margin([first]) is None and time_margin([]) is None
    assert time_margin([first, with_errors(ran_trial(planner, fp32_4, 1), -0.3)]) == 0.3
    assert time_margin([first, with_errors(ran_trial(planner, fp32_4, 1), 0.01)]) == TIME_MARGIN_MIN


def test_one_split_modes_calibration_does_not_rule_out_another(tiny_profile, rates):
    """FSDP trials measured far slower than the prior (its gathers and reductions, on a shared CPU)
    say little about a pipeline's step: the pipeline keeps its trial (as on the committed gpt-tiny
    grid, where the 2-stage pipeline was the optimum); once it ran, its own group can be ruled out."""
    from autofit.study.planner import time_margin

    planner = make_planner(tiny_profile, rates, devices=2, precision=["fp32"], micro_batch=[1, 2], global_batch=4,
                           checkpoint_every=[0], device_split=[2], split_mode=["pipeline", "fsdp"])
    fsdp = [TrainConfig("fp32", m, 2 // m, device_split=2, split_mode="fsdp") for m in (2, 1)]
    pipes = {TrainConfig("fp32", m, 4 // m, device_split=2, split_mode="pipeline") for m in (1, 2)}
    prior = {c: planner.prediction(planner.index[c], Calibration.prior())["samples_per_s"] for c in planner.configs}
    assert max(prior[c] for c in pipes) < max(prior[c] for c in fsdp)  # the premise: FSDP predicted faster
    # both FSDP configs 2.2x slower than predicted; the second as its calibrated prediction said (error 0)
    trials = [ran_trial(planner, c, k, samples_per_s=prior[c] / 2.2) for k, c in enumerate(fsdp)]
    trials[1] = dataclasses.replace(trials[1], errors={"step_time": 0.0})
    assert time_margin(trials) == 0.10
    step = planner.step(trials)
    assert not kinds(step).get("slow_precision") and not kinds(step).get("too_slow")
    assert planner.configs[step.run] in pipes
    assert time_margin(trials + [ran_trial(planner, planner.configs[step.run], 2, samples_per_s=1.0)]) == 0.10
    # a pipeline that ran 10x slower than the prior rules out the other pipeline config, by its own group's rule
    ran = planner.configs[step.run]
    trials.append(dataclasses.replace(ran_trial(planner, ran, 2, samples_per_s=prior[ran] / 10), errors={}))
    other = next(iter(pipes - {ran}))
    pruned = {planner.configs[p.index]: p for p in planner.step(trials).prunes}
    assert pruned[other].reason is PruneReason.SLOW_PRECISION and "every fp32 split=2 config left" in pruned[other].text


def test_stale_running_trials():
    import datetime
    import socket

    from autofit.study import STALE_S, is_stale, process_start

    def running(worker=None, heartbeat=None, age_s=0.0):
        started = datetime.datetime.now() - datetime.timedelta(seconds=age_s)
        return TrialRecord(0, TrainConfig(), TrialStatus.RUNNING, worker=worker or {}, heartbeat=heartbeat,
                           started=started)

    now = time.time()
    me = {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid())}
    assert not is_stale(running(me), now)
    assert is_stale(running({**me, "start": "0"}), now)          # the pid was reused
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert is_stale(running({**me, "pid": int(dead.stdout)}), now)
    remote = {"host": "elsewhere", "pid": 1, "start": "1"}
    assert not is_stale(running(remote, heartbeat=now - 10, age_s=3600), now)
    assert is_stale(running(remote, heartbeat=now - STALE_S - 1, age_s=3600), now)
    assert not is_stale(running(age_s=1), now) and is_stale(running(age_s=120), now)  # never signed


# --- calibration ------------------------------------------------------------------------------------


def _obs(status="ok", pred=100.0, meas=110.0, budget=1000, config=TrainConfig(), pred_t=1.0, meas_t=2.0):
    return Observation(config, status, pred, pred_t, meas if status == "ok" else None,
                       meas_t if status == "ok" else None, budget)


def test_calibration_prior_and_peak_margin():
    prior = calibrate([])
    assert prior.peak_ratio == 1.0 and prior.peak_margin == pytest.approx(PRIOR_MARGIN["cpu"])
    cal = calibrate([_obs(pred=100, meas=110), _obs(pred=100, meas=100), _obs(pred=100, meas=120)])
    assert cal.peak_ratio == pytest.approx(1.10)  # the median ratio
    # by hand: after the median correction the worst under-prediction is 120 / 110 - 1 = 0.0909;
    # plus 0.02 of slack is 0.1109, above the prior shrunk by three trials
    assert cal.peak_margin == pytest.approx(0.110909, abs=1e-6)
    assert cal.fits(100, 1000) and not cal.fits(1000, 1000)
    assert cal.peak_errors == pytest.approx((100 / 110 - 1, 0.0, 100 / 120 - 1))


def test_the_cpu_prior_margin_is_the_slack_and_keeps_a_best_guess_near_the_budget():
    # the profile's real steps have checked its bytes on the CPU: a config predicted at 97.5% of the
    # budget is the first trial's to take, one at 98.5% is not; CUDA keeps room for the allocator
    prior = calibrate([])
    assert prior.peak_margin == pytest.approx(MARGIN_SLACK)
    assert prior.fits(975, 1000) and not prior.fits(985, 1000)
    assert not Calibration.prior("cuda").fits(975, 1000)


def test_an_fsdp_rank_under_its_bound_does_not_lower_other_configs_estimates():
    # the bench's gpt-tiny at 24 MiB: an FSDP rank measured 0.933 of its (upper-bound) estimate; a pipeline
    # config predicted 0.75% over the budget must stay over it, not be scaled under it and run out of memory
    fsdp = TrainConfig(precision="bf16", micro_batch=2, device_split=2, split_mode="fsdp")
    pipeline = TrainConfig(precision="bf16", micro_batch=2, grad_accum=2, device_split=2)
    cal = calibrate([_obs(pred=24_298_734, meas=22_676_058, budget=25_165_824, config=fsdp)])
    assert cal.peak_ratio == 1.0
    assert cal.peak_margin >= MARGIN_SLACK / 2  # the FSDP trial still counts as evidence towards the margin
    assert not cal.fits(25_353_332, 25_165_824)
    # a pipeline's own trial does move the ratio, FSDP's beside it does not
    both = calibrate([_obs(pred=24_298_734, meas=22_676_058, config=fsdp), _obs(pred=100, meas=101, config=pipeline)])
    assert both.peak_ratio == pytest.approx(1.01)


def test_an_oom_widens_the_margin_to_what_it_proves():
    cal = calibrate([_obs(pred=100, meas=100), _obs(status="oom", pred=500, budget=1000)])
    assert cal.peak_margin >= 1000 / 500 - 1  # it used at least the budget: 2x its prediction
    assert not cal.fits(500, 1000)


def test_time_calibration_carries_the_micro_batch_effect_across_precisions():
    points = (TimePoint("fp32", 8, 1, 0, 1, 1.0), TimePoint("fp32", 1, 8, 0, 1, 4.0),
              TimePoint("amp-bf16", 8, 1, 0, 1, 2.0))
    cal = Calibration(time_points=points)
    import pandas as pd

    query = pd.DataFrame([{"precision": "amp-bf16", "micro_batch": 1, "grad_accum": 8, "checkpoint_every": 0,
                           "device_split": 1},
                          {"precision": "amp-bf16", "micro_batch": 8, "grad_accum": 1, "checkpoint_every": 0,
                           "device_split": 1}])
    small, big = cal.time_ratios(query)
    assert small > 2 * big  # fp32 showed micro-batch 1 is 4x worse than predicted relative to 8
    assert 1.5 < big < 2.5
    assert Calibration().time_ratios(query).tolist() == [1.0, 1.0]


def test_time_calibration_keeps_each_split_modes_own_correction():
    import pandas as pd

    # measured as on the committed gpt-tiny grid: FSDP 2.2x slower than the prior, the pipeline 1.2x
    points = tuple(TimePoint("bf16", m, 4 // m // d, 0, 2, r, mode) for m in (1, 2)
                   for mode, d, r in (("fsdp", 2, 2.2), ("pipeline", 1, 1.2)))
    rows = [{"precision": "bf16", "micro_batch": 1, "grad_accum": 4, "checkpoint_every": 0, "device_split": 2,
             "split_mode": mode} for mode in ("pipeline", "fsdp")]
    pipeline, fsdp = Calibration(time_points=points).time_ratios(pd.DataFrame(rows))
    assert pipeline == pytest.approx(1.2, rel=0.05) and fsdp == pytest.approx(2.2, rel=0.05)
    # calibration data written before split modes were recorded reads as pipelines
    old = {"time_points": [{"precision": "fp32", "micro_batch": 1, "grad_accum": 4, "checkpoint_every": 0,
                            "device_split": 2, "ratio": 1.5}]}
    assert Calibration.from_dict(old).time_points[0].split_mode == "pipeline"


def test_an_offloaded_trials_time_corrects_offloaded_configs_only():
    import pandas as pd

    # the prior does not cost the host step: offloaded trials ran 3x slower than predicted, the others as predicted
    points = tuple(TimePoint("fp32", m, 1, 0, 1, r, offload=o) for m in (2, 4)
                   for o, r in (("none", 1.0), ("optimizer", 3.0)))
    rows = [{"precision": "fp32", "micro_batch": 2, "grad_accum": 1, "checkpoint_every": 0, "device_split": 1,
             "offload": o} for o in ("none", "optimizer")]
    plain, offloaded = Calibration(time_points=points).time_ratios(pd.DataFrame(rows))
    assert plain == pytest.approx(1.0, rel=0.05) and offloaded == pytest.approx(3.0, rel=0.05)
    # a table, or calibration data, from before the lever: on the device
    assert Calibration(time_points=points).time_ratios(pd.DataFrame(rows[:1]).drop(columns="offload"))[0] == \
        pytest.approx(plain)
    assert Calibration.from_dict({"time_points": [{"precision": "fp32", "micro_batch": 1, "grad_accum": 1,
                                                   "checkpoint_every": 0, "device_split": 1, "ratio": 1.0}]}
                                 ).time_points[0].offload == "none"


def test_calibration_round_trips_and_relative_error():
    cal = calibrate([_obs(pred=100, meas=110, pred_t=1.0, meas_t=3.0)])
    again = Calibration.from_dict(cal.to_dict())
    assert again == cal and again.time_points[0].ratio == pytest.approx(3.0)
    assert relative_error(90, 100) == pytest.approx(-0.1)
    assert relative_error(None, 100) is None and relative_error(1.0, None) is None


# --- stored trials as records ---------------------------------------------------------------------


def test_stored_trials_read_as_records():
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import create_trial

    from autofit.study import record_of

    config = TrainConfig("fp32", 2, 2)
    dists = {k: CategoricalDistribution([v]) for k, v in config.to_dict().items()}

    def stored(state, **attrs):
        value = 0.0 if state == TrialState.COMPLETE else None
        return create_trial(state=state, params=config.to_dict(), distributions=dists, user_attrs=attrs, value=value,
                            system_attrs={"constraints:peak_over_budget_bytes": 1.0} if value is not None else {})

    oom = record_of(stored(TrialState.COMPLETE, status="oom", measured={"error": "over"}))
    assert oom.status is TrialStatus.OOM and not oom.feasible and oom.measurement["error"] == "over"
    pruned = record_of(stored(TrialState.PRUNED, status="pruned", reason_kind="dominated", reason="why"))
    assert pruned.prune_reason is PruneReason.DOMINATED and pruned.reason == "why"
    newer = record_of(stored(TrialState.PRUNED, status="pruned", reason_kind="a-reason-from-the-future", reason="t"))
    assert newer.prune_reason is None and newer.reason == "t"  # the text still says why
    assert record_of(stored(TrialState.FAIL, status="running")).status is TrialStatus.INTERRUPTED
    assert record_of(stored(TrialState.WAITING)).status is TrialStatus.RUNNING
    assert record_of(stored(TrialState.COMPLETE)).status is TrialStatus.OK  # 0.1 wrote no status for some
    assert record_of(create_trial(state=TrialState.COMPLETE, params={"x": 1},
                                  distributions={"x": CategoricalDistribution([1])}, value=1.0)) is None
    # a record is frozen, its mappings too
    with pytest.raises(TypeError):
        oom.measurement["error"] = "changed"


# --- a search through an injected trial runner (no child processes) ---------------------------------


class FakeRunner:
    """Answers trials without running them: fp32 at micro-batch 4 runs out of memory, everything else
    fits at 1 MB, and amp-bf16 is three times as fast as fp32."""

    def __init__(self, interrupt_at: int | None = None) -> None:
        self.calls = []
        self.interrupt_at = interrupt_at

    def __call__(self, workload, config, *, device, budget_bytes, timeout_s, memory=True):
        from autofit.trial.run import TrialResult
        from autofit.trial.run import TrialStatus as Status

        self.calls.append((config, device, budget_bytes, timeout_s))
        if len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt
        if config.precision.value == "fp32" and config.micro_batch == 4:
            return TrialResult("tiny-lm", config, device, Status.OOM, error="over the budget", wall_s=1.0)
        rate = (30.0 if config.precision.value == "amp-bf16" else 10.0) * config.micro_batch
        return TrialResult("tiny-lm", config, device, Status.OK, peak_bytes=10**6, per_device_peak_bytes=[10**6],
                           samples_per_s=rate, step_time_s=4 / rate, wall_s=1.0, budget_bytes=budget_bytes)


SMALL_SPACE = {"precision": ["fp32", "amp-bf16"], "micro_batch": [2, 4], "global_batch": 4, "checkpoint_every": [0, 1]}


def test_a_search_runs_its_trials_through_the_injected_runner(tmp_path):
    from autofit.api.run_study import search
    from autofit.study import load_snapshot

    runner = FakeRunner()
    result = search(TINY, "64MB", space=SMALL_SPACE, out_dir=tmp_path / "s", device="cpu", patience=10,
                    trial_runner=runner)
    configs = [c for c, *_ in runner.calls]
    assert all(device == "cpu" and budget == 64_000_000 and 0 < limit <= 180 for _, device, budget, limit in runner.calls)
    stored = [r for r in load_snapshot(tmp_path / "s").records if r.status.ran]
    assert [r.config for r in stored] == configs and result.n_real == len(configs)
    measurements = [(r.config, r.sample) for r in stored]
    assert len(measurements) == len(set(measurements)), "a measurement was taken twice"
    records = {r.config: r for r in stored if r.sample == 1}
    # before answering, the leaders were measured a second time only if their noise bands overlap
    # (NOISE_MIN with one sample each): here the runner's best is alone, 2x the next
    from autofit.study.leaders import NOISE_MIN

    again = [r.config for r in stored if r.sample == 2]
    top = max(r.value for r in records.values() if r.feasible)
    leaders = [c for c, r in records.items() if r.feasible and r.value * (1 + NOISE_MIN) >= top]
    assert (len(leaders) > 1) == bool(again) and set(again) <= set(leaders)
    assert result.best_measured["samples"] == 1 + (result.best in again)
    fp32_4 = TrainConfig("fp32", 4, 1)
    if fp32_4 in records:  # what the runner said is what was stored
        assert records[fp32_4].status.value == "oom" and not records[fp32_4].feasible
    # the fastest the runner reported among what ran: amp-bf16 (3x) at the largest micro-batch that ran
    assert result.best.precision.value == "amp-bf16" and result.best_measured["samples_per_s"] == max(
        r.value for r in records.values() if r.feasible)
    assert (tmp_path / "s" / "trials.csv").is_file()


class ThroughputOnlyRunner:
    """Every config fits at 1 MB (2 MB with checkpointing) and runs 100 samples/s, so every leader's
    noise band overlaps the best's and they are measured again; a trial asked for throughput only
    (``memory=False``) reads no peak, as a real one does."""

    def __init__(self) -> None:
        self.calls: list[tuple[TrainConfig, bool]] = []

    def __call__(self, workload, config, *, device, budget_bytes, timeout_s, memory=True):
        from autofit.trial.run import TrialResult, TrialStatus

        self.calls.append((config, memory))
        peak = (2 if config.checkpoint_every else 1) * 10**6 if memory else None
        return TrialResult("tiny-lm", config, device, TrialStatus.OK, peak_bytes=peak,
                           per_device_peak_bytes=[peak] if peak else [], samples_per_s=100.0 + len(self.calls) / 100,
                           step_time_s=0.04, wall_s=1.0, budget_bytes=budget_bytes)


def test_a_remeasurement_times_throughput_only_and_keeps_its_first_trials_peak(tmp_path):
    """A config's first trial reads its memory; a re-measurement asks for throughput only, and its record
    carries the first trial's peak, marked so that calibration counts that peak once."""
    from autofit.api.run_study import search
    from autofit.estimator.calibration import observations
    from autofit.study import load_snapshot

    runner = ThroughputOnlyRunner()
    search(TINY, "64MB", space=SMALL_SPACE, out_dir=tmp_path / "s", device="cpu", patience=10, trial_runner=runner)
    firsts = [c for c, memory in runner.calls if memory]
    again = [c for c, memory in runner.calls if not memory]
    assert again and len(firsts) == len(set(firsts)) and set(again) <= set(firsts)
    assert all(runner.calls.index((c, True)) < runner.calls.index((c, False)) for c in again)
    records = [r for r in load_snapshot(tmp_path / "s").records if r.status.ran]
    first_of = {r.config: r for r in records if r.sample == 1}
    for r in (r for r in records if r.sample > 1):
        first = first_of[r.config]
        assert r.measurement["peak_bytes"] == first.measurement["peak_bytes"] > 0
        assert r.measurement["peak_from_trial"] == first.number and r.errors["peak"] is None and r.feasible
    counted = [o for o in observations(records, 64_000_000) if o.measured_peak_bytes is not None]
    assert len(counted) == len(first_of)
    table = pd.read_csv(tmp_path / "s" / "trials.csv")
    shown = dict(zip(table["number"], table["trial"]))
    remeasured = table[table["sample"] > 1]
    assert list(remeasured["peak_from_trial"]) == [shown[first_of[TrainConfig.from_dict(
        {k: row[k] for k in ("precision", "micro_batch", "grad_accum", "checkpoint_every")})].number]
        for row in remeasured.to_dict("records")]
    assert table.loc[table["sample"] == 1, "peak_from_trial"].isna().all()


def test_start_up_progress_says_what_was_computed_then_what_came_from_the_cache(tmp_path, monkeypatch):
    from autofit.api.run_study import search
    from autofit.probes import device_rates as time_model

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))  # cold: profile, device probe, layer timing
    fixed = time_model.DeviceRates("cpu", "test", 2, {"float32": 1e11, "bfloat16": 5e10, "float16": 1e9}, 1e10, 5e-6,
                                   0.0, "x")
    asked = []

    def measure_checked(device_type, dtypes=time_model.ALL_DTYPES):  # the probe's seconds spared
        asked.append(tuple(dtypes))
        return dataclasses.replace(fixed, matmul_flops_per_s={d: fixed.matmul_flops_per_s[d] for d in dtypes}), None

    monkeypatch.setattr(time_model, "measure_checked", measure_checked)
    space = {**SMALL_SPACE, "precision": ["fp32"], "micro_batch": [2], "checkpoint_every": [0]}
    runs = []
    for out in ("cold", "warm"):
        events = []
        search(TINY, "64MB", space=space, out_dir=tmp_path / out, device="cpu", trial_runner=FakeRunner(),
               progress=events.append)
        runs.append(events)
    cold, warm = ([e.message for e in events] for events in runs)
    assert cold[0] == "profiling tiny-lm on fake tensors (fp32)..."
    assert cold[1].startswith("profiled tiny-lm in ") and "traced fp32 (cache: " in cold[1]
    assert cold[2].startswith("study ")
    assert cold[3].startswith("probing the cpu's rates") and cold[4].startswith("probed the cpu in ")
    assert cold[4].startswith("probed the cpu in ") and "100.0 GFLOP/s fp32 matmul, 5.0 us per operator" in cold[4]
    assert asked == [("float32",)]  # an fp32 space: no other dtype's matmuls timed
    assert cold[5].startswith("timing one layer of the workload for real (fp32;")
    assert cold[6].startswith("timed the layer in ")
    assert "read from the cache" not in " ".join(cold)
    assert warm[0] == cold[0] and warm[1].startswith("profile of tiny-lm read from the cache in ")
    assert warm[3].startswith("cpu rates read from the cache (")
    assert warm[4].startswith("the workload's layer timings read from the cache (")
    assert not any(m.startswith(("probing", "timing", "profiled")) for m in warm)
    # the events from before the study is open say so (their counts are not read); then the writing of the reports
    for events in runs:
        assert [e.starting for e in events[:3]] == [True, True, False] and not any(e.starting for e in events[3:])
        assert events[-2].message == "writing the tables, the pictures and report.html..." and events[-1].done


def test_an_interrupted_trial_is_recorded_interrupted_and_the_interrupt_propagates(tmp_path):
    from autofit.api.run_study import search
    from autofit.core.errors import StudyError
    from autofit.study import load_snapshot

    with pytest.raises(KeyboardInterrupt):
        search(TINY, "64MB", space=SMALL_SPACE, out_dir=tmp_path / "s", device="cpu", trial_runner=FakeRunner(2))
    statuses = [r.status.value for r in load_snapshot(tmp_path / "s").records if r.status.value != "pruned"]
    assert len(statuses) == 2 and statuses[0] in ("ok", "oom") and statuses[1] == "interrupted"
    with pytest.raises(StudyError, match="a trial_runner runs in this process only"):
        search(TINY, "64MB", space=SMALL_SPACE, out_dir=tmp_path / "t", workers=2, trial_runner=FakeRunner())
    with pytest.raises(StudyError, match="device 'tpu': expected cpu or cuda"):
        search(TINY, "64MB", space=SMALL_SPACE, out_dir=tmp_path / "t", device="tpu")
    from trial_workloads import tiny_lm

    with pytest.raises(StudyError, match="workers > 1 needs a workload that other processes can load"):
        search(tiny_lm(), "64MB", space=SMALL_SPACE, out_dir=tmp_path / "t", workers=2)


# --- real searches -----------------------------------------------------------------------------------


def _load(out: Path) -> optuna.Study:
    from autofit.study import open_study

    return open_study(out)


def _trials_by_state(out: Path):
    try:
        return _load(out).get_trials(deepcopy=False)
    except Exception:  # noqa: BLE001 -- not created yet
        return []


@pytest.mark.slow
def test_kill_9_mid_search_then_the_same_command_resumes(tmp_path, write_space):
    space = write_space(tmp_path / "space.toml", precision=["fp32"], micro_batch=[4, 8], global_batch=8)
    out = tmp_path / "study"
    # tiny_lm's trials can end between two looks at the study: this one's last seconds
    command = [sys.executable, "-m", "autofit", "search", "--model", SLOW_TINY_LM, "--budget", "64MB", "--space", str(space),
               "--out", str(out), "--patience", "10"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed_number = None
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            trials = _trials_by_state(out)
            done = [t for t in trials if t.state == TrialState.COMPLETE]
            # signed by its worker: an unsigned one is only failed after ORPHAN_S (see is_stale)
            running = [t for t in trials if t.state == TrialState.RUNNING and t.user_attrs.get("worker")]
            if done and running:
                killed_number = running[0].number
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.2)
    finally:
        if proc.poll() is None and killed_number is None:
            proc.kill()
        proc.wait()
    assert killed_number is not None, "the search ended before a trial could be killed mid-way"
    before = {t.number: (t.params, t.value) for t in _trials_by_state(out) if t.state == TrialState.COMPLETE}
    assert before

    rerun = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    trials = _trials_by_state(out)
    after = {t.number: (t.params, t.value) for t in trials if t.state == TrialState.COMPLETE}
    assert {n: after[n] for n in before} == before  # finished trials kept as they were
    interrupted = next(t for t in trials if t.number == killed_number)
    from autofit.study import record_of

    assert interrupted.state == TrialState.FAIL and record_of(interrupted).status is TrialStatus.INTERRUPTED
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    real = [(tuple(sorted(t.params.items())), t.user_attrs.get("sample", 1)) for t in trials
            if t.state == TrialState.COMPLETE]
    assert len(real) == len(set(real)), "a measurement was taken twice"
    assert (out / "trials.csv").is_file() and (out / "summary.md").is_file()


@pytest.mark.slow
def test_two_workers_share_a_study_without_losing_or_repeating_a_trial(tmp_path):
    from autofit.api.run_study import search

    # one config per precision is explored first whatever the predictions: both workers get trials
    space = {"precision": ["fp32", "amp-bf16", "bf16"], "micro_batch": [4, 8], "global_batch": 8,
             "checkpoint_every": [0, 1], "device_split": [1, 2]}
    result = search(TINY, "64MB", space=space, workers=2, out_dir=tmp_path / "study", patience=10)
    trials = _load(tmp_path / "study").get_trials(deepcopy=False)
    assert [t.number for t in trials] == list(range(len(trials)))
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.FAIL, TrialState.WAITING)]
    real = [t for t in trials if t.state == TrialState.COMPLETE]
    keys = [tuple(sorted(t.params.items())) for t in real]
    measurements = [(k, t.user_attrs.get("sample", 1)) for k, t in zip(keys, real)]
    assert len(measurements) == len(set(measurements)), "a measurement was taken twice"
    assert len({t.user_attrs["worker"]["pid"] for t in real}) == 2, "both workers ran trials"
    pruned = {tuple(sorted(t.params.items())) for t in trials if t.state == TrialState.PRUNED}
    assert len(pruned) == len([t for t in trials if t.state == TrialState.PRUNED]), "a config pruned twice"
    assert result.n_real == len(real) and result.n_pruned == len(pruned - set(keys))
    assert result.n_real >= 3 and len(set(keys)) + result.n_pruned <= result.n_configs == 24  # re-measured: one key
    assert result.best is not None and result.best_measured["peak_bytes"] < 64_000_000
    assert all((tmp_path / "study" / f"worker-{w}.log").is_file() for w in range(2))


def test_fsdp_beside_pipeline_in_the_planner(tiny_profile, rates):
    planner = make_planner(tiny_profile, rates, devices=8, precision=["fp32"], micro_batch=[1], global_batch=8,
                           checkpoint_every=[0, 1], device_split=[2, 8], split_mode=["pipeline", "fsdp"])
    step = planner.step([])
    configs, found = planner.configs, kinds(step)
    # 8 FSDP ranks on a 4-layer model can run (8 pipeline stages cannot); each checkpoint interval
    # competes only within its own split mode
    assert any(c.device_split == 8 and c.split_mode.value == "fsdp" and i not in found.get("invalid", [])
               for i, c in enumerate(configs))
    for i in found.get("dominated", []):
        text = next(p.text for p in step.prunes if p.index == i)
        assert "checkpoint_every 0" in text
    # the objective fills the 8 devices: a 2-rank FSDP config counts 4 replicas
    two = planner.index[TrainConfig("fp32", 1, 4, 0, 2, "fsdp")]
    prediction = planner.prediction(two, Calibration.prior())
    assert prediction["objective"] == pytest.approx(4 * prediction["samples_per_s"])


@pytest.mark.slow
def test_four_local_workers_on_the_journal_with_reports_while_they_run(tmp_path):
    """Four workers of one search on the default journal, `autofit report` read again and again
    while they run: every trial accounted for, each config once, one best however it is read."""
    import json

    from autofit.study import load_snapshot

    out = tmp_path / "study"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def autofit(*argv):
        return subprocess.Popen([sys.executable, "-m", "autofit", *argv], cwd=tmp_path, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    search = autofit("search", "--model", TINY, "--budget", "64MB", "--space", "tiny", "--device", "cpu", "--out",
                     str(out), "--workers", "4", "--trials", "5", "--patience", "10", "--json")
    during = 0
    while search.poll() is None:
        if not (out / "study.json").is_file():
            time.sleep(0.5)
            continue
        report = autofit("report", str(out), "--json")
        text, err = report.communicate(timeout=120)
        assert report.returncode == 0 and "Traceback" not in err, err[-2000:]
        assert "best" in json.loads(text)
        during += search.poll() is None
    text, err = search.communicate(timeout=600)
    assert search.returncode == 0, err[-3000:]
    assert during, "no report finished while the workers ran"
    trials = _load(out).get_trials(deepcopy=False)
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.FAIL, TrialState.WAITING)]
    real = [(tuple(sorted(t.params.items())), t.user_attrs.get("sample", 1)) for t in trials
            if t.state == TrialState.COMPLETE]
    assert 1 <= len(real) == len(set(real)), "a measurement was taken twice"
    snapshot_best = next(r.config.to_dict() for r in load_snapshot(out).records
                         if r.number == json.loads(text)["best_number"])
    report = autofit("report", str(out), "--json")
    after = json.loads(report.communicate(timeout=120)[0])["best"]
    assert json.loads(text)["best"] == snapshot_best == after["config"]


def test_a_kind_no_trial_vouches_for_is_ruled_out_only_by_the_measured_cross_margin(tiny_profile, rates):
    """A precision that has not run is dropped once the calibrated model's error across kinds has been
    measured (another kind's first trial) and even that much faster it would not beat the best; before
    that, it keeps its trial unless it is ten times too slow (the next test). The margin is the measured
    error, at least CROSS_MARGIN_MIN."""
    from autofit.study.planner import CROSS_MARGIN_MIN, cross_margin
    planner = make_planner(tiny_profile, rates, precision=["fp32", "amp-bf16"], micro_batch=[2, 4],
                           global_batch=4, checkpoint_every=[0, 1])
    # asking a 25% gain: amp-bf16 is predicted at ~0.8x fp32 here, so the margin decides
    planner = Planner(dataclasses.replace(planner.settings, min_improvement=0.25), tiny_profile, rates)
    prior = {c: planner.prediction(planner.index[c], Calibration.prior())["samples_per_s"] for c in planner.configs}
    with_error = lambda r, e: dataclasses.replace(r, errors={"step_time": e})  # noqa: E731
    fast, fast_ckpt = TrainConfig("fp32", 4, 1), TrainConfig("fp32", 4, 1, checkpoint_every=1)
    amp = [c for c in planner.configs if c.precision == "amp-bf16"]
    trials = [with_error(ran_trial(planner, fast, 0, samples_per_s=10 * prior[fast]), -0.9)]
    step = planner.step(trials)
    assert cross_margin(trials) is None
    assert not {planner.configs[p.index] for p in step.prunes if p.reason.value in ("slow_precision", "too_slow")} & set(amp)
    # the other side of checkpointing is a kind of its own: its first trial measures the error across kinds
    trials.append(with_error(ran_trial(planner, fast_ckpt, 1, samples_per_s=10 * prior[fast_ckpt]), 0.05))
    assert cross_margin(trials) == CROSS_MARGIN_MIN
    calibration = planner.step(trials).calibration
    best_amp = max(planner.prediction(planner.index[c], calibration)["samples_per_s"] for c in amp)
    best = 10 * prior[fast]
    bar = best * 1.25
    assert best_amp * (1 + CROSS_MARGIN_MIN) < bar  # the premise: amp-bf16 is ruled out at that margin
    pruned = {planner.configs[p.index]: p for p in planner.step(trials).prunes}
    assert all(pruned[c].reason in (PruneReason.SLOW_PRECISION, PruneReason.DOMINATED) for c in amp)
    assert pruned[amp[0]].reason is PruneReason.SLOW_PRECISION
    assert "30% faster (the time model's measured error across precisions, layouts and checkpointing)" in pruned[amp[0]].text
    # a wider measured error across kinds widens the margin: at 10x it no longer rules amp-bf16 out
    trials[1] = with_error(trials[1], 9.0)
    assert cross_margin(trials) == 9.0 and best_amp * 10 > bar
    assert not {planner.configs[p.index] for p in planner.step(trials).prunes
                if p.reason.value in ("slow_precision", "too_slow")} & set(amp)


@pytest.mark.parametrize("bf16_flops, ruled_out", [(3e7, True), (1e8, False)])
def test_before_the_error_across_kinds_is_measured_only_a_kind_ten_times_too_slow_is_ruled_out(tiny_profile,
                                                                                           bf16_flops, ruled_out):
    """A bf16 matmul rate that makes amp-bf16 ~15x slower than fp32 here (not the 20x that prunes before
    any trial) costs it its trial once fp32 has run: even CROSS_MARGIN_PRIOR faster it would not beat the
    best measured. At ~5.5x slower it keeps its trial, which then measures the error across kinds."""
    from autofit.probes.device_rates import DeviceRates
    from autofit.study.planner import CROSS_MARGIN_PRIOR, cross_margin

    slow_bf16 = DeviceRates("cpu", "test", 2, {"float32": 1e11, "bfloat16": bf16_flops, "float16": 1e9}, 1e10, 5e-6,
                            0.0, "x")
    planner = make_planner(tiny_profile, slow_bf16, precision=["fp32", "amp-bf16"], micro_batch=[2, 4],
                           global_batch=4)
    amp = {c for c in planner.configs if c.precision.value == "amp-bf16"}
    step = planner.step([])
    first = planner.configs[step.run]
    assert first.precision.value == "fp32" and not {planner.configs[p.index] for p in step.prunes} & amp
    measured = planner.prediction(planner.index[first], Calibration.prior())["samples_per_s"]
    trials = [ran_trial(planner, first, 0, samples_per_s=measured)]
    assert cross_margin(trials) is None
    step = planner.step(trials)
    best_amp = max(planner.prediction(planner.index[c], step.calibration)["samples_per_s"] for c in amp)
    assert (best_amp * (1 + CROSS_MARGIN_PRIOR) < measured) == ruled_out  # the premise
    slow = {planner.configs[p.index]: p for p in step.prunes
            if p.reason in (PruneReason.SLOW_PRECISION, PruneReason.TOO_SLOW)}
    if ruled_out:
        assert amp <= set(slow)
        assert "900% faster (the widest error across precisions, layouts and checkpointing allowed before it is " \
               "measured)" in slow[next(iter(amp))].text
    else:
        assert not amp & set(slow)


def test_a_checkpointed_trial_does_not_vouch_for_its_precision_without_checkpointing(tiny_profile, rates):
    """Checkpointing's cost is one term of the calibration, fitted from whichever side ran: a
    precision whose only trial checkpointed is judged without checkpointing by the margin across
    kinds, not its group's (the committed convnet-bn grid at 24 MiB: bf16's checkpointed trial ruled
    out bf16 without checkpointing, the optimum)."""
    from autofit.study.planner import (
        CROSS_MARGIN_MIN,
        TIME_MARGIN_MIN,
        cross_margin,
        time_margin,
    )

    planner = make_planner(tiny_profile, rates, precision=["fp32", "amp-bf16"], micro_batch=[2, 4], global_batch=4,
                           checkpoint_every=[0, 1])
    prior = {c: planner.prediction(planner.index[c], Calibration.prior())["samples_per_s"] for c in planner.configs}
    ran = [TrainConfig("fp32", 4, 1), TrainConfig("fp32", 2, 2), TrainConfig("amp-bf16", 4, 1, checkpoint_every=1)]
    trials = [dataclasses.replace(ran_trial(planner, c, k, samples_per_s=prior[c]), errors={"step_time": 0.0})
              for k, c in enumerate(ran)]
    assert time_margin(trials) == TIME_MARGIN_MIN and cross_margin(trials) == CROSS_MARGIN_MIN
    step = planner.step(trials)
    plain = [c for c in planner.configs if c.precision == "amp-bf16" and c.checkpoint_every == 0]
    top = max(planner.prediction(planner.index[c], step.calibration)["samples_per_s"] for c in plain)
    bar = max(r.value for r in trials) * (1 + planner.settings.min_improvement)
    # the premise: within its group's margin amp-bf16 without checkpointing would be ruled out, across kinds not
    assert top * (1 + TIME_MARGIN_MIN) < bar <= top * (1 + CROSS_MARGIN_MIN)
    slow = {planner.configs[p.index] for p in step.prunes if p.reason.value in ("slow_precision", "too_slow")}
    best_plain = TrainConfig("amp-bf16", 4, 1)
    assert planner.prediction(planner.index[best_plain], step.calibration)["samples_per_s"] == top
    assert best_plain not in slow and planner.configs[step.run] == best_plain


def test_the_planner_gives_the_leaders_rule_its_calibrated_predictions(tiny_profile, rates, monkeypatch):
    """A config measured once is a leader also where its calibrated prediction reaches the best
    (autofit.study.leaders): the planner passes the prediction of every config that ran, as it ranks them."""
    import autofit.study.planner as planner_module

    planner = make_planner(tiny_profile, rates, precision=["fp32"], micro_batch=[4, 8], global_batch=8)
    a, b = TrainConfig("fp32", 8, 1), TrainConfig("fp32", 4, 2)
    trials = [ran_trial(planner, a, 0, samples_per_s=100.0), ran_trial(planner, b, 1, samples_per_s=60.0)]
    seen = {}
    real = planner_module.remeasurements
    monkeypatch.setattr(planner_module, "remeasurements",
                        lambda records, by_config, index, predicted, min_improvement: seen.update(
                            predicted, min_improvement=min_improvement) or real(
                            records, by_config, index, predicted, min_improvement))
    step = planner.step(trials)
    calibration = step.calibration
    # and the study's min_improvement: a challenger must be able to beat the best by it to be measured again
    assert seen.pop("min_improvement") == planner.settings.min_improvement
    assert set(seen) == {a, b}
    for config in (a, b):
        assert seen[config] == pytest.approx(planner.prediction(planner.index[config], calibration)["objective"])

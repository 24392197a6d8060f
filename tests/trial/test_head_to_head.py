"""Configs of one build timed together in one process, their steps interleaved: the measurement itself and
its isolated child; and a real search, which measures its leaders in trials of their own instead."""

from __future__ import annotations

import pandas as pd
import pytest

from autofit.core.config import TrainConfig
from autofit.runtime.schedule import MeasureSchedule
from autofit.trial.head_to_head import check_shared_build, measure_head_to_head
from autofit.trial.run import run_head_to_head
from autofit.workloads.load import load_workload

TINY = "tests/trial_workloads.py:tiny_lm"
SCHEDULE = MeasureSchedule(timed_steps=3)


def _configs(*micro_batches: int, precision: str = "fp32") -> list[TrainConfig]:
    return [TrainConfig.parse(f"precision={precision},micro_batch={m},grad_accum={4 // m}") for m in micro_batches]


def test_configs_of_one_build_are_timed_in_turn_on_one_model(one_thread):
    results = measure_head_to_head(load_workload(TINY), _configs(1, 2, 4), schedule=SCHEDULE)
    assert [TrainConfig.from_dict(r["config"]) for r in results] == _configs(1, 2, 4)
    for config, r in zip(_configs(1, 2, 4), results):
        assert r["status"] == "ok" and r["peak_bytes"] is None  # time only: each config's own trial measured memory
        assert r["timed_steps"] >= SCHEDULE.timed_steps and r["samples_per_s"] > 0
        assert r["step_time_s"] == pytest.approx(config.grad_accum * r["micro_step_time_s"] + r["optimizer_step_time_s"])
        assert r["samples_per_s"] == pytest.approx(config.samples_per_step / r["step_time_s"])


@pytest.mark.parametrize("configs, why", [
    (_configs(2), "two or more"),
    (_configs(2, 2), "two or more"),
    (_configs(2) + _configs(4, precision="amp-bf16"), "one build"),
    ([TrainConfig.parse("micro_batch=2,grad_accum=2"), TrainConfig.parse("micro_batch=2,grad_accum=2,checkpoint_every=1")],
     "one build"),
    (_configs(2) + [TrainConfig.parse("micro_batch=4,grad_accum=1,device_split=2")], "one build"),
])
def test_only_distinct_configs_of_one_build_on_one_device_go_head_to_head(configs, why):
    with pytest.raises(ValueError, match=why):
        check_shared_build(configs)


def test_the_isolated_child_answers_each_config_or_the_same_failure_for_all():
    results = run_head_to_head(TINY, _configs(2, 4), timeout_s=120, schedule=SCHEDULE)
    assert [r.config for r in results] == _configs(2, 4)
    assert all(r.ok and r.samples_per_s > 0 and r.peak_bytes is None and r.wall_s > 0 for r in results)
    failed = run_head_to_head("tests/trial_workloads.py:no_such_model", _configs(2, 4), timeout_s=60)
    assert [r.status.value for r in failed] == ["error", "error"] and all("no_such_model" in r.error for r in failed)


def test_a_search_measures_its_leaders_in_trials_of_their_own_and_reports_one_figure(tmp_path, monkeypatch, capsys):
    """Every config a leader (the noise floor made huge): the two configs of the one build are measured again,
    each in a trial of its own with its own peak, never head to head; the answer, the tables, the headline and
    the picture's star show the answer's best sample and say so in the same words."""
    from autofit.api.run_study import search
    from autofit.cli import main
    from autofit.cli.search import _summary
    from autofit.core.records import best_of, best_sample
    from autofit.report.pictures import throughput_vs_peak
    from autofit.report.tables import trials_table
    from autofit.study import leaders, load_snapshot

    monkeypatch.setattr(leaders, "NOISE_MIN", 10.0)
    space = {"precision": ["fp32"], "micro_batch": [2, 4], "global_batch": 4, "checkpoint_every": [0]}
    result = search(TINY, "64MB", space=space, out_dir=tmp_path / "s", device="cpu")
    ran = [r for r in load_snapshot(tmp_path / "s").records if r.status.ran]
    own = {r.config: r for r in ran if r.sample == 1}
    again = [r for r in ran if r.sample == 2]
    assert len(own) == 2 and {r.config for r in again} == set(own)
    for r in again:  # a trial of its own: its own peak, no head-to-head
        assert r.measurement["peak_bytes"] and r.measurement.get("head_to_head") is None
    best = best_of(ran)
    samples = [r for r in ran if r.config == best.config]
    assert result.best == best.config and best == best_sample(samples)
    assert result.best_measured["samples_per_s"] == pytest.approx(best.measurement["samples_per_s"])
    trials = pd.read_csv(tmp_path / "s" / "trials.csv")
    assert (trials["sample"] == 2).sum() == 2 and trials["head_to_head"].isna().all()
    figure = f"{best.measurement['samples_per_s']:,.2f} samples/s"
    basis = f"best of {len(samples)} samples; their median"
    capsys.readouterr()
    _summary(result)
    headline = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("throughput"))
    assert figure in headline and basis in headline
    assert main(["report", str(tmp_path / "s")]) == 0
    reported = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("best:"))
    assert figure in reported and basis in reported
    summary = (tmp_path / "s" / "summary.md").read_text()
    assert f"the figure above is {basis}" in summary and "head-to-head" not in summary
    snapshot = load_snapshot(tmp_path / "s")
    table = trials_table(snapshot)
    fig = throughput_vs_peak(table, snapshot.settings["budget_bytes"], best.number, snapshot.study_name)
    (star,) = [c for c in fig.axes[0].collections if c.get_gid() == "best"]
    assert star.get_label() == f"best: trial {int(table.loc[table['number'] == best.number, 'trial'].iloc[0])}"
    assert star.get_offsets()[0][1] == pytest.approx(best.value)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_on_cuda_each_step_is_timed_by_its_events_too():
    results = run_head_to_head(TINY, _configs(2, 4), device="cuda", timeout_s=300, schedule=SCHEDULE)
    assert all(r.ok and r.device_step_s is not None and r.device_step_s > 0 for r in results)

"""Leaders of one build timed together in one process, their steps interleaved: the measurement itself,
its isolated child, and a real search that crowns its best from it."""

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


def test_a_search_times_its_leaders_head_to_head_and_reports_that_figure(tmp_path, monkeypatch, capsys):
    """Every config a leader (the noise floor made huge): the two configs of the one build are timed
    together after their own trials; that head-to-head orders them, and the answer, the tables, the
    headline and the picture's star show the winner's best sample and say so in the same words."""
    from autofit.api.run_study import search
    from autofit.cli import main
    from autofit.cli.search import _summary
    from autofit.core.records import best_of, best_sample, reach
    from autofit.report.pictures import throughput_vs_peak
    from autofit.report.tables import trials_table
    from autofit.study import leaders, load_snapshot

    monkeypatch.setattr(leaders, "NOISE_MIN", 10.0)
    space = {"precision": ["fp32"], "micro_batch": [2, 4], "global_batch": 4, "checkpoint_every": [0]}
    result = search(TINY, "64MB", space=space, out_dir=tmp_path / "s", device="cpu")
    ran = [r for r in load_snapshot(tmp_path / "s").records if r.status.ran]
    own = {r.config: r for r in ran if r.sample == 1}
    together = [r for r in ran if r.sample == 2]
    assert len(own) == 2 and {r.config for r in together} == set(own)
    assert len({r.measurement["head_to_head"] for r in together}) == 1
    for r in together:  # its memory is its own trial's, said so
        assert r.measurement["peak_bytes"] == own[r.config].measurement["peak_bytes"]
        assert r.measurement["peak_from_trial"] == own[r.config].number
    best = best_of(ran)
    winner = max(together, key=lambda r: (reach(r), -r.number))  # reach: a starved sample's raised figure
    assert result.best == best.config == winner.config
    assert best == best_sample([r for r in ran if r.config == winner.config])
    assert result.best_measured["samples_per_s"] == pytest.approx(best.measurement["samples_per_s"])
    trials = pd.read_csv(tmp_path / "s" / "trials.csv")
    h2h = trials[trials["sample"] == 2]
    assert len(h2h) == 2 and h2h["head_to_head"].nunique() == 1
    assert h2h["head_to_head"].iloc[0] == h2h["trial"].min()  # numbered as the user reads trials
    figure = f"{best.measurement['samples_per_s']:,.2f} samples/s"
    basis = "best of 2 samples; their median"
    capsys.readouterr()
    _summary(result)
    headline = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("throughput"))
    assert figure in headline and basis in headline
    assert main(["report", str(tmp_path / "s")]) == 0
    reported = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("best:"))
    assert figure in reported and basis in reported
    summary = (tmp_path / "s" / "summary.md").read_text()
    assert f"the figure above is {basis}" in summary and "that head-to-head orders them" in summary
    snapshot = load_snapshot(tmp_path / "s")
    table = trials_table(snapshot)
    fig = throughput_vs_peak(table, snapshot.settings["budget_bytes"], best.number, snapshot.study_name)
    (star,) = [c for c in fig.axes[0].collections if c.get_gid() == "best"]
    where = ", timed head to head" if best in together else ""
    assert star.get_label() == f"best: trial {int(table.loc[table['number'] == best.number, 'trial'].iloc[0])}{where}"
    assert star.get_offsets()[0][1] == pytest.approx(best.value)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_on_cuda_each_step_is_timed_by_its_events_too():
    results = run_head_to_head(TINY, _configs(2, 4), device="cuda", timeout_s=300, schedule=SCHEDULE)
    assert all(r.ok and r.device_step_s is not None and r.device_step_s > 0 for r in results)

"""Result tables from a study's storage: a hand-made study with every kind of trial (no training)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest
from optuna.trial import TrialState, create_trial

from autofit.cli import main
from autofit.core.config import TrainConfig
from autofit.core.errors import StudyError
from autofit.core.space import space_from_dict
from autofit.report.result import search_result
from autofit.report.summary import summary_markdown
from autofit.report.tables import (
    COLUMNS,
    best_record,
    counts,
    select,
    trials_table,
)
from autofit.report.write import write_reports
from autofit.study import (
    StudySettings,
    create_or_load,
    distributions,
    load_snapshot,
    open_study,
    space_to_dict,
)

BUDGET = 1_000_000
SPACE = {"precision": ["fp32", "amp-bf16"], "micro_batch": [2, 4], "global_batch": 4, "device_split": [1, 2]}


def _trial(config: TrainConfig, state, status, value=None, peak=None, over=-1.0, **attrs):
    predicted = {"peak_bytes": 500_000, "calibrated_peak_bytes": 500_000, "step_time_s": 0.5,
                 "prior_step_time_s": 0.25, "samples_per_s": 8.0, "per_device_peak_bytes": [500_000],
                 "activations_bytes": 100_000}
    user_attrs = {"status": status, "predicted": predicted, **attrs}
    system_attrs = {}
    if state == TrialState.COMPLETE:
        ok = status == "ok"
        user_attrs["measured"] = {"peak_bytes": peak, "samples_per_s": value if ok else None,
                                  "step_time_s": 4 / value if ok else None, "tokens_per_s": None, "wall_s": 3.0,
                                  "error": None if ok else f"{status}!"}
        user_attrs["errors"] = {"peak": (500_000 - peak) / peak if peak else None, "step_time": 0.1,
                                "prior_step_time": -0.5}
        system_attrs = {"constraints:peak_over_budget_bytes": over, "constraints:failed": 0.0 if ok else 1.0}
    return dict(state=state, params=config.to_dict(), user_attrs=user_attrs, system_attrs=system_attrs,
                value=(value if status == "ok" else 0.0) if state == TrialState.COMPLETE else None)


@pytest.fixture
def study_dir(tmp_path):
    space = space_from_dict(dict(SPACE))
    settings = StudySettings(workload_name="tiny", workload_source="tiny.py:make", budget_bytes=BUDGET,
                             budget_text="1MB", space=space_to_dict(space), device_type="cpu", devices=1,
                             study_name="report-test", out_dir=str(tmp_path / "study"), command="autofit search ...")
    study = create_or_load(settings)
    dists = distributions(space)
    c = lambda prec, mb, split=1: TrainConfig(prec, mb, 4 // mb, 0, split)  # noqa: E731
    rows = [
        _trial(c("fp32", 2, 2), TrialState.PRUNED, "pruned", reason_kind="devices", reason="needs 2 devices"),
        _trial(c("fp32", 4), TrialState.COMPLETE, "ok", value=10.0, peak=600_000),
        _trial(c("amp-bf16", 4), TrialState.COMPLETE, "ok", value=30.0, peak=1_200_000, over=200_000.0),  # over
        _trial(c("amp-bf16", 2), TrialState.COMPLETE, "oom", over=1.0),
        _trial(c("fp32", 2), TrialState.COMPLETE, "ok", value=20.0, peak=400_000),
        _trial(c("amp-bf16", 2, 2), TrialState.COMPLETE, "timeout"),
    ]
    for row in rows:
        study.add_trial(create_trial(distributions=dists, **row))
    study.set_user_attr("runs", [{"wall_s": 65.0}, {"wall_s": 10.0}])
    study.set_user_attr("stop_reason", "patience: test")
    return tmp_path / "study"


def test_trials_table_has_one_row_per_trial_with_statuses_and_errors(study_dir):
    table = trials_table(load_snapshot(study_dir))
    assert list(table.columns) == list(COLUMNS)
    assert table["status"].tolist() == ["pruned", "ok", "ok", "oom", "ok", "timeout"]
    assert table.loc[0, "reason_kind"] == "devices" and table.loc[0, "reason"] == "needs 2 devices"
    assert table.loc[1, "measured_peak_bytes"] == 600_000 and table.loc[1, "predicted_peak_bytes"] == 500_000
    assert table.loc[1, "peak_error"] == pytest.approx(-1 / 6)
    assert table.loc[4, "samples_per_s"] == 20.0 and table.loc[4, "step_time_s"] == pytest.approx(0.2)
    assert select(table, status="ok")["number"].tolist() == [2, 4, 1]  # fastest first
    assert select(table, top=2)["number"].tolist() == [2, 4]


def test_best_is_the_fastest_trial_that_ran_ok_under_the_budget(study_dir):
    best = best_record(load_snapshot(study_dir))
    assert best["trial"] == 4  # 30 samples/s went over the budget; 20 is the best that fits
    assert best["config"] == TrainConfig("fp32", 2, 2).to_dict()
    assert best["peak_fraction_of_budget"] == pytest.approx(0.4)
    assert best["reproduce"] == ("autofit measure --model tiny.py:make --config precision=fp32,micro_batch=2,"
                                 "grad_accum=2,checkpoint_every=0,device_split=1,split_mode=pipeline --budget 1MB --device cpu")


def test_summary_and_files(study_dir):
    study = load_snapshot(study_dir)
    c = counts(trials_table(study))
    assert c["real"] == 5 and c["pruned"] == 1 and c["pruned_by_reason"] == {"devices": 1}
    text = summary_markdown(study)
    for part in ("# Search summary: report-test", "## Best config", "`fp32 mb=2 ga=2 ckpt=0 split=1` (trial 4)",
                 "## Pruned by the estimate", "| devices | 1 | a device split over", "## Calibration",
                 "## Prediction error of every real trial", "wall time: 1m15s over 2 search command(s)",
                 "not tried: 2", "torch:"):
        assert part in text, part
    paths = write_reports(study, study_dir)
    assert json.loads(paths["best.json"].read_text())["trial"] == 4
    assert paths["trials.csv"].read_text().splitlines()[0].startswith("trial,number,status,sample,head_to_head,reason_kind,reason,")
    assert json.loads(paths["calibration.json"].read_text())["peak_ratio"] > 0
    result = search_result(study, study_dir)
    assert result.best == TrainConfig("fp32", 2, 2) and result.n_real == 5 and result.n_pruned == 1
    assert result.plan().grad_accum == 2


def test_the_best_is_the_highest_best_sample_and_every_table_shows_that_sample(study_dir, capsys):
    """Load only ever slows a trial down: a config is ranked by its best sample, and the headline,
    best.json, summary.md, the top table (one row per config) and the API all show that sample."""
    study = open_study(study_dir)
    dists = distributions(space_from_dict(dict(SPACE)))
    fp32_4, fp32_2 = TrainConfig("fp32", 4, 1), TrainConfig("fp32", 2, 2)
    # re-measured: fp32 mb=4 at 26 and 28 (samples 10, 26, 28: best 28, trial 7);
    # fp32 mb=2 at 12 (samples 20, 12: best 20): the crown moves to fp32 mb=4
    for config, value, sample in ((fp32_4, 26.0, 2), (fp32_4, 28.0, 3), (fp32_2, 12.0, 2)):
        study.add_trial(create_trial(distributions=dists, **_trial(config, TrialState.COMPLETE, "ok", value=value,
                                                                  peak=600_000, sample=sample)))
    snapshot = load_snapshot(study_dir)
    best = best_record(snapshot)
    assert best["trial"] == 7 and best["measured"]["samples_per_s"] == 28.0
    assert best["median_samples_per_s"] == 26.0 and best["sample_spread"] == pytest.approx(28 / 26 - 1)
    assert [x["samples_per_s"] for x in best["samples"]] == [10.0, 26.0, 28.0]
    summary = summary_markdown(snapshot)
    assert "- throughput: 28.00 samples/s" in summary
    assert "measured 3 times: 10.00, 26.00, 28.00 samples/s" in summary
    top = summary.split("## Top 10 configs")[1].split("\n\n")[1]
    rows = [line for line in top.splitlines() if line.startswith("| ") and "trial" not in line]
    assert len(rows) == len({r.split("|")[2] for r in rows})  # one row per config
    assert rows[0].split("|")[1].strip() == "7" and "28.00" in rows[0]
    assert trials_table(snapshot)["sample"].tolist() == [1, 1, 1, 1, 1, 1, 2, 3, 2]
    result = search_result(snapshot, study_dir)
    assert result.best_trial == 7 and result.best_measured["samples_per_s"] == 28.0
    assert result.best_measured["samples"] == 3
    assert main(["report", str(study_dir), "--no-write"]) == 0
    assert "(trial 7): 28.00 samples/s, peak 585.94 KiB (best of 3 samples; their median 26.00)" in \
        capsys.readouterr().out


def test_report_command(study_dir, capsys):
    assert main(["report", str(study_dir), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "report-test: 5 real trials, 1 configs pruned by the estimate (never ran)" in out
    assert "best: fp32 mb=2 ga=2 ckpt=0 split=1 (trial 4)" in out and "reproduce: autofit measure" in out
    assert main(["report", str(study_dir), "--status", "oom", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [t["number"] for t in data["trials"]] == [3] and data["best"]["trial"] == 4
    assert main(["report", str(study_dir), "--summary", "--no-write"]) == 0
    assert "## Best config" in capsys.readouterr().out


def test_report_of_a_directory_without_a_study(tmp_path, capsys):
    with pytest.raises(StudyError, match="no study here"):
        open_study(tmp_path)
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("autofit: error: ")


def test_report_of_a_study_without_a_finished_trial(tmp_path, capsys):
    space = space_from_dict(dict(SPACE))
    settings = StudySettings(workload_name="tiny", workload_source="tiny.py:make", budget_bytes=BUDGET,
                             budget_text="1MB", space=space_to_dict(space), device_type="cpu", devices=1,
                             study_name="fresh", out_dir=str(tmp_path / "fresh"), command="autofit search ...")
    create_or_load(settings)  # a search that has not finished a trial yet
    assert main(["report", settings.out_dir]) == 0
    out = capsys.readouterr().out
    assert "fresh: 0 real trials" in out and out.rstrip().endswith("best: none (no trial ran ok under the budget yet)")
    assert main(["export", settings.out_dir, "--to", "hf"]) == 2
    assert capsys.readouterr().err.strip() == ("autofit: error: study fresh: no config ran under the budget yet; "
                                               "nothing to export (pass --config to export one anyway)")


def test_a_study_cannot_be_resumed_with_another_budget(study_dir):
    import dataclasses

    settings = StudySettings.from_json(json.dumps({
        **{k: v for k, v in open_study(study_dir).user_attrs["settings"].items()}, "budget_bytes": 2 * BUDGET}))
    with pytest.raises(StudyError, match="another budget_bytes"):
        create_or_load(dataclasses.replace(settings, out_dir=str(study_dir)))


def test_a_journal_written_by_autofit_0_1_reads_the_same(tmp_path):
    """tests/data/journal-autofit-0.1 is a gpt-tiny 8 GB study written by autofit 0.1 (user attrs, no
    split_mode param), with the tables that version wrote."""
    import shutil

    import pandas as pd

    example = Path(__file__).resolve().parents[1] / "data" / "journal-autofit-0.1"
    shutil.copy(example / "study.journal", tmp_path / "study.journal")  # reading takes a lock file beside it
    shutil.copy(example / "study.json", tmp_path / "study.json")
    study = load_snapshot(tmp_path)
    statuses = [r.status.value for r in study.records]
    assert len(statuses) == 315 and statuses.count("pruned") == 308 and statuses.count("ok") == 7
    assert {r.prune_reason.value for r in study.records if r.prune_reason} == {"devices", "dominated"}
    best = json.loads((example / "best.json").read_text())
    # the committed best.json (0.1) named Optuna's number; now that is "number", and "trial" counts real trials
    assert best_record(study)["number"] == best["trial"] == 309 and best_record(study)["trial"] == 2
    assert best_record(study)["measured"]["samples_per_s"] == best["measured"]["samples_per_s"]
    # the committed table, rebuilt from the journal (columns added since are not compared)
    table = pd.read_csv(io.StringIO(trials_table(study).to_csv(index=False)))
    committed = pd.read_csv(example / "trials.csv")
    committed["status"] = committed["status"].replace({"complete": "ok", "failed": "interrupted"})  # 0.1's words
    pd.testing.assert_frame_equal(table[list(committed.columns)], committed, check_dtype=False)


@pytest.mark.parametrize("source", [
    "hf:gpt2?n_layer=2&n_embd=64&n_head=2&vocab_size=128#seq_len=16#task=causal-lm",
    "hf:llama?num_hidden_layers=2#seq_len=32#task=causal-lm#lora=r=8,alpha=16,target=q_proj+v_proj",
    "hf:bert#task=seq-cls",
    "tiny.py:make",
])
def test_reproduce_command_is_in_the_cli_flags_and_parses_back_to_the_workload(source):
    """hf: options are written as --seq-len/--task/--lora (the command line's own syntax), not as the
    '#seq_len=...' source; parsed by `autofit measure`, the command gives the same source and config back."""
    import shlex

    from autofit.cli import build_parser
    from autofit.cli._args import model_spec
    from autofit.core.budget import parse_budget
    from autofit.report.tables import measure_command

    config = TrainConfig.parse("precision=amp-bf16,micro_batch=4,grad_accum=2,checkpoint_every=1")
    command = measure_command({"workload_source": source, "budget_text": "8G", "device_type": "cpu"}, config)
    argv = shlex.split(command)
    assert argv[:2] == ["autofit", "measure"] and "#" not in command
    for key, flag in (("seq_len", "--seq-len"), ("task", "--task"), ("lora", "--lora")):
        assert (f"#{key}=" in source) == (flag in argv), command
    args = build_parser().parse_args(argv[1:])
    assert model_spec(args) == source
    assert TrainConfig.parse(args.config) == config and parse_budget(args.budget) == 8 * 10**9
    if source.startswith("hf:gpt2"):  # the same workload, loaded (transformers reads no weights)
        pytest.importorskip("transformers")
        from autofit.workloads.load import load_workload

        loaded = load_workload(model_spec(args))
        assert loaded.source == source and loaded.meta["seq_len"] == 16 and loaded.meta["task"] == "causal-lm"


def test_summary_names_the_workload_in_the_cli_flags(study_dir):
    study = load_snapshot(study_dir)
    settings = dict(study.settings, workload_source="hf:gpt2?n_layer=2#seq_len=64#task=causal-lm")
    text = summary_markdown(dataclasses.replace(study, settings=settings))
    assert "`--model 'hf:gpt2?n_layer=2' --seq-len 64 --task causal-lm`" in text
    assert "- reproduce: `autofit measure --model 'hf:gpt2?n_layer=2' --seq-len 64 --task causal-lm --config " in text


def test_an_export_overriding_the_best_says_how_it_changes_the_training(study_dir):
    from autofit.report.exports import export_study

    exp = export_study(study_dir, "json", override="micro_batch=4,precision=amp-bf16")  # best: fp32 mb=2 ga=2
    assert [c.text().split(":")[0] for c in exp.changes] == ["global batch 4 -> 8 (x2)", "precision fp32 -> amp-bf16"]
    assert json.loads(exp.text)["changes"] == exp.warnings()
    assert not export_study(study_dir, "json", override="micro_batch=4,grad_accum=1").changes  # 4 samples a step still


def _with_loaded_best(study_dir, starved_steps: int):
    """A re-measured fp32 mb=4 whose 3 timed steps include ``starved_steps`` that waited for a CPU: the best."""
    study = open_study(study_dir)
    row = _trial(TrainConfig("fp32", 4, 1), TrialState.COMPLETE, "ok", value=50.0, peak=600_000, sample=2)
    row["user_attrs"]["measured"].update(timed_steps=3, starved_steps=starved_steps, max_wait_share=0.41)
    study.add_trial(create_trial(distributions=distributions(space_from_dict(dict(SPACE))), **row))
    return load_snapshot(study_dir)


def test_an_answer_whose_every_step_waited_for_a_cpu_says_it_was_measured_under_load(study_dir):
    from autofit.cli.search import _summary

    snapshot = _with_loaded_best(study_dir, starved_steps=3)
    assert best_record(snapshot)["measured"]["samples_per_s"] == 50.0
    summary = summary_markdown(snapshot)
    assert ("- **measured under load**: all 3 timed steps waited for a CPU (another process held one throughout): "
            "this is the fastest config beside that load, which may not be the fastest on a quiet machine; search "
            "again when it is quiet") in summary
    assert "were taken again" not in summary
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _summary(search_result(snapshot, study_dir))
    assert "\nload       all 3 timed steps waited for a CPU" in out.getvalue()


def test_an_answer_with_some_steps_taken_again_says_only_that(study_dir):
    from autofit.cli.search import _summary

    snapshot = _with_loaded_best(study_dir, starved_steps=1)
    summary = summary_markdown(snapshot)
    assert "- 1 of its 3 timed steps waited for a CPU (another process was running) and were taken again" in summary
    assert "measured under load" not in summary
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _summary(search_result(snapshot, study_dir))
    assert "\nload " not in out.getvalue()

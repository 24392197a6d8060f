"""``autofit search`` end to end on a tiny workload and budget, then rerun (resume) and ``autofit report``."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from trial_workloads import TINY_LM as TINY

from autofit.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # a loaded shared machine: no spin-waiting


def _autofit(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "autofit", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_search_then_rerun_then_report(tmp_path, write_space):
    space = write_space(tmp_path / "space.toml", precision=["fp32", "amp-bf16"], micro_batch=[2, 4],
                        global_batch=4, checkpoint_every=[0, 1], device_split=[1, 2])
    args = ["search", "--model", TINY, "--budget", "64MB", "--space", str(space), "--trials", "2"]
    first = _autofit(*args, "--json", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    data = json.loads(first.stdout)
    assert "profiling" not in first.stderr and "] study " not in first.stderr  # --json: no progress lines
    out = tmp_path / "results" / "tiny-lm-64MB"  # the default --out: results/<model>-<budget>
    assert data["study"] == "tiny-lm-64MB" and Path(data["out_dir"]) == Path("results/tiny-lm-64MB")
    assert data["n_real"] == 2 and data["stop_reason"].startswith("trial limit")
    assert data["n_configs"] == 16 and data["n_pruned"] >= 8  # the 8 two-stage configs need 2 devices
    assert data["pruned_by_reason"]["devices"] == 8 and data["pruned_by_reason"]["dominated"] >= 4
    assert data["best_measured"]["peak_bytes"] < data["budget_bytes"] == 64_000_000
    for name in ("trials.csv", "best.json", "summary.md", "calibration.json", "study.journal", "study.json"):
        assert (out / name).is_file(), name
    best = json.loads((out / "best.json").read_text())
    assert best["config"] == data["best"] and best["reproduce"].startswith("autofit measure --model ")
    assert best["search_command"].startswith("autofit search --model ")

    again = _autofit(*args, cwd=tmp_path)  # the same command: resumes, runs nothing new
    assert again.returncode == 0, again.stderr[-3000:]
    assert "trials     2 real (2 ok)" in again.stdout
    assert "peak " in again.stdout and "of 64.00 MB (61.04 MiB)" in again.stdout
    assert "stopped    trial limit" in again.stdout and "wall time" in again.stdout
    # plain progress lines on a pipe, one per event; the stop reason is said once, in the summary
    assert "[" in again.stderr and "trial limit" not in again.stderr and "] done\n" in again.stderr
    # the start-up phases, each read from the cache the first run filled
    for line in ("] profiling tiny-lm on fake tensors (fp32, amp-bf16)...", "] profile of tiny-lm read from the cache",
                 "] cpu rates read from the cache", "] the workload's layer timings read from the cache",
                 "] writing the tables, the pictures and report.html..."):
        assert line in again.stderr, (line, again.stderr)

    report = _autofit("report", str(out), "--top", "3", cwd=tmp_path)
    assert report.returncode == 0 and "best: " in report.stdout


def test_usage_errors_are_one_line(tmp_path, capsys):
    assert main(["search", "--budget", "8 gigs"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(SystemExit) as exc:
        main(["search", "--budget", "8GB", "--workers", "0"])
    assert exc.value.code == 2
    assert main(["search", "--budget", "8GB", "--model", "no-such-model", "--out", str(tmp_path)]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["search", "--budget", "8GB", "--space", str(tmp_path / "missing.toml")]) == 2


class _FakeRunner:
    """Answers trials without running them: amp-bf16 three times as fast as fp32, everything at 1 MB."""

    def __call__(self, workload, config, *, device, budget_bytes, timeout_s, memory=True):
        from autofit.trial.run import TrialResult, TrialStatus

        rate = (30.0 if config.precision.value == "amp-bf16" else 10.0) * config.micro_batch
        return TrialResult("tiny-lm", config, device, TrialStatus.OK, peak_bytes=10**6, per_device_peak_bytes=[10**6],
                           samples_per_s=rate, step_time_s=4 / rate, wall_s=1.0, budget_bytes=budget_bytes)


def test_one_short_stop_line_and_real_trials_numbered_from_one_everywhere(tmp_path, capsys):
    """Pruned configs take Optuna's first numbers; what a user reads counts real trials 1, 2, ..., and
    the terminal, trials.csv, best.json, summary.md, ``autofit report``, the export and a resumed
    search agree. Why the search stopped is one short line, printed once."""
    import pandas as pd

    from autofit.api.run_study import search
    from autofit.cli.search import _summary
    from autofit.study.progress import ProgressPrinter

    space = {"precision": ["fp32", "amp-bf16"], "micro_batch": [1, 2, 4], "global_batch": 4,
             "checkpoint_every": [0, 1], "device_split": [1, 2]}  # the 2-device splits are pruned before the first trial
    out = tmp_path / "s"
    stream = io.StringIO()  # not a terminal: one line per event
    result = search(TINY, "64MB", space=space, out_dir=out, device="cpu", trials=2, trial_runner=_FakeRunner(),
                    progress=ProgressPrinter(stream))
    _summary(result)
    printed = capsys.readouterr().out
    terminal = stream.getvalue() + printed
    assert result.stop_reason.startswith("trial limit: 2 real trials") and len(result.stop_reason) < 80
    assert terminal.count(result.stop_reason) == 1 and f"stopped    {result.stop_reason}\n" in printed
    assert "stopped:" not in terminal and "done:" not in terminal
    assert re.findall(r"\] trial (\d+) \S+ mb=\d+ ga=\d+ ckpt=\d+ split=\d+: running", stream.getvalue()) == \
        ["1", "2"]

    table = pd.read_csv(out / "trials.csv")
    real = table[table["status"] != "pruned"]
    assert real["trial"].tolist() == [1, 2] and real["number"].min() > 0  # Optuna's numbers: pruned ones first
    assert table.loc[table["status"] == "pruned", "trial"].isna().all()
    best = json.loads((out / "best.json").read_text())
    assert best["trial"] == result.best_trial and best["number"] == result.best_number
    assert real.loc[real["number"] == result.best_number, "trial"].item() == result.best_trial
    assert f"(trial {result.best_trial})" in printed and f"(trial {result.best_trial})" in (out / "summary.md").read_text()
    assert main(["report", str(out), "--no-write"]) == 0
    report = capsys.readouterr().out
    assert f"(trial {result.best_trial}): " in report
    assert sorted(line.split()[0] for line in report.splitlines()[2:] if line.split()[1:2] == ["ok"]) == ["1", "2"]
    assert main(["export", str(out), "--to", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["trial"] == result.best_trial

    stream = io.StringIO()  # resumed with one trial more: its number follows on
    again = search(TINY, "64MB", space=space, out_dir=out, device="cpu", trials=3, trial_runner=_FakeRunner(),
                   progress=ProgressPrinter(stream))
    assert re.findall(r"\] trial (\d+) ", stream.getvalue())[:1] == ["3"] and again.n_real == 3
    resumed = pd.read_csv(out / "trials.csv")
    assert resumed.loc[resumed["status"] != "pruned", "trial"].tolist() == [1, 2, 3]
    assert resumed.set_index("number").loc[real["number"], "trial"].tolist() == [1, 2]

"""``autofit search`` end to end on a tiny workload and budget, then rerun (resume) and ``autofit report``."""

from __future__ import annotations

import json
import os
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
    # plain progress lines on a pipe, one per event
    assert "[" in again.stderr and "stopped: trial limit" in again.stderr
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

"""One study on a real PostgreSQL, shared by three `autofit search` commands (as three machines
would: each its own --out, one --storage). Skipped unless AUTOFIT_TEST_POSTGRES_URL is set
(`.ci/run` starts PostgreSQL on loopback and sets it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
URL = os.environ.get("AUTOFIT_TEST_POSTGRES_URL")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not URL, reason="AUTOFIT_TEST_POSTGRES_URL is not set")]


def _autofit(*argv: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS.parent), os.environ.get("PYTHONPATH")])),
           "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "autofit", *argv], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _reports_while_running(searches: list[subprocess.Popen], out: Path) -> int:
    """``autofit report`` on the study again and again while the searches run (it reads a snapshot:
    no lock, no error). Returns how many started while a search was running (on a CPU where only
    fp32 is worth a trial, the searches can all end within one report's interpreter start)."""
    overlapped = 0
    deadline = time.monotonic() + 600
    while any(s.poll() is None for s in searches) and time.monotonic() < deadline:
        if not (out / "study.json").is_file():  # not created yet
            time.sleep(0.5)
            continue
        report = _autofit("report", str(out), "--storage", URL, "--json", cwd=out.parent)
        overlapped += any(s.poll() is None for s in searches)
        text, err = report.communicate(timeout=120)
        assert report.returncode == 0 and "Traceback" not in err, err[-2000:]
        assert "best" in json.loads(text)
    return overlapped


def test_three_machines_share_one_postgres_study(tmp_path):
    import optuna

    from autofit.study.storage import read_records

    study = f"pg-{uuid.uuid4().hex[:8]}"
    common = ["--model", f"{TESTS / 'trial_workloads.py'}:tiny_lm", "--budget", "1GB", "--space", "tiny",
              "--device", "cpu", "--storage", URL, "--study", study, "--trials", "6", "--patience", "10",
              "--trial-timeout", "120"]
    workers = [_autofit("search", *common, "--out", str(tmp_path / f"m{i}"), "--json", cwd=tmp_path) for i in range(3)]
    during = _reports_while_running(workers, tmp_path / "m0")
    outputs = [w.communicate(timeout=600) for w in workers]
    password = URL.partition("://")[2].rpartition("@")[0].partition(":")[2]
    for worker, (out, err) in zip(workers, outputs):  # a failed search is said before the overlap below
        assert worker.returncode == 0, err[-3000:]
        assert "Traceback" not in err
        if password:
            assert password not in out + err
    assert during, "no report ran while the searches ran"
    # every trial accounted for: finished (no trial left running), each config run once
    records = read_records(optuna.load_study(study_name=study, storage=URL))
    assert records and all(r.status.value != "running" for r in records), [r.status for r in records]
    real = [r for r in records if r.status.ran]
    measurements = [(r.config, r.sample) for r in real]  # a config measured again has a higher sample
    assert len(measurements) == len(set(measurements)), "a measurement was taken twice"
    assert 1 <= len(real) <= 6
    # the same best read from each machine's directory
    bests = []
    for i in range(3):
        report = _autofit("report", str(tmp_path / f"m{i}"), "--storage", URL, "--json", cwd=tmp_path)
        out, err = report.communicate(timeout=120)
        assert report.returncode == 0, err
        best = json.loads(out)["best"]
        bests.append((best.get("trial"), best.get("short")))
        text = "".join(p.read_text() for p in (tmp_path / f"m{i}").iterdir()
                       if p.suffix in (".md", ".json", ".csv", ".html", ".log"))
        if password:
            assert password not in text
    assert bests[0][0] is not None and bests[0] == bests[1] == bests[2], bests

"""What a finished search leaves for people: Optuna's own dashboard on its storage, the pictures
and report.html (one short real search, shared by the tests of this module)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest

import autofit
from autofit.study import open_study

SPACE = {"precision": ["fp32", "amp-bf16"], "micro_batch": [2, 4], "global_batch": 4, "checkpoint_every": [0, 1],
         "device_split": [1, 2]}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("search") / "gpt-tiny-1GB"
    result = autofit.search("gpt-tiny", budget="1GB", space=SPACE, trials=2, out=out)
    assert result.n_real == 2
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=30) as response:  # loopback only
        return json.loads(response.read())


def test_optuna_dashboard_shows_every_trial_with_readable_attributes(finished, tmp_path):
    dashboard = shutil.which("optuna-dashboard") or str(Path(sys.executable).with_name("optuna-dashboard"))
    if not Path(dashboard).exists():
        pytest.skip("optuna-dashboard is not installed (pip install 'autofit[export]')")
    journal = finished.out_dir / "study.journal"
    port = _free_port()
    # the README's command, on loopback
    server = subprocess.Popen([dashboard, str(journal), "--host", "127.0.0.1", "--port", str(port), "--quiet"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        studies = None
        for _ in range(120):  # bounded: the server imports for a few seconds on a loaded machine
            try:
                studies = _get(f"http://127.0.0.1:{port}/api/studies")
                break
            except OSError:
                if server.poll() is not None:
                    pytest.fail(f"optuna-dashboard exited: {server.stderr.read().decode()[-2000:]}")
                time.sleep(0.5)
        assert studies is not None, "optuna-dashboard did not answer within 60 s"
        (summary,) = studies["study_summaries"]
        assert summary["study_name"] == finished.study_name
        detail = _get(f"http://127.0.0.1:{port}/api/studies/{summary['study_id']}")
    finally:
        server.terminate()
        server.wait(timeout=30)
    stored = open_study(finished.out_dir).get_trials(deepcopy=False)
    assert [t["number"] for t in detail["trials"]] == [t.number for t in stored]
    complete = [t for t in detail["trials"] if t["state"] == "Complete"]
    assert len(complete) == finished.n_real
    for trial in complete:
        config = {p["name"]: p["param_external_value"] for p in trial["params"]}  # the config, field by field
        assert set(config) >= {"precision", "micro_batch", "grad_accum", "checkpoint_every", "device_split"}
        attrs = {a["key"]: a["value"] for a in trial["user_attrs"]}
        predicted, measured = json.loads(attrs["predicted"]), json.loads(attrs["measured"])  # not truncated
        assert predicted["peak_bytes"] > 0 and measured["peak_bytes"] > 0 and measured["samples_per_s"] > 0
        assert trial["values"] == [pytest.approx(measured["samples_per_s"])]


def test_the_study_loads_in_optuna_itself(finished):
    study = open_study(finished.out_dir)
    assert isinstance(study, optuna.Study) and study.best_trial.number == finished.best_trial
    frame = study.trials_dataframe()
    assert {"params_precision", "params_micro_batch", "user_attrs_measured"} <= set(frame.columns)

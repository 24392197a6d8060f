"""What a finished search leaves for people: Optuna's own dashboard on its storage, the pictures
and report.html (one short real search, shared by the tests of this module)."""

from __future__ import annotations

import json
import os
import re
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
from autofit.cli import main
from autofit.core.config import TrainConfig
from autofit.profiling.cache import study_profile
from autofit.profiling.data import PROFILE_VERSION
from autofit.report.page import best_exports
from autofit.report.pictures import PICTURES
from autofit.study import load_snapshot, open_study

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
    assert isinstance(study, optuna.Study)
    # Optuna's best_trial is the highest measured figure; autofit's best may rank a starved sample by its
    # raised figure (autofit.core.records.reach), so only the stored trial itself is the same
    best = study.trials[finished.best_number]
    assert best.state is optuna.trial.TrialState.COMPLETE and TrainConfig.from_dict(best.params) == finished.best
    frame = study.trials_dataframe()
    assert {"params_precision", "params_micro_batch", "user_attrs_measured"} <= set(frame.columns)


def _self_contained(page: str) -> None:
    """Every image is a data URI; no link, script, stylesheet, import or URL reference."""
    sources = re.findall(r"""\bsrc\s*=\s*["']([^"']*)""", page, flags=re.I)
    assert sources and all(src.startswith("data:image/png;base64,") for src in sources)
    for pattern in (r"\bhref\s*=", r"<link\b", r"<script\b", r"<iframe\b", r"url\(", r"@import", r"srcset"):
        assert not re.search(pattern, page, flags=re.I), pattern


def test_pictures_and_report_html_are_written_by_the_search(finished):
    for name in PICTURES:
        data = (finished.out_dir / f"{name}.png").read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000
    page = (finished.out_dir / "report.html").read_text()
    _self_contained(page)
    assert page.count("<img ") == len(PICTURES)
    assert finished.best.short() in page  # the summary's best config ...
    assert "training_arguments" in page and "train_micro_batch_size_per_gpu" in page  # ... and its exports
    assert "Prediction error of every real trial" in page  # the tables


def test_report_html_renders_headless_in_chromium(finished, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run installs it)")
    shot = tmp_path / "report.png"
    page = (finished.out_dir / "report.html").resolve()
    # every host unresolvable: nothing can leave the machine; --v=1 logs each URL the browser loads
    proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-background-networking", "--host-resolver-rules=MAP * ~NOTFOUND",
                           "--enable-logging=stderr", "--v=1", "--window-size=1280,2400", f"--screenshot={shot}",
                           page.as_uri()], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 50_000
    files = set(re.findall(r"FileURLLoader::Start: (\S+)", proc.stderr))
    assert files == {page.as_uri()}  # the page loaded nothing else from disk ...
    requested = re.findall(r"NotifyBeforeURLRequest: (\S+)", proc.stderr)
    # ... nor from the network (Chromium's own background checks, to Google's hosts, aside)
    assert [u for u in requested if not re.match(r"https?://[^/]*(google\.com|googleapis\.com|gvt1\.com)/", u)] == []
    assert "Uncaught" not in proc.stderr


def test_report_html_flag_rewrites_the_page_from_storage(finished, capsys):
    for name in PICTURES:
        (finished.out_dir / f"{name}.png").unlink()
    (finished.out_dir / "report.html").unlink()
    assert main(["report", str(finished.out_dir), "--html", "--top", "1"]) == 0
    assert "report.html" in capsys.readouterr().err
    assert all((finished.out_dir / f"{name}.png").exists() for name in PICTURES)
    _self_contained((finished.out_dir / "report.html").read_text())


def test_export_from_the_study_and_from_the_result(finished, capsys):
    assert main(["export", str(finished.out_dir), "--to", "json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["config"] == finished.best.to_dict() and record["trial"] == finished.best_trial
    assert record["measured"]["samples_per_s"] == pytest.approx(finished.best_measured["samples_per_s"])
    hf = finished.export("hf").kwargs
    assert hf["per_device_train_batch_size"] == finished.best.micro_batch
    assert hf["gradient_accumulation_steps"] == finished.best.grad_accum
    assert main(["export", str(finished.out_dir), "--to", "hf", "--config", "micro_batch=1"]) == 0
    assert json.loads(capsys.readouterr().out)["training_arguments"]["per_device_train_batch_size"] == 1
    assert main(["export", str(finished.out_dir), "--to", "hf", "--model", "gpt2"]) == 2  # the study says the model


def test_a_fresh_report_and_export_read_the_searchs_profile_without_torch_dynamo(finished):
    """Reviewing a finished study costs no fake build of the model (its torch._dynamo import alone
    takes seconds): the search stored its profile's key and the report reads that profile."""
    assert open_study(finished.out_dir).user_attrs["profile"]["version"] == PROFILE_VERSION
    code = ("import sys; from autofit.cli import main; out = sys.argv[1]; "
            "assert main(['report', out, '--html', '--top', '1']) == 0; "
            "assert main(['export', out, '--to', 'hf', '--config', 'checkpoint_every=2']) == 0; "
            "print('torch._dynamo imported:', 'torch._dynamo' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, str(finished.out_dir)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "estimated peak" in proc.stdout  # the export's note has its peak, from the stored profile
    assert proc.stdout.rstrip().endswith("torch._dynamo imported: False")


def test_the_studys_profile_gives_the_exports_a_fresh_profile_gives(finished):
    snap = load_snapshot(finished.out_dir)
    profile = study_profile(snap)
    assert profile is not None and profile.key == snap.profile["key"]
    config = TrainConfig("amp-bf16", 2, 2, 2, 1)  # hf checkpoints every layer or none: a note with a peak
    stored = best_exports(config, snap.settings, profile)
    assert "estimated peak" in stored["hf"]
    assert stored == best_exports(config, snap.settings, None)


@pytest.mark.parametrize("stored", [None, {"key": "0" * 20, "version": PROFILE_VERSION}, {"version": -1}],
                         ids=["older-autofit", "not-in-this-cache", "another-profile-version"])
def test_a_study_without_a_usable_profile_key_still_reports(finished, tmp_path, stored):
    copy = tmp_path / "study"
    shutil.copytree(finished.out_dir, copy)
    study = open_study(copy)
    if stored is not None and "key" not in stored:
        stored = {**study.user_attrs["profile"], **stored}
    study.set_user_attr("profile", stored)
    assert study_profile(load_snapshot(copy)) is None  # so the report profiles the workload again
    (copy / "report.html").unlink()
    assert main(["report", str(copy), "--html", "--top", "1"]) == 0
    assert "training_arguments" in (copy / "report.html").read_text()


def test_a_search_where_nothing_fits_says_what_would(tmp_path, capsys):
    out = tmp_path / "tiny-budget"
    space = tmp_path / "space.toml"
    space.write_text('precision = ["fp32"]\nmicro_batch = [1, 2]\ngrad_accum = [1]\ncheckpoint_every = [0]\n'
                     'device_split = [1]\n')
    assert main(["search", "--budget", "5MB", "--model", "gpt-tiny", "--space", str(space), "--out", str(out)]) == 1
    terminal = capsys.readouterr().out
    assert "what fits" in terminal and "weights + gradients + optimizer state alone are" in terminal
    assert "nothing fits even split across 4 devices" in terminal
    summary = (out / "summary.md").read_text()
    assert "## What would fit" in summary and "use a smaller model or a larger budget" in summary
    page = (out / "report.html").read_text()
    assert "alone are" in page
    assert page.index("What would fit") < page.index("<h2>Pictures</h2>")  # the answer comes first
    _self_contained(page)
    assert main(["export", str(out), "--to", "hf"]) == 2  # nothing to export, said in one line
    assert "no config ran under the budget yet" in capsys.readouterr().err

"""What autofit must not leak or trust: storage passwords, and pickles read back from disk."""

from __future__ import annotations

import re
from pathlib import Path

from autofit.runtime import procs
from autofit.study.launcher import worker_env
from autofit.study.settings import StudySettings, redact
from autofit.study.storage import storage_failure

URL = "postgresql://user:secret@127.0.0.1:1/db"
PACKAGE = Path(__file__).resolve().parents[2] / "autofit"


def test_trials_inherit_no_database_password(monkeypatch):
    monkeypatch.setenv("PGPASSWORD", "secret")
    monkeypatch.setenv("MY_DB_URL", URL)
    monkeypatch.setenv("HARMLESS", "https://example.org/x")
    env = procs.child_env()
    assert "PGPASSWORD" not in env and "MY_DB_URL" not in env
    assert env["HARMLESS"] == "https://example.org/x"
    assert "secret" not in "".join(env.values())


def test_workers_keep_what_opens_the_storage(monkeypatch):
    # a worker opens the study itself: a password it reads from its environment stays
    monkeypatch.setenv("PGPASSWORD", "secret")
    settings = StudySettings(workload_name="w", workload_source="w", budget_bytes=1, budget_text="1B", space={},
                             device_type="cpu", devices=1, study_name="s", out_dir="o", storage=URL)
    assert worker_env(settings, 1, [])["PGPASSWORD"] == "secret"


def test_commands_and_errors_show_no_password():
    assert redact(f"autofit search --storage {URL} --budget 8GB") == \
        "autofit search --storage postgresql://user:***@127.0.0.1:1/db --budget 8GB"
    # a driver that echoes the URL, or the password alone, in its message
    failure = storage_failure("study 's'", URL, RuntimeError(f"cannot reach {URL}\npassword secret rejected"))
    assert "secret" not in str(failure) and "user:***@127.0.0.1:1/db" in str(failure)
    assert failure.exit_status == 1


def test_nothing_read_back_is_unpickled():
    """No pickle, no torch.load without weights_only=True, no np.load with allow_pickle=True."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if re.search(r"\bimport pickle\b|\bpickle\.|\bdill\b|\bshelve\b|\bmarshal\.load", code) \
                    or ("torch.load(" in code and "weights_only=True" not in code) \
                    or ("np.load(" in code and "allow_pickle=False" not in code):
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not offenders, offenders

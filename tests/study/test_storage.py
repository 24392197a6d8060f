"""What a study records about the machine its trials ran on (autofit.study.storage)."""

from __future__ import annotations

from autofit.study import storage


def test_the_recorded_environment_is_the_trials_own(monkeypatch):
    """summary.md's Environment section shows the OpenMP wait policy the trials ran with: autofit's
    PASSIVE where the user set none, theirs where they did."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert storage._versions()["env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert storage._versions()["env"]["OMP_WAIT_POLICY"] == "ACTIVE"

"""Fixtures shared by the profiling tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def forked_requests(monkeypatch, tmp_path):
    """Workers even on a one-core machine and a cache of this test's own: the requests of the profiling
    workers the fork server forks, in order. The test starts the server itself (its environment, which
    the server is keyed on, differs from the setup's: pytest's own variable); it is stopped after."""
    from autofit.runtime import forkserver

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    forked: list[dict] = []
    start = forkserver.start_trial
    monkeypatch.setattr(forkserver, "start_trial", lambda entry, req, *a, **k: forked.append(req) or start(entry, req, *a, **k))
    try:
        yield forked
    finally:
        forkserver.stop_server()

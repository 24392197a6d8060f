"""Shared test fixtures and the ``cuda`` marker's skip. Keep it small."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import statistics
from collections import defaultdict
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent
# Seconds each test file took (setup, call and teardown summed), read to hand out the longest files
# first. Refresh it after adding slow tests: AUTOFIT_STORE_TEST_DURATIONS=tests/durations.json python -m pytest
DURATIONS = TESTS_DIR / "durations.json"
_measured_s: dict[str, float] = defaultdict(float)

# A suite started in the background by a script inherits SIGINT ignored; the CLI then warns that
# Ctrl-C is ignored (a second stderr line the one-line error tests would count), and the Ctrl-C
# tests could not interrupt anything. Take Ctrl-C back, as an interactive run has it; the
# processes the tests start inherit it.
signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_xdist_auto_num_workers(config):
    # One worker per core, at most four: the tests' trials start threads and processes of their own.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores))


def pytest_collection_modifyitems(config, items):
    _longest_files_first(items)
    # torch.cuda.is_available() does not create a CUDA context, so trial parents stay clean.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # not item.keywords: it holds folder names too
            item.add_marker(skip)


def _longest_files_first(items) -> None:
    """Under ``--dist loadfile`` a test file is one unit of work, handed to whichever worker frees up
    first, in collection order. Alphabetical order can leave a long file for last, run by one worker
    while the others idle; the longest files first (longest-processing-time scheduling) end the workers
    together. A file without a record counts as the median one. Tests keep their order within a file."""
    try:
        seconds = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return
    typical_s = statistics.median(seconds.values()) if seconds else 0.0
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::")[0], len(first_seen))

    def key(item):
        file = item.nodeid.split("::")[0]
        return -seconds.get(file, typical_s), first_seen[file]

    items.sort(key=key)


def pytest_runtest_logreport(report):
    if os.environ.get("AUTOFIT_STORE_TEST_DURATIONS"):
        _measured_s[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session):
    out = os.environ.get("AUTOFIT_STORE_TEST_DURATIONS")
    # the controller (or a run without workers) has every report; a worker only its own
    if out and _measured_s and not hasattr(session.config, "workerinput"):
        Path(out).write_text(json.dumps({f: round(s, 1) for f, s in sorted(_measured_s.items())}, indent=1) + "\n")


@pytest.fixture(autouse=True)
def _machine_to_itself(request, tmp_path_factory):
    """Under pytest-xdist, a test marked ``alone`` runs while no other worker runs a test: it takes a
    lock on the machine that every other test shares (flock: an exclusive lock waits for the shared
    ones to end, and they wait for it). Such a test needs a quiet machine as its reference, as a
    user's search has when nothing else runs; another worker's trials would be the load it checks
    autofit against."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    path = tmp_path_factory.getbasetemp().parent / "machine.lock"  # the workers' common base
    alone = request.node.get_closest_marker("alone") is not None
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def trial_workload_spec():
    """``spec("tiny")`` -> an absolute ``tests/trial_workloads.py:tiny`` source string."""
    return lambda function: f"{TESTS_DIR / 'trial_workloads.py'}:{function}"


@pytest.fixture
def write_space():
    """``write_space(path, precision=["fp32"], micro_batch=[2, 4], ...)`` -> a search-space TOML file."""

    def write(path: Path, **values) -> Path:
        path.write_text("".join(f"{key} = {value!r}\n".replace("'", '"') for key, value in values.items()))
        return path

    return write


@pytest.fixture
def one_thread():
    """Run with one intra-op thread: timings on a shared 2-core machine are far steadier."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _session_dir(tmp_path_factory, variable: str, name: str, shared: bool = False):
    """A fresh directory in ``variable`` for the test session (child processes inherit it), the
    variable as it was restored afterwards. (A session fixture cannot use ``monkeypatch``.)
    ``shared``: under pytest-xdist, one directory for all the session's workers (a cache autofit
    already shares between concurrent searches), so each workload is profiled once, not per worker."""

    if shared and os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.getbasetemp().parent / name  # the workers' common base
        path.mkdir(exist_ok=True)
    else:
        path = tmp_path_factory.mktemp(name)
    previous = os.environ.get(variable)
    os.environ[variable] = str(path)
    yield path
    if previous is None:
        os.environ.pop(variable, None)
    else:
        os.environ[variable] = previous


@pytest.fixture(scope="session", autouse=True)
def profile_cache(tmp_path_factory):
    """One fresh profile cache per test session (child processes inherit it): tests never
    read a developer's ~/.cache, and a workload is profiled once per session."""
    yield from _session_dir(tmp_path_factory, "AUTOFIT_CACHE_DIR", "autofit-cache", shared=True)


@pytest.fixture(scope="session", autouse=True)
def device_locks(tmp_path_factory):
    """One device-lock directory per test session (child processes inherit it): the suite's
    trials take turns among themselves, never waiting on another program's trials."""
    yield from _session_dir(tmp_path_factory, "AUTOFIT_LOCK_DIR", "autofit-locks")

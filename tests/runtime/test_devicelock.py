"""One trial per device at a time: the device lock itself, device names, workers spread over
GPUs, and real searches started at once (in one directory and in others) whose trials never
overlap in time."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from autofit.runtime.devicelock import DeviceLock, device_names, lock_dir

TESTS = Path(__file__).resolve().parents[1]
HOLD = """
import sys, time
from autofit.runtime.devicelock import DeviceLock
with DeviceLock([sys.argv[1]], "holder test"):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(name: str) -> subprocess.Popen:
    """Another process holding device ``name`` until killed."""
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, name], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_device_is_waited_for_and_a_killed_holder_frees_it():
    holder = _holder("cpu")
    got = threading.Event()
    lock = DeviceLock(["cpu"], "test")

    def take():
        with lock:
            got.set()

    thread = threading.Thread(target=take)
    try:
        thread.start()
        assert not got.wait(0.5), "taken while another process held it"
        holder.kill()  # kill -9 leaves no stale lock: the kernel releases the flock
        holder.wait()
        thread.join(30)
        assert got.is_set()
    finally:
        holder.kill()
        holder.wait()
    assert lock.waited_for == f"cpu: pid {holder.pid}: holder test" and lock.wait_s > 0
    # free now: taken at once, and another device never waited for this one
    with DeviceLock(["cpu"]) as again, DeviceLock(["cuda-0"]) as other:
        assert again.waited_for is None and other.waited_for is None


def test_a_thread_reenters_its_own_lock_and_other_threads_wait():
    order = []
    with DeviceLock(["cpu"]):
        with DeviceLock(["cpu", "cuda-1"]) as inner:  # a trial inside a held block does not wait on itself
            assert inner.waited_for is None
        def take():
            with DeviceLock(["cpu"]):
                order.append("other")

        other = threading.Thread(target=take)
        other.start()
        other.join(0.5)
        assert other.is_alive(), "another thread took a device this thread holds"
        order.append("first")
    other.join(30)
    assert order == ["first", "other"]


def test_device_names(monkeypatch):
    assert device_names("cpu") == device_names("cpu", 4) == ["cpu"]  # stage processes share the one CPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-1a2b/x,5")
    assert device_names("cuda") == ["cuda-3"]
    assert device_names("cuda", 2) == ["cuda-3", "cuda-GPU-1a2b_x"]
    assert device_names("cuda:2") == ["cuda-5"]


def test_the_lock_directory_is_made_when_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOFIT_LOCK_DIR", str(tmp_path / "a" / "b"))
    assert lock_dir() == tmp_path / "a" / "b"
    with DeviceLock(["cpu"], "made"):
        assert (tmp_path / "a" / "b" / "cpu.lock").read_text() == f"pid {os.getpid()}: made\n"


def test_workers_spread_over_the_gpus():
    from autofit.api.run_study import spread_gpus
    from autofit.core.errors import StudyError

    assert spread_gpus(["0", "1", "2", "3"], 2, None) == (2, [["0", "1"], ["2", "3"]])
    assert spread_gpus(["0", "1", "2", "3"], 2, 1) == (1, [["0", "1"], ["2", "3"]])
    assert spread_gpus(["0", "1", "2"], 3, None) == (1, [["0"], ["1"], ["2"]])
    # more workers than GPUs: one each in turn (they take turns under the lock)
    assert spread_gpus(["4", "7"], 3, None) == (1, [["4"], ["7"], ["4"]])
    with pytest.raises(StudyError, match="no CUDA GPU"):
        spread_gpus([], 1, None)


def _search(out: Path, study: str, trials: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent), "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "autofit", "search", "--model", f"{TESTS / 'trial_workloads.py'}:tiny_lm",
            "--budget", "1GB", "--space", "tiny", "--device", "cpu", "--out", str(out), "--study", study,
            "--trials", str(trials), "--patience", "10", "--trial-timeout", "120"]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_searches_at_once_never_run_trials_side_by_side(tmp_path):
    """Two searches on one directory and a third in a directory of its own, all at once on one
    CPU: every trial held the CPU alone (recorded intervals disjoint), and the shared study ran
    each measurement once."""
    from autofit.probes.device_rates import probe_rates
    from autofit.profiling.profile import profile_workload
    from autofit.report.tables import trials_table
    from autofit.study import load_snapshot
    from autofit.workloads.load import load_workload

    # profile and probe once here (the session's cache), not in three searches at once
    profile_workload(load_workload(f"{TESTS / 'trial_workloads.py'}:tiny_lm"), ["fp32", "amp-bf16"])
    probe_rates("cpu")
    runs = {"shared-a": ("shared", "s", 2), "shared-b": ("shared", "s", 2), "own": ("own", "o", 1)}
    procs = {name: _search(tmp_path / d, study, trials) for name, (d, study, trials) in runs.items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (name, err[-3000:])
    intervals = []
    for d in ("shared", "own"):
        records = load_snapshot(tmp_path / d).records
        real = [r for r in records if r.status.ran]
        assert real and all(r.status.value not in ("running", "interrupted") for r in records)
        assert len({(r.config, r.sample) for r in real}) == len(real), f"{d}: a measurement was taken twice"
        intervals += [(r.measurement["started_at"], r.measurement["started_at"] + r.measurement["wall_s"],
                       d, r.number, r.measurement["wait_s"]) for r in real]
        assert "wait_s" in trials_table(load_snapshot(tmp_path / d)).columns
    intervals.sort()
    for before, after in zip(intervals, intervals[1:]):
        assert after[0] >= before[1], f"trials overlapped on the CPU: {before} and {after}"
    # the tables say which trials waited
    for d in ("shared", "own"):
        waits = [wait for _, _, where, _, wait in intervals if where == d]
        summary = (tmp_path / d / "summary.md").read_text()
        assert ("waited for their device" in summary) == any(w >= 0.5 for w in waits), (d, waits)


def test_the_summary_names_trials_that_waited():
    from autofit.core.config import TrainConfig
    from autofit.core.records import StudySnapshot, TrialRecord, TrialStatus
    from autofit.report.summary import summary_markdown
    from autofit.report.tables import trials_table

    def record(number, wait_s):
        return TrialRecord(number, TrainConfig("fp32", 2 * (number + 1)), TrialStatus.OK, value=10.0,
                           measurement={"samples_per_s": 10.0, "peak_bytes": 10**6, "wall_s": 3.0, "wait_s": wait_s})

    study = StudySnapshot("w", [record(0, 0.01), record(1, 42.0)], settings={"budget_bytes": 10**9, "devices": 1})
    assert list(trials_table(study)["wait_s"]) == [0.01, 42.0]
    lines = [line for line in summary_markdown(study).splitlines() if "waited" in line]
    assert len(lines) == 1 and "1 trial(s): 2 (42 s)" in lines[0]  # real trials are numbered from 1

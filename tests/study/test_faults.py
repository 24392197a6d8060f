"""Faults injected into a running search: killed workers, Ctrl-C, trials that crash, hang, run out
of memory or flood their output, a full disk, and a parent that runs many trials.

Where the point is the search process (kills, a full disk, its memory), trials are replayed by a
``trial_runner`` and the search runs in a forked copy of this process (no imports to repeat) that
is killed or limited; where the point is the trial, trials are real child processes.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pandas as pd
import pytest

from autofit.core.config import TrainConfig
from autofit.core.records import TrialStatus
from autofit.trial.run import TrialResult

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
FAULTY = f"{TESTS / 'fault_workloads.py'}:faulty"
TABLES = ("trials.csv", "best.json", "summary.md", "calibration.json", "report.html", "best_so_far.png")
SPACE = {"precision": ["fp32"], "micro_batch": [6, 8], "grad_accum": [1, 2, 3]}


class Replay:
    """Answers trials at once, each an ``error`` that names the process and call that answered it (so a
    trial recorded again would show); the ``kill_at``-th call kills this process, mid-trial, as ``kill -9``
    would. Errors because they teach the planner nothing: every config of the space runs, whatever its
    policy for measured ones (the faults are the point here, not the policy)."""

    def __init__(self, kill_at: int | None = None) -> None:
        self.calls: list[TrainConfig] = []
        self.kill_at = kill_at

    def __call__(self, workload, config, *, device, budget_bytes, timeout_s, memory=True):
        self.calls.append(config)
        if len(self.calls) == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return TrialResult("tiny-lm", config, device, TrialStatus.ERROR, wall_s=0.01, budget_bytes=budget_bytes,
                           error=f"replayed by process {os.getpid()}, call {len(self.calls)}")


def _search(out: Path, runner, **kwargs):
    from trial_workloads import TINY_LM

    from autofit.api.run_study import search

    return search(TINY_LM, "1GB", space=SPACE, out_dir=out, device="cpu", patience=100, trial_runner=runner, **kwargs)


def _forked(function) -> tuple[int, str]:
    """Run ``function()`` in a forked copy of this process; its wait status and the text it returned
    (or its exception's ``Type: message``)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the copy: never returns to pytest
        status = 1
        try:
            try:
                text, status = str(function() or ""), 0
            except BaseException as exc:  # noqa: BLE001
                text = f"{type(exc).__name__}: {exc}"
            os.write(write_end, text.encode())
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        text = f.read().decode()
    return os.waitpid(pid, 0)[1], text


def _kill_when_writing(out: Path, name: str) -> None:
    """SIGKILL this process once it has opened a file of ``out`` whose name holds ``name`` for writing
    and starts writing it: the file exists, created or emptied, its data not written yet."""
    def killer(frame, event, arg):
        target = getattr(getattr(arg, "__self__", None), "name", None)
        if event == "c_call" and getattr(arg, "__name__", "") == "write" and target == opened[0]:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_open(event, args):
        if event == "open" and isinstance(args[1], str) and "w" in args[1] and not opened:
            path = Path(os.fsdecode(args[0]))
            if path.parent == out and name in path.name:
                opened.append(str(args[0]))
                sys.setprofile(killer)  # this thread, from now on

    opened: list[str] = []
    sys.addaudithook(on_open)


def _assert_tables_whole(out: Path) -> None:
    """Every table a reader can see is whole: parses, or ends as its format ends."""
    assert all((out / name).is_file() for name in TABLES)
    for path in out.iterdir():
        name, data = path.name, path.read_bytes()
        if name.startswith(".") or name.startswith("study.journal"):
            continue
        if name.endswith(".csv"):
            assert len(pd.read_csv(path)) > 0 and data.endswith(b"\n"), name
        elif name.endswith(".json"):
            json.loads(data)
        elif name.endswith(".png"):
            assert data.startswith(b"\x89PNG\r\n\x1a\n") and data.endswith(b"IEND\xaeB`\x82"), name
        elif name.endswith(".html"):
            assert data.rstrip().endswith(b"</html>"), name
        else:
            assert name == "summary.md" and data.endswith(b"\n") and len(data) > 100, name


def _ran(out: Path) -> dict[int, tuple[tuple[TrainConfig, int], str, str | None]]:
    """Trial number -> ((config, which sample of it), status, error), of every trial not pruned."""
    from autofit.study import load_snapshot

    return {r.number: ((r.config, r.sample), r.status.value, r.measurement.get("error"))
            for r in load_snapshot(out).records if r.status is not TrialStatus.PRUNED}


def test_sigkill_mid_trial_and_mid_write_then_resume(tmp_path):
    out = tmp_path / "study"
    _search(out, Replay(), trials=2)
    _assert_tables_whole(out)
    # Killed mid-trial: the trial it had claimed stays running; the tables are the last run's, whole.
    status, _ = _forked(lambda: _search(out, Replay(kill_at=2), trials=6))
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    before = _ran(out)
    assert [s for _, s, _ in before.values()] == ["error", "error", "error", "running"]
    _assert_tables_whole(out)
    # Killed as it starts writing a table, then a picture (report.html goes the way of both): none is left half-written.
    for name in ("trials.csv", "best_so_far.png"):
        status, text = _forked(lambda: (_kill_when_writing(out, name), _search(out, Replay(), trials=6))[1])
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (name, text)
        _assert_tables_whole(out)
    result = _search(out, Replay(), trials=6)
    after = _ran(out)
    assert all(after[n] == before[n] for n, (_, s, _) in before.items() if s == "error"), "a finished trial changed"
    running = next(n for n, (_, s, _) in before.items() if s == "running")
    assert after[running][1] == "interrupted"
    finished = [c for c, s, _ in after.values() if s == "error"]
    assert len(finished) == len(set(finished)) == 6 == result.n_real, "a trial lost or doubled"
    assert after[running][0] in finished, "the interrupted config ran again"
    assert "running" not in {s for _, s, _ in after.values()}
    table = pd.read_csv(out / "trials.csv")
    assert sorted(table.loc[table["status"] != "pruned", "number"]) == sorted(after)


def test_a_full_disk_while_writing_tables_keeps_the_study(tmp_path):
    out = tmp_path / "study"
    _search(out, Replay(), trials=2)
    journal = (out / "study.journal").read_bytes()

    def search_on_a_full_disk() -> str:
        # Files may grow only a little past the journal: the run's bookkeeping fits, the pictures do not.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing us
        limit = len(journal) + (16 << 10)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        _search(out, Replay(), trials=2)
        return "no error"

    status, text = _forked(search_on_a_full_disk)
    assert os.WEXITSTATUS(status) == 1 and text.startswith("RunFailure: "), text
    assert "\n" not in text and "cannot write the tables" in text and "study is intact" in text, text
    assert f"autofit report {out}" in text, text
    assert (out / "study.journal").read_bytes().startswith(journal)  # only this run's record appended
    _assert_tables_whole(out)
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name], "a temporary file left behind"
    from autofit.study import load_snapshot

    assert [r.status.value for r in load_snapshot(out).records if r.status.ran] == ["error", "error"]


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads RSS from /proc")
def test_two_hundred_trials_keep_the_parent_flat(tmp_path):
    rss: list[int] = []
    fds: list[int] = []

    class Measured(Replay):
        def __call__(self, *args, **kwargs):
            rss.append(_rss_bytes())
            fds.append(len(os.listdir("/proc/self/fd")))
            return super().__call__(*args, **kwargs)

    # A memory filesystem when there is one: Optuna syncs every journal write, and the disk is not the point.
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path
    out = Path(tempfile.mkdtemp(dir=base)) / "study"
    try:
        space = {"precision": ["fp32"], "micro_batch": [8], "grad_accum": list(range(1, 201))}
        from trial_workloads import TINY_LM

        from autofit.api.run_study import search

        result = search(TINY_LM, "1GB", space=space, out_dir=out, device="cpu", patience=10**6, trials=200,
                        trial_runner=Measured())
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    assert result.n_real == len(rss) == 200, (result.stop_reason, result.pruned_by_reason)
    growth = rss[-1] - rss[0]
    assert growth < 50 << 20, f"the search process grew by {growth / 2**20:.0f} MB over 200 trials"
    assert fds[-1] <= fds[0], f"file descriptors leak: {fds[0]} -> {fds[-1]}"


# --- trials that misbehave; Ctrl-C --------------------------------------------------------------------


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the address space from /proc")
def test_trials_that_crash_hang_run_out_of_memory_or_flood_are_recorded_and_the_study_goes_on(tmp_path, monkeypatch,
                                                                                               capfd):
    from fault_workloads import FAULTS_ENV, FLOOD_BYTES, HOG_BYTES, faulty

    from autofit.api.run_study import search
    from autofit.runtime.schedule import DEFAULT_SCHEDULE
    from autofit.study import load_snapshot
    from autofit.trial.run import run_trial

    # An oom widens the planner's margin to prune configs predicted as large as it: the hog is the largest.
    monkeypatch.setenv(FAULTS_ENV, "7:hog,6:segfault,5:hang,3:flood")
    monkeypatch.setenv("AUTOFIT_TEST_PIDFILE", str(tmp_path / "pids"))
    limit = _vm_bytes() + (4 << 30)  # a trial may map 4 GiB more than this process holds; the hog asks for 12
    assert HOG_BYTES > 4 << 30

    def limited(workload, config, *, device, budget_bytes, timeout_s, memory=True):
        return run_trial(workload, config, device=device, budget_bytes=budget_bytes, timeout_s=timeout_s,
                         schedule=DEFAULT_SCHEDULE, memory_limit_bytes=limit)

    out = tmp_path / "study"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a workload without a source: forked trials
            search(faulty(), "1GB", space={"precision": ["fp32"], "micro_batch": [3, 5, 6, 7]}, out_dir=out,
                   device="cpu", patience=10, trial_timeout_s=10, trial_runner=limited)
    finally:
        flooded = len(capfd.readouterr().err)  # the trials' output, echoed to our stderr
    first = {r.config.micro_batch: r for r in load_snapshot(out).records if r.status.ran and r.sample == 1}
    status = {mb: (r.status.value, r.measurement.get("error")) for mb, r in first.items()}
    assert status[7][0] == "oom" and "can't allocate memory" in status[7][1], status
    assert status[6] == ("error", "killed by signal SIGSEGV"), status
    assert status[5][0] == "timeout" and "limit of 10 s" in status[5][1], status
    assert status[3] == ("ok", None), status
    assert flooded >= FLOOD_BYTES
    hung = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
    assert hung and all(_gone(pid) for pid in hung), "the hung trial outlived its limit"


def _search_until_a_trial_hangs(tmp_path, write_space, sigint: signal.Handlers,
                                *extra: str) -> tuple[subprocess.Popen, Path, Path, Path]:
    """``autofit search`` in a child whose SIGINT starts as ``sigint`` (SIG_DFL: Python turns it into
    KeyboardInterrupt; SIG_IGN: as in a background job of a non-interactive shell, ``cmd &`` in a CI
    script, which Python then leaves ignored), once its first trial (micro_batch 6) hangs. Returns the
    search, the trials' pid file, the study's directory and the space file. ``extra``: more arguments."""
    from fault_workloads import FAULTS_ENV

    pids = tmp_path / "pids"
    space = write_space(tmp_path / "space.toml", precision=["fp32"], micro_batch=[5, 6])
    out = tmp_path / "study"
    env = {**os.environ, "PYTHONPATH": str(REPO), FAULTS_ENV: "6:hang", "AUTOFIT_TEST_PIDFILE": str(pids)}
    # Set, not inherited: pytest itself may have SIGINT ignored (started in the background by a CI script),
    # and a child inherits that.
    search = subprocess.Popen([sys.executable, "-m", "autofit", "search", "--model", FAULTY, "--budget", "1GB",
                               "--space", str(space), "--device", "cpu", "--out", str(out), *extra],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
    try:
        deadline = time.monotonic() + 240
        while not (pids.is_file() and pids.read_text().strip()) and search.poll() is None:
            assert time.monotonic() < deadline, "no trial started"
            time.sleep(0.2)
    except BaseException:
        search.kill()
        raise
    return search, pids, out, space


def test_ctrl_c_records_the_running_trial_interrupted_and_the_study_resumes(tmp_path, write_space):
    search, pids, out, space = _search_until_a_trial_hangs(tmp_path, write_space, signal.SIG_DFL)
    try:
        search.send_signal(signal.SIGINT)  # Ctrl-C reaches the search only: a trial has its own session
        stdout, stderr = search.communicate(timeout=120)
    finally:
        if search.poll() is None:
            search.kill()
    assert search.returncode == 130, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == "autofit: interrupted" and "Traceback" not in stderr, stderr[-2000:]
    assert all(_gone(int(pid)) for pid in pids.read_text().split()), "the trial outlived the search"
    before = _ran(out)
    assert list(before.values()) == [((TrainConfig("fp32", 6, 1), 1), "interrupted", None)], before
    table = pd.read_csv(out / "trials.csv")
    assert list(table.loc[table["status"] != "pruned", "status"]) == ["interrupted"]

    from autofit.api.run_study import search as resume
    from autofit.study import load_snapshot

    assert load_snapshot(out).runs[-1]["stop_reason"] == "interrupted"
    replay = Replay()
    resume(FAULTY, "1GB", space=str(space), out_dir=out, device="cpu", trial_runner=replay)
    assert replay.calls[0] == TrainConfig("fp32", 6, 1), "the interrupted config runs again, first"
    after = _ran(out)
    assert after[0] == before[0] and "running" not in {s for _, s, _ in after.values()}
    assert sorted(c.micro_batch for (c, _), s, _ in after.values() if s == "error") == [5, 6]


@pytest.mark.parametrize("workers", (1, 2))
def test_started_with_ctrl_c_ignored_it_says_so_and_sigterm_stops_it_as_ctrl_c_would(tmp_path, write_space, workers):
    from autofit.study.launcher import STOP_GRACE_S

    search, pids, out, _ = _search_until_a_trial_hangs(tmp_path, write_space, signal.SIG_IGN, "--workers", str(workers))
    try:
        search.send_signal(signal.SIGINT)  # ignored: the search goes on
        time.sleep(1.0)
        assert search.poll() is None, "SIGINT was not ignored"
        sent = time.monotonic()
        search.send_signal(signal.SIGTERM)
        stdout, stderr = search.communicate(timeout=120)
        took = time.monotonic() - sent
    finally:
        if search.poll() is None:
            search.kill()
    lines = stderr.strip().splitlines()
    assert search.returncode == 143, stderr[-2000:]
    assert lines[0] == (f"autofit: warning: Ctrl-C is ignored in this process (SIGINT ignored: started in the "
                        f"background by a script?); stop it with kill {search.pid} (SIGTERM), which interrupts it as "
                        "Ctrl-C would"), stderr[-2000:]
    assert lines[-1] == "autofit: terminated (SIGTERM)" and "Traceback" not in stderr, stderr[-2000:]
    # workers, which inherit SIGINT ignored, still take the search's SIGINT: they mark their trials at once
    assert took < STOP_GRACE_S, f"stopped after {took:.0f} s: the workers were killed after the grace"
    assert all(_gone(int(pid)) for pid in pids.read_text().split()), "the trial outlived the search"
    ran = _ran(out)
    assert ((TrainConfig("fp32", 6, 1), 1), "interrupted", None) in ran.values(), ran
    assert {s for _, s, _ in ran.values()} <= {"interrupted", "ok"} and (workers > 1 or len(ran) == 1), ran
    from autofit.study import load_snapshot

    assert load_snapshot(out).runs[-1]["stop_reason"] == "interrupted"
    table = pd.read_csv(out / "trials.csv")  # the tables were written on the way out
    assert "interrupted" in set(table["status"]) and "running" not in set(table["status"])

@pytest.mark.parametrize("others_stopped", (False, True), ids=("the-other-plans", "the-other-had-stopped"))
def test_a_worker_killed_on_its_own_has_its_trial_run_again_while_the_other_goes_on(tmp_path, write_space,
                                                                                    others_stopped):
    from fault_workloads import FAULTS_ENV

    from autofit.study import load_snapshot

    pids = tmp_path / "pids"
    # micro_batch 6 is predicted the fastest: planned first, and again once interrupted (a slower config
    # interrupted may rightly be pruned instead, by the trials measured meanwhile). Alone in its space,
    # the other worker has nothing to plan while it hangs, and stops: workers start again for it.
    space = write_space(tmp_path / "space.toml", precision=["fp32"], micro_batch=[6] if others_stopped else [4, 5, 6])
    out = tmp_path / "study"
    env = {**os.environ, "PYTHONPATH": str(REPO), FAULTS_ENV: "6:hang-once", "AUTOFIT_TEST_PIDFILE": str(pids)}
    search = subprocess.Popen([sys.executable, "-m", "autofit", "search", "--model", FAULTY, "--budget", "1GB",
                               "--space", str(space), "--device", "cpu", "--out", str(out), "--workers", "2"],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not (pids.is_file() and pids.read_text().strip()) and search.poll() is None:
            assert time.monotonic() < deadline, "no trial started"
            time.sleep(0.2)
        while others_stopped and load_snapshot(out).stop_reason is None:
            assert time.monotonic() < deadline, "the other worker did not stop"
            time.sleep(0.2)
        hung = int(pids.read_text().split()[0])
        running = [r for r in load_snapshot(out).records if r.status is TrialStatus.RUNNING]
        hanging = [r for r in running if r.config.micro_batch == 6]  # the other worker's waits for the device
        assert len(hanging) == 1, running
        victim = hanging[0].worker["pid"]
        os.kill(victim, signal.SIGKILL)  # the worker alone, mid-trial (as the OOM killer would)
        stdout, stderr = search.communicate(timeout=300)
    finally:
        if search.poll() is None:
            search.kill()
    assert search.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "error" not in stderr.lower(), stderr[-3000:]
    died = [line for line in stderr.splitlines() if "died (killed by signal SIGKILL)" in line]
    assert died and "the trial it was running will run again" in died[0], stderr[-3000:]
    assert died[0].endswith("; the others go on") != others_stopped, died
    again = [line for line in stderr.splitlines() if "of a killed worker is marked interrupted; 2 workers start again" in line]
    assert bool(again) == others_stopped, stderr[-3000:]
    warning = [line for line in stderr.splitlines() if line.startswith("autofit: warning: worker ")]
    assert len(warning) == 1 and "killed by signal SIGKILL while the search ran" in warning[0], stderr[-3000:]
    assert "marked interrupted and ran again" in warning[0], warning
    assert _gone(hung), "the killed worker's trial outlived it"
    records = [r for r in load_snapshot(out).records if r.status is not TrialStatus.PRUNED]
    six = [(r.number, r.status.value, r.worker["pid"]) for r in records if r.config.micro_batch == 6 and r.sample == 1]
    assert [s for _, s, _ in six] == ["interrupted", "ok"], (six, stderr[-3000:])
    assert six[0][2] == victim and six[1][2] != victim, "another worker ran it again"
    assert "running" not in {r.status.value for r in records}

def test_a_full_disk_while_the_journal_is_written_is_one_line_and_the_study_resumes(tmp_path):
    out = tmp_path / "study"
    _search(out, Replay(), trials=2)
    journal = (out / "study.journal").read_bytes()

    def search_on_a_full_disk() -> str:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing us
        limit = len(journal) + 3000  # a record or two more, then one cut off mid-write
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        _search(out, Replay(), trials=6)
        return "no error"

    status, text = _forked(search_on_a_full_disk)
    assert os.WEXITSTATUS(status) == 1 and text.startswith("RunFailure: "), text
    assert "\n" not in text and f"cannot write the study's journal {out / 'study.journal'} (File too large)" in text
    assert "run the same search again to resume" in text, text
    data = (out / "study.journal").read_bytes()
    assert data.startswith(journal) and len(data) > len(journal) and data.endswith(b"\n"), "a record cut off mid-write"
    assert not list(out.glob("study.journal.torn-*")), "the next start had a torn line to repair"
    result = _search(out, Replay(), trials=6)  # resumes: every trial once, none left running
    after = _ran(out)
    finished = [c for c, s, _ in after.values() if s == "error"]
    assert len(finished) == len(set(finished)) == 6 == result.n_real, after
    assert "running" not in {s for _, s, _ in after.values()}


def test_temporary_files_of_a_killed_write_are_removed_at_the_next_start(tmp_path):
    from autofit.core.files import temp_path

    out = tmp_path / "study"
    _search(out, Replay(), trials=1)
    # killed as it starts writing trials.csv: its temporary file is left, created and empty
    status, text = _forked(lambda: (_kill_when_writing(out, "trials.csv"), _search(out, Replay(), trials=2))[1])
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, text
    left = [p.name for p in out.iterdir() if p.name.startswith(".trials.csv.tmp")]
    assert len(left) == 1, sorted(p.name for p in out.iterdir())
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # another process, alive
    try:
        live = out / temp_path(out / "best.json").name.replace(f"tmp{os.getpid()}@", f"tmp{writer.pid}@")
        live.write_text("{")  # as a concurrent `autofit report` writing best.json would have it
        (out / ".notes.tmp").write_text("not autofit's")
        events = []
        _search(out, Replay(), trials=2, progress=events.append)
    finally:
        writer.kill()
        writer.wait()
    names = {p.name for p in out.iterdir()}
    assert left[0] not in names and live.name in names and ".notes.tmp" in names
    assert any(f"removed 1 temporary file(s) a killed write left in {out}: {left[0]}" in e.message for e in events)

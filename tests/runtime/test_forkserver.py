"""The trials' fork server: forked trials are isolated processes, and the zygote never ran an operator."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from autofit.runtime import forkserver, procs

TESTS_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture
def server_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("AUTOFIT_TEST_MARKER", "one")
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    forkserver.stop_server()


def _finish(child: procs.Child) -> dict | None:
    try:
        assert child.wait()
    finally:
        child.kill()
    return child.last_message()


def test_a_forked_trial_runs_every_thread_in_its_own_group_and_its_exit_reaches_us(server_env, monkeypatch):
    out = _finish(forkserver.start_trial("procs_entries:torch_threads", {}, timeout_s=120, echo_stderr=False))
    assert out["threads"] == __import__("torch").get_num_threads() and out["tasks"] >= out["threads"]
    assert out["pgid_is_pid"] and out["cwd"] == str(server_env) and out["marker"] == "one"
    child = forkserver.start_trial("procs_entries:segfault", {}, timeout_s=120, echo_stderr=False)
    assert _finish(child) is None and child.failure() == "killed by signal SIGSEGV"
    child = forkserver.start_trial("procs_entries:raising", {}, timeout_s=120, echo_stderr=False)
    assert _finish(child) is None and child.failure() == "exited with status 1: the last line of the message"
    zygote = forkserver._SERVER.zygote.pid
    monkeypatch.setenv("AUTOFIT_TEST_MARKER", "two")  # what libraries read at load may differ: a new zygote
    out = _finish(forkserver.start_trial("procs_entries:torch_threads", {}, timeout_s=120, echo_stderr=False))
    assert out["marker"] == "two" and forkserver._SERVER.zygote.pid != zygote


def test_a_forked_trial_dies_with_its_zygote(server_env):
    child = forkserver.start_trial("procs_entries:hang", {}, timeout_s=120, echo_stderr=False)
    zygote = forkserver._SERVER.zygote.pid
    try:
        os.kill(zygote, signal.SIGKILL)
        end = time.monotonic() + 10
        while time.monotonic() < end and not child.exited():
            time.sleep(0.05)
        assert child.exited()
    finally:
        child.kill()


def _zygotes_of(pid: int) -> list[int]:
    """Processes running a zygote for parent ``pid`` (procs.spawn passes the parent's pid last)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"autofit.runtime.forkserver:zygote_main" in args and str(pid).encode() in args[-3:]:
            found.append(int(entry))
    return found


def test_exiting_while_the_zygote_starts_does_not_wait_for_it_and_leaves_none(server_env):
    import subprocess
    import sys

    code = ("import os, time; from autofit.runtime import forkserver; forkserver.start_server_soon(); time.sleep(0.2); "
            "forkserver._stop_at_exit(); print(forkserver._SERVER_LOCK.locked(), os.getpid())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    starting, pid = done.stdout.split()
    assert done.returncode == 0 and starting == "True"  # returned while the start held the lock
    end = time.monotonic() + 30
    while time.monotonic() < end and _zygotes_of(int(pid)):
        time.sleep(0.1)
    assert not _zygotes_of(int(pid))


def test_a_variable_the_zygotes_imports_set_is_not_a_changed_environment(server_env):
    env = {k: v for k, v in procs.child_env().items() if k != "AUTOFIT_TEST_SET_BY_IMPORT"}
    server = forkserver.TrialServer(env, preload=("sets_env_on_import",))
    try:
        assert server.import_env == {"AUTOFIT_TEST_SET_BY_IMPORT": "yes"}
        assert server.serves(env) and server.serves({**env, "AUTOFIT_TEST_SET_BY_IMPORT": "yes"})
        assert not server.serves({**env, "AUTOFIT_TEST_SET_BY_IMPORT": "no"})
        assert not server.serves({**env, "AUTOFIT_TEST_MARKER": "two"})
    finally:
        server.close()


def test_importing_torch_dynamo_after_the_zygote_started_keeps_the_zygote(server_env):
    """torch._dynamo sets TORCHINDUCTOR_CACHE_DIR when imported; a search imports it (fake tensors) after
    starting its zygote, which must not be restarted for that (it was: two seconds at every first use)."""
    import subprocess
    import sys

    code = ("import os; os.environ.pop('TORCHINDUCTOR_CACHE_DIR', None); from autofit.runtime import forkserver; "
            "a = forkserver.ensure_server().zygote.pid; import torch._dynamo; "
            "assert 'TORCHINDUCTOR_CACHE_DIR' in os.environ; print(a == forkserver.ensure_server().zygote.pid)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True"]


def test_a_start_that_waited_for_the_lock_starts_the_zygote_for_the_environment_then(server_env, monkeypatch):
    """A background start (start_server_soon) that waited while the environment changed (the next test,
    the next search of a launcher) must not replace a zygote of the new environment with one of the old:
    it did, and a profile that meanwhile found the zygote busy profiled every precision in its own process."""
    import threading

    with forkserver._SERVER_LOCK:  # a zygote is being started elsewhere: the background start waits
        forkserver.start_server_soon()
        time.sleep(0.2)  # the thread has begun and waits for the lock
        monkeypatch.setenv("AUTOFIT_TEST_MARKER", "two")
    for thread in threading.enumerate():
        if thread.name == "autofit-zygote-start":
            thread.join(timeout=300)
    assert forkserver.ready(), "the background start left a zygote for the old environment"


def test_a_zygote_imports_the_workloads_preload_for_its_trials_and_skips_one_that_fails(server_env):
    # modules that neither torch nor autofit imports; one that does not exist must not keep the zygote down
    modules = ["wave", "xml.dom.minidom", "no_such_module_here"]
    forkserver.use_preload(tuple(modules))
    try:
        forkserver.stop_server()
        out = _finish(forkserver.start_trial("procs_entries:loaded", {"modules": modules}, timeout_s=120, echo_stderr=False))
        assert out["loaded"] == ["wave", "xml.dom.minidom"]
        forkserver.use_preload(())
        forkserver.stop_server()
        out = _finish(forkserver.start_trial("procs_entries:loaded", {"modules": modules}, timeout_s=120, echo_stderr=False))
        assert out["loaded"] == []
    finally:
        forkserver.use_preload(())


def test_a_preload_that_starts_a_thread_is_skipped_with_a_warning_not_forked_from(server_env, caplog):
    modules = ["wave", "starts_thread_on_import"]
    forkserver.use_preload(tuple(modules))
    try:
        forkserver.stop_server()
        with caplog.at_level("WARNING", logger="autofit.runtime.forkserver"):
            out = _finish(forkserver.start_trial("procs_entries:loaded", {"modules": modules}, timeout_s=120,
                                                 echo_stderr=False))
        assert out["loaded"] == []
        assert forkserver._EXTRA == ()
        assert [r.getMessage() for r in caplog.records] == [
            "importing starts_thread_on_import (Workload.preload) started a thread in the trials' fork server, where "
            "forking is then unsafe: the preload is skipped and each trial imports those modules itself"]
    finally:
        forkserver.use_preload(())


def test_a_running_zygote_imports_a_preload_named_after_it_started_and_keeps_serving(server_env):
    # as when the command line starts the zygote before the workload (and its preload) is known
    forkserver.stop_server()
    forkserver.use_preload(())
    first = forkserver.ensure_server()
    try:
        forkserver.use_preload(("wave", "no_such_module_here"))
        assert forkserver.ensure_server() is first  # not restarted: the running one imported them
        out = _finish(forkserver.start_trial("procs_entries:loaded", {"modules": ["wave"]}, timeout_s=120,
                                             echo_stderr=False))
        assert out["loaded"] == ["wave"]
        assert forkserver.ensure_server() is first
    finally:
        forkserver.use_preload(())


def test_a_preload_named_later_that_starts_a_thread_replaces_the_zygote_with_one_without_it(server_env, caplog):
    forkserver.stop_server()
    forkserver.use_preload(())
    first = forkserver.ensure_server()
    try:
        forkserver.use_preload(("xml.dom.minidom", "starts_thread_on_import"))
        with caplog.at_level("WARNING", logger="autofit.runtime.forkserver"):
            second = forkserver.ensure_server()
        assert second is not first and not first.alive()  # never forked from once a thread ran there
        assert forkserver._EXTRA == ()
        out = _finish(forkserver.start_trial("procs_entries:loaded", {"modules": ["starts_thread_on_import"]},
                                             timeout_s=120, echo_stderr=False))
        assert out["loaded"] == []
        assert [r.getMessage() for r in caplog.records] == [
            "importing starts_thread_on_import (Workload.preload) started a thread in the trials' fork server, where "
            "forking is then unsafe: the preload is skipped and each trial imports those modules itself"]
    finally:
        forkserver.use_preload(())

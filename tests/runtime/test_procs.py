"""autofit.runtime.procs: JSON messages, limits, group kill, die-with-parent, stderr tail. Real child processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from autofit.runtime import procs

TESTS_DIR = Path(__file__).resolve().parents[1]
ENV = procs.child_env({"PYTHONPATH": os.pathsep.join([str(TESTS_DIR), procs.child_env()["PYTHONPATH"]])})


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] != b"Z"


def _gone_within(pid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _run(entry: str, request: dict, timeout_s: float = 60) -> tuple[procs.Child, bool]:
    child = procs.spawn(entry, request, timeout_s=timeout_s, env=ENV)
    try:
        finished = child.wait()
    finally:
        child.kill()
    return child, finished


def test_spawned_child_sends_json_messages_in_order_and_prints_go_to_stderr():
    child, finished = _run("procs_entries:echo", {"value": [1, "two"], "extra": 2})
    assert finished
    assert list(child.messages)[:2] == [{"index": 0}, {"index": 1}]
    assert child.last_message()["echo"] == [1, "two"]
    assert "a print that must not reach the messages" in child.stderr_tail()
    assert os.waitstatus_to_exitcode(child.wait_status) == 0


def test_raising_child_reports_the_exceptions_last_line():
    child, finished = _run("procs_entries:raising", {})
    assert finished and child.last_message() is None
    assert child.failure() == "exited with status 1: the last line of the message"


def test_crashing_child_reports_the_signal():
    child, _ = _run("procs_entries:segfault", {})
    assert child.failure() == "killed by signal SIGSEGV"


def test_a_line_that_is_not_json_is_a_protocol_error_not_a_message():
    child, _ = _run("procs_entries:garbage", {})
    assert child.last_message() is None
    assert child.failure() == "sent a message that is not a JSON object"


def test_wall_clock_limit_kills_the_whole_group():
    child = procs.spawn("procs_entries:hang_with_grandchild", {}, timeout_s=60, env=ENV)
    try:
        grandchild = child.next_message()["grandchild"]
        child.extend_deadline(1.0)
        finished = child.wait()
    finally:
        child.kill()
    assert not finished
    assert child.failure(finished) == "exceeded the wall-clock limit of 1 s"
    assert _gone_within(grandchild, 10)
    assert os.WIFSIGNALED(child.wait_status) and os.WTERMSIG(child.wait_status) == signal.SIGKILL


def test_a_child_dies_with_its_parent():
    # The middle process is killed alone (SIGKILL to its pid, not its group); the grandchild,
    # in the middle's group, must notice its parent is gone and take the group down.
    child = procs.spawn("procs_entries:hang_with_grandchild", {}, timeout_s=60, env=ENV)
    try:
        grandchild = child.next_message()["grandchild"]
        os.kill(child.pid, signal.SIGKILL)
        assert _gone_within(grandchild, 10)
    finally:
        child.kill()


def test_forked_child_runs_a_closure():
    secret = object()  # not JSON, not picklable by reference: only inheritance carries it
    child = procs.fork(lambda request, send: {"same": request["obj"] is secret, "n": request["n"] + 1},
                       {"obj": secret, "n": 41}, timeout_s=60)
    try:
        assert child.wait()
    finally:
        child.kill()
    assert child.last_message() == {"same": True, "n": 42}


def test_next_message_raises_past_the_limit():
    child = procs.spawn("procs_entries:hang", {}, timeout_s=0.5, env=ENV)
    try:
        with pytest.raises(TimeoutError, match="wall-clock limit of 0.5 s"):
            child.next_message()
    finally:
        child.kill()


def test_bad_entry_and_unserialisable_request_are_refused():
    with pytest.raises(ValueError, match="package.module:function"):
        procs.spawn("procs_entries.echo", {})
    with pytest.raises(TypeError):
        procs.spawn("procs_entries:echo", {"x": object()})


def test_exit_text():
    assert procs.exit_text(0) == "exited with status 0"
    assert procs.exit_text(3 << 8) == "exited with status 3"
    assert procs.exit_text(signal.SIGKILL) == "killed by signal SIGKILL"


def test_a_request_larger_than_an_argument_or_a_pipe_buffer_arrives_whole():
    value = "x" * (1 << 20)  # 1 MiB: over Linux's 128 KiB per argument and the 64 KiB pipe buffer
    child, finished = _run("procs_entries:echo", {"value": value})
    assert finished and child.last_message()["echo"] == value


def test_log_path_receives_the_childs_output(tmp_path):
    log = tmp_path / "child.log"
    child = procs.spawn("procs_entries:raising", {}, timeout_s=60, env=ENV, log_path=log)
    try:
        assert child.wait()
    finally:
        child.kill()
    assert "the last line of the message" in log.read_text()
    assert child.failure() == "exited with status 1: the last line of the message"


def test_a_child_imports_our_autofit_not_one_in_the_working_directory(tmp_path, monkeypatch):
    decoy = tmp_path / "autofit"
    decoy.mkdir()
    (decoy / "__init__.py").write_text('raise ImportError("the working directory\'s autofit was imported")\n')
    monkeypatch.chdir(tmp_path)  # on no entry of our path, as under the installed `autofit` command
    child, finished = _run("procs_entries:echo", {"value": 3})
    assert finished and (child.last_message() or {}).get("echo") == 3, child.failure()
    monkeypatch.syspath_prepend(str(tmp_path))  # as under `python -m`: ours too, so the child keeps it
    assert procs._boot_code() == procs._BOOT

"""Every probe's failure is said in one line (the exception's type and its message's first line) and its
traceback comes back from the child for --debug (autofit.probes.failures)."""

from __future__ import annotations

import pytest

from autofit.probes import device_rates, links
from autofit.probes.failures import child_failure, error_reply, one_line


class _Child:
    """Stands in for an autofit.runtime.procs.Child that has finished."""

    def __init__(self, messages=(), failure="exited with status 1: Boom", tail="Traceback ...\nBoom"):
        self.messages = list(messages)
        self._failure, self._tail = failure, tail

    def wait(self):
        return True

    def kill(self):
        return 0

    def last_message(self):
        return self.messages[-1] if self.messages else None

    def failure(self, finished=True):
        return self._failure

    def stderr_tail(self):
        return self._tail


def _raise(exc):
    raise exc


def test_one_line_is_the_type_and_the_first_line():
    assert one_line(ValueError("first\nsecond")) == "ValueError: first"
    assert one_line(KeyError()) == "KeyError"
    try:
        _raise(RuntimeError("deep\ndown"))
    except RuntimeError as exc:
        reply = error_reply(exc)
    assert reply["status"] == "error" and reply["error"] == "RuntimeError: deep"
    assert "Traceback (most recent call last)" in reply["traceback"] and "_raise" in reply["traceback"]


def test_the_rate_probe_child_replies_with_its_error_and_the_parent_says_it(monkeypatch, debug_lines):
    monkeypatch.setattr(device_rates, "measure_rates", lambda device_type, dtypes=None: _raise(ValueError("no rate\nat all")))
    reply = device_rates.probe_child({"device_type": "cpu", "repeats": 2})
    assert reply["error"] == "ValueError: no rate" and "measure_rates" in reply["traceback"]
    monkeypatch.setattr(device_rates, "start_probe_child", lambda *a, **k: _Child([reply]))
    with pytest.raises(RuntimeError, match=r"^the cpu rate probe failed: ValueError: no rate$"):
        device_rates._probe_once("cpu")
    assert any("rate probe failed" in line and "Traceback" in line and "at all" in line for line in debug_lines)


def test_a_rate_probe_that_died_is_said_by_how_it_ended(monkeypatch, debug_lines):
    monkeypatch.setattr(device_rates, "start_probe_child", lambda *a, **k: _Child(failure="killed by signal SIGSEGV",
                                                                                 tail="Fatal Python error"))
    with pytest.raises(RuntimeError, match="the cpu rate probe failed: killed by signal SIGSEGV"):
        device_rates._probe_once("cpu")
    assert any("Fatal Python error" in line for line in debug_lines)


def test_a_link_probe_rank_that_fails_says_why(monkeypatch, debug_lines):
    import autofit.runtime.ranks as ranks

    monkeypatch.setattr(ranks, "join_group", lambda request, spawned: _raise(OSError("no route\nto host")))
    reply = links.link_probe_child({"rank": 0, "world_size": 2})
    assert reply["error"] == "OSError: no route" and "join_group" in reply["traceback"]
    ok = {"status": "ok"}
    monkeypatch.setattr(links, "_start_rank", lambda request, device_type: _Child([ok] if request["rank"] else [reply]))
    with pytest.raises(RuntimeError, match=r"^the link probe of 2 cpu ranks failed: OSError: no route$"):
        links.measure_links("cpu", 2)
    assert any("rank 0" in line and "Traceback" in line for line in debug_lines)


def test_child_failure_without_a_reply_falls_back_to_how_it_ended(debug_lines):
    assert child_failure(_Child(), True, "x") == "exited with status 1: Boom"
    assert debug_lines == ["x failed; the child's last output:\nTraceback ...\nBoom"]

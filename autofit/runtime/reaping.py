"""How a child of :mod:`autofit.runtime.procs` ends: its exit status, read without reaping it (ours
to wait for, or a :class:`Reaper`'s), its process group gone, and its death with its parent."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Protocol

from autofit.core.procstat import stat_fields

REAP_GRACE_S = 2.0          # after SIGKILL, how long to wait for the group's members to go
_PARENT_POLL_S = 0.5


class Reaper(Protocol):
    """Who learns how a child exited when it is not our own child (a fork server's, :mod:`autofit.runtime.forkserver`)."""

    def poll_status(self, pid: int) -> int | None:
        """Its ``os.waitpid`` status if it has exited, else None; never blocks."""

    def wait_status(self, pid: int, timeout_s: float) -> int | None:
        """Its status once it has exited, waiting up to ``timeout_s``; None if still unknown."""


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """In a child: when ``parent_pid`` is no longer our parent, send ``sig`` to our process group
    if we lead one (taking what we started with us), else to ourselves.

    A watcher thread, not ``prctl(PR_SET_PDEATHSIG)``: that one fires when the *thread* that
    started us exits, and exists on Linux only. ``sig=SIGINT`` lets a study worker mark its
    running trial failed before it goes.
    """
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        if os.getpgid(0) == os.getpid():
            os.killpg(0, sig)
        else:
            os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="autofit-parent-watch", daemon=True).start()


def exit_text(wait_status: int) -> str:
    """``killed by signal SIGSEGV`` or ``exited with status 3``, from an ``os.waitpid`` status."""
    if os.WIFSIGNALED(wait_status):
        sig = os.WTERMSIG(wait_status)
        try:
            return f"killed by signal {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exited with status {os.waitstatus_to_exitcode(wait_status)}"


def has_exited(pid: int) -> bool:
    """Whether our child ``pid`` has exited, leaving it a zombie (unreaped, so its pid stays ours)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def peek_status(pid: int, reaper: Reaper | None) -> int | None:
    """How child ``pid`` exited, without reaping it (its group may still need killing), waiting up to
    :data:`REAP_GRACE_S` for it; None when it has not exited by then or is not ours."""
    if reaper is not None:
        return reaper.wait_status(pid, REAP_GRACE_S)
    end = time.monotonic() + REAP_GRACE_S  # its pipes close as it dies, a moment before it exits
    while True:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return None
        if info is not None:
            if info.si_code == os.CLD_EXITED:
                return (info.si_status & 0xFF) << 8
            return info.si_status & 0x7F  # killed (or dumped core) by this signal
        if time.monotonic() >= end:
            return None
        time.sleep(0.01)


def wait_group_gone(pgid: int) -> None:
    """Wait up to :data:`REAP_GRACE_S` for every running process of group ``pgid`` to go."""
    deadline = time.monotonic() + REAP_GRACE_S
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.01)


def _group_alive(pgid: int) -> bool:
    """Whether a process in group ``pgid`` is still running (zombies do not count). Linux /proc; else False."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return False
    for entry in entries:
        if not entry.isdigit():
            continue
        fields = stat_fields(entry)  # state ppid pgrp ...
        if fields and len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False

"""Child processes: the one place autofit starts, talks to, supervises and kills them.

Every child (a trial, a pipeline stage, a profiling worker, the device probe, a bench worker,
a study worker) is a :class:`Child`:

- **started** either in a fresh interpreter (:func:`spawn`: ``subprocess``, not
  ``multiprocessing``, so a caller's ``__main__`` is never re-imported and no helper process
  outlives the child) running an entry point ``"package.module:function"``, or by
  :func:`fork` running a Python callable (for what cannot be re-imported: a workload built of
  lambdas). The entry is called as ``function(request, send)``;
- **talking JSON only**: the request is a JSON object; the child sends JSON objects, one a
  line, on a pipe of their own (``send(obj)``; a returned dict is sent last). Nothing read
  back is unpickled, and the child's stdout never mixes with them (it goes to its stderr);
- **supervised** against a wall-clock limit (``timeout_s``, from the start), with its stderr
  (and stdout) captured: the last :data:`STDERR_TAIL_BYTES` are kept for error messages, and
  are echoed to ours as they arrive when ``echo_stderr``;
- **killed** with its whole process group when it leads one (``new_group=True``, the default:
  whatever it started dies with it), else alone; and it **dies with its parent**
  (:func:`die_with_parent`), so a killed caller leaves no orphans.

This module starts, limits and kills children (the parent's side); :mod:`autofit.runtime.messages`
holds the JSON messaging, both ends (:func:`serve` runs in the child), and
:mod:`autofit.runtime.reaping` how a child's exit is learnt. Their public names are here too.

Example::

    child = spawn("autofit.probes.device_rates:probe_child", {"device_type": "cuda"}, timeout_s=300)
    try:
        finished = child.wait()
    finally:
        child.kill()
    message = child.last_message()       # None when it sent nothing
    if message is None:
        print(child.failure(finished))   # "exceeded ...", the stderr's last line, "killed by signal SIGSEGV"
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from autofit.runtime.messages import MAX_MESSAGE_BYTES, MessageReader, Send, serve
from autofit.runtime.reaping import (
    REAP_GRACE_S,
    Reaper,
    die_with_parent,
    exit_text,
    has_exited,
    peek_status,
    wait_group_gone,
)

__all__ = ["CHILD_OMP_WAIT_POLICY", "MAX_MESSAGE_BYTES", "STDERR_TAIL_BYTES", "Child", "Reaper", "Send", "child_env", "die_with_parent",
           "exit_text", "fork", "pump", "serve", "spawn"]

STDERR_TAIL_BYTES = 8192
SECRET_ENV = ("PGPASSWORD", "MYSQL_PWD")  # database passwords a trial has no use for
_URL_WITH_PASSWORD = re.compile(r"://[^/@:\s]+:[^@/\s]+@")


# The OpenMP wait policy of every child autofit starts, where the user's environment sets none.
CHILD_OMP_WAIT_POLICY = "PASSIVE"


def child_env(extra: dict[str, str] | None = None, secrets: bool = False) -> dict[str, str]:
    """Our environment, with this autofit first on PYTHONPATH (so a child imports the same code), OpenMP's
    wait policy :data:`CHILD_OMP_WAIT_POLICY` unless ours has one, and ``extra``.

    Without ``secrets`` (a trial, a profile: they run the user's code and need no database),
    database passwords are left out: :data:`SECRET_ENV` and any variable holding a URL with one."""
    env = dict(os.environ)
    if not secrets:
        env = {k: v for k, v in env.items() if k not in SECRET_ENV and not _URL_WITH_PASSWORD.search(v)}
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    # GNU OpenMP spin-waits at its barriers unless told otherwise; beside another busy process that
    # spin steals the CPU the awaited thread needs, and timings (so the ranking) follow the load
    # (docs/facts.md#openmp-waiting). A policy the user set is kept.
    env.setdefault("OMP_WAIT_POLICY", CHILD_OMP_WAIT_POLICY)
    env.update(extra or {})
    return env


class Child:
    """A started child process: its messages, its stderr tail, its limit. Build with :func:`spawn` or :func:`fork`.

    ``messages`` holds the decoded messages not yet taken, oldest first. ``done`` is True once
    the child closed its message pipe or exited. Methods never raise for the child's sake.
    """

    def __init__(self, pid: int, message_fd: int, stderr_fd: int | None, *, new_group: bool, timeout_s: float | None,
                 echo_stderr: bool, log_path: Path | None, popen: subprocess.Popen | None = None,
                 reaper: Reaper | None = None):
        self.pid = pid
        self._reaper = reaper  # set when the child is not ours to wait for (a fork server's)
        self.new_group = new_group
        self.started = time.monotonic()
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else self.started + timeout_s
        self._reader = MessageReader()
        self.messages = self._reader.messages
        self.wait_status: int | None = None
        self._popen = popen
        self._message_fd: int | None = message_fd
        self._stderr_fd = stderr_fd
        self._echo = echo_stderr
        self._log_path = log_path
        self._tail = bytearray()
        self._exited = False

    # --- reading -----------------------------------------------------------------------------

    @property
    def protocol_error(self) -> str | None:
        """What the child sent that is not a message: not a JSON object, too long, or cut short."""
        return self._reader.error

    @property
    def done(self) -> bool:
        return self._message_fd is None

    @property
    def timed_out(self) -> bool:
        """Past its wall-clock limit and not done."""
        return not self.done and self.deadline is not None and time.monotonic() >= self.deadline

    def fds(self) -> list[int]:
        return [fd for fd in (self._message_fd, self._stderr_fd) if fd is not None]

    def read(self, fd: int) -> None:
        """Consume what is readable on ``fd`` (one of :meth:`fds`); called by :func:`pump`."""
        try:
            data = os.read(fd, 1 << 16)
        except OSError:
            data = b""
        if fd == self._stderr_fd:
            if not data:
                self._close_stderr()
                return
            self._tail = (self._tail + data)[-STDERR_TAIL_BYTES:]
            if self._echo:
                with contextlib.suppress(OSError):
                    os.write(2, data)
            return
        if not data:
            self._close_messages()
            return
        self._reader.feed(data)

    def _close_messages(self) -> None:
        if self._message_fd is not None:
            os.close(self._message_fd)
            self._message_fd = None
        self._reader.close()

    def _close_stderr(self) -> None:
        if self._stderr_fd is not None:
            os.close(self._stderr_fd)
            self._stderr_fd = None

    def exited(self) -> bool:
        """Whether the process has exited (left a zombie until :meth:`kill` reaps it, so its pid stays ours)."""
        if self._exited or self.wait_status is not None:
            return True
        if self._reaper is not None:
            self._exited = self._reaper.poll_status(self.pid) is not None
            return self._exited
        self._exited = has_exited(self.pid)
        return self._exited

    def _drain(self) -> None:
        # Exited without closing its pipe? (A grandchild it forked may hold the write end.) Take what is there.
        while self._message_fd is not None and select.select([self._message_fd], [], [], 0)[0]:
            self.read(self._message_fd)
        self._close_messages()

    def wait(self, until: Callable[["Child"], bool] | None = None) -> bool:
        """Pump until done (or ``until(self)``); False when the wall-clock limit came first."""
        while not self.done and not (until is not None and until(self)):
            if self.timed_out:
                return False
            pump([self], 0.25)
        return True

    def next_message(self) -> dict | None:
        """The next message; None when the child is done and sent no more. Raises TimeoutError past the limit."""
        while not self.messages:
            if self.done:
                return None
            if self.timed_out:
                raise TimeoutError(f"no message within the wall-clock limit of {self.timeout_s:g} s")
            pump([self], 0.25)
        return self.messages.popleft()

    def last_message(self) -> dict | None:
        return self.messages[-1] if self.messages else None

    def extend_deadline(self, timeout_s: float | None) -> None:
        """A new limit of ``timeout_s`` from now (a worker that reported may take the next job)."""
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def stderr_tail(self) -> str:
        """The last bytes the child wrote to stderr or stdout, as text."""
        if self._log_path is not None:
            with contextlib.suppress(OSError), open(self._log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - STDERR_TAIL_BYTES))
                return f.read().decode(errors="replace")
        return bytes(self._tail).decode(errors="replace")

    def stderr_last_line(self) -> str | None:
        lines = [line.strip() for line in self.stderr_tail().splitlines() if line.strip()]
        return lines[-1] if lines else None

    def failure(self, finished: bool = True) -> str:
        """One line saying why there is no message: the limit, the stderr's last line, or how it exited."""
        if not finished:
            return f"exceeded the wall-clock limit of {self.timeout_s:g} s"
        if self.protocol_error:
            return f"sent {self.protocol_error}"
        status = self.wait_status if self.wait_status is not None else peek_status(self.pid, self._reaper)
        if status is None:
            return "did not exit and sent no result"
        if os.WIFSIGNALED(status):
            return exit_text(status)
        last = self.stderr_last_line()
        return f"{exit_text(status)}: {last}" if last else f"{exit_text(status)} without a result"

    # --- signals, kill, reap -----------------------------------------------------------------

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's group (if it leads one) or to the child; no-op once reaped."""
        if self.wait_status is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.new_group:
                try:
                    os.killpg(self.pid, sig)
                    return
                except ProcessLookupError:
                    pass  # a forked child killed before its setsid(): not a group leader yet
            os.kill(self.pid, sig)

    def kill(self, grace_s: float = 0.0) -> int:
        """Stop the child and its group (SIGTERM and ``grace_s`` to exit first, if given), reap it, close
        its pipes. Returns its ``os.waitpid`` status. Idempotent."""
        if self.wait_status is None:
            if grace_s > 0 and not self.exited():
                self.signal(signal.SIGTERM)
                end = time.monotonic() + grace_s
                while time.monotonic() < end and not self.exited():
                    time.sleep(0.02)
            self.signal(signal.SIGKILL)
            if self.new_group:
                wait_group_gone(self.pid)
            self._reap()
        self._drain_stderr()
        self._close_messages()
        self._close_stderr()
        return self.wait_status

    def _reap(self) -> None:
        if self.wait_status is None and self._reaper is not None:
            status = self._reaper.wait_status(self.pid, 2 * REAP_GRACE_S)
            self.wait_status = status if status is not None else signal.SIGKILL  # its reaper died with it
        if self.wait_status is None:
            try:
                _, self.wait_status = os.waitpid(self.pid, 0)
            except ChildProcessError:
                self.wait_status = 0
            if self._popen is not None:  # so Popen never waits on a reaped pid
                self._popen.returncode = os.waitstatus_to_exitcode(self.wait_status)

    def _drain_stderr(self) -> None:
        while self._stderr_fd is not None and select.select([self._stderr_fd], [], [], 0)[0]:
            self.read(self._stderr_fd)


def pump(children: Iterable[Child], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for output from any of ``children`` and consume it; a child that
    exited is marked done once its pipe is drained."""
    children = list(children)
    owner = {fd: child for child in children for fd in child.fds()}
    ready = select.select(list(owner), [], [], max(0.0, timeout_s))[0] if owner else []
    if not owner:
        time.sleep(max(0.0, timeout_s))
    for fd in ready:
        owner[fd].read(fd)
    for child in children:
        if not ready and not child.done and child.exited():
            child._drain()


_BOOT = "from autofit.runtime.messages import child_main; child_main()"


def _boot_code() -> str:
    """The child's ``-c`` program. ``python -c`` puts the working directory first on the child's path, ahead of
    PYTHONPATH; unless it is on ours too (``python -m``), it is taken off first, so that a directory
    holding another ``autofit`` (or a module named as one of ours) cannot change what the child imports."""
    here = os.path.realpath(os.getcwd())
    if any(os.path.realpath(entry or os.curdir) == here for entry in sys.path):
        return _BOOT
    return "import sys\nif sys.path[:1] == ['']:\n    del sys.path[0]\n" + _BOOT


def spawn(entry: str, request: dict, *, timeout_s: float | None = None, new_group: bool = True,
          env: dict[str, str] | None = None, echo_stderr: bool = False, log_path: Path | None = None,
          pass_fds: tuple[int, ...] = ()) -> Child:
    """Run ``entry`` (``"package.module:function"``) in a fresh interpreter with ``request`` (a JSON object).

    ``env``: the child's environment (default :func:`child_env`); ``log_path``: a file that
    receives the child's stderr and stdout instead of a captured pipe; ``pass_fds``: more of our
    file descriptors the child keeps, under the same numbers. Raises ValueError for a
    request that is not JSON, OSError when the interpreter cannot be started.
    """
    if ":" not in entry:
        raise ValueError(f"entry must be 'package.module:function', got {entry!r}")
    payload = json.dumps(request).encode()
    message_r, message_w = os.pipe()
    stderr_r, stderr_w = (None, None) if log_path is not None else os.pipe()
    log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 -- closed below
    out = log.fileno() if log is not None else stderr_w
    try:
        popen = subprocess.Popen(
            [sys.executable, "-c", _boot_code(), entry, str(message_w), str(os.getpid())],
            pass_fds=(message_w, *pass_fds), stdin=subprocess.PIPE, stdout=out, stderr=out,
            env=env if env is not None else child_env(),
            start_new_session=new_group)  # its own session and group, set before exec: no race
    except BaseException:
        for fd in (message_r, stderr_r):
            if fd is not None:
                os.close(fd)
        raise
    finally:
        for fd in (message_w, stderr_w):
            if fd is not None:
                os.close(fd)
        if log is not None:
            log.close()
    # The request goes on the child's stdin (no size limit, unlike an argument), from a thread:
    # more than a pipe's buffer would block us until the child reads it.
    threading.Thread(target=_write_and_close, args=(popen.stdin, payload), name="autofit-request",
                     daemon=True).start()
    return Child(popen.pid, message_r, stderr_r, new_group=new_group, timeout_s=timeout_s, echo_stderr=echo_stderr,
                 log_path=log_path, popen=popen)


def _write_and_close(pipe, data: bytes) -> None:
    with contextlib.suppress(OSError):  # a child that died first does not read it
        pipe.write(data)
    with contextlib.suppress(OSError):
        pipe.close()


def fork(function: Callable[[dict, Send], dict | None], request: dict, *, timeout_s: float | None = None,
         new_group: bool = True, echo_stderr: bool = False) -> Child:
    """Run ``function(request, send)`` in a forked child (``request`` may hold anything: it is inherited).

    Fork copies this process's state: CUDA cannot be used in the child of a process that
    initialised it, and GNU OpenMP hangs in a forked child of a process that used it -- so a
    forked child runs torch on one intra-op thread. Prefer :func:`spawn`.
    """
    message_r, message_w = os.pipe()
    stderr_r, stderr_w = os.pipe()
    sys.stdout.flush()  # or the child would write our buffered output a second time
    sys.stderr.flush()
    try:
        pid = os.fork()
    except BaseException:
        for fd in (message_r, message_w, stderr_r, stderr_w):
            os.close(fd)
        raise
    if pid == 0:  # the child: never returns
        try:
            if new_group:
                os.setsid()
            os.close(message_r)
            os.close(stderr_r)
            os.dup2(stderr_w, 2)
            os.dup2(stderr_w, 1)
            if "torch" in sys.modules:
                sys.modules["torch"].set_num_threads(1)  # OpenMP is not fork-safe; one thread runs ops inline
        except BaseException:  # noqa: BLE001
            os._exit(1)
        serve(function, request, message_w, os.getppid())
    os.close(message_w)
    os.close(stderr_w)
    return Child(pid, message_r, stderr_r, new_group=new_group, timeout_s=timeout_s, echo_stderr=echo_stderr,
                 log_path=None)

"""A fork server for trials: torch and autofit imported once, an isolated process forked per trial.

Starting an interpreter and importing torch and autofit is most of a short trial's fixed cost
(``autofit bench --suite cost``, "Trial runner overhead"). So a CPU trial is forked from a
*zygote*: a child started once (:func:`autofit.runtime.procs.spawn`) that imports those modules and
then only forks. Forking is safe there because the zygote never runs an operator: no OpenMP
thread pool exists to be copied half-locked (GNU OpenMP hangs in a forked child of a process
that used it), and no CUDA context (a forked child cannot use CUDA its parent initialised) --
the caller's own process, which probes, profiles and may have run ops, is never forked.

Each trial stays as isolated as a spawned one: its own process (its own memory, its own peak),
the leader of its own session and process group (killed with everything it starts), its
stderr and stdout on a pipe of ours, its result on a message pipe of ours (both passed to the
zygote over a Unix socket with ``SCM_RIGHTS``), and it dies with the zygote, which dies with
us. The zygote reaps each trial and reports its exit status, so a segfault or a kill reads as
it would for our own child (:class:`autofit.runtime.procs.Reaper`). The trial runs in our environment
and working directory as of the request, and the zygote is restarted when the environment it
was started with changed (what libraries read when they load, e.g. ``OMP_NUM_THREADS``).

Set ``AUTOFIT_TRIAL_SERVER=0`` to spawn a fresh interpreter per trial instead.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging
import os
import random
import select
import signal
import socket
import sys
import threading
import time

from autofit.runtime import procs

# Imported by the zygote before it forks (what every trial and profiling worker imports, torch._dynamo
# with them: building an optimizer or a FakeTensorMode imports it); never anything that runs ops.
PRELOAD = ("torch", "torch.distributed._tools.mem_tracker", "autofit.trial.run", "autofit.trial.measure", "autofit.runtime.training",
           "autofit.runtime.tracker", "autofit.workloads.base", "autofit.workloads.load", "autofit.workloads",
           "autofit.profiling.profile")
READY_TIMEOUT_S = 300.0   # the zygote's imports, on a loaded machine
_MAX_REQUEST_BYTES = 1 << 20
_REAP_POLL_S = 0.02


def enabled() -> bool:
    """Whether trials go through the fork server (``AUTOFIT_TRIAL_SERVER`` unset, or not ``0``)."""
    return os.environ.get("AUTOFIT_TRIAL_SERVER", "1").strip().lower() not in ("0", "false", "no", "off")


class UnsafePreload(OSError):
    """A module of the workload's preload started threads in the zygote (e.g. it ran an operator)."""


class TrialServer:
    """Our side of one zygote: forks trials there and learns how they exited. Thread-safe."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = PRELOAD, extra: tuple[str, ...] = ()) -> None:
        self.env = env
        self.import_env: dict[str, str] = {}  # what the zygote's imports set in its environment
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.zygote = procs.spawn("autofit.runtime.forkserver:zygote_main", {"socket_fd": theirs.fileno(),
                                                                         "preload": list(preload),
                                                                         "extra": list(extra)},
                                      env=env, pass_fds=(theirs.fileno(),), timeout_s=READY_TIMEOUT_S)
        finally:
            theirs.close()
        self.sock = ours
        self.extra = tuple(extra)  # the workload modules this zygote was asked to import (one that failed included)
        self.lock = threading.Lock()
        self.exits: dict[int, int] = {}
        try:
            ready = self.zygote.next_message()
        except TimeoutError:
            ready = None
        if ready and ready.get("unsafe"):
            self.close()
            raise UnsafePreload(_unsafe_text(ready["unsafe"]))
        if not ready or not ready.get("ready"):
            failure = self.zygote.failure(not self.zygote.timed_out)
            self.close()
            raise OSError(f"the trial fork server did not start: {failure}")
        self.import_env = dict(ready.get("import_env") or {})
        self.zygote.extend_deadline(None)

    def import_more(self, modules: tuple[str, ...]) -> None:
        """Have the running zygote import ``modules`` too (a workload's preload named after it started, as
        when the command line starts it before the workload is known). Raises UnsafePreload (this zygote
        closed) when one started a thread there, OSError when the zygote did not answer."""
        with self.lock:
            self.sock.send(json.dumps({"preload": list(modules)}).encode())
            reply = self._next_reply("preloaded", READY_TIMEOUT_S)
        if reply is None:
            raise OSError("the trial fork server did not import the workload's preload")
        if reply.get("unsafe"):
            self.close()
            raise UnsafePreload(_unsafe_text(reply["unsafe"]))
        self.extra = tuple(dict.fromkeys(self.extra + tuple(modules)))

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a trial started with ``env`` sees what one forked from this zygote sees: ``env`` is the
        zygote's own, except for variables that importing torch sets (e.g. torch._dynamo sets
        ``TORCHINDUCTOR_CACHE_DIR``), which our process gets too once it imports the same modules."""
        return all(env.get(k) == self.env.get(k) or (k in self.import_env and env.get(k) == self.import_env[k])
                   for k in set(env) | set(self.env))

    def alive(self) -> bool:
        procs.pump([self.zygote], 0)  # drains its stderr (never blocks it on a full pipe)
        return not self.zygote.done

    def start(self, entry: str, request: dict, *, timeout_s: float | None, echo_stderr: bool,
              env: dict[str, str] | None = None) -> procs.Child:
        """Fork ``entry`` (``"package.module:function"``) with ``request`` in a fresh trial process, its
        environment ours plus ``env`` (read by Python code; libraries loaded in the zygote keep what
        they read there). Raises OSError when the zygote is gone or refuses."""
        payload = json.dumps({"entry": entry, "request": request, "env": procs.child_env(env),
                              "cwd": os.getcwd()}).encode()
        if len(payload) > _MAX_REQUEST_BYTES:
            raise OSError(f"a request over {_MAX_REQUEST_BYTES} bytes")
        message_r, message_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        try:
            with self.lock:
                socket.send_fds(self.sock, [payload], [message_w, stderr_w])
                reply = self._next_reply("pid", READY_TIMEOUT_S)
        except BaseException:
            os.close(message_r)
            os.close(stderr_r)
            raise
        finally:
            os.close(message_w)
            os.close(stderr_w)
        if reply is None:
            os.close(message_r)
            os.close(stderr_r)
            raise OSError("the trial fork server did not fork")
        return procs.Child(reply["pid"], message_r, stderr_r, new_group=True, timeout_s=timeout_s,
                           echo_stderr=echo_stderr, log_path=None, reaper=self)

    def _next_reply(self, key: str, timeout_s: float) -> dict | None:
        """Read the zygote's replies (exit reports stored) until one carries ``key``; under the lock."""
        deadline = time.monotonic() + timeout_s
        while select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
            data = self.sock.recv(1 << 16)
            if not data:
                raise OSError("the trial fork server is gone")
            reply = json.loads(data)
            if "exit" in reply:
                self.exits[reply["exit"]] = reply["status"]
            if "pid" in reply:  # a new process: an exit stored under its (reused) pid was another's
                self.exits.pop(reply["pid"], None)
            if key in reply:
                return reply
        return None

    def poll_status(self, pid: int) -> int | None:
        return self.wait_status(pid, 0.0)

    def wait_status(self, pid: int, timeout_s: float) -> int | None:
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                if pid in self.exits:
                    return self.exits[pid]
                try:
                    self._next_reply("exit", max(0.0, min(deadline - time.monotonic(), 0.05)))
                except (OSError, ValueError):
                    return None if _running(pid) else signal.SIGKILL  # the zygote is gone, and so is its trial
                if pid in self.exits:
                    return self.exits[pid]
            if time.monotonic() >= deadline:
                return None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()  # the zygote reads EOF and exits
        self.zygote.kill()


def _unsafe_text(module: str) -> str:
    return (f"importing {module} (Workload.preload) started a thread in the trials' fork server, where forking is "
            "then unsafe: the preload is skipped and each trial imports those modules itself")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_SERVER: TrialServer | None = None
_SERVER_LOCK = threading.Lock()
_EXTRA: tuple[str, ...] = ()  # the workload's own modules (Workload.preload) a zygote started now imports too


def ensure_server() -> TrialServer:
    """This process's zygote, started (or restarted, when our environment changed or it died) if need
    be. Raises OSError when it cannot start."""
    global _SERVER
    with _SERVER_LOCK:
        # Read under the lock: a caller that waited (a background start) must judge the zygote against the
        # environment as it is now, not as it was when it began waiting.
        env = _server_env()
        if _SERVER is not None and (not _SERVER.serves(env) or not _SERVER.alive()):
            _SERVER.close()
            _SERVER = None
        if _SERVER is not None and not set(_EXTRA) <= set(_SERVER.extra):
            _SERVER = _with_preload(_SERVER)
        if _SERVER is None:
            try:
                _SERVER = TrialServer(env, extra=_EXTRA)
            except UnsafePreload as exc:
                logging.getLogger(__name__).warning(str(exc))
                use_preload(())
                _SERVER = TrialServer(env)
        return _SERVER


def _with_preload(server: TrialServer) -> TrialServer | None:
    """``server`` once it has imported the workload's preload (:func:`use_preload`) too, or None (it is
    closed) when it could not: a module that started a thread there is then dropped from the preload."""
    try:
        server.import_more(tuple(m for m in _EXTRA if m not in server.extra))
        return server
    except UnsafePreload as exc:
        logging.getLogger(__name__).warning(str(exc))
        use_preload(())
    except OSError:
        server.close()
    return None


def _server_env() -> dict[str, str]:
    return {k: v for k, v in procs.child_env().items() if k != "AUTOFIT_TRIAL_SERVER"}


def ready() -> bool:
    """Whether this process's zygote is up and would serve a trial started now, without waiting for
    one that is starting (:func:`start_server_soon`) and without starting one."""
    if not _SERVER_LOCK.acquire(blocking=False):
        return False  # being started, restarted or stopped
    try:
        return _SERVER is not None and _SERVER.serves(_server_env()) and _SERVER.alive()
    finally:
        _SERVER_LOCK.release()


def wait_started() -> None:
    """Return once no zygote of ours is starting (:func:`start_server_soon`); starts none. A probe that
    times the device waits so: the zygote's imports would run beside its timing."""
    with _SERVER_LOCK:
        pass


def start_trial(entry: str, request: dict, *, timeout_s: float | None, echo_stderr: bool,
                env: dict[str, str] | None = None) -> procs.Child:
    """Fork a trial (``entry``, ``"package.module:function"``, called with ``request``, ``env`` added to
    our environment) from this process's zygote (:func:`ensure_server`). Raises OSError when no zygote
    can be started or used: the caller spawns instead."""
    return ensure_server().start(entry, request, timeout_s=timeout_s, echo_stderr=echo_stderr, env=env)


def start_server_soon(extra: tuple[str, ...] | None = None) -> None:
    """Start this process's zygote in the background (a thread), so that it is ready, or nearly,
    when a trial or profiling worker is first forked; a failure is left for that call to meet.
    ``extra``: modules every trial of the workload imports (``Workload.preload``), imported by this
    zygote and any started after it (None: those asked for before)."""
    if extra is not None:
        use_preload(extra)

    def start() -> None:
        with contextlib.suppress(OSError):
            ensure_server()

    threading.Thread(target=start, name="autofit-zygote-start", daemon=True).start()


def use_preload(modules: tuple[str, ...]) -> None:
    """The workload's own modules (``Workload.preload``) that the zygote imports too, so that its trials
    do not: one started from now on as it starts, one already running at its next use (:func:`ensure_server`)."""
    global _EXTRA
    _EXTRA = tuple(modules)


def stop_server() -> None:
    """Stop this process's zygote, if any (at exit; it would also die with us)."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is not None:
            _SERVER.close()
            _SERVER = None


def _stop_at_exit() -> None:
    """At exit, stop the zygote; one still starting (:func:`start_server_soon`'s thread holds the lock
    for seconds) is not waited for: it dies with us (:func:`autofit.runtime.procs.die_with_parent`)."""
    global _SERVER
    if not _SERVER_LOCK.acquire(blocking=False):
        return
    try:
        if _SERVER is not None:
            _SERVER.close()
            _SERVER = None
    finally:
        _SERVER_LOCK.release()


atexit.register(_stop_at_exit)


# --- the zygote --------------------------------------------------------------------------------


def zygote_main(request: dict, send: procs.Send) -> None:
    """In the zygote: import, say ready, then fork one trial per request until the socket closes."""
    sock = socket.socket(fileno=request["socket_fd"])
    own_message_fd = int(sys.argv[2])  # messages.child_main's message pipe to our parent: no trial keeps it
    started_env = dict(os.environ)
    for name in request["preload"]:
        importlib.import_module(name)
    threads = _thread_count()
    unsafe = _import_extra(request.get("extra", ()), threads)
    if unsafe is not None:
        send({"ready": False, "unsafe": unsafe})
        return
    # Our parent sets these too when it imports the same modules; it must not read that as a changed
    # environment and start another zygote (two seconds of imports, at every search's first use).
    send({"ready": True, "import_env": {k: v for k, v in os.environ.items() if started_env.get(k) != v}})
    while True:
        _report_exits(sock)
        if not select.select([sock], [], [], _REAP_POLL_S)[0]:
            continue
        data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_REQUEST_BYTES, 2)
        if not data:
            return  # our parent closed its end
        if not fds:  # not a trial: more modules to import (TrialServer.import_more)
            unsafe = _import_extra(json.loads(data).get("preload", ()), threads)
            sock.send(json.dumps({"preloaded": unsafe is None, "unsafe": unsafe}).encode())
            if unsafe is not None:
                return  # a thread of ours would be copied half-way into every trial: fork none
            continue
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            continue
        pid = _fork_trial(json.loads(data), fds, (sock.fileno(), own_message_fd))
        sock.send(json.dumps({"pid": pid}).encode())


def _import_extra(modules, threads: int) -> str | None:
    """Import the workload's own modules (``Workload.preload``) in the zygote; the first that started a
    thread (``threads``: the zygote's count before), where no fork is safe any more, or None. One that
    fails to import is left for each trial to import and to report its way (a WorkloadError with the
    reason), not a zygote that never starts."""
    for name in modules:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
        if _thread_count() > threads:  # it ran an op (OpenMP's pool) or started a thread
            return name
    return None


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exit": pid, "status": status}).encode())


def _fork_trial(order: dict, fds: list[int], close: tuple[int, ...]) -> int:
    message_w, stderr_w = fds
    sys.stdout.flush()
    sys.stderr.flush()
    # Read before the fork: a zygote killed while the trial still imports its entry would otherwise
    # leave it reading init as the parent it must die with, and it would outlive us.
    zygote = os.getpid()
    pid = os.fork()
    if pid:
        os.close(message_w)
        os.close(stderr_w)  # only the trial holds them: its exit closes our parent's pipes
        return pid
    try:  # the trial: never returns
        os.setsid()  # its own session and group, as a spawned trial
        for fd in close:
            os.close(fd)
        os.dup2(stderr_w, 1)
        os.dup2(stderr_w, 2)
        os.close(stderr_w)
        os.environ.clear()
        os.environ.update(order["env"])
        os.chdir(order["cwd"])
        random.seed()
        module_name, _, name = order["entry"].partition(":")
        function = getattr(importlib.import_module(module_name), name)
    except BaseException:  # noqa: BLE001
        os._exit(1)
    procs.serve(function, order["request"], message_w, zygote)

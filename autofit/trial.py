"""Run one trial in a child process with a wall-clock limit; always return a :class:`TrialResult`.

Isolation is the point: a config that runs out of memory, a workload that raises, segfaults
or hangs, must not take the caller down, and must leave nothing behind (no stray process, no
GPU memory held). So each trial runs :func:`autofit.measure.measure_trial` in a child that is
the leader of its own session and process group; whatever it starts (pipeline stage
processes) is killed with it, and the parent never initialises CUDA.

How the workload reaches the child:

- a workload with a ``source`` (every workload from :func:`autofit.workload.load_workload`,
  and a spec string) is re-loaded in a fresh interpreter -- the "spawn" model, started with
  ``subprocess`` rather than ``multiprocessing``, so the caller's ``__main__`` is not
  re-imported and no helper process (resource tracker, fork server) outlives the trial;
- a Workload built in Python without a ``source`` (lambdas, closures: unpicklable) can only
  be inherited, so its child is forked. Fork copies the caller's state: CUDA cannot be used in
  a forked child of a process that initialised it, locks held by other threads are copied
  locked, and GNU OpenMP hangs in a forked child of a process that used it -- so a forked trial
  runs on one intra-op thread and its throughput is not that of a real run. Prefer a ``source``.

The child writes one small JSON object to a pipe that the parent drains while it waits, so
a large result cannot block the child and nothing unpicklable ever crosses. A watchdog thread
in the child kills its process group if the parent dies first.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from autofit.config import TrainConfig
from autofit.tracker import CATEGORIES
from autofit.workload import Workload

_MAX_RESULT_BYTES = 1 << 20  # a result is ~1 KB; more than this is not a result
_MAX_ERROR_CHARS = 2000
_REAP_GRACE_S = 2.0


class TrialStatus(str, enum.Enum):
    """How a trial ended. Only ``ok`` carries measurements."""

    OK = "ok"
    OOM = "oom"          # over the memory budget (or the device's memory)
    ERROR = "error"      # the workload raised, crashed or exited without a result
    TIMEOUT = "timeout"  # past the wall-clock limit; killed

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TrialResult:
    """The outcome of one trial. Field names are a public contract (also in JSON, via :meth:`to_dict`).

    - ``workload``: the workload's name; ``config``: the :class:`TrainConfig` run;
      ``device``: ``"cpu"`` or ``"cuda"`` (or ``"cuda:N"``).
    - ``status``: a :class:`TrialStatus`; ``error``: None when ok, else one line (the
      exception's last line, ``killed by signal SIGSEGV``, the time limit...).
    - ``peak_bytes``: peak bytes of the largest device (live tensors: the CPU tracker, or
      CUDA's ``max_memory_allocated``); ``per_device_peak_bytes``: one per pipeline stage.
    - ``breakdown``: the peak's composition under the six :data:`autofit.tracker.CATEGORIES`
      (values None when not measured).
    - ``samples_per_s``, ``tokens_per_s`` (None when the workload has no tokens_per_sample),
      ``step_time_s`` (one optimizer step), ``micro_step_time_s``, ``optimizer_step_time_s``.
    - ``wall_s``: the whole trial, process start included.
    - ``budget_bytes``: the budget it ran under (None: none); ``peak_reserved_bytes``: CUDA's
      ``max_memory_reserved`` (None on the CPU).
    """

    workload: str
    config: TrainConfig
    device: str
    status: TrialStatus
    peak_bytes: int | None = None
    per_device_peak_bytes: list[int] = field(default_factory=list)
    breakdown: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(CATEGORIES))
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    micro_step_time_s: float | None = None
    optimizer_step_time_s: float | None = None
    error: str | None = None
    wall_s: float = 0.0
    budget_bytes: int | None = None
    peak_reserved_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return self.status is TrialStatus.OK

    def to_dict(self) -> dict:
        """JSON-ready: the field names above, ``config`` as its five fields, ``status`` as a string."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["config"] = self.config.to_dict()
        data["status"] = self.status.value
        data["per_device_peak_bytes"] = list(self.per_device_peak_bytes)
        data["breakdown"] = dict(self.breakdown)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "TrialResult":
        """Inverse of :meth:`to_dict`; keys it does not know are ignored (newer writers)."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["config"] = TrainConfig.from_dict(data["config"])
        values["status"] = TrialStatus(data["status"])
        if "breakdown" in values:
            values["breakdown"] = {k: values["breakdown"].get(k) for k in CATEGORIES}
        return cls(**values)


def run_trial(workload: Workload | str, config: TrainConfig, *, device: str = "cpu", budget_bytes: int | None = None,
              warmup_steps: int = 2, measure_steps: int = 3, timeout_s: float = 300) -> TrialResult:
    """Run ``config`` on ``workload`` in a child process and measure it; never raises for the trial's sake.

    ``workload`` is a Workload or a ``--model`` spec (re-loaded in the child).
    ``timeout_s`` bounds the whole trial, the child's interpreter start and imports included
    (about 5 s on a small CPU machine). Returns a TrialResult whose status is ``ok``, ``oom``,
    ``error`` or ``timeout``. Raises ValueError only for invalid arguments.

    Example::

        result = run_trial("gpt-tiny", TrainConfig.parse("precision=amp-bf16,micro_batch=8"),
                           budget_bytes=parse_budget("2GB"), timeout_s=120)
        result.status, result.peak_bytes, result.samples_per_s
    """
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a TrainConfig, got {type(config).__name__}")
    if measure_steps < 1 or timeout_s <= 0:
        raise ValueError("measure_steps must be >= 1 and timeout_s > 0")
    source = workload if isinstance(workload, str) else workload.source
    name = workload if isinstance(workload, str) else workload.name
    request = {"source": source, "config": config.to_dict(), "device": device, "budget_bytes": budget_bytes,
               "warmup_steps": warmup_steps, "measure_steps": measure_steps, "parent_pid": os.getpid()}
    start = time.monotonic()
    try:
        if source is not None:
            outcome = _supervise(*_spawn(request), timeout_s, start)
        else:
            # CUDA works in a forked child only if this process never initialised CUDA.
            warnings.warn(f"workload {name!r} has no source, so its trial runs in a forked child: on one CPU "
                          "thread (OpenMP is not fork-safe), and with CUDA only if this process never "
                          "initialised CUDA. Load it with autofit.load_workload(spec) to run it in a fresh "
                          "process.", RuntimeWarning, stacklevel=2)
            outcome = _supervise(*_fork(workload, request), timeout_s, start)
    except Exception as exc:  # e.g. the interpreter cannot be started: still a result
        outcome = {"status": "error", "error": _last_line(exc)}
    return _to_result(outcome, name, config, device, budget_bytes, time.monotonic() - start)


def _to_result(outcome: dict, name: str, config: TrainConfig, device: str, budget_bytes: int | None,
               wall_s: float) -> TrialResult:
    try:
        status = TrialStatus(outcome.get("status"))
    except ValueError:
        status = TrialStatus.ERROR
    known = {f.name for f in dataclasses.fields(TrialResult)} - {"workload", "config", "device", "status", "wall_s",
                                                                  "budget_bytes", "breakdown"}
    values = {k: v for k, v in outcome.items() if k in known}
    breakdown = outcome.get("breakdown") or {}
    return TrialResult(workload=outcome.get("workload") or name, config=config, device=str(device), status=status,
                       breakdown={k: breakdown.get(k) for k in CATEGORIES}, wall_s=wall_s,
                       budget_bytes=budget_bytes, **values)


# --- the child side ---------------------------------------------------------------------------

def _run_request(request: dict, workload: Workload | None = None) -> dict:
    """In the child: load the workload, measure, and turn any exception into an ``error`` outcome."""
    try:
        from autofit.measure import measure_trial  # noqa: PLC0415 -- imported in the child only
        from autofit.workload import load_workload  # noqa: PLC0415

        if workload is None:
            workload = load_workload(request["source"])
        outcome = measure_trial(workload, TrainConfig.from_dict(request["config"]), device=request["device"],
                                budget_bytes=request["budget_bytes"], warmup_steps=request["warmup_steps"],
                                measure_steps=request["measure_steps"])
        outcome["workload"] = workload.name
        return outcome
    except BaseException as exc:  # noqa: BLE001 -- SystemExit from user code is an error too
        if os.environ.get("AUTOFIT_TRIAL_TRACEBACK"):
            traceback.print_exc()
        outcome = {"status": "error", "error": _last_line(exc)}
        if workload is not None:
            outcome["workload"] = workload.name
        return outcome


def _write_result(fd: int, outcome: dict) -> None:
    if isinstance(outcome.get("error"), str):
        outcome["error"] = outcome["error"][:_MAX_ERROR_CHARS]
    try:
        data = json.dumps(outcome).encode()
    except (TypeError, ValueError) as exc:
        data = json.dumps({"status": "error", "error": f"unserialisable trial result: {exc}"[:_MAX_ERROR_CHARS]}).encode()
    while data:
        data = data[os.write(fd, data):]
    os.close(fd)


def _die_with_parent(parent_pid: int) -> None:
    """In the child: if the parent dies (killed, say), kill this trial's whole process group -- no orphans."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="autofit-parent-watch", daemon=True).start()


def _child_main() -> None:
    """Entry point of a spawned child: ``python -c '...; _child_main()' RESULT_FD REQUEST_JSON``."""
    fd, request = int(sys.argv[1]), json.loads(sys.argv[2])
    _die_with_parent(request["parent_pid"])
    status = 0
    try:
        _write_result(fd, _run_request(request))
    except BaseException:  # noqa: BLE001 -- the parent reports a missing result
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # skip interpreter teardown: the result is out, the parent kills the group


def _last_line(exc: BaseException) -> str:
    """``Type: last line of the message`` -- what a traceback's last line says."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1]}" if lines else type(exc).__name__


# --- the parent side --------------------------------------------------------------------------

def _stdout_target() -> int:
    # The child's stdout goes to our stderr: a workload's prints must never reach our stdout
    # (``autofit measure --json`` prints one object there).
    try:
        os.fstat(2)
        return 2
    except OSError:
        return subprocess.DEVNULL


def _spawn(request: dict) -> tuple[int, int, subprocess.Popen]:
    read_fd, write_fd = os.pipe()
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent)  # so the child imports this autofit
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", "from autofit.trial import _child_main; _child_main()", str(write_fd),
             json.dumps(request)],
            pass_fds=(write_fd,), stdin=subprocess.DEVNULL, stdout=_stdout_target(), env=env,
            start_new_session=True,  # its own session and process group, set before exec: no race
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return process.pid, read_fd, process


def _fork(workload: Workload, request: dict) -> tuple[int, int, None]:
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()  # or the child would write our buffered output a second time
    sys.stderr.flush()
    try:
        pid = os.fork()
    except BaseException:
        os.close(read_fd)
        os.close(write_fd)
        raise
    if pid == 0:  # the child: never returns
        status = 1
        try:
            os.setsid()
            _die_with_parent(request["parent_pid"])
            os.close(read_fd)
            if _stdout_target() == 2:
                os.dup2(2, 1)
            # GNU OpenMP is not fork-safe: the first parallel region of a forked child whose
            # parent used the intra-op pool hangs. One thread runs every op inline.
            import torch  # noqa: PLC0415

            torch.set_num_threads(1)
            _write_result(write_fd, _run_request(request, workload))
            status = 0
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(status)  # never run the parent's atexit handlers or test teardown here
    os.close(write_fd)
    return pid, read_fd, None


def _supervise(pid: int, read_fd: int, process: subprocess.Popen | None, timeout_s: float, start: float) -> dict:
    """Read the child's result until it exits or the time is up; kill its group; reap it."""
    chunks: list[bytes] = []
    size = 0
    timed_out = eof = False
    try:
        deadline = start + timeout_s
        while not eof:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            readable, _, _ = select.select([read_fd], [], [], min(remaining, 0.25))
            if readable:
                data = os.read(read_fd, 1 << 16)
                eof = not data
                size += len(data)
                if size <= _MAX_RESULT_BYTES:
                    chunks.append(data)
            elif _has_exited(pid):
                # Exited without closing the pipe? (A grandchild may hold it.) Take what is there.
                while select.select([read_fd], [], [], 0)[0] and (data := os.read(read_fd, 1 << 16)):
                    size += len(data)
                    if size <= _MAX_RESULT_BYTES:
                        chunks.append(data)
                break
    finally:
        os.close(read_fd)
        _kill_group(pid)
        wait_status = _reap(pid, process)
    if timed_out:
        return {"status": "timeout", "error": f"exceeded the wall-clock limit of {timeout_s:g} s"}
    if chunks and size <= _MAX_RESULT_BYTES:
        try:
            outcome = json.loads(b"".join(chunks))
            if isinstance(outcome, dict) and "status" in outcome:
                return outcome
        except ValueError:
            pass
    if os.WIFSIGNALED(wait_status):
        return {"status": "error", "error": f"killed by signal {signal.Signals(os.WTERMSIG(wait_status)).name}"}
    return {"status": "error", "error": f"exited with status {os.waitstatus_to_exitcode(wait_status)} "
                                        "without a result"}


def _has_exited(pid: int) -> bool:
    # WNOWAIT: leave it a zombie, so its pid (and process group id) cannot be reused before we kill the group.
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_group(pgid: int) -> None:
    """SIGKILL the child's process group, then wait (briefly) until its members are gone."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # a forked child killed before its setsid(): not a group leader yet
        try:
            os.kill(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return
    deadline = time.monotonic() + _REAP_GRACE_S
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
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def _reap(pid: int, process: subprocess.Popen | None) -> int:
    _, wait_status = os.waitpid(pid, 0)
    if process is not None:
        process.returncode = os.waitstatus_to_exitcode(wait_status)  # so Popen never waits on a reaped pid
    return wait_status

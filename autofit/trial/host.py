"""A trial host: one long-lived process that runs a search's trials one after another (CUDA's default).

On CUDA a trial in a fresh process pays the interpreter, the imports, a CUDA context and the
libraries' initialisation before its first step: 9.0 s on an H200 for a trial that died at its
first large allocation, against 0.09 s for a further trial in the same process
(docs/facts.md#a-trials-fixed-cost-on-cuda). The batch-size finders retry inside the training
process and pay that once; the fork server (:mod:`autofit.runtime.forkserver`) cannot help on CUDA,
since a forked child cannot use a context its parent created. So a CUDA trial is sent to a host: a
child started by the first trial, which runs :func:`autofit.trial.run.child_entry` for each trial
request it receives, and stays for the next.

Isolation is kept where it matters:

- a trial that does not come back ``ok`` (out of memory, an error, a crash, its time limit) ends its
  host, and the next trial starts a fresh one: an allocator that failed, or a workload that raised
  mid-step, may leave state behind that the next trial must not inherit;
- between ok trials nothing of the last one stays referenced (its model, optimizer and batches are
  local to :func:`autofit.trial.measure.measure_trial`); the host collects garbage before it answers,
  and a CUDA trial empties the allocator's cache and resets its peak statistics before it builds its
  model, so each peak is the trial's own (on the CPU the tracker counts one trainee's live tensors);
- a host serves one workload source, device, memory limit, working directory and environment; a
  trial that differs in any of them gets a host of its own;
- a device split's trial starts its stage or rank processes itself, and never runs in a host;
- when this trial had to wait for its device (another process uses it), the host ends after the
  trial, so an idle host never holds a context on a card another process is measuring on.

``AUTOFIT_TRIAL_HOST=0`` gives every trial a fresh process; ``=1`` uses a host on the CPU too (there the
fork server is the default: a forked trial starts in ~0.1 s with an address space of its own).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time

from autofit.core.records import TrialStatus
from autofit.runtime import procs
from autofit.runtime.messages import result_status

MAX_REQUEST_BYTES = 1 << 20


def enabled(device: str) -> bool:
    """Whether single-device trials on ``device`` run in a host: ``AUTOFIT_TRIAL_HOST`` ``1``/``0`` says; unset, on CUDA."""
    value = os.environ.get("AUTOFIT_TRIAL_HOST", "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    return device.split(":")[0] == "cuda"


def hosts_request(request: dict) -> bool:
    """Whether a trial request can run in a host: it has a workload source and runs on one device."""
    configs = request.get("configs") or [request.get("config") or {}]
    return request.get("source") is not None and all(c.get("device_split", 1) == 1 for c in configs)


class TrialHost:
    """Our side of one host process. Not thread-safe: :func:`run` serialises the calls."""

    def __init__(self, source: str, device: str, memory_limit_bytes: int | None) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = procs.child_env()  # what the host started with
        try:
            self.child = procs.spawn("autofit.trial.hosted:host_main",
                                     {"socket_fd": theirs.fileno(), "source": source, "device": device,
                                      "memory_limit_bytes": memory_limit_bytes},
                                     env=self.env, pass_fds=(theirs.fileno(),), timeout_s=None, echo_stderr=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.import_env: dict[str, str] | None = None  # what its imports set in its environment; None: not ready

    def ready(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the host's imports and warm-up; False when it died or took longer."""
        if self.import_env is None:
            self.child.extend_deadline(max(timeout_s, 0.0))
            try:
                message = self.child.next_message()
            except TimeoutError:
                message = None
            if not message or not message.get("ready"):
                return False
            self.import_env = dict(message.get("import_env") or {})
        return True

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a trial started with ``env`` sees what it sees in this host: the host's environment, but
        for variables its imports set (e.g. ``TORCHINDUCTOR_CACHE_DIR``), which our process gets too once
        it imports the same modules. Call once :meth:`ready`."""
        known = self.import_env or {}
        return all(env.get(k) == self.env.get(k) or (k in known and env.get(k) == known[k])
                   for k in set(env) | set(self.env))

    def run(self, request: dict, timeout_s: float) -> dict:
        """Send one trial request to a ready host and wait up to ``timeout_s`` for its outcome (a
        child_entry dict). Raises OSError when the host is gone before it took the request."""
        payload = json.dumps(request).encode()
        if len(payload) > MAX_REQUEST_BYTES:
            raise OSError(f"a trial request over {MAX_REQUEST_BYTES} bytes")
        self.sock.send(payload)
        self.child.extend_deadline(timeout_s)
        try:
            outcome = self.child.next_message()
        except TimeoutError:
            return _timeout(timeout_s)
        if outcome is None or "status" not in outcome:
            self.child.kill()  # reaped, so the failure says how it exited
            return {"status": "error", "error": self.child.failure()}
        return outcome

    def alive(self) -> bool:
        procs.pump([self.child], 0)  # drains its stderr (never blocks it on a full pipe)
        return not self.child.done

    def close(self) -> None:
        """End the host and what it started (idempotent)."""
        self.sock.close()
        self.child.kill(grace_s=1.0)


def _timeout(timeout_s: float) -> dict:
    return {"status": "timeout", "error": f"exceeded the wall-clock limit of {timeout_s:g} s"}


_hosts: dict[tuple, TrialHost] = {}
_lock = threading.Lock()


def _key(source: str, device: str, memory_limit_bytes: int | None) -> tuple:
    return source, device, memory_limit_bytes, os.getcwd()


def start_soon(source: str, device: str, memory_limit_bytes: int | None = None) -> None:
    """Start the host for trials of ``source`` on ``device`` now: its imports, the workload and a CUDA
    context then overlap what the caller does before its first trial (profiling, probes)."""
    key = _key(source, device, memory_limit_bytes)
    with _lock:
        if key not in _hosts:
            _hosts[key] = TrialHost(source, device, memory_limit_bytes)


def ready_within(timeout_s: float) -> bool:
    """Whether the host :func:`start_soon` started is ready within ``timeout_s`` (False: none was started,
    or it died or took longer); what a caller that times a search's start waits on."""
    with _lock:
        started = list(_hosts.values())
    return len(started) == 1 and started[0].ready(timeout_s)


def run(request: dict, timeout_s: float) -> dict:
    """Run one trial request (:func:`autofit.trial.run.child_entry`'s) in the host for its source,
    device, memory limit, directory and environment, starting one when there is none; the host ends
    after an outcome that is not ok. ``timeout_s`` covers a new host's start. Raises OSError when no
    host can be started."""
    key = _key(request["source"], request["device"], request.get("memory_limit_bytes"))
    deadline = time.monotonic() + timeout_s
    with _lock:
        for stale in [k for k, h in _hosts.items() if k != key or not h.alive()]:
            _hosts.pop(stale).close()  # one host at a time: an idle one would hold its device
        try:
            outcome = _run_in_a_host(key, request, timeout_s, deadline)
        except BaseException:  # Ctrl-C: the trial it runs goes with it
            _release_locked()
            raise
        if result_status(outcome) is not TrialStatus.OK:
            _release_locked()
        return outcome


def _run_in_a_host(key: tuple, request: dict, timeout_s: float, deadline: float) -> dict:
    env = procs.child_env()
    for attempt in range(3):  # a host that died between trials, or one started in another environment
        host = _hosts.get(key)
        if host is None:
            host = _hosts[key] = TrialHost(*key[:3])
        if not host.ready(deadline - time.monotonic()):
            if time.monotonic() >= deadline:
                return _timeout(timeout_s)
            failure = host.child.failure()
            _hosts.pop(key).close()
            if attempt:
                return {"status": "error", "error": f"the trial host ended before its first trial: {failure}"}
            continue
        if not host.serves(env):
            _hosts.pop(key).close()
            continue
        try:
            outcome = host.run(request, deadline - time.monotonic())
            return _timeout(timeout_s) if result_status(outcome) is TrialStatus.TIMEOUT else outcome
        except OSError:
            _hosts.pop(key).close()
    raise OSError("no trial host could take the trial")


def _release_locked() -> None:
    while _hosts:
        _hosts.popitem()[1].close()


def release() -> None:
    """End every host (the search is over, or its device is wanted elsewhere)."""
    with _lock:
        _release_locked()


atexit.register(release)

"""Run one trial in a child process with a wall-clock limit; always return a :class:`TrialResult`.

Isolation is the point: a config that runs out of memory, a workload that raises, segfaults
or hangs, must not take the caller down, and must leave nothing behind (no stray process, no
GPU memory held). So each trial runs :func:`autofit.trial.measure.measure_trial` in a child that is
the leader of its own session and process group; whatever it starts (pipeline stage
processes) is killed with it, and the parent never initialises CUDA.

How the workload reaches the child:

- a workload with a ``source`` (every workload from :func:`autofit.workloads.load.load_workload`,
  and a spec string) is re-loaded in another process: on the CPU a fresh one forked from autofit's
  fork server (:mod:`autofit.runtime.forkserver`, a child of ours that imported torch and autofit once
  and never runs an operator, so the fork is safe and a trial skips ~3 s of imports); on CUDA
  the trial host (:mod:`autofit.trial.host`, a process that runs one trial after another and ends
  after any that is not ok, so trials after the first skip the interpreter, imports and CUDA
  context); with ``AUTOFIT_TRIAL_SERVER=0`` and ``AUTOFIT_TRIAL_HOST=0``, and for a device split,
  a fresh interpreter started with ``subprocess`` rather than ``multiprocessing``, so the caller's
  ``__main__`` is never re-imported;
- a Workload built in Python without a ``source`` (lambdas, closures: unpicklable) can only
  be inherited, so its child is forked. Fork copies the caller's state: CUDA cannot be used in
  a forked child of a process that initialised it, locks held by other threads are copied
  locked, and GNU OpenMP hangs in a forked child of a process that used it -- so a forked trial
  runs on one intra-op thread and its throughput is not that of a real run. Prefer a ``source``.

The child is started, limited and killed by :mod:`autofit.runtime.procs`: it sends one small JSON
object back (nothing is unpickled), its stdout and stderr are echoed to our stderr (a
workload's prints never reach our stdout), and it kills its process group if we die first.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import resource
import time
import traceback
import warnings
from dataclasses import dataclass, field

from autofit.core.config import TrainConfig
from autofit.core.records import TrialStatus
from autofit.runtime import forkserver, procs
from autofit.runtime.devicelock import DeviceLock, device_names
from autofit.runtime.messages import result_status
from autofit.runtime.schedule import MeasureSchedule
from autofit.runtime.tracker import CATEGORIES
from autofit.trial import host
from autofit.workloads.base import Workload

_MAX_ERROR_CHARS = 2000


@dataclass(frozen=True)
class TrialResult:
    """The outcome of one trial. Field names are a public contract (also in JSON, via :meth:`to_dict`).

    - ``workload``: the workload's name; ``config``: the :class:`TrainConfig` run;
      ``device``: ``"cpu"`` or ``"cuda"`` (or ``"cuda:N"``).
    - ``status``: a :class:`TrialStatus`; ``error``: None when ok, else one line (the
      exception's last line, ``killed by signal SIGSEGV``, the time limit...).
    - ``peak_bytes``: peak bytes of the largest device (live tensors: the CPU tracker, or
      CUDA's ``max_memory_allocated``); ``per_device_peak_bytes``: one per pipeline stage.
    - ``breakdown``: the peak's composition under the six :data:`autofit.runtime.tracker.CATEGORIES`
      (values None when not measured).
    - ``samples_per_s``, ``tokens_per_s`` (None when the workload has no tokens_per_sample),
      ``step_time_s`` (one optimizer step), ``micro_step_time_s``, ``optimizer_step_time_s``.
    - ``wall_s``: the whole trial, process start included (not the wait for its devices).
    - ``wait_s``: how long it waited for its devices' locks (another trial held one;
      :mod:`autofit.runtime.devicelock`); ``started_at``: ``time.time()`` when it got them and started.
    - ``budget_bytes``: the budget it ran under (None: none); ``peak_reserved_bytes``: CUDA's
      ``max_memory_reserved`` (None on the CPU).
    - CUDA only (None elsewhere): ``context_bytes``, the process's bytes on the card outside the
      allocator; ``peak_card_bytes``, reserved + context: what the card held, and what the
      estimate predicts on CUDA.
    - What the timed steps got from the machine (:class:`autofit.runtime.timing.StepTimes`; None
      where not measured, as for a device split): ``timed_steps`` (starved ones included),
      ``starved_steps`` (steps whose threads waited for a CPU: taken again, never the figure),
      ``step_samples_s`` (every timed step, composed), ``step_spread`` (median over best, less
      one), ``cpu_share`` (CPU time over wall time times ``threads`` in the best step),
      ``threads`` (intra-op threads asked for), ``cpus`` (CPUs the process could run on),
      ``max_wait_share`` (the largest run-queue wait of a step over its wall time), and on CUDA
      ``device_step_s`` (event time of the fastest step as run). The throughput is the best step's.
    - ``tracked_s``: on the CPU, the seconds of the warm-up and measured steps, which run under the
      memory tracker (but a pipeline stage's first, run bare); a device split's is its slowest rank's,
      the ranks stepping together. None on CUDA and for a throughput sample, whose schedule reads no
      memory.
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
    wait_s: float = 0.0
    started_at: float | None = None
    budget_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    context_bytes: int | None = None
    peak_card_bytes: int | None = None
    timed_steps: int | None = None
    starved_steps: int | None = None
    step_samples_s: list[float] | None = None
    step_spread: float | None = None
    cpu_share: float | None = None
    threads: int | None = None
    cpus: int | None = None
    max_wait_share: float | None = None
    device_step_s: float | None = None
    tracked_s: float | None = None

    @property
    def judged_peak_bytes(self) -> int | None:
        """The peak the budget and the estimate are judged on: on CUDA reserved + context (what the card
        held), elsewhere ``peak_bytes``."""
        return self.peak_card_bytes if self.peak_card_bytes is not None else self.peak_bytes

    @property
    def ok(self) -> bool:
        return self.status is TrialStatus.OK

    def to_dict(self) -> dict:
        """JSON-ready: the field names above, ``config`` as its fields, ``status`` as a string."""
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
              warmup_steps: int = 2, measure_steps: int = 3, timeout_s: float = 300,
              schedule: MeasureSchedule | None = None, memory_limit_bytes: int | None = None) -> TrialResult:
    """Run ``config`` on ``workload`` in a child process and measure it; never raises for the trial's sake.

    ``workload`` is a Workload or a ``--model`` spec (re-loaded in the child). The steps run
    are ``schedule`` (a :class:`autofit.runtime.schedule.MeasureSchedule`); without one,
    ``MeasureSchedule.from_steps(warmup_steps, measure_steps)``.
    ``timeout_s`` bounds the whole trial, the child's interpreter start and imports included
    (about 5 s on a small CPU machine). ``memory_limit_bytes``: the child's address space at most
    (``RLIMIT_AS``, what ``ulimit -v`` sets; its imports count too), so a config that would exhaust
    the host fails alone. Returns a TrialResult whose status is ``ok``, ``oom`` (over the budget, or
    an allocation refused by the device or the host), ``error`` or ``timeout``. Raises ValueError
    only for invalid arguments. The trial holds its devices for its whole run
    (:class:`autofit.runtime.devicelock.DeviceLock`): it first waits, outside ``timeout_s``, while another
    trial on this machine holds one.

    Example::

        result = run_trial("gpt-tiny", TrainConfig.parse("precision=amp-bf16,micro_batch=8"),
                           budget_bytes=parse_budget("2GB"), timeout_s=120)
        result.status, result.peak_bytes, result.samples_per_s
    """
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a TrainConfig, got {type(config).__name__}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if schedule is None:
        schedule = MeasureSchedule.from_steps(warmup_steps, measure_steps)
    source = workload if isinstance(workload, str) else workload.source
    name = workload if isinstance(workload, str) else workload.name
    request = {"source": source, "config": config.to_dict(), "device": device, "budget_bytes": budget_bytes,
               "schedule": schedule.to_dict(), "memory_limit_bytes": memory_limit_bytes}
    with DeviceLock(device_names(device, config.device_split), f"trial {name} {config.short()}") as lock:
        start, started_at = time.monotonic(), time.time()
        outcome = _start_and_supervise(workload, source, name, request, device, timeout_s)
        wall_s = time.monotonic() - start
    _release_a_shared_device(lock)
    return _to_result(outcome, name, config, device, budget_bytes, wall_s, lock.wait_s, started_at)


def run_head_to_head(workload: Workload | str, configs: list[TrainConfig], *, device: str = "cpu",
                     timeout_s: float = 300, schedule: MeasureSchedule | None = None) -> list[TrialResult]:
    """Time ``configs`` (one build) in one child process, their timed steps interleaved
    (:func:`autofit.trial.head_to_head.measure_head_to_head`); never raises for the trial's sake.

    Returns one TrialResult per config, in order, with throughput and no peak (each config's own
    trial measured that). When the child fails, every result carries its status and error.
    """
    from autofit.trial.head_to_head import check_shared_build

    check_shared_build(configs)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    schedule = schedule or MeasureSchedule()
    source = workload if isinstance(workload, str) else workload.source
    name = workload if isinstance(workload, str) else workload.name
    request = {"source": source, "configs": [c.to_dict() for c in configs], "device": device,
               "schedule": schedule.to_dict(), "budget_bytes": None}
    what = ", ".join(c.short() for c in configs)
    with DeviceLock(device_names(device, 1), f"head-to-head {name} {what}") as lock:
        start, started_at = time.monotonic(), time.time()
        outcome = _start_and_supervise(workload, source, name, request, device, timeout_s)
        wall_s = time.monotonic() - start
    _release_a_shared_device(lock)
    each = outcome.get("results") if result_status(outcome) is TrialStatus.OK else None
    if not isinstance(each, list) or len(each) != len(configs):
        each = [{k: v for k, v in outcome.items() if k in ("status", "error")} or
                {"status": "error", "error": "the head-to-head child sent no results"}] * len(configs)
    return [_to_result(o, name, c, device, None, wall_s / len(configs), lock.wait_s, started_at)
            for o, c in zip(each, configs)]


def _start_and_supervise(workload: Workload | str, source: str | None, name: str, request: dict, device: str,
                         timeout_s: float) -> dict:
    try:
        if source is not None and host.enabled(device) and host.hosts_request(request):
            return host.run(request, timeout_s)
        if source is not None:
            child = _start_child(request, device, timeout_s)
        else:
            # CUDA works in a forked child only if this process never initialised CUDA.
            warnings.warn(f"workload {name!r} has no source, so its trial runs in a forked child: on one CPU "
                          "thread (OpenMP is not fork-safe), and with CUDA only if this process never "
                          "initialised CUDA. Load it with autofit.load_workload(spec) to run it in a fresh "
                          "process.", RuntimeWarning, stacklevel=3)
            child = procs.fork(functools.partial(child_entry, workload=workload), request, timeout_s=timeout_s,
                               echo_stderr=True)
        return _supervise(child)
    except Exception as exc:  # e.g. the interpreter cannot be started: still a result
        return {"status": "error", "error": _last_line(exc)}


def _release_a_shared_device(lock: DeviceLock) -> None:
    """A trial that waited for its device shares it with another process: no idle host of ours may
    hold memory there while that one measures (:mod:`autofit.trial.host`)."""
    if lock.waited_for is not None:
        host.release()


def _start_child(request: dict, device: str, timeout_s: float) -> procs.Child:
    """A CPU trial is forked from the fork server (:mod:`autofit.runtime.forkserver`: torch and autofit
    already imported); a CUDA one, or any when the server is off or cannot start, gets a fresh interpreter."""
    if device.split(":")[0] == "cpu" and forkserver.enabled():
        try:
            return forkserver.start_trial("autofit.trial.run:child_entry", request, timeout_s=timeout_s, echo_stderr=True)
        except OSError as exc:
            warnings.warn(f"the trial fork server failed ({exc}); this trial starts a fresh interpreter",
                          RuntimeWarning, stacklevel=3)
    return procs.spawn("autofit.trial.run:child_entry", request, timeout_s=timeout_s, echo_stderr=True)


def _supervise(child: procs.Child) -> dict:
    try:
        finished = child.wait()
    finally:
        child.kill()
    if not finished:
        return {"status": "timeout", "error": child.failure(finished)}
    outcome = child.last_message()
    if outcome is not None and "status" in outcome:
        return outcome
    return {"status": "error", "error": child.failure()}


def _to_result(outcome: dict, name: str, config: TrainConfig, device: str, budget_bytes: int | None,
               wall_s: float, wait_s: float = 0.0, started_at: float | None = None) -> TrialResult:
    status = result_status(outcome)
    known = {f.name for f in dataclasses.fields(TrialResult)} - {"workload", "config", "device", "status", "wall_s",
                                                                  "wait_s", "started_at", "budget_bytes", "breakdown"}
    values = {k: v for k, v in outcome.items() if k in known}
    breakdown = outcome.get("breakdown") or {}
    return TrialResult(workload=outcome.get("workload") or name, config=config, device=str(device), status=status,
                       breakdown={k: breakdown.get(k) for k in CATEGORIES}, wall_s=wall_s, wait_s=wait_s,
                       started_at=started_at, budget_bytes=budget_bytes, **values)


# --- the child side ---------------------------------------------------------------------------

def child_entry(request: dict, send: procs.Send | None = None, workload: Workload | None = None) -> dict:
    """In the child: load the workload, measure, and turn any exception into an ``error`` outcome (JSON-ready)."""
    try:
        from autofit.trial.measure import measure_trial
        from autofit.workloads.load import load_workload

        if request.get("memory_limit_bytes"):  # before the user's code allocates anything
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (int(request["memory_limit_bytes"]), hard))
        if workload is None:
            workload = load_workload(request["source"])
        if "configs" in request:
            outcome = _head_to_head_entry(workload, request)
        else:
            outcome = measure_trial(workload, TrainConfig.from_dict(request["config"]), device=request["device"],
                                    budget_bytes=request["budget_bytes"],
                                    schedule=MeasureSchedule.from_dict(request["schedule"]))
        outcome["workload"] = workload.name
    except BaseException as exc:  # noqa: BLE001 -- SystemExit from user code is an error too
        if os.environ.get("AUTOFIT_TRIAL_TRACEBACK"):
            traceback.print_exc()
        outcome = {"status": "oom" if _out_of_memory(exc) else "error", "error": _last_line(exc)}
        if workload is not None:
            outcome["workload"] = workload.name
    if isinstance(outcome.get("error"), str):
        outcome["error"] = outcome["error"][:_MAX_ERROR_CHARS]
    try:
        json.dumps(outcome)
    except (TypeError, ValueError) as exc:
        outcome = {"status": "error", "error": f"unserialisable trial result: {exc}"[:_MAX_ERROR_CHARS]}
    return outcome


def _head_to_head_entry(workload: Workload, request: dict) -> dict:
    from autofit.trial.head_to_head import measure_head_to_head

    configs = [TrainConfig.from_dict(c) for c in request["configs"]]
    results = measure_head_to_head(workload, configs, device=request["device"],
                                   schedule=MeasureSchedule.from_dict(request["schedule"]))
    return {"status": "ok", "error": None, "results": results}


def _out_of_memory(exc: BaseException) -> bool:
    """An allocation the host refused: Python's MemoryError, or PyTorch's CPU allocator (a RuntimeError
    saying so). The device's own, ``torch.OutOfMemoryError``, is caught in measure."""
    return isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def _last_line(exc: BaseException) -> str:
    """``Type: last line of the message`` -- what a traceback's last line says."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1]}" if lines else type(exc).__name__

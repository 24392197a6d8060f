"""Several local workers on one study: :mod:`autofit.runtime.procs` children, progress read from the storage.

Each worker is a :func:`autofit.runtime.procs.spawn` child running :func:`worker_entry` (the study's
settings as its JSON request): it runs :func:`autofit.study.worker.run_worker` and sends one
message, ``{"stop_reason": ...}`` or, for a user error, ``{"error": ...}``. Its stderr goes to
``<out>/worker-<i>.log``. Like every procs child it dies, with what it started, when the search
process is gone; a trial it left running is marked interrupted by the next worker on the study
(its process is gone) and planned again.

A worker killed on its own (``kill -9``, the kernel's OOM killer) while another goes on is said
(a progress line, then a warning) and the search goes on: its running trial is marked interrupted
by the next planning step of another worker and runs again (when the others had already stopped
planning, workers start again for it). Only when no worker finished the study, or a worker
reported an error, does the search fail.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import optuna

from autofit.core.errors import AutofitError, RunFailure, StudyError
from autofit.core.records import trial_number
from autofit.runtime import forkserver, procs
from autofit.study import storage
from autofit.study.progress import ProgressCallback, progress_of
from autofit.study.settings import StudySettings
from autofit.study.worker import fail_stale_trials

STOP_GRACE_S = 15.0        # after Ctrl-C, workers get this long to mark their trials before a kill
POLL_S = 1.0               # how often progress is read from the storage
RESTARTS = 2               # rounds of workers started again for trials that killed workers left
log = logging.getLogger(__name__)


def worker_env(settings: StudySettings, workers: int, gpus: list[str], shared: bool = False) -> dict:
    """A worker's environment: this autofit importable and its GPUs. Every core on the CPU: its
    trials take turns with the other workers' (:mod:`autofit.runtime.devicelock`), never share them.
    ``shared``: its GPUs are another worker's too, so its trials start fresh processes rather than
    run in a trial host, whose idle context would sit on a card the other worker measures on."""
    extra = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if settings.device_type == "cuda" else {}
    if shared and settings.device_type == "cuda":
        extra["AUTOFIT_TRIAL_HOST"] = "0"
    return procs.child_env(extra, secrets=True)  # a worker opens the storage itself


def _shares_gpus(gpu_slices: list[list[str]], w: int) -> bool:
    """Whether worker ``w``'s GPUs are another worker's too (more workers than GPUs)."""
    return bool(gpu_slices) and any(set(other) & set(gpu_slices[w]) for i, other in enumerate(gpu_slices) if i != w)


def run_workers(settings: StudySettings, workers: int, gpu_slices: list[list[str]], study: optuna.Study,
                emit: ProgressCallback, started: float, log_tag: str = "") -> str:
    """Start ``workers`` worker processes on the study, report progress from the storage, wait for them.

    Returns the stop reason. A worker that reports an error, or workers that all died, make this
    raise (StudyError, or RunFailure for a failure of the surroundings such as a full disk) after
    the others finished; KeyboardInterrupt interrupts the workers (they mark their running trials)
    and propagates. A worker killed on its own while another finishes is a warning: its running
    trial is marked interrupted and runs again -- on the others if they are still planning, else on
    workers started again for it (at most RESTARTS times). Worker ``w`` logs to
    ``worker-<w><log_tag>.log`` (a search that joined another on its directory tags its own; workers
    started again add ``-<round>``).
    """
    out_dir = Path(settings.out_dir)
    killed: list[str] = []
    left: list[int] = []
    for round_ in range(RESTARTS + 1):
        suffix = log_tag + (f"-{round_}" if round_ else "")
        killed_now = _run_round(settings, workers, gpu_slices, study, emit, started, out_dir, suffix)
        killed += killed_now
        # the trials the killed workers left running and no other worker took up (they had stopped planning)
        left = fail_stale_trials(study, storage.read_records(study)) if killed_now else []
        if not left or round_ == RESTARTS:
            break
        emit(progress_of(storage.read_records(study), f"trial {', '.join(map(str, left))} of a killed worker is "
                         f"marked interrupted; {workers} workers start again to run it", started))
    if killed:
        log.warning("%s while the search ran (see %s/worker-*.log); the other workers finished the study, %s",
                    "; ".join(killed), out_dir, "and the trial it was running was marked interrupted and ran again"
                    if not left else f"and trial {', '.join(map(str, left))} it was running is marked interrupted: "
                    "run the same search again to run it")
    return study.user_attrs.get("stop_reason") or "workers finished"


def _run_round(settings: StudySettings, workers: int, gpu_slices: list[list[str]], study: optuna.Study,
               emit: ProgressCallback, started: float, out_dir: Path, log_suffix: str) -> list[str]:
    """Start the workers and wait for them; which were killed on their own (``worker N killed by ...``)."""
    children = []
    try:
        for w in range(workers):
            log_path = out_dir / f"worker-{w}{log_suffix}.log"
            log_path.write_text("")  # this run's log only
            children.append(procs.spawn(
                "autofit.study.launcher:worker_entry", {"settings": settings.to_json()},
                env=worker_env(settings, workers, gpu_slices[w] if gpu_slices else [], _shares_gpus(gpu_slices, w)),
                log_path=log_path))
        _watch(children, study, workers, emit, started)
    except BaseException:
        _stop(children)
        raise
    errors, killed, finished, failure = [], [], 0, False
    for w, child in enumerate(children):
        status = child.kill()  # reaps it (it is done)
        message = child.last_message() or {}
        if "error" in message:
            errors.append(message["error"])
            failure = failure or message.get("exit_status") == RunFailure.exit_status  # e.g. a full disk
        elif "stop_reason" in message:
            finished += 1
        elif os.WIFSIGNALED(status) and os.WTERMSIG(status) != signal.SIGINT:
            killed.append(f"worker {w} {child.failure()}")
        else:
            errors.append(child.failure())
    if errors or not finished:
        kind = RunFailure if failure or not errors else StudyError  # a full disk, or every worker killed: exit 1
        raise kind(f"a worker failed: {(errors or killed)[0]} (see {out_dir}/worker-*.log)")
    return killed


def _watch(children: list[procs.Child], study: optuna.Study, workers: int, emit: ProgressCallback,
           started: float) -> None:
    seen = None
    gone: set[int] = set()
    while not all(child.done for child in children):
        procs.pump(children, POLL_S)
        records = storage.read_records(study)
        for w, child in enumerate(children):
            if child.done and w not in gone:
                gone.add(w)
                message = child.last_message() or {}
                if not ("stop_reason" in message or "error" in message):
                    others = "; the others go on" if not all(c.done for c in children) else ""
                    emit(progress_of(records, f"worker {w} died ({child.failure()}); the trial it was running will "
                                     f"run again{others}", started))
        snapshot = tuple((r.number, r.status) for r in records)
        if snapshot != seen:
            seen = snapshot
            last = max((r for r in records if r.claimed), key=lambda r: r.number, default=None)
            message = (f"{workers} workers" if last is None
                       else f"trial {trial_number(records, last.number)} {last.config.short()}: {last.status}")
            emit(progress_of(records, message, started))


def _stop(children: list[procs.Child]) -> None:
    """Interrupt the workers (each marks its running trial interrupted), then kill what is left."""
    for child in children:
        child.signal(signal.SIGINT)
    for child in children:
        child.extend_deadline(STOP_GRACE_S)
        child.wait()
        child.kill()


def worker_entry(request: dict, send: procs.Send) -> dict:
    """A worker process (a procs child): run the study of ``request["settings"]`` until it stops."""
    from autofit.study.worker import run_worker
    from autofit.workloads.load import load_workload

    settings = StudySettings.from_json(request["settings"])
    # Our SIGINT (a stop, or the search gone) must reach run_worker as KeyboardInterrupt to mark its trial,
    # even when the search was started with SIGINT ignored (which we inherit): a terminal's Ctrl-C never
    # reaches us (our own session), only the search's signal does.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        workload = load_workload(settings.workload_source)
        forkserver.use_preload(workload.preload)  # a zygote this worker starts imports them for its trials
        return {"stop_reason": run_worker(settings, workload)}
    except AutofitError as exc:
        return {"error": str(exc), "exit_status": exc.exit_status}

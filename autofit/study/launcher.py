"""Several local workers on one study: :mod:`autofit.runtime.procs` children, progress read from the storage.

Each worker is a :func:`autofit.runtime.procs.spawn` child running :func:`worker_entry` (the study's
settings as its JSON request): it runs :func:`autofit.study.worker.run_worker` and sends one
message, ``{"stop_reason": ...}`` or, for a user error, ``{"error": ...}``. Its stderr goes to
``<out>/worker-<i>.log``. Like every procs child it dies, with what it started, when the search
process is gone; a trial it left running is marked interrupted by the next worker on the study
(its process is gone) and planned again.
"""

from __future__ import annotations

import signal
from pathlib import Path

import optuna

from autofit.core.errors import AutofitError, StudyError
from autofit.core.records import trial_number
from autofit.runtime import procs
from autofit.study import storage
from autofit.study.progress import ProgressCallback, progress_of
from autofit.study.settings import StudySettings

STOP_GRACE_S = 15.0        # after Ctrl-C, workers get this long to mark their trials before a kill
POLL_S = 1.0               # how often progress is read from the storage


def worker_env(settings: StudySettings, workers: int, gpus: list[str]) -> dict:
    """A worker's environment: this autofit importable and its GPUs. Every core on the CPU: its
    trials take turns with the other workers' (:mod:`autofit.runtime.devicelock`), never share them."""
    extra = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if settings.device_type == "cuda" else {}
    return procs.child_env(extra, secrets=True)  # a worker opens the storage itself


def run_workers(settings: StudySettings, workers: int, gpu_slices: list[list[str]], study: optuna.Study,
                emit: ProgressCallback, started: float, log_tag: str = "") -> str:
    """Start ``workers`` worker processes on the study, report progress from the storage, wait for them.

    Returns the stop reason. A worker that fails makes this raise StudyError with its error
    (after the others finished); KeyboardInterrupt interrupts the workers (they mark their
    running trials) and propagates. Worker ``w`` logs to ``worker-<w><log_tag>.log`` (a search
    that joined another on its directory tags its own).
    """
    out_dir = Path(settings.out_dir)
    children = []
    try:
        for w in range(workers):
            log_path = out_dir / f"worker-{w}{log_tag}.log"
            log_path.write_text("")  # this run's log only
            children.append(procs.spawn(
                "autofit.study.launcher:worker_entry", {"settings": settings.to_json()},
                env=worker_env(settings, workers, gpu_slices[w] if gpu_slices else []), log_path=log_path))
        _watch(children, study, workers, emit, started)
    except BaseException:
        _stop(children)
        raise
    errors = []
    for child in children:
        child.kill()  # reaps it (it is done)
        message = child.last_message() or {}
        if "error" in message:
            errors.append(message["error"])
        elif "stop_reason" not in message:
            errors.append(child.failure())
    if errors:
        raise StudyError(f"a worker failed: {errors[0]} (see {out_dir}/worker-*.log)")
    return study.user_attrs.get("stop_reason") or "workers finished"


def _watch(children: list[procs.Child], study: optuna.Study, workers: int, emit: ProgressCallback,
           started: float) -> None:
    seen = None
    while not all(child.done for child in children):
        procs.pump(children, POLL_S)
        records = storage.read_records(study)
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
    try:
        return {"stop_reason": run_worker(settings, load_workload(settings.workload_source))}
    except AutofitError as exc:
        return {"error": str(exc)}

"""Several local workers on one study: start them as processes, report progress from the storage, wait.

Each worker is ``python -m autofit.study.launcher SETTINGS_JSON PARENT_PID``: it runs
:func:`autofit.study.worker.run_worker` and interrupts itself when the search process is gone
(its running trial is then marked interrupted).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna

from autofit.errors import AutofitError, StudyError
from autofit.study import storage
from autofit.study.progress import ProgressCallback, progress_of
from autofit.study.settings import StudySettings
from autofit.workload import load_workload

STOP_GRACE_S = 15.0        # after Ctrl-C, workers get this long to mark their trials before a kill


def worker_env(settings: StudySettings, workers: int, gpus: list[str]) -> dict:
    """A worker's environment: this autofit importable, its GPUs, a fair share of the CPU cores."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent.parent)  # so the worker imports this autofit
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    if settings.device_type == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    elif "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    return env


def run_workers(settings: StudySettings, workers: int, gpu_slices: list[list[str]], study: optuna.Study,
                emit: ProgressCallback, started: float) -> str:
    """Start ``workers`` worker processes on the study, report progress from the storage, wait for them.

    Each worker's stderr goes to ``<out>/worker-<i>.log``; a worker that fails makes this raise
    StudyError with its last line (after the others finished).
    """
    out_dir = Path(settings.out_dir)
    procs, logs = [], []
    for w in range(workers):
        env = worker_env(settings, workers, gpu_slices[w] if gpu_slices else [])
        log_path = out_dir / f"worker-{w}.log"
        logs.append(log_path)
        with open(log_path, "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "autofit.study.launcher", settings.to_json(), str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                start_new_session=True))  # a terminal's Ctrl-C reaches this process, which forwards it
    try:
        _watch(procs, study, workers, emit, started)
    except BaseException:
        _stop(procs)
        raise
    errors = []
    for p, log_path in zip(procs, logs):
        if p.returncode != 0:
            lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
            errors.append(lines[-1] if lines else f"exited with status {p.returncode}")
    if errors:
        raise StudyError(f"a worker failed: {errors[0].removeprefix('autofit: error: ')} (see {logs[0].parent}/worker-*.log)")
    return study.user_attrs.get("stop_reason") or "workers finished"


def _watch(procs, study: optuna.Study, workers: int, emit: ProgressCallback, started: float) -> None:
    seen = None
    while any(p.poll() is None for p in procs):
        time.sleep(1.0)
        records = storage.read_records(study)
        snapshot = tuple((r.number, r.status) for r in records)
        if snapshot != seen:
            seen = snapshot
            last = max((r for r in records if r.claimed), key=lambda r: r.number, default=None)
            message = f"{workers} workers" if last is None else f"trial {last.number} {last.config.short()}: {last.status}"
            emit(progress_of(records, message, started))


def _stop(procs) -> None:
    """Interrupt the workers (they mark their running trials), then kill what is left."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def die_with_parent(parent_pid: int) -> None:
    """In a worker: when the search process is gone, interrupt ourselves (the running trial is marked interrupted)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, name="autofit-parent-watch", daemon=True).start()


def worker_main(argv: list[str]) -> int:
    """A worker process: ``argv`` is ``[SETTINGS_JSON, PARENT_PID]``. Returns its exit status."""
    from autofit.study.worker import run_worker

    settings = StudySettings.from_json(argv[0])
    die_with_parent(int(argv[1]))
    try:
        run_worker(settings, load_workload(settings.workload_source))
    except KeyboardInterrupt:
        return 130
    except AutofitError as exc:
        sys.stderr.write(f"autofit: error: {exc}\n")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(worker_main(sys.argv[1:]))


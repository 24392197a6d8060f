"""``search()``: validate the request, create or resume the study, run its workers, write the tables."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import optuna

from autofit.core.budget import parse_budget
from autofit.core.config import Precision
from autofit.core.errors import RunFailure, StudyError
from autofit.core.files import remove_stale_temp_files
from autofit.core.space import SearchSpace, load_space, space_from_dict
from autofit.estimator.layer_prior import workload_prior
from autofit.estimator.memory_model import needs_selective, needs_split_ends, optimizer_choices
from autofit.estimator.time_model import OpCounts
from autofit.probes.device_rates import DeviceRates, probe_rates
from autofit.probes.links import with_links
from autofit.profiling.profile import profile_workload
from autofit.runtime import forkserver
from autofit.runtime.devicelock import visible_gpus
from autofit.study import locks
from autofit.study import (
    storage as backend,  # the module; `storage` is search()'s URL argument
)
from autofit.study.launcher import run_workers
from autofit.study.progress import ProgressCallback, progress_of, starting_progress
from autofit.study.settings import (
    JOURNAL_NAME,
    MIN_IMPROVEMENT,
    PATIENCE,
    TRIAL_TIMEOUT_S,
    StudySettings,
    check_study_name,
    default_study_name,
    redact,
    space_to_dict,
)
from autofit.study.worker import TrialRunner, run_trial_isolated, run_worker
from autofit.trial import host
from autofit.workloads.base import Workload
from autofit.workloads.load import load_workload


def resolve_space(space: SearchSpace | str | Path | dict | None, global_batch: int | None = None) -> SearchSpace:
    """A SearchSpace from a SearchSpace, a TOML path or name, a mapping like a TOML file, or None
    (the default space); ``global_batch`` fixes its global batch. Raises SpaceError."""
    if isinstance(space, SearchSpace):
        resolved = space
    elif isinstance(space, dict):
        resolved = space_from_dict(dict(space), "<inline>")
    else:
        resolved = load_space(space)
    return resolved.with_global_batch(global_batch) if global_batch is not None else resolved


def default_device() -> str:
    """``"cuda"`` when PyTorch sees a GPU, else ``"cpu"`` (no CUDA context is created)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _visible_gpus() -> list[str]:
    import torch

    return visible_gpus()[:torch.cuda.device_count()]  # no CUDA context: trials run in children


def spread_gpus(gpus: list[str], workers: int, devices: int | None) -> tuple[int, list[list[str]]]:
    """Devices per worker and each worker's GPU ids: the GPUs dealt out evenly, or, with more workers
    than GPUs, one GPU each in turn (workers on one GPU take turns: :mod:`autofit.runtime.devicelock`)."""
    if not gpus:
        raise StudyError("--device cuda: no CUDA GPU is visible to this PyTorch")
    if workers > len(gpus):
        return 1, [[gpus[w % len(gpus)]] for w in range(workers)]
    per_worker = len(gpus) // workers
    slices = [gpus[w * per_worker:(w + 1) * per_worker] for w in range(workers)]
    return (min(devices, per_worker) if devices else per_worker), slices


def _devices(device: str, workers: int, devices: int | None) -> tuple[int, list[list[str]]]:
    """Devices per worker and, on CUDA, each worker's GPU ids."""
    if device != "cuda":
        return devices or 1, []
    return spread_gpus(_visible_gpus(), workers, devices)


def _check(device: str, workers, trials, workload: Workload, own_runner) -> None:
    """Raise StudyError for arguments no search can run with."""
    if device not in ("cpu", "cuda"):
        raise StudyError(f"device {device!r}: expected cpu or cuda")
    if not isinstance(workers, int) or workers < 1:
        raise StudyError(f"workers must be a positive integer, got {workers!r}")
    if trials is not None and trials < 1:
        raise StudyError(f"trials must be a positive integer, got {trials!r}")
    if workers > 1 and workload.source is None:
        raise StudyError("workers > 1 needs a workload that other processes can load: pass a --model spec or "
                         "autofit.load_workload('path/to/file.py:function')")
    if workers > 1 and own_runner is not None:
        raise StudyError("a trial_runner runs in this process only: use workers=1 with it")


def search(workload: Workload | str, budget: str | int, *, space: SearchSpace | str | Path | dict | None = None,
           global_batch: int | None = None, trials: int | None = None, timeout_s: float | None = None,
           workers: int = 1, storage: str | None = None, study_name: str | None = None,
           out_dir: str | Path | None = None, device: str | None = None, devices: int | None = None, seed: int = 0,
           patience: int = PATIENCE, min_improvement: float = MIN_IMPROVEMENT,
           trial_timeout_s: float = TRIAL_TIMEOUT_S, progress: ProgressCallback | None = None,
           command: str | None = None, trial_runner: TrialRunner | None = None):
    """Search ``space`` for the fastest config of ``workload`` whose measured peak fits ``budget``.

    - ``workload``: a Workload or a ``--model`` spec; ``budget``: ``"8GB"`` or bytes.
    - ``space``: a SearchSpace, a TOML path or name in ``search_spaces/``, or a mapping as in a
      TOML file (default: ``search_spaces/default.toml``); ``global_batch`` fixes the global batch.
    - ``trials``: real trials in the study at most (pruned configs are free); ``timeout_s``: no
      trial starts after this many seconds; ``patience``/``min_improvement``: stop after that
      many real trials in a row without improving the best by that fraction.
    - ``workers``: local worker processes on one study (each with its own GPUs when there are
      several); ``storage``: an Optuna storage URL (e.g. ``postgresql://...``) instead of the
      journal file in ``out_dir`` (default ``results/<study_name>``); ``study_name`` (default
      ``<workload>-<budget>``). Running the same search again resumes it.
    - ``device``: ``"cpu"`` or ``"cuda"`` (default: cuda when available); ``devices``: devices a
      worker has (default: 1 on the CPU, its share of the visible GPUs on CUDA); device splits
      above it are never run (estimated, except pipeline splits of a model with tied weights, whose
      ends would cost profiling). On the CPU, ``devices=N`` runs splits up to N as
      pipeline stage processes sharing the CPU.
    - ``progress``: called with a :class:`SearchProgress` after every step (the library never prints).
    - ``trial_runner`` (workers=1 only): runs each real trial, first measurements and re-measurements alike
      (:class:`autofit.study.worker.TrialRunner`; default: an isolated child).

    Returns a :class:`autofit.report.result.SearchResult`; the tables ``trials.csv``, ``best.json`` and
    ``summary.md`` are written to ``out_dir`` (where temporary files that a killed write of them left are
    removed first: :func:`autofit.core.files.remove_stale_temp_files`). Raises BudgetError, SpaceError, WorkloadError or
    StudyError for bad input (StudyError also when ``out_dir`` holds a study of another budget,
    workload, device or space); KeyboardInterrupt after marking running trials interrupted.
    """
    # Long on purpose: its order is the contract (every check before profiling, the search lock around the study, the tables in `finally`), read top to bottom.
    from autofit.report.result import search_result

    started_wall, started = time.time(), time.monotonic()
    budget_bytes = parse_budget(budget)
    loaded = load_workload(workload)
    resolved = resolve_space(space, global_batch)
    device = device or default_device()
    _check(device, workers, trials, loaded, trial_runner)
    devices, gpu_slices = _devices(device, workers, devices)
    name = check_study_name(study_name) if study_name is not None else default_study_name(loaded.name, budget_bytes)
    backend.check_storage_url(storage)
    out = Path(out_dir) if out_dir is not None else Path("results") / name
    backend.ensure_out_dir(out)
    backend.check_connection(storage, name)  # an unreachable database is said at once, not after profiling
    with locks.SearchLock(out) as directory:  # a second search here joins the study
        settings = StudySettings(
            workload_name=loaded.name, workload_source=loaded.source, budget_bytes=budget_bytes,
            budget_text=budget if isinstance(budget, str) else f"{budget}B", space=space_to_dict(resolved),
            device_type=device, devices=devices, study_name=name, out_dir=str(out), storage=storage, seed=seed,
            trials=trials, deadline=None if timeout_s is None else started_wall + timeout_s, patience=patience,
            min_improvement=min_improvement, trial_timeout_s=trial_timeout_s, command=redact(command))
        emit = progress or (lambda event: None)
        removed = remove_stale_temp_files(out)  # left by a killed write (write_atomic); never a live writer's
        if removed:
            emit(starting_progress(f"removed {len(removed)} temporary file(s) a killed write left in {out}: "
                                   f"{', '.join(removed)}", started))
        if workers == 1 and trial_runner is None:
            _start_trial_processes(loaded, device)
        starting = None if progress is None else lambda line: emit(starting_progress(line, started))
        early = probe_beside_profiling(device, resolved.precision, starting)
        profile = _profile(loaded, resolved, device, devices, starting)
        study = backend.create_or_load(settings)
        backend.record_profile(study, profile.key)
        note = None if progress is None else lambda line: emit(progress_of(backend.read_records(study), line, started))
        emit(progress_of(backend.read_records(study), f"study {name} in {out}", started))
        stop = None
        try:
            rates, counts = device_prior(loaded, profile, device, resolved, note, devices,
                                         probed=early.result() if early is not None else None)
            if workers == 1:
                stop = run_worker(settings, loaded, profile=profile, rates=rates, counts=counts, progress=progress,
                                  started=started, runner=trial_runner or run_trial_isolated)
            else:
                # Each worker reads the device's rates and the workload's layer timings from the disk cache
                # filled above once, so no worker starts its trials late (or times its probes against another's);
                # this process runs no trial itself: the fork server the layer timing started goes.
                forkserver.stop_server()
                stop = run_workers(settings, workers, gpu_slices, study, emit, started,
                                   log_tag=f".{os.getpid()}" if directory.joined else "")
        finally:
            _record_run(study, settings, started_wall, workers, stop)
            if note is not None:
                note("writing the tables, the pictures and report.html...")
            _write_tables(study, out, storage, stop)
        result = search_result(backend.snapshot(study), out, wall_s=time.time() - started_wall)
        # the stop reason is said once, by whoever shows the result (the CLI's summary), not in this line
        emit(progress_of(backend.read_records(study), "done", started, done=True, stop_reason=result.stop_reason))
        return result


def _start_trial_processes(loaded: Workload, device: str) -> None:
    """Start what this process's trials will run in now, so its imports (seconds) overlap the profile
    and the probes instead of delaying the first trial: on the CPU the fork server they fork from
    (profiling starts it too, but only when it profiles), on CUDA the trial host with its context."""
    if device == "cpu" and forkserver.enabled():
        forkserver.start_server_soon(loaded.preload)
    if loaded.source is not None and host.enabled(device):
        host.start_soon(loaded.source, device)


def _profile(loaded: Workload, space: SearchSpace, device: str, devices: int, note: Callable[[str], None] | None):
    """The workload's profile for ``space`` (:func:`autofit.profiling.profile.profile_workload`) as a worker with
    ``devices`` devices runs it, where a user's errors in the model surface; the trial host started for this
    search goes if it fails."""
    configs = space.configs()
    try:
        return profile_workload(loaded, list(space.precision), device_type=device,
                                split_ends=needs_split_ends(configs, devices),
                                optimizers=optimizer_choices(configs), selective=needs_selective(configs), note=note)
    except BaseException:
        host.release()
        raise


# CPUs a machine needs before the device probe runs beside profiling: one for the profiling, one for the
# probe's kernel launches (its operator latency is a CPU's time), the rest for the trial host's start.
PROBE_BESIDE_PROFILING_CPUS = 4


def probe_beside_profiling(device: str, precisions: Sequence[Precision], note: Callable[[str], None] | None = None,
                           use_cache: bool = True) -> Future | None:
    """On a GPU, the device probe (:func:`autofit.probes.device_rates.probe_rates`: a child that makes a CUDA
    context and times the card's matmuls, seconds when not cached) started in a thread now, so that it runs
    while this process profiles on fake tensors (seconds more); None on the CPU, whose rates would be timed
    against the profiling, or with fewer than PROBE_BESIDE_PROFILING_CPUS CPUs. A daemon thread, not an
    executor's: a search that fails while profiling exits without waiting for the probe.

    The profiling children's real-step checks (:mod:`autofit.profiling.real_check`: a step at micro-batch 2,
    sometimes 4) may land on the card beside the probe's timing; the probe measures twice and probes again
    when its readings disagree (:func:`autofit.probes.device_rates.measure_checked`), and its rates are only
    the prior that the first trials calibrate."""
    if device == "cpu" or (os.cpu_count() or 1) < PROBE_BESIDE_PROFILING_CPUS:
        return None
    probed: Future = Future()

    def probe() -> None:
        try:
            probed.set_result(probe_rates(device, use_cache=use_cache, note=note, precisions=precisions))
        except BaseException as exc:  # noqa: BLE001 -- raised where the rates are read, as the probe's own
            probed.set_exception(exc)

    threading.Thread(target=probe, name="autofit-probe", daemon=True).start()
    return probed


def _write_tables(study: optuna.Study, out: Path, storage: str | None, stop: str | None) -> None:
    """The tables, pictures and page from the study. A failure is raised only when the search itself
    ended well (``stop``): never hide the search's own outcome behind a report error."""
    from autofit.report.write import write_reports

    try:
        write_reports(backend.snapshot(study), out, html=True)
    except OSError as exc:  # a full disk: the tables are whole or old (written atomically), the study kept
        if stop is not None:
            raise RunFailure(f"cannot write the tables in {out} ({exc.strerror or exc}); the study is intact "
                             f"in {redact(storage) or out / JOURNAL_NAME}: make room, then run "
                             f"`autofit report {out} --html` to write them") from None
    except Exception:  # noqa: BLE001
        if stop is not None:
            raise


def _record_run(study: optuna.Study, settings: StudySettings, started_wall: float, workers: int,
                stop: str | None) -> None:
    """Append this invocation to the study's ``runs`` (wall time, workers, why it stopped)."""
    try:
        with locks.ClaimLock(Path(settings.out_dir)):
            runs = list(study.user_attrs.get("runs", []))
            runs.append({"started": started_wall, "wall_s": time.time() - started_wall, "workers": workers,
                         "host": socket.gethostname(), "stop_reason": stop or "interrupted",
                         "command": settings.command})
            study.set_user_attr("runs", runs)
    except Exception:  # noqa: BLE001 -- bookkeeping must not mask the search's own outcome
        pass


def device_prior(workload: Workload, profile, device: str, space: SearchSpace,
                 note: Callable[[str], None] | None = None, devices: int = 1,
                 probed: DeviceRates | None = None) -> tuple[DeviceRates, OpCounts | None]:
    """The device's rates (:func:`autofit.probes.device_rates.probe_rates`, or ``probed`` where they were
    probed already; with the collectives' costs of the device splits that run on ``devices``,
    :func:`autofit.probes.links.with_links`) and the time model's prior of ``workload``
    (:func:`autofit.estimator.layer_prior.workload_prior`), each read from the disk cache or measured (and
    cached); ``note`` is told which, a line at a time."""
    rates = probed if probed is not None else probe_rates(device, note=note, precisions=space.precision)
    rates = with_links(rates, space.configs(), devices, note=note)
    return rates, workload_prior(workload, profile, rates, [p.value for p in space.precision], note=note)

"""The launcher API: search, estimate and measure from Python, then apply the best config to your loop.

Example (a launcher script; ``examples/launcher.py`` is a runnable one)::

    import autofit

    result = autofit.search("gpt-tiny", budget="8GB", trials=12)  # progress lines on stderr
    print(result.best, result.best_measured["samples_per_s"])
    model = MyModel()
    optimizer = torch.optim.AdamW(model.parameters())
    with result.apply(model, optimizer) as run:
        for batch in loader:
            for inputs, targets in run.micro_batches(batch):
                with run.autocast():
                    loss = loss_fn(model(inputs), targets)
                run.backward(loss)
            run.step()
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from autofit.api.run_study import default_device, resolve_space
from autofit.api.run_study import search as study_search
from autofit.core.budget import parse_budget
from autofit.core.config import TrainConfig
from autofit.core.errors import StudyError
from autofit.core.space import SearchSpace
from autofit.estimator.memory_model import MemoryEstimate, optimizer_choices
from autofit.estimator.memory_model import estimate as estimate_one
from autofit.estimator.memory_table import estimate_table
from autofit.profiling.profile import profile_workload
from autofit.report.result import SearchResult
from autofit.runtime.training import check_fake_device
from autofit.study import (
    MIN_IMPROVEMENT,
    PATIENCE,
    TRIAL_TIMEOUT_S,
    ProgressCallback,
    ProgressPrinter,
    SearchProgress,
)
from autofit.trial.apply import TrainingPlan, TrainingRun
from autofit.trial.run import TrialResult, run_trial
from autofit.workloads.base import Workload
from autofit.workloads.load import load_workload

__all__ = ["SearchProgress", "SearchResult", "TrainingPlan", "TrainingRun", "estimate", "measure", "search"]


def search(workload: Workload | str, budget: str | int = "8GB", *,
           space: SearchSpace | str | Path | dict | None = None, global_batch: int | None = None,
           trials: int | None = None, timeout_s: float | None = None, workers: int = 1, storage: str | None = None,
           study: str | None = None, out: str | Path | None = None, device: str | None = None,
           devices: int | None = None, seed: int = 0, patience: int = PATIENCE,
           min_improvement: float = MIN_IMPROVEMENT, trial_timeout_s: float = TRIAL_TIMEOUT_S,
           progress: ProgressCallback | bool | None = True) -> SearchResult:
    """Find the fastest config of ``workload`` whose measured peak fits ``budget`` (per device).

    The same search as ``autofit search`` (see :func:`autofit.study.search` for every argument):
    ``space`` is a SearchSpace, a TOML path or name, or a mapping like a TOML file;
    ``trials`` caps the real trials; ``storage`` is an Optuna URL for several machines; ``out``
    (default ``results/<study>``) holds the study and its tables, and running the same search
    again resumes it.

    ``progress``: ``True`` (the default) prints the lines ``autofit search`` prints, on stderr, from
    the first second (profiling the workload, probing the device, each trial, the stop): one live
    line on a terminal, a line per event otherwise (a notebook, a log file). ``False`` or ``None``:
    silent. A function: called with each :class:`SearchProgress` event instead, nothing printed
    (e.g. ``progress=lambda e: log.info("%s", e.message)`` to route them through ``logging``).

    A workload built in Python (no ``source``) runs its trials in forked children on one
    thread; load it with ``autofit.load_workload("path/to/file.py:function")`` so trials run in
    fresh processes (and so ``workers > 1`` can load it).

    Returns a :class:`SearchResult` (``.best``, ``.table``, ``.apply(model, optimizer)``).
    Raises BudgetError, SpaceError, WorkloadError or StudyError for bad input.
    """
    printer = ProgressPrinter() if progress is True else None
    if progress is False or progress is None:
        callback = None
    elif printer is not None:
        callback = printer
    elif callable(progress):
        callback = progress
    else:
        raise StudyError(f"progress must be True (print the progress lines), False or None (silent), or a function "
                         f"of a SearchProgress event; got {progress!r}")
    try:
        return study_search(workload, budget, space=space, global_batch=global_batch, trials=trials,
                            timeout_s=timeout_s, workers=workers, storage=storage, study_name=study, out_dir=out,
                            device=device, devices=devices, seed=seed, patience=patience,
                            min_improvement=min_improvement, trial_timeout_s=trial_timeout_s, progress=callback,
                            command=None)
    finally:
        if printer is not None:
            printer.close()


def estimate(workload: Workload | str, config: TrainConfig | str | SearchSpace | Path | dict | None = None, *,
             budget: str | int | None = None, device: str | None = None,
             global_batch: int | None = None) -> MemoryEstimate | pd.DataFrame:
    """Predicted peak memory, from a fake-tensor profile (nothing is trained).

    With a :class:`TrainConfig` (or ``"precision=amp-bf16,micro_batch=8"``): its
    :class:`autofit.estimator.memory_model.MemoryEstimate`. With a space (SearchSpace, TOML path or
    name, mapping; None = the default space): a DataFrame, one row per config
    (:func:`autofit.estimator.memory_table.estimate_table`'s columns). ``fits`` needs ``budget``.
    Raises ConfigError, SpaceError, BudgetError or WorkloadError.

    >>> autofit.estimate("gpt-tiny", "precision=amp-bf16,micro_batch=8", budget="2GB").fits  # doctest: +SKIP
    True
    """
    device = device or default_device()
    check_fake_device(device)
    loaded = load_workload(workload)
    budget_bytes = parse_budget(budget) if budget is not None else None
    if isinstance(config, str) and "=" in config:
        config = TrainConfig.parse(config)
    if isinstance(config, TrainConfig):
        profile = profile_workload(loaded, [config.precision], device_type=device,
                                   optimizers=optimizer_choices([config]))
        return estimate_one(profile, config, budget_bytes)
    space = resolve_space(config, global_batch)
    configs = space.configs()
    profile = profile_workload(loaded, list(space.precision), device_type=device, optimizers=optimizer_choices(configs))
    return estimate_table(profile, configs, budget_bytes)


def measure(workload: Workload | str, config: TrainConfig | str, *, budget: str | int | None = None,
            device: str | None = None, steps: int = 3, timeout_s: float = 300.0) -> TrialResult:
    """Train a few real steps of ``config`` in an isolated child process: peak memory and throughput.

    Over ``budget`` is ``status == "oom"``; a crash, exception or hang of the workload is
    ``error``/``timeout`` -- never an exception here. Returns a :class:`autofit.trial.run.TrialResult`.
    Raises ConfigError or BudgetError for bad arguments.
    """
    if isinstance(config, str):
        config = TrainConfig.parse(config)
    budget_bytes = parse_budget(budget) if budget is not None else None
    return run_trial(workload, config, device=device or default_device(), budget_bytes=budget_bytes,
                     measure_steps=steps, timeout_s=timeout_s)

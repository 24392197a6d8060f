"""The search: an Optuna study over a search space, pruned by the estimate, confirmed by real trials.

One planning step (every worker, before every trial, from what the storage holds):

1. **calibrate** from the real trials so far (:mod:`autofit.calibration`);
2. **prune**, with a reason, every config that should not run (recorded as a ``PRUNED`` trial
   whose user attrs hold the predicted breakdown): ``invalid`` (more stages than layers),
   ``devices`` (a device split larger than the devices a worker has: estimated, never run),
   ``duplicate`` (a checkpoint interval at least a stage's length is one segment per stage,
   the same config as the smallest such interval), ``over_budget`` (calibrated peak with its
   safety margin over the budget), ``too_slow`` (predicted throughput under 1/SLOW_FACTOR of
   the best predicted, or a trial predicted to outlast the trial time limit), ``dominated``
   (the same precision, micro-batch, accumulation and split with less recomputation fits and
   is predicted faster: checkpointing only trades time for memory). A prune is re-examined at
   every step: if its reason no longer holds (the config that dominated it ran out of memory,
   calibration shrank the margin), the config becomes a candidate again;
3. **stop** when the real-trial limit is reached, the time is up, ``patience`` real trials in a
   row did not improve the best by ``min_improvement``, the best remaining candidate is
   predicted below BOUND of the best measured, or no candidate is left;
4. otherwise **run** the next candidate: first, for each precision not measured yet, its
   predicted-fastest config (one trial calibrates the whole precision); then the candidate with
   the highest calibrated predicted throughput; predictions within NEAR of the best are a tie,
   won by the cheapest trial. It runs in an isolated child
   (:func:`autofit.trial.run_trial`) under the budget and a time limit sized from its
   prediction; the objective is measured samples/s, and ``trial.set_constraint`` records the
   measured peak minus the budget (and whether it failed), so a trial that went over, or
   failed, is never the best. ``oom``, ``error`` and ``timeout`` are recorded and the search
   goes on.

The sampler is this planner: each trial's params are the planned config (per-dimension
categoricals, so Optuna's tables and plots read naturally). No config runs twice: a planning
step and the ask that follows it hold a lock shared by the workers of one output directory;
workers on other machines (an RDB ``--storage``) that pick the same config at the same moment
see the other's trial and prune theirs as a ``duplicate``.

Storage: by default an Optuna journal file, ``<out>/study.journal``, locked with ``flock``
(released by the kernel when a process dies, so ``kill -9`` never leaves a stale lock). Running
the same search again resumes it: finished trials are kept; a trial left ``RUNNING`` by a dead
worker (its process is gone, or its heartbeat is older than STALE_S) is marked ``FAIL`` and its
config planned again.

Known limitations: on a CPU every worker shares the same cores, so ``workers > 1`` measures
each config under the others' load (their OpenMP threads are divided between them); a study's
search space, budget, workload and device are fixed when it is created.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import optuna
from optuna.distributions import CategoricalDistribution
from optuna.samplers import BaseSampler
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.storages.journal._file import BaseJournalFileLock
from optuna.trial import FrozenTrial, TrialState, create_trial

from autofit.budget import format_bytes, parse_budget
from autofit.calibration import Calibration, Observation, calibrate, relative_error
from autofit.config import FIELDS, Precision, TrainConfig, stage_bounds
from autofit.errors import AutofitError, StudyError
from autofit.memory_model import BREAKDOWN, estimate_table
from autofit.profile import Profile, profile_workload
from autofit.space import SearchSpace, load_space, space_from_dict
from autofit.time_model import DeviceRates, OpCounts, op_counts, predict_table, probe_rates
from autofit.trial import TrialResult, TrialStatus, run_trial
from autofit.workload import Workload, load_workload

# --- the rules' constants ---------------------------------------------------------------------
PATIENCE = 5               # real trials in a row without improving the best by MIN_IMPROVEMENT
MIN_IMPROVEMENT = 0.02     # relative; below this an "improvement" is measurement noise
SLOW_FACTOR = 20.0         # pruned: predicted this many times slower than the best predicted
NEAR = 0.05                # predictions this close are a tie: the cheaper trial runs first
BOUND = 0.5                # stop: the best candidate is predicted below this fraction of the best measured
TRIAL_TIMEOUT_S = 180.0    # a trial's time limit never exceeds this (process start included)
MIN_TRIAL_TIMEOUT_S = 60.0
TRIAL_TIMEOUT_FACTOR = 4.0  # a trial may take this many times its (calibrated) prediction
TRIAL_STARTUP_S = 8.0      # interpreter start + imports of a trial child (and of each extra stage)
TRACKED_STEP_SLOWDOWN = 2.0  # steps run under the memory tracker are slower than timed ones
# measure_trial's schedule: warm-up and measured steps run under the tracker, then timed steps.
WARMUP_STEPS, MEASURE_STEPS, TIMED_STEPS, MICRO_STEPS_PER_STEP = 2, 1, 3, 3
HEARTBEAT_S = 30.0         # a running trial's worker writes a heartbeat this often
STALE_S = 600.0            # a RUNNING trial without a heartbeat for this long belongs to a dead worker
ORPHAN_S = 60.0            # a RUNNING trial no worker signed within this long was orphaned at birth

JOURNAL_NAME = "study.journal"
META_NAME = "study.json"
_CLAIM_LOCK = ".autofit-claim.lock"
_JOURNAL_LOCK = ".autofit-journal.lock"
REASON_KINDS = ("invalid", "devices", "duplicate", "over_budget", "too_slow", "dominated")


# --- settings -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StudySettings:
    """Everything that defines one search and its limits; the same for every worker (JSON-ready)."""

    workload_name: str
    workload_source: str | None
    budget_bytes: int
    budget_text: str
    space: dict                  # space dimensions, global_batch and source (space_from_dict's input)
    device_type: str
    devices: int                 # devices per worker (device splits above this are never run)
    study_name: str
    out_dir: str
    storage: str | None = None   # an Optuna storage URL; None: the journal file in out_dir
    seed: int = 0
    trials: int | None = None    # real trials in the study at most
    deadline: float | None = None  # time.time() after which no trial starts
    patience: int = PATIENCE
    min_improvement: float = MIN_IMPROVEMENT
    trial_timeout_s: float = TRIAL_TIMEOUT_S
    command: str | None = None   # the command line that started the search (for best.json)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "StudySettings":
        return cls(**json.loads(text))

    def search_space(self) -> SearchSpace:
        return space_from_dict({k: v for k, v in self.space.items() if k != "source"}, self.space.get("source", "<inline>"))


def space_to_dict(space: SearchSpace) -> dict:
    """A SearchSpace as the mapping :func:`autofit.space.space_from_dict` reads (plus its source)."""
    data: dict[str, Any] = {d: [getattr(v, "value", v) for v in getattr(space, d)] for d in FIELDS}
    if space.global_batch is not None:
        data["global_batch"] = space.global_batch
        data.pop("grad_accum")
    data["source"] = space.source
    return data


def default_study_name(workload_name: str, budget_bytes: int) -> str:
    """``<workload>-<budget>``, the budget in the largest unit that divides it, e.g. ``gpt-tiny-8GB``."""
    for unit, size in (("TB", 10**12), ("TiB", 2**40), ("GB", 10**9), ("GiB", 2**30), ("MB", 10**6),
                       ("MiB", 2**20), ("KB", 10**3), ("KiB", 2**10)):
        if budget_bytes % size == 0:
            return f"{workload_name}-{budget_bytes // size}{unit}"
    return f"{workload_name}-{budget_bytes}B"


def redact(url: str | None) -> str | None:
    """A storage URL without its password: ``postgresql://user:***@host/db``."""
    return None if url is None else re.sub(r"(//[^:/@]+:)[^@/]*@", r"\1***@", url)


def distributions(space: SearchSpace) -> dict[str, CategoricalDistribution]:
    """One categorical per config field, over the values the space's configs take."""
    configs = space.configs()
    out = {}
    for name in FIELDS:
        values = list(dict.fromkeys(getattr(c, name) for c in configs))
        if name in ("precision", "split_mode"):
            out[name] = CategoricalDistribution([v.value for v in values])
        else:
            out[name] = CategoricalDistribution(sorted(values))
    return out


def config_of(params: dict) -> TrainConfig | None:
    """The TrainConfig of a trial's params (None when they are not a config)."""
    try:
        # params from before split_mode existed lack it: TrainConfig's default (pipeline) applies
        return TrainConfig.from_dict({f: params[f] for f in FIELDS if f in params})
    except (KeyError, AutofitError):
        return None


# --- storage ------------------------------------------------------------------------------


class _FlockLock(BaseJournalFileLock):
    """The journal's lock as an ``flock``: the kernel releases it when its holder dies."""

    def __init__(self, path: Path) -> None:
        self._path = str(path)
        self._fd: int | None = None

    def acquire(self) -> bool:
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        self._fd = fd
        return True

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


class _ClaimLock:
    """Held around a planning step and its ask: local workers never pick the same config."""

    def __init__(self, out_dir: Path) -> None:
        self._path = out_dir / _CLAIM_LOCK

    def __enter__(self) -> "_ClaimLock":
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def make_storage(out_dir: Path, storage: str | None):
    """The study's storage: ``storage`` (an Optuna URL) or the journal file in ``out_dir``."""
    if storage:
        return storage
    out_dir.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(out_dir / JOURNAL_NAME), lock_obj=_FlockLock(out_dir / _JOURNAL_LOCK)))


def open_study(out_dir: str | Path, storage: str | None = None, study_name: str | None = None) -> optuna.Study:
    """Load an existing study from its output directory (``study.json``) for reading.

    ``storage`` overrides the URL recorded there (which is stored without its password).
    Raises StudyError when the directory holds no study or the storage cannot be read.
    """
    out_dir = Path(out_dir)
    meta_path = out_dir / META_NAME
    meta = {}
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except ValueError:
            raise StudyError(f"{meta_path}: not valid JSON") from None
    elif not (out_dir / JOURNAL_NAME).is_file() and storage is None:
        raise StudyError(f"{out_dir}: no study here (no {META_NAME} or {JOURNAL_NAME}); run `autofit search --out {out_dir}`")
    url = storage or meta.get("storage")
    if url and "***" in url:
        raise StudyError(f"{out_dir}: the study is in {url}; pass the storage URL with its password (--storage)")
    name = study_name or meta.get("study_name")
    _quiet_optuna()
    try:
        backend = make_storage(out_dir, url)
        if name is None:
            names = optuna.get_all_study_names(storage=backend)
            if len(names) != 1:
                raise StudyError(f"{out_dir}: {len(names)} studies in the storage; name one (--study)")
            name = names[0]
        return optuna.load_study(study_name=name, storage=backend)
    except StudyError:
        raise
    except (KeyError, ValueError, ImportError, RuntimeError) as exc:
        raise StudyError(f"{out_dir}: cannot read study {name!r} ({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # a database driver's own errors (connection refused, ...)
        raise StudyError(f"{out_dir}: cannot read study {name!r} ({type(exc).__name__}: {exc})") from None


def _quiet_optuna() -> None:
    # Optuna logs every trial at INFO on stderr; the library never prints (the CLI reports progress).
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def _identity(settings: StudySettings) -> dict:
    configs = sorted(c.short() for c in settings.search_space().configs())
    return {"workload": settings.workload_name, "budget_bytes": settings.budget_bytes,
            "device_type": settings.device_type,
            "space": hashlib.sha256("\n".join(configs).encode()).hexdigest()[:16]}


def _create_or_load(settings: StudySettings) -> optuna.Study:
    out_dir = Path(settings.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _quiet_optuna()
    storage = make_storage(out_dir, settings.storage)
    try:
        study = optuna.create_study(storage=storage, study_name=settings.study_name, direction="maximize",
                                    load_if_exists=True)
    except Exception as exc:
        raise StudyError(f"cannot create or open study {settings.study_name!r} in "
                         f"{redact(settings.storage) or out_dir / JOURNAL_NAME}: {type(exc).__name__}: {exc}") from None
    identity = _identity(settings)
    found = study.user_attrs.get("identity")
    if found is None:
        study.set_user_attr("identity", identity)
        study.set_user_attr("settings", json.loads(settings.to_json()) | {"storage": redact(settings.storage)})
        study.set_user_attr("versions", _versions())
    elif found != identity:
        diff = ", ".join(f"{k} {found.get(k)!r} (now {v!r})" for k, v in identity.items() if found.get(k) != v)
        raise StudyError(f"study {settings.study_name!r} in {out_dir} was created with another {diff}; "
                         "pass --study NAME or --out DIR to start a new study")
    meta = {"study_name": settings.study_name, "storage": redact(settings.storage), "journal": None
            if settings.storage else JOURNAL_NAME}
    _write_atomic(out_dir / META_NAME, json.dumps(meta, indent=2) + "\n")
    return study


def _versions() -> dict:
    import platform

    import torch

    from autofit import __version__

    return {"autofit": __version__, "torch": torch.__version__, "optuna": optuna.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "host": socket.gethostname(),
            "cpu_count": os.cpu_count(),
            "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "CUDA_VISIBLE_DEVICES")
                    if k in os.environ}}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


# --- the trial record (user attrs) ---------------------------------------------------------
# status: ok | oom | error | timeout | pruned | running | interrupted
# reason, reason_kind: why it was pruned
# predicted: the estimate and time model before it ran (raw and calibrated)
# measured: the TrialResult's numbers; errors: relative prediction errors; worker: who ran it


def trial_status(trial: FrozenTrial) -> str:
    """``ok``, ``oom``, ``error``, ``timeout`` (ran), ``pruned``, ``running``, ``waiting`` or ``failed``."""
    if trial.state == TrialState.COMPLETE:
        return trial.user_attrs.get("status", "ok")
    return {TrialState.PRUNED: "pruned", TrialState.RUNNING: "running", TrialState.WAITING: "waiting"}.get(
        trial.state, "failed")


def observations(trials: list[FrozenTrial], budget_bytes: int) -> list[Observation]:
    """What calibration needs from every real trial that finished (ok, oom, error, timeout)."""
    out = []
    for t in trials:
        if t.state != TrialState.COMPLETE:
            continue
        config = config_of(t.params)
        predicted = t.user_attrs.get("predicted") or {}
        measured = t.user_attrs.get("measured") or {}
        if config is None or "peak_bytes" not in predicted:
            continue
        out.append(Observation(
            config=config, status=t.user_attrs.get("status", "ok"),
            predicted_peak_bytes=float(predicted["peak_bytes"]),
            predicted_step_time_s=float(predicted.get("prior_step_time_s") or math.nan),
            measured_peak_bytes=measured.get("peak_bytes"), measured_step_time_s=measured.get("step_time_s"),
            budget_bytes=budget_bytes))
    return out


# --- planning -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One planning step: prunes to record, then the config to run (None: stop, with the reason)."""

    prunes: list[dict]
    run: dict | None
    stop: str | None
    calibration: Calibration


class Planner:
    """Scores the whole space once (estimate + time model), then plans each step from the trials."""

    def __init__(self, settings: StudySettings, profile: Profile, rates: DeviceRates,
                 counts: OpCounts | None = None) -> None:
        self.settings = settings
        space = settings.search_space()
        self.configs = space.configs()
        self.index = {c: i for i, c in enumerate(self.configs)}
        mem = estimate_table(profile, self.configs, settings.budget_bytes)
        times = predict_table(profile, self.configs, rates, counts)
        self.table = mem.join(times.drop(columns=list(FIELDS)))
        self.n_layers = profile.n_layers
        self._static = self._static_reasons()
        rng = np.random.default_rng(settings.seed)
        self._tiebreak = rng.permutation(len(self.configs))  # seeded order among equal predictions

    # Reasons that do not depend on any measurement.
    def _static_reasons(self) -> list[tuple[str, str] | None]:
        out: list[tuple[str, str] | None] = [None] * len(self.configs)
        devices = self.settings.devices
        for i, (c, row) in enumerate(zip(self.configs, self.table.itertuples())):
            if not row.valid:
                out[i] = ("invalid", f"cannot run: {row.reason}")
            elif c.device_split > devices:
                out[i] = ("devices", f"device_split {c.device_split} needs {c.device_split} devices; a worker has "
                                     f"{devices} ({self.settings.device_type}); estimated only")
            else:
                longest = max(e - s for s, e in stage_bounds(self.n_layers, c.device_split))
                if c.checkpoint_every > longest:
                    same = [k for k in self._space_ckpts() if longest <= k < c.checkpoint_every]
                    if same:
                        out[i] = ("duplicate", f"checkpoint_every {c.checkpoint_every} >= the {longest} layers of a "
                                               f"stage is one segment per stage, as checkpoint_every {min(same)}")
        return out

    def _space_ckpts(self) -> list[int]:
        return sorted({c.checkpoint_every for c in self.configs})

    def prediction(self, i: int, calibration: Calibration, ratio: float | None = None) -> dict:
        """What the trial record keeps of config ``i``'s predictions (raw and calibrated).
        ``ratio``: its calibrated time ratio, when already computed."""
        row = self.table.iloc[i]
        if ratio is None:
            ratio = float(calibration.time_ratios(self.table.iloc[[i]])[0])
        step = float(row["step_time_s"]) if math.isfinite(row["step_time_s"]) else None
        out = {
            "peak_bytes": None if not math.isfinite(row["peak_bytes"]) else int(round(row["peak_bytes"])),
            "per_device_peak_bytes": [int(b) for b in row["per_device_peak_bytes"]],
            "peak_phase": row["peak_phase"],
            **{k: None if not math.isfinite(row[k]) else int(round(row[k])) for k in BREAKDOWN},
            "calibrated_peak_bytes": None if not math.isfinite(row["peak_bytes"])
            else int(round(calibration.corrected_peak(row["peak_bytes"]))),
            "peak_factor": calibration.peak_factor,
            "prior_step_time_s": step,
            "step_time_s": None if step is None else step * ratio,
            "samples_per_s": None if step is None else self.configs[i].samples_per_step / (step * ratio),
        }
        out["trial_timeout_s"] = self._trial_timeout(i, ratio)
        return out

    def _trial_seconds(self, i: int, ratio: float) -> float:
        """Predicted wall time of a trial of config ``i``: process starts, tracked and timed steps."""
        c, row = self.configs[i], self.table.iloc[i]
        if c.device_split > 1:  # the pipeline runs every micro-batch of a step
            step = row["step_time_s"] * ratio
        else:
            step = (min(c.grad_accum, MICRO_STEPS_PER_STEP) * row["micro_step_time_s"] + row["optimizer_step_time_s"]) * ratio
        steps = (WARMUP_STEPS + MEASURE_STEPS) * TRACKED_STEP_SLOWDOWN + TIMED_STEPS
        return TRIAL_STARTUP_S * c.device_split + steps * step

    def _trial_timeout(self, i: int, ratio: float) -> float:
        seconds = self._trial_seconds(i, ratio)
        if not math.isfinite(seconds):
            return self.settings.trial_timeout_s
        return float(min(self.settings.trial_timeout_s, max(MIN_TRIAL_TIMEOUT_S, TRIAL_TIMEOUT_FACTOR * seconds)))

    def step(self, trials: list[FrozenTrial], now: float | None = None) -> Step:
        """Plan from the study's trials: what to prune, what to run next, or why to stop."""
        settings = self.settings
        n = len(self.configs)
        calibration = calibrate(observations(trials, settings.budget_bytes), settings.device_type)
        ran = np.zeros(n, dtype=bool)          # a real trial finished or is running
        failed_run = np.zeros(n, dtype=bool)   # ran and did not come back ok under the budget
        measured_step = np.full(n, np.nan)     # measured step time of configs that ran ok
        pruned_before = np.zeros(n, dtype=bool)
        real_done, running = [], 0
        for t in trials:
            config = config_of(t.params)
            i = self.index.get(config) if config is not None else None
            if t.state in (TrialState.RUNNING, TrialState.WAITING):
                running += 1
            if i is None:
                continue
            if t.state == TrialState.COMPLETE:
                ran[i] = True
                ok = t.user_attrs.get("status", "ok") == "ok" and all(v <= 0 for v in t.constraints.values())
                failed_run[i] = not ok
                if ok and (t.user_attrs.get("measured") or {}).get("step_time_s"):
                    measured_step[i] = t.user_attrs["measured"]["step_time_s"]
                real_done.append(t)
            elif t.state in (TrialState.RUNNING, TrialState.WAITING):
                ran[i] = True
            elif t.state == TrialState.PRUNED:
                pruned_before[i] = True
        # Calibrated predictions.
        peak = self.table["peak_bytes"].to_numpy(dtype=np.float64)
        ratio = calibration.time_ratios(self.table)
        step_s = self.table["step_time_s"].to_numpy(dtype=np.float64) * ratio
        sps = (self.table["micro_batch"] * self.table["grad_accum"]).to_numpy(dtype=np.float64) / step_s
        fits = np.nan_to_num(np.asarray(calibration.fits(peak, settings.budget_bytes), dtype=bool), nan=False)
        reasons: list[tuple[str, str] | None] = list(self._static)
        for i in range(n):
            if reasons[i] is None and not fits[i]:
                reasons[i] = ("over_budget", f"predicted peak {format_bytes(peak[i] * calibration.peak_ratio)} "
                              f"(x{1 + calibration.peak_margin:.2f} safety margin) over the budget of "
                              f"{format_bytes(settings.budget_bytes)}")
        runnable = np.array([r is None for r in reasons])
        best_predicted = float(np.nanmax(sps[runnable])) if runnable.any() else math.nan
        for i in range(n):
            if reasons[i] is not None:
                continue
            seconds = self._trial_seconds(i, ratio[i])
            if sps[i] < best_predicted / SLOW_FACTOR:
                reasons[i] = ("too_slow", f"predicted {sps[i]:.3g} samples/s, under 1/{SLOW_FACTOR:g} of the best "
                                          f"predicted {best_predicted:.3g} samples/s")
            elif seconds > settings.trial_timeout_s:
                reasons[i] = ("too_slow", f"a trial is predicted to take {seconds:.0f} s, over the "
                                          f"{settings.trial_timeout_s:.0f} s trial limit")
        # Times are compared on one basis, the calibrated predictions (a measured time against a
        # sibling's prediction would let noise decide); a config that ran ok is known to fit.
        known = ~np.isnan(measured_step)
        self._dominance(reasons, step_s, np.where(known, 0.0, peak), failed_run)
        # Prunes: every prunable config that has no trial yet (ran configs keep their result).
        prunes = []
        for i in range(n):
            if reasons[i] is not None and not ran[i] and not pruned_before[i]:
                prunes.append({"index": i, "kind": reasons[i][0], "reason": reasons[i][1],
                               "predicted": self.prediction(i, calibration, float(ratio[i]))})
        candidates = [i for i in range(n) if reasons[i] is None and not ran[i]]
        stop = self._stop(candidates, real_done, running, sps, now)
        if stop is not None:
            return Step(prunes, None, stop, calibration)
        chosen = self._choose(candidates, sps, ratio, trials)
        return Step(prunes, {"index": chosen, "predicted": self.prediction(chosen, calibration, float(ratio[chosen]))},
                    None, calibration)

    def _dominance(self, reasons, step_s, peak, failed_run) -> None:
        """Prune checkpointing that buys memory the budget does not need (see the module docstring)."""
        groups: dict[tuple, list[int]] = {}
        for i, c in enumerate(self.configs):
            groups.setdefault((c.precision, c.micro_batch, c.grad_accum, c.device_split), []).append(i)
        for members in groups.values():
            alive = [i for i in members if reasons[i] is None and not failed_run[i]]
            for b in alive:
                for a in alive:
                    if a == b:
                        continue
                    faster = step_s[a] < step_s[b] * (1 - 1e-3)
                    same_time_less_memory = abs(step_s[a] - step_s[b]) <= 1e-3 * step_s[b] and (
                        peak[a] < peak[b] or (peak[a] == peak[b] and self.configs[a].checkpoint_every
                                              < self.configs[b].checkpoint_every))
                    if faster or same_time_less_memory:
                        ca = self.configs[a]
                        why = "predicted faster" if faster else "predicted as fast with less memory"
                        reasons[b] = ("dominated", f"checkpoint_every {ca.checkpoint_every} with the same precision, "
                                                   f"micro-batch and split fits and is {why}")
                        break

    def _stop(self, candidates: list[int], real_done: list[FrozenTrial], running: int, sps: np.ndarray,
              now: float | None) -> str | None:
        settings = self.settings
        if not candidates:
            return "exhausted: every config of the space ran or was pruned"
        if settings.trials is not None and len(real_done) + running >= settings.trials:
            return f"trial limit: {settings.trials} real trials"
        if settings.deadline is not None and (now or time.time()) >= settings.deadline:
            return "timeout: no trial starts after the time limit"
        ordered = sorted(real_done, key=lambda t: (t.datetime_complete is None, t.datetime_complete, t.number))
        best, since = None, 0
        for t in ordered:
            ok = t.user_attrs.get("status", "ok") == "ok" and all(v <= 0 for v in t.constraints.values())
            value = t.value if ok else None
            if value is not None and (best is None or value > best * (1 + settings.min_improvement)):
                best, since = value, 0
            else:
                since += 1
                if value is not None and value > best:
                    best = value
        if since >= settings.patience:
            return (f"patience: {since} real trials in a row without improving the best by "
                    f"{settings.min_improvement:.0%}" + ("" if best is not None else " (none fitted)"))
        if best is not None:
            top = max(sps[i] for i in candidates)
            if top < BOUND * best:
                return (f"bound: the best remaining config is predicted at {top:.3g} samples/s, under "
                        f"{BOUND:.0%} of the best measured {best:.3g}")
        return None

    def _choose(self, candidates: list[int], sps: np.ndarray, ratio: np.ndarray, trials: list[FrozenTrial]) -> int:
        """Explore each precision once, then exploit the best prediction; among near-equal
        predictions (within NEAR, below the model's resolution) take the cheapest trial."""
        measured = set()
        for t in trials:
            config = config_of(t.params)
            if config is not None and t.state in (TrialState.COMPLETE, TrialState.RUNNING):
                measured.add(config.precision)
        unexplored = [i for i in candidates if self.configs[i].precision not in measured]
        pool = unexplored or candidates
        top = max(sps[i] for i in pool)
        near = [i for i in pool if sps[i] >= top * (1 - NEAR)]
        return min(near, key=lambda i: (self._trial_seconds(i, ratio[i]), -sps[i], self._tiebreak[i]))


# --- the worker ------------------------------------------------------------------------------


class _PlannedSampler(BaseSampler):
    """Samples exactly the planned config: every field is a relative param set before ``ask``."""

    def __init__(self, dists: dict[str, CategoricalDistribution]) -> None:
        self.dists = dists
        self.pending: dict | None = None

    def infer_relative_search_space(self, study, trial):
        return dict(self.dists)

    def sample_relative(self, study, trial, search_space):
        return dict(self.pending or {})

    def sample_independent(self, study, trial, param_name, param_distribution):
        raise RuntimeError(f"autofit's planner sets every param; {param_name!r} was not planned")


@dataclass(frozen=True)
class SearchProgress:
    """A progress event for a callback (the library never prints).

    ``real``: real trials finished; ``pruned``: configs pruned by the estimate; ``running``;
    ``best_samples_per_s``/``best_config``: the best feasible trial so far (None before);
    ``message``: one line about what just happened; ``elapsed_s``; ``done``: the search ended.
    """

    real: int
    pruned: int
    running: int
    best_samples_per_s: float | None
    best_config: TrainConfig | None
    message: str
    elapsed_s: float
    done: bool = False


ProgressCallback = Callable[[SearchProgress], None]


def progress_of(trials: list[FrozenTrial], message: str, started: float, done: bool = False) -> SearchProgress:
    """Counts and the best feasible trial, from the study's trials."""
    real = pruned = running = 0
    pruned_configs, ran_configs = set(), set()
    best, best_config = None, None
    for t in trials:
        status = trial_status(t)
        if status == "pruned":
            pruned_configs.add(tuple(sorted(t.params.items())))
        elif status == "running":
            running += 1
        elif status in ("ok", "oom", "error", "timeout"):
            real += 1
            ran_configs.add(tuple(sorted(t.params.items())))
            if status == "ok" and all(v <= 0 for v in t.constraints.values()) and (best is None or t.value > best):
                best, best_config = t.value, config_of(t.params)
    pruned = len(pruned_configs - ran_configs)
    return SearchProgress(real, pruned, running, best, best_config, message, time.monotonic() - started, done)


def _process_start(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rfind(b")") + 2:].split()[19].decode()  # field 22: start time in clock ticks
    except (OSError, IndexError):
        return None


def _worker_identity() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid())}


def _is_stale(trial: FrozenTrial, now: float) -> bool:
    worker = trial.user_attrs.get("worker") or {}
    started = trial.datetime_start.timestamp() if trial.datetime_start else now
    if not worker:  # its worker died between creating it and signing it (a moment, under the lock)
        return now - started > ORPHAN_S
    if worker.get("host") == socket.gethostname() and worker.get("pid"):
        start = _process_start(int(worker["pid"]))
        if start is None or (worker.get("start") is not None and start != worker["start"]):
            return True  # its process is gone (or the pid was reused)
        return False
    beat = trial.user_attrs.get("heartbeat") or started
    return now - float(beat) > STALE_S


def fail_stale_trials(study: optuna.Study, trials: list[FrozenTrial]) -> list[int]:
    """Mark RUNNING trials of dead workers FAIL (status ``interrupted``); their configs are planned again."""
    now = time.time()
    failed = []
    for t in trials:
        if t.state == TrialState.RUNNING and _is_stale(t, now):
            try:
                study._storage.set_trial_user_attr(t._trial_id, "status", "interrupted")
                study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
                failed.append(t.number)
            except (RuntimeError, ValueError):
                pass  # finished by its worker meanwhile
    return failed


class _Heartbeat:
    """Writes ``heartbeat`` (time.time()) on the running trial every HEARTBEAT_S seconds."""

    def __init__(self, trial: optuna.Trial) -> None:
        self._trial = trial
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autofit-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._trial.set_user_attr("heartbeat", time.time())
            except Exception:  # noqa: BLE001 -- a missed heartbeat only delays recovery
                pass

    def __enter__(self) -> "_Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _measured(result: TrialResult) -> dict:
    keys = ("peak_bytes", "per_device_peak_bytes", "peak_reserved_bytes", "breakdown", "samples_per_s", "tokens_per_s",
            "step_time_s", "micro_step_time_s", "optimizer_step_time_s", "error", "wall_s")
    data = result.to_dict()
    return {k: data[k] for k in keys}


def _describe(number: int, config: TrainConfig, result: TrialResult) -> str:
    if result.ok:
        return (f"trial {number} {config.short()}: {result.samples_per_s:.2f} samples/s, peak "
                f"{format_bytes(result.peak_bytes)} ({result.wall_s:.0f} s)")
    return f"trial {number} {config.short()}: {result.status.value}: {result.error} ({result.wall_s:.0f} s)"


def run_worker(settings: StudySettings, workload: Workload, *, profile: Profile | None = None,
               rates: DeviceRates | None = None, progress: ProgressCallback | None = None,
               started: float | None = None) -> str:
    """Plan, prune and run trials of one study until a stop rule holds. Returns the stop reason.

    Several workers (processes, machines) may run on one study at once. Raises StudyError when
    the study cannot be opened; KeyboardInterrupt marks the running trial FAIL and propagates.
    """
    started = time.monotonic() if started is None else started
    out_dir = Path(settings.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    space = settings.search_space()
    profile = profile or profile_workload(workload, list(space.precision), device_type=settings.device_type)
    rates = rates or probe_rates(settings.device_type)
    planner = Planner(settings, profile, rates, op_counts(workload))
    dists = distributions(space)
    sampler = _PlannedSampler(dists)
    _quiet_optuna()
    study = optuna.load_study(study_name=settings.study_name, storage=make_storage(out_dir, settings.storage),
                              sampler=sampler)
    lock = _ClaimLock(out_dir)
    device = settings.device_type
    emit = progress or (lambda event: None)
    if "device_rates" not in study.user_attrs:
        study.set_user_attr("device_rates", rates.to_dict())
    calibrated_on = None
    while True:
        with lock:
            trials = study.get_trials(deepcopy=False)
            if fail_stale_trials(study, trials):
                trials = study.get_trials(deepcopy=False)
            step = planner.step(trials)
            if step.calibration.n_trials != calibrated_on:  # kept with the study as it is learned
                calibrated_on = step.calibration.n_trials
                study.set_user_attr("calibration", step.calibration.to_dict())
            for p in step.prunes:
                config = planner.configs[p["index"]]
                study.add_trial(create_trial(
                    state=TrialState.PRUNED, params=config.to_dict(), distributions=dists,
                    user_attrs={"status": "pruned", "reason_kind": p["kind"], "reason": p["reason"],
                                "predicted": p["predicted"]}))
            if step.prunes:
                kinds = {}
                for p in step.prunes:
                    kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
                emit(progress_of(study.get_trials(deepcopy=False), "pruned by the estimate: " + ", ".join(
                    f"{v} {k.replace('_', ' ')}" for k, v in kinds.items()), started))
            if step.run is None:
                study.set_user_attr("stop_reason", step.stop)
                break
            config = planner.configs[step.run["index"]]
            sampler.pending = config.to_dict()
            trial = study.ask(fixed_distributions=dists)
            sampler.pending = None
            predicted = step.run["predicted"]
            trial.set_user_attr("worker", _worker_identity())
            trial.set_user_attr("predicted", predicted)
            trial.set_user_attr("status", "running")
        if config_of(trial.params) != config:  # a trial someone enqueued by hand was popped instead
            config = config_of(trial.params)
        duplicate = _claimed_elsewhere(study, trial.number, config)
        if duplicate is not None:
            trial.set_user_attr("status", "pruned")
            trial.set_user_attr("reason_kind", "duplicate")
            trial.set_user_attr("reason", f"claimed at the same time by trial {duplicate} (another machine)")
            study.tell(trial, state=TrialState.PRUNED)
            continue
        emit(progress_of(study.get_trials(deepcopy=False),
                         f"trial {trial.number} {config.short()}: running (predicted {predicted['samples_per_s']:.3g} "
                         f"samples/s, limit {predicted['trial_timeout_s']:.0f} s)", started))
        try:
            with _Heartbeat(trial):
                result = run_trial(workload if workload.source is None else workload.source, config,
                                   device=device, budget_bytes=settings.budget_bytes, warmup_steps=WARMUP_STEPS,
                                   measure_steps=MEASURE_STEPS, timeout_s=predicted["trial_timeout_s"])
        except BaseException:
            try:
                trial.set_user_attr("status", "interrupted")
                study.tell(trial, state=TrialState.FAIL)
            finally:
                raise
        _tell(study, trial, config, result, predicted, settings.budget_bytes)
        emit(progress_of(study.get_trials(deepcopy=False), _describe(trial.number, config, result), started))
    emit(progress_of(study.get_trials(deepcopy=False), f"stopped: {step.stop}", started))
    return step.stop


def _claimed_elsewhere(study: optuna.Study, number: int, config: TrainConfig) -> int | None:
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING)):
        if t.number < number and config_of(t.params) == config:
            return t.number
    return None


def _tell(study: optuna.Study, trial: optuna.Trial, config: TrainConfig, result: TrialResult, predicted: dict,
          budget_bytes: int) -> None:
    measured = _measured(result)
    trial.set_user_attr("measured", measured)
    trial.set_user_attr("status", result.status.value)
    trial.set_user_attr("errors", {
        "peak": relative_error(predicted.get("peak_bytes"), result.peak_bytes),
        "calibrated_peak": relative_error(predicted.get("calibrated_peak_bytes"), result.peak_bytes),
        "step_time": relative_error(predicted.get("step_time_s"), result.step_time_s),
        "prior_step_time": relative_error(predicted.get("prior_step_time_s"), result.step_time_s),
    })
    if result.ok:
        over = float(result.peak_bytes - budget_bytes) if result.peak_bytes is not None else 0.0
        failed = 0.0
    else:
        # An oom went over the budget by definition; an error or timeout measured nothing.
        over = 1.0 if result.status is TrialStatus.OOM else 0.0
        failed = 1.0
    trial.set_constraint("peak_over_budget_bytes", over)
    trial.set_constraint("failed", failed)
    study.tell(trial, float(result.samples_per_s) if result.ok else 0.0)


# --- the search ---------------------------------------------------------------------------


def _resolve_space(space: SearchSpace | str | Path | dict | None, global_batch: int | None) -> SearchSpace:
    if isinstance(space, SearchSpace):
        resolved = space
    elif isinstance(space, dict):
        resolved = space_from_dict(dict(space), "<inline>")
    else:
        resolved = load_space(space)
    return resolved.with_global_batch(global_batch) if global_batch is not None else resolved


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _visible_gpus() -> list[str]:
    import torch

    count = torch.cuda.device_count()  # no CUDA context: trials run in children
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(count)]
    return ids[:count]


def search(workload: Workload | str, budget: str | int, *, space: SearchSpace | str | Path | dict | None = None,
           global_batch: int | None = None, trials: int | None = None, timeout_s: float | None = None,
           workers: int = 1, storage: str | None = None, study_name: str | None = None,
           out_dir: str | Path | None = None, device: str | None = None, devices: int | None = None, seed: int = 0,
           patience: int = PATIENCE, min_improvement: float = MIN_IMPROVEMENT,
           trial_timeout_s: float = TRIAL_TIMEOUT_S, progress: ProgressCallback | None = None,
           command: str | None = None):
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
      above it are estimated, never run. On the CPU, ``devices=N`` runs splits up to N as
      pipeline stage processes sharing the CPU.
    - ``progress``: called with a :class:`SearchProgress` after every step (the library never prints).

    Returns a :class:`autofit.report.SearchResult`; the tables ``trials.csv``, ``best.json`` and
    ``summary.md`` are written to ``out_dir``. Raises BudgetError, SpaceError, WorkloadError or
    StudyError for bad input (StudyError also when ``out_dir`` holds a study of another budget,
    workload, device or space); KeyboardInterrupt after marking running trials failed.
    """
    from autofit.report import search_result, write_reports  # the report reads what the search wrote

    started_wall = time.time()
    started = time.monotonic()
    budget_bytes = parse_budget(budget)
    budget_text = budget if isinstance(budget, str) else f"{budget}B"
    loaded = load_workload(workload)
    resolved = _resolve_space(space, global_batch)
    device = device or _default_device()
    if device not in ("cpu", "cuda"):
        raise StudyError(f"device {device!r}: expected cpu or cuda")
    if not isinstance(workers, int) or workers < 1:
        raise StudyError(f"workers must be a positive integer, got {workers!r}")
    if trials is not None and trials < 1:
        raise StudyError(f"trials must be a positive integer, got {trials!r}")
    if workers > 1 and loaded.source is None:
        raise StudyError("workers > 1 needs a workload that other processes can load: pass a --model spec or "
                         "autofit.load_workload('path/to/file.py:function')")
    gpu_slices: list[list[str]] = []
    if device == "cuda":
        gpus = _visible_gpus()
        if not gpus:
            raise StudyError("--device cuda: no CUDA GPU is visible to this PyTorch")
        per_worker = len(gpus) // workers
        if per_worker < 1:
            raise StudyError(f"{workers} workers need at least {workers} GPUs; {len(gpus)} are visible")
        gpu_slices = [gpus[w * per_worker:(w + 1) * per_worker] for w in range(workers)]
        devices = min(devices, per_worker) if devices else per_worker
    else:
        devices = devices or 1
    name = study_name or default_study_name(loaded.name, budget_bytes)
    out = Path(out_dir) if out_dir is not None else Path("results") / name
    settings = StudySettings(
        workload_name=loaded.name, workload_source=loaded.source, budget_bytes=budget_bytes, budget_text=budget_text,
        space=space_to_dict(resolved), device_type=device, devices=devices, study_name=name, out_dir=str(out),
        storage=storage, seed=seed, trials=trials,
        deadline=None if timeout_s is None else started_wall + timeout_s, patience=patience,
        min_improvement=min_improvement, trial_timeout_s=trial_timeout_s, command=command,
    )
    profile = profile_workload(loaded, list(resolved.precision), device_type=device)  # user errors surface here
    study = _create_or_load(settings)
    emit = progress or (lambda event: None)
    emit(progress_of(study.get_trials(deepcopy=False), f"study {name} in {out}", started))
    stop = None
    try:
        if workers == 1:
            rates = probe_rates(device)
            stop = run_worker(settings, loaded, profile=profile, rates=rates, progress=progress, started=started)
        else:
            stop = _run_workers(settings, workers, gpu_slices, study, emit, started)
    finally:
        _record_run(study, settings, started_wall, workers, stop)
        try:
            write_reports(study, out)
        except Exception:  # noqa: BLE001 -- never hide the search's own outcome behind a report error
            if stop is not None:
                raise
    result = search_result(study, out, wall_s=time.time() - started_wall)
    emit(progress_of(study.get_trials(deepcopy=False), f"done: {result.stop_reason}", started, done=True))
    return result


def _record_run(study: optuna.Study, settings: StudySettings, started_wall: float, workers: int,
                stop: str | None) -> None:
    """Append this invocation to the study's ``runs`` (wall time, workers, why it stopped)."""
    try:
        with _ClaimLock(Path(settings.out_dir)):
            runs = list(study.user_attrs.get("runs", []))
            runs.append({"started": started_wall, "wall_s": time.time() - started_wall, "workers": workers,
                         "host": socket.gethostname(), "stop_reason": stop or "interrupted",
                         "command": settings.command})
            study.set_user_attr("runs", runs)
    except Exception:  # noqa: BLE001 -- bookkeeping must not mask the search's outcome
        pass


# --- several local workers -------------------------------------------------------------------


def _worker_env(settings: StudySettings, workers: int, gpus: list[str]) -> dict:
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent)  # so the worker imports this autofit
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    if settings.device_type == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    elif "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))  # a fair share of the cores
    return env


def _run_workers(settings: StudySettings, workers: int, gpu_slices: list[list[str]], study: optuna.Study,
                 emit: ProgressCallback, started: float) -> str:
    """Start ``workers`` worker processes on the study, report progress from the storage, wait for them.

    Each worker's stderr goes to ``<out>/worker-<i>.log``; a worker that fails makes this raise
    StudyError with its last line (after the others finished).
    """
    out_dir = Path(settings.out_dir)
    procs, logs = [], []
    for w in range(workers):
        env = _worker_env(settings, workers, gpu_slices[w] if gpu_slices else [])
        log_path = out_dir / f"worker-{w}.log"
        logs.append(log_path)
        with open(log_path, "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-c", "from autofit.study import _worker_main; _worker_main()", settings.to_json(),
                 str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                start_new_session=True))  # a terminal's Ctrl-C reaches this process, which forwards it
    seen = None
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(1.0)
            trials = study.get_trials(deepcopy=False)
            snapshot = tuple((t.number, t.state) for t in trials)
            if snapshot != seen:
                seen = snapshot
                last = max((t for t in trials if t.state in (TrialState.COMPLETE, TrialState.RUNNING)
                            and config_of(t.params) is not None), key=lambda t: t.number, default=None)
                message = (f"{workers} workers" if last is None
                           else f"trial {last.number} {config_of(last.params).short()}: {trial_status(last)}")
                emit(progress_of(trials, message, started))
    except BaseException:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 15
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        raise
    errors = []
    for p, log_path in zip(procs, logs):
        if p.returncode != 0:
            lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
            errors.append(lines[-1] if lines else f"exited with status {p.returncode}")
    if errors:
        raise StudyError(f"a worker failed: {errors[0].removeprefix('autofit: error: ')} (see {logs[0].parent}/worker-*.log)")
    return study.user_attrs.get("stop_reason") or "workers finished"


def _die_with_parent(parent_pid: int) -> None:
    """In a worker: when the search process is gone, interrupt ourselves (the running trial is marked failed)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, name="autofit-parent-watch", daemon=True).start()


def _worker_main() -> None:
    """Entry point of a worker process: ``python -c '...; _worker_main()' SETTINGS_JSON PARENT_PID``."""
    settings = StudySettings.from_json(sys.argv[1])
    _die_with_parent(int(sys.argv[2]))
    try:
        workload = load_workload(settings.workload_source)
        run_worker(settings, workload)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except AutofitError as exc:
        sys.stderr.write(f"autofit: error: {exc}\n")
        raise SystemExit(2) from None
    raise SystemExit(0)

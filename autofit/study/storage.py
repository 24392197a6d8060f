"""Where a study lives: an Optuna storage (a journal file by default), its locks, and the record format.

A trial is stored as an Optuna trial: its params are the config fields (one categorical
each), its value the measured samples/s, its constraints the measured peak over the budget
and whether it failed. The rest is in user attrs, read and written only here:

- ``status``: a :class:`autofit.core.records.TrialStatus` value (``ok``, ``oom``, ``error``,
  ``timeout``, ``pruned``, ``running``, ``interrupted``);
- ``reason_kind`` (a :class:`autofit.core.records.PruneReason` value), ``reason``: why it was pruned;
- ``predicted``: the estimate and time model before it ran (raw and calibrated);
- ``measured``: the TrialResult's numbers; ``errors``: relative prediction errors;
- ``worker``: who ran it; ``heartbeat``: when its worker last wrote;
- ``sample``: which measurement of its config (1 the first, more a re-measurement; absent: 1).

:func:`record_of` turns a stored trial into a :class:`autofit.core.records.TrialRecord`, the only
form the planner and the report see. Journals written by autofit 0.1 read the same way.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.storages import JournalStorage
from optuna.trial import FrozenTrial, TrialState, create_trial

from autofit.core.config import FIELDS, TrainConfig
from autofit.core.errors import AutofitError, RunFailure, StudyError
from autofit.core.files import write_atomic
from autofit.core.objective import objective
from autofit.core.records import PruneReason, StudySnapshot, TrialRecord, TrialStatus
from autofit.core.space import SearchSpace
from autofit.profiling.data import PROFILE_VERSION
from autofit.study.locks import (
    JOURNAL_LOCK_NAME,
    FlockLock,
    JournalFile,
)
from autofit.study.settings import JOURNAL_NAME, StudySettings, redact

META_NAME = "study.json"
DB_SCHEMES = ("postgresql", "mysql", "sqlite")  # Optuna's RDB storage (SQLAlchemy URLs, +driver allowed)
CONNECT_TIMEOUT_S = 10     # an unreachable database is reported after this long, not a TCP timeout's minutes
log = logging.getLogger(__name__)


def check_storage_url(url: str | None) -> None:
    """Raise StudyError unless ``url`` is None or a database URL Optuna can open."""
    if url is None:
        return
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.split("+")[0].lower() not in DB_SCHEMES or not rest:
        raise StudyError(f"invalid --storage {redact(url)!r}: expected a database URL such as "
                         "postgresql://user:pass@host/db, mysql://user:pass@host/db or sqlite:///path.db "
                         "(default: a journal file in --out)")


def ensure_out_dir(out_dir: Path) -> None:
    """Create ``out_dir``; RunFailure when it cannot be (a file in the way, no permission)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".autofit-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise RunFailure(f"cannot write the output directory {out_dir} ({exc.strerror or type(exc).__name__}); "
                         "choose a writable directory with --out") from None


def repair_journal(journal: Path, lock: FlockLock) -> None:
    """Drop a last line cut off mid-write (a worker killed while appending), keeping the file as
    it was in ``<journal>.torn-<time>``. Under the journal's lock: no live writer is mid-line."""
    if not journal.is_file() or journal.stat().st_size == 0:
        return
    lock.acquire()
    try:
        with open(journal, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) == b"\n":
                return
            data = journal.read_bytes()
        keep = data.rfind(b"\n") + 1
        backup = journal.with_name(f"{journal.name}.torn-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.copy2(journal, backup)
        with open(journal, "r+b") as f:
            f.truncate(keep)
        log.warning("%s: dropped a torn last line (%d bytes cut off mid-write, e.g. by a killed worker); "
                    "the file as it was is kept as backup %s", journal, len(data) - keep, backup.name)
    finally:
        lock.release()


def make_storage(out_dir: Path, storage: str | None):
    """The study's storage: ``storage`` (an Optuna URL) or the journal file in ``out_dir``."""
    if storage:
        check_storage_url(storage)
        if storage.startswith("postgresql"):
            return _rdb_storage(storage, {"connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}})
        return storage
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = FlockLock(out_dir / JOURNAL_LOCK_NAME)
    repair_journal(out_dir / JOURNAL_NAME, lock)
    return JournalStorage(JournalFile(str(out_dir / JOURNAL_NAME), lock))


def _rdb_storage(url: str, engine_kwargs: dict, attempts: int = 5):
    """Optuna's RDB storage of ``url``. Machines that start at once on an empty database race to
    create Optuna's tables; the losers see "already exists" and try again (the tables are there now)."""
    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
        except Exception as exc:  # sqlalchemy's IntegrityError / ProgrammingError, by the driver's words
            if "already exists" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(0.5 * (attempt + 1))


def check_connection(url: str | None, study_name: str) -> None:
    """Open the database of ``url`` once (nothing for the journal): RunFailure when it cannot be,
    said before a search spends its time profiling."""
    if not url:
        return
    try:
        make_storage(Path("."), url)
    except AutofitError:
        raise
    except Exception as exc:  # a database driver's own errors (connection refused, bad password...)
        raise storage_failure(f"study {study_name!r}", url, exc) from None


def storage_failure(where: str, url: str | None, exc: BaseException) -> RunFailure:
    """A storage that could not be opened, as one line without the URL's password."""
    text = " ".join(str(exc).split("(Background on this error")[0].split())
    if url:
        password = url.partition("://")[2].rpartition("@")[0].partition(":")[2]
        text = redact(text.replace(url, redact(url)))
        if password:
            text = text.replace(password, "***")
    if isinstance(exc, ImportError):
        text += " (pip install 'psycopg[binary]' for postgresql://)"
    return RunFailure(f"{where}: cannot open {redact(url) or 'the journal'} ({type(exc).__name__}: {text})")


def quiet_optuna() -> None:
    """Optuna logs every trial at INFO on stderr; the library never prints (the CLI reports progress)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def open_study(out_dir: str | Path, storage: str | None = None, study_name: str | None = None) -> optuna.Study:
    """Load an existing study from its output directory (``study.json``) for reading.

    ``storage`` overrides the URL recorded there (which is stored without its password).
    Raises StudyError when the directory holds no study or the storage cannot be read.
    """
    out_dir = Path(out_dir)
    _check_study_dir(out_dir, storage)
    meta_path = out_dir / META_NAME
    meta = {}
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except ValueError:
            raise StudyError(f"{meta_path}: not valid JSON (autofit search writes it; remove it to read "
                             f"{JOURNAL_NAME} alone)") from None
    elif not (out_dir / JOURNAL_NAME).is_file() and storage is None:
        raise StudyError(f"{out_dir}: no study here (no {META_NAME} or {JOURNAL_NAME}); run `autofit search --out {out_dir}`")
    url = storage or meta.get("storage")
    if url and "***" in url:
        raise StudyError(f"{out_dir}: the study is in {url}; pass the storage URL with its password (--storage)")
    name = study_name or meta.get("study_name")
    where = redact(url) or out_dir / JOURNAL_NAME
    if not url and not (out_dir / JOURNAL_NAME).is_file():  # else opening it would create an empty one
        raise StudyError(f"{where}: missing, though {meta_path.name} names study {name!r}; the trials are "
                         "stored in that file (copy it back, or pass --storage if they are in a database)")
    quiet_optuna()
    try:
        backend = make_storage(out_dir, url)
        names = optuna.get_all_study_names(storage=backend)
        if name is None and len(names) != 1:
            raise StudyError(f"{out_dir}: {len(names)} studies in the storage; name one (--study)" if names else
                             f"{where}: holds no study (empty, cut short, or not an Optuna journal)")
        if name is not None and name not in names:
            raise StudyError(f"{where}: holds no study {name!r} (" + (f"it holds {', '.join(map(repr, names))}; "
                             "name one with --study)" if names else "empty, cut short, or not an Optuna journal)"))
        return optuna.load_study(study_name=name or names[0], storage=backend)
    except StudyError:
        raise
    except Exception as exc:  # bad files, a database driver's own errors (connection refused, ...)
        raise storage_failure(f"{out_dir}: study {name!r}", url, exc) from None


def _check_study_dir(out_dir: Path, storage: str | None) -> None:
    """StudyError for a path that cannot be a study's directory: missing, or a file (a study's own
    study.json, study.journal or trials.csv passed instead of the directory that holds them)."""
    if out_dir.is_dir() or (storage is not None and not out_dir.exists()):
        return
    if not out_dir.exists():
        raise StudyError(f"{out_dir}: no such directory; pass a study's output directory (autofit search --out)")
    if (out_dir.parent / META_NAME).is_file() or (out_dir.parent / JOURNAL_NAME).is_file():
        raise StudyError(f"{out_dir} is a file; pass the study's directory that holds it: {out_dir.parent}")
    raise StudyError(f"{out_dir} is a file, not a study's output directory (autofit search --out)")


def _identity(settings: StudySettings) -> dict:
    configs = sorted(c.short() for c in settings.search_space().configs())
    return {"workload": settings.workload_name, "budget_bytes": settings.budget_bytes,
            "device_type": settings.device_type,
            "space": hashlib.sha256("\n".join(configs).encode()).hexdigest()[:16]}


def create_or_load(settings: StudySettings) -> optuna.Study:
    """Create the study of ``settings`` (or open it to resume). Raises StudyError when the
    storage cannot be opened or holds a study of another workload, budget, device or space."""
    out_dir = Path(settings.out_dir)
    ensure_out_dir(out_dir)
    quiet_optuna()
    try:
        storage = make_storage(out_dir, settings.storage)
        study = optuna.create_study(storage=storage, study_name=settings.study_name, direction="maximize",
                                    load_if_exists=True)
    except AutofitError:
        raise
    except Exception as exc:
        raise storage_failure(f"study {settings.study_name!r}", settings.storage, exc) from None
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
    write_atomic(out_dir / META_NAME, json.dumps(meta, indent=2) + "\n")
    return study


def record_profile(study: optuna.Study, key: str) -> None:
    """Store the key of the profile this search estimates with, so that a report of the study reads
    it from the cache (:func:`autofit.profiling.cache.study_profile`) instead of keying the workload
    again: a fake build whose import of torch._dynamo alone costs a fresh process seconds."""
    stored = {"key": key, "version": PROFILE_VERSION}
    if study.user_attrs.get("profile") != stored:  # a resumed search adds nothing to the journal
        study.set_user_attr("profile", stored)


def _versions() -> dict:
    import platform

    import torch

    from autofit.core.version import __version__

    return {"autofit": __version__, "torch": torch.__version__, "optuna": optuna.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "host": socket.gethostname(),
            "cpu_count": os.cpu_count(),
            "env": _trial_env()}


def _trial_env() -> dict[str, str]:
    """The variables that change a trial's speed, as its process has them."""
    from autofit.runtime.procs import child_env

    env = child_env()
    return {k: env[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "CUDA_VISIBLE_DEVICES") if k in env}


def distributions(space: SearchSpace) -> dict[str, CategoricalDistribution]:
    """One categorical per config field, over the values the space's configs take."""
    configs = space.configs()
    out = {}
    for name in FIELDS:
        values = list(dict.fromkeys(getattr(c, name) for c in configs))
        if isinstance(values[0], enum.Enum):
            out[name] = CategoricalDistribution([v.value for v in values])
        else:
            out[name] = CategoricalDistribution(sorted(values))
    return out


# Config fields added after studies were first stored: a stored trial without them is still a config.
_LATER_FIELDS = {"split_mode", "optimizer", "checkpoint_policy", "offload"}


def config_of(params: dict) -> TrainConfig | None:
    """The TrainConfig of a trial's params (None when they are not a config)."""
    missing = [f for f in FIELDS if f not in params]
    if not set(missing) <= _LATER_FIELDS:  # not a config (a trial someone added by hand)
        return None
    try:
        # params from before a later field existed lack it: TrainConfig's default applies (pipeline,
        # the workload's own optimizer, full checkpointing)
        return TrainConfig.from_dict({f: params[f] for f in FIELDS if f in params})
    except (KeyError, AutofitError):
        return None


# --- reading records --------------------------------------------------------------------------


def _status(trial: FrozenTrial) -> TrialStatus:
    if trial.state == TrialState.COMPLETE:
        try:
            status = TrialStatus(trial.user_attrs.get("status", "ok"))
        except ValueError:
            return TrialStatus.ERROR
        return status if status.ran else TrialStatus.ERROR
    if trial.state == TrialState.PRUNED:
        return TrialStatus.PRUNED
    if trial.state in (TrialState.RUNNING, TrialState.WAITING):
        return TrialStatus.RUNNING
    return TrialStatus.INTERRUPTED  # FAIL: its worker died or was stopped


def record_of(trial: FrozenTrial) -> TrialRecord | None:
    """The record of a stored trial (None when its params are not a config)."""
    config = config_of(trial.params)
    if config is None:
        return None
    attrs = trial.user_attrs
    status = _status(trial)
    prune_reason = None
    if status is TrialStatus.PRUNED and attrs.get("reason_kind"):
        try:
            prune_reason = PruneReason(attrs["reason_kind"])
        except ValueError:  # a reason a newer autofit wrote: its text still says why
            pass
    return TrialRecord(
        number=trial.number, config=config, status=status, prediction=attrs.get("predicted") or {},
        measurement=attrs.get("measured") or {}, errors=attrs.get("errors") or {}, prune_reason=prune_reason,
        reason=attrs.get("reason") if status is TrialStatus.PRUNED else None, value=trial.value,
        constraints=trial.constraints, started=trial.datetime_start, finished=trial.datetime_complete,
        worker=attrs.get("worker") or {}, heartbeat=attrs.get("heartbeat"), sample=int(attrs.get("sample") or 1))


def read_records(study: optuna.Study) -> list[TrialRecord]:
    """Every trial of ``study`` whose params are a config, as records, in trial order."""
    return _records_of(study.get_trials(deepcopy=False))


def _records_of(trials: list[FrozenTrial]) -> list[TrialRecord]:
    return [r for r in map(record_of, trials) if r is not None]


# A claim is written in steps (Optuna's trial, then each param, then the worker's signature), and another
# machine can read the study between them: an earlier claim not yet a config is not yet a record. Reading
# waits this long at most for the claims before a trial to be complete (one is left half-written only by a
# worker that died in between, and fail_stale_trials closes it later).
CLAIM_SETTLE_S = 5.0


def settled_records(study: optuna.Study, before: int, wait_s: float = CLAIM_SETTLE_S) -> list[TrialRecord]:
    """:func:`read_records`, once every trial numbered below ``before`` that is still running carries its
    claim's signature (:func:`sign_claim`'s last attribute), or after ``wait_s``: a worker that checks
    whether another machine took the same measurement first must see that machine's earlier claim whole."""
    deadline = time.monotonic() + wait_s
    while True:
        trials = study.get_trials(deepcopy=False)
        pending = [t for t in trials if t.number < before and t.state == TrialState.RUNNING
                   and "status" not in t.user_attrs]
        if not pending or time.monotonic() > deadline:
            return _records_of(trials)
        time.sleep(0.02)


def snapshot(study: optuna.Study) -> StudySnapshot:
    """The study as the report reads it (records, settings, runs, stop reason, versions, rates)."""
    attrs = study.user_attrs
    return StudySnapshot(study_name=study.study_name, records=read_records(study), settings=attrs.get("settings") or {},
                         runs=attrs.get("runs") or (), stop_reason=attrs.get("stop_reason"),
                         versions=attrs.get("versions") or {}, device_rates=attrs.get("device_rates"),
                         profile=attrs.get("profile"))


def load_snapshot(out_dir: str | Path, storage: str | None = None, study_name: str | None = None) -> StudySnapshot:
    """:func:`open_study` then :func:`snapshot`. Raises StudyError as :func:`open_study` does."""
    return snapshot(open_study(out_dir, storage, study_name))


# --- writing records ----------------------------------------------------------------------------


def add_pruned(study: optuna.Study, config: TrainConfig, dists: dict, reason: PruneReason, text: str,
               prediction: dict) -> None:
    """Record ``config`` as pruned by the estimate (a PRUNED trial holding the predicted breakdown)."""
    study.add_trial(create_trial(
        state=TrialState.PRUNED, params=config.to_dict(), distributions=dists,
        user_attrs={"status": TrialStatus.PRUNED.value, "reason_kind": reason.value, "reason": text,
                    "predicted": prediction}))


def sign_claim(trial: optuna.Trial, worker: dict, prediction: dict, sample: int = 1) -> None:
    """Mark a freshly asked trial as this worker's, with what it is predicted to do and which
    measurement of its config it is (``sample``: 1 the first, more a re-measurement). ``status`` is
    written last: :func:`settled_records` reads a claim as whole once it is there."""
    trial.set_user_attr("worker", worker)
    trial.set_user_attr("predicted", prediction)
    trial.set_user_attr("sample", sample)
    trial.set_user_attr("status", TrialStatus.RUNNING.value)


def prune_claimed(study: optuna.Study, trial: optuna.Trial, reason: PruneReason, text: str) -> None:
    """Close a claimed trial as pruned (e.g. another machine claimed the same config at once)."""
    trial.set_user_attr("status", TrialStatus.PRUNED.value)
    trial.set_user_attr("reason_kind", reason.value)
    trial.set_user_attr("reason", text)
    study.tell(trial, state=TrialState.PRUNED)


def mark_interrupted(study: optuna.Study, trial: optuna.Trial | int) -> None:
    """Close a running trial as interrupted (FAIL): its config is planned again."""
    if isinstance(trial, optuna.Trial):
        trial.set_user_attr("status", TrialStatus.INTERRUPTED.value)
    study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)


def heartbeat(trial: optuna.Trial, now: float) -> None:
    trial.set_user_attr("heartbeat", now)


def tell_result(study: optuna.Study, trial: optuna.Trial, result, prediction: dict, measured: dict, errors: dict,
                budget_bytes: int, devices: int = 1) -> None:
    """Record a finished real trial: its measurements, status, errors, constraints and value
    (:func:`autofit.core.objective.objective`: job samples/s on ``devices`` devices).

    The constraints make a trial that went over the budget, or failed, never the best: an oom
    went over by definition; an error or timeout measured nothing.
    """
    trial.set_user_attr("measured", measured)
    trial.set_user_attr("status", TrialStatus(result.status).value)
    trial.set_user_attr("errors", errors)
    if result.ok:
        peak = result.judged_peak_bytes
        over = float(peak - budget_bytes) if peak is not None else 0.0
        failed = 0.0
    else:
        over = 1.0 if TrialStatus(result.status) is TrialStatus.OOM else 0.0
        failed = 1.0
    trial.set_constraint("peak_over_budget_bytes", over)
    trial.set_constraint("failed", failed)
    study.tell(trial, float(objective(result.config, result.samples_per_s, devices)) if result.ok else 0.0)

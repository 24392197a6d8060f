"""The locks of a study directory (``flock``: released by the kernel when a process dies, so ``kill -9``
never leaves a stale lock) and the journal file whose failed write is cut back to its last whole record."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from optuna.storages.journal import JournalFileBackend

from autofit.core.errors import RunFailure

CLAIM_LOCK_NAME = ".autofit-claim.lock"
JOURNAL_LOCK_NAME = ".autofit-journal.lock"
SEARCH_LOCK_NAME = ".autofit-search.lock"


class FlockLock:
    """The journal's lock as an ``flock``: the kernel releases it when its holder dies.

    Optuna's journal calls only ``acquire`` and ``release`` on its lock (the interface of its
    ``BaseJournalFileLock``, which is not public)."""

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


class JournalFile(JournalFileBackend):
    """Optuna's journal file, whose appends never leave part of a record behind: a write that fails
    (a full disk, a quota, a file-size limit) is cut back to the last whole record, under the
    journal's lock, and raised as one line (RunFailure): the study stays as it was before that
    record, and running the same search again resumes it."""

    def __init__(self, path: str, lock: FlockLock) -> None:
        super().__init__(path, lock_obj=lock)
        self._journal_path, self._journal_lock = path, lock

    def append_logs(self, logs: list[dict]) -> None:
        data = ("\n".join(json.dumps(log, separators=(",", ":")) for log in logs) + "\n").encode()
        self._journal_lock.acquire()
        try:
            fd = os.open(self._journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                size = os.fstat(fd).st_size
                try:
                    view = memoryview(data)
                    while view:  # a write may stop short at the limit; the next one fails
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                except OSError as exc:
                    try:
                        os.ftruncate(fd, size)  # shrinking needs no room
                    except OSError:
                        pass  # the next start drops the torn line (repair_journal)
                    raise RunFailure(f"cannot write the study's journal {self._journal_path} ({exc.strerror or exc}); "
                                     "it holds every record before this one: make room, then run the same search "
                                     "again to resume") from None
            finally:
                os.close(fd)
        finally:
            self._journal_lock.release()


class ClaimLock:
    """Held around a planning step and its ask: local workers never pick the same config."""

    def __init__(self, out_dir: Path) -> None:
        self._path = Path(out_dir) / CLAIM_LOCK_NAME

    def __enter__(self) -> "ClaimLock":
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


class SearchLock:
    """Held by the first search on an output directory for its whole run. A second ``autofit
    search`` there joins the study (``joined``): the claim lock gives each config to one worker,
    and the device locks (:mod:`autofit.runtime.devicelock`) keep their trials from running side by side."""

    def __init__(self, out_dir: Path) -> None:
        self._path = Path(out_dir) / SEARCH_LOCK_NAME
        self.joined = False
        self._fd: int | None = None

    def __enter__(self) -> "SearchLock":
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self.joined = True
            return self
        self._fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


"""One trial per device at a time, across processes: an ``flock`` per device, machine-wide.

Two trials on one device measure each other: on the CPU they share the cores (a bf16 trial
read 8.8 samples/s beside another instead of about 130), on a GPU they also share its memory,
so neither budget holds. So whoever runs a trial -- a search's workers, two searches on one
machine (in one directory or two), ``autofit measure``, the bench -- holds its devices' locks
for the trial's whole run (:func:`autofit.trial.run.run_trial` does), and waits while another
holds one. The wait is recorded with the trial (``wait_s``) and shown in the tables.

The locks are files in one directory for the whole machine, ``$AUTOFIT_LOCK_DIR`` or else
``/tmp/autofit-locks`` (sticky and writable by all, like ``/tmp``, so two users' searches see
each other); when that directory cannot be used, a per-user one (``~/.cache/autofit/locks``),
with a warning. ``flock`` is released by the kernel when its holder dies: ``kill -9`` never
leaves a stale lock. Devices are named ``cpu`` (one lock: a CPU split's stage processes share
the cores) and ``cuda-<id>`` for a physical GPU, ``<id>`` as ``CUDA_VISIBLE_DEVICES`` names it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import threading
import time
from pathlib import Path

LOCK_DIR_ENV = "AUTOFIT_LOCK_DIR"
SHARED_LOCK_DIR = Path("/tmp/autofit-locks")
USER_LOCK_DIR = Path.home() / ".cache" / "autofit" / "locks"
log = logging.getLogger(__name__)
_held = threading.local()  # names this thread holds: taking one again would wait on ourselves


def visible_gpus() -> list[str]:
    """The ids of the GPUs this process may use: ``CUDA_VISIBLE_DEVICES``, else ``0..count-1``
    (``torch.cuda.device_count`` creates no CUDA context)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [v.strip() for v in visible.split(",") if v.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def device_names(device: str, count: int = 1) -> list[str]:
    """Lock names of the ``count`` devices a trial on ``device`` (``cpu``, ``cuda``, ``cuda:N``) uses:
    ``["cpu"]``, or the physical GPUs from the N-th visible one on (ranks and stages use ``cuda:N+i``)."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return ["cpu"]
    first = int(index or 0)
    ids = visible_gpus()[first:first + count]
    ids += [str(first + i) for i in range(len(ids), count)]  # more than are visible: the trial will fail anyway
    return [f"cuda-{re.sub(r'[^A-Za-z0-9_.-]', '_', gpu)}" for gpu in ids]


def _usable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        if path == SHARED_LOCK_DIR and path.stat().st_uid == os.getuid():
            os.chmod(path, 0o1777)  # every user's trials lock here; sticky: none deletes another's files
        return os.access(path, os.W_OK | os.X_OK)
    except OSError:
        return False


def lock_dir() -> Path:
    """Where the device locks live (see the module's docstring)."""
    chosen = os.environ.get(LOCK_DIR_ENV)
    if chosen:
        Path(chosen).mkdir(parents=True, exist_ok=True)
        return Path(chosen)
    if _usable(SHARED_LOCK_DIR):
        return SHARED_LOCK_DIR
    log.warning("cannot use %s for device locks; using %s, which only this user's trials see",
                SHARED_LOCK_DIR, USER_LOCK_DIR)
    USER_LOCK_DIR.mkdir(parents=True, exist_ok=True)
    return USER_LOCK_DIR


def _open(path: Path) -> int:
    """The lock file, never through a link (another user could plant one in a shared directory)."""
    flags = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, os.O_RDWR | flags, 0o666)
    except PermissionError:  # another user's file: flock needs only a read-only descriptor
        return os.open(path, os.O_RDONLY | flags)
    try:
        os.fchmod(fd, 0o666)  # ours: other users may write their holder line too
    except OSError:
        pass
    return fd


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "?"
    except OSError:
        return "?"


class DeviceLock:
    """``with DeviceLock(device_names("cuda", 2), "trial ..."):`` holds those devices, waiting while
    another process holds one. ``wait_s``: how long it waited; ``waited_for``: who held the
    first busy device (their holder line, e.g. ``pid 123: trial fp32 mb4``), else None.

    Locks are taken in sorted order, so two holders of overlapping sets never deadlock; a
    device this thread already holds is not taken again (a trial inside a held block). Other
    threads wait as other processes do. KeyboardInterrupt while waiting releases what was
    taken and propagates.
    """

    def __init__(self, names: list[str], what: str = "trial") -> None:
        self.names = sorted(set(names))
        self.what = what
        self.wait_s = 0.0
        self.waited_for: str | None = None
        self._fds: list[int] = []

    def __enter__(self) -> "DeviceLock":
        start = time.monotonic()
        directory = lock_dir()
        held = _held.__dict__.setdefault("names", set())
        self._taken = [name for name in self.names if name not in held]
        try:
            for name in self._taken:
                fd = _open(directory / f"{name}.lock")
                self._fds.append(fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    self.waited_for = self.waited_for or f"{name}: {_holder(fd)}"
                    fcntl.flock(fd, fcntl.LOCK_EX)
                self._write_holder(fd)
        except BaseException:
            self._release()
            raise
        held.update(self._taken)
        self.wait_s = time.monotonic() - start
        return self

    def _write_holder(self, fd: int) -> None:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}: {self.what}\n".encode(), 0)
        except OSError:
            pass  # a read-only descriptor (another user's file): the lock holds all the same

    def _release(self) -> None:
        fds, self._fds = self._fds, []
        for fd in reversed(fds):
            os.close(fd)  # closing the last descriptor releases the flock

    def __exit__(self, *exc) -> None:
        _held.names.difference_update(self._taken)
        self._release()

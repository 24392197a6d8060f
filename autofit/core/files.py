"""Files written so that a reader never sees half of one, and the temporary files a killed write leaves."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from pathlib import Path

from autofit.core.procstat import GONE_STATES, stat_fields

# ``.NAME.tmpPID@HOST``: write_atomic's temporary sibling of NAME (``.NAME.tmpPID`` before hosts were named).
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp(?P<pid>\d+)(?:@(?P<host>[A-Za-z0-9._-]+))?$")
STALE_TEMP_S = 3600.0      # a temporary file this old is a killed write's, whoever wrote it (a write takes seconds)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()) or "localhost"


def temp_path(path: Path) -> Path:
    """The temporary sibling :func:`write_atomic` writes ``path`` through: ``.NAME.tmpPID@HOST``."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}@{_host()}")


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` (text or bytes) to ``path`` through a temporary sibling and a rename (atomic on
    POSIX): a reader, or a process killed mid-write, sees the old file or the new one, never half.
    A failed write (a full disk) removes its temporary file and raises the OSError; one killed
    mid-write leaves it, for :func:`remove_stale_temp_files` to remove."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie, killed and not reaped yet, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    fields = stat_fields(pid)
    return not fields or fields[0] not in GONE_STATES  # no /proc: it answered the signal


def stale_temp_files(directory: Path, now: float | None = None) -> list[Path]:
    """:func:`write_atomic`'s temporary files in ``directory`` whose writer is gone: written on this
    host by a process that no longer runs, or older than STALE_TEMP_S (from any host). A live
    writer's (a concurrent search, report or worker) and other programs' files are never listed."""
    now = time.time() if now is None else now
    stale = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return []
    for path in entries:
        match = _TEMP_RE.match(path.name)
        if not match or not path.is_file() or path.is_symlink():
            continue
        try:
            age = now - path.stat().st_mtime
        except OSError:
            continue  # renamed or removed by its writer meanwhile
        host = match.group("host")
        local = host is None or host == _host()
        if age > STALE_TEMP_S or (local and not _alive(int(match.group("pid")))):
            stale.append(path)
    return sorted(stale)


def remove_stale_temp_files(directory: Path) -> list[str]:
    """Remove :func:`stale_temp_files` of ``directory``; the names of those removed."""
    removed = []
    for path in stale_temp_files(directory):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path.name)
    return removed

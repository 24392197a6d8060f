"""Files written so that a reader never sees half of one."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` (text or bytes) to ``path`` through a temporary sibling and a rename (atomic on
    POSIX): a reader, or a process killed mid-write, sees the old file or the new one, never half.
    A failed write (a full disk) removes its temporary file and raises the OSError."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
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

"""One reader of Linux's ``/proc/PID/stat``, for the places that ask whether a process runs.

The command name (field 2) is in parentheses and may hold spaces or parentheses itself, so the
fields are read after its last ``)``: field 3 (the state) comes first.
"""

from __future__ import annotations

GONE_STATES = (b"Z", b"X")  # a zombie (exited, not reaped yet) or dead: it runs nothing


def stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` from field 3 (the state) on; None when there is no such
    process or no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:].split()

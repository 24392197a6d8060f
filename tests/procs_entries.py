"""Child entry points for tests/runtime/test_procs.py, run as ``procs_entries:NAME`` (tests/ on PYTHONPATH)."""

from __future__ import annotations

import ctypes
import os
import sys
import time

from autofit.runtime import procs


def echo(request: dict, send) -> dict:
    print("a print that must not reach the messages")  # stdout goes to the captured stderr
    for i in range(request.get("extra", 0)):
        send({"index": i})
    return {"echo": request["value"], "pid": os.getpid()}


def raising(request: dict, send) -> None:
    raise RuntimeError("first line\nthe last line of the message")


def segfault(request: dict, send) -> None:
    ctypes.string_at(0)


def garbage(request: dict, send) -> None:
    os.write(int(sys.argv[2]), b"not json\n")


def hang_with_grandchild(request: dict, send) -> None:
    """Start a grandchild in our group that hangs too, say its pid, and hang."""
    grandchild = procs.spawn("procs_entries:hang", {}, new_group=False, env=dict(os.environ))
    send({"grandchild": grandchild.pid})
    time.sleep(600)


def hang(request: dict, send) -> None:
    time.sleep(600)


def torch_threads(request: dict, send) -> dict:
    """Run an operator on every intra-op thread: in a child forked from a process whose OpenMP pool
    already ran, this would hang (the fork server's zygote must never have run one)."""
    import torch

    x = torch.randn(256, 256)
    torch.mm(x, x)
    return {"threads": torch.get_num_threads(), "cwd": os.getcwd(), "marker": os.environ.get("AUTOFIT_TEST_MARKER"),
            "pgid_is_pid": os.getpgid(0) == os.getpid(), "tasks": len(os.listdir("/proc/self/task"))}


def loaded(request: dict, send) -> dict:
    """Which of ``request["modules"]`` this process has imported (a forked trial: its zygote's)."""
    return {"loaded": [m for m in request["modules"] if m in sys.modules]}

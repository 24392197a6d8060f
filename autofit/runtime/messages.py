"""JSON messages between a child of :mod:`autofit.runtime.procs` and its parent, both ends.

The child (:func:`serve`, :func:`child_main` in a spawned interpreter) runs its entry point
``function(request, send)`` and sends JSON objects, one a line, on a pipe of their own; the parent
decodes them (:class:`MessageReader`). Nothing read back is unpickled.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import json
import os
import sys
import threading
import traceback
from collections.abc import Callable

from autofit.core.records import TrialStatus
from autofit.runtime.reaping import die_with_parent

MAX_MESSAGE_BYTES = 64 << 20  # results are small (a profile: ~100 KB); more than this is not a result

Send = Callable[[dict], None]


def result_status(message: dict | None, missing: TrialStatus = TrialStatus.ERROR) -> TrialStatus:
    """The ``status`` of a child's result message as the enum (between processes it is the string
    value): ``missing`` when there is no message or it says none, ``error`` for a value that is no status."""
    value = message.get("status") if message else None
    if not value:
        return missing
    try:
        return TrialStatus(value)
    except ValueError:
        return TrialStatus.ERROR


class MessageReader:
    """The parent's end of a message pipe: bytes in, decoded messages out.

    ``messages`` holds the decoded messages not yet taken, oldest first; ``error`` says what was
    sent that is not a message (not a JSON object, too long, or cut short).
    """

    def __init__(self) -> None:
        self.messages: collections.deque[dict] = collections.deque()
        self.error: str | None = None
        self._partial = bytearray()

    def feed(self, data: bytes) -> None:
        """Decode every whole line ``data`` completes."""
        self._partial.extend(data)
        while (end := self._partial.find(b"\n")) >= 0:
            line = bytes(self._partial[:end])
            del self._partial[:end + 1]
            self._decode(line)
        if len(self._partial) > MAX_MESSAGE_BYTES:
            self.error = f"a message over {MAX_MESSAGE_BYTES} bytes"
            self._partial.clear()

    def close(self) -> None:
        """The pipe is closed; idempotent."""
        if self._partial:  # a last line without its newline: the child died while writing it
            self.error = self.error or "a truncated message"
            self._partial.clear()

    def _decode(self, line: bytes) -> None:
        if len(line) > MAX_MESSAGE_BYTES:
            self.error = f"a message over {MAX_MESSAGE_BYTES} bytes"
            return
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if isinstance(message, dict):
            self.messages.append(message)
        else:
            self.error = "a message that is not a JSON object"


# --- the child side --------------------------------------------------------------------------


def child_main() -> None:
    """Entry point of a spawned child: ``python -c '...; child_main()' ENTRY MESSAGE_FD PARENT_PID``, the request on stdin."""
    entry, fd, parent_pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    request = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)  # stdin is spent: a workload reading it gets EOF, as before
    os.dup2(devnull, 0)
    os.close(devnull)
    module_name, _, name = entry.partition(":")

    def call(request: dict, send: Send) -> dict | None:
        return getattr(importlib.import_module(module_name), name)(request, send)

    serve(call, request, fd, parent_pid)


def serve(function: Callable[[dict, Send], dict | None], request: dict, fd: int, parent_pid: int) -> None:
    """In a child: die with ``parent_pid``, run ``function(request, send)`` sending JSON lines on ``fd``,
    and exit (never returns): status 0, an exit code, or 1 after printing an exception's traceback."""
    die_with_parent(parent_pid)
    lock = threading.Lock()

    def send(message: dict) -> None:
        data = (json.dumps(message) + "\n").encode()  # raises for what is not JSON
        with lock:
            while data:
                data = data[os.write(fd, data):]

    status = 0
    try:
        last = function(request, send)
        if last is not None:
            send(last)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            sys.stderr.write(exc.code + "\n")
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        status = 130
    except BaseException:  # noqa: BLE001 -- the parent reads the last line of the traceback
        traceback.print_exc()
        status = 1
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(status)  # skip interpreter teardown (and a forked parent's atexit handlers)

"""A probe child's failure, said: one line for the user, the traceback for ``--debug``.

A probe (the device rates, the links, the layer timing) runs in a child process and, when it
fails, leaves the prior as it was or stops the search. Either way the user is told why in one
line -- the exception's type and the first line of its message, e.g. ``RuntimeError: Tensor.item()
cannot be called on meta tensors`` -- and the child's formatted traceback travels back in its
reply (:func:`error_reply`) and is logged at DEBUG (logger ``autofit.probes``), which ``autofit
--debug`` prints. A child that died without a reply (a crash, the wall-clock limit) is said by
:meth:`autofit.runtime.procs.Child.failure`, its captured output logged at DEBUG instead.
"""

from __future__ import annotations

import logging
import traceback

log = logging.getLogger("autofit.probes")


def one_line(exc: BaseException) -> str:
    """``"Type: first line of the message"`` (the type alone for an empty message)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def error_reply(exc: BaseException) -> dict:
    """A child's reply for ``exc`` (call it in the ``except`` block): status, one line, formatted traceback."""
    return {"status": "error", "error": one_line(exc),
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}


def reply_failure(reply: dict | None, what: str) -> str | None:
    """The one-line cause in an error ``reply`` (its traceback logged at DEBUG), or None for any other reply."""
    if not reply or reply.get("status") != "error":
        return None
    log.debug("%s failed; the child's traceback:\n%s", what, (reply.get("traceback") or "(none sent)").rstrip())
    return reply.get("error") or "failed without a message"


def child_failure(child, finished: bool, what: str) -> str:
    """Why ``child`` (an :class:`autofit.runtime.procs.Child`) gave no usable reply, in one line: its error
    reply's cause, else how it ended; what it sent or printed is logged at DEBUG."""
    said = reply_failure(child.last_message(), what)
    if said is not None:
        return said
    tail = child.stderr_tail().strip()
    if tail:
        log.debug("%s failed; the child's last output:\n%s", what, tail)
    return child.failure(finished)

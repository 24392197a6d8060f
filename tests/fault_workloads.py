"""A workload that misbehaves on purpose in some trials: the fault-injection tests' (``tests/study/test_faults.py``).

``faulty()`` is the search tests' tiny language model, except that ``batch(n)`` misbehaves for
the micro-batches named in ``AUTOFIT_TEST_FAULTS`` (``"7:segfault,6:hang"``), read when it is
called, so a test sets it in the environment the trial inherits:

- ``segfault``: the process kills itself with SIGSEGV;
- ``hang``: sleeps for ten minutes (it appends its pid to ``AUTOFIT_TEST_PIDFILE`` first);
- ``hang-once``: as ``hang`` unless ``AUTOFIT_TEST_PIDFILE`` already names a process (a trial run
  again after its worker was killed goes on);
- ``hog``: asks for :data:`HOG_BYTES` without touching them, which only a memory limit refuses;
- ``flood``: writes :data:`FLOOD_BYTES` to its stdout, then behaves.

autofit's own probes build real batches of 2, 4 and 8 samples (the profiler's real steps, the layer
probe): fault those and a probe fails instead.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

import torch

from autofit.workloads.base import Workload

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by path in a trial: find its sibling
from trial_workloads import tiny_lm, tiny_lm_batch  # noqa: E402

FAULTS_ENV = "AUTOFIT_TEST_FAULTS"
HOG_BYTES = 12 << 30     # untouched: harmless without a limit (on a machine with the address space)
FLOOD_CHUNK = ("flood " * 170 + "\n").encode() * 64  # about 64 KiB
FLOOD_BYTES = 64 * len(FLOOD_CHUNK)  # about 4 MiB, written whole


def faults() -> dict[int, str]:
    """``{micro_batch: fault}`` from the environment."""
    text = os.environ.get(FAULTS_ENV, "")
    return {int(k): v for k, v in (item.split(":") for item in text.split(",") if item)}


def _misbehave(fault: str | None) -> None:
    if fault == "segfault":
        faulthandler.disable()  # a forked copy of pytest would print its traceback to the terminal
        os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(60)
    elif fault == "hang-once":
        path = os.environ.get("AUTOFIT_TEST_PIDFILE")
        if not (path and os.path.exists(path) and open(path).read().strip()):
            _misbehave("hang")
    elif fault == "hang":
        path = os.environ.get("AUTOFIT_TEST_PIDFILE")
        if path:
            with open(path, "a") as f:
                f.write(f"{os.getpid()}\n")
        time.sleep(600)
    elif fault == "hog":
        torch.empty(HOG_BYTES, dtype=torch.uint8)
    elif fault == "flood":  # on the file descriptor, as a library's C code would (and past any sys.stdout)
        for _ in range(FLOOD_BYTES // len(FLOOD_CHUNK)):
            os.write(1, FLOOD_CHUNK)


def faulty_batch(n: int):
    _misbehave(faults().get(n))
    return tiny_lm_batch(n)


def faulty() -> Workload:
    return dataclasses.replace(tiny_lm(), name="faulty-lm", batch=faulty_batch)

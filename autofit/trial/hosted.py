"""The trial host's own side (:mod:`autofit.trial.host` is ours): import once, then run trial requests one
after another, each as a trial child runs it (:func:`autofit.trial.run.child_entry`)."""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import resource
import socket

from autofit.core.records import TrialStatus
from autofit.runtime import procs
from autofit.runtime.messages import result_status
from autofit.trial.host import MAX_REQUEST_BYTES
from autofit.trial.run import child_entry


def host_main(request: dict, send: procs.Send) -> None:
    """In the host: import once, then run each trial request from the socket and send its outcome;
    exit when the socket closes or after an outcome that is not ok."""
    sock = socket.socket(fileno=request["socket_fd"])
    if request.get("memory_limit_bytes"):  # before the workload allocates anything (child_entry sets it too)
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (int(request["memory_limit_bytes"]), hard))
    started_env = dict(os.environ)
    workload = _warm_up(request["source"], request["device"])
    send({"ready": True, "import_env": {k: v for k, v in os.environ.items() if started_env.get(k) != v}})
    while True:
        data = sock.recv(MAX_REQUEST_BYTES)
        if not data:
            return
        trial = json.loads(data)
        outcome = child_entry(trial, workload=workload)
        gc.collect()  # the trial's tensors go now, before the next trial measures
        send(outcome)
        if result_status(outcome) is not TrialStatus.OK:
            return


def _warm_up(source: str, device: str):
    """Before the first request: the workload, and on CUDA the context (seconds each). A failure here is
    left for the first trial to meet and report (child_entry loads a workload it was not given)."""
    import torch

    from autofit.runtime.forkserver import PRELOAD
    from autofit.workloads.load import load_workload

    for name in PRELOAD:  # what a trial imports (torch._dynamo among them), as a forked trial finds them
        importlib.import_module(name)
    try:
        workload = load_workload(source)
    except BaseException:  # noqa: BLE001 -- said by the first trial, in its own words
        return None
    if device.split(":")[0] == "cuda":
        with contextlib.suppress(Exception):  # the first trial meets it too, and says it
            torch.cuda.init()
    return workload

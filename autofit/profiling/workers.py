"""Where profiling runs: worker processes, and this process beside them.

Fake-tensor dispatch is pure Python and single-threaded, so a process per precision is the only
way to use a second core. On the CPU the workers are forked from the trials' fork server
(:mod:`autofit.runtime.forkserver`: torch, torch._dynamo and autofit already imported); elsewhere they
are fresh interpreters running :func:`profile_child` (not multiprocessing, whose spawn would
re-run a caller's unguarded ``__main__``). Workloads without a ``source`` (built in Python, not
loadable by name) are profiled in this process.

At a search's first use the fork server is still starting (seconds of imports) when profiling
begins: this process profiles a precision at a time meanwhile, and a thread forks a worker for
each precision left as soon as the server is up. With the server already up, all precisions but
one are forked and that one is profiled here (this process would only wait for them).
"""

from __future__ import annotations

import glob
import os
import threading
from dataclasses import asdict

import torch

from autofit.core.config import Precision
from autofit.core.errors import WorkloadError
from autofit.profiling.cache import cache_dir
from autofit.profiling.data import PrecisionProfile, precision_from_dict
from autofit.runtime import forkserver, procs
from autofit.workloads.base import Workload

__all__ = ["in_children", "profile_child", "profile_many", "profile_one", "surely_forks"]

_ENTRY = "autofit.profiling.workers:profile_child"


def profile_one(workload: Workload, precision: Precision, device_type: str, split_ends: bool,
                ends_only: bool, selective: bool = True) -> PrecisionProfile:
    """:func:`autofit.profiling.precision.profile_precision` (``ends_only``: :func:`autofit.profiling.precision.profile_split_ends`)
    from one random stream in whichever process profiles (a model whose memory depends on its data,
    e.g. routing, gets one profile); the caller's stream is left as it was."""
    from autofit.profiling.precision import profile_precision, profile_split_ends

    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(0)
        if ends_only:
            return profile_split_ends(workload, precision, device_type)
        return profile_precision(workload, precision, device_type, split_ends, selective)


def in_children(workload: Workload, precisions: list[Precision], device_type: str) -> bool:
    """Whether :func:`profile_many` uses worker processes (else it profiles in this one)."""
    # On CUDA the real step (autofit.profiling.real_check) must not create a context in the caller: always a child.
    alone = min(len(precisions), os.cpu_count() or 1) <= 1 and device_type != "cuda"
    return bool(precisions) and not alone and bool(workload.source) and os.environ.get("AUTOFIT_PROFILE_WORKERS") != "1"


def surely_forks(workload: Workload, precisions: list[Precision], device_type: str, use_cache: bool) -> bool:
    """Whether profiling ``workload`` will use the fork server, known before its cache key is: no cache
    to read, or none for this workload at all."""
    if device_type != "cpu" or not forkserver.enabled() or not in_children(workload, precisions, device_type):
        return False
    return not use_cache or not any(cache_dir().glob(f"{glob.escape(workload.name)}-{device_type}-*.json"))


def profile_many(workload: Workload, precisions: list[Precision], device_type: str, split_ends: bool = True,
                 ends_only: bool = False, selective: bool = True) -> dict[str, PrecisionProfile]:
    """Profile several precisions, in parallel processes when there are spare cores (module docstring).
    ``ends_only``: each precision's split ends instead of its profile; ``selective``: as
    :func:`autofit.profiling.precision.profile_precision`. Raises WorkloadError."""
    args = (workload, device_type, split_ends, ends_only, selective)
    if not in_children(workload, precisions, device_type):
        return _here(precisions, *args)
    if device_type != "cpu" or not forkserver.enabled():
        return _collect(_spawn(precisions, *args))
    if forkserver.ready():
        try:
            forked = _fork(precisions[1:], *args)
        except OSError:  # gone meanwhile
            return _beside_starting_server(precisions, *args)
        try:
            return {**_here(precisions[:1], *args), **_collect(forked)}
        finally:
            _kill(forked)
    return _beside_starting_server(precisions, *args)


def _beside_starting_server(precisions: list[Precision], *args) -> dict[str, PrecisionProfile]:
    """Profile here a precision at a time while a thread waits for the fork server and forks a worker
    for each precision left then; a precision it cannot fork is profiled here."""
    lock = threading.Lock()
    queue, forked, unforked = list(precisions), [], []

    def fork_the_rest() -> None:
        try:
            forkserver.ensure_server()  # waits for the one starting (start_server_soon), or starts one
        except OSError:
            return  # none: this process profiles them all
        with lock:  # under the lock: once this process takes it, every worker this thread starts is started
            try:
                forked.extend(_fork(queue, *args))
            except OSError:
                unforked.extend(queue)
            queue.clear()

    threading.Thread(target=fork_the_rest, name="autofit-profile-fork", daemon=True).start()
    found: dict[str, PrecisionProfile] = {}
    try:
        while True:
            with lock:
                taken = queue[:1]
                del queue[:1]
            if not taken:
                break
            found.update(_here(taken, *args))
        with lock:
            started, rest = list(forked), list(unforked)
        found.update(_here(rest, *args))
        found.update(_collect(started))
        return found
    finally:
        with lock:
            queue.clear()  # after an error, the thread forks nothing more
            started = list(forked)
        _kill(started)


def _here(precisions: list[Precision], workload: Workload, device_type: str, split_ends: bool,
          ends_only: bool, selective: bool) -> dict[str, PrecisionProfile]:
    """Profile in this process as a worker does: on one thread (workers run beside it)."""
    if not precisions:
        return {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {p.value: profile_one(workload, p, device_type, split_ends, ends_only, selective) for p in precisions}
    finally:
        torch.set_num_threads(threads)


def _request(precisions: list[Precision], workload: Workload, device_type: str, split_ends: bool,
             ends_only: bool, selective: bool) -> dict:
    return {"source": workload.source, "device_type": device_type, "precisions": [p.value for p in precisions],
            "threads": 1, "split_ends": split_ends, "ends_only": ends_only, "selective": selective}


_ENV = {"AUTOFIT_PROFILE_WORKERS": "1", "OMP_NUM_THREADS": "1"}


def _fork(precisions: list[Precision], *args) -> list[procs.Child]:
    """A worker forked from the fork server per precision (a fork costs milliseconds). Raises OSError
    when the server cannot be used (no worker is left running then)."""
    children: list[procs.Child] = []
    try:
        for p in precisions:
            children.append(forkserver.start_trial(_ENTRY, _request([p], *args), timeout_s=None,
                                                   echo_stderr=False, env=_ENV))
    except OSError:
        _kill(children)
        raise
    return children


def _spawn(precisions: list[Precision], *args) -> list[procs.Child]:
    """Fresh interpreters, one per core at most (start-up, imports and first-op warm-up cost seconds
    per process, so fewer processes finish sooner)."""
    workers = min(len(precisions), os.cpu_count() or 1)
    return [procs.spawn(_ENTRY, _request(precisions[i::workers], *args), env=procs.child_env(_ENV))
            for i in range(workers)]


def _collect(children: list[procs.Child]) -> dict[str, PrecisionProfile]:
    """The workers' profiles, once all have finished. Raises WorkloadError with the first failure."""
    found: dict[str, PrecisionProfile] = {}
    failure = None
    try:
        for child in children:
            child.wait()
            out = child.last_message()
            if out is None or "error" in out:
                failure = failure or (out["error"] if out else child.failure())
                continue
            found.update({name: precision_from_dict(pp) for name, pp in out["profiles"].items()})
    finally:
        _kill(children)
    if failure:
        raise WorkloadError(failure)
    return found


def _kill(children: list[procs.Child]) -> None:
    for child in children:
        child.kill()


def profile_child(request: dict, send: procs.Send | None = None) -> dict:
    """A profiling worker (an :mod:`autofit.runtime.procs` child): ``{"profiles": {precision: asdict}}`` or ``{"error"}``."""
    from autofit.core.errors import AutofitError
    from autofit.workloads.load import load_workload

    if request.get("threads"):  # a forked worker: the zygote's libraries loaded before OMP_NUM_THREADS=1
        torch.set_num_threads(request["threads"])
    try:
        workload = load_workload(request["source"])
        return {"profiles": {p: asdict(profile_one(workload, Precision(p), request["device_type"],
                                                   request.get("split_ends", True), request.get("ends_only", False),
                                                   request.get("selective", True)))
                             for p in request["precisions"]}}
    except AutofitError as exc:
        return {"error": str(exc)}

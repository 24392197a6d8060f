"""Profile a workload for every precision asked for: read the on-disk cache, trace what is missing
(in worker processes where that pays), and assemble one :class:`~autofit.profiling.data.Profile`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Iterable

import torch

from autofit.core.config import OptimizerChoice, Precision
from autofit.core.errors import WorkloadError
from autofit.core.files import write_atomic
from autofit.profiling.cache import (
    cache_outcome,
    cache_path,
    profile_key,
    split_refusal,
)
from autofit.profiling.data import (
    PrecisionProfile,
    Profile,
    retained_caveat,
)
from autofit.profiling.optimizers import option_library, profile_options
from autofit.profiling.precision import with_split_ends
from autofit.profiling.workers import profile_many, surely_forks
from autofit.runtime import forkserver
from autofit.runtime.optimizers import missing_library, refusal
from autofit.workloads.base import (
    Workload,
    explain_build_failure,
    selective_caveat,
)


def profile_workload(workload: Workload, precisions: Iterable[Precision | str] = tuple(Precision),
                     device_type: str = "cpu", use_cache: bool = True, split_ends: bool = True,
                     note: Callable[[str], None] | None = None,
                     optimizers: Iterable[OptimizerChoice | str] = (), selective: bool = True) -> Profile:
    """Profile ``workload`` for each precision on fake tensors, using the on-disk cache.

    Returns a :class:`Profile`. Raises WorkloadError when the model cannot be built or
    followed on fake tensors. Profiles are cached per precision under :func:`cache_dir`.
    ``split_ends=False``: a caller that estimates no pipeline split (``device_split > 1``,
    :func:`autofit.estimator.memory_model.needs_split_ends`) skips profiling the ends of a model with tied
    weights untied (about 40% of its profile); a cached profile without them is completed when
    they are asked for. ``note`` is called with a line for a user as profiling starts and ends
    (read from the cache or traced). ``optimizers``: the ``optimizer`` lever's choices to profile too
    (:mod:`autofit.profiling.optimizers`; those the workload's optimizer or this environment rules out
    are skipped, and the estimate says why), added to a cached profile that lacks them.
    ``selective=False``: a caller that estimates no selectively checkpointed config
    (:func:`autofit.estimator.memory_model.needs_selective`) skips tracing the layers' selective forwards
    (a quarter of a small transformer's profile); a cached profile without them is profiled again
    when they are asked for.
    """
    started = time.perf_counter()
    precisions = [Precision(p) for p in precisions]
    note = note or (lambda line: None)
    note(f"profiling {workload.name} on fake tensors ({', '.join(p.value for p in precisions)})...")
    if surely_forks(workload, precisions, device_type, use_cache):
        forkserver.start_server_soon(workload.preload)  # its imports overlap the key's fake build below
    try:
        key, param_count, n_layers = profile_key(workload, device_type)
    except WorkloadError:
        raise
    except Exception as exc:
        raise WorkloadError(explain_build_failure(workload, exc)) from exc
    if n_layers == 0:
        raise WorkloadError(f"{workload.name}: layers(model) is empty; it must list the repeated blocks")
    found: dict[str, PrecisionProfile] = {}
    path = cache_path(workload.name, device_type, key)
    if use_cache and path.is_file():
        try:
            found = dict(Profile.from_json(path.read_text()).precisions)
        except (ValueError, TypeError, KeyError):
            found = {}  # an unreadable cache entry is rebuilt, never trusted
    missing = [p for p in precisions if p.value not in found or (selective and found[p.value].selective_skipped)]
    endless = [p for p in precisions if split_ends and p not in missing and found[p.value].split_ends_skipped]
    found.update(_kept_options(found, profile_many(workload, missing, device_type, split_ends, selective=selective)))
    ends = profile_many(workload, endless, device_type, ends_only=True) if endless else {}
    found.update({name: with_split_ends(found[name], pp) for name, pp in ends.items()})
    with torch.device("meta"):  # over the model's own parameters: a factory may pick some (only matrices)
        model = workload.model()
        optimizer_name = type(workload.optimizer(model.parameters())).__name__
    options = _missing_options(found, precisions, optimizers, optimizer_name)
    for name, choices in options.items():
        kept = tuple(o for o in found[name].optimizer_options if o.choice not in choices)
        found[name] = dataclasses.replace(
            found[name], optimizer_options=kept + profile_options(workload, name, device_type, choices))
    note(cache_outcome(workload.name, precisions, missing, endless, time.perf_counter() - started, path))
    if (caveat := retained_caveat(workload.name, found.values())) is not None:
        logging.getLogger(__name__).warning(caveat)
    profile = Profile(
        split_refusal=split_refusal(workload), selective_refusal=selective_caveat(workload.name, model),
        workload=workload.name, device_type=device_type, param_count=param_count, n_layers=n_layers,
        tokens_per_sample=workload.tokens_per_sample, optimizer=optimizer_name, key=key,
        profile_s=time.perf_counter() - started, precisions=found,
    )
    if use_cache and (missing or endless or options):  # else the file already holds every precision found
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, profile.to_json())  # a concurrent reader never sees half a file
        except OSError:
            pass  # a read-only cache only costs time
    return profile



def _kept_options(cached: dict[str, PrecisionProfile], traced: dict[str, PrecisionProfile]) -> dict[str, PrecisionProfile]:
    """``traced`` with the optimizer choices a cached profile of the same precision had (a precision traced
    again for its selective forwards keeps what was profiled of the optimizer lever: it does not change)."""
    return {name: pp if pp.optimizer_options or name not in cached
            else dataclasses.replace(pp, optimizer_options=cached[name].optimizer_options)
            for name, pp in traced.items()}


def _missing_options(found: dict[str, PrecisionProfile], precisions: list[Precision], optimizers,
                     optimizer_name: str) -> dict[str, list[str]]:
    """Per precision, the lever choices to profile: asked for, able to replace the workload's optimizer
    here, and not in the profile yet (or profiled with another version of their library)."""
    choices = [c.value for c in dict.fromkeys(OptimizerChoice(o) for o in optimizers)
               if c is not OptimizerChoice.AS_GIVEN and refusal(c, optimizer_name) is None and missing_library(c) is None]
    out = {}
    for p in precisions:
        have = {o.choice for o in found[p.value].optimizer_options if o.library == option_library(o.choice)}
        if todo := [c for c in choices if c not in have]:
            out[p.value] = todo
    return out

"""Profile a workload for every precision asked for: read the on-disk cache, trace what is missing
(in worker processes where that pays), and assemble one :class:`~autofit.profiling.data.Profile`.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

import torch

from autofit.core.config import Precision
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
)
from autofit.profiling.precision import with_split_ends
from autofit.profiling.workers import profile_many, surely_forks
from autofit.runtime import forkserver
from autofit.workloads.base import (
    Workload,
    explain_build_failure,
    training_cache_caveat,
)


def profile_workload(workload: Workload, precisions: Iterable[Precision | str] = tuple(Precision),
                     device_type: str = "cpu", use_cache: bool = True, split_ends: bool = True,
                     note: Callable[[str], None] | None = None) -> Profile:
    """Profile ``workload`` for each precision on fake tensors, using the on-disk cache.

    Returns a :class:`Profile`. Raises WorkloadError when the model cannot be built or
    followed on fake tensors. Profiles are cached per precision under :func:`cache_dir`.
    ``split_ends=False``: a caller that estimates no pipeline split (``device_split > 1``,
    :func:`autofit.estimator.memory_model.needs_split_ends`) skips profiling the ends of a model with tied
    weights untied (about 40% of its profile); a cached profile without them is completed when
    they are asked for. ``note`` is called with a line for a user as profiling starts and ends
    (read from the cache or traced).
    """
    started = time.perf_counter()
    precisions = [Precision(p) for p in precisions]
    note = note or (lambda line: None)
    note(f"profiling {workload.name} on fake tensors ({', '.join(p.value for p in precisions)})...")
    if surely_forks(workload, precisions, device_type, use_cache):
        forkserver.start_server_soon()  # its imports overlap the key's fake build below
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
    missing = [p for p in precisions if p.value not in found]
    endless = [p for p in precisions if split_ends and p.value in found and found[p.value].split_ends_skipped]
    found.update(profile_many(workload, missing, device_type, split_ends))
    ends = profile_many(workload, endless, device_type, ends_only=True) if endless else {}
    found.update({name: with_split_ends(found[name], pp) for name, pp in ends.items()})
    note(cache_outcome(workload.name, precisions, missing, endless, time.perf_counter() - started, path))
    with torch.device("meta"):  # over the model's own parameters: a factory may pick some (only matrices)
        model = workload.model()
        optimizer_name = type(workload.optimizer(model.parameters())).__name__
    if (caveat := training_cache_caveat(workload.name, model)) is not None:
        logging.getLogger(__name__).warning(caveat)
    profile = Profile(
        split_refusal=split_refusal(workload),
        workload=workload.name, device_type=device_type, param_count=param_count, n_layers=n_layers,
        tokens_per_sample=workload.tokens_per_sample, optimizer=optimizer_name, key=key,
        profile_s=time.perf_counter() - started, precisions=found,
    )
    if use_cache and (missing or endless):  # else the file already holds every precision found
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, profile.to_json())  # a concurrent reader never sees half a file
        except OSError:
            pass  # a read-only cache only costs time
    return profile


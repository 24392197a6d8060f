"""The profile cache's key: everything that can change a profile, so an edited model, optimizer,
batch or loss is never served a stale one (:func:`autofit.profiling.profile.profile_workload` reads and
writes the cache under :func:`cache_dir`). Code counts by content (the sources and the digests of
the files that define the workload), never by path or modification time: another checkout of the
same code, or a ``touch``, reuses the cache. The layer probe's timings are keyed by this key too."""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from autofit.profiling.data import PROFILE_BATCHES, PROFILE_VERSION, Profile
from autofit.runtime.training import copies_stay_fake, is_kv_cache
from autofit.workloads.base import Workload, checked_batch

__all__ = ["cache_dir", "cache_outcome", "cache_path", "code_digests", "profile_key", "split_refusal", "study_profile"]


def cache_dir() -> Path:
    """``$AUTOFIT_CACHE_DIR``, else ``~/.cache/autofit/profiles``."""
    root = os.environ.get("AUTOFIT_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "autofit" / "profiles"


def cache_path(workload_name: str, device_type: str, key: str) -> Path:
    """The cache file of the profile of ``workload_name`` on ``device_type`` under ``key``."""
    return cache_dir() / f"{workload_name}-{device_type}-{key}.json"


def study_profile(study) -> Profile | None:
    """The profile the search of ``study`` (a StudySnapshot) estimated with, read from the cache by
    the key it stored; None for a study stored without one (an older autofit), by another profile
    version, or whose profile is not in this machine's cache (the caller then profiles the workload).

    A report of a finished study wants the peaks of the profile its predictions came from, and this
    read costs no fake build of the model (whose torch._dynamo import alone takes seconds).
    """
    stored = study.profile or {}
    name, device_type = study.settings.get("workload_name"), study.settings.get("device_type")
    if stored.get("version") != PROFILE_VERSION or not stored.get("key") or not name or not device_type:
        return None
    try:
        profile = Profile.from_json(cache_path(name, device_type, stored["key"]).read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None  # gone or unreadable: profiled again, never trusted
    return profile if profile.key == stored["key"] else None


def _source_of(obj: Any) -> str:
    try:
        return _cached_source_of(obj)
    except TypeError:  # an unhashable callable (a bound method of an unhashable object)
        return _read_source(obj)


# Memoised per object: inspect.getsource re-parses a class's whole module (ast) on every call, and
# a search keys its profile several times (its start, then each export of the best config). An
# edited and re-run definition is a new object, so a stale source is never returned.
@functools.lru_cache(maxsize=512)
def _cached_source_of(obj: Any) -> str:
    return _read_source(obj)


def _read_source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (TypeError, OSError):
        return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}"


def code_digests(objs) -> list[str]:
    """The content digests of the files defining ``objs`` (classes, functions), sorted by digest: an
    edit anywhere in them (a helper the model calls, a constant) changes the key, while a copy in
    another checkout or a ``touch`` does not -- no path or modification time enters a key, not even
    through the order (files sorted by path would order differently under /tmp and /work)."""
    files = {path for path in map(_source_file, objs) if path}
    return sorted(digest for digest in map(_file_digest, files) if digest)


def _source_file(obj: Any) -> str | None:
    try:
        return inspect.getsourcefile(obj)
    except TypeError:  # a builtin, a functools.partial
        return None


def _file_digest(path: str) -> str | None:
    # read every time (a few source files: well under a millisecond), never memoised by mtime
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError:  # a notebook cell's pseudo-file: its source text is keyed instead
        return None


def split_refusal(workload: Workload) -> str | None:
    """Why a pipeline split of ``workload`` cannot run, or None: ``workload.split.refusal`` on a model
    built on the meta device (no memory), if it has one; without a hand-made ``split``, inputs that
    are not one tensor (the traced stages of ``torch.distributed.pipelining`` take tensors only) or an
    output torch.export cannot capture (:func:`_output_refusal`)."""
    if workload.split is None:
        inputs = checked_batch(workload, 1)[0]
        if isinstance(inputs, torch.Tensor):
            return _output_refusal(workload, inputs)
        return (f"a pipeline split passes the model's inputs to its first stage as one tensor "
                f"(torch.distributed.pipelining), and batch(n) returns them as a {type(inputs).__name__}: "
                "use split_mode=fsdp, or inputs of one tensor")
    refusal = getattr(workload.split, "refusal", None)
    if refusal is None:
        return None
    with torch.device("meta"):
        return refusal(workload.model())


# What torch.export (the generic split's tracer) carries in a model's output besides tensors.
_PLAIN = (torch.Tensor, int, float, bool, str, type(None))


def _output_refusal(workload: Workload, inputs: torch.Tensor) -> str | None:
    """Why the generic split cannot trace the model's output, or None: an object in it that torch.export
    does not know, other than a transformers key/value cache (which the traced stages drop). Read from one
    forward on the meta device (no memory); a model that cannot run there is not judged here (its trial
    says why, if it fails)."""
    try:
        with torch.device("meta"), torch.no_grad():
            model = workload.model()
            out = model(inputs.to("meta"))
        # a key/value cache is dropped from the traced output (autofit.trial.pipeline.stages.without_caches)
        unknown = sorted({type(leaf).__name__ for leaf in tree_leaves(out)
                          if not isinstance(leaf, _PLAIN) and not is_kv_cache(leaf)})
    except Exception:  # noqa: BLE001 -- a forward that the meta device cannot run: not refused here
        return None
    if not unknown:
        return None
    return (f"the model returns a {', '.join(unknown)}, which torch.export, the pipeline split's tracer, "
            "cannot capture: use split_mode=fsdp, or a model that returns tensors")


def profile_key(workload: Workload, device_type: str) -> tuple[str, int, int]:
    """(cache key, parameter count, layer count), from a fake build of the model."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), copies_stay_fake():
        model = workload.model()
        layers = workload.layers(model)
        optimizer = workload.optimizer(model.parameters())
    params = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]
    buffers = [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    classes = sorted({type(m) for m in model.modules()}, key=lambda c: c.__qualname__)
    # Plain attributes (flags, rates, config dataclasses) change behaviour without changing shapes.
    settings = [sorted((k, repr(v)) for k, v in vars(m).items()
                       if not k.startswith("_") and (isinstance(v, (bool, int, float, str, tuple))
                                                     or hasattr(v, "__dataclass_fields__")))
                for m in model.modules()]
    batch = workload.batch(PROFILE_BATCHES[0])
    batch_shapes = [(tuple(t.shape), str(t.dtype)) for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    functions = (workload.model, workload.batch, workload.loss, workload.optimizer, workload.layers)
    parts = [
        PROFILE_VERSION, torch.__version__, device_type, workload.name, repr(model), params, buffers,
        [_source_of(c) for c in classes], settings, repr(optimizer), type(optimizer).__qualname__,
        [_source_of(f) for f in functions], batch_shapes, len(layers),
        code_digests([*functions, *(c for c in classes if not c.__module__.startswith("torch."))]),
    ]
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()[:20]
    param_count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return digest, param_count, len(layers)


def cache_outcome(name: str, precisions: list, missing: list, endless: list, seconds: float, path: Path) -> str:
    """What :func:`autofit.profiling.profile.profile_workload` did, as a line for a user: the profile read from
    the cache, or which precisions it traced (``missing``) or completed with untied ends (``endless``)."""
    if not missing and not endless:
        return f"profile of {name} read from the cache in {seconds:.1f} s ({path})"
    done = [f"traced {', '.join(p.value for p in missing)}"] if missing else []
    done += [f"traced the untied ends of {', '.join(p.value for p in endless)}"] if endless else []
    cached = [p.value for p in precisions if p not in missing]
    done += [f"{', '.join(cached)} read from the cache"] if cached else []
    return f"profiled {name} in {seconds:.1f} s: {'; '.join(done)} (cache: {path.parent})"

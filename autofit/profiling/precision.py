"""Profile a workload on fake tensors: the facts the memory and time models need.

One optimizer step is run under ``FakeTensorMode`` (no real memory, so a 7B model profiles
on a laptop) through the same code as a real trial (:mod:`autofit.runtime.training`), at two
micro-batch sizes per precision. A dispatch-mode timeline counts live tensor bytes after
every op; hooks on the layers cut the timeline into regions (the part before the layers,
each layer, the part after them, forward and backward, then the optimizer step). For each
region we keep where live bytes end and how high they peak, as lines ``c0 + c1·b`` in the
micro-batch ``b``. The memory model recombines these regions for any checkpoint interval,
device split and accumulation.

Here the parts meet: :mod:`~autofit.profiling.step` runs one step under the hooks of
:mod:`~autofit.profiling.trace` (a :class:`~autofit.profiling.raw.RawRun`),
:mod:`~autofit.profiling.real_check` corrects the fake runs by real steps, and
:mod:`~autofit.profiling.assemble` fits the two micro-batches' runs into lines.
"""

from __future__ import annotations

import dataclasses
import functools

from torch import nn

from autofit.core.config import Precision
from autofit.core.errors import WorkloadError
from autofit.profiling.assemble import assemble
from autofit.profiling.data import PROFILE_BATCHES, PrecisionProfile
from autofit.profiling.real_check import check_runs
from autofit.profiling.step import run_fake
from autofit.workloads.base import Workload, checked_batch, explain_failure

__all__ = ["profile_precision", "profile_split_ends", "with_split_ends"]


# What an estimate of a model profiled on its native RNN kernels says (autofit.profiling.step.run_fake).
CUDNN_OFF_NOTE = ("profiled with cuDNN off (its RNN kernels refuse fake tensors): the native kernels' memory, "
                  "not cuDNN's, which differs both ways (on an H200, lstm-lm's allocator peak was 9-12% above this "
                  "estimate at fp32 and bf16 and 29-32% below it under autocast); trials measure the real step")


def profile_precision(workload: Workload, precision: Precision, device_type: str = "cpu",
                      split_ends: bool = True, selective: bool = True) -> PrecisionProfile:
    """Profile one precision on fake tensors. Raises WorkloadError if the model can't be traced.

    ``split_ends=False`` leaves out :func:`profile_split_ends` (a model with tied weights is then
    marked ``split_ends_skipped``): for callers that estimate no pipeline split. ``selective=False``
    leaves out the layers' selectively checkpointed forwards (marked ``selective_skipped``): for callers
    that estimate no selectively checkpointed config."""
    runs = {}
    real_batches = {b: checked_batch(workload, b) for b in PROFILE_BATCHES}
    for b in PROFILE_BATCHES:
        try:
            runs[b] = run_fake(workload, precision, b, device_type, real_batches[b], selective=selective)
        except WorkloadError:
            raise
        except Exception as exc:
            raise WorkloadError(explain_failure(workload.name, exc)) from exc
    runs, real_note, real_extra = check_runs(workload, precision, device_type, runs, real_batches, selective)
    if any(run.cudnn_off for run in runs.values()):
        real_note = "; ".join(x for x in (CUDNN_OFF_NOTE, real_note) if x)
    pp = assemble(precision, runs, real_check=real_note, real_extra_bytes_per_sample=real_extra)
    if not selective:
        pp = dataclasses.replace(pp, selective_skipped=True)
    if not runs[PROFILE_BATCHES[0]].tied_bytes:
        return pp
    if not split_ends:
        return dataclasses.replace(pp, split_ends_skipped=True)
    return with_split_ends(pp, profile_split_ends(workload, precision, device_type, real_batches))


def profile_split_ends(workload: Workload, precision: Precision, device_type: str = "cpu",
                       real_batches: dict | None = None) -> PrecisionProfile:
    """The model's ends as a device split's first and last stages run them, for a model with a
    weight tied across its ends. Each of those stages holds its own copy of that weight and
    accumulates only its own gradient (no sum of the two): the ends are profiled on the model with
    those weights untied (fake runs only; :func:`with_split_ends` attaches them, with the layers of the
    tied profile: the layers' recomputed forwards are not traced here, about a third of a run)."""
    untied = dataclasses.replace(workload, model=functools.partial(_build_untied, workload.model))
    real_batches = real_batches or {b: workload.batch(b) for b in PROFILE_BATCHES}
    return assemble(precision, {b: run_fake(untied, precision, b, device_type, real_batches[b], layer_recomputes=False)
                                for b in PROFILE_BATCHES})


def with_split_ends(pp: PrecisionProfile, ends: PrecisionProfile) -> PrecisionProfile:
    """``pp`` with ``ends`` (:func:`profile_split_ends`) as its split ends; the layers stay ``pp``'s
    (the real check's corrections included)."""
    return dataclasses.replace(pp, split_ends=dataclasses.replace(ends, layers=pp.layers), split_ends_skipped=False)


def _build_untied(build) -> nn.Module:
    """``build()`` with every parameter shared by two modules replaced, in the second, by a copy."""
    model = build()
    owner: dict[int, nn.Module] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if owner.setdefault(id(p), module) is not module:
                setattr(module, name, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
    return model

"""Profiles for every shape of a family from a few fake-tensor profiles: how ``autofit size`` is fast.

How hundreds of shapes are scored in seconds (profiling each one on fake tensors would take
minutes): the memory and time models need a :class:`~autofit.profiling.data.Profile` per shape, and
most of it is shared or follows from a few profiles.

- **Depth** is exact reuse: the layers of a family are identical blocks, so a model of L layers
  is profiled once with one layer and its layer profile repeated L times. Whole-model totals
  add L-1 more layers' parameters, gradients and forward FLOPs; optimizer state grows with the
  gradients (the memory model's own assumption for pipeline stages), the optimizer step's
  temporaries too, or stay set by the largest tensor for a per-tensor optimizer loop; backward
  FLOPs grow with forward FLOPs.
- **Width, heads, feed-forward width, sequence length** (the other varied fields): every
  quantity of a one-layer profile -- bytes held or peaking in each region, as lines in the
  micro-batch, parameter and gradient bytes, FLOPs -- is a sum of tensor sizes, each a product
  of those fields of degree at most two in each one (activations are linear in batch x seq and in
  width for fixed head size and ratios, attention scores quadratic in seq, weights quadratic in
  width). So each quantity is interpolated with a tensor-product quadratic (Lagrange) through
  three anchor values per field -- the smallest, middle and largest value of the grid -- from
  one profile per anchor combination (a field with three values or fewer is profiled at each).
  This is exact for sums of such terms and approximate where a peak changes which operator sets
  it between anchors; ``tests/sizing/test_size.py`` checks it against direct profiles.
- **Parameter counts** are exact: each distinct non-depth shape is built once on the meta device.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from autofit.core.config import Precision
from autofit.core.errors import AutofitError, WorkloadError
from autofit.estimator.time_model import OpCounts, op_counts
from autofit.profiling.data import PrecisionProfile, Profile, upper_envelope
from autofit.profiling.profile import profile_workload
from autofit.sizing.family import Family, SizeError
from autofit.workloads.base import Workload
from autofit.workloads.load import load_workload


def _leaves(obj) -> list[float]:
    """Numeric leaves of a nested dict/list in a fixed order (bools and strings are not numbers here)."""
    if isinstance(obj, dict):
        return [x for k in sorted(obj) for x in _leaves(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v)]
    if obj is None or isinstance(obj, bool) or isinstance(obj, str):  # None: e.g. no split_ends
        return []
    return [float(obj)]


def _fill(template, values: list[float], pos: list[int]):
    """``template`` with its numeric leaves replaced, in :func:`_leaves` order (ints rounded)."""
    if isinstance(template, dict):
        return {k: _fill(template[k], values, pos) for k in sorted(template)}
    if isinstance(template, (list, tuple)):
        return [_fill(v, values, pos) for v in template]
    if template is None or isinstance(template, bool) or isinstance(template, str):
        return template
    value = values[pos[0]]
    pos[0] += 1
    return int(round(value)) if isinstance(template, int) else float(value)


def _non_numeric(obj):
    if isinstance(obj, dict):
        return {k: _non_numeric(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_non_numeric(v) for v in obj]
    return obj if isinstance(obj, (bool, str)) else None


def _without_notes(obj):
    """``obj`` with its free-text notes blanked (``real_check`` says in words what a real step found,
    with numbers that differ between anchors): only numbers are interpolated, and notes are not."""
    if isinstance(obj, dict):
        return {k: ("" if k == "real_check" else _without_notes(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_without_notes(v) for v in obj]
    return obj


# Micro-batches at which each anchor's peak lines are read for interpolation (:func:`_bends_on_grid`).
_BEND_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def _regions(obj):
    """Every region dict (one with ``bends``) in a profile's ``asdict`` form."""
    if isinstance(obj, dict):
        if "bends" in obj:
            yield obj
        for v in obj.values():
            yield from _regions(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _regions(v)


def _bends_on_grid(pp: dict) -> None:
    """Replace each region's bends (as many as its peak has: the shape decides) by one line per
    :data:`_BEND_GRID` micro-batch, the highest of its peak lines there. Every anchor then has as many,
    and the k-th of each is its highest line at the same micro-batch: interpolated, it gives the
    interpolated peak there."""
    grid = np.asarray(_BEND_GRID, dtype=np.float64)
    for region in _regions(pp):
        for suffix in ("", "_nongrad"):
            lines = np.array([region["peak" + suffix], region["steep" + suffix], *region["bends" + suffix]])
            top = np.argmax(lines[:, 0][:, None] + lines[:, 1][:, None] * grid, axis=0)
            region["bends" + suffix] = [list(lines[i]) for i in top]


def _bends_pruned(pp: dict) -> None:
    """Keep of an interpolated region's grid lines those on their upper envelope."""
    for region in _regions(pp):
        for suffix in ("", "_nongrad"):
            lines = np.array(region["bends" + suffix]).reshape(-1, 2)
            region["bends" + suffix] = [list(line) for line in upper_envelope(lines[:, 0], lines[:, 1])]


def lagrange_weights(anchors: list[float], x: float) -> np.ndarray:
    """Weights w with sum(w_i · f(anchor_i)) = the polynomial through the anchors at x."""
    w = np.ones(len(anchors))
    for i, a in enumerate(anchors):
        for j, b in enumerate(anchors):
            if i != j:
                w[i] *= (x - b) / (a - b)
    return w


def _largest_grad_tensor(pp: PrecisionProfile) -> int:
    return max([layer.max_grad_tensor_bytes for layer in pp.layers]
               + [pp.pre_max_grad_tensor_bytes, pp.post_max_grad_tensor_bytes])


def _opt_peak_ratio(pp: PrecisionProfile) -> tuple[bool, float]:
    """(per-tensor loop?, optimizer-step temporaries over the largest tensor or over all gradients).

    The same rule as the memory model's: temporaries within 4x the largest gradient tensor mean
    an optimizer that steps one tensor at a time."""
    largest = _largest_grad_tensor(pp)
    if largest and pp.optimizer_peak_bytes <= 4 * largest:
        return True, pp.optimizer_peak_bytes / largest
    return False, pp.optimizer_peak_bytes / pp.grad_bytes if pp.grad_bytes else 0.0


def deepen(pp: PrecisionProfile, n_layers: int) -> PrecisionProfile:
    """A one-layer profile as the profile of the same model with ``n_layers`` identical layers."""
    if len(pp.layers) != 1:
        raise ValueError("deepen takes a one-layer profile")
    layer, extra = pp.layers[0], n_layers - 1
    grads = pp.grad_bytes + extra * layer.grad_bytes
    grow = grads / pp.grad_bytes if pp.grad_bytes else 1.0
    per_tensor, _ = _opt_peak_ratio(pp)
    largest = _largest_grad_tensor(pp)
    options = tuple(dataclasses.replace(  # the optimizer lever's choices grow as the workload's own
        o, state_bytes=int(round(o.state_bytes * grow)),  # (a kernel's own bytes follow the largest tensor: kept)
        peak_bytes=o.peak_bytes if largest and o.peak_bytes <= 4 * largest else int(round(o.peak_bytes * grow)))
        for o in pp.optimizer_options)
    fwd = (pp.forward_flops[0], pp.forward_flops[1] + extra * layer.forward_flops[1])
    fwd_grow = fwd[1] / pp.forward_flops[1] if pp.forward_flops[1] else 1.0
    return dataclasses.replace(
        pp, layers=(layer,) * n_layers, static_param_bytes=pp.static_param_bytes + extra * layer.param_bytes,
        grad_bytes=grads, optimizer_bytes=int(round(pp.optimizer_bytes * grow)),
        optimizer_peak_bytes=pp.optimizer_peak_bytes if per_tensor else int(round(pp.optimizer_peak_bytes * grow)),
        forward_flops=fwd, backward_flops=(pp.backward_flops[0], pp.backward_flops[1] * fwd_grow),
        split_ends=deepen(pp.split_ends, n_layers) if pp.split_ends is not None else None,
        optimizer_options=options,
    )


@dataclass(frozen=True)
class _Base:
    """What one non-depth shape needs before depth is applied: one-layer profiles and exact counts."""

    precisions: dict            # precision -> one-layer PrecisionProfile
    param_count: int            # of the one-layer model
    layer_param_count: int
    counts: OpCounts | None
    optimizer: str


def _meta_counts(workload: Workload) -> tuple[int, int]:
    import torch

    with torch.device("meta"):
        model = workload.model()
    layers = workload.layers(model)
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return total, sum(p.numel() for p in layers[0].parameters())


def _profile_base(family: Family, values: dict, precisions: list[Precision], device_type: str,
                  optimizers: tuple[str, ...] = (), split_ends: bool = True) -> _Base:
    one = {**values, family.roles.depth: 1}
    workload = load_workload(family.spec(one))
    # In this process (no source): one warm-up for all anchors instead of worker processes per anchor.
    profile = profile_workload(dataclasses.replace(workload, source=None), precisions, device_type=device_type,
                               optimizers=optimizers, split_ends=split_ends)
    total, per_layer = _meta_counts(workload)
    # Only the optimizer choices (and split ends) asked for: a cached profile may hold more (profiled by
    # another command), and every anchor must have the same structure to be interpolated.
    kept = {p.value: _only_options(profile.for_precision(p), optimizers) for p in precisions}
    if not split_ends:
        kept = {name: _without_ends(pp) for name, pp in kept.items()}
    return _Base(precisions=kept, param_count=total,
                 layer_param_count=per_layer, counts=op_counts(workload), optimizer=profile.optimizer)


def _without_ends(pp: PrecisionProfile) -> PrecisionProfile:
    """``pp`` as profiled without split ends (a model with tied weights marked so), whatever the cache held."""
    tied = pp.split_ends is not None or pp.split_ends_skipped
    return dataclasses.replace(pp, split_ends=None, split_ends_skipped=tied)


def _only_options(pp, optimizers: tuple[str, ...]):
    wanted = {str(getattr(o, "value", o)) for o in optimizers}
    options = tuple(o for o in pp.optimizer_options if str(getattr(o.choice, "value", o.choice)) in wanted)
    return pp if options == pp.optimizer_options else dataclasses.replace(pp, optimizer_options=options)


def _interpolate(bases: list[_Base], weights: np.ndarray, exact: _Base) -> _Base:
    """A base at an off-anchor shape: quadratic interpolation of every numeric quantity.

    The optimizer step's temporaries are interpolated as a ratio and multiplied by the largest
    tensor, itself interpolated: the largest tensor is a maximum that can switch between anchors."""
    out = {}
    for name, template in bases[0].precisions.items():
        dicts = [_without_notes(dataclasses.asdict(b.precisions[name])) for b in bases]
        for d in dicts:
            _bends_on_grid(d)
        shape = _non_numeric(dicts[0])
        if any(_non_numeric(d) != shape for d in dicts):
            raise SizeError(f"{name}: the anchors' profiles differ in structure; profile shapes directly")
        values = weights @ np.array([_leaves(d) for d in dicts])
        filled = _fill(dicts[0], list(values), [0])
        _bends_pruned(filled)
        pp = Profile.from_json(json.dumps({"workload": "", "device_type": "", "param_count": 0, "n_layers": 1,
                                           "tokens_per_sample": None, "optimizer": "", "key": "", "profile_s": 0.0,
                                           "precisions": {name: filled}})).for_precision(name)
        ratios = [_opt_peak_ratio(b.precisions[name]) for b in bases]
        per_tensor = ratios[0][0] and all(r[0] for r in ratios)
        ratio = float(weights @ np.array([r[1] for r in ratios]))
        scale = _largest_grad_tensor(pp) if per_tensor else pp.grad_bytes
        out[name] = dataclasses.replace(pp, optimizer_peak_bytes=int(round(ratio * scale)))
    return dataclasses.replace(exact, precisions=out)


@dataclass(frozen=True)
class ShapeProfile:
    """The profile of one shape (built from one-layer profiles) and its operator counts for the time model."""

    profile: Profile
    counts: OpCounts | None


def shape_profiles(family: Family, shapes: list[dict], axes: list[str], precisions: list[Precision],
                   device_type: str = "cpu", progress: Callable[[str], None] | None = None,
                   optimizers: tuple[str, ...] = (), split_ends: bool = True) -> tuple[list[ShapeProfile | None], dict]:
    """One :class:`ShapeProfile` per shape (None where the model cannot be built), and how they were made.

    ``shapes`` are resolved value dicts (:meth:`Family.resolve`); ``axes`` the varied fields
    other than depth (fields that follow the width are not axes). See the module docstring for
    the method. ``optimizers``: the ``optimizer`` lever's choices to profile too; ``split_ends``: the untied ends
    of a model with tied weights, for pipeline splits (:func:`autofit.estimator.memory_model.needs_split_ends`). The dict gives ``profiled`` (one-layer profiles run or read from the cache),
    ``interpolated`` (non-depth shapes interpolated) and ``profile_s``.
    """
    started = time.perf_counter()
    depth = family.roles.depth
    keys = sorted({_key(s, depth) for s in shapes})
    axes = [f for f in axes if f != depth and len({dict(k)[f] for k in keys}) > 1]
    anchor_values = {f: _anchors(sorted({dict(k)[f] for k in keys})) for f in axes}
    combos = list(itertools.product(*(anchor_values[f] for f in axes)))
    by_axes = {tuple(dict(k)[f] for f in axes): k for k in keys}
    bases: dict[tuple, _Base | None] = {}
    direct = len(combos) >= len(keys) or not axes or any(c not in by_axes for c in combos)
    if not direct:
        anchor_bases = [_try_base(family, dict(by_axes[c]), precisions, device_type, progress, optimizers,
                                  split_ends)
                        for c in combos]
        direct = any(b is None for b in anchor_bases)
        bases.update({by_axes[c]: b for c, b in zip(combos, anchor_bases)})
    interpolated = 0
    for k in keys:
        if k in bases:
            continue
        if direct:
            bases[k] = _try_base(family, dict(k), precisions, device_type, progress, optimizers, split_ends)
            continue
        values = dict(k)
        try:
            workload = load_workload(family.spec({**values, depth: 1}))
            total, per_layer = _meta_counts(workload)
        except AutofitError:
            bases[k] = None
            continue
        weights = np.array([math.prod(lagrange_weights(anchor_values[f], values[f])[anchor_values[f].index(v)]
                                      for f, v in zip(axes, combo)) for combo in combos])
        exact = dataclasses.replace(anchor_bases[0], param_count=total, layer_param_count=per_layer,
                                    counts=op_counts(workload))
        bases[k] = _interpolate(anchor_bases, weights, exact)
        interpolated += 1
    out = [None if bases[_key(s, depth)] is None else _deepened(family, s, bases[_key(s, depth)], device_type)
           for s in shapes]
    profiled = sum(b is not None for b in bases.values()) - interpolated
    return out, {"profiled": profiled, "interpolated": interpolated, "axes": axes,
                 "profile_s": time.perf_counter() - started}


def _key(shape: dict, depth: str) -> tuple:
    return tuple(sorted((k, v) for k, v in shape.items() if k != depth))


def _anchors(values: list[int]) -> list[int]:
    if len(values) <= 3:
        return values
    return [values[0], values[len(values) // 2], values[-1]]


def _try_base(family: Family, values: dict, precisions: list[Precision], device_type: str,
              progress: Callable[[str], None] | None, optimizers: tuple[str, ...] = (),
              split_ends: bool = True) -> _Base | None:
    if progress:
        progress(f"profiling {family.spec({**values, family.roles.depth: 1})} on fake tensors")
    try:
        return _profile_base(family, values, precisions, device_type, optimizers, split_ends)
    except WorkloadError:  # a shape the model refuses (e.g. heads that do not divide the width)
        return None


def _deepened(family: Family, shape: dict, base: _Base, device_type: str) -> ShapeProfile:
    n = shape[family.roles.depth]
    counts = None
    if base.counts is not None:
        counts = OpCounts(tensors_per_layer=base.counts.tensors_per_layer[:1] * n,
                          tensors_outside=base.counts.tensors_outside)
    profile = Profile(
        workload=family.spec(shape), device_type=device_type,
        param_count=base.param_count + (n - 1) * base.layer_param_count, n_layers=n,
        tokens_per_sample=shape.get(family.roles.seq), optimizer=base.optimizer, key="scaled", profile_s=0.0,
        precisions={name: deepen(pp, n) for name, pp in base.precisions.items()},
    )
    return ShapeProfile(profile, counts)

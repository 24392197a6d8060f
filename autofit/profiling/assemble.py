"""Fit two raw runs (one per profiled micro-batch) into a :class:`~autofit.profiling.data.PrecisionProfile`.

Every quantity that grows with the micro-batch ``b`` becomes a line ``c0 + c1·b`` through its
values at the two :data:`~autofit.profiling.data.PROFILE_BATCHES`; a region's four values each
become one, and the lines of the operators highest at some micro-batch (their upper envelope, the
steepest among them) more (:class:`~autofit.profiling.data.Region`).
"""

from __future__ import annotations

import numpy as np

from autofit.core.config import Precision
from autofit.profiling.data import (
    OUTPUT_REGIONS,
    PROFILE_BATCHES,
    LayerProfile,
    Line,
    PrecisionProfile,
    Region,
    upper_envelope,
)
from autofit.profiling.raw import RawLayer, RawRegion, RawRun

__all__ = ["assemble"]


def _line(v1: float, v2: float) -> Line:
    b1, b2 = PROFILE_BATCHES
    slope = (v2 - v1) / (b2 - b1)
    return (float(v1 - slope * b1), float(slope))


def _flops_line(flops: float) -> Line:
    """FLOPs grow in proportion to the micro-batch (every op's work is per sample)."""
    return (0.0, flops / PROFILE_BATCHES[-1])


def _envelope(points1: list[int], points2: list[int]) -> tuple[Line, ...]:
    """The lines of the operators that are the region's highest at some micro-batch of 1 or more, the
    steepest last (:func:`~autofit.profiling.data.upper_envelope` of every operator's line). A region's
    highest point bends upwards with the micro-batch: where a batch-independent point (gradients being
    accumulated) is highest at small b, a per-sample one at large b, and a third in between, the line
    through the two profiled peaks and the steepest line both pass below the third (a mixture-of-experts
    backward, 2.5% under at micro-batch 8). The two runs execute the same ops in the same order, so points
    pair up one to one; empty where they do not."""
    if len(points1) != len(points2) or not points1:
        return ()
    b1, b2 = PROFILE_BATCHES
    p1, p2 = np.asarray(points1, dtype=np.float64), np.asarray(points2, dtype=np.float64)
    slope = (p2 - p1) / (b2 - b1)
    return upper_envelope(p1 - slope * b1, slope)


def _peak_lines(points1: list[int], points2: list[int], peak: Line) -> tuple[Line, tuple[Line, ...]]:
    """The line of the op whose live bytes grow fastest with the micro-batch (ties: the higher: the
    envelope's last), and the envelope's other lines beside it and ``peak`` (the line through the two
    profiled peaks). Where the runs' ops do not pair up, the fitted peak is all that can be said."""
    envelope = _envelope(points1, points2)
    if not envelope:
        return _line(max(points1, default=0), max(points2, default=0)), ()
    steep = envelope[-1]
    return steep, tuple(line for line in envelope
                        if not any(np.allclose(line, known, rtol=0, atol=0.5) for known in (peak, steep)))


def _region_lines(r1: RawRegion, r2: RawRegion) -> Region:
    lines = [_line(a, b) for a, b in zip(r1[:4], r2[:4])]
    steep, bends = _peak_lines(r1.points, r2.points, lines[1])
    steep_ng, bends_ng = _peak_lines(r1.points_nongrad, r2.points_nongrad, lines[3])
    return Region(*lines, steep=steep, steep_nongrad=steep_ng, bends=bends, bends_nongrad=bends_ng)


def _both(r1: RawRegion | None, r2: RawRegion | None) -> Region | None:
    """The region's lines where both runs have it, else None."""
    return _region_lines(r1, r2) if r1 is not None and r2 is not None else None


def _layer(l1: RawLayer, l2: RawLayer) -> LayerProfile:
    return LayerProfile(
        param_bytes=l1.param_bytes, grad_bytes=l1.grad_bytes,
        output=_line(l1.output, l2.output), output_saved=l1.output_saved,
        max_grad_tensor_bytes=l1.max_grad_tensor_bytes, grad_rows=l1.grad_rows,
        forward=_region_lines(l1.forward, l2.forward),
        recompute=_region_lines(l1.recompute, l2.recompute),
        checkpointed_forward=_region_lines(l1.checkpointed_forward, l2.checkpointed_forward),
        backward=_region_lines(l1.backward, l2.backward), after=_line(l1.after, l2.after),
        backward_grad_kept=_both(l1.backward_grad_kept, l2.backward_grad_kept),
        backward_output_kept=_both(l1.backward_output_kept, l2.backward_output_kept),
        input_freed_late=_line(l1.input_freed_late, l2.input_freed_late),
        args_freed_late=_line(l1.args_freed_late, l2.args_freed_late),
        forward_flops=_flops_line(l2.forward_flops),
        selective_forward=_region_lines(l1.selective_forward, l2.selective_forward),
        selective_kept=_line(l1.selective_kept, l2.selective_kept),
        selective_output_kept=l1.selective_output_kept and l2.selective_output_kept,
        selective_saved_flops=_flops_line(l2.selective_saved_flops),
        selective_recompute=_both(l1.selective_recompute, l2.selective_recompute),
        selective_recompute_prefix=_both(l1.selective_recompute_prefix, l2.selective_recompute_prefix),
        retained=_line(l1.retained, l2.retained),
        retained_recomputed_inner=_line(l1.retained_recomputed_inner, l2.retained_recomputed_inner),
        retained_recomputed=_line(l1.retained_recomputed, l2.retained_recomputed),
        recomputed_input_kept=_line(l1.recomputed_input_kept, l2.recomputed_input_kept),
        recomputed_args_kept=_line(l1.recomputed_args_kept, l2.recomputed_args_kept),
    )


def _output_regions(r1: RawRun, r2: RawRun) -> dict[str, Region]:
    """The regions cut at the model's output, where both runs have them."""
    pairs = {k: (getattr(r1, k), getattr(r2, k)) for k in OUTPUT_REGIONS}
    return {k: _region_lines(a, b) for k, (a, b) in pairs.items() if a is not None and b is not None}


def assemble(precision: Precision, runs: dict[int, RawRun], real_check: str = "",
             real_extra_bytes_per_sample: float = 0.0) -> PrecisionProfile:
    """The profile of ``precision`` from its runs at the two profiled micro-batches (the larger one
    with the optimizer step) and the real check's note and extra bytes per sample."""
    r1, r2 = runs[PROFILE_BATCHES[0]], runs[PROFILE_BATCHES[1]]
    return PrecisionProfile(
        precision=precision.value,
        static_param_bytes=r1.static_param_bytes, grad_bytes=r1.grad_bytes,
        optimizer_bytes=r2.optimizer_bytes, optimizer_peak_bytes=max(0, r2.opt_region.peak), grad_rows=r1.grad_rows,
        pre_param_bytes=r1.pre_param_bytes, post_param_bytes=r1.post_param_bytes, pre_buffer_bytes=r1.pre_buffer_bytes,
        pre_grad_bytes=r1.pre_grad_bytes, post_grad_bytes=r1.post_grad_bytes,
        pre_max_grad_tensor_bytes=r1.pre_max_grad_tensor_bytes,
        post_max_grad_tensor_bytes=r1.post_max_grad_tensor_bytes,
        pre_forward=_region_lines(r1.pre_forward, r2.pre_forward),
        post_forward=_region_lines(r1.post_forward, r2.post_forward),
        post_backward=_region_lines(r1.post_backward, r2.post_backward),
        **_output_regions(r1, r2),
        pre_backward=_region_lines(r1.pre_backward, r2.pre_backward),
        input_bytes=_line(r1.input_bytes, r2.input_bytes),
        kept_bytes=_line(r1.kept_bytes, r2.kept_bytes),
        layer_args=_line(r1.layer_args, r2.layer_args),
        layers=tuple(_layer(l1, l2) for l1, l2 in zip(r1.layers, r2.layers)),
        forward_flops=_flops_line(r2.forward_flops),
        backward_flops=_flops_line(r2.backward_flops),
        optimizer_flops=0.0, real_check=real_check, real_extra_bytes_per_sample=real_extra_bytes_per_sample,
        routing=r1.routing or r2.routing,
    )


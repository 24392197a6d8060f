"""What one profiled step measures, before the two micro-batch sizes are fitted into lines.

A traced step (:mod:`autofit.profiling.step`) gives a :class:`RawRun` of plain integers at one
micro-batch; the real check (:mod:`autofit.profiling.real_check`) corrects the regions of such runs;
:mod:`autofit.profiling.assemble` fits two of them into a
:class:`~autofit.profiling.data.PrecisionProfile`. Nothing here is cached: the profile is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["RawLayer", "RawRegion", "RawRun"]


class RawRegion(NamedTuple):
    """A stretch of the timeline between two marks, in bytes relative to its start."""

    delta: int            # live bytes at the end minus at the start
    peak: int             # the highest live bytes above the start
    delta_nongrad: int    # the same for live bytes without parameter gradients
    peak_nongrad: int
    points: list[int]     # live bytes above the start after every operator
    points_nongrad: list[int]


# A stretch with nothing in it (read only: its lists are shared).
EMPTY_REGION = RawRegion(0, 0, 0, 0, [0], [0])


@dataclass(frozen=True)
class RawLayer:
    """One layer's part of a :class:`RawRun` (:class:`~autofit.profiling.data.LayerProfile`'s fields, unfitted)."""

    param_bytes: int
    grad_bytes: int
    max_grad_tensor_bytes: int
    grad_rows: tuple[tuple[int, int], ...]
    output: int
    output_saved: bool
    forward: RawRegion
    recompute: RawRegion
    checkpointed_forward: RawRegion
    after: int
    backward: RawRegion
    input_freed_late: int
    args_freed_late: int
    forward_flops: float
    selective_forward: RawRegion
    selective_kept: int
    selective_output_kept: bool
    selective_saved_flops: float
    # its forward as a selective segment's recomputation runs it (kept outputs handed back, not made):
    # whole, and up to the last tensor it saves
    # (None where the forward does not replay: the estimate then counts the kept outputs as made again)
    selective_recompute: RawRegion | None = None
    selective_recompute_prefix: RawRegion | None = None
    # what its checkpointed forward left alive beyond its output once the model's forward returned
    # (a key/value cache the model returns), net of what it replaced there
    retained: int = 0
    # what its recomputation in a checkpointed segment's backward leaves alive until the model's output is
    # dropped (the cache grown again, the recomputed graph behind it): with its output held, and once dropped
    retained_recomputed_inner: int = 0
    retained_recomputed: int = 0
    recomputed_input_kept: int = 0  # its input, where that graph keeps it
    recomputed_args_kept: int = 0  # its other arguments first taken there (rotary tables), where it keeps them
    # its backward as a pipeline stage ending with it runs it: its output's gradient kept to the end, and its
    # output too (StepTrace.backward_kept; None in a run traced without them)
    backward_grad_kept: RawRegion | None = None
    backward_output_kept: RawRegion | None = None


@dataclass(frozen=True)
class RawRun:
    """One profiled micro-step at one micro-batch (:class:`~autofit.profiling.data.PrecisionProfile`'s
    fields, unfitted). A run without the optimizer step has no ``optimizer_bytes`` nor ``opt_region``
    (None): neither depends on the micro-batch, so one run of the two holds them."""

    static_param_bytes: int
    grad_bytes: int
    grad_rows: tuple[tuple[int, int], ...]
    pre_param_bytes: int
    tied_bytes: int  # weights used before and after the layers (a tied embedding and head)
    pre_buffer_bytes: int  # buffers used before the layers (rotary frequencies)
    post_param_bytes: int
    pre_grad_bytes: int
    post_grad_bytes: int
    pre_max_grad_tensor_bytes: int
    post_max_grad_tensor_bytes: int
    pre_forward: RawRegion
    post_forward: RawRegion
    post_backward: RawRegion
    pre_backward: RawRegion
    forward_flops: float
    backward_flops: float
    input_bytes: int
    step_peak_bytes: int
    layers: tuple[RawLayer, ...]
    # post_forward and post_backward cut at the model's output (None where it has no gradient)
    head_forward: RawRegion | None = None
    loss_forward: RawRegion | None = None
    loss_backward: RawRegion | None = None
    head_backward: RawRegion | None = None
    optimizer_bytes: int | None = None
    opt_region: RawRegion | None = None
    # on CUDA, an RNN whose cuDNN kernels refuse fake tensors was run on its native kernels instead
    cudnn_off: bool = False
    # what the step before left alive for this one beyond weights, gradients and optimizer state (a hook's
    # stash, a buffer the forward replaced); this step was traced with it alive from the start
    kept_bytes: int = 0
    # what the first layer is called with beyond its input that is neither a weight nor a buffer (rotary
    # tables, position ids): made before the layers, and made again by each later pipeline stage
    layer_args: int = 0
    routing: str = ""  # the routing assumption the step ran under (autofit.profiling.routing), "" without a top-k

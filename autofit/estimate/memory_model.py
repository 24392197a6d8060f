"""The analytic memory model: a profile and configs in, per-device peak bytes out.

The profile (:mod:`autofit.profiling`) cut one real micro-step into regions. Here those regions
are laid end to end again for any config, as PyTorch would run it:

- gradients: set to None before the first micro-step and grown during its backward; later
  accumulation micro-steps start with all of them (``*_nongrad`` regions + all gradients);
- checkpointing (non-reentrant, segments of k layers): the forward keeps only each segment's
  output, which the checkpoint of the next segment keeps as its input (one tensor, counted once)
  until that segment's backward is done, whether or not a layer saved it (so are its other
  arguments, e.g. an encoder's output each decoder layer takes, and an input whose last Python
  reference the unchecked profile saw die as the model returned); the backward of a
  segment first recomputes its forward, stopping at the last tensor the segment saves (early
  stop: an output nothing saves is not made again), then runs its backward. A segment's first
  forward saves nothing, so its peak is the profile's ``checkpointed_forward``, not ``forward``;
- device split: stage s holds its layers (plus the embedding on the first stage and the head
  on the last), and under 1F1B up to ``min(grad_accum, p - s)`` micro-batches in flight
  (GPipe: all ``grad_accum``) during its forwards and first backward, one fewer once later
  micro-steps run with the gradients made (:func:`in_flight_later`); its receive buffers
  live through the optimizer step; an earlier stage's output and that output's gradient live
  until the micro-batch's backward returns (the unsplit profile saw its last layer free them:
  :func:`_walk_stage` adds them back from that layer's backward on); a weight tied across the model's ends (embedding and head)
  is one copy per end stage, each with its own gradient: the ends come from the profile of the
  untied model (``PrecisionProfile.split_ends``);
- the optimizer step: weights + gradients + state + the step's own temporaries;
- on CUDA: the cuBLAS workspaces (allocated, but no tensor of the model), the allocator's
  fragmentation (reserved over allocated) and the context, which ``max_memory_reserved`` does not
  see: the estimate is what the card holds, ``max_memory_reserved`` + context
  (:class:`autofit.probes.cuda_overhead.CudaOverhead`, measured on the device where there is one).

Every quantity is a line ``c0 + c1·b`` in the micro-batch b, so for one structure (precision,
checkpoint interval, split) the peak is the upper envelope of a few dozen lines, evaluated for
all micro-batches and accumulation counts at once with numpy. A region contributes two lines
(its peak at the profiled sizes and its steepest operator), since the operator that sets a
region's peak can change with b. ``tests/estimate/test_memory_model_golden.py`` checks the result
byte for byte against hand arithmetic on a stack of Linear layers.

Known limitations: a region whose peak changes operator
twice beyond the profiled sizes is under-estimated between the changes; pipeline runtime
buffers are modelled as one received activation and one received gradient per micro-batch;
the CUDA fragmentation is a constant share (10%) until a search calibrates it. The profile runs on
fake tensors, so a CPU kernel that keeps a larger storage than its meta kernel says is missed
(``F.mse_loss`` on the CPU returns its 0-dim mean in the b x n buffer of the unreduced loss);
each accumulation micro-step's detached loss (a few bytes) is not counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import pandas as pd

from autofit.core.config import (
    FIELDS,
    PipelineSchedule,
    Precision,
    SplitMode,
    TrainConfig,
    stage_bounds,
)
from autofit.core.errors import ConfigError, ProfileError
from autofit.estimate.fsdp_memory import FSDP_EXTRA_COLUMNS, score_fsdp
from autofit.probes.cuda_overhead import (
    FALLBACK_CONTEXT_BYTES,
    FRAGMENTATION,
    CudaOverhead,
    fallback_overhead,
)
from autofit.profiling.data import (
    Line,
    PrecisionProfile,
    Profile,
    Region,
    segment_freed_late,
)

# Fallbacks, used only where the device cannot be measured (autofit.probes.cuda_overhead measures both on
# the device in use: the device probe child, cached with its rates).
CUDA_CONTEXT_BYTES = FALLBACK_CONTEXT_BYTES
CUDA_FRAGMENTATION = FRAGMENTATION

SCHEDULES = tuple(PipelineSchedule)  # the one enum, shared with autofit.trial.pipeline
BREAKDOWN = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "temporary_bytes", "overhead_bytes")


@dataclass(frozen=True)
class MemoryEstimate:
    """The predicted peak of one config, with the breakdown at the peak of the largest device."""

    workload: str
    device_type: str
    config: TrainConfig
    param_count: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    temporary_bytes: int
    overhead_bytes: int
    model_state_bytes: int          # weights + gradients + optimizer state of the whole model
    peak_bytes: int                 # the largest device's peak
    per_device_peak_bytes: tuple[int, ...]
    peak_phase: str                 # forward/backward of the first or a later micro-step, or optimizer
    budget_bytes: int | None = None
    fits: bool | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    shard_bytes: int | None = None      # fsdp: weights, gradients, optimizer state shards and buffers per rank
    gathered_bytes: int | None = None   # fsdp: whole weights of the units computing at the peak

    def to_dict(self) -> dict:
        """JSON-ready; the field names are a public contract."""
        out = {
            "workload": self.workload, "device_type": self.device_type, "budget_bytes": self.budget_bytes,
            "config": self.config.to_dict(), "param_count": self.param_count,
        }
        out.update({name: getattr(self, name) for name in BREAKDOWN})
        out.update({
            "model_state_bytes": self.model_state_bytes, "peak_bytes": self.peak_bytes,
            "per_device_peak_bytes": list(self.per_device_peak_bytes), "peak_phase": self.peak_phase,
            "fits": self.fits, "notes": list(self.notes),
            "shard_bytes": self.shard_bytes, "gathered_bytes": self.gathered_bytes,
        })
        return out


# --------------------------------------------------------------------------------------
# One stage's micro-step as lines.


def _add(a: Line, b: Line, scale: float = 1.0) -> Line:
    return (a[0] + scale * b[0], a[1] + scale * b[1])


@dataclass(frozen=True)
class _StageLines:
    """Peaks of one stage's micro-step, relative to the stage's weights + optimizer state.

    ``first``: lines for the first micro-step (no gradients at its start), with the
    gradients alive at each peak and the activations held at its start;
    ``later``: lines for later micro-steps, relative to weights + state + all gradients.
    """

    first: np.ndarray          # (E, 2) c0, c1
    first_grads: np.ndarray    # (E,) gradient bytes alive at each line's peak (upper bound)
    first_acts: np.ndarray     # (E, 2) activations held at the start of each region
    first_phase: tuple
    later: np.ndarray
    later_acts: np.ndarray
    later_phase: tuple
    held: Line                 # one micro-batch's activations at the end of its forward
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    optimizer_peak_bytes: int


class _Walk:
    """Accumulates region lines along a stage's timeline."""

    def __init__(self) -> None:
        self.live: Line = (0.0, 0.0)       # above weights + state (+ all grads for later steps)
        self.grads: float = 0.0            # gradients made so far in this micro-step (within live)
        self.peaks: list[Line] = []
        self.grads_at: list[float] = []
        self.acts_at: list[Line] = []
        self.phases: list[str] = []

    def region(self, peaks: tuple[Line, ...], delta: Line, phase: str, grads: float = 0.0,
               held: Line = (0.0, 0.0)) -> None:
        """A region starting at the current live bytes (plus ``held``, alive only during it)."""
        for peak in peaks:  # each a lower bound of the region's peak; the envelope is the peak
            self.peaks.append(_add(_add(self.live, held), peak))
            self.grads_at.append(self.grads + grads)
            self.acts_at.append((self.live[0] - self.grads, self.live[1]))  # live counts the gradients made so far
            self.phases.append(phase)
        self.live = _add(self.live, delta)
        self.grads += grads


def _walk_stage(pp: PrecisionProfile, start: int, end: int, first_stage: bool, last_stage: bool,
                every: int, later: bool) -> tuple[_Walk, Line]:
    """Lay one micro-step of a stage end to end; returns the walk and the activations held after forward."""
    w = _Walk()
    layers = pp.layers

    def fwd(r: Region):
        return r.peaks, r.delta

    def bwd(r: Region):
        return (r.peaks_nongrad, r.delta_nongrad) if later else (r.peaks, r.delta)

    # forward
    if first_stage:  # a later stage's input lives in the pipeline's receive buffers (see _pipeline_buffers)
        w.region(*fwd(pp.pre_forward), "forward")
    segments = [(s, min(s + every, end)) for s in range(start, end, every)] if every else []
    # Under autocast, the half-precision weight copies are cached until the autocast region
    # ends, even in checkpointed segments that keep nothing else: the batch-independent part
    # of a layer's forward (its weight casts) stays until the end of the forward. The profile
    # (not checkpointed) saw the copies its backward needs (``saved``: what the layer's
    # backward frees that does not grow with the batch) outlive the region; the others (e.g.
    # bias copies) were freed at its end, in ``post_forward``. Checkpointed, the saved ones
    # are freed too; a segment's recomputation builds them all again and frees the others.
    amp = Precision(pp.precision).is_amp
    cache = [max(0.0, layers[i].forward.delta[0]) if amp and every else 0.0 for i in range(len(layers))]
    saved = [min(cache[i], max(0.0, -layers[i].backward.delta_nongrad[0])) for i in range(len(layers))]
    if every:
        for s, e in segments:
            for i in range(s, e):
                held_in_segment = layers[i - 1].output if i > s else (0.0, 0.0)
                w.region(layers[i].forward_checkpointed().peaks, (cache[i], 0.0), "forward", held=held_in_segment)
            w.live = _add(w.live, layers[e - 1].output)  # only the segment's output survives
    else:
        for i in range(start, end):
            w.region(*fwd(layers[i].forward), "forward")
            if first_stage or i > start:  # a later stage's input stays in its receive buffer
                w.live = _add(w.live, layers[i].after)
    # Segment arguments the unsplit, unchecked profile saw die as the model's forward returned (in
    # post_forward, where no backward kept them): each checkpoint keeps its own until its backward.
    late = [segment_freed_late(layers, s, e) for s, e in segments]
    late_total = (sum(l[0] for l in late), sum(l[1] for l in late))
    if last_stage:
        w.region(*fwd(pp.post_forward), "forward", held=late_total)  # alive through it, freed before its peak or not
        w.live = _add(w.live, late_total)
    w.live = _add(w.live, (-sum(saved[start:end]), 0.0))  # autocast exits: its cache is freed
    held = w.live
    # backward
    if last_stage:  # an earlier stage's output gradient arrives in a receive buffer
        w.region(*bwd(pp.post_backward), "backward", 0.0 if later else pp.post_grad_bytes)
    grad_of = (lambda i: 0.0) if later else (lambda i: layers[i].grad_bytes)
    # An earlier stage's output is an end of its autograd graph: the pipeline schedule keeps it
    # (its forward cache) until the micro-batch's backward returns, and the output's gradient
    # lives in a receive buffer (counted in _pipeline_buffers). The profile saw the last layer's
    # backward free both: the gradient always, the output too where the layer saves it (a final
    # ReLU). Here neither is freed: add them back from the end of that backward on. Inside it,
    # the profile's peak is kept: a lower bound, since it cannot say whether the peak came
    # before those frees (nn.LSTM's fused backward) or after them (a conv block's, where stage 0
    # of convnet-bn without checkpointing stays ~2% under); counting them through the whole
    # region instead over-estimates a Linear+ReLU stack by 8%.
    boundary = layers[end - 1].output if not last_stage else (0.0, 0.0)

    def layer_backward(i: int, output_freed: bool) -> None:
        w.region(*bwd(layers[i].backward), "backward", grad_of(i))
        if i == end - 1:
            w.live = _add(w.live, _add(boundary, boundary, 1.0 if output_freed else 0.0))

    if every:
        for s, e in reversed(segments):
            # The segment's forward output is not kept twice: either recomputation stops before
            # it (nothing in the segment saves it) or, when a layer saves its own output (a final
            # ReLU), the original was freed with the next segment's saved inputs and the
            # recomputed copy takes its place. A stage's own output is not freed (see above):
            # its recomputed copy adds to it, and the layer's backward frees only that copy.
            stage_output_kept = not last_stage and e == end and layers[e - 1].output_saved
            if layers[e - 1].output_saved and not stage_output_kept:
                w.live = _add(w.live, layers[e - 1].output, -1.0)
            for i in range(s, e):  # recompute the segment's forward, saving its activations
                w.region(layers[i].recomputed(last=i == e - 1).peaks, layers[i].forward.delta, "backward")
                if i > s:  # the segment's input is the checkpoint's
                    w.live = _add(w.live, layers[i].after)
            w.live = _add(w.live, (-sum(cache[s:e]) + sum(saved[s:e]), 0.0))  # recompute's autocast exits
            if not layers[e - 1].output_saved:
                w.live = _add(w.live, layers[e - 1].output, -1.0)
            for i in reversed(range(s, e)):  # the recomputed output is freed, the stage's own kept
                layer_backward(i, output_freed=False)
            # The checkpoint kept the segment's input until its backward is done; where no layer
            # saves it (linear(relu(x))), the profile's backward did not free it (its forward did,
            # in ``after``): free it now. A later stage's input stays in its receive buffer.
            if first_stage or s > start:
                w.live = _add(w.live, layers[s].after)
            if last_stage:
                w.live = _add(w.live, segment_freed_late(layers, s, e), -1.0)
    else:
        for i in reversed(range(start, end)):
            layer_backward(i, output_freed=layers[i].output_saved)
    if first_stage:
        w.region(*bwd(pp.pre_backward), "backward", 0.0 if later else pp.pre_grad_bytes)
    return w, held


@lru_cache(maxsize=4096)
def _stage_lines(pp: PrecisionProfile, start: int, end: int, first_stage: bool, last_stage: bool,
                 every: int) -> _StageLines:
    w1, held = _walk_stage(pp, start, end, first_stage, last_stage, every, later=False)
    wn, _ = _walk_stage(pp, start, end, first_stage, last_stage, every, later=True)
    params = sum(l.param_bytes for l in pp.layers[start:end])
    grads = sum(l.grad_bytes for l in pp.layers[start:end])
    whole = first_stage and last_stage
    if whole:
        params, grads = pp.static_param_bytes, pp.grad_bytes
    else:
        if first_stage:
            params, grads = params + pp.pre_param_bytes, grads + pp.pre_grad_bytes
        if last_stage:
            params, grads = params + pp.post_param_bytes, grads + pp.post_grad_bytes
    # Optimizer state scales with the gradients the stage owns. Its step's temporaries do too
    # for a multi-tensor (foreach) step; a per-tensor loop's peak is set by the largest tensor.
    share = grads / pp.grad_bytes if pp.grad_bytes else 1.0
    largest = max([l.max_grad_tensor_bytes for l in pp.layers[start:end]]
                  + ([pp.pre_max_grad_tensor_bytes] if first_stage else [])
                  + ([pp.post_max_grad_tensor_bytes] if last_stage else []), default=0)
    overall = max([l.max_grad_tensor_bytes for l in pp.layers] + [pp.pre_max_grad_tensor_bytes, pp.post_max_grad_tensor_bytes])
    per_tensor_loop = overall and pp.optimizer_peak_bytes <= 4 * overall
    opt_share = largest / overall if per_tensor_loop else share
    return _StageLines(
        first=np.array(w1.peaks, dtype=np.float64), first_grads=np.array(w1.grads_at, dtype=np.float64),
        first_acts=np.array(w1.acts_at, dtype=np.float64), first_phase=tuple(f"first {p}" for p in w1.phases),
        later=np.array(wn.peaks, dtype=np.float64), later_acts=np.array(wn.acts_at, dtype=np.float64),
        later_phase=tuple(f"later {p}" for p in wn.phases),
        held=held, params_bytes=int(params), grads_bytes=int(grads),
        optimizer_bytes=int(round(pp.optimizer_bytes * share)),
        optimizer_peak_bytes=int(round(pp.optimizer_peak_bytes * opt_share)),
    )


def _pipeline_buffers(pp: PrecisionProfile, start: int, end: int, stage: int, split: int,
                      k: np.ndarray, b: np.ndarray, schedule: PipelineSchedule) -> tuple[np.ndarray, np.ndarray]:
    """Bytes torch.distributed.pipelining keeps on a stage: ``(kept, pending)``. ``kept``: one
    receive buffer per micro-batch for the input activation (later stages) and for the output's
    gradient (earlier stages), allocated once and alive through the optimizer step too;
    ``pending``: sends keep one more boundary tensor alive during the micro-steps (measured
    on torch 2.13's 1F1B: an earlier stage's first output once it runs ahead, a later
    stage's last input gradient)."""
    kept, pending = np.zeros_like(b), np.zeros_like(b)
    if split == 1:
        return kept, pending
    kf = k.astype(np.float64)
    if stage > 0:
        c0, c1 = pp.layers[start - 1].output
        boundary = c0 + c1 * b
        kept = kept + kf * boundary
        # the input gradient sent back stays referenced by its send until the next micro-batch's
        pending = pending + np.where(k > 1, boundary, 0.0)
    if stage < split - 1:
        c0, c1 = pp.layers[end - 1].output
        boundary = c0 + c1 * b
        kept = kept + kf * boundary
        if PipelineSchedule(schedule) is PipelineSchedule.ONE_F_ONE_B:
            pending = pending + np.where(k > split - stage, boundary, 0.0)
    return kept, pending


def in_flight(stage: int, device_split: int, grad_accum: np.ndarray,
              schedule: PipelineSchedule | str = PipelineSchedule.ONE_F_ONE_B) -> np.ndarray:
    """Micro-batches whose activations stage ``stage`` holds at once (Narayanan et al. SC'21):
    during every forward before its first backward, and during the first backward."""
    if device_split == 1:
        return np.ones_like(grad_accum)
    if PipelineSchedule(schedule) is PipelineSchedule.GPIPE:
        return grad_accum
    return np.minimum(grad_accum, device_split - stage)


def in_flight_later(stage: int, device_split: int, grad_accum: np.ndarray,
                    schedule: PipelineSchedule | str = PipelineSchedule.ONE_F_ONE_B) -> np.ndarray:
    """Micro-batches stage ``stage`` holds at once while any later micro-step runs with the
    gradients already made (its backward, and a forward that follows a backward), at least 1.

    Both schedules run the backwards in micro-batch order, each freeing its micro-batch. GPipe
    runs every forward first: backward j starts with k - j in flight. 1F1B (torch's
    ``Schedule1F1B``: p - s warm-up forwards, then backward i, forward i + p - s, ...) starts
    backward j with min(k - j, p - s) in flight, and each steady-state forward with p - s.
    For j >= 1: GPipe k - 1, 1F1B min(k - 1, p - s). Forwards before the first backward hold
    no gradients yet: the first micro-step's walk (with :func:`in_flight`) covers them."""
    k = np.asarray(grad_accum)
    if device_split == 1:
        return np.ones_like(k)
    if PipelineSchedule(schedule) is PipelineSchedule.GPIPE:
        return np.maximum(k - 1, 1)
    return np.maximum(np.minimum(k - 1, device_split - stage), 1)


# --------------------------------------------------------------------------------------
# Vectorized scoring.


def estimate_table(profile: Profile, configs: list[TrainConfig], budget_bytes: int | None = None,
                   schedule: PipelineSchedule | str = PipelineSchedule.ONE_F_ONE_B,
                   overhead: CudaOverhead | None = None) -> pd.DataFrame:
    """Score many configs at once. One row per config, in the given order.

    ``overhead``: the CUDA device's measured context and workspace (``DeviceRates.memory_overhead()``);
    None on CUDA means the fallback constants (:func:`autofit.probes.cuda_overhead.fallback_overhead`).

    Columns: the five config fields, the six breakdown categories (at the largest device's
    peak), ``model_state_bytes``, ``peak_bytes``, ``per_device_peak_bytes`` (a tuple),
    ``peak_phase``, ``fits`` (None without a budget) and ``valid`` / ``reason`` (False with a
    reason when the config cannot run at all, e.g. more stages than layers; its peak is NaN).
    Raises KeyError if the profile lacks a precision in ``configs``, ProfileError if it lacks the
    split ends a pipeline split of a model with tied weights needs (:func:`needs_split_ends`).
    """
    n = len(configs)
    cols = {f: np.array([getattr(getattr(c, f), "value", getattr(c, f)) for c in configs]) for f in FIELDS}
    out = {k: np.zeros(n, dtype=np.float64) for k in BREAKDOWN + ("peak_bytes",)}
    per_device = np.empty(n, dtype=object)
    phase = np.empty(n, dtype=object)
    valid = np.ones(n, dtype=bool)
    reason = np.full(n, "", dtype=object)
    extra = {name: np.full(n, np.nan) for name in FSDP_EXTRA_COLUMNS}
    for (precision, every, split, mode), members in _structures(configs).items():
        idx = np.array(members, dtype=np.int64)
        if mode is SplitMode.FSDP and split > 1:
            _score_fsdp_group(profile, profile.for_precision(precision), overhead or fallback_overhead(), every, split,
                              cols["micro_batch"][idx].astype(np.float64), cols["grad_accum"][idx].astype(np.int64),
                              idx, out, extra, per_device, phase)
            continue
        if split > profile.n_layers:
            valid[idx] = False
            reason[idx] = (f"device_split {split} > {profile.n_layers} layers: each pipeline stage needs at least "
                           f"one layer (device_split 1 to {profile.n_layers})")
            out["peak_bytes"][idx] = np.nan
            per_device[idx] = [()] * len(idx)
            continue
        pp = profile.for_precision(precision)
        if split > 1 and pp.split_ends_skipped and not profile.split_refusal:
            raise ProfileError(
                f"{profile.workload} {precision.value}: device_split {split} (pipeline) needs the profile's split ends "
                "(each end stage holds its own copy of the weights tied across the model's ends), but it was made "
                "with split_ends=False; profile with profile_workload(..., split_ends=True)")
        _score_group(profile, pp, overhead or fallback_overhead(), min(every, profile.n_layers), split,
                     cols["micro_batch"][idx].astype(np.float64), cols["grad_accum"][idx].astype(np.int64),
                     schedule, idx, out, per_device, phase)
    _refuse_splits(profile, configs, valid, reason)
    table = pd.DataFrame({f: cols[f] for f in FIELDS})
    for k in BREAKDOWN + ("peak_bytes",):
        table[k] = out[k]
    for name in FSDP_EXTRA_COLUMNS:  # fsdp rows only: all shards, and the whole weights at the peak
        table[name] = extra[name]
    table["model_state_bytes"] = [_model_state(profile, p) for p in cols["precision"]] if n else []
    table["per_device_peak_bytes"] = per_device
    table["peak_phase"] = phase
    table["valid"] = valid
    table["reason"] = reason
    table["fits"] = (table["peak_bytes"] <= budget_bytes) & valid if budget_bytes is not None else None
    return table


def needs_split_ends(configs: Iterable[TrainConfig]) -> bool:
    """Whether estimating ``configs`` needs the profile's split ends (``profile_workload(split_ends=...)``):
    only a pipeline split gives its end stages their own copy of a tied weight (FSDP keeps it tied)."""
    return any(c.device_split > 1 and c.split_mode is SplitMode.PIPELINE for c in configs)


def _structures(configs: list[TrainConfig]) -> dict[tuple[Precision, int, int, SplitMode], list[int]]:
    """Config indices grouped by what fixes the peak's lines: (precision, checkpoint interval, split, mode)."""
    groups: dict[tuple[Precision, int, int, SplitMode], list[int]] = {}
    for i, c in enumerate(configs):
        groups.setdefault((c.precision, c.checkpoint_every, c.device_split, c.split_mode), []).append(i)
    return groups


def _score_fsdp_group(profile: Profile, pp: PrecisionProfile, cuda_overhead: CudaOverhead, every: int, ranks: int,
                      b: np.ndarray, k: np.ndarray, idx: np.ndarray, out: dict, extra: dict, per_device, phase) -> None:
    # Every rank holds the same; rank 0 (the largest optimizer-state shard) stands for all. The
    # cuBLAS workspace is a block of its own: it goes with the context, outside the fragmentation.
    scored = score_fsdp(pp, ranks, min(every, profile.n_layers), b, k, cuda=profile.device_type == "cuda",
                        context_bytes=cuda_overhead.context_bytes + cuda_overhead.workspace_bytes,
                        fragmentation=cuda_overhead.fragmentation)
    for name in BREAKDOWN + ("peak_bytes",):
        out[name][idx] = scored[name]
    for name in FSDP_EXTRA_COLUMNS:
        extra[name][idx] = scored[name]
    per_device[idx] = [(int(round(p)),) * ranks for p in scored["peak_bytes"]]
    phase[idx] = scored["phase"]


def _refuse_splits(profile: Profile, configs: list[TrainConfig], valid: np.ndarray, reason: np.ndarray) -> None:
    """Pipeline splits of a model that cannot be cut (``profile.split_refusal``) cannot run: invalid, with why."""
    refusal = getattr(profile, "split_refusal", None)
    if not refusal:
        return
    for i, c in enumerate(configs):
        if c.device_split > 1 and getattr(getattr(c, "split_mode", None), "value", "pipeline") == "pipeline":
            valid[i] = False
            reason[i] = refusal


def _model_state(profile: Profile, precision: str) -> int:
    pp = profile.for_precision(precision)
    return pp.static_param_bytes + pp.grad_bytes + pp.optimizer_bytes


def _score_group(profile: Profile, pp: PrecisionProfile, cuda_overhead: CudaOverhead, every: int, split: int,
                 b: np.ndarray,
                 k: np.ndarray, schedule: PipelineSchedule | str, idx: np.ndarray, out: dict, per_device, phase) -> None:
    cuda = profile.device_type == "cuda"
    n = len(idx)
    best = np.full(n, -np.inf)
    best_parts = {name: np.zeros(n) for name in BREAKDOWN}
    best_phase = np.empty(n, dtype=object)
    stage_peaks = []
    ends = (pp.split_ends or pp) if split > 1 else pp  # a split holds its own copy of each tied weight
    for s, (start, end) in enumerate(stage_bounds(profile.n_layers, split)):
        st = _stage_lines(ends, start, end, s == 0, s == split - 1, every)
        one = st.held[0] + st.held[1] * b                             # one micro-batch's activations
        kept, pending = _pipeline_buffers(ends, start, end, s, split, k, b, schedule)
        buffers = kept + pending
        # other micro-batches in flight: during the first micro-step, and during later ones
        held = one * (in_flight(s, split, k, schedule) - 1) + buffers
        held_later = one * (in_flight_later(s, split, k, schedule) - 1) + buffers
        base = st.params_bytes + st.optimizer_bytes
        v1 = st.first[:, 0][None, :] + st.first[:, 1][None, :] * b[:, None]        # (n, E)
        a1 = np.argmax(v1, axis=1)
        peak1 = base + v1[np.arange(n), a1] + held
        vn = st.later[:, 0][None, :] + st.later[:, 1][None, :] * b[:, None]
        an = np.argmax(vn, axis=1)
        # A stage in a pipeline runs later micro-steps while gradients exist from the first backward on.
        has_later = (k > 1)
        peakn = np.where(has_later, base + st.grads_bytes + vn[np.arange(n), an] + held_later, -np.inf)
        peak_opt = base + st.grads_bytes + st.optimizer_peak_bytes + kept  # receive buffers outlive the step
        stage_peak = np.maximum(np.maximum(peak1, peakn), peak_opt)
        input_bytes = (pp.input_bytes[0] + pp.input_bytes[1] * b) if (cuda and s == 0) else 0.0
        # The workspaces are allocated blocks of their own (no fragmentation); the context is outside the allocator.
        overhead = (cuda_overhead.context_bytes + cuda_overhead.workspace_bytes
                    + cuda_overhead.fragmentation * (stage_peak + input_bytes)) if cuda else np.zeros(n)
        stage_total = stage_peak + input_bytes + overhead
        stage_peaks.append(stage_total)
        # Breakdown at this stage's peak.
        acts1 = st.first_acts[a1, 0] + st.first_acts[a1, 1] * b + held
        actsn = st.later_acts[an, 0] + st.later_acts[an, 1] * b + held_later
        is1 = peak1 >= np.maximum(peakn, peak_opt)
        isn = ~is1 & (peakn >= peak_opt)
        grads = np.where(is1, st.first_grads[a1], st.grads_bytes)
        acts = np.where(is1, acts1, np.where(isn, actsn, kept)) + (input_bytes if cuda else 0.0)
        parts = {
            "params_bytes": np.full(n, float(st.params_bytes)),
            "grads_bytes": grads,
            "optimizer_bytes": np.full(n, float(st.optimizer_bytes)),
            "activations_bytes": np.maximum(acts, 0.0),
            "overhead_bytes": overhead if cuda else np.zeros(n),
        }
        parts["temporary_bytes"] = np.maximum(stage_total - sum(parts.values()), 0.0)
        ph = np.where(is1, np.array(st.first_phase, dtype=object)[a1],
                      np.where(isn, np.array(st.later_phase, dtype=object)[an], "optimizer"))
        better = stage_total > best
        best = np.where(better, stage_total, best)
        for name in BREAKDOWN:
            best_parts[name] = np.where(better, parts[name], best_parts[name])
        best_phase = np.where(better, ph, best_phase)
    out["peak_bytes"][idx] = best
    for name in BREAKDOWN:
        out[name][idx] = best_parts[name]
    stacked = np.stack(stage_peaks, axis=1).round().astype(np.int64)
    per_device[idx] = [tuple(int(x) for x in row) for row in stacked]
    phase[idx] = best_phase


def estimate(profile: Profile, config: TrainConfig, budget_bytes: int | None = None,
             schedule: PipelineSchedule | str = PipelineSchedule.ONE_F_ONE_B,
             overhead: CudaOverhead | None = None) -> MemoryEstimate:
    """The predicted memory of one config.

    >>> est = estimate(profile, TrainConfig(precision="amp-bf16", micro_batch=8))  # doctest: +SKIP
    >>> est.peak_bytes, est.fits                                                   # doctest: +SKIP

    Raises ConfigError when the config cannot run (e.g. more stages than layers).
    """
    row = estimate_table(profile, [config], budget_bytes, schedule, overhead).iloc[0]
    if not row["valid"]:
        raise ConfigError(f"{config.short()}: {row['reason']}")
    notes = []
    if config.checkpoint_every > profile.n_layers:
        notes.append(f"checkpoint_every {config.checkpoint_every} > {profile.n_layers} layers: one segment of all layers")
    if profile.device_type == "cuda":
        notes.append((overhead or fallback_overhead()).note())
    real_check = profile.for_precision(config.precision).real_check
    if real_check:  # what the profile's real steps found (autofit.profiling.real_check), corrections included
        notes.append(f"profile: {real_check}")
    return MemoryEstimate(
        workload=profile.workload, device_type=profile.device_type, config=config,
        param_count=profile.param_count,
        **{name: int(round(row[name])) for name in BREAKDOWN},
        model_state_bytes=int(row["model_state_bytes"]), peak_bytes=int(round(row["peak_bytes"])),
        per_device_peak_bytes=tuple(row["per_device_peak_bytes"]), peak_phase=str(row["peak_phase"]),
        budget_bytes=budget_bytes, fits=None if budget_bytes is None else bool(row["fits"]), notes=tuple(notes),
        **{name: None if pd.isna(row[name]) else int(round(row[name])) for name in FSDP_EXTRA_COLUMNS},
    )


def clear_caches() -> None:
    """Forget the per-stage walks cached across calls (``autofit bench`` times a cold first call)."""
    _stage_lines.cache_clear()

"""The profile's data: plain frozen dataclasses that round-trip through JSON.

:mod:`autofit.profiling` measures them; the memory and time models read them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field

import numpy as np

from autofit.core.config import Precision

__all__ = ["OUTPUT_REGIONS", "PROFILE_BATCHES", "PROFILE_VERSION", "LayerProfile", "Line", "OptimizerProfile",
           "PrecisionProfile", "Profile", "Region", "precision_from_dict", "region_from_dict", "retained_caveat",
           "segment_freed_late",
           "upper_envelope", "with_optimizer"]

# The profile's format: a cache entry of another version is never read (autofit.profiling.cache).
PROFILE_VERSION = 25
# Micro-batch sizes profiled; every per-sample quantity is fitted as a line through them.
PROFILE_BATCHES = (2, 4)

Line = tuple[float, float]  # (bytes at b=0, bytes per sample): value(b) = c0 + c1 * b


OUTPUT_REGIONS = ("head_forward", "loss_forward", "loss_backward", "head_backward")


def upper_envelope(intercepts, slopes, from_batch: float = 1.0) -> tuple[Line, ...]:
    """The lines ``intercepts[i] + slopes[i]·b`` that are the highest at some ``b >= from_batch``, in order
    of slope: their max is everyone's max there. Few lines for many (a region's operators)."""
    icept, slope = np.asarray(intercepts, dtype=np.float64), np.asarray(slopes, dtype=np.float64)
    if not icept.size:
        return ()
    i = int(np.lexsort((slope, icept + slope * from_batch))[-1])  # the highest there, the steeper of ties
    out = [i]
    while (steeper := slope > slope[i]).any():
        cross = np.full(icept.shape, np.inf)
        cross[steeper] = (icept[i] - icept[steeper]) / (slope[steeper] - slope[i])  # where each overtakes
        first = cross.min()
        i = int(np.flatnonzero(cross == first)[np.argmax(slope[cross == first])])
        out.append(i)
    return tuple((float(icept[j]), float(slope[j])) for j in out)


@dataclass(frozen=True)
class Region:
    """A stretch of the timeline between two hooks. All values are lines in the micro-batch.

    ``delta_*`` is the change of live bytes from start to end, ``peak_*`` the highest point
    above the start. ``*_nongrad`` is the same for live bytes minus parameter gradients,
    which is what a later accumulation micro-step sees (its gradients already exist).

    The highest point may be set by a different operator at a larger micro-batch than at the
    two profiled ones (a batch-independent peak, e.g. gradients being accumulated, at small b;
    a per-sample one, e.g. the loss's backward, at large b). ``peak`` is the line through the
    peaks at the profiled sizes; ``steep*`` is the line of the operator whose live bytes grow
    fastest with b, which sets the peak for large b. The region's peak is at least the larger
    of the two.
    """

    delta: Line
    peak: Line
    delta_nongrad: Line
    peak_nongrad: Line
    steep: Line = (0.0, 0.0)
    steep_nongrad: Line = (0.0, 0.0)
    bends: tuple[Line, ...] = ()
    bends_nongrad: tuple[Line, ...] = ()

    @property
    def peaks(self) -> tuple[Line, ...]:
        return (self.peak, self.steep, *self.bends)

    @property
    def peaks_nongrad(self) -> tuple[Line, ...]:
        return (self.peak_nongrad, self.steep_nongrad, *self.bends_nongrad)


@dataclass(frozen=True)
class LayerProfile:
    """One repeated block: its parameters, the tensor it hands on, its forward and backward."""

    param_bytes: int          # weights + buffers in the precision's parameter dtype
    grad_bytes: int           # gradients of its trainable parameters
    output: Line              # bytes of the output handed to the next layer (a stage boundary)
    forward: Region
    backward: Region
    forward_flops: Line = (0.0, 0.0)
    output_saved: bool = False  # the layer's own backward needs its output (e.g. it ends in ReLU)
    max_grad_tensor_bytes: int = 0  # its largest gradient (a per-tensor optimizer's transients scale with it)
    grad_rows: tuple[tuple[int, int], ...] = ()  # (size(0), bytes) of each trainable parameter (FSDP pads dim 0)
    # Live bytes from this layer's end to the next one's start (the last layer's: to the next
    # operator): its input freed when no backward keeps it (a frozen block's, linear(relu(x))'s).
    # Where something else holds that input, it is freed later: a checkpointed segment's (the
    # checkpoint keeps it until the segment's backward is done), a later pipeline stage's first
    # layer's (its receive buffer).
    after: Line = (0.0, 0.0)
    # The forward up to the last tensor it saves for backward: where a checkpointed segment that
    # ends with this layer stops recomputing (torch.utils.checkpoint non-reentrant, early stop), so
    # an output nothing saves is never made again. Its peaks bound that recomputation's.
    recompute: Region | None = None
    # The forward as a checkpointed segment's forward runs it: nothing kept for backward, so the
    # tensors it saves die with their last Python reference (a lower peak).
    checkpointed_forward: Region | None = None
    # This layer's input (``input_freed_late``) and its other tensor arguments first taken here
    # (``args_freed_late``: an encoder's output every decoder layer takes, under the first) whose
    # last Python reference dies after the layers, as the model's forward returns (in
    # ``post_forward``), where no backward keeps them. A checkpoint keeps its segment's arguments
    # until the segment's backward is done: from the end of the forward to there, they are alive.
    input_freed_late: Line = (0.0, 0.0)
    args_freed_late: Line = (0.0, 0.0)
    # The forward as a selectively checkpointed segment's first run runs it (checkpoint_policy=selective):
    # the outputs of the operators the policy saves (matmuls, attention) are kept until the segment's
    # recomputation takes them, the rest die as in ``checkpointed_forward``. ``selective_kept``: those
    # outputs' bytes, beyond the layer's output; ``selective_output_kept``: the output is one of them;
    # ``selective_saved_flops``: their operators' FLOPs, which the recomputation does not run again.
    selective_forward: Region | None = None
    selective_kept: Line = (0.0, 0.0)
    selective_output_kept: bool = False
    selective_saved_flops: Line = (0.0, 0.0)
    # The forward as a selective segment's recomputation runs it: autograd saves what backward needs,
    # and the operators the policy saved hand back their kept outputs rather than making them again
    # (whole, for a segment's inner layers; up to the last tensor it saves, for its last layer).
    selective_recompute: Region | None = None
    selective_recompute_prefix: Region | None = None
    # What its forward leaves alive beyond its output where autograd keeps nothing (a checkpointed
    # segment's forward), until the model's output is dropped: what something else holds, e.g. a
    # key/value cache the model returns (``past_key_values``). Without checkpointing it is among the
    # forward's saved bytes (``forward.delta``) and freed where the profile saw it freed.
    retained: Line = (0.0, 0.0)
    # What this layer's recomputation in a checkpointed segment's backward leaves alive until the model's
    # output is dropped, where it keeps tensors beyond autograd (``retained``): called again with what it
    # keeps, a cache appends to itself again, and the tensors it now holds carry the recomputation's graph,
    # whose nodes keep what they saved (autofit.profiling.recompute_kept replays it). ``retained_recomputed``:
    # as a segment's last layer (its output dropped); ``_inner``: as an inner layer, whose output and
    # graph the next layer's recomputed graph holds.
    retained_recomputed: Line = (0.0, 0.0)
    retained_recomputed_inner: Line = (0.0, 0.0)
    # Its input, where that graph keeps it (a norm saves its input): a segment's first layer's outlives the
    # checkpoint, which would have let it go after the segment's backward. Not in the two above.
    recomputed_input_kept: Line = (0.0, 0.0)
    # Its other tensor arguments first taken here (rotary tables every layer takes, under the first), where
    # that graph keeps them: they outlive the checkpoints, which would have let them go (``args_freed_late``).
    recomputed_args_kept: Line = (0.0, 0.0)
    # Its backward as a pipeline stage that ends with it runs it: the output's gradient stays in the stage's
    # receive buffer (``backward_grad_kept``) and, without checkpointing, the output in the schedule's
    # forward cache too (``backward_output_kept``), where the profile's backward freed them as it went. Their
    # peaks are the stage's, wherever in the backward the profile's peak fell (None: not profiled).
    backward_grad_kept: Region | None = None
    backward_output_kept: Region | None = None

    def recomputed(self, last: bool, selective: bool = False) -> Region:
        """This layer's forward as a checkpointed segment's recomputation runs it (``last``: the
        segment's last layer, which stops at the last tensor it saves; ``selective``: the policy's kept
        outputs handed back, not made again)."""
        if selective:
            region = self.selective_recompute_prefix if last else self.selective_recompute
            if region is not None:
                return region
        return self.recompute if last and self.recompute is not None else self.forward

    def forward_checkpointed(self, selective: bool = False) -> Region:
        """This layer's forward inside a checkpointed segment (its first run: nothing saved, or with
        ``selective`` only what the policy saves)."""
        if selective:
            return self.selective_forward if self.selective_forward is not None else self.forward
        return self.checkpointed_forward if self.checkpointed_forward is not None else self.forward


def segment_freed_late(layers, s: int, e: int) -> Line:
    """What a checkpoint of layers [s, e) keeps that the unchecked profile saw die after the layers:
    its input (the head's) and the other arguments its layers take first (the later layers are
    called with the head's)."""
    c0, c1 = layers[s].input_freed_late
    for layer in layers[s:e]:
        c0, c1 = c0 + layer.args_freed_late[0], c1 + layer.args_freed_late[1]
    return (c0, c1)


@dataclass(frozen=True)
class OptimizerProfile:
    """One ``optimizer`` lever choice's step, profiled over the same parameters as the workload's own
    (:mod:`autofit.profiling.optimizers`): its state after a step, what its step holds beyond
    weights + gradients + state as the timeline saw it (its temporaries), and what a kernel allocates
    inside one operator for the largest tensor, unseen by the timeline (bitsandbytes' on the CPU)."""

    choice: str            # an OptimizerChoice value, e.g. "adamw8bit"
    optimizer: str         # the class that ran, e.g. "AdamW8bit"
    state_bytes: int
    peak_bytes: int
    library: str = ""      # what implements it, with its version ("bitsandbytes 0.50.2"): another is profiled again
    kernel_bytes: int = 0  # one tensor at a time: it follows the largest tensor a stage holds


@dataclass(frozen=True)
class PrecisionProfile:
    """Everything measured for one precision."""

    precision: str
    static_param_bytes: int       # all weights + buffers
    grad_bytes: int               # all gradients (params requiring grad, param dtype)
    optimizer_bytes: int          # optimizer state after a step (steady state)
    optimizer_peak_bytes: int     # transient above params + grads + state during optimizer.step()
    pre_param_bytes: int          # weights used before the first layer (embeddings, stem)
    post_param_bytes: int         # weights used after the last layer (final norm, head)
    pre_grad_bytes: int
    post_grad_bytes: int
    pre_max_grad_tensor_bytes: int
    post_max_grad_tensor_bytes: int
    pre_forward: Region           # step start -> first layer
    post_forward: Region          # last layer (once its ``after`` is freed) -> loss ready
    post_backward: Region         # loss -> into the last layer's backward
    pre_backward: Region          # out of the first layer's backward -> micro-step end
    input_bytes: Line             # the micro-batch itself (data loader's; counted only on CUDA)
    layers: tuple[LayerProfile, ...]
    forward_flops: Line = (0.0, 0.0)   # whole model, one micro-batch
    backward_flops: Line = (0.0, 0.0)
    optimizer_flops: float = 0.0
    # post_forward and post_backward cut at the model's output (None when it has no gradient):
    head_forward: Region | None = None    # last layer (after its ``after``) -> model output (final norm, head)
    loss_forward: Region | None = None    # model output -> loss ready
    loss_backward: Region | None = None   # loss -> the output's gradient
    head_backward: Region | None = None   # the output's gradient -> into the last layer's backward
    grad_rows: tuple[tuple[int, int], ...] = ()  # (size(0), bytes) of every trainable parameter; () if not recorded
    # autofit.profiling.real_check: what real steps found beside the fake runs (the regions above include it)
    real_check: str = ""
    real_extra_bytes_per_sample: float = 0.0
    # autofit.profiling.routing: the routing the step assumed for a top-k router's experts ("": no top-k)
    routing: str = ""
    # The model's ends as a device split's first and last stages hold them: weights tied across
    # the ends (an embedding and its head) untied, one copy a stage (None: nothing is tied).
    split_ends: "PrecisionProfile | None" = None
    # True: weights are tied across the ends but split_ends was not profiled (profile_workload's
    # split_ends=False, for a search without pipeline splits); a pipeline split's estimate refuses it.
    split_ends_skipped: bool = False
    # True: the layers' selectively checkpointed forwards were not traced (profile_workload's
    # selective=False, for a search without the selective policy): their fields read 0, and an
    # estimate of a selectively checkpointed config refuses the profile.
    selective_skipped: bool = False
    # The ``optimizer`` lever's choices profiled for this precision (profile_workload(optimizers=...)),
    # in place of the workload's own optimizer; () when none was asked for.
    optimizer_options: tuple[OptimizerProfile, ...] = ()
    # Whether the optimizer step's temporaries are one tensor's at a time (they follow the largest
    # tensor a stage holds) or all tensors' at once (they follow its share of the gradients); None:
    # judged from their size (at most 4x the largest gradient: one at a time). with_optimizer sets it.
    optimizer_per_tensor: bool | None = None
    # What every step after the first starts with beyond weights, gradients and optimizer state: the
    # tensors a step leaves alive for the next (a hook's stash, a buffer the forward replaces). The
    # regions above are those of such a step, so this is alive under all of them, the optimizer step too.
    kept_bytes: Line = (0.0, 0.0)
    # What the first layer is called with beyond its input, made before the layers and neither a weight
    # nor a buffer: rotary tables, position ids. A pipeline stage after the first makes its own for each
    # micro-batch (Hugging Face stages do, autofit.workloads.hf.stages) and keeps them through that
    # micro-batch's backward, as the unsplit model keeps them in ``pre_forward``'s bytes.
    layer_args: Line = (0.0, 0.0)
    # The buffers among ``pre_param_bytes`` (rotary frequencies): a later pipeline stage that makes its
    # layers' arguments holds a copy of them (an upper bound where they make none of those arguments).
    pre_buffer_bytes: int = 0

    def optimizer_option(self, choice: str) -> OptimizerProfile | None:
        """The profile of lever choice ``choice`` (an OptimizerChoice value), None when not profiled."""
        return next((o for o in self.optimizer_options if o.choice == choice), None)


@dataclass(frozen=True)
class Profile:
    """The profile of one workload on one device type. Plain data; JSON round-trips."""

    workload: str
    device_type: str
    param_count: int
    n_layers: int
    tokens_per_sample: int | None
    optimizer: str
    key: str
    profile_s: float
    precisions: dict[str, PrecisionProfile] = field(default_factory=dict)
    split_refusal: str | None = None  # why the model cannot be cut into pipeline stages (None: it can)
    selective_refusal: str | None = None  # why it cannot be checkpointed selectively (None: it can)

    def for_precision(self, precision: Precision | str) -> PrecisionProfile:
        return self.precisions[Precision(precision).value]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        data = json.loads(text)
        precisions = {name: precision_from_dict(pp) for name, pp in data.pop("precisions").items()}
        return cls(**data, precisions=precisions)


def with_optimizer(pp: PrecisionProfile, option: OptimizerProfile) -> PrecisionProfile:
    """``pp`` as it trains with ``option`` instead of the workload's optimizer: its state and its step's
    temporaries replaced. A device split's ends (``split_ends``: tied weights untied, one more copy's
    state) get the state in the same proportion to their own as the workload's optimizer has."""
    largest = max([layer.max_grad_tensor_bytes for layer in pp.layers]
                  + [pp.pre_max_grad_tensor_bytes, pp.post_max_grad_tensor_bytes])
    # a kernel's own bytes are one tensor's at a time, so with temporaries that are too, the step's are
    per_tensor = bool(largest) and option.peak_bytes <= 4 * largest
    peak = option.peak_bytes + option.kernel_bytes
    ends = pp.split_ends
    if ends is not None:
        scale = ends.optimizer_bytes / pp.optimizer_bytes if pp.optimizer_bytes else 1.0
        ends = dataclasses.replace(ends, optimizer_bytes=int(round(option.state_bytes * scale)),
                                   optimizer_peak_bytes=peak, optimizer_per_tensor=per_tensor, optimizer_options=())
    return dataclasses.replace(pp, optimizer_bytes=option.state_bytes, optimizer_peak_bytes=peak,
                               optimizer_per_tensor=per_tensor, split_ends=ends, optimizer_options=())


def retained_caveat(name: str, precisions) -> str | None:
    """One line where the layers' forward leaves tensors alive beyond what backward needs until the model's
    output is dropped (``LayerProfile.retained``: a key/value cache the model returns while it trains), if it does."""
    per_sample = max((sum(layer.retained[1] for layer in pp.layers) for pp in precisions), default=0.0)
    if per_sample <= 0:
        return None
    return (f"{name}: its layers keep {per_sample / 1024:,.1f} KiB per sample alive beside what backward needs, "
            "until the step's output is dropped (a key/value cache the model returns: waste while training); "
            "counted in the estimate, with what a checkpointed recomputation appends to it and keeps; "
            "set use_cache=False")


# A layer's per-sample lines that JSON written before them lacks (read as zero).
_LINE_FIELDS = ("after", "input_freed_late", "args_freed_late", "selective_kept", "selective_saved_flops", "retained",
                "retained_recomputed", "retained_recomputed_inner", "recomputed_input_kept", "recomputed_args_kept")


def rows_from_json(rows) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(r) for r in rows)


def region_from_dict(d: dict) -> Region:
    return Region(**{k: tuple(map(tuple, v)) if k.startswith("bends") else tuple(v) for k, v in d.items()})


def precision_from_dict(pp: dict) -> PrecisionProfile:
    """A PrecisionProfile from its ``dataclasses.asdict`` (JSON) form."""
    pp = dict(pp)
    layers = tuple(LayerProfile(**{**lp, "forward": region_from_dict(lp["forward"]), "backward": region_from_dict(lp["backward"]),
                                   **{k: region_from_dict(lp[k]) if lp.get(k) else None
                                      for k in ("recompute", "checkpointed_forward", "selective_forward",
                                                "selective_recompute", "selective_recompute_prefix",
                                                "backward_grad_kept", "backward_output_kept")},
                                   "output": tuple(lp["output"]), "forward_flops": tuple(lp["forward_flops"]),
                                   **{k: tuple(lp.get(k, (0.0, 0.0))) for k in _LINE_FIELDS},
                                   "grad_rows": rows_from_json(lp.get("grad_rows", ()))})
                   for lp in pp.pop("layers"))
    regions = {k: region_from_dict(pp[k]) for k in ("pre_forward", "post_forward", "post_backward", "pre_backward")}
    regions.update({k: region_from_dict(pp[k]) for k in OUTPUT_REGIONS if pp.get(k) is not None})
    lines = {k: tuple(pp[k]) for k in ("input_bytes", "forward_flops", "backward_flops")}
    lines.update({k: tuple(pp.get(k, (0.0, 0.0))) for k in ("kept_bytes", "layer_args")})
    ends = pp.pop("split_ends", None)
    options = tuple(OptimizerProfile(**o) for o in pp.pop("optimizer_options", ()))
    return PrecisionProfile(**{**pp, **regions, **lines, "layers": layers, "grad_rows": rows_from_json(pp.get("grad_rows", ())),
                               "split_ends": precision_from_dict(ends) if ends else None, "optimizer_options": options})

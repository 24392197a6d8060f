"""One pipeline stage's micro-step, its profiled regions laid end to end as lines ``c0 + c1·b``.

The rules (gradients, checkpointing, device split) are described in :mod:`autofit.estimator.memory_model`;
:func:`stage_lines` gives what :mod:`autofit.estimator.memory_table` takes the upper envelope of.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from autofit.core.config import Precision
from autofit.profiling.data import Line, PrecisionProfile, Region, segment_freed_late


def _add(a: Line, b: Line, scale: float = 1.0) -> Line:
    return (a[0] + scale * b[0], a[1] + scale * b[1])


@dataclass(frozen=True)
class StageLines:
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


class _StageWalk(_Walk):
    """One micro-step of the stage of layers ``[start, end)``: :meth:`forward`, then :meth:`backward`.

    ``every``: the checkpoint interval (0: none); ``later``: a micro-step after the first, run
    with every gradient already made (its regions counted without them); ``selective``: the segments
    keep what selective checkpointing saves (:meth:`_kept`).
    """

    def __init__(self, pp: PrecisionProfile, start: int, end: int, first_stage: bool, last_stage: bool,
                 every: int, later: bool, selective: bool = False) -> None:
        super().__init__()
        self.pp, self.layers = pp, pp.layers
        self.start, self.end, self.every, self.later = start, end, every, later
        self.selective = bool(selective and every)
        self.first_stage, self.last_stage = first_stage, last_stage
        self.segments = [(s, min(s + every, end)) for s in range(start, end, every)] if every else []
        # Under autocast, the half-precision weight copies are cached until the autocast region
        # ends, even in checkpointed segments that keep nothing else: the batch-independent part
        # of a layer's forward (its weight casts) stays until the end of the forward. The profile
        # (not checkpointed) saw the copies its backward needs (``saved``: what the layer's
        # backward frees that does not grow with the batch) outlive the region; the others (e.g.
        # bias copies) were freed at its end, in ``post_forward``. Checkpointed, the saved ones
        # are freed too; a segment's recomputation builds them all again and frees the others.
        layers = self.layers
        amp = Precision(pp.precision).is_amp
        self.cache = [max(0.0, layers[i].forward.delta[0]) if amp and every else 0.0 for i in range(len(layers))]
        self.saved = [min(self.cache[i], max(0.0, -layers[i].backward.delta_nongrad[0])) for i in range(len(layers))]
        # An earlier stage's output is an end of its autograd graph: the pipeline schedule keeps it
        # (its forward cache) until the micro-batch's backward returns, and the output's gradient
        # lives in a receive buffer (counted in memory_table's ``_pipeline_buffers``). The profile
        # saw the last layer's backward free both: the gradient always, the output too where the
        # layer saves it (a final ReLU). Here neither is freed: they are added back from the end of
        # that backward on, and inside it the peaks are the profile's with each kept from where it
        # died (``LayerProfile.backward_output_kept``; under checkpointing the recomputed copy of
        # the output is what the backward frees, so only the gradient is kept: ``backward_grad_kept``).
        self.boundary = layers[end - 1].output if not last_stage else (0.0, 0.0)

    def _kept(self, i: int, e: int) -> Line:
        """What selective checkpointing keeps of layer ``i``'s forward in a segment ending at ``e``: the
        outputs of the matmuls and attention (``selective_kept``), and its own output where it is one of
        them and not the segment's (which the segment keeps anyway). Nothing under full checkpointing."""
        if not self.selective:
            return (0.0, 0.0)
        layer = self.layers[i]
        return _add(layer.selective_kept, layer.output, 1.0 if layer.selective_output_kept and i < e - 1 else 0.0)

    def _held_by_cache(self, i: int, last: bool) -> Line:
        """What the recomputation of layer ``i`` leaves alive beyond the cache's growth, until the step's
        output is dropped, where a layer keeps tensors beyond autograd (``LayerProfile.retained``: a
        key/value cache): the profile's replay (``retained_recomputed*``) found the cache grown again and
        the recomputed graph behind it, which holds what the layer saved up to its cache (a segment's last
        layer) or all of it with its output (an inner layer, whose output leads to a later layer's cache).
        The regions already count the growth (``retained``: in the unchecked forward's delta, freed with
        the output)."""
        layer = self.layers[i]
        if layer.retained == (0.0, 0.0):
            return (0.0, 0.0)
        recomputed = layer.retained_recomputed if last else layer.retained_recomputed_inner
        return _add(recomputed, layer.retained, -1.0)

    def _bwd(self, r: Region) -> tuple[tuple[Line, ...], Line]:
        return (r.peaks_nongrad, r.delta_nongrad) if self.later else (r.peaks, r.delta)

    def _grad_of(self, i: int) -> float:
        return 0.0 if self.later else self.layers[i].grad_bytes

    def forward(self) -> Line:
        """The forward; returns the activations held at its end."""
        layers, start, end = self.layers, self.start, self.end
        if self.first_stage:  # a later stage's input lives in the pipeline's receive buffers
            self.region(self.pp.pre_forward.peaks, self.pp.pre_forward.delta, "forward")
        else:  # it makes its layers' other arguments (rotary tables) itself, kept through its backward
            self.region((self.pp.layer_args,), self.pp.layer_args, "forward")
        if self.every:
            for s, e in self.segments:
                for i in range(s, e):
                    # the previous layer's output is this one's input (unless selective keeps it: in ``live``)
                    kept_before = self.selective and i > s and layers[i - 1].selective_output_kept
                    held_in_segment = layers[i - 1].output if i > s and not kept_before else (0.0, 0.0)
                    # what the layer leaves alive beyond autograd (a key/value cache) stays until the
                    # model's output is dropped, where the profile saw it freed (its recomputation makes it again)
                    self.region(layers[i].forward_checkpointed(self.selective).peaks,
                                _add(_add((self.cache[i], 0.0), self._kept(i, e)), layers[i].retained), "forward",
                                held=held_in_segment)
                # the segment's output survives (and, selective, what the policy keeps)
                self.live = _add(self.live, layers[e - 1].output)
        else:
            for i in range(start, end):
                self.region(layers[i].forward.peaks, layers[i].forward.delta, "forward")
                if self.first_stage or i > start:  # a later stage's input stays in its receive buffer
                    self.live = _add(self.live, layers[i].after)
        # Segment arguments the unsplit, unchecked profile saw die as the model's forward returned (in
        # post_forward, where no backward kept them): each checkpoint keeps its own until its backward.
        late = [segment_freed_late(layers, s, e) for s, e in self.segments]
        late_total = (sum(l[0] for l in late), sum(l[1] for l in late))
        if self.last_stage:  # post_forward: alive through it, freed before its peak or not
            # The unsplit profile also saw the first layer's input die there, as the model's forward
            # returned (where no backward keeps it: the embeddings under a norm that copies them to
            # fp32). A later stage never had it, and its checkpoints keep the arguments it makes for
            # its layers (``layer_args``) until their backward: count both back, through the region
            # (an upper bound where the peak comes before the return) and after it.
            if self.first_stage:
                elsewhere = (0.0, 0.0)
            elif self.every:
                elsewhere = segment_freed_late(layers, 0, start)
            else:
                elsewhere = layers[0].input_freed_late
            self.region(self.pp.post_forward.peaks, _add(self.pp.post_forward.delta, elsewhere), "forward",
                        held=_add(late_total, elsewhere))
            self.live = _add(self.live, late_total)
        elif self.first_stage and not self.every:
            # A first stage's graph (torch.export's) lets its input and its layers' other arguments go
            # at their last use, not as the model returns: by the end of its forward they are gone.
            self.live = _add(self.live, segment_freed_late(layers, start, end), -1.0)
        self.live = _add(self.live, (-sum(self.saved[start:end]), 0.0))  # autocast exits: its cache is freed
        return self.live

    def backward(self) -> None:
        pp = self.pp
        if self.last_stage:  # an earlier stage's output gradient arrives in a receive buffer
            self.region(*self._bwd(pp.post_backward), "backward", 0.0 if self.later else pp.post_grad_bytes)
        if self.every:
            for s, e in reversed(self.segments):
                self._segment_backward(s, e)
        else:
            for i in reversed(range(self.start, self.end)):
                self._layer_backward(i, output_freed=self.layers[i].output_saved)
        if self.first_stage:
            self.region(*self._bwd(pp.pre_backward), "backward", 0.0 if self.later else pp.pre_grad_bytes)

    def _layer_backward(self, i: int, output_freed: bool, held: Line = (0.0, 0.0)) -> None:
        layer = self.layers[i]
        peaks, delta = self._bwd(layer.backward)
        if i == self.end - 1 and not self.last_stage:  # the stage's output and its gradient stay (see __init__)
            kept = layer.backward_grad_kept if self.every else layer.backward_output_kept
            if kept is not None:
                peaks = self._bwd(kept)[0]
        self.region(peaks, delta, "backward", self._grad_of(i), held=held)
        if i == self.end - 1:
            self.live = _add(self.live, _add(self.boundary, self.boundary, 1.0 if output_freed else 0.0))

    def _segment_backward(self, s: int, e: int) -> None:
        """A checkpointed segment's recomputation, then its layers' backward."""
        layers = self.layers
        # The segment's forward output is not kept twice: either recomputation stops before
        # it (nothing in the segment saves it) or, when a layer saves its own output (a final
        # ReLU), the original was freed with the next segment's saved inputs and the
        # recomputed copy takes its place. A stage's own output is not freed (see above):
        # its recomputed copy adds to it, and the layer's backward frees only that copy.
        stage_output_kept = not self.last_stage and e == self.end and layers[e - 1].output_saved
        if layers[e - 1].output_saved and not stage_output_kept:
            self.live = _add(self.live, layers[e - 1].output, -1.0)
        kept_after_stop = self._kept(e - 1, e)
        for i in range(s, e):  # recompute the segment's forward, saving its activations
            replay = (self.selective and layers[i].selective_recompute is not None
                      and layers[i].selective_recompute_prefix is not None)
            if replay:
                # The policy hands its kept outputs back rather than making them again, and one that
                # nothing saves then dies: the profile's replay of the recomputation (peaks and delta) has
                # both. The last layer stops at its last saved tensor (early stop); the kept outputs after
                # it stay cached until the segment's backward is done (taken off below).
                if i < e - 1:
                    region = layers[i].selective_recompute
                    self.region(region.peaks, region.delta, "backward")
                else:
                    handed_back = _add(layers[i].recomputed(last=True).delta,
                                       layers[i].selective_recompute_prefix.delta, -1.0)
                    self.region(layers[i].selective_recompute_prefix.peaks,
                                _add(layers[i].forward.delta, handed_back, -1.0), "backward")
                    kept_after_stop = _add(kept_after_stop, handed_back, -1.0)
            else:
                # Without the replay (a profile from before it): the kept outputs are counted as made
                # again (high by what the layer keeps), then once
                self.region(layers[i].recomputed(last=i == e - 1).peaks, layers[i].forward.delta, "backward")
                if i < e - 1:
                    self.live = _add(self.live, self._kept(i, e), -1.0)
            if i > s:  # the segment's input is the checkpoint's
                self.live = _add(self.live, layers[i].after)
        self.live = _add(self.live, (-sum(self.cache[s:e]) + sum(self.saved[s:e]), 0.0))  # recompute's autocast exits
        if not layers[e - 1].output_saved:
            self.live = _add(self.live, layers[e - 1].output, -1.0)
        for i in reversed(range(s, e)):  # the recomputed output is freed, the stage's own kept
            # what the recomputed graph behind a kept cache holds is not freed by the backward: an upper
            # bound through the layer's backward (the profile's backward frees it as it goes), kept after
            held = self._held_by_cache(i, last=i == e - 1)
            self._layer_backward(i, output_freed=False, held=held)
            self.live = _add(self.live, held)
        # The last layer's recomputation stops at the last tensor it saves (early stop), before the kept
        # outputs of the operators after it are taken from the policy's cache: they stay until the
        # checkpoint is done with, after the segment's backward.
        self.live = _add(self.live, kept_after_stop, -1.0)
        # the recomputed graph behind a kept cache keeps the segment's input and the arguments its layers
        # take first (rotary tables), which the checkpoint would let go here
        self.live = _add(self.live, self.layers[s].recomputed_input_kept)
        for i in range(s, e):
            self.live = _add(self.live, self.layers[i].recomputed_args_kept)
        # The checkpoint kept the segment's input until its backward is done; where no layer
        # saves it (linear(relu(x))), the profile's backward did not free it (its forward did,
        # in ``after``): free it now. A later stage's input stays in its receive buffer.
        if self.first_stage or s > self.start:
            self.live = _add(self.live, layers[s].after)
        if self.last_stage or self.first_stage:  # the checkpoint lets its input and arguments go
            self.live = _add(self.live, segment_freed_late(layers, s, e), -1.0)


def walk_stage(pp: PrecisionProfile, start: int, end: int, first_stage: bool, last_stage: bool,
               every: int, later: bool, selective: bool = False) -> tuple[_Walk, Line]:
    """Lay one micro-step of a stage end to end; returns the walk and the activations held after forward."""
    w = _StageWalk(pp, start, end, first_stage, last_stage, every, later, selective)
    held = w.forward()
    w.backward()
    return w, held


@lru_cache(maxsize=4096)
def stage_lines(pp: PrecisionProfile, start: int, end: int, first_stage: bool, last_stage: bool,
                every: int, selective: bool = False) -> StageLines:
    """The lines of a stage's first and later micro-steps (cached across calls: one walk per structure).
    ``selective``: the checkpointed segments keep what selective checkpointing saves."""
    w1, held = walk_stage(pp, start, end, first_stage, last_stage, every, later=False, selective=selective)
    wn, _ = walk_stage(pp, start, end, first_stage, last_stage, every, later=True, selective=selective)
    params = sum(l.param_bytes for l in pp.layers[start:end])
    grads = sum(l.grad_bytes for l in pp.layers[start:end])
    whole = first_stage and last_stage
    if whole:
        params, grads = pp.static_param_bytes, pp.grad_bytes
    else:
        if first_stage:
            params, grads = params + pp.pre_param_bytes, grads + pp.pre_grad_bytes
        elif pp.layer_args != (0.0, 0.0):  # it makes its layers' arguments with a copy of the buffers they need
            params += pp.pre_buffer_bytes
        if last_stage:
            params, grads = params + pp.post_param_bytes, grads + pp.post_grad_bytes
    # Optimizer state scales with the gradients the stage owns. Its step's temporaries do too
    # for a multi-tensor (foreach) step; a per-tensor loop's peak is set by the largest tensor.
    share = grads / pp.grad_bytes if pp.grad_bytes else 1.0
    largest = max([l.max_grad_tensor_bytes for l in pp.layers[start:end]]
                  + ([pp.pre_max_grad_tensor_bytes] if first_stage else [])
                  + ([pp.post_max_grad_tensor_bytes] if last_stage else []), default=0)
    overall = max([l.max_grad_tensor_bytes for l in pp.layers] + [pp.pre_max_grad_tensor_bytes, pp.post_max_grad_tensor_bytes])
    per_tensor_loop = (pp.optimizer_per_tensor if pp.optimizer_per_tensor is not None
                       else overall and pp.optimizer_peak_bytes <= 4 * overall)
    opt_share = largest / overall if per_tensor_loop else share
    return StageLines(
        first=np.array(w1.peaks, dtype=np.float64), first_grads=np.array(w1.grads_at, dtype=np.float64),
        first_acts=np.array(w1.acts_at, dtype=np.float64), first_phase=tuple(f"first {p}" for p in w1.phases),
        later=np.array(wn.peaks, dtype=np.float64), later_acts=np.array(wn.acts_at, dtype=np.float64),
        later_phase=tuple(f"later {p}" for p in wn.phases),
        held=held, params_bytes=int(params), grads_bytes=int(grads),
        optimizer_bytes=math.ceil(pp.optimizer_bytes * share),  # never under by the rounding
        optimizer_peak_bytes=int(round(pp.optimizer_peak_bytes * opt_share)),
    )


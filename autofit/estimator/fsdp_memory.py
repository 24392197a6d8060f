"""The memory model of one FSDP rank (``split_mode = fsdp``), from the same profile as one device.

Every rank runs the whole model on its own ``micro_batch`` samples, so its activations are
those of one device at that micro-batch: the profile's regions, laid end to end as
:mod:`autofit.estimator.memory_model` does, counted without parameter gradients. What FSDP2
(:mod:`autofit.trial.fsdp`) changes is the model state and its traffic, added here term by term
(N ranks; bytes in the parameter dtype; ``torch.distributed.fsdp`` 2.x behaviour):

- **shards**: each rank keeps a shard of every parameter, of its gradient (from the first
  reduce-scatter on) and of its optimizer state; FSDP2 shards dim 0 padded to a multiple of N,
  so rank 0 holds ``ceil(size(0)/N)`` rows of each (:func:`padded_shard_bytes`, from the
  profile's ``grad_rows``); buffers are not sharded (every rank has them);
- **gathered weights**: a unit (a layer, or a checkpoint segment of k layers) is all-gathered
  before its forward and freed after it (``reshard_after_forward``), and gathered again before
  its backward while the next unit's all-gather is prefetched -- so up to two units are whole
  in backward (and in forward on CUDA, where the next gather is issued while the current unit
  computes). Gathering copies out of the all-gather buffer (N padded shards): the unit's size
  twice, briefly.
  The root (embeddings, final norm, head) is gathered from the first forward to the end of
  the backward (FSDP2 does not reshard the root after forward);
- **gradients**: a unit's backward makes whole gradients, which its post-backward copies into a
  reduce-scatter buffer (whole size again) before keeping 1/N; FSDP2 keeps that buffer until the
  next unit's post-backward, through the next unit's gather, recomputation and backward; the
  root's whole gradients live from the loss's backward to the end of the backward;
- **the optimizer step** runs on shards: its temporaries are 1/N of one device's;
- **in flight**: gloo's worker thread marks a collective complete and only afterwards drops the
  tensors it holds (``ProcessGroupGloo::runLoop``), so an all-gather buffer the rank has already
  dropped can still be alive for a moment (``scripts/gloo_buffer_race.py``: after 24-53% of the
  calls); on CUDA the caching allocator likewise reuses a buffer only once the collective's stream
  has passed it. When such a late free straddles the
  rank's peak, the rank holds one unit's gathered buffer more -- seen once in 4 runs on a quiet
  machine, and with one rank slowed. Every point counts the largest unit's (or the root's)
  buffer once more (``in_flight_bytes``, in the temporaries): the estimate bounds every rank's
  peak from above, by at most that buffer.

Under amp, gathered weights are fp32 and autocast's half-precision weight copies are part of the
activations, as on one device (see :mod:`autofit.trial.fsdp` for why no ``MixedPrecisionPolicy``).

Known limitations: profiles without ``grad_rows`` (before version 8) count shards as exactly 1/N;
the optimizer state is scaled by the parameters' padding (state follows each parameter's shape). On CUDA the context and the allocator's reserve are added as in
:mod:`autofit.estimator.memory_model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from autofit.core.config import Precision
from autofit.estimator.reserved_model import ReservedModel
from autofit.profiling.data import Line, PrecisionProfile, Region, segment_freed_late

# Columns of a line's constant parts: sharded+gathered params, shard+whole grads, optimizer state, buffers.
_PARAMS, _GRADS, _OPT, _TEMP = range(4)
FSDP_EXTRA_COLUMNS = ("shard_bytes", "gathered_bytes")


def padded_shard_bytes(rows: tuple[tuple[int, int], ...], total_bytes: float, n_ranks: int) -> float:
    """Rank 0's shard of parameters with ``rows`` = (size(0), bytes): ``ceil(size(0)/N)`` rows each.

    Without rows (an older profile) the shard is ``total_bytes / N``.
    """
    if not rows:
        return total_bytes / n_ranks
    r = np.asarray(rows, dtype=np.float64).reshape(-1, 2)
    return float((np.ceil(r[:, 0] / n_ranks) * r[:, 1] / r[:, 0]).sum())


def fsdp_units(n_layers: int, checkpoint_every: int) -> list[tuple[int, int]]:
    """``[start, end)`` layer ranges that are one FSDP unit each: a layer, or a checkpoint segment."""
    k = checkpoint_every if checkpoint_every > 1 else 1
    return [(s, min(s + k, n_layers)) for s in range(0, n_layers, k)]


@dataclass(frozen=True)
class RankLines:
    """One micro-step of a rank as lines ``c0 + c1·b``, first and later micro-steps.

    ``consts``: (E, 4) constant bytes at each line (params, grads, optimizer, temporary);
    ``acts``: (E, 2) activations at each line; ``gathered``: (E,) whole weights at each line.
    """

    first_consts: np.ndarray
    first_acts: np.ndarray
    first_gathered: np.ndarray
    first_phase: tuple
    later_consts: np.ndarray
    later_acts: np.ndarray
    later_gathered: np.ndarray
    later_phase: tuple
    shard_bytes: float          # params + grads + optimizer shards, and buffers
    optimizer_line: np.ndarray  # (4,) the optimizer step's constant parts
    in_flight_bytes: float      # one collective buffer the communication thread may still hold


class _Timeline:
    """Points of one micro-step: activations (a line) and FSDP's constant bytes at that moment."""

    def __init__(self, base: np.ndarray) -> None:
        self.base = base
        self.consts: list[np.ndarray] = []
        self.acts: list[Line] = []
        self.gathered: list[float] = []
        self.phases: list[str] = []

    def at(self, act: Line, phase: str, *, gathered: float = 0.0, grads: float = 0.0, temp: float = 0.0) -> None:
        c = self.base.copy()
        c[_PARAMS] += gathered
        c[_GRADS] += grads
        c[_TEMP] += temp
        self.consts.append(c)
        self.acts.append(act)
        self.gathered.append(gathered)
        self.phases.append(phase)


    def peaks(self, live: Line, region: Region, phase: str, **parts: float) -> None:
        """A region's highest point above ``live``: at the profiled sizes, and its steepest operator's."""
        for peak in region.peaks:
            self.at(_plus(live, peak), phase, **parts)


def _plus(a: Line, b: Line, scale: float = 1.0) -> Line:
    return (a[0] + scale * b[0], a[1] + scale * b[1])


_NOTHING = Region((0.0, 0.0), (0.0, 0.0), (0.0, 0.0), (0.0, 0.0))


def _output_regions(pp: PrecisionProfile) -> tuple[Region, Region, Region, Region]:
    """(head forward, loss forward, loss backward, head backward); without the cut, all after the
    layers counts as head (the root's weights gathered: an upper bound)."""
    if pp.head_forward is None:
        return pp.post_forward, _NOTHING, _NOTHING, pp.post_backward
    return pp.head_forward, pp.loss_forward, pp.loss_backward, pp.head_backward


class _RankWalk(_Timeline):
    """The state :func:`_walk` advances along rank 0's micro-step: live activations (a line), the
    all-gather or reduce-scatter buffer held, the gradient shards made; and the units' sizes."""

    def __init__(self, pp: PrecisionProfile, n_ranks: int, every: int, later: bool, cuda: bool) -> None:
        layers = pp.layers
        units = fsdp_units(len(layers), every)
        self.w = [float(sum(layers[i].grad_bytes for i in range(s, e))) for s, e in units]  # whole weights = grads' size
        self.ws = [sum(padded_shard_bytes(layers[i].grad_rows, layers[i].grad_bytes, n_ranks) for i in range(s, e))
                   for s, e in units]  # rank 0's padded shards
        self.wb = [n_ranks * x for x in self.ws]  # a unit's all-gather (and reduce-scatter) buffer: N padded shards
        self.root = float(pp.grad_bytes - sum(self.w))
        grad_total = float(pp.grad_bytes)
        shard_total = _shard_total(pp, n_ranks)
        self.root_s = shard_total - sum(self.ws)
        self.root_b = n_ranks * self.root_s
        self.in_flight = max([*self.wb, self.root_b])
        super().__init__(np.array([shard_total + pp.static_param_bytes - grad_total, 0.0,
                                   _optimizer_shard(pp, n_ranks), self.in_flight]))
        self.pp, self.layers, self.units, self.every, self.later, self.cuda = pp, layers, units, every, later, cuda
        self.g_sh = shard_total if later else 0.0  # gradient shards (later micro-steps: all, accumulating)
        self.live: Line = (0.0, 0.0)
        self.held = 0.0
        self.root_grads = 0.0
        self.amp_cache = [0.0] * len(layers)  # autocast's weight copies kept to the end of forward in checkpointed segments
        if every and Precision(pp.precision).is_amp:
            self.amp_cache = [max(0.0, l.forward.delta[0]) for l in layers]
        # segment arguments the unchecked profile saw die as the model returned: each checkpoint keeps its own
        self.late = [segment_freed_late(layers, s, e) if every else (0.0, 0.0) for s, e in units]

    def _wb_at(self, u: int) -> float:
        return self.wb[u] if 0 <= u < len(self.wb) else 0.0

    def forward(self) -> None:
        """The root, then each unit gathered (copied out of its buffer, which stays held)."""
        root, layers, g_sh = self.root, self.layers, self.g_sh
        self.at(self.live, "forward", gathered=root + self.root_b, grads=g_sh)
        self.peaks(self.live, self.pp.pre_forward, "forward", gathered=root + self.root_b, grads=g_sh)
        self.live = _plus(self.live, self.pp.pre_forward.delta)
        self.held = self.root_b
        for u, (s, e) in enumerate(self.units):
            ahead = self._wb_at(u + 1) if self.cuda else 0.0  # CUDA issues the next gather while this unit computes
            self.at(self.live, "forward", gathered=root + self.held + self.w[u] + self.wb[u], grads=g_sh)
            self.held = self.wb[u]
            gathered = root + self.w[u] + self.held + ahead
            if self.every:  # one checkpointed segment: only its output survives
                kept: Line = (0.0, 0.0)
                for i in range(s, e):
                    self.peaks(_plus(self.live, kept), layers[i].forward_checkpointed(), "forward", gathered=gathered,
                               grads=g_sh)
                    kept = layers[i].output
                    self.live = _plus(self.live, _plus((self.amp_cache[i], 0.0), layers[i].retained))
                self.live = _plus(self.live, layers[e - 1].output)
            else:
                self.peaks(self.live, layers[s].forward, "forward", gathered=gathered, grads=g_sh)
                self.live = _plus(self.live, _plus(layers[s].forward.delta, layers[s].after))

    def output(self) -> None:
        """The head and the loss, forward and backward, between the units' forwards and backwards."""
        root, g_sh, wb = self.root, self.g_sh, self.wb
        head_fwd, loss_fwd, loss_bwd, head_bwd = _output_regions(self.pp)
        late_total = (sum(x[0] for x in self.late), sum(x[1] for x in self.late))
        self.peaks(_plus(self.live, late_total), head_fwd, "forward", gathered=root + self.held, grads=g_sh)
        self.live = _plus(self.live, head_fwd.delta)
        # the root's post-forward frees its weights and the held buffer; the loss runs without them
        self.peaks(_plus(self.live, late_total), loss_fwd, "forward", grads=g_sh)
        self.live = _plus(self.live, _plus(loss_fwd.delta, late_total))
        self.live = _plus(self.live, (-sum(self.amp_cache), 0.0))  # autocast exits
        self.peaks(self.live, loss_bwd, "backward", grads=g_sh)
        self.live = _plus(self.live, loss_bwd.delta_nongrad)
        # the output's gradient: the root gathered again, the last unit's gather prefetched
        last = len(self.units) - 1
        self.at(self.live, "backward", gathered=max(root + self.root_b, root + wb[last]), grads=g_sh)
        self.peaks(self.live, head_bwd, "backward", gathered=root + wb[last], grads=g_sh)
        self.live = _plus(self.live, head_bwd.delta_nongrad)
        # The root's whole gradients made in the head's backward live until the root's post-backward
        # at the end. (A weight tied to the embedding is not among them: autograd sums its two uses
        # before accumulating, so the head's part is in the live bytes already.)
        self.root_grads = max(0.0, head_bwd.delta[0] - head_bwd.delta_nongrad[0])

    def unit_backward(self, u: int) -> None:
        """Unit ``u``'s gather, recomputation (checkpointed), backward and post-backward."""
        (s, e), layers, root, root_grads, w, wb = self.units[u], self.layers, self.root, self.root_grads, self.w, self.wb
        prefetch = self._wb_at(u - 1)
        # FSDP2 keeps the previous unit's reduce-scatter input (its N padded shards) alive until
        # this unit's post-backward (``reduce_scatter_states``, at most one in flight): through
        # this unit's gather, recomputation and backward. Its size is that unit's, not this one's
        # (measured on torch 2.13: convnet-bn's 2 MiB last segment beside the 0.5 MiB one before it).
        held = wb[u + 1] if u < len(self.units) - 1 else 0.0
        # copy-out of this unit's (prefetched) gather, and the previous unit's gather issued
        self.at(self.live, "backward", gathered=root + w[u] + wb[u], grads=self.g_sh + root_grads, temp=held)
        gathered = root + w[u] + prefetch
        if self.every:
            if layers[e - 1].output_saved:
                self.live = _plus(self.live, layers[e - 1].output, -1.0)
            for i in range(s, e):  # recomputation under the gathered unit
                self.peaks(self.live, layers[i].recomputed(last=i == e - 1), "backward", gathered=gathered,
                           grads=self.g_sh + root_grads, temp=held)
                self.live = _plus(self.live, layers[i].forward.delta if i == s
                                  else _plus(layers[i].forward.delta, layers[i].after))
            if not layers[e - 1].output_saved:
                self.live = _plus(self.live, layers[e - 1].output, -1.0)
        whole = 0.0
        for i in reversed(range(s, e)):
            self.peaks(self.live, layers[i].backward, "backward", gathered=gathered,
                       grads=self.g_sh + root_grads + whole, temp=held)
            whole += layers[i].grad_bytes
            self.live = _plus(self.live, layers[i].backward.delta_nongrad)
        if self.every:  # the checkpoint kept the segment's input to here (freed in ``after`` where no layer saves it)
            self.live = _plus(_plus(self.live, layers[s].after), self.late[u], -1.0)
        # post-backward: reshard, the previous reduce-scatter input dropped, then the whole
        # gradients copied into this unit's reduce-scatter input (kept until the next one's)
        self.at(self.live, "backward", gathered=root + prefetch, grads=self.g_sh + root_grads + w[u],
                temp=wb[u] + self.ws[u])
        self.held = wb[u]
        if not self.later:
            self.g_sh += self.ws[u]

    def root_backward(self) -> None:
        """The embedding's backward, then the root's reduce-scatter."""
        self.peaks(self.live, self.pp.pre_backward, "backward", gathered=self.root, grads=self.g_sh + self.root_grads,
                   temp=self.held)
        self.live = _plus(self.live, self.pp.pre_backward.delta_nongrad)
        self.at(self.live, "backward", grads=self.g_sh + self.root, temp=self.root_b + self.root_s)


def _walk(pp: PrecisionProfile, n_ranks: int, every: int, later: bool, cuda: bool) -> _Timeline:
    """One micro-step of rank 0, region by region (see the module docstring for each term).

    In forward FSDP2 keeps the last all-gather's buffer until the next gather is copied out
    ("held"), so a unit's size is alive twice while it computes; in backward the buffer held is
    the previous unit's reduce-scatter input, and the next unit's prefetched gather is alive beside them. Region peaks are taken with their own
    gradients (FSDP makes whole gradients as one device does); live bytes advance without them
    (FSDP turns them into shards at the unit's post-backward).
    """
    walk = _RankWalk(pp, n_ranks, every, later, cuda)
    walk.forward()
    walk.output()
    for u in reversed(range(len(walk.units))):
        walk.unit_backward(u)
    walk.root_backward()
    return walk


def _shard_total(pp: PrecisionProfile, n_ranks: int) -> float:
    """Rank 0's padded shard of all trainable parameters (also of their gradients)."""
    return padded_shard_bytes(pp.grad_rows, pp.grad_bytes, n_ranks)


def _optimizer_shard(pp: PrecisionProfile, n_ranks: int) -> float:
    """Rank 0's optimizer state: the state follows each parameter, so it is padded like them."""
    if pp.grad_bytes <= 0:
        return pp.optimizer_bytes / n_ranks
    return pp.optimizer_bytes * _shard_total(pp, n_ranks) / pp.grad_bytes


@lru_cache(maxsize=1024)
def rank_lines(pp: PrecisionProfile, n_ranks: int, every: int, cuda: bool) -> RankLines:
    """The lines of rank 0's micro-steps (cached: one walk per precision, ranks and checkpoint interval)."""
    first, later = _walk(pp, n_ranks, every, False, cuda), _walk(pp, n_ranks, every, True, cuda)
    opt = first.base.copy()
    opt[_GRADS] += _shard_total(pp, n_ranks)
    opt[_TEMP] += pp.optimizer_peak_bytes / n_ranks

    def arr(x):
        return np.array(x, dtype=np.float64)

    return RankLines(
        first_consts=arr(first.consts), first_acts=arr(first.acts), first_gathered=arr(first.gathered),
        first_phase=tuple(f"first {p}" for p in first.phases),
        later_consts=arr(later.consts), later_acts=arr(later.acts), later_gathered=arr(later.gathered),
        later_phase=tuple(f"later {p}" for p in later.phases),
        shard_bytes=float(first.base[_PARAMS] + first.base[_OPT] + _shard_total(pp, n_ranks)), optimizer_line=opt,
        in_flight_bytes=first.in_flight,
    )


def score_fsdp(pp: PrecisionProfile, n_ranks: int, every: int, b: np.ndarray, k: np.ndarray, *,
               cuda: bool, context_bytes: float, reserved: ReservedModel) -> dict[str, np.ndarray]:
    """Peak bytes of rank 0 for micro-batches ``b`` and accumulations ``k`` (arrays of one length).

    Returns arrays: ``peak_bytes``, the six breakdown categories (``params_bytes`` counts the
    shards and the gathered weights at the peak), ``shard_bytes`` (all shards and buffers),
    ``gathered_bytes`` (whole weights at the peak) and ``phase``.
    """
    lines = rank_lines(pp, n_ranks, every, cuda)
    m = len(b)
    rows = np.arange(m)

    def best(consts, acts):
        v = consts.sum(axis=1)[None, :] + acts[:, 0][None, :] + acts[:, 1][None, :] * b[:, None]  # (m, E)
        a = np.argmax(v, axis=1)
        return v[rows, a], a

    p1, a1 = best(lines.first_consts, lines.first_acts)
    pn, an = best(lines.later_consts, lines.later_acts)
    pn = np.where(k > 1, pn, -np.inf)
    popt = np.full(m, lines.optimizer_line.sum())
    peak = np.maximum(np.maximum(p1, pn), popt)
    is1 = p1 >= np.maximum(pn, popt)
    isn = ~is1 & (pn >= popt)

    def pick(first, later, opt):
        return np.where(is1, first, np.where(isn, later, opt))

    consts = pick(lines.first_consts[a1].T, lines.later_consts[an].T, lines.optimizer_line[:, None]).T  # (m, 4)
    acts = pick(lines.first_acts[a1, 0] + lines.first_acts[a1, 1] * b, lines.later_acts[an, 0] + lines.later_acts[an, 1] * b, 0.0)
    gathered = pick(lines.first_gathered[a1], lines.later_gathered[an], 0.0)
    input_bytes = (pp.input_bytes[0] + pp.input_bytes[1] * b) if cuda else np.zeros(m)
    # what a step leaves for the next (a hook's stash) is alive through all of it: with the activations
    kept = pp.kept_bytes[0] + pp.kept_bytes[1] * b
    peak = peak + kept
    overhead = (context_bytes + reserved.extra_bytes(peak + input_bytes, every > 0)) if cuda else np.zeros(m)
    phase = pick(np.array(lines.first_phase, dtype=object)[a1], np.array(lines.later_phase, dtype=object)[an], "optimizer")
    return {
        "peak_bytes": peak + input_bytes + overhead,
        "params_bytes": consts[:, _PARAMS], "grads_bytes": consts[:, _GRADS], "optimizer_bytes": consts[:, _OPT],
        "activations_bytes": np.maximum(acts, 0.0) + kept + input_bytes, "temporary_bytes": consts[:, _TEMP],
        "overhead_bytes": overhead, "shard_bytes": np.full(m, lines.shard_bytes), "gathered_bytes": gathered,
        "phase": phase,
    }

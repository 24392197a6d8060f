"""The memory model of one FSDP rank (``split_mode = fsdp``), from the same profile as one device.

Every rank runs the whole model on its own ``micro_batch`` samples, so its activations are
those of one device at that micro-batch: the profile's regions, laid end to end as
:mod:`autofit.memory_model` does, counted without parameter gradients. What FSDP2
(:mod:`autofit.fsdp`) changes is the model state and its traffic, added here term by term
(N ranks; bytes in the parameter dtype; ``torch.distributed.fsdp`` 2.x behaviour):

- **shards**: each rank keeps 1/N of the parameters, of the gradients (from the first
  reduce-scatter on) and of the optimizer state; buffers are not sharded (every rank has them);
- **gathered weights**: a unit (a layer, or a checkpoint segment of k layers) is all-gathered
  before its forward and freed after it (``reshard_after_forward``), and gathered again before
  its backward while the next unit's all-gather is prefetched -- so up to two units are whole
  in backward (and in forward on CUDA, where the next gather is issued while the current unit
  computes). Gathering copies out of the all-gather buffer: the unit's size twice, briefly.
  The root (embeddings, final norm, head) is gathered from the first forward to the end of
  the backward (FSDP2 does not reshard the root after forward);
- **gradients**: a unit's backward makes whole gradients, which its post-backward copies into a
  reduce-scatter buffer (whole size again) before keeping 1/N; the root's whole gradients live
  from the loss's backward to the end of the backward;
- **the optimizer step** runs on shards: its temporaries are 1/N of one device's.

Under amp, gathered weights are fp32 and autocast's half-precision weight copies are part of the
activations, as on one device (see :mod:`autofit.fsdp` for why no ``MixedPrecisionPolicy``).

Known limitations: shards are counted as exactly 1/N (FSDP pads dimension 0 to a multiple of N:
at most one row per parameter, which the profile does not size); the largest rank is rank 0,
whose optimizer state is at least 1/N. On CUDA the context and fragmentation are added as in
:mod:`autofit.memory_model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from autofit.profile import Line, PrecisionProfile

# Columns of a line's constant parts: sharded+gathered params, shard+whole grads, optimizer state, buffers.
_PARAMS, _GRADS, _OPT, _TEMP = range(4)
FSDP_EXTRA_COLUMNS = ("shard_bytes", "gathered_bytes")


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


def _plus(a: Line, b: Line, scale: float = 1.0) -> Line:
    return (a[0] + scale * b[0], a[1] + scale * b[1])


def _walk(pp: PrecisionProfile, n_ranks: int, every: int, later: bool, cuda: bool) -> _Timeline:
    """One micro-step of rank 0, region by region (see the module docstring for each term)."""
    layers = pp.layers
    n = len(layers)
    units = fsdp_units(n, every)
    unit_of = {i: u for u, (s, e) in enumerate(units) for i in range(s, e)}
    w = [float(sum(layers[i].grad_bytes for i in range(s, e))) for s, e in units]  # whole weights = grads' size
    root = float(pp.grad_bytes - sum(w))
    grad_total = float(pp.grad_bytes)
    shard = grad_total / n_ranks
    base = np.array([shard + pp.static_param_bytes - grad_total, 0.0, pp.optimizer_bytes / n_ranks, 0.0])
    t = _Timeline(base)
    g_sh = shard if later else 0.0  # gradient shards alive (later micro-steps: all, accumulating)
    live: Line = (0.0, 0.0)
    amp_cache = [0.0] * n  # autocast's weight copies kept to the end of forward in checkpointed segments
    if every and pp.precision.startswith("amp"):
        amp_cache = [max(0.0, l.forward.delta[0]) for l in layers]

    def nxt(u: int) -> float:
        return w[u] if 0 <= u < len(w) else 0.0

    # forward
    t.at(live, "forward", gathered=2 * root, grads=g_sh)  # the root's all-gather, copied out
    t.at(_plus(live, pp.pre_forward.peak), "forward", gathered=root, grads=g_sh)
    live = _plus(live, pp.pre_forward.delta)
    for u, (s, e) in enumerate(units):
        ahead = nxt(u + 1) if cuda else 0.0
        t.at(live, "forward", gathered=root + 2 * w[u] + ahead, grads=g_sh)
        if every:  # one checkpointed segment: only its output survives
            held: Line = (0.0, 0.0)
            for i in range(s, e):
                t.at(_plus(_plus(live, held), layers[i].forward.peak), "forward", gathered=root + w[u] + ahead, grads=g_sh)
                held = layers[i].output
                live = _plus(live, (amp_cache[i], 0.0))
            live = _plus(live, layers[e - 1].output)
        else:
            t.at(_plus(live, layers[s].forward.peak), "forward", gathered=root + w[u] + ahead, grads=g_sh)
            live = _plus(live, layers[s].forward.delta)
    t.at(_plus(live, pp.post_forward.peak), "forward", gathered=root, grads=g_sh)
    live = _plus(live, pp.post_forward.delta)
    live = _plus(live, (-sum(amp_cache), 0.0))  # autocast exits
    # backward: the head first, with the last unit's all-gather prefetched
    last = len(units) - 1
    root_grads = float(pp.post_grad_bytes)
    t.at(_plus(live, pp.post_backward.peak_nongrad), "backward", gathered=root + w[last],
         grads=g_sh + root_grads)
    live = _plus(live, pp.post_backward.delta_nongrad)
    for u in reversed(range(len(units))):
        s, e = units[u]
        prefetch = nxt(u - 1)
        # copy-out of this unit's gather, then the previous unit's gather issued
        t.at(live, "backward", gathered=root + max(2 * w[u], w[u] + prefetch), grads=g_sh + root_grads)
        if every:
            if layers[e - 1].output_saved:
                live = _plus(live, layers[e - 1].output, -1.0)
            for i in range(s, e):  # recomputation under the gathered unit
                t.at(_plus(live, layers[i].forward.peak), "backward", gathered=root + w[u] + prefetch,
                     grads=g_sh + root_grads)
                live = _plus(live, layers[i].forward.delta)
            if not layers[e - 1].output_saved:
                live = _plus(live, layers[e - 1].output, -1.0)
        whole = 0.0
        for i in reversed(range(s, e)):
            whole += layers[i].grad_bytes
            t.at(_plus(live, layers[i].backward.peak_nongrad), "backward", gathered=root + w[u] + prefetch,
                 grads=g_sh + root_grads + whole)
            live = _plus(live, layers[i].backward.delta_nongrad)
        # post-backward: reshard, copy the whole gradients into the reduce-scatter buffer
        t.at(live, "backward", gathered=root + prefetch, grads=g_sh + root_grads + w[u], temp=w[u] + w[u] / n_ranks)
        if not later:
            g_sh += w[u] / n_ranks
    t.at(_plus(live, pp.pre_backward.peak_nongrad), "backward", gathered=root, grads=g_sh + root)
    live = _plus(live, pp.pre_backward.delta_nongrad)
    t.at(live, "backward", gathered=0.0, grads=g_sh + root, temp=root + root / n_ranks)  # the root's reduce-scatter
    return t


@lru_cache(maxsize=1024)
def rank_lines(pp: PrecisionProfile, n_ranks: int, every: int, cuda: bool) -> RankLines:
    """The lines of rank 0's micro-steps (cached: one walk per precision, ranks and checkpoint interval)."""
    first, later = _walk(pp, n_ranks, every, False, cuda), _walk(pp, n_ranks, every, True, cuda)
    grad_total = float(pp.grad_bytes)
    opt = first.base.copy()
    opt[_GRADS] += grad_total / n_ranks
    opt[_TEMP] += pp.optimizer_peak_bytes / n_ranks

    def arr(x):
        return np.array(x, dtype=np.float64)

    return RankLines(
        first_consts=arr(first.consts), first_acts=arr(first.acts), first_gathered=arr(first.gathered),
        first_phase=tuple(f"first {p}" for p in first.phases),
        later_consts=arr(later.consts), later_acts=arr(later.acts), later_gathered=arr(later.gathered),
        later_phase=tuple(f"later {p}" for p in later.phases),
        shard_bytes=float(first.base[_PARAMS] + first.base[_OPT] + grad_total / n_ranks), optimizer_line=opt,
    )


def score_fsdp(pp: PrecisionProfile, n_ranks: int, every: int, b: np.ndarray, k: np.ndarray, *,
               cuda: bool, context_bytes: float, fragmentation: float) -> dict[str, np.ndarray]:
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
    overhead = (context_bytes + fragmentation * (peak + input_bytes)) if cuda else np.zeros(m)
    phase = pick(np.array(lines.first_phase, dtype=object)[a1], np.array(lines.later_phase, dtype=object)[an], "optimizer")
    return {
        "peak_bytes": peak + input_bytes + overhead,
        "params_bytes": consts[:, _PARAMS], "grads_bytes": consts[:, _GRADS], "optimizer_bytes": consts[:, _OPT],
        "activations_bytes": np.maximum(acts, 0.0) + input_bytes, "temporary_bytes": consts[:, _TEMP],
        "overhead_bytes": overhead, "shard_bytes": np.full(m, lines.shard_bytes), "gathered_bytes": gathered,
        "phase": phase,
    }

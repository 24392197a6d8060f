"""The memory model, vectorised: many configs scored at once (:func:`estimate_table`).

For one structure (precision, checkpoint interval, split) every quantity is a line ``c0 + c1·b``
in the micro-batch b (:mod:`autofit.estimator.stage_walk` lays them out per stage), so the peak is
the upper envelope of a few dozen lines, evaluated for all micro-batches and accumulation counts at
once with numpy; pipeline stages add the micro-batches in flight and their receive buffers here.
The model itself is described in :mod:`autofit.estimator.memory_model`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from autofit.core.config import (
    FIELDS,
    CheckpointPolicy,
    Offload,
    OptimizerChoice,
    PipelineSchedule,
    Precision,
    SplitMode,
    TrainConfig,
    stage_bounds,
)
from autofit.core.errors import ProfileError
from autofit.estimator.fsdp_memory import FSDP_EXTRA_COLUMNS, score_fsdp
from autofit.estimator.offload_memory import host_refusal, offload_refusal, offloaded
from autofit.estimator.reserved_model import FITTED as RESERVED
from autofit.estimator.stage_walk import stage_lines
from autofit.probes.cuda_overhead import CudaOverhead, fallback_overhead
from autofit.profiling.data import PrecisionProfile, Profile, with_optimizer
from autofit.profiling.step import CUDA_BLOCK_BYTES
from autofit.runtime.optimizers import missing_library, refusal

BREAKDOWN = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "temporary_bytes", "overhead_bytes")


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


def whole_bytes(peak: np.ndarray | float) -> np.ndarray:
    """A peak in whole bytes, rounded up: lines fitted through two micro-batches can land on a half byte
    between them, which rounding to the nearest could put under the peak. A float's last bits are not a byte."""
    return np.ceil(np.asarray(peak, dtype=np.float64) - 1e-6).astype(np.int64)


# A scalar tensor: an fp32 value on the CPU, one allocator block on CUDA.
_SCALAR_BYTES = {False: 4, True: CUDA_BLOCK_BYTES}


def _step_scalars(pp: PrecisionProfile, k: np.ndarray, last_stage: bool, split: int,
                  cuda: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scalars a step keeps beside the profiled micro-step, during its first micro-step, during later
    ones and through the optimizer step. The last stage keeps each micro-batch's loss until the step
    returns their mean (the training loop, and the pipeline schedule): a micro-step's own is in its
    regions, the earlier ones are not, and all ``k`` are alive through the optimizer step. amp-fp16's
    GradScaler keeps its scale and growth tracker on every stage from the first step on, and through
    the optimizer step the inf check its unscale made; a pipeline's schedule keeps the scaled loss,
    beside the loss itself."""
    scalar = _SCALAR_BYTES[cuda]
    fp16 = Precision(pp.precision) is Precision.AMP_FP16
    per_loss = 2 * scalar if fp16 and split > 1 else scalar
    losses = k.astype(np.float64) * per_loss if last_stage else np.zeros(len(k))
    scaler = 2 * scalar if fp16 else 0
    found_inf = scalar if fp16 else 0
    return np.full(len(k), float(scaler)), np.maximum(losses - per_loss, 0.0) + scaler, losses + scaler + found_inf


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


# Why a pipeline split of a model with weights tied across its ends has no estimate where its profile was
# made without the ends (estimate_table's unprofiled_ends_invalid).
ENDS_NOT_PROFILED = ("not estimated: its end stages' own copies of the weights tied across the model's ends "
                     "were not profiled (a search profiles them only for the splits its workers run)")


def estimate_table(profile: Profile, configs: list[TrainConfig], budget_bytes: int | None = None,
                   schedule: PipelineSchedule | str = PipelineSchedule.ONE_F_ONE_B,
                   overhead: CudaOverhead | None = None, host_bytes: int | None = None,
                   unprofiled_ends_invalid: bool = False) -> pd.DataFrame:
    """Score many configs at once. One row per config, in the given order.

    ``overhead``: the CUDA device's measured context and workspace (``DeviceRates.memory_overhead()``);
    None on CUDA means the fallback constants (:func:`autofit.probes.cuda_overhead.fallback_overhead`).
    ``host_bytes``: the host memory ``offload=optimizer`` configs must fit in (None: this machine's;
    :mod:`autofit.estimator.offload_memory`).

    Columns: the config fields, the six breakdown categories (at the largest device's
    peak), ``model_state_bytes``, ``peak_bytes``, ``per_device_peak_bytes`` (a tuple),
    ``peak_phase``, ``fits`` (None without a budget) and ``valid`` / ``reason`` (False with a
    reason when the config cannot run at all, e.g. more stages than layers, an ``optimizer`` the
    workload's cannot be replaced with, or ``offload=optimizer`` on the CPU; its peak is NaN).
    With ``offload=optimizer`` the breakdown's ``optimizer_bytes`` is the state left on the device;
    ``model_state_bytes`` is always the whole state, wherever it lives.
    Raises KeyError if the profile lacks a precision in ``configs``, ProfileError if it lacks the
    split ends a pipeline split of a model with tied weights needs
    (:func:`autofit.estimator.memory_model.needs_split_ends`) or an ``optimizer`` choice a config asks
    for (:func:`autofit.estimator.memory_model.optimizer_choices`). ``unprofiled_ends_invalid``: such a
    pipeline split is invalid with the reason :data:`ENDS_NOT_PROFILED` instead (for a search's splits over more
    devices than a worker has: it never runs them, and does not profile their ends to estimate them).
    """
    n = len(configs)
    cols = {f: np.array([getattr(getattr(c, f), "value", getattr(c, f)) for c in configs]) for f in FIELDS}
    out = {k: np.zeros(n, dtype=np.float64) for k in BREAKDOWN + ("peak_bytes",)}
    per_device = np.empty(n, dtype=object)
    phase = np.empty(n, dtype=object)
    valid = np.ones(n, dtype=bool)
    reason = np.full(n, "", dtype=object)
    extra = {name: np.full(n, np.nan) for name in FSDP_EXTRA_COLUMNS}
    model_state = np.zeros(n, dtype=np.float64)
    for (precision, every, split, mode, choice, policy, offload), members in _structures(configs).items():
        idx = np.array(members, dtype=np.int64)
        why = lever_refusal(profile, choice, policy, mode is SplitMode.FSDP and split > 1)
        if why is None and offload is Offload.OPTIMIZER:
            why = (offload_refusal(profile, configs[members[0]])
                   or host_refusal(profile_for(profile, precision, choice), host_bytes))
        if why is None and every > 0:
            why = retained_refusal(profile.for_precision(precision), fsdp=mode is SplitMode.FSDP and split > 1)
        if why is None and mode is not SplitMode.FSDP and split > profile.n_layers:
            why = (f"device_split {split} > {profile.n_layers} layers: each pipeline stage needs at least "
                   f"one layer (device_split 1 to {profile.n_layers})")
        if why is not None:
            valid[idx] = False
            reason[idx] = why
            out["peak_bytes"][idx] = np.nan
            per_device[idx] = [()] * len(idx)
            as_given = profile.for_precision(precision)
            model_state[idx] = as_given.static_param_bytes + as_given.grad_bytes + as_given.optimizer_bytes
            continue
        pp = profile_for(profile, precision, choice)
        model_state[idx] = pp.static_param_bytes + pp.grad_bytes + pp.optimizer_bytes
        device_overhead = overhead or fallback_overhead()
        if offload is Offload.OPTIMIZER:  # the workload's Adam or AdamW is made fused, Adafactor is not
            pp = offloaded(pp, fused=choice is OptimizerChoice.AS_GIVEN)
            device_overhead = dataclasses.replace(
                device_overhead, context_bytes=device_overhead.context_bytes + device_overhead.offload_context_bytes)
        selective = policy is CheckpointPolicy.SELECTIVE
        if selective and pp.selective_skipped:
            raise ProfileError(
                f"{profile.workload} {precision.value}: the selective checkpoint policy needs the layers' selective "
                "forwards profiled, but the profile was made with selective=False; profile with "
                "profile_workload(..., selective=True)")
        if mode is SplitMode.FSDP and split > 1:
            _score_fsdp_group(profile, pp, overhead or fallback_overhead(), every, split,
                              cols["micro_batch"][idx].astype(np.float64), cols["grad_accum"][idx].astype(np.int64),
                              idx, out, extra, per_device, phase)
            continue
        if split > 1 and pp.split_ends_skipped and not profile.split_refusal:
            if unprofiled_ends_invalid:
                valid[idx], reason[idx], out["peak_bytes"][idx] = False, ENDS_NOT_PROFILED, np.nan
                per_device[idx] = [()] * len(idx)
                continue
            raise ProfileError(
                f"{profile.workload} {precision.value}: device_split {split} (pipeline) needs the profile's split ends "
                "(each end stage holds its own copy of the weights tied across the model's ends), but it was made "
                "with split_ends=False; profile with profile_workload(..., split_ends=True)")
        _score_group(profile, pp, device_overhead, min(every, profile.n_layers), split,
                     cols["micro_batch"][idx].astype(np.float64), cols["grad_accum"][idx].astype(np.int64),
                     schedule, idx, out, per_device, phase, selective)
    _refuse_splits(profile, configs, valid, reason)
    table = pd.DataFrame({f: cols[f] for f in FIELDS})
    for k in BREAKDOWN + ("peak_bytes",):
        table[k] = out[k]
    for name in FSDP_EXTRA_COLUMNS:  # fsdp rows only: all shards, and the whole weights at the peak
        table[name] = extra[name]
    table["model_state_bytes"] = model_state
    table["per_device_peak_bytes"] = per_device
    table["peak_phase"] = phase
    table["valid"] = valid
    table["reason"] = reason
    table["fits"] = (table["peak_bytes"] <= budget_bytes) & valid if budget_bytes is not None else None
    return table


def _structures(configs: list[TrainConfig]) -> dict[tuple, list[int]]:
    """Config indices grouped by what fixes the peak's lines: (precision, checkpoint interval, split, mode,
    optimizer, checkpoint policy, offload)."""
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(configs):
        groups.setdefault((c.precision, c.checkpoint_every, c.device_split, c.split_mode, c.optimizer,
                           c.checkpoint_policy, c.offload), []).append(i)
    return groups


def retained_refusal(pp, fsdp: bool) -> str | None:
    """Why a checkpointed step cannot be estimated for layers that keep tensors beyond backward (a key/value
    cache the model returns), or None. The recomputation calls each layer again with the same cache, which
    grows and keeps the recomputed graph: the profile replays it (``LayerProfile.retained_recomputed``, never
    zero for a layer that keeps something, unless the replay failed) and the one-device and pipeline walks
    count it; an FSDP rank's walk does not. An invalid config is never a false fit; the fix is the model's
    own switch."""
    keeping = [layer for layer in pp.layers if layer.retained[1] > 0 or layer.retained[0] > 0]
    if not keeping:
        return None
    if fsdp:
        return ("checkpointing with split_mode=fsdp recomputes layers that append to a cache they keep (a "
                "key/value cache the model returns while it trains): not estimated; set use_cache=False, or "
                "checkpoint_every 0")
    if any(layer.retained_recomputed == (0.0, 0.0) for layer in keeping):
        return ("checkpointing recomputes layers that keep tensors beyond backward (a key/value cache the model "
                "returns while it trains), and the profile could not replay that recomputation: not estimated; "
                "set use_cache=False, or checkpoint_every 0")
    return None


def lever_refusal(profile: Profile, choice: OptimizerChoice, policy: CheckpointPolicy, fsdp: bool) -> str | None:
    """Why a config with lever choice ``choice`` and checkpoint ``policy`` cannot run (None: it can): the
    workload's optimizer is not one the lever replaces, its library is not installed, a model that
    selective checkpointing refuses (``Profile.selective_refusal``), or FSDP ranks (whose sharded
    parameters neither replacement nor the selective estimate handles)."""
    if choice is not OptimizerChoice.AS_GIVEN:
        why = refusal(choice, profile.optimizer) or missing_library(choice)
        if why is not None:
            return why
        if fsdp:
            return (f"optimizer={choice.value} with split_mode=fsdp: autofit does not run the replacement over "
                    "FSDP's sharded (DTensor) parameters; use one device or a pipeline split")
    if policy is CheckpointPolicy.SELECTIVE and getattr(profile, "selective_refusal", None):
        return profile.selective_refusal
    if policy is CheckpointPolicy.SELECTIVE and fsdp:
        return ("checkpoint_policy=selective with split_mode=fsdp: the FSDP rank's estimate does not model it; "
                "use checkpoint_policy=full")
    return None


def profile_for(profile: Profile, precision: Precision | str, choice: OptimizerChoice | str) -> PrecisionProfile:
    """``profile``'s precision as it trains with lever choice ``choice`` (the workload's own optimizer for
    ``as-given``). Raises ProfileError when the profile was made without that choice."""
    pp = profile.for_precision(precision)
    choice = OptimizerChoice(choice)
    if choice is OptimizerChoice.AS_GIVEN:
        return pp
    option = pp.optimizer_option(choice.value)
    if option is None:
        raise ProfileError(f"{profile.workload} {pp.precision}: optimizer={choice.value} needs the profile of that "
                           f"optimizer, which this profile lacks; profile with profile_workload(..., "
                           f"optimizers=[{choice.value!r}])")
    return with_optimizer(pp, option)


def _score_fsdp_group(profile: Profile, pp: PrecisionProfile, cuda_overhead: CudaOverhead, every: int, ranks: int,
                      b: np.ndarray, k: np.ndarray, idx: np.ndarray, out: dict, extra: dict, per_device, phase) -> None:
    # Every rank holds the same; rank 0 (the largest optimizer-state shard) stands for all. The
    # cuBLAS workspace is a block of its own: it goes with the context, outside the fragmentation.
    scored = score_fsdp(pp, ranks, min(every, profile.n_layers), b, k, cuda=profile.device_type == "cuda",
                        context_bytes=cuda_overhead.context_bytes + cuda_overhead.workspace_bytes,
                        reserved=RESERVED)
    for name in BREAKDOWN + ("peak_bytes",):
        out[name][idx] = scored[name]
    for name in FSDP_EXTRA_COLUMNS:
        extra[name][idx] = scored[name]
    per_device[idx] = [(int(whole_bytes(p)),) * ranks for p in scored["peak_bytes"]]
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


def _score_group(profile: Profile, pp: PrecisionProfile, cuda_overhead: CudaOverhead, every: int, split: int,
                 b: np.ndarray,
                 k: np.ndarray, schedule: PipelineSchedule | str, idx: np.ndarray, out: dict, per_device, phase,
                 selective: bool = False) -> None:
    cuda = profile.device_type == "cuda"
    n = len(idx)
    best = np.full(n, -np.inf)
    best_parts = {name: np.zeros(n) for name in BREAKDOWN}
    best_phase = np.empty(n, dtype=object)
    stage_peaks = []
    ends = (pp.split_ends or pp) if split > 1 else pp  # a split holds its own copy of each tied weight
    for s, (start, end) in enumerate(stage_bounds(profile.n_layers, split)):
        st = stage_lines(ends, start, end, s == 0, s == split - 1, every, selective)
        one = st.held[0] + st.held[1] * b                             # one micro-batch's activations
        kept, pending = _pipeline_buffers(ends, start, end, s, split, k, b, schedule)
        buffers = kept + pending
        # other micro-batches in flight: during the first micro-step, and during later ones
        held = one * (in_flight(s, split, k, schedule) - 1) + buffers
        held_later = one * (in_flight_later(s, split, k, schedule) - 1) + buffers
        # What a step leaves for the next (a hook's stash, a replaced buffer) is alive through all of it,
        # the optimizer step too. Which stage's layers made it is not profiled: every stage counts it all.
        carried = pp.kept_bytes[0] + pp.kept_bytes[1] * b
        first_scalars, later_scalars, step_scalars = _step_scalars(pp, k, last_stage=s == split - 1, split=split, cuda=cuda)
        kept = kept + carried + step_scalars
        held, held_later = held + carried + first_scalars, held_later + carried + later_scalars
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
        # The workspaces are allocated blocks of their own (no fragmentation); the context is outside the
        # allocator; what the allocator reserves beyond the tensors grows when checkpointing re-makes them.
        overhead = (cuda_overhead.context_bytes + cuda_overhead.workspace_bytes
                    + RESERVED.extra_bytes(stage_peak + input_bytes, every > 0)) if cuda else np.zeros(n)
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
    stacked = whole_bytes(np.stack(stage_peaks, axis=1))
    per_device[idx] = [tuple(int(x) for x in row) for row in stacked]
    phase[idx] = best_phase

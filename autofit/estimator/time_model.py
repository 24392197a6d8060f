"""The time model: a predicted step time for every config, from the profile's FLOPs and the device's rates.

It is a prior, for ordering a search and for sizing trial time limits; real trials calibrate
it (:mod:`autofit.estimator.calibration`). Three measured rates of the device, per dtype where it
matters, come from a short probe (:func:`probe_rates`: a child process with
``OMP_WAIT_POLICY=PASSIVE`` that measures twice, a few seconds once, then cached on disk next to
the profiles; implausible rates are never cached), never from a table of peak numbers: the same chip runs fp16 matmuls 1000x
slower than bf16 when it has no native kernel (docs/facts.md#device-rates-differ-by-dtype).

For one micro-step of ``b`` samples on a stage (shapes: scalars per config, vectorized over
a table of configs)::

    flops   = forward(b) + backward(b) + recompute(b)       # recompute: the checkpointed layers' forward
                                                            # (selective: less the matmuls and attention kept)
    bytes   = 4 * saved_activations(b) + 5 * weight_bytes   # write + read + gradient write + read; weights
                                                            # read by forward, dgrad, wgrad; grads written
    t_micro = flops / matmul_rate[dtype] + bytes / memory_rate + ops * op_latency

and for a step of ``m = grad_accum`` micro-batches over ``p`` pipeline stages (1F1B or GPipe,
Narayanan et al. SC'21)::

    t_step  = (m + p - 1) * max_s t_micro[s] + max_s t_optimizer[s]     # bubble (p - 1) / (m + p - 1)
    t_optimizer = 2 * (weights + grads + optimizer state) / memory_rate + ops * op_latency
    # an FSDP rank of N: the bytes / N, the ops on every tensor (a shard of each), each + a DTensor's overhead

With ``p = 1`` this is ``grad_accum * t_micro + t_optimizer`` (docs/facts.md#step-time-with-accumulation).
Backward FLOPs of a stage are the whole model's backward in proportion to the stage's forward FLOPs.

Known limitations: matmuls are costed at the probe's large-matrix rate (small matrices run
slower: the prior favours small micro-batches too much until calibrated); the operator count is
estimated from the parameter tensors, not counted; pipeline stages and FSDP ranks are assumed to run on
separate devices (ranks sharing one CPU get no speed-up, which the prior does not know). A split's
communication (FSDP's gathers and reduce-scatters, a pipeline's sends) is costed from the profile's
bytes and the measured links (:mod:`autofit.probes.links`) when the search probed them; without them
a pipeline's transfers are a copy at the memory rate and FSDP's are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autofit.core.config import FIELDS, Precision, TrainConfig, stage_bounds
from autofit.estimator.comm_time import fsdp_micro_step_seconds, send_seconds
from autofit.probes.device_rates import DeviceRates
from autofit.profiling.data import Profile, with_optimizer

if TYPE_CHECKING:
    import pandas as pd
# Operators per micro-step (forward + backward): about OPS_PER_TENSOR per parameter tensor (a
# transformer block's 12 tensors go with ~25 forward operators; backward doubles that), counted
# on the meta device by :func:`op_counts`; OPS_PER_LAYER when the workload is not at hand.
# Autocast adds a cast before most matmuls. A prior only: calibration corrects it.
OPS_PER_TENSOR = 6
OPS_PER_LAYER = 75
OPS_OUTSIDE_LAYERS = 40
AMP_OPS_FACTOR = 1.4
OPTIMIZER_OPS_PER_TENSOR = 4  # the optimizer's foreach kernels still touch every tensor
OPTIMIZER_TENSORS_PER_LAYER = 12
# Traffic multipliers of the formula in the module docstring.
ACTIVATION_TRAFFIC = 4.0
WEIGHT_TRAFFIC = 5.0
OPTIMIZER_TRAFFIC = 2.0


# --------------------------------------------------------------------------------------
# Prediction.


@dataclass(frozen=True)
class OpCounts:
    """Parameter tensors of each layer and of the rest of the model (operators scale with them)."""

    tensors_per_layer: tuple[int, ...]
    tensors_outside: int
    # (precision, per-sample factor, fixed factor): the workload's own layer timed for real against
    # :func:`layer_time_line` (autofit.probes.layer_timing); () when not measured.
    layer_scales: tuple[tuple[str, float, float], ...] = ()

    def scales(self, precision: str) -> tuple[float, float]:
        """(per-sample factor, fixed factor) of ``precision``; (1, 1) when its layer was not timed."""
        return next(((c, f) for p, c, f in self.layer_scales if p == precision), (1.0, 1.0))


def op_counts(workload) -> OpCounts | None:
    """Parameter tensors of ``workload``'s model, built on the meta device (no memory, no init).
    None when the model cannot be built there."""
    import torch

    try:
        with torch.device("meta"):
            model = workload.model()
        layers = workload.layers(model)
    except Exception:  # noqa: BLE001 -- a model that refuses the meta device gets the per-layer default
        return None
    in_layers = tuple(len(list(layer.parameters())) for layer in layers)
    return OpCounts(tensors_per_layer=in_layers, tensors_outside=max(len(list(model.parameters())) - sum(in_layers), 0))


def layer_time_line(profile: Profile, precision: str, rates: DeviceRates,
                    counts: OpCounts | None = None) -> tuple[float, float]:
    """The time model's (fixed seconds, seconds per sample) of the first layer's forward and backward,
    unscaled: what :mod:`autofit.probes.layer_timing` compares a real run of that layer with."""
    pp = profile.for_precision(precision)
    layer = pp.layers[0]
    fwd_total = pp.forward_flops[1]
    flops = layer.forward_flops[1] * (1 + (pp.backward_flops[1] / fwd_total if fwd_total else 2.0))
    per_sample = (flops / rates.flops_per_s(precision)
                  + ACTIVATION_TRAFFIC * max(layer.forward.delta[1], 0.0) / rates.memory_bytes_per_s)
    tensors = counts.tensors_per_layer[0] if counts is not None and counts.tensors_per_layer else None
    ops = OPS_PER_TENSOR * max(tensors, 1) if tensors is not None else OPS_PER_LAYER
    ops *= AMP_OPS_FACTOR if Precision(precision).is_amp else 1.0
    fixed = (WEIGHT_TRAFFIC * (layer.param_bytes + layer.grad_bytes) / rates.memory_bytes_per_s
             + ops * rates.op_latency_s)
    return fixed, per_sample


def _stage_terms(profile: Profile, precision: str, split: int, checkpointed: bool,
                 counts: OpCounts | None = None, optimizer: str = "as-given", selective: bool = False) -> list[dict]:
    """Per stage: FLOPs per sample (forward + backward + recompute), activation bytes per sample,
    weight bytes, optimizer-step bytes, operator counts, boundary bytes per sample. ``optimizer``: the
    lever's choice (its state where the profile has it); ``selective``: checkpointed segments recompute
    all but the operators selective checkpointing keeps."""
    pp = profile.for_precision(precision)
    option = pp.optimizer_option(optimizer)
    if option is not None:
        pp = with_optimizer(pp, option)
    n = profile.n_layers
    layer_fwd = np.array([layer.forward_flops[1] for layer in pp.layers])
    # what a checkpointed segment runs again: the whole forward, or (selective) all but the kept operators
    layer_recompute = layer_fwd - (np.array([layer.selective_saved_flops[1] for layer in pp.layers]) if selective else 0.0)
    fwd_total = pp.forward_flops[1]
    bwd_total = pp.backward_flops[1]
    outside_fwd = max(fwd_total - layer_fwd.sum(), 0.0)
    amp = Precision(precision).is_amp
    terms = []
    for s, (start, end) in enumerate(stage_bounds(n, split)):
        first, last = s == 0, s == split - 1
        fwd = layer_fwd[start:end].sum() + (outside_fwd if (first and last) else outside_fwd / 2 * (first + last))
        bwd = bwd_total * (fwd / fwd_total) if fwd_total else 0.0
        recompute = max(layer_recompute[start:end].sum(), 0.0) if checkpointed else 0.0  # every layer is in a segment
        saved = sum(max(pp.layers[i].forward.delta[1], 0.0) for i in range(start, end))
        if last:
            saved += max(pp.post_forward.delta[1], 0.0)
        if first:
            saved += max(pp.pre_forward.delta[1], 0.0)
        weights = sum(pp.layers[i].param_bytes for i in range(start, end))
        grads = sum(pp.layers[i].grad_bytes for i in range(start, end))
        if first and last:
            weights, grads = pp.static_param_bytes, pp.grad_bytes
        else:
            weights += (pp.pre_param_bytes if first else 0) + (pp.post_param_bytes if last else 0)
            grads += (pp.pre_grad_bytes if first else 0) + (pp.post_grad_bytes if last else 0)
        share = grads / pp.grad_bytes if pp.grad_bytes else 1.0
        if counts is not None and len(counts.tensors_per_layer) == n:
            layer_ops = OPS_PER_TENSOR * sum(max(k, 1) for k in counts.tensors_per_layer[start:end])
            outside_ops = OPS_PER_TENSOR * max(counts.tensors_outside, 1)
            tensors = sum(counts.tensors_per_layer[start:end]) + counts.tensors_outside * (first + last) / 2
        else:
            layer_ops, outside_ops = OPS_PER_LAYER * (end - start), OPS_OUTSIDE_LAYERS
            tensors = OPTIMIZER_TENSORS_PER_LAYER * (end - start)
        # Recomputation runs the forward once more: a third of a micro-step's operators.
        ops = layer_ops * (4 / 3 if checkpointed else 1.0) + outside_ops / 2 * (first + last)
        terms.append({
            "flops_per_sample": fwd + bwd + recompute,
            "recompute_flops_per_sample": recompute,
            "saved_bytes_per_sample": saved,
            "weight_bytes": weights + grads,
            "optimizer_bytes": weights + grads + pp.optimizer_bytes * share,
            "ops": ops * (AMP_OPS_FACTOR if amp else 1.0),
            "optimizer_ops": OPTIMIZER_OPS_PER_TENSOR * max(tensors, 1),
            "boundary_bytes_per_sample": pp.layers[end - 1].output[1] if not last else 0.0,
            # per boundary it sends over or receives from (after it, before it): bytes per sample
            "boundaries_bytes_per_sample": ([pp.layers[end - 1].output[1]] if not last else [])
                                           + ([pp.layers[start - 1].output[1]] if not first else []),
        })
    return terms


def exposed(comm_s, compute_s, device_type: str):
    """The part of FSDP's communication ``comm_s`` a micro-step waits for, next to its compute ``compute_s``.
    On the CPU all of it: gloo's copies and reductions run on the cores that compute (the ranks share
    them). On CUDA NCCL runs on streams of its own beside the compute (FSDP2 prefetches the next
    unit's gather), so only what the compute cannot hide."""
    if device_type == "cuda":
        return np.maximum(comm_s - compute_s, 0.0)
    return comm_s


def predict_table(profile: Profile, configs: list[TrainConfig], rates: DeviceRates,
                  counts: OpCounts | None = None) -> pd.DataFrame:
    """Predicted times of many configs. One row per config, in the given order.

    Columns: the config fields, ``micro_step_time_s`` (the slowest stage's micro-step),
    ``optimizer_step_time_s``, ``step_time_s``, ``samples_per_s``, ``flops_per_step`` (all
    stages, recomputation included), ``recompute_flops_per_step`` and ``bubble_fraction``.
    ``counts`` (:func:`op_counts`) sizes the operator overhead; without it a transformer
    block's count is assumed. Configs with more stages than layers get NaN times. Raises KeyError if the profile or the
    rates lack a precision of ``configs``.
    """
    import pandas as pd  # here, not at the top: the probe child imports this module and needs no pandas

    n = len(configs)
    cols = {f: np.array([getattr(getattr(c, f), "value", getattr(c, f)) for c in configs]) for f in FIELDS}
    out = {k: np.full(n, np.nan) for k in ("micro_step_time_s", "optimizer_step_time_s", "step_time_s",
                                            "flops_per_step", "recompute_flops_per_step", "bubble_fraction")}
    keys = np.array([f"{c.precision.value}|{int(c.checkpoint_every > 0)}|{c.device_split}|{c.data_parallel}|"
                     f"{c.optimizer.value}|{c.checkpoint_policy.value}" for c in configs])
    for key in np.unique(keys) if n else []:
        idx = np.nonzero(keys == key)[0]
        precision, checkpointed, split, ranks, optimizer, policy = key.split("|")
        split, ranks = int(split), int(ranks)
        links = rates.link(max(split, ranks))  # measured collectives (autofit.probes.links); None: not costed
        comm, dtensor_op_s = np.zeros(len(idx)), 0.0
        if ranks > 1:
            # FSDP: every rank runs the whole model on its micro-batch (one stage), the optimizer on
            # its shards (below), and gathers and reduce-scatters every unit (a layer or a checkpoint
            # segment) at each micro-step.
            if links is not None:
                dtensor_op_s = links.dtensor_op_s
                every = cols["checkpoint_every"][idx]
                for k in np.unique(every):
                    comm[every == k] = fsdp_micro_step_seconds(profile.for_precision(precision), profile.n_layers,
                                                               int(k), links, rates.memory_bytes_per_s)
            split = 1
        elif split > profile.n_layers:
            continue
        b = cols["micro_batch"][idx].astype(np.float64)
        m = cols["grad_accum"][idx].astype(np.float64)
        rate = rates.flops_per_s(precision)
        # The workload's own layer, timed (autofit.probes.layer_timing): per-sample and fixed parts rescaled.
        per_sample_scale, fixed_scale = counts.scales(precision) if counts is not None else (1.0, 1.0)
        stage_micro, stage_opt = [], []
        flops = np.zeros(len(idx))
        recompute = np.zeros(len(idx))
        for t in _stage_terms(profile, precision, split, checkpointed == "1", counts, optimizer, policy == "selective"):
            # A boundary's transfers: measured sends, on both of its stages (the receiver waits for them);
            # without the link probe, a copy at the memory rate on the sender.
            copied = 0.0 if links is not None else 2 * t["boundary_bytes_per_sample"]
            sends = sum(send_seconds(x * b, links) for x in t["boundaries_bytes_per_sample"]) if links is not None else 0.0
            per_sample = (t["flops_per_sample"] / rate + (ACTIVATION_TRAFFIC * t["saved_bytes_per_sample"]
                          + copied) / rates.memory_bytes_per_s) * b
            fixed = WEIGHT_TRAFFIC * t["weight_bytes"] / rates.memory_bytes_per_s + t["ops"] * rates.op_latency_s
            compute = per_sample_scale * per_sample + fixed_scale * fixed
            stage_micro.append(compute + sends + exposed(comm, compute, rates.device_type))
            # An FSDP rank steps 1/ranks of the bytes, but every tensor (a shard of each), as DTensors.
            stage_opt.append(OPTIMIZER_TRAFFIC * t["optimizer_bytes"] / rates.memory_bytes_per_s / ranks
                             + t["optimizer_ops"] * (rates.op_latency_s + dtensor_op_s))
            flops += t["flops_per_sample"] * b * m
            recompute += t["recompute_flops_per_sample"] * b * m
        t_micro = np.max(np.stack(stage_micro), axis=0)
        t_opt = float(max(stage_opt))
        flops, recompute = flops * ranks, recompute * ranks  # the whole job's
        out["micro_step_time_s"][idx] = t_micro
        out["optimizer_step_time_s"][idx] = t_opt
        out["step_time_s"][idx] = (m + split - 1) * t_micro + t_opt
        out["flops_per_step"][idx] = flops
        out["recompute_flops_per_step"][idx] = recompute
        out["bubble_fraction"][idx] = (split - 1) / (m + split - 1)
    table = pd.DataFrame({f: cols[f] for f in FIELDS})
    for k, v in out.items():
        table[k] = v
    table["samples_per_s"] = np.array([c.samples_per_step for c in configs], dtype=np.float64) / table["step_time_s"]
    return table[list(FIELDS) + ["micro_step_time_s", "optimizer_step_time_s", "step_time_s", "samples_per_s",
                                 "flops_per_step", "recompute_flops_per_step", "bubble_fraction"]]


def predict(profile: Profile, config: TrainConfig, rates: DeviceRates, counts: OpCounts | None = None) -> dict:
    """The predicted times of one config, as :func:`predict_table`'s row (a dict)."""
    return predict_table(profile, [config], rates, counts).iloc[0].to_dict()

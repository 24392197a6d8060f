"""The analytic memory model: a profile and configs in, per-device peak bytes out.

The profile (:mod:`autofit.profiling`) cut one real micro-step into regions. Here those regions
are laid end to end again for any config, as PyTorch would run it:

- gradients: set to None before the first micro-step and grown during its backward; later
  accumulation micro-steps start with all of them (``*_nongrad`` regions + all gradients);
- checkpointing (non-reentrant, segments of k layers; selective: see below): the forward keeps only each segment's
  output, which the checkpoint of the next segment keeps as its input (one tensor, counted once)
  until that segment's backward is done, whether or not a layer saved it (so are its other
  arguments, e.g. an encoder's output each decoder layer takes, and an input whose last Python
  reference the unchecked profile saw die as the model returned); the backward of a
  segment first recomputes its forward, stopping at the last tensor the segment saves (early
  stop: an output nothing saves is not made again), then runs its backward. A segment's first
  forward saves nothing, so its peak is the profile's ``checkpointed_forward``, not ``forward``;
- selective checkpointing (``checkpoint_policy=selective``): a segment's forward also keeps the
  outputs of its matmuls and attention (the profile's ``selective_forward`` and ``selective_kept``)
  until its recomputation takes them from the policy's cache instead of computing them again; the
  recomputation's peaks are the profile's replay of it (``selective_recompute``: the kept outputs
  handed back, not made), and the
  last layer's kept outputs after its last saved tensor stay until the segment's backward is done;
- the ``optimizer`` lever: the chosen optimizer's state and step temporaries, profiled over the
  same parameters (``PrecisionProfile.optimizer_options``), replace the workload's optimizer's;
- the ``offload`` lever: only the state of parameters under 4096 elements, and their step's
  temporaries, stay on the device; the host must hold the rest, with pinned copies of the offloaded
  parameters and gradients (:mod:`autofit.estimator.offload_memory`);
- device split: stage s holds its layers (plus the embedding on the first stage and the head
  on the last), and under 1F1B up to ``min(grad_accum, p - s)`` micro-batches in flight
  (GPipe: all ``grad_accum``) during its forwards and first backward, one fewer once later
  micro-steps run with the gradients made (:func:`autofit.estimator.memory_table.in_flight_later`);
  its receive buffers live through the optimizer step; an earlier stage's output and that
  output's gradient live until the micro-batch's backward returns (the unsplit profile saw its
  last layer free them: :mod:`autofit.estimator.stage_walk` adds them back from that layer's
  backward on); a weight tied across the model's ends (embedding and head) is one copy per end
  stage, each with its own gradient: the ends come from the profile of the untied model
  (``PrecisionProfile.split_ends``);
- tensors kept beside autograd: what a checkpointed layer's forward leaves alive until the step's
  output is dropped (``LayerProfile.retained``: a key/value cache the model returns) from that
  forward on, and what a step leaves for the next (``PrecisionProfile.kept_bytes``: a hook's stash)
  through the whole step, on every stage. A segment's recomputation calls such a layer again with
  what it keeps: a cache appends to itself again, and the tensors it then holds keep the recomputed
  graph (what the layer saved up to its cache; an inner layer's all, with its output; the segment's
  input and its layers' other arguments where they are saved: rotary tables), which no backward frees:
  the profile replays each layer's recomputation on fake tensors (``retained_recomputed*``,
  ``recomputed_input_kept``, ``recomputed_args_kept``), and the walk
  keeps it from the layer's backward on (through that backward: an upper bound) until the step ends.
  An FSDP rank's checkpointed step of such a model is refused;
- the optimizer step: weights + gradients + state + the step's own temporaries;
- on CUDA: the cuBLAS workspaces (allocated, but no tensor of the model), what the allocator
  reserves beyond the tensors (:mod:`autofit.estimator.reserved_model`: a fixed part and shares of the
  tensors' peak, a larger one when checkpointing, fitted on measured H200 steps) and the context,
  which ``max_memory_reserved`` does not see: the estimate is what the card holds,
  ``max_memory_reserved`` + context (:class:`autofit.probes.cuda_overhead.CudaOverhead`, measured on
  the device where there is one).

Every quantity is a line ``c0 + c1·b`` in the micro-batch b, so for one structure (precision,
checkpoint interval, split) the peak is the upper envelope of a few dozen lines, evaluated for
all micro-batches and accumulation counts at once with numpy. A region contributes two lines
(its peak at the profiled sizes and its steepest operator), since the operator that sets a
region's peak can change with b. ``tests/estimator/test_memory_model_golden.py`` checks the result
byte for byte against hand arithmetic on a stack of Linear layers.

The model in modules: :mod:`autofit.estimator.stage_walk` lays one stage's micro-step out as lines,
:mod:`autofit.estimator.memory_table` scores many configs at once (:func:`~autofit.estimator.memory_table.estimate_table`;
FSDP ranks: :mod:`autofit.estimator.fsdp_memory`), and this module gives one config's
:class:`MemoryEstimate` (:func:`estimate`).

Known limitations: a region whose peak changes operator
twice beyond the profiled sizes is under-estimated between the changes; pipeline runtime
buffers are modelled as one received activation and one received gradient per micro-batch;
the CUDA allocator's reserve is fitted on small steps (9-846 MiB of tensors) of one GPU and
extrapolated beyond them until a search calibrates it. The profile runs on
fake tensors, so a CPU kernel that keeps a larger storage than its meta kernel says is missed
(``F.mse_loss`` on the CPU returns its 0-dim mean in the b x n buffer of the unreduced loss);
each accumulation micro-step's detached loss (a few bytes) is not counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import pandas as pd

from autofit.core.budget import format_bytes
from autofit.core.config import (
    CheckpointPolicy,
    Offload,
    PipelineSchedule,
    SplitMode,
    TrainConfig,
)
from autofit.core.errors import ConfigError
from autofit.estimator.fsdp_memory import FSDP_EXTRA_COLUMNS
from autofit.estimator.memory_table import BREAKDOWN, estimate_table, profile_for, whole_bytes
from autofit.estimator.offload_memory import host_need
from autofit.estimator.stage_walk import stage_lines
from autofit.probes.cuda_overhead import (
    FALLBACK_CONTEXT_BYTES,
    CudaOverhead,
    fallback_overhead,
)
from autofit.profiling.data import Profile, retained_caveat

# The fallback, used only where the device cannot be measured (autofit.probes.cuda_overhead measures the
# context and the workspaces on the device in use: the device probe child, cached with its rates).
CUDA_CONTEXT_BYTES = FALLBACK_CONTEXT_BYTES

SCHEDULES = tuple(PipelineSchedule)  # the one enum, shared with autofit.trial.pipeline


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


def needs_split_ends(configs: Iterable[TrainConfig], devices: int | None = None) -> bool:
    """Whether estimating ``configs`` needs the profile's split ends (``profile_workload(split_ends=...)``):
    only a pipeline split gives its end stages their own copy of a tied weight (FSDP keeps it tied).
    ``devices``: count only the splits a worker with that many devices runs (a search leaves the larger
    ones unestimated rather than profile the ends for them: a third more profiling per precision)."""
    return any(1 < c.device_split <= (devices or c.device_split) and c.split_mode is SplitMode.PIPELINE
               for c in configs)


def needs_selective(configs: Iterable[TrainConfig]) -> bool:
    """Whether estimating ``configs`` needs the layers' selective forwards profiled
    (``profile_workload(selective=...)``): only a config with the selective policy reads them."""
    return any(c.checkpoint_policy is CheckpointPolicy.SELECTIVE for c in configs)


def optimizer_choices(configs: Iterable[TrainConfig]) -> list[str]:
    """The ``optimizer`` lever's choices (other than ``as-given``) estimating ``configs`` needs profiled
    (``profile_workload(optimizers=...)``)."""
    return list(dict.fromkeys(c.optimizer.value for c in configs if c.changes_optimizer))


def estimate(profile: Profile, config: TrainConfig, budget_bytes: int | None = None,
             schedule: PipelineSchedule | str = PipelineSchedule.ONE_F_ONE_B,
             overhead: CudaOverhead | None = None, host_bytes: int | None = None) -> MemoryEstimate:
    """The predicted memory of one config (``host_bytes``: the host an offloaded optimizer must fit in;
    None: this machine's).

    >>> est = estimate(profile, TrainConfig(precision="amp-bf16", micro_batch=8))  # doctest: +SKIP
    >>> est.peak_bytes, est.fits                                                   # doctest: +SKIP

    Raises ConfigError when the config cannot run (e.g. more stages than layers).
    """
    row = estimate_table(profile, [config], budget_bytes, schedule, overhead, host_bytes).iloc[0]
    if not row["valid"]:
        raise ConfigError(f"{config.short()}: {row['reason']}")
    notes = []
    if config.checkpoint_every > profile.n_layers:
        notes.append(f"checkpoint_every {config.checkpoint_every} > {profile.n_layers} layers: one segment of all layers")
    if profile.device_type == "cuda":
        notes.append((overhead or fallback_overhead()).note())
    if config.changes_optimizer:
        option = profile.for_precision(config.precision).optimizer_option(config.optimizer.value)
        notes.append(f"optimizer={config.optimizer.value}: {option.optimizer if option else config.optimizer.value} "
                     f"replaces the workload's {profile.optimizer} (this changes the training)")
    if config.offload is Offload.OPTIMIZER:
        need = host_need(profile_for(profile, config.precision, config.optimizer), fused=not config.changes_optimizer)
        notes.append(f"offload=optimizer: {format_bytes(need.host_bytes)} on the host (pinned copies of the "
                     f"parameters of 4096 elements or more and their gradients, their optimizer state, one step); "
                     f"{format_bytes(need.device_state_bytes)} of state stays on the device")
    if caveat := retained_caveat(profile.workload, [profile.for_precision(config.precision)]):
        notes.append(caveat)  # counted; an FSDP rank's checkpointed step is refused (memory_table.retained_refusal)
    routing = profile.for_precision(config.precision).routing
    if routing:  # expert activations depend on routing: say which the estimate assumed
        notes.append(routing)
    real_check = profile.for_precision(config.precision).real_check
    if real_check:  # what the profile's real steps found (autofit.profiling.real_check), corrections included
        notes.append(f"profile: {real_check}")
    return MemoryEstimate(
        workload=profile.workload, device_type=profile.device_type, config=config,
        param_count=profile.param_count,
        **{name: int(round(row[name])) for name in BREAKDOWN},
        model_state_bytes=int(row["model_state_bytes"]), peak_bytes=int(whole_bytes(row["peak_bytes"])),
        per_device_peak_bytes=tuple(row["per_device_peak_bytes"]), peak_phase=str(row["peak_phase"]),
        budget_bytes=budget_bytes, fits=None if budget_bytes is None else bool(row["fits"]), notes=tuple(notes),
        **{name: None if pd.isna(row[name]) else int(round(row[name])) for name in FSDP_EXTRA_COLUMNS},
    )


def clear_caches() -> None:
    """Forget the per-stage walks cached across calls (``autofit bench`` times a cold first call)."""
    stage_lines.cache_clear()

"""Device split: a workload's layers cut into contiguous pipeline stages, one process per device.

``TrainConfig.device_split = p`` runs the model as ``p`` stages of PyTorch's own pipeline
engine, :mod:`torch.distributed.pipelining`: ``grad_accum`` micro-batches of ``micro_batch``
samples go through a 1F1B (default) or GPipe schedule per optimizer step. There is no
home-made pipeline here; this module only cuts the model, applies the config to each stage,
runs the steps and measures them.

Front end: the tracer, ``pipeline(model, mb_args, split_spec={"<layers>.<i>": BEGINNING})``.
It is the generic one: ``torch.export`` captures the model's own forward, so whatever runs
before the first layer (embeddings) lands on the first stage and whatever runs after the
last layer (final norm, head) on the last stage, with no knowledge of the model beyond its
layer list. Manual stage construction would have to know which modules to drop on which
stage, which a generic ``Workload`` does not say. The traced stages keep the original module
hierarchy and parameter names (``blocks.2.attn.weight``), so checkpointing and the optimizer
act on them as on the eager model. A model that ``torch.export`` cannot capture (data-dependent
control flow, graph breaks) gets a clear ``error`` status naming the cause.

The traced stage module runs inside the manual ``PipelineStage`` (not ``Pipe.build_stage``) so
that it can be wrapped: the wrapper applies ``torch.autocast`` to the stage forward only, as
:func:`autofit.runtime.training.forward_backward` does (backward runs outside autocast). The loss
runs on the last stage as the schedule's ``loss_fn``, under the same autocast.

Processes: one per stage, rendezvous on 127.0.0.1 at a free port. On the CPU gloo, on CUDA
NCCL with one GPU per stage (``cuda:{rank}``). They are :mod:`autofit.runtime.procs` children: a
workload with a ``source`` spec is re-loaded in a fresh interpreter per stage, one built in
code is inherited by ``fork``; each stage sends one JSON result; the parent kills every stage
it started before returning. :func:`run_stage` is the per-process body and also runs under
``torchrun`` (``scripts/run_split_torchrun.py``, which reads RANK, WORLD_SIZE and LOCAL_RANK).

Modules: :mod:`~autofit.trial.pipeline.stages` (tracing, cutting, applying the config to a stage),
:mod:`~autofit.trial.pipeline.steps` (one optimizer step, measuring a stage: :func:`run_stage`),
:mod:`~autofit.trial.pipeline.launch` (the stage processes: :func:`measure_split`).

Known limitations:

- Dropout draws differ from the unsplit run (each stage process has its own RNG stream), so
  losses match the unsplit run only for models without dropout.
- Parameters used on two stages (tied embedding and head) are replicated by the tracer; their
  gradients are summed across the owning stages before the optimizer step, so they stay tied.
- Checkpoint segments restart at each stage boundary: with ``checkpoint_every = k`` a stage of
  ``n`` layers has ``ceil(n / k)`` segments.
- 1F1B needs at least as many micro-batches as stages; with ``grad_accum < device_split`` the
  schedule falls back to GPipe (the result's ``schedule`` says which ran). With fewer
  micro-batches than stages the two schedules hold the same activations anyway.
"""

from autofit.core.config import PipelineSchedule, stage_bounds
from autofit.runtime.tracker import CATEGORIES as BREAKDOWN_KEYS
from autofit.trial.pipeline.launch import combine_stage_results, measure_split
from autofit.trial.pipeline.stages import Schedule, SplitError
from autofit.trial.pipeline.steps import run_stage

__all__ = ["BREAKDOWN_KEYS", "PipelineSchedule", "Schedule", "SplitError", "combine_stage_results", "measure_split",
           "run_stage", "stage_bounds"]

"""The peers' batch-size finders, re-implemented from their published behaviour (see
:mod:`autofit.bench.strategies` for the rules every peer follows here), and the two ways a careful
user runs one: at the user's precision, or once per precision.

- :func:`accelerate_halving` -- Hugging Face Accelerate ``find_executable_batch_size``: start at
  the largest batch, multiply by 0.5 (or, in newer releases, 0.9) on each OOM, stop at the first
  that runs. Precision and checkpointing stay at the user's defaults.
- :func:`lightning_binsearch` -- Lightning ``BatchSizeFinder(mode="binsearch")``: from
  ``init_val=2`` double until OOM, then binary search between the last success and the
  failure, at most ``max_trials=25`` trials.
- :func:`deepspeed_autotuner` -- DeepSpeed autotuning at its own defaults (``min_train_micro_batch_
  size_per_gpu=1``, ``num_tuning_micro_batch_sizes=3``, ``metric="throughput"``, ``fast=True``,
  ``tuner_early_stopping=5``), micro-batch tuning of ZeRO stage 0 (stages 1-3 partition across
  data-parallel ranks: nothing to gain on one device): a profile run at micro-batch 1, the largest micro-batch predicted
  by linear scaling of its activation memory over 16 bytes/parameter of model states (bf16
  costed as fp32), probes at 1.05x/1x/0.95x of it, binary search with a 5% plateau rule, then
  the tuning list around the maximum and smaller sizes while each gains 5%.

The batch finders tune the micro-batch only. How a user would run them fairly:

- **at the user's precision** (:func:`at_user_precision`): amp-bf16, :data:`USER_PRECISION`. It is
  the mixed-precision switch each tool documents -- Accelerate ``mixed_precision="bf16"``, the HF
  Trainer's ``bf16=True`` (both ``torch.autocast`` with fp32 weights), Lightning's
  ``precision="bf16-mixed"`` -- and what their guides recommend where the hardware has bf16. Pure
  bf16 weights (Lightning's ``"bf16-true"``) change the optimizer's numerics, so a careful user
  does not choose it for speed alone. DeepSpeed's ``bf16: {enabled: true}`` section is the same
  switch there.
- **as a per-precision sweep** (:func:`precision_sweep`): the finder run once per precision of the
  grid, the best measured answer kept, every run's trials charged to one clock -- what a careful
  user does by hand.

Checkpointing stays off in both (none of the finders turns it on): the handicap that remains. So does
the workload's own optimizer: in a lean cell (:data:`autofit.bench.search_cells.LEAN_CELLS`) they never
swap it for adafactor or an 8-bit AdamW, which none of the tools does on its own.

The batch finders run on one device: where only a device split fits, they find nothing and
score 0, which is what they do (none of them splits a model).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from autofit.bench.problem import Memo, Oracle, Problem, best_by_throughput
from autofit.core.config import Precision, TrainConfig

# --------------------------------------------------------------------------------------
# Hugging Face Accelerate: find_executable_batch_size


def accelerate_halving(problem: Problem, oracle: Oracle, seed: int = 0, factor: float = 0.5) -> TrainConfig | None:
    """Start at the largest micro-batch; on OOM multiply it by ``factor``; the first that runs is the answer."""
    run = Memo(oracle)
    batch = problem.micro_batches[-1]   # starting_batch_size (128 by default), capped at the global batch
    while batch >= 1:
        micro = problem.floor_micro_batch(batch)
        if micro is None:
            return None
        outcome = run(problem.config(micro))
        if outcome.ok:
            return outcome.config
        # Accelerate: ``batch_size //= 2``; newer releases ``int(batch_size * 0.9)``.
        batch = batch // 2 if factor == 0.5 else int(batch * factor)
    return None


def accelerate_halving_09(problem: Problem, oracle: Oracle, seed: int = 0) -> TrainConfig | None:
    """:func:`accelerate_halving` with the newer factor 0.9."""
    return accelerate_halving(problem, oracle, seed, factor=0.9)


# --------------------------------------------------------------------------------------
# Lightning: BatchSizeFinder(mode="binsearch")


def lightning_binsearch(problem: Problem, oracle: Oracle, seed: int = 0, init_val: int = 2,
                        max_trials: int = 25) -> TrainConfig | None:
    """Double from ``init_val`` until OOM, then bisect between the last success and the failure.

    Lightning's ``_run_binary_scaling``: ``low`` is the last size that ran (1 before any), ``high``
    the last that failed; stop when ``high - low <= 1`` or after ``max_trials``; the answer is the
    size it ends on -- after a failure next to ``low``, ``low`` itself, even the initial 1 that
    never ran. Sizes above the global batch are the global batch (a micro-batch cannot exceed it);
    a size below the smallest allowed micro-batch is the smallest.
    """
    run = Memo(oracle)
    largest = problem.micro_batches[-1]

    def micro(size: int) -> int:
        return problem.floor_micro_batch(min(size, largest)) or problem.micro_batches[0]

    low, high = 1, None
    size = init_val
    for _ in range(max_trials):
        outcome = run(problem.config(micro(size)))
        if outcome.ok:
            low = size
            if micro(size) == largest:
                break
            if high is not None:
                if high - low <= 1:
                    break
                size = (high + low) // 2
            else:
                size *= 2
        else:
            high = size
            size = (high + low) // 2
            if high - low <= 1:
                break
    return problem.config(micro(size))


# --------------------------------------------------------------------------------------
# DeepSpeed autotuning (micro-batch tuning, ZeRO stage 0)

DS_PLATEAU = 0.05           # METRIC_PERCENT_DIFF_CONST
DS_NUM_TUNING_SIZES = 3     # num_tuning_micro_batch_sizes
DS_MODEL_STATE_BYTES_PER_PARAM = 16   # params 4 + grads 4 + Adam 8; bf16 is costed as fp32


def deepspeed_autotuner(problem: Problem, oracle: Oracle, seed: int = 0) -> TrainConfig | None:
    """DeepSpeed's ``tune_space`` for stage 0: model-info profile run, linear max, probes, bisect, list."""
    trial = _DeepSpeedTrials(problem, oracle)
    # 1. model_info_profile_run: micro-batch 1, activation memory per sample by difference.
    smallest = problem.micro_batches[0]
    profile = trial.run(problem.config(smallest))
    if not profile.ok or profile.peak_bytes is None:
        return None
    trial.metrics[smallest] = profile.samples_per_s or 0.0
    instantiation = DS_MODEL_STATE_BYTES_PER_PARAM * problem.param_count
    activation_per_sample = max(1.0, (profile.peak_bytes - instantiation) / smallest)
    calculated_max = int((problem.budget_bytes - instantiation) // activation_per_sample)
    if calculated_max < smallest:
        return None
    # 2. get_min_max_micro_batch_size: the minimum is the profile's size (already run).
    max_mbs = _deepspeed_max_micro_batch(trial, smallest, min(calculated_max, problem.micro_batches[-1]))
    # 3. get_tuning_micro_batch_size_list + run_tuning_micro_batch_sizes
    _deepspeed_tuning_list(trial, smallest, max_mbs)
    return best_by_throughput(trial.run.seen.values())


class _DeepSpeedTrials:
    """The autotuner's trials: what it ran (never twice) and each micro-batch's metric."""

    def __init__(self, problem: Problem, oracle: Oracle) -> None:
        self.problem = problem
        self.run = Memo(oracle)
        self.metrics: dict[int, float] = {}   # micro-batch -> samples/s (0 when it did not run)

    def __call__(self, mbs: int) -> float:
        micro = self.problem.floor_micro_batch(mbs)
        if micro is None:
            return 0.0
        outcome = self.run(self.problem.config(micro))
        self.metrics[micro] = outcome.samples_per_s if outcome.ok else 0.0
        return self.metrics[micro]


def _deepspeed_max_micro_batch(trial: _DeepSpeedTrials, low_bound: int, max_mbs: int) -> int:
    """The largest micro-batch that runs: probes at 1.05x/1x/0.95x of the predicted ``max_mbs``, else a
    binary search up from ``low_bound`` (the profile's size) that stops where throughput plateaus."""
    problem = trial.problem
    used = [low_bound]
    for mbs in (math.ceil(1.05 * max_mbs), max_mbs, int(0.95 * max_mbs)):
        if mbs > problem.micro_batches[-1]:
            continue
        micro = problem.floor_micro_batch(mbs)
        if micro in used:
            return micro
        if trial(mbs) > 0:
            return problem.floor_micro_batch(mbs)
    prev_metric = trial.metrics.get(low_bound)
    low, high = low_bound, max_mbs
    while low < high:
        mid = (low + high) // 2
        if mid == low:
            break
        if problem.floor_micro_batch(mid) in used and problem.floor_micro_batch(mid) != low:
            low = mid
            continue
        value = trial(mid)
        if value > 0:
            low = mid
            used.append(problem.floor_micro_batch(mid))
            if prev_metric and (value - prev_metric) / prev_metric < DS_PLATEAU:
                break   # "performance plateaus"
            prev_metric = value
        else:
            high = mid - 1
    return problem.floor_micro_batch(low)


def _deepspeed_tuning_list(trial: _DeepSpeedTrials, low_bound: int, max_mbs: int) -> None:
    """Run the tuning list between half the maximum and the maximum, then smaller sizes while each gains."""
    problem = trial.problem
    min_mbs = max(low_bound, max_mbs // 2)
    stride = max(1, (max_mbs - min_mbs) // DS_NUM_TUNING_SIZES)
    tuning = [m for m in range(min_mbs, max_mbs, stride) if max_mbs // m != 1] + [max_mbs]
    for mbs in tuning:
        trial(mbs)
    # smaller sizes with the same accumulation, while each gains more than 5%
    start = tuning[-2] + 1 if len(tuning) > 1 else low_bound
    best_metric = trial.metrics.get(problem.floor_micro_batch(max_mbs), 0.0)
    stride = max(1, (max_mbs - start) // 3)
    for mbs in reversed(range(start, max_mbs, stride)):
        micro = problem.floor_micro_batch(mbs)
        if micro is None or micro < start:
            continue
        value = trial(mbs)
        if value > best_metric * (1 + DS_PLATEAU):
            best_metric = value
        else:
            break


# --------------------------------------------------------------------------------------
# How a careful user runs a batch finder: at bf16 mixed precision, or once per precision

USER_PRECISION = Precision.AMP_BF16   # see the module docstring


def at_user_precision(problem: Problem, oracle: Oracle, seed: int = 0, *, finder: Callable,
                      **kwargs) -> TrainConfig | None:
    """Run ``finder`` with :data:`USER_PRECISION` as the precision it leaves alone."""
    return finder(dataclasses.replace(problem, default_precision=USER_PRECISION), oracle, seed, **kwargs)


def precision_sweep(problem: Problem, oracle: Oracle, seed: int = 0, *, finder: Callable,
                    **kwargs) -> TrainConfig | None:
    """Run ``finder`` once per precision of the grid on one clock; answer the fastest measured answer.

    An answer a finder never ran (Lightning can end on a size it did not try) has no measured
    throughput to compare: it is kept only when no precision's answer was measured.
    """
    answers = [finder(dataclasses.replace(problem, default_precision=p), oracle, seed, **kwargs)
               for p in problem.precisions]
    measured = {r.outcome.config: r.outcome.samples_per_s for r in oracle.history if r.outcome.ok}
    ran = [a for a in answers if a is not None and measured.get(a)]
    if ran:
        return max(ran, key=lambda a: measured[a])
    return next((a for a in answers if a is not None), None)

"""The gpu-cost regime: a replayed strategy's trials charged what they would cost on a GPU.

The committed grids were measured on a CPU, where a trial is forked from a warm server and costs
little besides its steps. On a GPU a trial that starts its own process pays the interpreter, the
imports, a CUDA context and the model build before its first step: seconds, whatever the model.
This module re-charges each trial of a replayed run (:class:`~autofit.bench.search_data.RunResult`)
by how the strategy would run it on a GPU:

- **autofit** runs its trials on CUDA in a trial host (:mod:`autofit.trial.host`): a process that
  runs one trial after another and ends after any that is not ok (isolation is what makes an OOM
  harmless). A trial that starts a host pays :data:`TRIAL_FIXED`, a further one in it
  :data:`IN_PROCESS_BUILD`, as a finder's retry; autofit also pays :data:`AUTOFIT_ONCE` once per
  search, in place of the first use (profiling, device probe) the CPU replay charges;
- a **batch-size finder** retries inside the training process (Accelerate's decorator, Lightning's
  tuner, DeepSpeed's autotuner loop): the first trial of a process pays :data:`TRIAL_FIXED`, each
  retry :data:`IN_PROCESS_BUILD` only. A per-precision *sweep* is the finder launched once per
  precision: one process per precision;
- **Optuna TPE** runs its objective in the process that calls ``study.optimize``: one process, each
  trial a model build in it, as a finder's retry.

Whoever runs it, a device split's trial starts its stages or ranks as processes of their own (one
per device), so it pays :data:`TRIAL_FIXED`.

A trial that fits then runs the trial schedule's steps; one over its budget runs up to its
out-of-memory point (:data:`OOM_STEPS`). Steps cost the grid's measured step time
(:data:`STEP_SCALE`). A strategy's own work (Optuna's sampler, autofit's planner) keeps the time
the replay measured. Every figure says where it comes from (:data:`FIGURES`, shown in ``search.md``);
one that the GPU runs did not measure says so and is chosen to favour autofit's peers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from autofit.bench.common import markdown_table
from autofit.bench.finders import precision_sweep
from autofit.bench.search_data import Grid, GridPoint, RunResult
from autofit.bench.strategies import Strategy
from autofit.bench.verdict import AUTOFIT_NAME
from autofit.core.config import SplitMode, TrainConfig
from autofit.core.records import TrialStatus
from autofit.runtime.schedule import DEFAULT_SCHEDULE, MeasureSchedule

GPU_DIR = "results/benchmarks/gpu"   # the H200 measurements the figures are read from (lines count the header as 1)


@dataclass(frozen=True)
class CostFigure:
    """One figure of the regime, with where it comes from; ``measured`` False flags an assumed value."""

    what: str
    value: float
    unit: str
    source: str
    measured: bool = True


TRIAL_FIXED = CostFigure(
    "a trial in a process of its own, before its steps: interpreter start, imports, CUDA context, model build",
    9.03, "s",
    f"{GPU_DIR}/run2-h200-abc.csv line 71: autofit's `run_trial` on gpt2 over an 8 GB budget, status oom at its "
    "first large allocation, wall_s 9.03 (run1-h200.csv line 82, the same trial: 9.00)")
IN_PROCESS_BUILD = CostFigure(
    "a further trial in the same process, before its steps: model and optimizer build, batches",
    0.090, "s",
    f"{GPU_DIR}/run3-h200-a.csv lines 3-12 (gpt-tiny) and run4-h200-a.csv lines 3-12 (convnet-bn): median of "
    "wall_s − 5 × step_time_s (2 warm-up + 3 timed steps) over each child's configs after its first")
AUTOFIT_ONCE = CostFigure(
    "autofit's own cost once per search: its process, profiling on fake tensors, the CUDA device probe, "
    "estimate, planner, study storage, reports",
    12.5, "s",
    f"{GPU_DIR}/run5-h200.csv line 85: `autofit search` on gpt2 at 8 GB with its trials in a trial host, wall_s "
    "26.59, of which its 4 real trials took 14.1 s (the row's note, from trials.csv; the first started 10 s after "
    "the search). The replay's timed own work is added on top, so autofit's planning is counted twice: against "
    "autofit")
HOST_HEAD_START = CostFigure(
    "of a new trial host's start, the seconds autofit's first trial does not wait for: the host starts as the "
    "search begins (autofit.trial.host.start_soon, before profiling) and its first real trial came 10 s later",
    4.9, "s",
    f"{GPU_DIR}/run5-h200.csv lines 80 and 85, derived as a lower bound: of the search's 14.1 s for 4 trials, at "
    "least 4 × 2.53 s were the trials themselves (line 80: the fastest gpt2 trial in a running process), so its "
    "first trial waited at most 3.99 s for its host, whose start is 9.03 s less the 0.09 s build above: 4.95 s, "
    "rounded down, not waited for. The first trial's own times did not come back from the GPU, so the rest counts "
    "against autofit")
OOM_STEPS = CostFigure(
    "steps a trial over its budget runs before its out-of-memory error",
    1, "step(s)",
    "not measured: the GPU runs record an OOM trial's wall time, not where in its steps it failed. The steady "
    "peak is first reached in step 2, so an OOM comes within 2 steps; charging 1 favours the strategies that "
    "run over (the finders, TPE)", measured=False)
STEP_SCALE = CostFigure(
    "a step of a config, as a multiple of the grid's measured step_time_s",
    1.0, "×",
    "not measured on a GPU for these configs (the H200 runs measured other micro-batches): the grid's own "
    "CPU step times, so every strategy's steps weigh more than on a GPU and the fixed costs above weigh less",
    measured=False)
FIGURES = (TRIAL_FIXED, IN_PROCESS_BUILD, AUTOFIT_ONCE, HOST_HEAD_START, OOM_STEPS, STEP_SCALE)


@dataclass(frozen=True)
class GpuCosts:
    """The figures as numbers (tests pass their own)."""

    trial_fixed_s: float = TRIAL_FIXED.value
    in_process_build_s: float = IN_PROCESS_BUILD.value
    autofit_once_s: float = AUTOFIT_ONCE.value
    host_head_start_s: float = HOST_HEAD_START.value
    oom_steps: float = OOM_STEPS.value
    step_scale: float = STEP_SCALE.value
    schedule: MeasureSchedule = DEFAULT_SCHEDULE


DEFAULT_COSTS = GpuCosts()


class Processes(str, enum.Enum):
    """How a strategy's trials map to processes on a GPU."""

    PER_TRIAL = "a process per trial"
    HOST = "a process until a trial that is not ok"
    ONE = "one process"
    PER_PRECISION = "a process per precision"


def processes(strategy: Strategy) -> Processes:
    """autofit runs its trials in a host; a sweep launches its finder once per precision; the rest run in one process."""
    if strategy.name == AUTOFIT_NAME:
        return Processes.HOST
    return Processes.PER_PRECISION if strategy.run is precision_sweep else Processes.ONE


def trial_steps(config: TrainConfig, schedule: MeasureSchedule = DEFAULT_SCHEDULE) -> float:
    """A trial's steps in units of the config's optimizer step: on one device (and per FSDP rank) each step
    runs ``min(grad_accum, micro_steps_per_step)`` of its micro-batches; a pipeline runs them all."""
    if config.device_split > 1 and config.split_mode is SplitMode.PIPELINE:
        return float(schedule.total_steps)
    return schedule.total_steps * schedule.micro_steps(config.grad_accum) / config.grad_accum


def trial_cost_s(point: GridPoint, status: TrialStatus, new_process: bool, costs: GpuCosts = DEFAULT_COSTS,
                 head_start_s: float = 0.0) -> float:
    """What one trial of ``point`` costs on a GPU: its start (a new process, or a build in a running one), then
    its steps up to the end (fits) or to its out-of-memory point (over the budget). ``head_start_s``: seconds a
    new process had been starting before the trial was asked for (the build is never ahead)."""
    start = costs.in_process_build_s
    if new_process:
        start += max(costs.trial_fixed_s - costs.in_process_build_s - head_start_s, 0.0)
    step = (point.step_time_s or 0.0) * costs.step_scale
    if status is TrialStatus.OOM:
        return start + costs.oom_steps * step
    if status is TrialStatus.OK:
        return start + trial_steps(point.config, costs.schedule) * step
    return start + point.wall_s   # an error or timeout: as long as the grid's trial ran (none in the committed grid)


def _new_process(policy: Processes, run: RunResult, i: int) -> bool:
    # a device split's stages or ranks are processes of their own, one per device, whoever runs it
    if policy is Processes.PER_TRIAL or i == 0 or run.history[i].outcome.config.device_split > 1:
        return True
    if policy is Processes.HOST:  # a split's trial runs beside the host; a trial not ok ended it
        before = [r.outcome for r in run.history[:i] if r.outcome.config.device_split == 1]
        return not before or before[-1].status is not TrialStatus.OK
    # a sweep runs its finder one precision after another: a change of precision is a new launch
    return (policy is Processes.PER_PRECISION
            and run.history[i].outcome.config.precision != run.history[i - 1].outcome.config.precision)


@dataclass(frozen=True)
class Charged:
    """A run on the gpu-cost clock: the clock after each trial, the total, and time to 98% (None: never)."""

    clock_s: list[float]
    wall_s: float
    time_to_98_s: float | None


def charge(run: RunResult, grid: Grid, strategy: Strategy, costs: GpuCosts = DEFAULT_COSTS) -> Charged:
    """Re-charge a replayed run's trials at GPU costs; its own work keeps the time the replay measured.

    The replay's clock after trial i is own work so far + its trials' grid costs + what was charged at the
    start (autofit's first use); here the grid costs become :func:`trial_cost_s` and the first use becomes
    :data:`AUTOFIT_ONCE`, charged before the first trial as the replay charges its first use.
    """
    policy = processes(strategy)
    once = costs.autofit_once_s if strategy.name == AUTOFIT_NAME else 0.0
    replay_trials_s = gpu_trials_s = 0.0
    clock = []
    for i, record in enumerate(run.history):
        outcome = record.outcome
        replay_trials_s += outcome.cost_s
        # autofit's first host starts as the search begins: its own cost before the first trial overlaps it
        head_start = costs.host_head_start_s if once and i == 0 and outcome.config.device_split == 1 else 0.0
        gpu_trials_s += trial_cost_s(grid.points[outcome.config], outcome.status, _new_process(policy, run, i),
                                     costs, head_start)
        own_s = record.clock_s - replay_trials_s - run.extra_s
        clock.append(once + own_s + gpu_trials_s)
    wall = once + (run.wall_s - run.trials_s - run.extra_s) + gpu_trials_s
    t98 = None if run.reached_98_at is None else clock[run.reached_98_at]
    return Charged(clock, wall, t98)


def figures_table() -> str:
    """Markdown: each figure, its value, and where it comes from (an assumed one flagged)."""
    rows = [[f.what, f"{f.value:g} {f.unit}", ("" if f.measured else "**not measured, assumed**: ") + f.source]
            for f in FIGURES]
    rows.append(["steps a trial runs (fits)", (f"{DEFAULT_SCHEDULE.total_steps} × min(grad_accum, "
                                               f"{DEFAULT_SCHEDULE.micro_steps_per_step}) / grad_accum steps"),
                 ("autofit/runtime/schedule.py DEFAULT_SCHEDULE (2 warm-up, 1 measured, 3 timed; no tracker on "
                  "CUDA); a pipeline runs every micro-batch")])
    return markdown_table(["figure", "value", "source"], rows, "lrl")

"""How many steps a trial runs, and of which kind: one frozen :class:`MeasureSchedule`.

A trial (:func:`autofit.trial.measure.measure_trial`, each pipeline stage of
:func:`autofit.trial.pipeline.measure_split`) runs, on a fresh model and optimizer:

1. ``warmup_steps`` optimizer steps (at least 2: the first creates the optimizer state and,
   on a pipeline, runs the schedule's shape inference, so the third step is the first steady one);
2. ``measured_steps`` steps over which the peak memory is read (on the CPU under the memory
   tracker, which also watches the warm-up);
3. ``timed_steps`` steps run without any tracker and timed (a median needs a few samples).

A re-measurement (``memory=False``) runs only 1 and 3: the config's first trial measured its memory,
and on the CPU the tracked steps cost several untracked ones each (about 1.3 s of a 1.7 s gpt-tiny
trial at bf16 micro-batch 12), so a throughput sample without them costs about half a trial.

On one device each of these steps runs ``min(grad_accum, micro_steps_per_step)`` micro-batches:
after the second micro-step gradients accumulate in place, so further micro-steps repeat the
same memory pattern and the same work (the step time is composed from their medians). A
pipeline runs all ``grad_accum`` micro-batches of every step.

The study's planner sizes a trial's time limit from :meth:`MeasureSchedule.step_equivalents`,
so changing the schedule here changes the limit with it.

Example::

    schedule = MeasureSchedule(measured_steps=3)
    run_trial("gpt-tiny", config, schedule=schedule)
    schedule.step_equivalents()   # (2 + 3) * 2.0 + 3 = 13.0 untracked steps' worth of time
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_SCHEDULE", "MIN_TIMED_STEPS", "MIN_WARMUP_STEPS", "MeasureSchedule", "TRACKED_STEP_SLOWDOWN",
           "run_steps"]

# Step 1 creates the optimizer state (and a pipeline's receive buffers); step 2 is the first
# that allocates as every later one does, so peaks are read from step 3 on.
MIN_WARMUP_STEPS = 2
# A median of fewer than 3 timed steps is one noisy sample.
MIN_TIMED_STEPS = 3
# Steps run under the CPU memory tracker (dispatch-mode accounting after every operator) take
# about this many times an untracked step; the planner's time limit uses it.
TRACKED_STEP_SLOWDOWN = 2.0


@dataclass(frozen=True)
class MeasureSchedule:
    """The steps one trial runs. Raises ValueError on construction for counts out of range.

    - ``warmup_steps``: optimizer steps before memory is read (>= 2);
    - ``measured_steps``: steps the peak memory is read over (>= 1);
    - ``timed_steps``: untracked steps whose median time is the throughput (>= 1);
    - ``micro_steps_per_step``: micro-batches run per step on one device (>= 2, so gradient
      accumulation is seen); a config runs ``min(grad_accum, micro_steps_per_step)``;
    - ``memory``: read the peak memory (False: a throughput sample only, no measured steps and no
      tracker; the trial reports no peak).
    """

    warmup_steps: int = MIN_WARMUP_STEPS
    measured_steps: int = 1
    timed_steps: int = MIN_TIMED_STEPS
    micro_steps_per_step: int = 3
    memory: bool = True

    def __post_init__(self) -> None:
        minimums = {"warmup_steps": MIN_WARMUP_STEPS, "measured_steps": 1, "timed_steps": 1,
                    "micro_steps_per_step": 2}
        for name, least in minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"MeasureSchedule.{name} must be an integer >= {least}, got {value!r}")
        if not isinstance(self.memory, bool):
            raise ValueError(f"MeasureSchedule.memory must be True or False, got {self.memory!r}")

    @classmethod
    def from_steps(cls, warmup_steps: int = MIN_WARMUP_STEPS, measure_steps: int = 3) -> "MeasureSchedule":
        """The schedule of the older ``warmup_steps`` / ``measure_steps`` arguments.

        Warm-up below 2 is raised to 2; ``measure_steps`` is the measured steps and the timed
        steps are ``max(measure_steps, 3)``. Raises ValueError when ``measure_steps < 1``.
        """
        if isinstance(measure_steps, bool) or not isinstance(measure_steps, int) or measure_steps < 1:
            raise ValueError(f"measure_steps must be an integer >= 1, got {measure_steps!r}")
        return cls(warmup_steps=max(MIN_WARMUP_STEPS, int(warmup_steps)), measured_steps=measure_steps,
                   timed_steps=max(MIN_TIMED_STEPS, measure_steps))

    @property
    def total_steps(self) -> int:
        """Optimizer steps a trial runs in all."""
        return self.warmup_steps + self.measured_steps * self.memory + self.timed_steps

    def micro_steps(self, grad_accum: int) -> int:
        """Micro-batches one single-device step of a config with ``grad_accum`` runs."""
        return min(grad_accum, self.micro_steps_per_step)

    def step_equivalents(self, tracked_slowdown: float = TRACKED_STEP_SLOWDOWN) -> float:
        """What a trial costs, in untracked optimizer steps: tracked steps count ``tracked_slowdown`` each."""
        if not self.memory:
            return self.warmup_steps + self.timed_steps
        return (self.warmup_steps + self.measured_steps) * tracked_slowdown + self.timed_steps

    def to_dict(self) -> dict:
        return {"warmup_steps": self.warmup_steps, "measured_steps": self.measured_steps,
                "timed_steps": self.timed_steps, "micro_steps_per_step": self.micro_steps_per_step,
                "memory": self.memory}

    @classmethod
    def from_dict(cls, data: dict) -> "MeasureSchedule":
        keys = ("warmup_steps", "measured_steps", "timed_steps", "micro_steps_per_step", "memory")
        return cls(**{k: data[k] for k in keys if k in data})


# What a study's trial runs: 2 warm-up steps, 1 measured, 3 timed, at most 3 micro-steps each.
DEFAULT_SCHEDULE = MeasureSchedule()


def run_steps(schedule: MeasureSchedule, step: Callable[[], Any], *, tracker: Callable[[], Any] | None = None,
              untracked_steps: int = 0) -> Any:
    """Run the warm-up and measured steps of ``schedule``: the one step loop of every trial.

    ``step()`` runs one optimizer step. The first ``untracked_steps`` warm-up steps run bare;
    then ``tracker()`` (a factory, so it can see what those steps allocated) gives a context
    manager with ``reset_peak()`` -- :class:`autofit.runtime.tracker.MemoryTracker` -- that watches the
    rest of the warm-up, has its peak reset, and then watches the measured steps. Without a
    tracker (CUDA, whose allocator keeps its own peak) the measured steps are left to the timed
    ones, which nothing slows down. A schedule without ``memory`` runs its warm-up bare, as
    without a tracker. Returns the tracker (None without one); the caller times
    ``schedule.timed_steps`` steps next, its own way.
    """
    for _ in range(untracked_steps):
        step()
    if tracker is None or not schedule.memory:
        for _ in range(schedule.warmup_steps - untracked_steps):
            step()
        return None
    watcher = tracker()
    with watcher:
        for _ in range(schedule.warmup_steps - untracked_steps):
            step()
        watcher.reset_peak()
        for _ in range(schedule.measured_steps):
            step()
    return watcher

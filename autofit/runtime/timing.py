"""What a timed step got from the machine: wall time beside CPU time and the time its threads
waited for a CPU, so a step slowed by another process is recognised, taken again, and never
ranks a config.

Load only ever slows a step down (another process takes CPU time; it never gives any), so the
fastest of a config's steps is the figure least inflated by load, and a step whose threads sat
on the run queue is not a measurement of the config. On Linux the kernel counts that wait per
thread (``/proc/self/task/<tid>/schedstat``: time on a CPU, time waiting on a run queue, in ns;
see docs/facts.md#run-queue-wait). Elsewhere only wall and CPU time are recorded and no step
is judged starved.

A timed step of OpenMP kernels runs its threads in lock step: one thread waiting for a CPU
holds the others at the next barrier, so the step is late by about the longest wait of any of
its threads. A step is **starved** when that wait exceeds :data:`STARVED_WAIT_SHARE` of its
wall time.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# A step whose busiest-waiting thread spent more than this share of the step on the run queue is
# starved: on a quiet machine the wait is under 1% (the trial's own threads and the kernel's
# housekeeping), with a busy loop on one of two cores it is 20-60% (measured with
# scripts/busy_core_timing.py).
STARVED_WAIT_SHARE = 0.05
# How many more steps a trial takes, at most, to replace starved ones.
MAX_RETIMED_STEPS = 6
_TASKS = "/proc/self/task"
_MIN_RUN_NS = 1_000_000  # a thread that ran under 1 ms in the step took no part in it


def _schedstats() -> dict[str, tuple[int, int]] | None:
    """Per thread of this process: (ns on a CPU, ns waiting on a run queue); None where the
    kernel does not report it."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    out = {}
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/schedstat") as f:
                run_ns, wait_ns, _slices = f.read().split()
        except (OSError, ValueError):
            continue
        out[tid] = (int(run_ns), int(wait_ns))
    return out or None


def _wait_s(before: dict | None, after: dict | None) -> float | None:
    """The longest run-queue wait, in seconds, of a thread that worked between two readings."""
    if before is None or after is None:
        return None
    waits = [(after[t][1] - before[t][1]) / 1e9 for t in after
             if t in before and after[t][0] - before[t][0] >= _MIN_RUN_NS]
    return max(waits, default=0.0)


@dataclass(frozen=True)
class StepSample:
    """One timed step: ``wall_s`` (the clock), ``cpu_s`` (this process's CPU time, all threads),
    ``wait_s`` (the longest run-queue wait of a working thread; None where not reported) and
    ``device_s`` (CUDA event time of the step; None on the CPU)."""

    wall_s: float
    cpu_s: float
    wait_s: float | None = None
    device_s: float | None = None

    @property
    def starved(self) -> bool:
        return self.wait_s is not None and self.wait_s > STARVED_WAIT_SHARE * self.wall_s


class StepClock:
    """Reads wall time, CPU time and run-queue waits around the parts of one step.

    ``start()`` then ``stop()`` around each part (the caller syncs the device first); the parts
    of a step add up in :meth:`step_sample`. The schedstat files are read outside the clock's
    window, so reading them costs the step nothing.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, read_waits: bool = True) -> None:
        self._clock = clock
        self._read_waits = read_waits
        self._wall = self._cpu = 0.0
        self._wait: float | None = 0.0 if read_waits else None

    def start(self) -> None:
        self._stats = _schedstats() if self._read_waits else None
        self._cpu0 = time.process_time()
        self._t0 = self._clock()

    def stop(self) -> float:
        """Ends a part; returns its wall seconds."""
        wall = self._clock() - self._t0
        self._cpu += time.process_time() - self._cpu0
        self._wall += wall
        if self._read_waits:
            wait = _wait_s(self._stats, _schedstats())
            self._wait = None if wait is None or self._wait is None else self._wait + wait
        return wall

    def step_sample(self, wall_s: float, device_s: float | None = None) -> StepSample:
        """The step's sample (``wall_s``: the step's composed time) with the CPU time and wait of its
        parts, scaled to ``wall_s`` where the composed time stands for more micro-steps than ran;
        resets the counters for the next step."""
        scale = wall_s / self._wall if self._wall > 0 else 1.0
        sample = StepSample(wall_s, self._cpu * scale, None if self._wait is None else self._wait * scale, device_s)
        self._wall = self._cpu = 0.0
        self._wait = 0.0 if self._read_waits else None
        return sample


def more_steps_due(samples: Sequence[StepSample], repeats: int) -> bool:
    """Whether a trial that wants ``repeats`` unstarved steps should time another, having timed ``samples``:
    until it has them, at most :data:`MAX_RETIMED_STEPS` extra, and not once its last ``repeats`` steps were
    all starved. Load that starved that many steps in a row is lasting (a busy core, a build): more steps
    would not find a quiet one, and beside such load each of them costs a slowed step (on this project's
    2-core machine, with one core busy, steps took 1.8-2.7x their quiet time and searches' trials ran past
    their time limit while re-timing)."""
    clean = sum(not s.starved for s in samples)
    if clean >= repeats or len(samples) >= repeats + MAX_RETIMED_STEPS:
        return False
    recent = samples[-repeats:] if repeats > 0 else ()
    return not (len(recent) == repeats and all(s.starved for s in recent))


@dataclass(frozen=True)
class StepTimes:
    """A trial's timed steps and what they say. ``best_s`` is the fastest step that was not starved
    (the fastest of all when every step was); ``spread`` the median over the best, less one."""

    samples: tuple[StepSample, ...]
    threads: int          # intra-op threads the trial asked for
    cpus: int             # CPUs the process may run on

    @property
    def clean(self) -> tuple[StepSample, ...]:
        return tuple(s for s in self.samples if not s.starved)

    @property
    def starved_steps(self) -> int:
        return len(self.samples) - len(self.clean)

    @property
    def best(self) -> StepSample:
        return min(self.clean or self.samples, key=lambda s: s.wall_s)

    @property
    def best_s(self) -> float:
        return self.best.wall_s

    @property
    def spread(self) -> float:
        walls = [s.wall_s for s in (self.clean or self.samples)]
        return statistics.median(walls) / min(walls) - 1.0

    @property
    def cpu_share(self) -> float:
        """CPU time over wall time times the threads asked for, of the best step: 1.0 is every
        thread busy all the step."""
        best = self.best
        return best.cpu_s / (best.wall_s * max(self.threads, 1)) if best.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        """The measured keys a trial reports (JSON-ready)."""
        shares = [s.wait_s / s.wall_s for s in self.samples if s.wait_s is not None and s.wall_s > 0]
        devices = [s.device_s for s in self.samples if s.device_s is not None]
        return {
            "timed_steps": len(self.samples), "starved_steps": self.starved_steps,
            "step_samples_s": [s.wall_s for s in self.samples],
            "step_spread": self.spread, "cpu_share": self.cpu_share,
            "threads": self.threads, "cpus": self.cpus,
            "max_wait_share": max(shares) if shares else None,
            "device_step_s": min(devices) if devices else None,
        }


def cpus_available() -> int:
    """CPUs this process may run on (its affinity), or the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1

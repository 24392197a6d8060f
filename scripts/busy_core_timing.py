"""How a busy core shows in a trial's timed steps: run-queue wait share and step time, quiet and loaded.

Times the training steps of one config the way a trial does (:func:`autofit.trial.measure.time_steps`),
first alone, then with ``--hogs`` busy-loop processes (default one: a busy core on a 2-core machine),
and prints per step its wall time, the longest run-queue wait of a working thread as a share of the
step, and whether the step counts as starved (:data:`autofit.runtime.timing.STARVED_WAIT_SHARE`).

    OMP_WAIT_POLICY=PASSIVE python scripts/busy_core_timing.py --model gpt-tiny --config amp-bf16,8,8

Run it alone on the machine: the quiet half is the reference.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch

from autofit.core.config import TrainConfig
from autofit.runtime.timing import STARVED_WAIT_SHARE, cpus_available
from autofit.runtime.training import build_trainee
from autofit.trial.measure import time_steps, trial_micro_batches
from autofit.workloads.load import load_workload


def _spin(seconds: float) -> None:
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        pass


def _run(trainee, batches, config, steps: int, label: str) -> list[float]:
    times, _, _ = time_steps(trainee, batches, config, steps)
    print(f"{label}: threads {times.threads}, cpus {times.cpus}, {times.starved_steps} of {len(times.samples)} "
          f"steps starved; best {times.best_s * 1e3:.1f} ms")
    for s in times.samples:
        share = "n/a" if s.wait_s is None else f"{s.wait_s / s.wall_s:6.1%}"
        less = "" if s.wait_s is None else f"  less the wait {(s.wall_s - s.wait_s) * 1e3:8.1f} ms"
        print(f"  step {s.wall_s * 1e3:8.1f} ms  cpu {s.cpu_s * 1e3:8.1f} ms  wait share {share}{less}"
              f"{'  starved' if s.starved else ''}")
    return [s.wall_s for s in times.samples], [s.wall_s - (s.wait_s or 0.0) for s in times.samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--config", default="amp-bf16,8,8", help="precision,micro_batch,grad_accum")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hogs", type=int, default=1, help="busy-loop processes while loaded")
    args = parser.parse_args()
    precision, micro_batch, grad_accum = args.config.split(",")
    config = TrainConfig(precision, int(micro_batch), int(grad_accum))
    workload = load_workload(args.model)
    trainee = build_trainee(workload, config)
    batches = trial_micro_batches(workload, config, trainee.device)
    for _ in range(2):  # warm-up: the optimizer state and the allocator's pools
        time_steps(trainee, batches, config, 1)
    print(f"torch {torch.__version__}, {cpus_available()} CPUs, starved above {STARVED_WAIT_SHARE:.0%} waiting")
    quiet, _ = _run(trainee, batches, config, args.steps, "quiet")
    hogs = [multiprocessing.get_context("fork").Process(target=_spin, args=(600.0,)) for _ in range(args.hogs)]
    for h in hogs:
        h.start()
    try:
        time.sleep(0.5)
        loaded, less_wait = _run(trainee, batches, config, args.steps, f"with {args.hogs} busy process(es)")
    finally:
        for h in hogs:
            h.terminate()
            h.join()
    print(f"median step loaded / quiet: {statistics.median(loaded) / statistics.median(quiet):.2f}x; "
          f"best loaded / quiet: {min(loaded) / min(quiet):.2f}x; "
          f"best loaded less its wait / quiet: {min(less_wait) / min(quiet):.2f}x")


if __name__ == "__main__":
    main()

"""Does the machine's own speed drift between trials, where no run-queue wait shows it?

Runs two configs' trials alternately for ``--seconds``, each between two timings of a fixed matmul
(the *canary*: the same work every time, so its time is the machine's speed at that moment), then
prints per config the trials' spread (coefficient of variation), the correlation between a trial's
throughput and the canary's speed, and the spread left once each trial is scaled by its canary.
A strong correlation means trials differ because the machine did, not the config: ranking by the
best sample then favours the config that happened to run in a fast spell. Last, over all trials, the
correlation between a trial's own step-to-step spread (``step_spread``) and its throughput over its
config's best: near zero means a slow trial's steps were evenly slow, and its spread cannot tell it.

    python scripts/machine_drift.py [--model gpt-tiny] [--seconds 300]

Run it alone on the machine; trials run with the OpenMP wait policy a search's trials have
(``PASSIVE`` unless the environment sets ``OMP_WAIT_POLICY``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from autofit.core.config import TrainConfig
from autofit.runtime.schedule import DEFAULT_SCHEDULE
from autofit.trial.run import run_trial

CONFIGS = ("precision=amp-bf16,micro_batch=8,grad_accum=8", "precision=bf16,micro_batch=16,grad_accum=4")


def canary_s(size: int = 384, repeats: int = 20, rounds: int = 5) -> float:
    """The fastest of ``rounds`` timings of ``repeats`` fp32 ``size`` x ``size`` matmuls."""
    x = torch.randn(size, size)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(repeats):
            x @ x
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--seconds", type=float, default=300)
    args = parser.parse_args()
    configs = [TrainConfig.parse(c) for c in CONFIGS]
    rows: dict[TrainConfig, list[tuple[float, float, float]]] = {c: [] for c in configs}
    started = time.monotonic()
    while time.monotonic() - started < args.seconds:
        for config in configs:
            before = canary_s()
            result = run_trial(args.model, config, device="cpu", timeout_s=300, schedule=DEFAULT_SCHEDULE)
            canary = (before + canary_s()) / 2
            rows[config].append((result.samples_per_s or float("nan"), canary,
                                 float("nan") if result.step_spread is None else result.step_spread))
            print(f"{config.short()}: {result.samples_per_s or 0:.1f} samples/s, canary {1e3 * canary:.1f} ms",
                  flush=True)
    shortfall, spreads = [], []
    for config, samples in rows.items():
        throughput, canary, spread = (np.array(v) for v in zip(*samples))
        cv = lambda v: 100 * v.std() / v.mean()
        print(f"{config.short()}: {len(samples)} trials, spread (cv) {cv(throughput):.1f}%, correlation with the "
              f"canary's speed {np.corrcoef(throughput, 1 / canary)[0, 1]:.2f}, spread scaled by the canary "
              f"{cv(throughput * canary):.1f}%")
        shortfall += list(throughput / np.nanmax(throughput))
        spreads += list(spread)
    shortfall, spreads = np.array(shortfall), np.array(spreads)
    known = ~np.isnan(shortfall) & ~np.isnan(spreads)
    print(f"all trials: step spread median {100 * np.median(spreads[known]):.1f}%, max {100 * spreads[known].max():.1f}%; "
          f"correlation between a trial's step spread and its throughput over its config's best "
          f"{np.corrcoef(spreads[known], shortfall[known])[0, 1]:.2f} ({known.sum()} trials)")


if __name__ == "__main__":
    main()

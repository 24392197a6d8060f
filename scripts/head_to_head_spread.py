"""How steady is the ratio of two configs' throughput, timed in trials of their own or head to head?

Alternates, for ``--seconds``, a round of separate trials (A, then B, each in its own process as a
search's first trials run) with a head-to-head of A and B (one process, steps interleaved, as a
search times its leaders: autofit.trial.head_to_head). Prints, per method, the ratio B/A of each
round and its spread (coefficient of variation, and largest over smallest): the method whose ratio
spreads less tells two close configs apart more reliably.

    python scripts/head_to_head_spread.py [--model gpt-tiny] [--seconds 240] [--configs A B]

Run it alone on the machine; trials run with the OpenMP wait policy a search's trials have
(``PASSIVE`` unless the environment sets ``OMP_WAIT_POLICY``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from autofit.core.config import TrainConfig
from autofit.runtime.schedule import DEFAULT_SCHEDULE
from autofit.trial.run import run_head_to_head, run_trial

CONFIGS = ("precision=bf16,micro_batch=16,grad_accum=4", "precision=bf16,micro_batch=4,grad_accum=16")


def _spread(ratios: list[float]) -> str:
    r = np.array(ratios)
    return (f"{len(r)} rounds, ratio median {np.median(r):.3f}, cv {100 * r.std() / r.mean():.1f}%, "
            f"range {r.min():.3f}-{r.max():.3f} (largest/smallest {r.max() / r.min():.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--seconds", type=float, default=240)
    parser.add_argument("--configs", nargs=2, default=CONFIGS)
    args = parser.parse_args()
    a, b = (TrainConfig.parse(c) for c in args.configs)
    separate: list[float] = []
    together: list[float] = []
    started = time.monotonic()
    while time.monotonic() - started < args.seconds:
        ra, rb = (run_trial(args.model, c, device="cpu", timeout_s=300, schedule=DEFAULT_SCHEDULE) for c in (a, b))
        ha, hb = run_head_to_head(args.model, [a, b], device="cpu", timeout_s=600, schedule=DEFAULT_SCHEDULE)
        if ra.ok and rb.ok:
            separate.append(rb.samples_per_s / ra.samples_per_s)
        if ha.ok and hb.ok:
            together.append(hb.samples_per_s / ha.samples_per_s)
        print(f"separate: {a.short()} {ra.samples_per_s or 0:.1f}, {b.short()} {rb.samples_per_s or 0:.1f}; "
              f"head to head: {ha.samples_per_s or 0:.1f}, {hb.samples_per_s or 0:.1f}", flush=True)
    print(f"B/A = {b.short()} over {a.short()}")
    print(f"separate trials: {_spread(separate)}")
    print(f"head to head:    {_spread(together)}")


if __name__ == "__main__":
    main()

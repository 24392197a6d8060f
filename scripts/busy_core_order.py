#!/usr/bin/env python
"""Beside a busy core, does the search's own reading order its leaders as a quiet machine does?

Runs the steady suite's busy-core search (``autofit search`` of its model at its budget, beside a busy
loop holding one core: :mod:`autofit.bench.steady`) ``--runs`` times and reads every sample whose timed
steps all waited for a CPU. Prints, for each config with two or more such samples, the spread of their
longest waits (``max_wait_share``: largest less smallest), its quantiles over all runs, and, where the
search timed leaders head to head (one process, steps interleaved: versions before the search measured
each leader in trials of its own, as results/benchmarks/busy_core_order.txt was made), each head-to-head's
members: their waits, readings and reaches (reading / (1 - wait), :func:`autofit.core.records.reach`).
docs/facts.md#run-queue-wait reads it.

    python scripts/busy_core_order.py [--runs 3] > results/benchmarks/busy_core_order.txt

Run it alone on the machine; each search takes one to two minutes on gpt-tiny.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def starved_rows(table):
    """The ok samples whose every timed step waited for a CPU."""
    ok = table[(table["status"] == "ok") & table["max_wait_share"].notna()]
    return ok[ok["starved_steps"] == ok["timed_steps"]]


def spreads(rows) -> list[float]:
    """Per config (precision, micro-batch, accumulation, checkpointing) with two or more starved samples:
    the largest wait share less the smallest."""
    keys = ["precision", "micro_batch", "grad_accum", "checkpoint_every"]
    return [float(g["max_wait_share"].max() - g["max_wait_share"].min())
            for _, g in rows.groupby(keys) if len(g) > 1]


def main(argv: list[str] | None = None) -> int:
    import autofit
    from autofit.bench.steady import BUSY_BUDGET, MODEL, BusyCore

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    found: list[float] = []
    for run in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory(prefix="autofit-wait-") as tmp, BusyCore():
            res = autofit.search(MODEL, BUSY_BUDGET, out=Path(tmp) / "study", device="cpu", progress=False)
        rows = starved_rows(res.table)
        mine = spreads(rows)
        found += mine
        print(f"run {run}: answer {res.best.short() if res.best else None}; {len(rows)} starved samples; "
              f"wait-share spreads within a config: {', '.join(f'{s:.3f}' for s in mine) or 'none'}", flush=True)
        for h2h, g in rows[rows["head_to_head"].notna()].groupby("head_to_head"):
            members = "; ".join(f"mb={int(r.micro_batch)} ga={int(r.grad_accum)} {r.precision}: wait "
                                f"{r.max_wait_share:.3f}, {r.objective:.2f} read, "
                                f"{r.objective / (1 - r.max_wait_share):.2f} reach" for r in g.itertuples())
            print(f"  head-to-head {int(h2h)}: {members}", flush=True)
    if found:
        q = np.quantile(found, [0.5, 0.9, 1.0])
        print(f"{len(found)} configs with two or more starved samples over {args.runs} runs: wait-share spread "
              f"median {q[0]:.3f}, 90th percentile {q[1]:.3f}, max {q[2]:.3f}")
    else:
        print("no config had two starved samples: nothing to report (was the machine idle enough to starve?)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

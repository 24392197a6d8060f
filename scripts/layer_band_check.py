"""How well the layer-timed prior ranks a grid's configs, quiet and beside a duty-cycled busy loop, per noise band.

Times the workload's first layer ``--runs`` times (:func:`autofit.probes.layer_timing.measure_layer_timings`,
no cache), quietly or (``--load``) beside a process that spins 0.4 s of every second: a load that comes and
goes, as a browser's or a build's does. Each timing rescales the time model's prior
(:func:`autofit.estimator.layer_prior.layer_scales`) under each band of ``--bands``
(:data:`autofit.estimator.layer_prior.FIXED_NOISE_BANDS`: 0 trusts the measured fixed part as it is), and
the prior's predicted throughput of every single-device config of the workload in the committed grid is
ranked against the grid's measured throughput (Spearman's rank correlation: 1 is the grid's own order).

    OMP_WAIT_POLICY=PASSIVE python scripts/layer_band_check.py --model gpt-mini+seq_len=512 --load

Run it alone on the machine (besides the busy loop it starts itself).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import subprocess
import sys

import numpy as np
import pandas as pd

from autofit.core.config import Precision, TrainConfig
from autofit.estimator import layer_prior
from autofit.estimator.time_model import op_counts, predict_table
from autofit.probes.device_rates import probe_rates
from autofit.probes.layer_timing import LayerTimings, measure_layer_timings
from autofit.profiling.profile import profile_workload
from autofit.workloads.load import load_workload

GRID = "results/benchmarks/search_grid.csv"
_BUSY = "import time\nwhile True:\n    t = time.time()\n    while time.time() - t < 0.4: pass\n    time.sleep(0.6)"


def grid_rows(grid: pd.DataFrame, workload: str) -> pd.DataFrame:
    """The workload's configs that ran ok on one device with the lever defaults (what the prior ranks)."""
    keep = ((grid.workload == workload) & (grid.status == "ok") & (grid.device_split == 1)
            & (grid.optimizer == "as-given") & (grid.checkpoint_policy == "full") & (grid.offload == "none"))
    return grid[keep]


def rank_correlation(predicted, measured) -> float:
    """Spearman's rank correlation (Pearson's on the ranks; no scipy needed)."""
    return float(pd.Series(predicted).rank().corr(pd.Series(measured).rank()))


def score(profile, rates, counts, rows: pd.DataFrame, timings: LayerTimings, bands: float) -> float:
    """The rank correlation of the prior rescaled by ``timings`` under ``bands`` with the grid's throughputs."""
    configs = [TrainConfig(precision=Precision(r.precision), micro_batch=int(r.micro_batch),
                           grad_accum=int(r.grad_accum), checkpoint_every=int(r.checkpoint_every))
               for r in rows.itertuples()]
    scales = layer_prior.layer_scales(profile, rates, counts, timings.seconds, timings.spread_s, bands)
    scaled = dataclasses.replace(counts, layer_scales=tuple((p, c, f) for p, (c, f) in scales.items()))
    return rank_correlation(predict_table(profile, configs, rates, scaled)["samples_per_s"].to_numpy(),
                            rows.samples_per_s.to_numpy())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-mini+seq_len=512")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--load", action="store_true", help="beside a busy loop spinning 0.4 s of every second")
    parser.add_argument("--bands", default="0,1,2")
    parser.add_argument("--grid", default=GRID)
    args = parser.parse_args()
    rows = grid_rows(pd.read_csv(args.grid), args.model)
    if rows.empty:
        sys.exit(f"{args.grid} has no single-device configs of {args.model}")
    workload = load_workload(args.model)
    precisions = sorted(set(rows.precision))
    profile = profile_workload(workload, precisions)
    rates = probe_rates("cpu", precisions=precisions)
    counts = op_counts(workload)
    busy = subprocess.Popen([sys.executable, "-c", _BUSY]) if args.load else None
    try:
        runs = [measure_layer_timings(workload.source, precisions, "cpu", use_cache=False, key=profile.key)
                for _ in range(args.runs)]
    finally:
        if busy is not None:
            with contextlib.suppress(OSError):
                busy.kill()
    runs = [t for t in runs if t is not None]
    print(f"{args.model}, {'beside a duty-cycled busy loop' if args.load else 'quiet'}: {len(runs)} layer timings, "
          f"{len(rows)} grid configs")
    for bands in (float(b) for b in args.bands.split(",")):
        rho = [score(profile, rates, counts, rows, t, bands) for t in runs]
        print(f"  band {bands:g}: rank correlation {np.min(rho):.2f}-{np.max(rho):.2f} (median {np.median(rho):.2f})")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Measure the search suite's grid on a GPU and replay every strategy on it there.

The committed search grids were measured on a CPU, where a trial costs little besides its steps.
This measures a grid on CUDA the way ``autofit bench`` measures one on the CPU
(:func:`autofit.bench.search_grid.measure_grid`: every config run for real by autofit's own trial
runner, no budget, then more throughput samples of each config until its two best agree within 2%),
for GPT-2 (``gpt2``, 124M parameters) and a Llama-style ``hf:`` model with grouped-query attention
(8 layers, d=512, 8 heads over 2 key/value heads, 55M parameters), both at 256 tokens, over
amp-bf16 and bf16 x micro-batches 4-16 at global batch 16 x checkpointing off and every layer.
A config's peak is what the card held (reserved + the CUDA context: what a budget is checked against).

The budgets are chosen from the grid once measured, the same way for both models: the card peaks at the
1/3 and 2/3 quantiles of the configs that ran, so that each budget cuts away part of the grid. Then
every strategy of the suite (autofit as shipped, Optuna TPE, the batch-size finders and their
per-precision sweeps) is replayed on each cell, one seed, and ``search_cells.csv`` and
``search_replay.md`` are written beside the grid. autofit's search in that replay estimates and probes
for CUDA on the device itself, so replaying it again needs a CUDA build of PyTorch; the peers' replays
need none (``python -m autofit.bench.replay GRID --strategy optuna-tpe``).

On the GPU machine, from the repository root (optuna carried as wheels, see scripts/gpu_check.py)::

    PYTHONUNBUFFERED=1 python3 scripts/gpu_grid.py --out "$OUT/grid" --time-limit 300

``--device cpu --quick`` runs the plumbing on a CPU with one tiny cell (the unit test does that).
Writes ``search_grid.csv``, ``search.md`` (each grid's heading: its costs, which the replay reads back),
``search_cells.csv`` and ``search_replay.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autofit.bench.search_data import Cell, Grid, MiB  # noqa: E402
from autofit.core.config import Precision  # noqa: E402
from autofit.core.records import TrialStatus  # noqa: E402

# fp32 and micro-batch 2 are left out to fit a short loan: in a first run on an H200 (stopped before its truth
# samples), gpt2's fp32 step gave about a third of bf16's throughput at micro-batches 8 and 16 (182 vs 511 and
# 197 vs 614 samples/s), and micro-batch 2 was the slowest of each precision but fp32's.
_TWO = (Precision.AMP_BF16, Precision.BF16)
LLAMA = ("hf:llama?num_hidden_layers=8&hidden_size=512&intermediate_size=1408&num_attention_heads=8"
         "&num_key_value_heads=2&vocab_size=32000#seq_len=256")
# A budget no config reaches while the grid is measured (every config that runs gets its truth samples);
# the cell's real budgets come from the measured grid (budgets_from).
UNBOUNDED_MIB = 1 << 30


def cells(device: str, quick: bool) -> list[Cell]:
    if quick:
        return [Cell("gpt-tiny", 4, (1, 2, 4), (Precision.FP32,), (UNBOUNDED_MIB,), device=device)]
    return [Cell(spec, 16, (4, 8, 16), _TWO, (UNBOUNDED_MIB,), device=device) for spec in ("gpt2+seq_len=256", LLAMA)]


def budgets_from(grid: Grid) -> tuple[int, ...]:
    """The card peaks (MiB, rounded down) at the 1/3 and 2/3 quantiles of the configs that ran."""
    peaks = sorted(p.peak_bytes for p in grid.points.values() if p.status is TrialStatus.OK and p.peak_bytes)
    if not peaks:
        return ()
    picks = {peaks[min(len(peaks) - 1, (len(peaks) * k) // 3)] // MiB for k in (1, 2)}
    return tuple(sorted(picks))


def write_grids(out: Path, grids: list[Grid]) -> Path:
    from autofit.bench.common import Report, environment
    from autofit.bench.search_tables import _grid_rows, _grid_section
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    csv = out / "search_grid.csv"
    pd.DataFrame(_grid_rows(grids)).to_csv(csv, index=False)
    rep = Report("Search grids measured on a GPU", environment(" ".join(sys.argv)), generator="scripts/gpu_grid.py")
    for g in grids:
        rep.add(_grid_section(g) + f"\n\nBudgets (the 1/3 and 2/3 quantiles of the card peaks): "
                + ", ".join(f"{b} MiB" for b in g.cell.budgets_mib))
    rep.write(out / "search.md")
    return csv


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--out", type=Path, default=ROOT / "results/benchmarks/gpu/grid")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="one tiny cell (the CPU plumbing test)")
    parser.add_argument("--time-limit", type=float, default=300.0,
                        help="seconds: no further cell is measured after this (default %(default)s)")
    args = parser.parse_args(argv)
    from autofit.bench.own_search import STRATEGIES
    from autofit.bench.replay import load_grids, replay, write_replay
    from autofit.bench.search_grid import measure_grid

    started = time.monotonic()
    grids: list[Grid] = []
    for cell in cells(args.device, args.quick):
        if grids and time.monotonic() - started > args.time_limit / 2:
            print(f"skipped {cell.workload}: half the time limit is spent", flush=True)
            continue
        grid = measure_grid(cell, progress=lambda m: print(m, flush=True),
                            samples_until=started + args.time_limit * 0.6)
        grid.cell = dataclasses.replace(cell, budgets_mib=budgets_from(grid))
        grids.append(grid)
        csv = write_grids(args.out, grids)
        print(f"wrote {csv} ({time.monotonic() - started:.0f} s)", flush=True)
    grids = [g for g in load_grids(csv) if g.cell.budgets_mib]  # as a later replay reads them
    runs = replay(grids, STRATEGIES, seeds=1)
    for path in write_replay(args.out, csv, grids, runs, STRATEGIES, "python scripts/gpu_grid.py"):
        print(f"wrote {path}", flush=True)
    print(f"done in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

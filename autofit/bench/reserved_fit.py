"""Fit the CUDA card's use beyond the tensors on the committed H200 measurements, and check it held out.

``python -m autofit.bench.reserved_fit`` reads ``results/benchmarks/gpu/run3-h200-a.csv`` and
``run4-h200-a.csv`` (``scripts/gpu_check.py``'s part a: autofit's estimate and what the card held,
per config), fits :mod:`autofit.estimator.reserved_model`'s terms on some workloads' rows, checks
them on the other workloads' rows, and writes ``results/benchmarks/gpu/reserved_model.md``.
``tests/bench/test_reserved_fit.py`` checks that the constants the estimate uses are this fit's.

Runs 1 and 2 are left out: their part a ran every config of a workload in one process without
freeing the allocator's cache in between (results/benchmarks/gpu/README.md).

Each row gives the tensors' peak the estimate predicted (``T``: its ``predicted_allocated_bytes``
less the workspace), the context and workspace the device probe measured (the estimate's other
terms) and the card's use (``max_memory_reserved`` + the trial's own context). The fit is of
``card − (probe context + workspace + T)`` on ``[1, T, T·checkpointed]`` by least squares, then a
margin in bytes that puts the estimate at or above the card in at least 95% of the fitted rows.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from autofit.estimator.reserved_model import FITTED, ReservedModel

GPU_DIR = Path(__file__).resolve().parents[2] / "results" / "benchmarks" / "gpu"
RUNS = ("run3-h200-a", "run4-h200-a")
# The fit sees autofit's own GPTs; the check is on models of other code it never saw: a GPT-2 built
# by transformers and a convolutional network.
FIT_WORKLOADS = ("gpt-mini", "gpt-tiny")
COVERAGE = 0.95  # the share of configs the estimate must be at or above the card for
# The runs' estimate: tensors + workspace + this share of the tensors + the probe's context.
RUN_FRAGMENTATION = 0.10
MiB = 2**20


def _probe_workspace_bytes(md_text: str) -> int:
    """The device probe's cuBLAS workspace, as the run's table header states it (whole MiB)."""
    found = re.search(r"cuBLAS workspace ([\d,]+) MiB measured", md_text)
    if not found:
        raise ValueError("the run's header names no measured cuBLAS workspace")
    return int(found.group(1).replace(",", "")) * MiB


def load_rows(gpu_dir: Path = GPU_DIR) -> pd.DataFrame:
    """The ok accuracy rows of :data:`RUNS`: workload, config, tensor_bytes, checkpointed,
    probe_bytes (the probe's context + workspace), card_bytes and the runs' own error_card."""
    frames = []
    for run in RUNS:
        rows = pd.read_csv(gpu_dir / f"{run}.csv")
        rows = rows[(rows.part == "a") & (rows.status == "ok")].copy()
        workspace = _probe_workspace_bytes((gpu_dir / f"{run}.md").read_text())
        tensors = rows.predicted_allocated_bytes - workspace
        # The run's estimate was probe context + workspace + tensors · (1 + RUN_FRAGMENTATION).
        context = rows.predicted_bytes - workspace - tensors * (1 + RUN_FRAGMENTATION)
        frames.append(pd.DataFrame({
            "run": run, "workload": rows.workload, "config": rows.config, "repeat": rows.repeat.astype(bool),
            "tensor_bytes": tensors.astype(float), "checkpointed": rows.config.str.contains("checkpoint_every="),
            "probe_bytes": (context + workspace).astype(float), "card_bytes": rows.card_bytes.astype(float),
            "run_error": rows.error_card.astype(float),
            "context_growth_bytes": (rows.context_bytes - context).astype(float),
        }))
    return pd.concat(frames, ignore_index=True)


def predict(model: ReservedModel, rows: pd.DataFrame, margin: bool = True) -> np.ndarray:
    """The estimate of the card's use under ``model`` (without its margin when ``margin`` is False)."""
    extra = np.where(rows.checkpointed, model.extra_bytes(rows.tensor_bytes, True),
                     model.extra_bytes(rows.tensor_bytes, False))
    return rows.probe_bytes.to_numpy() + rows.tensor_bytes.to_numpy() + extra - (0 if margin else model.margin_bytes)


def fit(rows: pd.DataFrame) -> ReservedModel:
    """Least-squares terms (whole MiB, shares to 0.001), then the smallest margin in whole MiB that puts
    the estimate at or above the card for :data:`COVERAGE` of ``rows``."""
    t = rows.tensor_bytes.to_numpy()
    x = np.c_[np.ones(len(rows)), t, t * rows.checkpointed.to_numpy()]
    y = rows.card_bytes.to_numpy() - rows.probe_bytes.to_numpy() - t
    fixed, share, ckpt_share = np.linalg.lstsq(x, y, rcond=None)[0]
    # A negative term would say the allocator gives bytes back: held at none.
    centre = ReservedModel(max(0, round(fixed / MiB)) * MiB, round(max(share, 0.0), 3), round(max(ckpt_share, 0.0), 3), 0)
    short = np.sort(rows.card_bytes.to_numpy() - predict(centre, rows))  # > 0: under the card
    need = math.ceil(COVERAGE * len(rows))
    margin = max(0, math.ceil(short[need - 1] / MiB)) * MiB
    return ReservedModel(centre.fixed_bytes, centre.fragmentation, centre.checkpoint_fragmentation, margin)


def scores(predicted: np.ndarray, rows: pd.DataFrame) -> dict:
    err = (predicted - rows.card_bytes.to_numpy()) / rows.card_bytes.to_numpy()
    return _score(err)


def _score(err) -> dict:
    err = np.asarray(err, dtype=float)
    return {"rows": len(err), "median_abs": float(np.median(np.abs(err))), "max_abs": float(np.max(np.abs(err))),
            "under": int((err < 0).sum())}


def _line(label: str, s: dict) -> str:
    return (f"| {label} | {s['rows']} | {s['median_abs']:.2%} | {s['max_abs']:.2%} | {s['under']} "
            f"({s['under'] / s['rows']:.0%}) |")


def _model_line(m: ReservedModel) -> str:
    return (f"fixed {m.fixed_bytes / MiB:.0f} MiB, fragmentation {m.fragmentation:.3f} of the tensors' peak, "
            f"checkpointed +{m.checkpoint_fragmentation:.3f}, margin {m.margin_bytes / MiB:.0f} MiB")


def report(rows: pd.DataFrame) -> tuple[ReservedModel, str]:
    """The fit on :data:`FIT_WORKLOADS`' rows and the Markdown of its check."""
    fitted = rows.workload.isin(FIT_WORKLOADS)
    train, held = rows[fitted], rows[~fitted]
    model = fit(train)
    out = [
        "# CUDA memory as the card sees it: the reserved-memory model, fitted and checked held out", "",
        "Written by `python -m autofit.bench.reserved_fit` from "
        + ", ".join(f"[{r}.csv]({r}.csv)" for r in RUNS)
        + " (`scripts/gpu_check.py` part a on one H200, torch 2.11; runs 1 and 2 left out: their part a "
        "did not free the allocator's cache between configs). Each row: the tensors' peak the estimate "
        "predicted, the context and cuBLAS workspace the device probe measured, and what the card held "
        "(`max_memory_reserved` + the trial's context). Error = (estimate − card) / card; negative is under.", "",
        (f"Fitted on {', '.join(FIT_WORKLOADS)} ({len(train)} rows), by least squares of the card's use "
         "beyond probe context + workspace + tensors on [1, tensors, tensors × checkpointed], then the "
         f"smallest margin that puts the estimate at or above the card in {COVERAGE:.0%} of those rows:"), "",
        f"**{_model_line(model)}** (`autofit/estimator/reserved_model.py`).", "",
        f"Held out: {', '.join(sorted(set(held.workload)))} ({len(held)} rows), models the fit never saw.", "",
        "| rows | configs | median abs error | max abs error | under the card |", "|---|---|---|---|---|",
        _line("held out, fit + margin (what the estimate uses)", scores(predict(model, held), held)),
        _line("held out, fit without the margin", scores(predict(model, held, margin=False), held)),
        _line("held out, the runs' estimate (10% fragmentation)", _score(held.run_error)),
        _line("fitted rows, fit + margin", scores(predict(model, train), train)),
        _line("fitted rows, fit without the margin", scores(predict(model, train, margin=False), train)),
        _line("fitted rows, the runs' estimate (10% fragmentation)", _score(train.run_error)),
        _line("all rows, fit + margin", scores(predict(model, rows), rows)),
        _line("all rows, the runs' estimate (10% fragmentation)", _score(rows.run_error)), "",
        "Each workload held out in turn (fit + margin on the other three, checked on it):", "",
        "| held out | terms fitted on the other three | median abs error | max abs error | under the card |",
        "|---|---|---|---|---|",
    ]
    for name in sorted(set(rows.workload)):
        one = rows.workload == name
        m = fit(rows[~one])
        s = scores(predict(m, rows[one]), rows[one])
        out.append(f"| {name} | {_model_line(m)} | {s['median_abs']:.2%} | {s['max_abs']:.2%} | "
                   f"{s['under']} of {s['rows']} |")
    out += ["", "Per row (the estimate of the fit + margin):", "",
            "| workload | config | fitted | tensors | card | estimate | error | runs' error |", "|---|---|---|---|---|---|---|---|"]
    estimate = predict(model, rows)
    for i, r in enumerate(rows.itertuples()):
        err = (estimate[i] - r.card_bytes) / r.card_bytes
        out.append(f"| {r.workload} | `{r.config}`{' (repeat)' if r.repeat else ''} | "
                   f"{'yes' if r.workload in FIT_WORKLOADS else 'no'} | {r.tensor_bytes / MiB:,.0f} MiB | "
                   f"{r.card_bytes / MiB:,.0f} MiB | {estimate[i] / MiB:,.0f} MiB | {err:+.2%} | {r.run_error:+.2%} |")
    growth_mib = (round(rows.context_growth_bytes.min() / MiB), round(rows.context_growth_bytes.max() / MiB))
    out += ["", (f"Tensor peaks measured here span {rows.tensor_bytes.min() / MiB:,.0f}–"
                 f"{rows.tensor_bytes.max() / MiB:,.0f} MiB (the trials' contexts {growth_mib[0]:+d} to "
                 f"{growth_mib[1]:+d} MiB beside the probe's) and every checkpointed row checkpoints every "
                 "layer: larger steps and sparser checkpointing are extrapolated."), ""]
    return model, "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    model, text = report(load_rows())
    (GPU_DIR / "reserved_model.md").write_text(text)
    print(_model_line(model))
    if model != FITTED:
        print(f"autofit/estimator/reserved_model.py holds {_model_line(FITTED)}: update it to the fit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

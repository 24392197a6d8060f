"""``autofit search``: the fastest config under a memory budget, from estimates and real trials."""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys

from autofit.api.run_study import search
from autofit.cli._args import (
    BUDGET_HELP,
    MODEL_HELP,
    add_hf_options,
    model_spec,
    positive,
)
from autofit.core.budget import format_budget, format_bytes
from autofit.report.exports import TARGETS
from autofit.report.tables import RAN, duration_text, figure_basis, load_warning
from autofit.study import PATIENCE, TRIAL_TIMEOUT_S, ProgressPrinter
from autofit.workloads import DEFAULT_WORKLOAD


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "search", help="find the fastest config under a memory budget (estimates, then real trials)",
        description="Search a space of configs for the highest measured throughput whose measured peak fits the "
                    "budget. The estimate prunes what cannot or should not run; survivors run as short real trials "
                    "in isolated processes, the most promising first; the search stops when trials stop improving. "
                    "The study lives in --out (default results/<study>): running the same command again resumes it.",
        epilog="Exit status: 0 when a config fits; 1 when no trial ran under the budget; 2 for a usage error; "
               "130 when interrupted (rerun the command to resume).",
    )
    p.add_argument("--budget", required=True, help=BUDGET_HELP)
    p.add_argument("--model", default=DEFAULT_WORKLOAD, help=f"{MODEL_HELP} (default: {DEFAULT_WORKLOAD})")
    add_hf_options(p)
    p.add_argument("--space", help="search-space TOML file or a name in search_spaces/ (default: default)")
    p.add_argument("--global-batch", type=positive(int), help="fix the global batch (grad_accum = global_batch / micro_batch)")
    p.add_argument("--trials", type=positive(int), help="real trials in the study at most (pruned configs are free)")
    p.add_argument("--timeout", type=positive(float), help="seconds after which no new trial starts")
    p.add_argument("--patience", type=positive(int), default=PATIENCE,
                   help=f"stop after this many real trials in a row without a 2%% improvement (default {PATIENCE})")
    p.add_argument("--trial-timeout", type=positive(float), default=TRIAL_TIMEOUT_S,
                   help=f"wall-clock limit of one trial in seconds, process start included (default {TRIAL_TIMEOUT_S:g})")
    p.add_argument("--workers", type=positive(int), default=1, help="local worker processes on the study (default 1)")
    p.add_argument("--storage", help="an Optuna storage URL shared by several machines, e.g. "
                                     "postgresql://user:pass@host/db (default: a journal file in --out)")
    p.add_argument("--study", help="study name (default: <model>-<budget>)")
    p.add_argument("--out", help="output directory for the study and its tables (default: results/<study>)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available, else cpu")
    p.add_argument("--devices", type=positive(int),
                   help="devices per worker; larger device splits are never run (default: 1 on the CPU, "
                        "a worker's share of the GPUs on CUDA). On the CPU, N > 1 runs splits as processes sharing it")
    p.add_argument("--seed", type=int, default=0, help="seed of the planner's tie-breaking (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of a summary")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    command = shlex.join(["autofit", *sys.argv[1:]]) if sys.argv and sys.argv[0] else None
    progress = None if args.json else ProgressPrinter()
    try:
        # A workload file that prints must not spoil --json's stdout.
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            result = search(model_spec(args), args.budget, space=args.space, global_batch=args.global_batch,
                            trials=args.trials, timeout_s=args.timeout, workers=args.workers, storage=args.storage,
                            study_name=args.study, out_dir=args.out, device=args.device, devices=args.devices,
                            seed=args.seed, patience=args.patience, trial_timeout_s=args.trial_timeout,
                            progress=progress, command=command)
    finally:
        if progress is not None:
            progress.close()
    if args.json:
        print(json.dumps({
            "study": result.study_name, "out_dir": str(result.out_dir), "storage": result.storage,
            "workload": result.workload, "device": result.device, "budget_bytes": result.budget_bytes,
            "best": None if result.best is None else result.best.to_dict(), "best_trial": result.best_trial,
            "best_number": result.best_number,
            "best_measured": result.best_measured, "best_predicted": result.best_predicted, "advice": list(result.advice),
            "n_configs": result.n_configs, "n_pruned": result.n_pruned, "pruned_by_reason": result.pruned_by_reason,
            "n_real": result.n_real, "stop_reason": result.stop_reason, "wall_s": result.wall_s,
            "calibration": result.calibration.to_dict(),
        }, indent=2))
        return 0 if result.best is not None else 1
    _summary(result)
    return 0 if result.best is not None else 1


def _summary(result) -> None:
    by_status = result.table[result.table["status"].isin(RAN)]["status"]
    statuses = ", ".join(f"{n} {s}" for s, n in by_status.value_counts().items())
    reasons = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in result.pruned_by_reason.items())
    print(f"study      {result.study_name} ({result.out_dir})")
    print(f"workload   {result.workload} on {result.device}")
    print(f"budget     {format_budget(result.budget_bytes)} per device")
    if result.best is None:
        print("best       none: no trial ran under the budget")
        for i, line in enumerate(result.advice):
            print(f"{'what fits' if i == 0 else '':<10} {line}")
    else:
        m = result.best_measured
        print(f"best       {result.best.short()}   (trial {result.best_trial})")
        predicted = (result.best_predicted or {}).get("peak_bytes")
        print(f"peak       {format_bytes(m['peak_bytes'])} measured of {format_budget(result.budget_bytes)}: "
              f"{100 * m['peak_bytes'] / result.budget_bytes:.1f}%"
              + (f" (predicted {format_bytes(predicted)})" if predicted else ""))
        rate = f"{m['samples_per_s']:,.2f} samples/s"
        if m.get("tokens_per_s"):
            rate += f", {m['tokens_per_s']:,.0f} tokens/s"
        basis = figure_basis(m.get("samples", 1), m.get("median_samples_per_s", 0.0))
        print(f"throughput {rate}; step {m['step_time_s']:.3f} s" + (f" ({basis})" if basis else ""))
        if (loaded := load_warning(m)) is not None:
            print(f"load       {loaded}")
    print(f"pruned     {result.n_pruned} of {result.n_configs} configs by the estimate" + (f" ({reasons})" if reasons else ""))
    print(f"trials     {result.n_real} real" + (f" ({statuses})" if statuses else ""))
    print(f"stopped    {result.stop_reason}")
    print(f"wall time  {duration_text(result.wall_s)}")
    print(f"tables     {result.out_dir}/trials.csv, best.json, summary.md  (autofit report {result.out_dir})")
    print(f"report     {result.out_dir}/report.html (summary, exports, pictures, tables; the pictures also as *.png)")
    if result.best is not None:
        print(f"export     autofit export {result.out_dir} --to {'|'.join(TARGETS)}")

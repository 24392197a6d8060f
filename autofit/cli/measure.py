"""``autofit measure``: run one config for real, in a child process, and report memory and speed."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from autofit.cli._args import (
    BUDGET_HELP,
    MODEL_HELP,
    add_hf_options,
    model_spec,
    positive,
)
from autofit.core.budget import format_budget, format_bytes, parse_budget
from autofit.core.config import TrainConfig
from autofit.core.errors import AutofitError
from autofit.runtime.schedule import MIN_TIMED_STEPS, MeasureSchedule
from autofit.runtime.tracker import CATEGORIES
from autofit.trial.run import TrialResult, run_trial
from autofit.workloads.load import load_workload


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "measure", help="run one config for real: peak memory and throughput",
        description="Train a few real steps of one config in an isolated child process: warm-up steps, then "
                    "peak memory over steady-state steps (CPU: live tensors counted by a tracker; CUDA: the "
                    "caching allocator) and throughput on untracked steps. Over --budget is status oom.",
        epilog="Exit status: 0 when the trial's status is ok; 1 when it is oom, error or timeout; "
               "2 for a usage error.",
    )
    p.add_argument("--model", required=True, help=MODEL_HELP)
    add_hf_options(p)
    p.add_argument("--config", default="", help="k=v,... over the defaults, e.g. precision=amp-bf16,micro_batch=8")
    p.add_argument("--budget", help=BUDGET_HELP + " (default: none)")
    p.add_argument("--steps", type=positive(int), default=3, help="measured steps after the warm-up (default 3)")
    p.add_argument("--timed-steps", type=positive(int),
                   help=f"untracked steps whose median time is the throughput (default: --steps, at least "
                        f"{MIN_TIMED_STEPS}; 1 saves "
                        "minutes where a step takes minutes, e.g. a billion-parameter model on a CPU)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available, else cpu")
    p.add_argument("--timeout", type=positive(float), default=300.0,
                   help="wall-clock limit in seconds for the whole trial, process start included (default 300)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    p.set_defaults(run=run)


def _device(requested: str | None) -> str:
    import torch  # is_available() creates no CUDA context: the trial runs in a child

    available = torch.cuda.is_available()
    if requested == "cuda" and not available:
        raise AutofitError("--device cuda: no CUDA GPU is available to this PyTorch "
                           f"({torch.__version__}); use --device cpu")
    return requested or ("cuda" if available else "cpu")


def run(args: argparse.Namespace) -> int:
    config = TrainConfig.parse(args.config)
    budget_bytes = parse_budget(args.budget) if args.budget is not None else None
    # User errors surface here, as one line, before any child starts. A workload file that
    # prints must not spoil --json's stdout: its output goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        workload = load_workload(model_spec(args))
    device = _device(args.device)
    schedule = MeasureSchedule(measured_steps=args.steps,
                               timed_steps=args.timed_steps or max(MIN_TIMED_STEPS, args.steps))
    result = run_trial(workload, config, device=device, budget_bytes=budget_bytes, schedule=schedule,
                       timeout_s=args.timeout)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        _summary(result)
    return 0 if result.ok else 1


def _decimal(n_bytes: int) -> str:
    """Bytes in powers of 1000 (format_bytes gives powers of 1024), e.g. ``80.2 kB``."""
    value = float(n_bytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            break
        value /= 1000
    return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"


def _summary(result: TrialResult) -> None:
    print(f"workload   {result.workload}")
    print(f"config     {result.config.short()}")
    print(f"device     {result.device}")
    print(f"status     {result.status.value}" + (f": {result.error}" if result.error else ""))
    if result.budget_bytes is not None:
        print(f"budget     {format_budget(result.budget_bytes)} per device")
    if result.ok:
        print()
        for name in CATEGORIES:
            print(f"  {name.removesuffix('_bytes'):<12} {format_bytes(result.breakdown[name]):>12}")
        peak = f"  {'peak':<12} {format_bytes(result.peak_bytes):>12}   = {_decimal(result.peak_bytes)}"
        if result.budget_bytes is not None:
            peak += f", {100 * result.peak_bytes / result.budget_bytes:.1f}% of the budget"
        print(peak)
        if len(result.per_device_peak_bytes) > 1:
            print("  per device   " + ", ".join(format_bytes(b) for b in result.per_device_peak_bytes))
        if result.peak_reserved_bytes is not None:
            print(f"  {'reserved':<12} {format_bytes(result.peak_reserved_bytes):>12}   (CUDA caching allocator)")
        if result.peak_card_bytes is not None:
            card = f"  {'card':<12} {format_bytes(result.peak_card_bytes):>12}   (reserved + context of {format_bytes(result.context_bytes)}"
            if result.budget_bytes is not None:
                card += f"; {100 * result.peak_card_bytes / result.budget_bytes:.1f}% of the budget"
            print(card + ")")
        print()
        rate = f"{result.samples_per_s:,.1f} samples/s"
        if result.tokens_per_s is not None:
            rate += f", {result.tokens_per_s:,.0f} tokens/s"
        print(f"throughput {rate}")
        step = f"step time  {result.step_time_s * 1e3:,.1f} ms"
        if result.micro_step_time_s is not None:
            step += (f" ({result.config.grad_accum} x {result.micro_step_time_s * 1e3:,.1f} ms micro-step"
                     f" + {result.optimizer_step_time_s * 1e3:,.1f} ms optimizer step)")
        print(step)
    print(f"trial      {result.wall_s:.1f} s wall, process start included")
